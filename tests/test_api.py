"""runtime/request/api.py, `streamfuse.load`: generate, stream, chat and conversations on the tiny checkpoint (torch)
and the tiny artifact's engines (ExecuTorch, ONNX Runtime); every output equals what the decode loop itself
(runtime/request/decode.py's generate) decodes."""

import subprocess
import sys

import pytest

import streamfuse
from streamfuse.runtime.request.decode import generate, kept_prefix
from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD, DecodeRequest, decode_settings

from tiny_export import EXPORTED

PROMPTS = ["the a and", "#Person1#: what is the time", "you i we he she they"]


@pytest.fixture(scope="module")
def model(checkpoint):
    return streamfuse.load(checkpoint / "ckpt")


@pytest.fixture(scope="module", params=EXPORTED)
def engine(artifact, request):
    """The tiny artifact on one exported engine."""
    return streamfuse.load(artifact, backend=request.param)


def reference(model, ids, **fields):
    """What the decode loop itself (runtime/request/decode.py's generate) decodes for these prompt ids."""
    loaded = model.loaded
    settings = decode_settings(loaded, DecodeRequest(**fields))
    return generate(
        loaded.backend, ids, settings, drafter=loaded.drafter(settings), detokenizer=loaded.tokenizer.decode
    )


def text_of(model, result) -> str:
    return model.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()


def check_generate_equals_the_loop(model, prompt, method, **fields):
    done = model.generate(prompt, method=method, **fields)
    expected = reference(model, model.prompt_ids(prompt), method=method, **fields)
    assert done.token_ids == expected.token_ids and done.stop_reason == expected.stop_reason
    assert done.text == text_of(model, expected)
    stats = done.stats
    assert stats.new_tokens == len(done.token_ids) and stats.model_calls == expected.run.model_calls
    assert stats.steps == stats.model_calls - 1 and stats.prefill_tokens == len(model.prompt_ids(prompt))
    assert 0 < stats.time_to_first_token <= stats.seconds
    return done


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("method", [DEFAULT_METHOD, BASELINE_METHOD])
def test_generate_equals_the_decode_loop_on_torch(model, prompt, method):
    done = check_generate_equals_the_loop(model, prompt, method, max_new_tokens=12)
    if method == BASELINE_METHOD:
        assert done.stats.accepted_per_step == 0 and done.stats.tokens_per_call == 1


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_generate_equals_the_decode_loop_on_exported_engines(engine, prompt):
    check_generate_equals_the_loop(engine, prompt, DEFAULT_METHOD, max_new_tokens=16)
    check_generate_equals_the_loop(engine, prompt, DEFAULT_METHOD, max_new_tokens=16, temperature=1.0, seed=3)


def test_on_step_sees_every_step_and_can_end_the_generation(model):
    ids, request = model.prompt_ids(PROMPTS[1]), DecodeRequest(DEFAULT_METHOD, 12)
    events = []
    done = model.run(ids, request, on_step=events.append)
    assert [t for event in events for t in event.tokens] == done.token_ids and len(events) == done.stats.model_calls
    assert any(event.accepted_drafts for event in events) == (done.stats.accepted_per_step > 0)

    class Enough(Exception):
        pass

    def stop_after_two(event) -> None:
        if len(seen) == 2:
            raise Enough
        seen.append(event)

    seen = []
    with pytest.raises(Enough):
        model.run(ids, request, on_step=stop_after_two)
    assert len(seen) == 2 and model.run(ids, request).token_ids == done.token_ids  # the next call starts afresh


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_deltas_join_to_the_completion(model, prompt):
    whole = model.generate(prompt, max_new_tokens=14)
    stream = model.generate(prompt, max_new_tokens=14, stream=True)
    assert stream.completion is None
    deltas = list(stream)
    assert "".join(deltas) == whole.text == stream.completion.text and all(deltas)
    assert stream.completion.token_ids == whole.token_ids


def test_a_stop_string_ends_the_text_where_it_starts(model):
    whole = model.generate(PROMPTS[0], max_new_tokens=14)
    words = whole.text.split()
    assert len(words) >= 4, "the tiny model's answer is too short to cut"
    stop = " ".join(words[2:4])
    cut = whole.text[: whole.text.index(stop)].strip()
    done = model.generate(PROMPTS[0], max_new_tokens=14, stop=[stop, "never there"])
    assert done.text == cut and done.stop_reason == "stop_string"
    assert done.token_ids == whole.token_ids[: len(done.token_ids)] and len(done.token_ids) < len(whole.token_ids)
    stream = model.generate(PROMPTS[0], max_new_tokens=14, stop=[stop], stream=True)
    deltas = list(stream)
    assert "".join(deltas) == cut and not any(word in "".join(deltas)[len(cut) :] for word in words[2:4])


def test_chat_renders_the_conversation_on_the_chat_template(model):
    single = model.chat([{"role": "user", "content": PROMPTS[0]}], max_new_tokens=10)
    assert single.token_ids == model.generate(PROMPTS[0], max_new_tokens=10).token_ids
    messages = [
        {"role": "system", "content": "you are a"},
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": "the"},
        {"role": "user", "content": PROMPTS[1]},
    ]
    ids = model.chat_ids(messages)
    rendered = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == model.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert model.chat(messages, max_new_tokens=10).token_ids == reference(model, ids, max_new_tokens=10).token_ids


def test_a_task_source_is_rendered_in_the_task_prompt_format(model):
    from streamfuse.runtime.request.inputs import prompt_ids

    source = "#Person1#: the time #Person2#: it is"
    done = model.generate(source, max_new_tokens=10, as_task=True)
    ids = prompt_ids(model.loaded, source, as_task=True, cut_source=False)
    assert done.token_ids == reference(model, ids, max_new_tokens=10).token_ids and ids != model.prompt_ids(source)


TURNS = ["the a and", "what is the time", "you i we", "she they", "and to of"]


def check_five_turn_conversation(model, max_new_tokens: int):
    chat = model.conversation(system="you are")
    memory, previous = [], []
    for number, text in enumerate(TURNS):
        messages = [*chat.messages, {"role": "user", "content": text}]
        fresh = model.chat(messages, max_new_tokens=max_new_tokens)  # the whole conversation, from an empty cache
        ids, held = model.chat_ids(messages), chat.cached_ids
        turn = chat.send(text, max_new_tokens=max_new_tokens)
        assert turn.token_ids == fresh.token_ids and turn.text == fresh.text, f"turn {number}"
        assert fresh.stats.prefill_tokens == len(ids)
        expected = len(ids) - kept_prefix(held, ids) if held else len(ids)
        assert turn.stats.prefill_tokens == expected, f"turn {number}"
        if number:  # the cache held the last turn's prompt, at least
            assert ids[: len(previous)] == previous and turn.stats.prefill_tokens <= len(ids) - len(previous)
        previous = ids
        assert chat.messages[-1] == {"role": "assistant", "content": turn.text} and len(chat.messages) == 3 + 2 * number
        memory.append(chat.memory_bytes)
    assert memory == sorted(memory) and memory[0] > 0


def test_a_five_turn_conversation_prefills_only_new_tokens_on_torch(model):
    check_five_turn_conversation(model, 6)


def test_a_five_turn_conversation_prefills_only_new_tokens_on_exported_engines(engine):
    check_five_turn_conversation(engine, 4)


def test_a_streamed_turn_joins_the_conversation_once_exhausted(model):
    chat = model.conversation()
    stream = chat.send(TURNS[0], max_new_tokens=6, stream=True)
    assert chat.messages == []
    text = "".join(stream)
    assert chat.messages[-1] == {"role": "assistant", "content": text} and text == stream.completion.text
    abandoned = chat.send(TURNS[1], max_new_tokens=6, stream=True)
    next(abandoned, None)
    abandoned.close()  # cancelled between steps: its cache holds its prompt and the tokens it committed
    held, ids = chat.cached_ids, model.chat_ids([*chat.messages, {"role": "user", "content": TURNS[1]}])
    assert len(chat.messages) == 2 and held[: len(ids)] == ids
    again = chat.send(TURNS[1], max_new_tokens=6)
    assert again.stats.prefill_tokens == len(ids) - kept_prefix(held, ids) < len(ids)
    assert again.token_ids == model.chat(chat.messages[:-1], max_new_tokens=6).token_ids


def test_a_later_generation_ends_an_unfinished_stream(model):
    stream = model.generate(PROMPTS[0], max_new_tokens=12, stream=True)
    model.generate(PROMPTS[1], max_new_tokens=4)
    with pytest.raises(RuntimeError, match="a later generation on the same model ended"):
        list(stream)


BAD = [  # call on the model -> (part of) the one-line error
    (lambda m: m.generate("x", max_new_tokens=0), "max_new_tokens must be > 0"),
    (lambda m: m.generate("x", temperature=-1.0), "temperature >= 0"),
    (lambda m: m.generate("x", method="nope"), "method must be one of"),
    (lambda m: m.generate("x", top_p=2.0), "0 < top_p <= 1"),
    (lambda m: m.generate("x", colour="red"), "unknown option 'colour'"),
    (lambda m: m.generate("x", max_new_tokens=100_000), "exceeds the model's context"),
    (lambda m: m.generate("x\ud800"), "not valid Unicode text"),
    (lambda m: m.generate([5, 1000]), "outside the vocabulary"),
    (lambda m: m.generate([]), "the prompt is empty"),
    (lambda m: m.generate([5], as_task=True), "as_task formats a source text"),
    (lambda m: m.generate("x", stop=["\ud800"]), "a stop string is not valid Unicode text"),
    (lambda m: m.chat([]), "give a non-empty list"),
    (lambda m: m.chat([{"role": "bot", "content": "x"}]), "messages[0]: needs a role among"),
    (lambda m: m.chat([{"role": "user", "content": 3}]), "messages[0]'s content must be text"),
    (lambda m: m.conversation().send("x", max_new_tokens=-1), "max_new_tokens must be > 0"),
]


@pytest.mark.parametrize("call, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_one_line_naming_the_problem(model, call, message):
    with pytest.raises(ValueError) as error:
        call(model)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"backend": "gpu"}, "backend 'gpu' is not available"), ({"threads": 0}, "threads must be >= 1")],
)
def test_load_refuses_bad_values(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        streamfuse.load(checkpoint / "ckpt", **kwargs)


def test_load_auto_takes_the_fastest_backend(model):
    assert model.backend == "torch" and DEFAULT_METHOD in model.methods  # a checkpoint runs on torch only


def test_importing_streamfuse_loads_no_numpy_or_torch():
    code = "import sys, streamfuse; print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
