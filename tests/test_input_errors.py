"""Bad input is one line: tree specs (bounded before anything is enumerated), thread counts, text that is not
Unicode, through the library and the command line; the tree parser's fuzz target on its seeds, on hypothesis'
strings and (where atheris is installed) under libFuzzer for a few seconds."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.runtime.artifact.prompt import PromptFormat, TextError, check_text
from streamfuse.runtime.backends.threads import MOST_THREADS, check_threads, max_threads
from streamfuse.runtime.commands import errors
from streamfuse.runtime.commands.generate import main as generate_main
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.inputs import read_input_file as read_requests
from streamfuse.runtime.speculation.tree import MAX_NODES, TreeSpec, TreeSpecError

FUZZ = Path(__file__).parent / "fuzz" / "tree"
sys.path.insert(0, str(FUZZ))
from fuzz_tree import check, spec_of  # noqa: E402

# spec -> what its one-line error says
BAD_TREES = [
    ("gamma=8,k=10", "111,111,111 nodes is larger than the most a tree may have (1024 nodes)"),
    ("gamma=64,k=1000", "over 10^15 nodes is larger than"),
    ("gamma=65,k=1", "give gamma <= 64"),
    ("[1]", "tree path 1 is not a list of ranks"),
    ('{"x":1}', 'a tree object needs "paths" (and may have "lookup"); unknown keys \'x\''),
    ('{"paths": [[0]], "lookup": 3}', "lookup branch 3 is not a list of ranks"),
    ("[]", "a draft tree needs at least one path below the root"),
    ('{"paths": []}', "a draft tree needs at least one path below the root"),
    ("gamma=0,k=2", "gamma and k must be >= 1, got gamma=0, k=2"),
    ("gamma=3,k=0", "gamma and k must be >= 1"),
    ("gamma=-1,k=2", "gamma must be a whole number, got '-1'"),
    ("gamma=2.5,k=1", "gamma must be a whole number, got '2.5'"),
    ("gamma=3,k=x", "k must be a whole number, got 'x'"),
    ("gamma=3,k=2,gamma=3", "expected 'gamma=G,k=K[,lookup=N]'"),
    ("gamma=3", "expected 'gamma=G,k=K[,lookup=N]'"),
    ("gamma=3,k=1,lookup=4", "lookup=4: give 1..3 (the tree's depth) lookup nodes"),
    ("[[0.5]]", "tree path [0.5] must hold whole ranks >= 0 and < 1024, got 0.5"),
    ("[[true]]", "must hold whole ranks >= 0 and < 1024, got True"),
    ('[["0"]]', "got '0'"),
    ("[[-1]]", "got -1"),
    ("[[1024]]", "got 1024"),
    ("[[[[0]]]]", "tree path [[[0]]] must hold whole ranks"),
    ("[" * 100_000, "JSON nested too deeply"),
    ("[[1" + "0" * 5000 + "]]", "not valid JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
    ("[[0],[0]]", "tree paths contain duplicates"),
    ("[[0,0]]", "tree path [0, 0] has no parent [0]"),
    ("[[0]" + ",[0]" * MAX_NODES + "]", "1025 paths: a tree has at most 1024 nodes"),
    ("[[" + ",".join(["0"] * 65) + "]]", "tree path has 65 ranks: a path holds 1..64"),
    ("[[0],]", "not valid JSON (Expecting value)"),
    ("null", "(no such file)"),
    ("", "(no such file)"),
    ("a\x00b", "(no such file)"),
    ("\udcff\udcfe", "(no such file)"),
    ("x" * 5000, "the file cannot be read"),
    ("[" + " " * (1 << 20), "longer than 1048576 characters"),
]


@pytest.mark.parametrize("spec, message", BAD_TREES, ids=[s[:20] for s, _ in BAD_TREES])
def test_every_bad_tree_spec_is_one_line_naming_the_problem(spec, message):
    started = time.perf_counter()
    with pytest.raises(TreeSpecError) as caught:
        TreeSpec.parse(spec)
    text = str(caught.value)
    assert message in text and text.startswith("tree '") and "\n" not in text and len(text) < 400, text
    assert time.perf_counter() - started < 2.0  # bounded before anything is enumerated


def test_an_artifact_bounds_the_tree_by_its_largest_step_graph():
    bound = "the artifact's largest step graph"
    assert TreeSpec.parse("gamma=3,k=2", 15, bound).num_nodes == 15
    with pytest.raises(TreeSpecError, match=r"21 nodes is larger than the artifact's largest step graph \(15 nodes\)"):
        TreeSpec.parse("gamma=2,k=4", 15, bound)
    with pytest.raises(TreeSpecError, match=r"7 nodes is larger than the artifact's largest step graph \(4 nodes\)"):
        TreeSpec.parse("gamma=3,k=1,lookup=3", 4, bound)  # the lookup branch counts
    with pytest.raises(TreeSpecError, match="5 nodes is larger"):
        TreeSpec.parse("[[0],[1],[2],[3]]", 4, bound)


def test_tree_files_are_read_bounded_and_as_utf8(tmp_path):
    good = tmp_path / "tree.json"
    good.write_text(json.dumps({"paths": [[0], [1], [0, 0]], "lookup": [1]}))
    assert TreeSpec.parse(str(good)).lookup_nodes == [2]
    for content, message in [
        (b"\xff[[0]]", "not UTF-8 text (invalid start byte at byte 0)"),
        (b"[[0]]" + b" " * (1 << 20), "larger than 1048576 bytes"),
        (b"gamma=3,k=2", "not valid JSON"),
    ]:
        bad = tmp_path / "bad.json"
        bad.write_bytes(content)
        with pytest.raises(TreeSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
            TreeSpec.parse(str(bad))
    with pytest.raises(TreeSpecError, match="no such file"):
        TreeSpec.parse(str(tmp_path))  # a folder


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TreeSpec([[0], 1]), "tree path 1 is not a list of ranks"),
        (lambda: TreeSpec("[[0]]"), "tree paths must be a list of rank paths"),
        (lambda: TreeSpec.full(3, 20), "8,421 nodes is larger than the most a tree may have here"),
        (lambda: TreeSpec.filling(MAX_NODES + 1, 3), "a filling tree needs 2 <= nodes <= 1024"),
        (lambda: TreeSpec.from_dict([[0]]), "a tree record is a JSON object"),
        (lambda: TreeSpec.from_dict({"paths": [[0]], "hash": "0" * 100}), "tree hash '00000"),
    ],
)
def test_trees_made_in_code_are_checked_too(make, message):
    with pytest.raises(TreeSpecError, match=message):
        make()


def test_filling_a_deep_tree_makes_only_its_nodes():
    tree = TreeSpec.filling(1000, 64)  # the full tree of k=2 it fills has 2^65 nodes
    assert tree.num_nodes == 1000 and tree.paths[:3] == ((0,), (1,), (0, 0))


@pytest.mark.parametrize(
    "threads, message",
    [
        (0, "--threads must be >= 1, got 0"),
        (-3, "--threads must be >= 1, got -3"),
        (10**12, f"--threads must be <= {max_threads()}"),
        (True, "--threads must be a whole number of threads, got True"),
        (2.0, "got 2.0"),
        ("4", "got '4'"),
    ],
)
def test_bad_thread_counts_are_one_line(threads, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_threads(threads)


@pytest.mark.parametrize("threads", ["0", "100000"])
def test_the_demo_refuses_a_bad_thread_count_before_opening_a_window(threads, capsys):
    from streamfuse.apps.demo import parse_args

    with pytest.raises(SystemExit) as caught:
        parse_args(["--threads", threads])
    assert caught.value.code == 2 and "error: --threads must be" in capsys.readouterr().err


def test_thread_counts_up_to_the_bound_pass():
    assert 4 <= max_threads() <= MOST_THREADS
    for threads in (None, 1, max_threads()):
        check_threads(threads)


# generate's argv (its flags are checked before any model is loaded) -> its one line on stderr, exit status 2
CLI_CASES = [
    (["--tree", "gamma=8,k=10"], "111,111,111 nodes is larger than the most a tree may have"),
    (["--tree", "[1]"], "tree path 1 is not a list of ranks"),
    (["--tree", '{"x":1}'], "unknown keys 'x'"),
    (["--tree", "[]"], "a draft tree needs at least one path"),
    (["--tree", "gamma=3,k=-2"], "k must be a whole number, got '-2'"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--threads", "100000"], f"--threads must be <= {max_threads()}"),
    (
        ["--prompt", "the \udcff water"],
        "--prompt is not valid Unicode text: '\\udcff' at character 4 is a lone surrogate",
    ),
    (["--stop", "\ud800"], "--stop is not valid Unicode text"),
]


@pytest.mark.parametrize("argv, message", CLI_CASES, ids=[" ".join(a)[:24] for a, _ in CLI_CASES])
def test_bad_flags_end_generate_in_one_line_before_loading(argv, message, tmp_path, capsys):
    prompt = [] if "--prompt" in argv else ["--prompt", "x"]
    status = errors.run(generate_main, ["--artifact", str(tmp_path / "none"), *prompt, *argv], prog="generate")
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("generate: error: ") and message in err, err


def test_undecodable_bytes_on_the_command_line_are_one_line(tmp_path):
    """As a shell passes them: argv bytes that are not UTF-8 (Python keeps them as lone surrogates)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamfuse.runtime.commands.generate",
            "--artifact",
            str(tmp_path),
            "--prompt",
            b"the \xff\xfe water",
        ],
        capture_output=True,
        timeout=120,
    )
    err = run.stderr.decode("utf-8", "replace")
    assert run.returncode == 2 and ": error: --prompt is not valid Unicode text" in err.strip().split("\n")[-1], err


@pytest.mark.parametrize(
    "line, message",
    [
        (
            b'{"prompt": "the \\ud800 water"}\n',
            "rows.jsonl:1: the prompt is not valid Unicode text: '\\ud800' at character 4",
        ),
        (b'{"prompt": "ok"}\n{"prompt": "\\udfff"}\n', "rows.jsonl:2: the prompt is not valid Unicode text"),
        (b'{"prompt": "the \xff water"}\n', "rows.jsonl:1: not UTF-8 text (invalid start byte at byte 16)"),
    ],
)
def test_text_in_an_input_file_that_is_not_unicode_is_one_line(tmp_path, line, message):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(line)
    with pytest.raises(ValueError) as caught:
        list(read_requests(rows, None, as_task=False, limit=None))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_text_through_the_python_entry_points_is_checked_before_the_tokenizer():
    loaded = SimpleNamespace(tokenizer=None, prompt=None)  # never reached: the check comes first
    for call in (
        lambda: prompt_ids(loaded, "a \ud83d b", as_task=False),
        lambda: PromptFormat("s {source}", "{dialogue}", 8).render(None, "\udc80"),
        lambda: PromptFormat("s {source}", "{dialogue}", 8).fill_source({"dialogue": "x \ud800"}),
        lambda: check_text(b"bytes", "the prompt"),
    ):
        with pytest.raises(TextError):
            call()
    assert check_text("emoji \U0001f600 and accents é", "the prompt").startswith("emoji")


# --- the tree parser's fuzz target -------------------------------------------------------------------------------


def test_the_fuzz_target_holds_on_its_seed_corpus():
    seeds = sorted((FUZZ / "seeds").iterdir())
    assert len(seeds) >= 20
    parsed = [check(*spec_of(seed.read_bytes())) for seed in seeds]
    assert sum(tree is not None for tree in parsed) >= 4  # the corpus holds good trees as well as bad ones


TREE_TEXT = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda g, k, rest: f"gamma={g},k={k}{rest}",
        st.integers(-2, 70),
        st.integers(-2, 2000),
        st.sampled_from(["", ",lookup=1", ",lookup=9", ",k=1", ",x=1"]),
    ),
    st.recursive(
        st.integers(-3, 1100) | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=3) | st.none(),
        lambda inner: (
            st.lists(inner, max_size=6) | st.dictionaries(st.sampled_from(["paths", "lookup", "x"]), inner, max_size=3)
        ),
        max_leaves=30,
    ).map(json.dumps),
)


@settings(max_examples=200, deadline=None)
@given(TREE_TEXT, st.sampled_from([None, 1, 4, 15, MAX_NODES]))
def test_the_tree_parser_returns_a_bounded_tree_or_one_line(text, bound):
    check(text, bound)


NO_ATHERIS = importlib.util.find_spec("atheris") is None


@pytest.mark.skipif(NO_ATHERIS, reason="atheris is not installed (pip install atheris)")
def test_the_fuzz_target_runs_under_libfuzzer_without_a_finding(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    run = subprocess.run(
        [
            sys.executable,
            str(FUZZ / "fuzz_tree.py"),
            "-max_total_time=4",
            "-timeout=5",
            "-rss_limit_mb=2048",
            str(corpus),
            str(FUZZ / "seeds"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "Done" in run.stderr, run.stderr[-2000:]
