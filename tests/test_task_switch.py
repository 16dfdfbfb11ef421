"""Several tasks on one base: q4-native graphs take a task's tensors as inputs (export/task_inputs.py), a second
task's build adds only its tensor files to the first's artifact, and switching tasks on a loaded engine gives each
task's own outputs bit for bit against a single-task artifact of that task."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamfuse.adapters.masks import causal_mask
from streamfuse.export.artifact import ArtifactBuilder, ExportConfig
from streamfuse.runtime.artifact.format import LOCK, Artifact, ArtifactError, file_digest
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig

from conftest import write_checkpoint
from tiny_export import DRAFT, build_beside, prompts

RULES = StopRules(16)


def config(backends: tuple[str, ...], task_inputs: bool) -> ExportConfig:
    return ExportConfig(
        backends=backends,
        trees=("gamma=3,k=1",),
        buckets=(4,),
        capacity=128,
        prefill_chunk=16,
        quantize="q4-native",
        parity_prompts=3,
        greedy_schedule="fused",
        task_inputs=task_inputs,
    )


def second_task(checkpoint, folder, task: str = "e2e_nlg"):
    """A copy of `checkpoint` trained "for another task": its LoRA and streams moved, its info naming `task`."""
    shutil.copytree(checkpoint, folder)
    generator = torch.Generator().manual_seed(1)
    for file in [*folder.glob("lora/*.safetensors"), folder / "streams.safetensors"]:
        tensors = load_file(file)
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}, str(file))
    manifest = json.loads((folder / "streamfuse.json").read_text())
    manifest["info"] = {
        **manifest["info"],
        "task": task,
        "training_key": f"{task}-key",
        "prompt": {**manifest["info"]["prompt"], "instruction_template": "describe {source}"},
    }
    (folder / "streamfuse.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    # two layers: lowering time grows with depth
    root = write_checkpoint(tmp_path_factory.mktemp("tasks"), layers=2, msa_layers=1, gguf=True)
    return {"dialogsum": root / "ckpt", "e2e_nlg": second_task(root / "ckpt", root / "ckpt-e2e")}


@pytest.fixture(scope="module", params=["onnxruntime", "executorch"])
def built(request, tasks, tmp_path_factory):
    """Per engine: `both`, dialogsum's artifact built for several tasks with e2e_nlg added; `alone`, e2e_nlg's own
    artifact in the one-task layout (the task's weights inside the graphs), built beside them."""
    backend = request.param
    pytest.importorskip(backend, reason=f"the {backend} extra is not installed")
    root = tmp_path_factory.mktemp(backend)
    alone = build_beside(tasks["e2e_nlg"], root / "alone", config((backend,), task_inputs=False), prompts(3), 16)
    first = build(tasks["dialogsum"], root / "both", (backend,), task_inputs=True)
    first["digests"] = digests(root / "both")  # the one-task artifact's files, before the second task joins
    added = build(tasks["e2e_nlg"], root / "both", (backend,), task_inputs=True)
    alone.result()
    return backend, root, first, added


def digests(folder) -> dict[str, tuple[int, str]]:
    return {
        str(f.relative_to(folder)): (f.stat().st_size, file_digest(f)["sha256"])
        for f in folder.rglob("*")
        if f.is_file() and f.name != LOCK
    }  # the lock file: made by the first write


def build(checkpoint, out, backends, task_inputs: bool):
    return ArtifactBuilder(checkpoint, out, config(backends, task_inputs), prompts(3), 16, {}, DRAFT).build()


def decoded(loaded, count: int = 3) -> list[list[int]]:
    """Plain and SS tokens, greedy and sampled, on a few prompts: SS == plain is checked on the way."""
    sampled = SamplingConfig(temperature=0.9, top_k=20)
    result = []
    for seed, ids in enumerate(prompts(count, seed=5)):
        for sampling in (SamplingConfig(), sampled):
            plain = generate(loaded.backend, ids, DecodeSettings("ar", RULES, sampling=sampling, seed=seed)).token_ids
            ss = generate(
                loaded.backend, ids, DecodeSettings("ss", RULES, tree=loaded.tree, sampling=sampling, seed=seed)
            ).token_ids
            assert ss == plain
            result.append(plain)
    return result


def test_two_tasks_share_the_base_graphs_and_switch_bit_for_bit(built):
    backend, root, first, added = built
    both, alone = root / "both", root / "alone"
    opened = Artifact.open(both)
    assert opened.tasks == ("dialogsum", "e2e_nlg") and added["task"] == "e2e_nlg"
    # one base: every file of the one-task artifact stays as it was; the second task adds its own folder only
    now, before = digests(both), first["digests"]
    assert {name: now[name] for name in before if name != "manifest.json"} == {
        name: digest for name, digest in before.items() if name != "manifest.json"
    }
    assert {name for name in now if name not in before} == {name for name in now if name.startswith("tasks/e2e_nlg/")}
    assert opened.manifest["files"] == first["files"]
    assert added["parity"][backend]["ss_equals_own_plain"] == 3
    assert added["task_files"][backend]["path"] == f"tasks/e2e_nlg/{backend}.safetensors"
    single = decoded(load(alone, backend))  # the task's weights inside the graphs
    other = decoded(load(both, backend, task="dialogsum"))
    assert single != other  # the tasks' tensors differ: outputs tell them apart
    loaded = load(both, backend)
    assert loaded.tasks == ("dialogsum", "e2e_nlg")
    switched = loaded.with_task("e2e_nlg")
    assert switched.backend is loaded.backend and switched.prompt.instruction_template == "describe {source}"
    assert decoded(switched) == single
    assert decoded(switched.with_task("dialogsum")) == other
    assert decoded(loaded.with_task("e2e_nlg")) == single
    # torch: both tasks' adapters on one unmerged base, switched in place (TaskSet), gives a fresh load's tokens
    # (the same arithmetic) and the one-task artifact's (its LoRA merged); the model's states bit for bit
    on_torch = load(both, "torch")
    assert on_torch.backend.tasks.tasks == ("dialogsum", "e2e_nlg")
    switched = on_torch.with_task("e2e_nlg")
    assert switched.backend is on_torch.backend
    fresh = load(both, "torch", task="e2e_nlg")
    assert decoded(switched) == decoded(fresh) == decoded(load(alone, "torch"))
    assert torch.equal(states(switched), states(fresh))
    assert torch.equal(states(switched.with_task("dialogsum")), states(load(both, "torch")))
    # the artifact with two tasks: one task's files plus the second's own (the manifest, a few KB, grows by its record)
    files = lambda digests: sum(size for name, (size, _) in digests.items() if name != "manifest.json")  # noqa: E731
    assert files(now) <= files(before) + 1.05 * size(both / "tasks" / "e2e_nlg")


def states(loaded) -> torch.Tensor:
    """A prompt's main-stream, stream and pruning-head states through the torch model, streams at every token."""
    ids = torch.tensor([prompts(1, seed=7)[0]])
    mask = causal_mask(torch.ones_like(ids))
    with torch.no_grad():
        out = loaded.backend.model(
            ids, torch.arange(ids.shape[1])[None], mask, anchors=torch.arange(ids.shape[1])[None], with_pruning=True
        )
    return torch.cat([out.hidden.flatten(), out.stream_hidden.flatten(), out.pruning_hidden.flatten()])


def size(folder) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_a_corrupted_task_file_or_an_unknown_task_is_one_line_naming_it(built, tmp_path):
    backend, root, _, _ = built
    out = tmp_path / "both"
    shutil.copytree(root / "both", out)
    loaded = load(out, backend)
    with pytest.raises(ArtifactError, match=r"has no task 'sql' \(its tasks: dialogsum, e2e_nlg\)"):
        loaded.with_task("sql")
    file = out / "tasks" / "e2e_nlg" / f"{backend}.safetensors"
    file.write_bytes(file.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(
        ArtifactError,
        match=rf"{backend}.safetensors: task e2e_nlg's tensors for {backend} are "
        r"missing or differ from the manifest",
    ) as error:
        loaded.with_task("e2e_nlg")
    assert "\n" not in str(error.value)
    with pytest.raises(ArtifactError, match="e2e_nlg's tensors"):
        load(out, backend, task="e2e_nlg")


def test_graphs_holding_a_task_refuse_another(built, tasks, tmp_path):
    """A one-task artifact (the weights inside its graphs) is not replaced by another task's build: the error says
    how to build both."""
    backend, root, _, _ = built
    out = tmp_path / "alone"
    shutil.copytree(root / "alone", out)
    with pytest.raises(
        ArtifactError,
        match=r"serves task e2e_nlg, and task dialogsum cannot join it: its graphs "
        r"hold its task's weights .* build the tasks together "
        r"\(--task e2e_nlg,dialogsum\)",
    ):
        build(tasks["dialogsum"], out, (backend,), task_inputs=False)
    with pytest.raises(ValueError, match="export.task_inputs .* needs graphs without the task's weights"):
        ExportConfig(task_inputs=True, quantize="none").validate()


def test_the_demo_session_switches_tasks_without_loading_again(built):
    from streamfuse.apps.demo_controller import DemoController, LoadRequest  # the demo's model side, without Qt

    backend, root, _, _ = built
    controller = DemoController()
    first = controller.load(LoadRequest(root / "both", backend))
    assert controller.tasks() == ("dialogsum", "e2e_nlg") and "(dialogsum" in controller.describe()
    switched = controller.load(LoadRequest(root / "both", backend, task="e2e_nlg"))
    assert (
        switched.backend is first.backend and controller.tasks()[0] == "e2e_nlg" and "(e2e_nlg" in controller.describe()
    )
    assert controller.load(LoadRequest(root / "both", backend)).tasks[0] == "dialogsum"  # None: the artifact's own


def test_memory_tool_times_each_switch_and_its_rss(built):
    from streamfuse.tools import memory

    backend, root, _, added = built
    row = memory.measure_backend(root / "both", backend, None, 1, 1, 8)
    assert [s["task"] for s in row["switches"]] == ["e2e_nlg", "dialogsum"]  # to the other task and back
    assert all(s["seconds"] > 0 for s in row["switches"])
    assert row["switches"][0]["task_file_bytes"] == added["task_files"][backend]["bytes"]
    assert "| switch to task |" in memory.markdown([row])


def test_task_switch_tool_decodes_each_task_after_switching(built, tmp_path, monkeypatch):
    from streamfuse.tools import bench_data, task_switch

    from conftest import write_tiny_dialogsum

    backend, root, _, _ = built
    data = write_tiny_dialogsum(tmp_path / "data")  # both tiny tasks read dialogues ("{dialogue}")
    monkeypatch.setattr(bench_data, "task_file", lambda task, split, data_dir=None: data / "dialogsum.test.jsonl")
    result = task_switch.measure_backend(root / "both", backend, 2, 1, 8)
    assert [v["task"] for v in result["visits"]] == ["e2e_nlg", "dialogsum"]  # to the other task and back
    assert all(v["ss_equals_plain"] == v["inputs"] == 2 and v["switch_seconds"] > 0 for v in result["visits"])
    assert "| e2e_nlg |" in task_switch.markdown([result])


def test_generate_takes_the_task_from_the_artifact(built, capsys):
    from streamfuse.runtime.commands import errors, generate

    backend, root, _, _ = built
    argv = [
        "--artifact",
        str(root / "both"),
        "--backend",
        backend,
        "--prompt",
        "a b c",
        "--max-new-tokens",
        "4",
        "--json",
    ]
    for task in ("e2e_nlg", "dialogsum"):
        assert generate.main([*argv, "--task", task]) == 0
    capsys.readouterr()
    assert errors.run(generate.main, [*argv, "--task", "sqlcontext"], prog="generate") == 2
    err = capsys.readouterr().err
    assert "generate: error: --task sqlcontext: " in err and "serves dialogsum, e2e_nlg; use that task name" in err


def test_torch_task_set_refuses_tasks_on_another_base_or_unknown(tasks, tmp_path):
    from streamfuse.adapters.checkpoint import load_checkpoint
    from streamfuse.adapters.task_set import TaskSet

    model, _, manifest = load_checkpoint(tasks["dialogsum"], adapter_name="dialogsum")
    task_set = TaskSet(model, manifest, "dialogsum")
    other = shutil.copytree(tasks["e2e_nlg"], tmp_path / "other")
    record = json.loads((other / "streamfuse.json").read_text())
    record["streams"]["num_streams"] += 1
    (other / "streamfuse.json").write_text(json.dumps(record))
    with pytest.raises(
        ValueError, match="task e2e_nlg's streams differs from task dialogsum's, so the two cannot share one base model"
    ):
        task_set.add("e2e_nlg", other)
    task_set.add("e2e_nlg", tasks["e2e_nlg"])
    assert task_set.tasks == ("dialogsum", "e2e_nlg") and task_set.active == "dialogsum"
    with pytest.raises(ValueError, match=r"task 'sql' is not loaded \(loaded: dialogsum, e2e_nlg\)"):
        task_set.use("sql")
