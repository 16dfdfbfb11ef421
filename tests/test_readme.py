"""README.md's ```python blocks run as written, against the tiny artifact (tests/tiny_export.py) in place of
artifacts/dialogsum: the Python API and conversation blocks in one namespace, in order, and the server's block
against `streamfuse serve`'s app started on a free loopback port (tests/test_server.py's `serve`)."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
REAL = "artifacts/dialogsum"  # the path the README's blocks load
SERVER = "http://127.0.0.1:8000"  # the address the server block talks to


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section whose heading is `section`."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {section}' section"
    blocks = re.findall(r"^```python\n(.*?)^```", match.group(1), re.MULTILINE | re.DOTALL)
    assert blocks, f"README.md's '## {section}' has no python block"
    return blocks


def run_block(code: str, namespace: dict, **replacements: str) -> str:
    """Execute a block with its literal text replaced; what it prints."""
    for old, new in replacements.items():
        assert old in code, f"the README block no longer says {old!r}"
        code = code.replace(old, new)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), namespace)
    return printed.getvalue()


def test_the_python_api_and_conversation_blocks_run(artifact):
    namespace: dict = {}
    for block in python_blocks("Python API"):
        printed = run_block(block, namespace, **{REAL: str(artifact)})
    done, summary = namespace["done"], namespace["summary"]
    assert printed.startswith(done.text) and done.stats.new_tokens == len(done.token_ids) > 0
    assert summary.stats.prefill_tokens > 0 and namespace["reply"].token_ids
    for block in python_blocks("Conversations"):
        printed = run_block(block, namespace)
    chat, first, second = namespace["chat"], namespace["first"], namespace["second"]
    assert second.stats.prefill_tokens < second.stats.prompt_tokens  # the first turn's rows were kept
    assert len(chat.messages) == 7 and chat.messages[2]["content"] == first.text and chat.memory_bytes > 0
    assert printed.startswith(f"{second.text} {second.stats.prefill_tokens} ")


def test_the_server_block_runs_against_a_server_on_loopback(checkpoint):
    """The block names no model folder: the server runs the tiny checkpoint, which loads in seconds."""
    pytest.importorskip("starlette", reason="the server extra (pip install 'streamfuse[server]')")
    pytest.importorskip("uvicorn", reason="the server extra (pip install 'streamfuse[server]')")
    pytest.importorskip("openai", reason="the dev extra's official client")
    import streamfuse

    from test_server import serve

    (block,) = python_blocks("A local server")
    served = serve(streamfuse.load(checkpoint / "ckpt"))
    try:
        printed = run_block(block, {}, **{SERVER: served.url, 'model="dialogsum"': 'model="tiny"'})
    finally:
        served.stop()
    assert "completion_tokens" in printed
