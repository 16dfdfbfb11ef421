"""How a task turns an input row into the model's prompt; stored in checkpoints and artifacts.

The exporter and the runtime share this, so text a user sends at run time is formatted exactly
as the training data was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


class TextError(ValueError):
    """Input that is not Unicode text (a lone surrogate, what undecodable bytes become in an argument or a JSON
    string's escape): no tokenizer takes it."""


def check_text(text: object, where: str = "the input") -> str:
    """`text` if it is a str that UTF-8 can encode, else TextError naming where and the first bad character."""
    if not isinstance(text, str):
        raise TextError(f"{where} must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise TextError(
            f"{where} is not valid Unicode text: {text[error.start]!r} at character {error.start} is a "
            f"lone surrogate (undecodable bytes, or a JSON \\u escape of half a pair); pass UTF-8 "
            f"text"
        ) from None
    return text


@dataclass(frozen=True)
class PromptFormat:
    instruction_template: str  # user message, with "{source}" where the source text goes
    source_template: str  # builds the source from an input row's fields, e.g. "{dialogue}"
    max_source_tokens: int  # training cut the source to this many tokens; render cuts it too where asked

    def fill_source(self, row: dict, where: str = "input row") -> str:
        """The source text of a JSON row: its "source" field, else the task's fields."""
        if isinstance(row.get("source"), str):
            return check_text(row["source"], f"{where}: the source")
        try:
            return check_text(self.source_template.format(**row), f"{where}: the source")
        except (KeyError, IndexError) as missing:
            raise ValueError(
                f"{where}: lacks field {missing}; this task's rows need "
                f"{self.source_template!r} fields or a 'source' field"
            ) from None

    def overflow(self, tokenizer, source: str, checked: bool = False) -> int:
        """Tokens of the source past max_source_tokens, which render(cut=True) cuts off; checked: the caller ran
        check_text on the source already."""
        ids = tokenizer(source if checked else check_text(source, "the source"), add_special_tokens=False)["input_ids"]
        return max(0, len(ids) - self.max_source_tokens)

    def render(self, tokenizer, source: str, cut: bool = True, checked: bool = False) -> str:
        """Chat-formatted prompt text ending where the assistant's answer starts; `cut`: the source's
        first max_source_tokens only, as training saw it (evaluation and benchmarks), else whole; checked: the
        caller ran check_text on the source already."""
        ids = tokenizer(source if checked else check_text(source, "the source"), add_special_tokens=False)["input_ids"]
        if cut and len(ids) > self.max_source_tokens:
            source = tokenizer.decode(ids[: self.max_source_tokens])
        message = self.instruction_template.replace("{source}", source)
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PromptFormat:
        return cls(**data)
