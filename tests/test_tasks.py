"""Task layer: loading, validation errors, data location, metrics, registry.

Fast and offline: tiny files under tmp_path, a fake `datasets` module for the
hub path, and the shared local copies (skipped when absent) for real counts.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from streamfuse.metrics.bleu import bleu
from streamfuse.metrics.rouge import rouge, split_sentences
from streamfuse.metrics.sql import exact_match, normalize_sql
from streamfuse.training.tasks import TASKS, DataError, Example, Task, base, get_task
from streamfuse.training.tasks.e2e_nlg import held_out

DIALOGSUM = get_task("dialogsum")
E2E = get_task("e2e_nlg")
SQL = get_task("sqlcontext")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sql_rows(n: int) -> list[dict]:
    return [
        {"question": f"q{i}?", "context": f"CREATE TABLE t{i} (a INT)", "answer": f"SELECT a FROM t{i}"}
        for i in range(n)
    ]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No env var, no shared copy, and `import datasets` fails: nothing to fall back on."""
    monkeypatch.delenv(base.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(base, "SHARED_DATA_ROOT", tmp_path / "no-shared-data")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    return tmp_path


# --- malformed input ----------------------------------------------------------


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "dialogsum.train.jsonl", [{"fname": "a", "dialogue": "d", "summary": "s"}])
    with path.open("a", encoding="utf-8") as f:
        f.write('{"fname": "b", "dialogue": \n')
    with pytest.raises(DataError, match=r"dialogsum\.train\.jsonl, line 2: invalid JSON"):
        DIALOGSUM.load("train", data_dir=tmp_path)


def test_missing_field_names_field_and_line(tmp_path: Path) -> None:
    rows = [{"fname": "a", "dialogue": "d", "summary": "s"}, {"fname": "b", "dialogue": "d"}]
    write_jsonl(tmp_path / "dialogsum.dev.jsonl", rows)
    with pytest.raises(DataError, match=r"dialogsum\.dev\.jsonl, line 2: missing field 'summary'"):
        DIALOGSUM.load("validation", data_dir=tmp_path)


def test_empty_field_is_rejected(tmp_path: Path) -> None:
    row = {"fname": "t", "dialogue": "d", "summary1": "x", "summary2": "  ", "summary3": "z"}
    write_jsonl(tmp_path / "dialogsum.test.jsonl", [row])
    with pytest.raises(DataError, match=r"line 1: field 'summary2' is empty"):
        DIALOGSUM.load("test", data_dir=tmp_path)


def test_missing_csv_column(tmp_path: Path) -> None:
    (tmp_path / "testset_w_refs.csv").write_text('mr,text\n"name[A]",A is nice.\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"testset_w_refs\.csv: missing CSV column\(s\) 'ref'"):
        E2E.load("test", data_dir=tmp_path)


def test_csv_empty_cell_names_row(tmp_path: Path) -> None:
    (tmp_path / "devset.csv").write_text('mr,ref\n"name[A]",A is nice.\n"name[B]",\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"devset\.csv, row 2 \(line 3\): field 'ref' is empty"):
        E2E.load("train", data_dir=tmp_path)


# --- data location ------------------------------------------------------------


def test_sqlcontext_offline_without_data_explains_how_to_supply(offline: Path) -> None:
    with pytest.raises(DataError) as err:
        SQL.load("test")
    message = str(err.value)
    for expected in (
        "sql_create_context.jsonl",
        "no-shared-data",
        "'datasets' package",
        "--data-dir",
        "question, context",
    ):
        assert expected in message


def test_hub_failure_is_reported_as_data_error(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*args: object, **kwargs: object) -> None:
        raise ConnectionError("hub unreachable")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(DataError, match="hub unreachable"):
        SQL.load("train")


def test_explicit_data_dir_never_falls_back_to_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("hub was contacted")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=must_not_run))
    with pytest.raises(DataError, match="not tried because --data-dir"):
        SQL.load("train", data_dir=tmp_path)


def test_env_var_dir_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sqlcontext").mkdir()
    write_jsonl(tmp_path / "sqlcontext" / "sql_create_context.jsonl", sql_rows(3))
    monkeypatch.setenv(base.DATA_DIR_ENV, str(tmp_path))
    assert [e.id for e in SQL.load("train")] == ["sql-0", "sql-1", "sql-2"]


def test_data_dir_may_be_the_parent_of_task_folders(tmp_path: Path) -> None:
    (tmp_path / "sqlcontext").mkdir()
    write_jsonl(tmp_path / "sqlcontext" / "sql_create_context.jsonl", sql_rows(3))
    assert len(SQL.load("train", data_dir=tmp_path)) == 3


def test_hub_test_rows_are_merged_per_dialogue(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = [{"id": f"test_0_{k}", "dialogue": "#P1#: hi", "summary": f"s{k}"} for k in (1, 2, 3)]
    hub.append({"id": "test_1_1", "dialogue": "#P1#: bye", "summary": "t1"})
    fake = types.SimpleNamespace(load_dataset=lambda hub_id, split, revision: hub)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    examples = DIALOGSUM.load("test")
    assert examples[0] == Example("test_0", "#P1#: hi", ("s1", "s2", "s3"))
    assert [e.id for e in examples] == ["test_0", "test_1"]


# --- task-specific loading ----------------------------------------------------


def test_sqlcontext_carving_is_disjoint_and_limited(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "sql_create_context.jsonl", sql_rows(30))
    splits = {s: SQL.load(s, data_dir=tmp_path) for s in ("train", "validation", "test")}
    assert [len(v) for v in splits.values()] == [24, 3, 3]
    assert splits["test"][-1].id == "sql-29" and splits["validation"][0].id == "sql-24"
    assert splits["train"][0].source == "Schema: CREATE TABLE t0 (a INT)\nQuestion: q0?"
    assert [e.id for e in SQL.load("train", data_dir=tmp_path, limit=2)] == ["sql-0", "sql-1"]


def test_sqlcontext_json_array_file(tmp_path: Path) -> None:
    (tmp_path / "sql_create_context.json").write_text(json.dumps(sql_rows(2) + [{"question": "q"}]), encoding="utf-8")
    with pytest.raises(DataError, match=r"element \[2\]: missing field 'context'"):
        SQL.load("train", data_dir=tmp_path)


def test_e2e_groups_refs_and_splits_by_mr(tmp_path: Path) -> None:
    mrs = [f"name[R{i}], food[Thai]" for i in range(40)]
    lines = ["mr,ref"] + [f'"{mr}","{mr} ref {k}."' for mr in mrs for k in range(2)]
    (tmp_path / "devset.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "testset_w_refs.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    train, val = E2E.load("train", data_dir=tmp_path), E2E.load("validation", data_dir=tmp_path)
    assert {e.source for e in train}.isdisjoint(e.source for e in val)
    assert len(train) + 2 * len(val) == 80
    assert all(len(e.references) == 2 for e in val)
    test = E2E.load("test", data_dir=tmp_path)
    assert len(test) == 40 and test[1] == Example("e2e-test-2", mrs[1], (f"{mrs[1]} ref 0.", f"{mrs[1]} ref 1."))


def test_duplicate_ids_are_rejected(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "dialogsum.train.jsonl", [{"fname": "x", "dialogue": "d", "summary": "s"}] * 2)
    with pytest.raises(DataError, match="duplicate example id 'x'"):
        DIALOGSUM.load("train", data_dir=tmp_path)


# --- metrics ------------------------------------------------------------------


# predictions, references per prediction -> corpus BLEU (sacrebleu, 13a, case-sensitive)
BLEU_TABLE = [
    (["the cat sat on the red mat today"], [("the cat sat on the red mat today",)], 100.0),
    (["the cat sat on the red mat today"], [("a dog ran far away from home now",)], 0.0),
    # a second reference that matches exactly lifts the segment to 100; the shorter MR leaves its slot empty
    (
        ["the cat sat on the mat", "a dog ran in the park"],
        [("the cat sat on the mat",), ("a dog ran in the big park", "a dog ran in the park")],
        100.0,
    ),
    (
        ["the cat sat on the mat", "a dog ran in the park"],
        [("the cat sat on the mat",), ("a dog ran in the big park",)],
        82.81,
    ),
]


@pytest.mark.parametrize(("predictions", "references", "expected"), BLEU_TABLE)
def test_bleu_scores_each_prediction_against_all_its_references(predictions, references, expected) -> None:
    assert bleu(predictions, references)["bleu"] == pytest.approx(expected, abs=0.01)


def test_e2e_scores_rouge_and_bleu() -> None:
    scores = E2E.score(["The Eagle is a cheap pub."], [("The Eagle is a cheap pub.",)])
    assert set(E2E.headline_metrics) == {"rouge1", "rougeLsum", "bleu"} and scores["bleu"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="2 predictions for 1 reference sets"):
        bleu(["a", "b"], [("a",)])


def test_rouge_multi_reference_takes_the_best() -> None:
    refs = ("A man buys a train ticket.", "Tom orders pizza for dinner tonight.", "Two friends talk about the weather.")
    scores = rouge(["Tom orders pizza for dinner tonight."], [refs])
    assert scores == pytest.approx({"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0, "rougeLsum": 100.0})
    assert rouge(["Tom orders pizza for dinner tonight."], [refs[:1]])["rouge1"] < 30


def test_rouge_lsum_uses_sentence_splitting() -> None:
    scores = rouge(["The dog ran away. The cat sat down."], [("The cat sat down. The dog ran away.",)])
    assert scores["rougeLsum"] == pytest.approx(100.0)
    assert scores["rougeL"] < 60


def test_sentence_splitter_keeps_abbreviations() -> None:
    text = "Mr. Smith sees Dr. Hawkins! He is fine? Yes.\nNew line"
    assert split_sentences(text) == ["Mr. Smith sees Dr. Hawkins!", "He is fine?", "Yes.", "New line"]


def test_exact_match_normalisation() -> None:
    assert normalize_sql("  SELECT  name\nFROM t ;; ") == "select name from t"
    preds = ["select NAME from t", "SELECT age FROM t"]
    refs = [("SELECT name FROM t;",), ("SELECT name FROM t",)]
    assert exact_match(preds, refs) == {"exact_match": 50.0}


def test_score_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 predictions but 1"):
        SQL.score(["a", "b"], [("a",)])


# --- registry -----------------------------------------------------------------


def test_get_task_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError, match="unknown task 'samsum'; known tasks: dialogsum, e2e_nlg, sqlcontext"):
        get_task("samsum")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_registry_entries_are_consistent(name: str) -> None:
    task = get_task(name)
    assert isinstance(task, Task) and task.name == name
    example = Example("x", "SOURCE-TEXT", ("select a from t",))
    assert task.instruction_template.count("{source}") == 1  # where the runtime puts the source (PromptFormat)
    scores = task.score(["select a from t"], [example.references])
    assert set(task.headline_metrics) <= set(scores)
    assert all(v == pytest.approx(100.0) for v in scores.values())


# --- real shared data (skipped where there is no local copy) ------------------


def shared(task: str) -> Path:
    path = base.SHARED_DATA_ROOT / task
    if not path.is_dir():
        pytest.skip(f"no shared copy at {path}")
    return path


def test_real_dialogsum_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    shared("dialogsum")
    monkeypatch.delenv(base.DATA_DIR_ENV, raising=False)
    assert len(DIALOGSUM.load("train")) == 601
    assert len(DIALOGSUM.load("validation")) == 500
    test = DIALOGSUM.load("test")
    assert len(test) == 500 and all(len(e.references) == 3 for e in test)
    assert test[0].id == "test_0"


def test_real_e2e_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    shared("e2e_nlg")
    monkeypatch.delenv(base.DATA_DIR_ENV, raising=False)
    test = E2E.load("test")
    assert len(test) == 630 and sum(len(e.references) for e in test) == 4693
    train, val = E2E.load("train"), E2E.load("validation")
    assert len(train) + sum(len(e.references) for e in val) == 4672
    assert 30 <= len(val) <= 80  # ~10% of 547 distinct MRs
    assert all(held_out(e.source) for e in val) and not any(held_out(e.source) for e in train)


def test_dialogsum_unlabelled_dialogues_load_without_references(tmp_path):
    from streamfuse.training.tasks import get_task
    from streamfuse.training.tasks.base import UNLABELLED

    from conftest import write_tiny_dialogsum

    data = write_tiny_dialogsum(tmp_path / "data")
    rows = get_task("dialogsum").load(UNLABELLED, data)
    assert [ex.id for ex in rows] == [f"unlabelled_{i}" for i in range(4)]
    assert all(ex.references == () and ex.source.startswith("#Person1#:") for ex in rows)
    with pytest.raises(ValueError, match="unknown split 'unlabelled' for task e2e_nlg"):
        get_task("e2e_nlg").load(UNLABELLED, data)
