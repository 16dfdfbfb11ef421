"""runtime/request/frontend.py and inputs.py, the library the front ends share: requests, their settings and trees,
prompts and input files, runs."""

import ast
import json
from pathlib import Path

import pytest

from streamfuse.runtime.backends.base import PruneConfig
from streamfuse.runtime.request import frontend, inputs
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.frontend import DEFAULT_TREE, DecodeRequest
from streamfuse.runtime.request.inputs import Input
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

# --- a request alone: what a front end refuses before loading a model ----------------------------

BAD_REQUESTS = [  # fields -> (part of) the one-line error
    ({"method": "nope"}, "method must be one of ar, ss,"),
    ({"max_new_tokens": 0}, "max_new_tokens must be > 0, got 0"),
    ({"temperature": -1.0}, "need temperature >= 0"),
    ({"top_k": -2}, "top_k >= 0"),
    ({"top_p": 1.5}, "0 < top_p <= 1"),
    ({"top_p": 0.0}, "0 < top_p <= 1"),
    ({"prune_budget": -1}, "prune budget must be >= 0, got -1"),
    ({"threshold": 1.5}, "threshold is a probability in [0, 1], got 1.5"),
    ({"threshold": -0.1}, "threshold is a probability in [0, 1], got -0.1"),
    ({"tree": "gamma=x"}, "tree 'gamma=x'"),
    ({"tree": "[]"}, "at least one path below the root"),
    ({"stop": ("ok", "\ud800")}, "a stop string is not valid Unicode text"),
]


@pytest.mark.parametrize(
    "fields, message", BAD_REQUESTS, ids=[next(iter(f)) + str(i) for i, (f, _) in enumerate(BAD_REQUESTS)]
)
def test_a_bad_request_is_one_line_naming_its_field(fields, message):
    with pytest.raises(ValueError) as error:
        DecodeRequest(**fields).check()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_good_request_checks_and_states_its_parts():
    request = DecodeRequest(
        max_new_tokens=7,
        stop=("\n\n",),
        temperature=0.5,
        top_k=4,
        top_p=0.9,
        prune_threshold=0.2,
        tree="gamma=2,k=1",
        threshold=None,
    )
    request.check()
    assert request.rules((2,)).max_new_tokens == 7 and request.rules((2,)).stop_token_ids == (2,)
    assert request.rules().stop_strings == ("\n\n",)
    assert request.sampling() == SamplingConfig(0.5, 4, 0.9)
    assert request.prune() == PruneConfig(0.2, None) and DecodeRequest().prune() is None


# --- a request on a model: the one place it becomes DecodeSettings ------------------------------


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return frontend.load_model(checkpoint / "ckpt")


CHAIN2 = TreeSpec.parse("gamma=2,k=1")
SETTINGS = [  # request -> (method, tree, sampling, seed, prune, max_new_tokens, stop strings) of its settings
    (DecodeRequest(), ("ss", TreeSpec.parse(DEFAULT_TREE), SamplingConfig(), 0, None, 128, ())),
    (DecodeRequest("ar"), ("ar", TreeSpec.parse(DEFAULT_TREE), SamplingConfig(), 0, None, 128, ())),
    (DecodeRequest(tree="gamma=2,k=1"), ("ss", CHAIN2, SamplingConfig(), 0, None, 128, ())),
    (
        DecodeRequest(max_new_tokens=5, stop=("x",), temperature=0.7, top_p=0.9, seed=3),
        ("ss", TreeSpec.parse(DEFAULT_TREE), SamplingConfig(0.7, 0, 0.9), 3, None, 5, ("x",)),
    ),
    (
        DecodeRequest(prune_threshold=0.1, prune_budget=3),
        ("ss", TreeSpec.parse(DEFAULT_TREE), SamplingConfig(), 0, PruneConfig(0.1, 3), 128, ()),
    ),
]


@pytest.mark.parametrize("request_, expected", SETTINGS, ids=[str(i) for i in range(len(SETTINGS))])
def test_a_request_becomes_settings(loaded, request_, expected):
    settings = frontend.decode_settings(loaded, request_)
    rules = settings.rules
    got = (
        settings.method,
        settings.tree,
        settings.sampling,
        settings.seed,
        settings.prune,
        rules.max_new_tokens,
        rules.stop_strings,
    )
    assert got == expected
    assert rules.stop_token_ids == loaded.stop_token_ids
    assert settings.fallback is None  # a checkpoint has no calibrated step costs to fall back by


BAD_ON_A_MODEL = [  # request -> (part of) the one-line error, on the tiny checkpoint (torch, no drafters)
    (DecodeRequest("medusa"), "method 'medusa' is not available for this model; it decodes with ar, ss"),
    (
        DecodeRequest("sd", tree="gamma=2,k=1"),
        "the checkpoint has no drafter for it (build the artifact with --set sd.enabled=true to add it)",
    ),
    (DecodeRequest(threshold=0.3), "SpecDec++'s, not method ss's"),
    (DecodeRequest(tree="gamma=8,k=10"), "111,111,111 nodes is larger than"),
    (DecodeRequest(max_new_tokens=-5), "max_new_tokens must be > 0, got -5"),
]


@pytest.mark.parametrize("request_, message", BAD_ON_A_MODEL, ids=[str(i) for i in range(len(BAD_ON_A_MODEL))])
def test_a_request_the_model_cannot_serve_is_one_line(loaded, request_, message):
    with pytest.raises(ValueError) as error:
        frontend.decode_settings(loaded, request_)
    assert message in str(error.value) and "\n" not in str(error.value)


TREES = [  # (tree text, method) -> paths of the tree chosen on the tiny checkpoint
    (None, "ss", TreeSpec.parse(DEFAULT_TREE).paths),
    ("gamma=2,k=2", "ss", ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))),
    ("[[0],[0,0]]", "ar", ((0,), (0, 0))),
]


@pytest.mark.parametrize("text, method, paths", TREES)
def test_choose_tree(loaded, text, method, paths):
    assert frontend.choose_tree(text, loaded, method).paths == paths


def test_the_task_is_checked_against_the_model(loaded):
    frontend.check_task(loaded, "dialogsum")
    with pytest.raises(
        ValueError,
        match="^task e2e_nlg: the checkpoint was fine-tuned for 'dialogsum'; use that task name or drop task$",
    ):
        frontend.check_task(loaded, "e2e_nlg")
    with pytest.raises(ValueError, match="^--task e2e_nlg: .* or drop --task$"):
        frontend.check_task(loaded, "e2e_nlg", "--task")


# --- prompts and inputs -------------------------------------------------------------------------

INPUT_FILES = [  # (file text, as a task source?) -> Inputs, or (part of) the error
    (
        '{"prompt": "hi", "id": 7}\n\n{"prompt": "yo", "fname": "f"}\n{"prompt": "no id"}\n',
        False,
        [Input("7", "hi"), Input("f", "yo"), Input("4", "no id")],
    ),
    ('{"dialogue": "#Person1#: hi"}\n', True, [Input("1", "#Person1#: hi")]),
    ('{"text": "hi"}\n', False, "rows.jsonl:1: needs a 'prompt' field"),
    ('{"prompt": "hi"}\n{"prompt": 3\n', False, "rows.jsonl:2: not valid JSON"),
    ("[1]\n", False, "rows.jsonl:1: a line must be one JSON object, got list"),
    ("\n \n", False, "rows.jsonl: no inputs (one JSON object per line)"),
]


@pytest.mark.parametrize("text, as_task, expected", INPUT_FILES, ids=[str(i) for i in range(len(INPUT_FILES))])
def test_read_input_file(loaded, tmp_path, text, as_task, expected):
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            list(inputs.read_input_file(path, loaded, as_task))
    else:
        assert list(inputs.read_input_file(path, loaded, as_task)) == expected


def test_read_input_file_stops_at_the_limit(loaded, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    assert [i.text for i in inputs.read_input_file(path, loaded, False, limit=2)] == ["p0", "p1"]


def test_prompts_as_a_task_source_or_a_chat_message(loaded):
    source = " ".join(["the water"] * 60)  # 120 tokens: over the 64 the tiny model was fine-tuned on
    assert inputs.source_overflow(loaded, source, as_task=True) == 56
    assert inputs.source_overflow(loaded, source, as_task=False) == 0
    cut, whole = (inputs.prompt_ids(loaded, source, True, cut_source=c) for c in (True, False))
    assert len(whole) - len(cut) == 56
    assert inputs.prompt_ids(loaded, "hi", as_task=False) != inputs.prompt_ids(loaded, "hi", as_task=True)
    with pytest.raises(ValueError, match="the prompt is not valid Unicode text"):
        inputs.prompt_ids(loaded, "\udc80", as_task=False)


# --- runs ---------------------------------------------------------------------------------------


def test_run_with_a_trace_and_a_step_callback(loaded):
    settings = frontend.decode_settings(loaded, DecodeRequest(max_new_tokens=6))
    trace = frontend.new_trace(loaded, settings, threads=1)
    steps = []
    ids = inputs.prompt_ids(loaded, "the water", as_task=True)
    model = Model(loaded)
    result = model.run(ids, settings=settings, trace=trace, run_id="a", on_step=steps.append)
    plain = model.run(ids, DecodeRequest("ar", max_new_tokens=6))
    assert result.token_ids == plain.token_ids and 0 < len(result.token_ids) <= 6  # lossless
    assert len(steps) == result.record.model_calls == result.stats.model_calls and result.record.id == "a"
    with pytest.raises(ValueError, match="Model.run needs a DecodeRequest or the DecodeSettings made of one"):
        model.run(ids)
    header = trace.to_dict()["meta"]
    assert header["method"] == "ss" and header["tree"]["num_nodes"] == 5 and header["backend"] == "torch"
    assert [run.id for run in trace.runs] == ["a"]
    plain_trace = frontend.new_trace(loaded, frontend.decode_settings(loaded, DecodeRequest("ar")), enabled=False)
    assert plain_trace.to_dict()["meta"]["tree"] is None and not plain_trace.enabled


def test_load_model_takes_the_fastest_backend_and_the_task_it_serves(checkpoint):
    loaded = frontend.load_model(checkpoint / "ckpt", task="not-served")  # a checkpoint serves its own task
    assert loaded.backend.name == "torch" and loaded.tasks == ("dialogsum",)


# --- a library: no flags, no printing ---------------------------------------------------------------


def test_the_library_parses_no_flags_and_prints_nothing():
    tree = ast.parse(Path(frontend.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "argparse" not in imported and "sys" not in imported
    calls = [node.func for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert not [call for call in calls if isinstance(call, ast.Name) and call.id == "print"]
