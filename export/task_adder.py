"""A task joining an artifact whose graphs another task's build made (ArtifactBuilder's part: export/artifact.py)."""

from __future__ import annotations

import shutil
from datetime import datetime, timezone

from streamfuse.adapters.checkpoint import read_manifest
from streamfuse.export.backend_export import tensors_stage
from streamfuse.export.formats import RUNS_HERE
from streamfuse.runtime.artifact.durable import replace_folder
from streamfuse.runtime.artifact.format import TASKS, Artifact, ArtifactError, lock


class TaskAdder:
    """A task joins an artifact whose graphs another task's build made (the same base, streams and LoRA shape, in a
    format whose graphs take the task's tensors): only its tensor files, its adapter and its parity are new. They are
    staged in <artifact>/tasks/.<task>.partial-<key> and renamed into tasks/<task> once parity passed; the manifest
    then records the task (runtime/artifact/format.py TASK_FIELDS)."""

    def __init__(self, builder):
        self.builder = builder
        self.artifact = Artifact.open(builder.out)
        builder.staging = builder.task_folder = builder.out / TASKS / f".{builder.task}.partial-{builder.key}"
        self.target = builder.out / TASKS / builder.task

    def add(self) -> dict:
        builder, stored = self.builder, self.artifact.manifest
        if builder.task in stored[TASKS] and stored[TASKS][builder.task]["build_key"] == builder.key:
            print(f"[export] reusing task {builder.task} in {builder.out} (same checkpoint and settings)", flush=True)
            return self.artifact.for_task(builder.task).manifest
        unbuilt = {b for b in builder.config.backends if b != "torch"} - set(stored["files"])
        if unbuilt:
            raise ArtifactError(
                f"{builder.out} has no {', '.join(sorted(unbuilt))} graphs to add task {builder.task} "
                f"to; build its own task with those backends first, or leave them out of --backends"
            )
        print(
            f"[export] adding task {builder.task} to {builder.out} (its graphs, task {stored['task']}'s build)",
            flush=True,
        )
        (builder.staging / "done").mkdir(parents=True, exist_ok=True)
        builder.graphs_in = builder.out
        builder._stage("common", self._copy_adapter)
        backends = list(stored["files"])
        files = {
            b: builder._stage(tensors_stage(b, builder.key), lambda b=b: builder._task_file(b))["file"]
            for b in backends
        }
        parity = {b: builder._parity_stage(b, stored["files"][b]) for b in backends if b in RUNS_HERE}
        builder._gate(parity)
        shutil.rmtree(builder.staging / "done")
        with lock(builder.out):  # the folder and its record change together
            replace_folder(builder.staging, self.target)
            self.artifact.add_task(self._fields(files, parity))
        return self.artifact.for_task(builder.task).manifest

    def _copy_adapter(self) -> dict:
        shutil.rmtree(self.builder.task_folder / "adapter", ignore_errors=True)
        shutil.copytree(
            self.builder.checkpoint,
            self.builder.task_folder / "adapter",
            ignore=shutil.ignore_patterns("*.snapshot", "eval", "*.tmp"),
        )
        return {}

    def _fields(self, files: dict, parity: dict) -> dict:
        builder = self.builder
        checkpoint = read_manifest(builder.checkpoint)
        if checkpoint["streams"] != self.artifact.manifest["streams"]:  # the graph key holds them: a broken artifact
            raise ArtifactError(f"task {builder.task}'s streams differ from those of {builder.out}'s graphs")
        return {
            "task": builder.task,
            "prompt": checkpoint["info"].get("prompt"),
            "adapter": builder.adapter_entry(builder.out, f"{TASKS}/{builder.task}/adapter"),
            "task_files": files,
            "trees": [tree.to_dict() for tree in builder.trees],
            "calibration": {"acceptance": None, "backends": {}},
            "drafters": {},
            "parity": parity,
            "build_key": builder.key,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "info": builder.info,
            "profile": None,
        }


def model_shape(trained: dict) -> dict:
    """What a checkpoint's graphs with task inputs depend on (adapters/checkpoint.py streamfuse.json): the base, the
    streams, where the LoRA sits and its rank; not its values."""
    lora = trained["lora"]
    return {
        "base_model": trained["base_model"],
        "base_layers": trained["base_layers"],
        "streams": trained["streams"],
        "lora": {name: lora[name] for name in ("rank", "target_modules", "top_layers")},
    }
