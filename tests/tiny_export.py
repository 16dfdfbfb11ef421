"""The tiny exported artifact the export tests share (tests/conftest.py builds it once per session): its export
config, trees, draft vocabulary and prompts, and helpers that read or copy it."""

import importlib.util
import json
import shutil

import pytest
import torch

from streamfuse.export import worker
from streamfuse.export.artifact import BACKENDS, ArtifactBuilder, ExportConfig, install_drafter, start_lowering
from streamfuse.export.draft_vocab import DraftVocab
from streamfuse.methods.medusa.drafter import heads_tree
from streamfuse.methods.medusa.model import MedusaHeads, save_heads
from streamfuse.runtime.speculation.tree import TreeSpec


def installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in modules)


# export backend -> the packages it needs; a test skips, with the reason, only for what it uses
REQUIRES = {
    "torch": (),
    "executorch": ("executorch",),
    "onnxruntime": ("onnx", "onnxruntime"),
    "coreml": ("coremltools",),
    "executorch_coreml": ("executorch", "coremltools"),
}
HERE = tuple(b for b in BACKENDS if installed(*REQUIRES[b]))


def needs(*backends: str):
    missing = [b for b in backends if b not in HERE]
    return pytest.mark.skipif(bool(missing), reason=f"not installed here: the packages for {', '.join(missing)}")


# runtime backend -> its parametrization, skipped where its packages are missing
EXPORTED = [
    pytest.param("executorch", marks=needs("executorch")),
    pytest.param("onnxruntime", marks=needs("onnxruntime")),
]

# Two trees: the 15-node tree (the default) and the chain, both with streams beside every node (auto
# would pick deferred for 15 nodes, which test_build runs), and a draft vocabulary of 60 of the tiny
# model's 97 tokens; two export processes, as make build runs; two batched steps (3 sequences of the 4-row
# bucket, 4 of decode rows).
CONFIG = ExportConfig(
    backends=HERE,
    trees=("gamma=3,k=2", "gamma=3,k=1"),
    buckets=(4, 15),
    capacity=128,
    prefill_chunk=16,
    parity_prompts=4,
    greedy_schedule="fused",
    workers=2,
    batches="3x4,4x1",
)
TREES = tuple(TreeSpec.parse(tree) for tree in CONFIG.trees)
DRAFT = DraftVocab(tuple(range(20, 80)), coverage=0.5)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in lengths]


def build_artifact(checkpoint, root):
    """The tiny checkpoint (checkpoint/ckpt) exported with Medusa heads (a heads method in the graphs), installed
    as its drafter, at root/artifact."""
    heads = MedusaHeads(2, 32)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    save_heads(heads, root / "medusa", {"training_key": "test-heads"})
    out = root / "artifact"
    arguments = (checkpoint / "ckpt", out, CONFIG, prompts(4), 24, {}, DRAFT, (), root / "medusa")
    # The lowering in halves, one a core: ONNX and Core ML in a worker, ExecuTorch and its Core ML delegate here.
    # (The build's own split, its first backend here and the rest beside it, leaves this process idle for most of
    # the suite's longest fixture when Core ML is installed: its two formats take about as long as the others.)
    beside = [backend for backend in ("onnxruntime", "coreml") if backend in CONFIG.backends]
    here = [backend for backend in CONFIG.backends if backend not in ("torch", *beside)]
    pending = start_lowering(arguments, beside) if beside and here else None
    ArtifactBuilder(*arguments, pending=pending).build()
    install_drafter(
        out,
        "medusa",
        root / "medusa",
        {"tree": heads_tree(TREES[0], 2).to_dict(), "heads": 2, "training_key": "test-heads"},
    )
    return out


def build(checkpoint, out, config: ExportConfig, inputs: list[list[int]], max_new_tokens: int) -> dict:
    """A single-task build of `checkpoint` at `out` with DRAFT: its manifest."""
    return ArtifactBuilder(checkpoint, out, config, inputs, max_new_tokens, {}, DRAFT).build()


def build_beside(checkpoint, out, config: ExportConfig, inputs: list[list[int]], max_new_tokens: int):
    """`build` in a spawned process, started now (a lowering is one core's work: a test with two independent builds
    runs one here and one beside it); the future's result is the manifest."""
    return worker.start(build, checkpoint, out, config, inputs, max_new_tokens)


def manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def copy_of(artifact, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    return target


class Biased:
    """Plain decoding's logits pushed towards one token: the backend is no longer lossless."""

    def __init__(self, session):
        self.session, self.name = session, session.name

    def run(self, method, inputs):
        outputs = self.session.run(method, inputs)
        if method == "decode":
            outputs[0][..., 42] += 100.0
        return outputs


def path_of(tree: TreeSpec, node: int) -> list[int]:
    """The nodes from the root to `node`, root first."""
    path = [node]
    while path[0] != 0:
        path.insert(0, tree.parents[path[0]])
    return path
