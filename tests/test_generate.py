"""runtime.generate CLI on a tiny checkpoint: JSON contract, SS == AR, bad input, traces."""

import json

import pytest

from streamfuse.runtime import generate


def run_cli(capsys, *argv):
    assert generate.main(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_json_records_and_speculative_equals_plain(checkpoint, capsys, tmp_path):
    common = ["--artifact", str(checkpoint / "ckpt"), "--task", "dialogsum", "--input-file",
              str(checkpoint / "data" / "dialogsum.test.jsonl"), "--limit", "3", "--max-new-tokens", "12", "--json"]
    ss = run_cli(capsys, *common, "--method", "ss", "--trace", str(tmp_path / "ss.json"))
    ar = run_cli(capsys, *common, "--method", "ar")
    assert [r["id"] for r in ss] == ["test_0", "test_1", "test_2"]
    for fast, plain in zip(ss, ar):
        assert {"id", "text", "token_ids", "model_calls", "new_tokens", "call_reduction", "seconds"} <= set(fast)
        assert fast["token_ids"] == plain["token_ids"] and fast["text"] == plain["text"]
        assert plain["model_calls"] == plain["new_tokens"] and plain["call_reduction"] == 1.0
        assert fast["call_reduction"] == fast["new_tokens"] / fast["model_calls"]
    trace = json.loads((tmp_path / "ss.json").read_text())
    assert trace["schema"] == "streamfuse.trace/2" and len(trace["runs"]) == 3
    assert trace["meta"]["tree"]["num_nodes"] == 5  # the default tree [[0],[1],[0,0],[0,0,0]] and its root


def test_plain_prompt_and_bad_inputs(checkpoint, capsys, tmp_path):
    records = run_cli(capsys, "--artifact", str(checkpoint / "ckpt"), "--prompt", "the water", "--max-new-tokens", "5", "--json")
    assert len(records) == 1 and records[0]["new_tokens"] <= 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"dialogue": "x"}\n{"other": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: lacks field 'dialogue'"):
        generate.main(["--artifact", str(checkpoint / "ckpt"), "--task", "dialogsum", "--input-file", str(bad)])
    with pytest.raises(SystemExit, match="fine-tuned for 'dialogsum'"):
        generate.main(["--artifact", str(checkpoint / "ckpt"), "--task", "e2e_nlg", "--prompt", "x"])
    with pytest.raises(FileNotFoundError, match="neither manifest.json .* nor streamfuse.json"):
        generate.main(["--artifact", str(tmp_path), "--prompt", "x"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate.main(["--artifact", str(checkpoint / "ckpt"), "--prompt", "x", "--max-new-tokens", "0"])
