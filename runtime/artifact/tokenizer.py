"""The artifact's tokenizer without Transformers: the `tokenizers` library for the text <-> ids map and
jinja2 for the chat template, rendered as Transformers renders it (same sandbox, options and
variables), so a prompt gets the ids training saw. The subset of Transformers' tokenizer API the
runtime calls, so the torch backend's Transformers tokenizer and this one are interchangeable.

    <folder>/tokenizer.json          the tokenizers model
    <folder>/tokenizer_config.json   special tokens; chat_template (or chat_template.jinja beside it)

An artifact passes the files' bytes it checked against its manifest (runtime/artifact/format.py), so what is parsed is
what was hashed; a bare folder is read from disk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)  # Transformers' clean_up_tokenization


TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    def __init__(self, folder: Path, files: Mapping[str, bytes] | None = None):
        """files: file name -> bytes, read and checked by the caller (None: read them from `folder`)."""
        from tokenizers import Tokenizer as Model

        folder = Path(folder)
        files = files if files is not None else _read(folder)
        config = json.loads(files["tokenizer_config.json"].decode("utf-8"))
        self.model = Model.from_str(files["tokenizer.json"].decode("utf-8"))
        self.special = {name: _content(config.get(name)) for name in SPECIAL_TOKENS if config.get(name) is not None}
        self.eos_token_id = self.model.token_to_id(self.special["eos_token"]) if "eos_token" in self.special else None
        self.pad_token_id = self.model.token_to_id(self.special["pad_token"]) if "pad_token" in self.special else None
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        template = files.get(TEMPLATE_FILE)
        self.chat_template = template.decode("utf-8") if template is not None else config.get("chat_template")
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.model.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.model.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.model.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.model.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for before, after in CLEANUPS:
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        if self.chat_template is None:
            raise ValueError(
                "the tokenizer has no chat template (tokenizer_config.json's chat_template or "
                "chat_template.jinja): restore the artifact's tokenizer/ folder"
            )
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **self.special
        )
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _read(folder: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", TEMPLATE_FILE)
    return {name: (folder / name).read_bytes() for name in names if name != TEMPLATE_FILE or (folder / name).is_file()}


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else token


def _compile(template: str):
    """Transformers' environment for chat templates: sandboxed, trim_blocks and lstrip_blocks, loop
    controls, and its raise_exception, tojson and strftime_now."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return environment.from_string(template)
