"""runtime.commands.generate CLI on a tiny checkpoint: JSON contract, SS == AR, bad input, traces."""

import json

import pytest

from streamfuse.runtime.commands import errors, generate


def run_cli(capsys, *argv):
    assert generate.main(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_json_records_and_speculative_equals_plain(checkpoint, capsys, tmp_path):
    common = [
        "--artifact",
        str(checkpoint / "ckpt"),
        "--task",
        "dialogsum",
        "--input-file",
        str(checkpoint / "data" / "dialogsum.test.jsonl"),
        "--limit",
        "3",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    ss = run_cli(capsys, *common, "--method", "ss", "--trace", str(tmp_path / "ss.json"))
    ar = run_cli(capsys, *common, "--method", "ar")
    assert [r["id"] for r in ss] == ["test_0", "test_1", "test_2"]
    for fast, plain in zip(ss, ar):
        assert {"id", "text", "token_ids", "model_calls", "new_tokens", "call_reduction", "seconds"} <= set(fast)
        assert fast["token_ids"] == plain["token_ids"] and fast["text"] == plain["text"]
        assert plain["model_calls"] == plain["new_tokens"] and plain["call_reduction"] == 1.0
        assert fast["call_reduction"] == fast["new_tokens"] / fast["model_calls"]
    trace = json.loads((tmp_path / "ss.json").read_text())
    assert trace["schema"] == "streamfuse.trace/3" and len(trace["runs"]) == 3
    assert trace["meta"]["tree"]["num_nodes"] == 5  # the default tree [[0],[1],[0,0],[0,0,0]] and its root


def test_plain_prompt(checkpoint, capsys):
    records = run_cli(
        capsys, "--artifact", str(checkpoint / "ckpt"), "--prompt", "the water", "--max-new-tokens", "5", "--json"
    )
    assert len(records) == 1 and records[0]["new_tokens"] <= 5 and records[0]["source_truncated"] is False


INPUT_FILES = {  # name -> bytes of an --input-file
    "malformed": b'{"dialogue": "x"}\n{"dialogue": \n',
    "no_dialogue": b'{"dialogue": "x"}\n{"other": 1}\n',
    "latin1": b'{"dialogue": "caf\xe9"}\n',
    "empty": b"\n\n",
    "not_object": b'["dialogue"]\n',
    "too_long": ('{"dialogue": "' + "the water " * 150 + '"}\n').encode(),  # ~300 tokens, kept whole by default
}

# Probes: argv (ARTIFACT = the tiny checkpoint, FILE = a file above) -> exit status, stderr's line
PROBES = [
    (["--artifact", "missing", "--prompt", "x"], 1, "missing is not a folder"),
    (["--task", "dialogsum", "--input-file", "FILE:malformed"], 1, "malformed.jsonl:2: not valid JSON"),
    (["--task", "dialogsum", "--input-file", "FILE:no_dialogue"], 1, "no_dialogue.jsonl:2: lacks field 'dialogue'"),
    (["--task", "dialogsum", "--input-file", "FILE:latin1"], 1, "latin1.jsonl:1: not UTF-8 text"),
    (["--task", "dialogsum", "--input-file", "FILE:empty"], 1, "empty.jsonl: no inputs"),
    (
        ["--task", "dialogsum", "--input-file", "FILE:not_object"],
        1,
        "not_object.jsonl:1: a line must be one JSON object",
    ),
    (["--input-file", "nowhere.jsonl"], 2, "nowhere.jsonl: no such file"),
    (["--prompt", "x", "--tree", "gamma=x"], 2, "gamma=x"),
    (["--prompt", "x", "--max-new-tokens", "-5"], 2, "max_new_tokens must be > 0, got -5"),
    (["--prompt", "x", "--temperature", "-1"], 2, "need temperature >= 0"),
    (["--prompt", "x", "--top-p", "1.5"], 2, "0 < top_p <= 1"),
    (["--prompt", "x", "--threads", "0"], 2, "--threads must be >= 1, got 0"),
    (["--prompt", "x", "--threshold", "1.5"], 2, "threshold is a probability in [0, 1], got 1.5"),
    (["--prompt", "x", "--method", "specdec++"], 2, "--set sd.enabled=true --set specdec.enabled=true"),
    (["--prompt", "x", "--method", "ss", "--threshold", "0.3"], 2, "SpecDec++'s, not method ss's"),
    (["--prompt", "x", "--limit", "0"], 2, "--limit must be >= 1"),
    (["--prompt", "x", "--backend", "onnxruntime"], 1, "is a checkpoint, which only the torch backend runs"),
    (["--prompt", "x", "--task", "e2e_nlg"], 2, "fine-tuned for 'dialogsum'"),
    (["--task", "dialogsum", "--input-file", "FILE:too_long"], 1, "exceeds the model's context of 256 positions"),
]


@pytest.mark.parametrize("argv, status, message", PROBES, ids=[" ".join(p[0][:4]) for p in PROBES])
def test_bad_input_is_one_line_and_a_nonzero_exit(checkpoint, tmp_path, capsys, argv, status, message):
    def resolve(arg: str) -> str:
        if arg.startswith("FILE:"):
            name = arg.removeprefix("FILE:")
            (tmp_path / f"{name}.jsonl").write_bytes(INPUT_FILES[name])
            return str(tmp_path / f"{name}.jsonl")
        return str(tmp_path / arg) if arg in ("missing", "nowhere.jsonl") else arg

    argv = [resolve(a) for a in argv]
    if "--artifact" not in argv:
        argv = ["--artifact", str(checkpoint / "ckpt"), *argv]
    assert errors.run(generate.main, argv, prog="generate") == status
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]  # after any progress bar of the model load
    assert last.startswith("generate: error: ") and message in last and "Traceback" not in err, err
    with pytest.raises((ValueError, OSError)):  # --debug: the traceback
        generate.main([*argv, "--debug"])


def test_a_source_longer_than_training_is_kept_whole_or_cut_on_request(checkpoint, tmp_path, capsys):
    rows = tmp_path / "long.jsonl"
    rows.write_text(
        json.dumps({"id": "long", "dialogue": " ".join(["the water"] * 60)})
        + "\n"
        + json.dumps({"id": "short", "dialogue": "the water"})
        + "\n"
    )
    argv = [
        "--artifact",
        str(checkpoint / "ckpt"),
        "--task",
        "dialogsum",
        "--input-file",
        str(rows),
        "--max-new-tokens",
        "3",
        "--json",
    ]
    whole = run_cli(capsys, *argv)
    cut = run_cli(capsys, *argv, "--cut-source")
    assert [r["source_truncated"] for r in whole] == [False, False]
    assert [r["source_truncated"] for r in cut] == [True, False]
    generate.main(argv[:-1] + ["--limit", "1"])
    assert (
        "warning: input long: the source is 56 tokens over the 64 the model was fine-tuned on; kept whole"
        in capsys.readouterr().err
    )
    generate.main(argv[:-1] + ["--limit", "1", "--cut-source"])
    assert "the source is 56 tokens over the 64 the model was fine-tuned on; its end is cut" in capsys.readouterr().err
