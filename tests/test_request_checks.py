"""Each check of a request has one home (runtime/request/checks.py, or the one module a message lives in), every entry
reaches it, and it runs once on each entry's path: the generate CLI, Model.generate and the server's parse and
admission (without HTTP), on the tiny checkpoint (torch)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

import streamfuse
from streamfuse.runtime.artifact import prompt
from streamfuse.runtime.commands import errors, generate
from streamfuse.runtime.request import api
from streamfuse.runtime.request import checks as request
from streamfuse.runtime.request.emitter import StopRules

ROOT = Path(__file__).resolve().parents[1]

# check -> its one home -> bad input at each entry (None: the entry cannot state it) -> the message (a distinctive
# part, found in exactly one source file: the home's). An entry's input: CLI flags after --artifact; Model.generate's
# arguments; the server's JSON body.
CHECKS = {
    "prompt ids: at least one": (
        request.check_prompt_ids,
        None,  # a --prompt always renders to a chat template's tokens
        {"prompt": []},
        None,  # a JSON prompt is text: the server's own "'prompt' must be a non-empty string" first
        "the prompt is empty: give at least one token",
    ),
    "prompt ids: in the vocabulary": (
        request.check_prompt_ids,
        None,
        {"prompt": [5, 1_000_000]},
        None,
        "are outside the vocabulary",
    ),
    "prompt text": (
        prompt.check_text,
        ["--prompt", "the \udcff water"],
        {"prompt": "the \udcff water"},
        {"prompt": "the \udcff water"},
        "is not valid Unicode text",
    ),
    "request fields": (
        StopRules.__post_init__,
        ["--prompt", "x", "--max-new-tokens", "0"],
        {"prompt": "x", "max_new_tokens": 0},
        {"prompt": "x", "max_tokens": 0},
        "max_new_tokens must be > 0",
    ),
    "method available": (
        request.check_method,
        ["--prompt", "x", "--method", "sd"],
        {"prompt": "x", "method": "sd"},
        {"prompt": "x", "method": "sd"},
        "is not available for this model",
    ),
    "task": (
        request.check_task,
        ["--prompt", "x", "--task", "e2e_nlg"],
        None,  # Model.generate and the server name no task: the loaded artifact's
        None,
        "use that task name or drop",
    ),
    "fits in the context": (
        request.check_fits,
        ["--prompt", "x", "--max-new-tokens", "100000"],
        {"prompt": "x", "max_new_tokens": 100_000},
        {"prompt": "x", "max_tokens": 100_000},
        "exceeds the model's context",
    ),
}


@pytest.fixture(scope="module")
def model(checkpoint):
    return streamfuse.load(checkpoint / "ckpt", backend="torch")


def server_parse(model, body: dict, chat: bool = False):
    from streamfuse.apps.request_body import Limits, parse

    return parse(model, body, chat, "tiny", Limits())


def sources_with(fragment: str) -> list[str]:
    """The package's non-test Python files that hold `fragment`."""
    tops = [p for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in ("tests", "shared", "build")]
    files = [p for top in tops for p in ([top] if top.suffix == ".py" else top.rglob("*.py") if top.is_dir() else [])]
    return sorted(p.relative_to(ROOT).as_posix() for p in files if fragment in p.read_text("utf-8", errors="replace"))


@pytest.mark.parametrize("name", CHECKS)
def test_a_check_has_one_home(name):
    home, *_, fragment = CHECKS[name]
    assert fragment in inspect.getsource(home), f"{name}: {home.__qualname__} does not say {fragment!r}"
    where = Path(inspect.getsourcefile(home)).resolve().relative_to(ROOT).as_posix()
    assert sources_with(fragment) == [where], f"{name}: {fragment!r} has a second copy"


@pytest.mark.parametrize("name", CHECKS)
def test_every_entry_raises_the_home_message(name, model, checkpoint, capsys):
    _, cli, api, body, fragment = CHECKS[name]
    if cli is not None:
        assert errors.run(generate.main, ["--artifact", str(checkpoint / "ckpt"), *cli], prog="generate") != 0
        assert fragment in capsys.readouterr().err
    if api is not None:
        with pytest.raises(ValueError, match=fragment):
            model.generate(**api)
    if body is not None:
        with pytest.raises(ValueError, match=fragment):
            server_parse(model, body)


def test_a_chat_message_is_checked_by_the_api_only(model):
    """A conversation's roles and text: runtime/request/api.py's checked_messages, for Model.chat and the server
    alike."""
    fragment = "needs a role among"
    assert fragment in inspect.getsource(api.checked_messages) and sources_with(fragment) == ["runtime/request/api.py"]
    bad = [{"role": "bot", "content": "x"}]
    with pytest.raises(ValueError, match=fragment):
        model.chat(bad)
    with pytest.raises(ValueError, match=fragment):
        server_parse(model, {"messages": bad}, chat=True)


# --- each check runs once on a path ------------------------------------------------------------------

COUNTED = {
    "DecodeRequest.check": None,  # the class's method, counted below
    "decode_settings": request.decode_settings,
    "check_method": request.check_method,
    "check_task": request.check_task,
    "check_prompt_format": request.check_prompt_format,
    "check_fits": request.check_fits,
    "check_prompt_ids": request.check_prompt_ids,
    "checked_messages": api.checked_messages,
}
PROMPT = "the water"


@pytest.fixture
def counts(monkeypatch):
    """Calls of each check (check_text: of the prompt's text), through every module that imported it."""
    seen = dict.fromkeys([*COUNTED, "prompt text"], 0)

    def counting(key, original):
        def wrapper(*args, **kwargs):
            seen[key] += 1
            return original(*args, **kwargs)

        return wrapper

    def text_counting(text, *args, **kwargs):
        seen["prompt text"] += text == PROMPT
        return original_text(text, *args, **kwargs)

    original_text = prompt.check_text
    originals = {id(f): counting(k, f) for k, f in COUNTED.items() if f is not None}
    originals[id(original_text)] = text_counting
    for module in [m for n, m in sys.modules.items() if n.startswith("streamfuse")]:
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in originals:
                monkeypatch.setattr(module, attr, originals[id(value)])
    monkeypatch.setattr(request.DecodeRequest, "check", counting("DecodeRequest.check", request.DecodeRequest.check))
    return seen


ONCE = {"DecodeRequest.check", "decode_settings", "check_method", "check_fits", "check_prompt_ids", "prompt text"}


def test_the_cli_checks_once(checkpoint, counts, capsys):
    argv = ["--artifact", str(checkpoint / "ckpt"), "--prompt", PROMPT, "--task", "dialogsum", "--max-new-tokens", "3"]
    assert generate.main(argv) == 0
    assert counts == {**dict.fromkeys(counts, 0), **dict.fromkeys(ONCE | {"check_task", "check_prompt_format"}, 1)}


@pytest.mark.parametrize("as_task", [False, True])
def test_model_generate_checks_once(model, counts, as_task):
    model.generate(PROMPT, max_new_tokens=3, as_task=as_task)
    task = {"check_prompt_format": 1} if as_task else {}
    assert counts == {**dict.fromkeys(counts, 0), **dict.fromkeys(ONCE, 1), **task}


def test_a_server_request_is_checked_once_from_parse_to_admission(model, counts):
    from streamfuse.apps.scheduler import Scheduler
    from streamfuse.apps.slot import ServerSlot

    parsed = server_parse(model, {"prompt": PROMPT, "max_tokens": 3})
    slot = ServerSlot(parsed.ids, parsed.settings, None, capacity=parsed.capacity)  # as the server's handler makes it
    scheduler = Scheduler(model.loaded)
    assert scheduler._add(slot)  # the worker's admission: BatchDecoder.add -> Generation.begin
    assert counts == {**dict.fromkeys(counts, 0), **dict.fromkeys(ONCE, 1)}


def test_a_server_chat_and_model_chat_check_each_message_once(model, counts):
    messages = [{"role": "user", "content": PROMPT}]
    server_parse(model, {"messages": messages, "max_tokens": 3}, chat=True)
    model.chat(messages, max_new_tokens=3)
    assert counts["checked_messages"] == 2 and counts["check_fits"] == 2 and counts["decode_settings"] == 2
