"""The build's stage and export of a fused drafter (methods/fused/model.py: ParallelSpec's, Falcon's): trained on
the frozen SS model's own answers with its head cut to the tokens they use most, then its pass exported as a graph
for each of the artifact's engines beside its weights and installed into the artifact."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamfuse.adapters.checkpoint import load_checkpoint
from streamfuse.export.artifact import ExportConfig, install_drafter
from streamfuse.methods.fused.model import DrafterFiles, FusedDrafter
from streamfuse.methods.fused.train import answer_states, embed_scale
from streamfuse.runtime.artifact.durable import replace_folder
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.stage import OutputFormat, Stage
from streamfuse.training.stages import target_stage

if TYPE_CHECKING:
    from streamfuse.training.pipeline import Build

GRAPH_ENGINES = ("executorch", "onnxruntime")  # the engines a drafter pass is exported for


def fused_stage(
    build: Build,
    ss_dir: Path,
    section: str,
    files: DrafterFiles,
    make: Callable[[torch.nn.Module, torch.Tensor], FusedDrafter],
    train: Callable[..., dict],
    *runtime_choices: str,
) -> Path:
    """<run>/<section>: make(model, kept ids) the drafter, its layer a copy of the SS model's last and its fused
    input scaled to the target's states; train(drafter, embed, items, states) on the SS model's own answers (the
    unlabelled inputs' too where the section says so), its head cut to the section's `vocab` tokens most frequent in
    them and their prompts. Keyed on target_stage_inputs, the section's recipe without `runtime_choices` (the
    settings of its export and its run, which change nothing that trains)."""
    config = build.config.section(section)

    def fit(folder: Path, stage: Stage, target_key: str, states, items, answers: int) -> str:
        vocab = build.vocab(f"{section} head", [item.input_ids for item in items], config.vocab)
        eager, _, _ = load_checkpoint(ss_dir, build.args.base_model, merge_lora=True)
        ids = torch.tensor(vocab.ids) if vocab is not None else torch.arange(eager.parts.vocab_size)
        torch.manual_seed(build.config.train.seed)
        drafter = make(eager.model, ids)
        drafter.start_fused(embed_scale(states, eager.parts.embed))
        result = train(drafter, eager.parts.embed, items, states)
        coverage = None if vocab is None else round(vocab.coverage, 4)
        files.save(
            drafter,
            folder,
            {
                "training_key": stage.key,
                "target": target_key,
                "answers": len(items),
                "vocab_coverage": coverage,
                **result,
            },
        )
        return (
            f"{result['seconds'] / 60:.1f} min on {len(states.hidden)} positions of {len(items)} of {answers} "
            f"own answers"
        )

    output = OutputFormat(files.manifest, files.read_manifest)
    return target_stage(build, ss_dir, section, section, output, "answer-states", answer_states, fit, *runtime_choices)


# write(model, embed, engines, folder) -> the drafter's manifest entry (its graphs written into folder)
Write = Callable[[torch.nn.Module, torch.nn.Module, list[str], Path], dict]


def install_fused(
    build: Build,
    artifact: Path,
    section: str,
    files: DrafterFiles,
    trained: Path,
    ss_dir: Path,
    export: ExportConfig,
    key: list,
    write: Write,
    tree: TreeSpec,
) -> dict:
    """The trained drafter's graphs exported (exported_drafter) and installed into the artifact as drafters/<section>
    with `tree`; key: the export settings its graphs depend on -> its manifest entry."""
    training_key = files.read_manifest(trained)["info"]["training_key"]
    folder, entry = exported_drafter(build, section, trained, ss_dir, export, [training_key, *key], write)
    install_drafter(artifact, section, folder, {**entry, "tree": tree.to_dict(), "training_key": training_key})
    return entry


def exported_drafter(
    build: Build, section: str, trained: Path, ss_dir: Path, export: ExportConfig, key: list, write: Write
) -> tuple[Path, dict]:
    """<run>/<section>-export: the trained drafter's folder plus what write(model, embed, engines, folder) adds
    (its graphs), made in a staging folder and reused while `key` and the engines are the same."""
    out = build.run_dir / f"{section}-export"
    engines = [b for b in export.backends if b in GRAPH_ENGINES]
    key = [*key, engines]
    done = out / "export.json"
    if done.is_file() and json.loads(done.read_text())["key"] == key:
        print(f"[{section}] reusing the drafter's graphs in {out}", flush=True)
        return out, json.loads(done.read_text())["entry"]
    staging = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(trained, staging)
    eager, _, _ = load_checkpoint(ss_dir, build.args.base_model, merge_lora=True)
    quantize = build.config.section(section).quantize
    print(f"[{section}] exporting the drafter ({', '.join(engines) or 'no graph engine'}; {quantize})", flush=True)
    entry = write(eager.model, eager.parts.embed, engines, staging)
    (staging / "export.json").write_text(json.dumps({"key": key, "entry": entry}, indent=2))
    replace_folder(staging, out)  # the old export deleted once the new one is in place
    return out, entry
