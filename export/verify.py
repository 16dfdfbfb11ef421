"""Parity of an exported backend against torch eager, recorded in the artifact manifest.

Two checks per backend, on the same prompts:
- tokens: greedy SS on the backend equals greedy SS on the torch eager model (and its own plain
  greedy decoding), token for token;
- step outputs: every call the backend made, replayed through the eager graph modules with the
  same inputs, differs by at most the tolerance (max |diff| per output name is recorded; integer
  outputs, greedy_step's token ids, must be equal: their figure is the count of differing ids; the
  drafts, a top-K of the stream states, are counted but not judged: their states are, and ranks 8-9 of
  a 49k vocabulary tie within float tolerance).
The first numeric prompt runs the separate step + streams calls (what sampling uses), the others
greedy_step. The artifact's other draft trees decode the first `plain_prompts` prompts too, each
against the backend's own plain decoding (lossless on every tree calibration may pick). A chain
deeper than the streams (the draft-model methods' verification graphs) is drafted from the known
answer instead, its last draft spoiled every other step, so its graph both commits whole chains and
rejects. A method that adds to the graphs (Medusa's heads method) checks its part too (its graph
module's main_graph_parity), recorded under its name.
Every differing prompt is recorded with its first differing token; `check_parity` refuses the
artifact on any (a low-bit format: on any against its own plain decoding; docs/export.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from streamfuse.export.eager import TorchBackend
from streamfuse.methods.ar import METHOD as PLAIN
from streamfuse.methods.sd import METHOD as CHAIN  # a chain drafted beside the streams: the draft-model methods'
from streamfuse.methods.ss import METHOD as SS
from streamfuse.runtime.artifact.contract import CACHE_INPUTS, GraphSpec, input_names, output_names
from streamfuse.runtime.backends.static_graph import GraphRunner, StaticGraphBackend
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec

# Absolute tolerance per output, relative to the output's largest magnitude (fp32 graphs).
RELATIVE_TOLERANCE = 1e-4
EAGER, OWN_PLAIN = "SS vs torch eager fp32", "SS vs its own plain decoding"


class ParityError(ValueError):
    """An exported backend is not lossless: the build refuses the artifact."""


class EagerRunner:
    """The graph modules run by torch eager: the reference every exported engine must match."""

    name = "torch:eager-graph"

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules

    @torch.inference_mode()
    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        outputs = self.modules[method](*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs))
        return [out.numpy() for out in (outputs if isinstance(outputs, tuple) else [outputs])]


class ReplayRunner:
    """Wraps a graph runner; replays each call through the reference and keeps the largest differences. Where the engine
    keeps the cache, the reference runs on a copy of it, and the two caches after the call are compared too (the
    rows the call wrote and moved: "keys", "values")."""

    def __init__(self, runner: GraphRunner, reference: GraphRunner, engine_cache: bool):
        self.runner, self.reference, self.engine_cache = runner, reference, engine_cache
        self.name = runner.name
        self.max_diff: dict[str, float] = {}
        self.max_ref: dict[str, float] = {}

    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        copies = [a.copy() for a in inputs]  # the reference's own: a call may write its cache
        if not self.engine_cache:
            inputs = [a.copy() for a in inputs]  # the host mutates its cache after the call
        outputs = [out.copy() for out in self.runner.run(method, inputs)]  # an engine may reuse its buffers
        compared = list(zip(output_names(method, self.engine_cache), outputs, self.reference.run(method, copies)))
        if self.engine_cache:
            names = input_names(method, True)
            compared += [(name, inputs[names.index(name)], copies[names.index(name)]) for name in CACHE_INPUTS]
        for name, out, ref in compared:
            key = f"{method}.{name}"
            exact = not np.issubdtype(ref.dtype, np.floating)
            diff = float((out != ref).sum()) if exact else float(np.abs(out.astype(np.float32) - ref).max())
            self.max_diff[key] = max(self.max_diff.get(key, 0.0), diff)
            self.max_ref[key] = None if exact else max(self.max_ref.get(key, 0.0), float(np.abs(ref).max()))
        return outputs


def eager_tokens(eager: TorchBackend, tree, prompts: Sequence[Sequence[int]], rules: StopRules) -> list[list[int]]:
    """Greedy SS tokens of the torch eager model: the reference of every backend's token parity."""
    return [generate(eager, ids, DecodeSettings(SS.name, rules, tree=tree)).token_ids for ids in prompts]


def parity_trees(spec: GraphSpec, trees: Sequence[TreeSpec]) -> list[TreeSpec]:
    """What parity decodes besides the default tree (trees[0]): the artifact's other trees, a stream tree
    filling each bucket none of them fills, and the chain filling the largest bucket where it is deeper
    than the streams (the draft-model methods verify such chains)."""
    extra = list(trees[1:])
    extra += [
        TreeSpec.filling(rows, spec.num_streams)
        for rows in spec.buckets
        if not any(tree.num_nodes == rows for tree in trees)
    ]
    chain = TreeSpec.chain(spec.max_nodes - 1)
    if chain.depth > spec.num_streams:
        extra.append(chain)
    unique: dict[str, TreeSpec] = {}
    for tree in extra:
        unique.setdefault(tree.hash(), tree)
    return list(unique.values())


def backend_parity(
    runner: GraphRunner,
    reference: EagerRunner,
    spec: GraphSpec,
    trees: Sequence[TreeSpec],
    prompts: Sequence[Sequence[int]],
    expected: Sequence[Sequence[int]],
    rules: StopRules,
    numeric_prompts: int = 2,
    plain_prompts: int = 5,
    relative_tolerance: float | None = RELATIVE_TOLERANCE,
) -> dict:
    """Greedy token parity of `runner` with the default tree (trees[0]) on all prompts against `expected`
    (eager_tokens), its own plain decoding on the first `plain_prompts` (every parity_trees tree too),
    and step-output differences on the first
    `numeric_prompts` (each call replayed through the eager graphs). relative_tolerance None: the
    differences are recorded, not judged (a low-bit format against the fp32 model)."""
    replay = ReplayRunner(runner, reference, spec.engine_cache)
    fast = StaticGraphBackend(runner, spec)
    checked = [StaticGraphBackend(replay, spec, use_greedy_step=False), StaticGraphBackend(replay, spec)]
    mismatches: list[dict] = []

    def same(check: str, index: int, got: list[int], want: Sequence[int]) -> bool:
        position = first_difference(got, want)
        if position is not None:
            mismatches.append({"check": check, "prompt": index, "position": position})
        return position is None

    same_as_eager = same_as_plain = 0
    plain = []
    for index, (ids, want) in enumerate(zip(prompts, expected)):
        backend = checked[min(index, 1)] if index < numeric_prompts else fast
        tokens = generate(backend, ids, DecodeSettings(SS.name, rules, tree=trees[0])).token_ids
        same_as_eager += same(EAGER, index, tokens, want)
        if index < plain_prompts:
            plain.append(generate(fast, ids, DecodeSettings(PLAIN.name, rules)).token_ids)
            same_as_plain += same(OWN_PLAIN, index, tokens, plain[-1])
    others = {}
    for tree in parity_trees(spec, trees):
        streams = tree.depth <= spec.num_streams
        settings = DecodeSettings(SS.name if streams else CHAIN.name, rules, tree=tree)
        others[tree.hash()] = sum(
            same(
                f"{OWN_PLAIN}, tree {tree.hash()}",
                index,
                generate(fast, ids, settings, drafter=None if streams else KnownAnswerDrafter(tree, want)).token_ids,
                want,
            )
            for index, (ids, want) in enumerate(zip(prompts, plain))
        )
    extra = main_graph_parity(checked[1], fast, spec, trees[0], prompts, plain, rules, same)
    tolerance = (
        {}
        if relative_tolerance is None
        else {
            k: 0.0 if ref is None else relative_tolerance * max(1.0, ref)
            for k, ref in replay.max_ref.items()
            if not k.endswith(".drafts")
        }
    )
    return {
        "prompts": len(prompts),
        "ss_equals_torch_eager": same_as_eager,
        "plain_prompts": min(plain_prompts, len(prompts)),
        "ss_equals_own_plain": same_as_plain,
        "other_trees": {"prompts": len(plain), "ss_equals_own_plain": others},
        **extra,
        "numeric_prompts": min(numeric_prompts, len(prompts)),
        "tolerance": tolerance,
        "max_abs_diff": replay.max_diff,
        "mismatches": mismatches,
        "within_tolerance": None
        if relative_tolerance is None
        else all(replay.max_diff[k] <= tolerance[k] for k in tolerance),
    }


def main_graph_parity(
    replayed, fast, spec: GraphSpec, default: TreeSpec, prompts, plain, rules: StopRules, same
) -> dict:
    """Each method's check on what it adds to the main graphs (its graph module's `main_graph_parity`, Medusa's
    heads method): {method: its result, None where the graphs lack its part}."""
    results = {}
    for name in registry.names():
        module = registry.part(name, "graph")
        if module is not None and hasattr(module, "main_graph_parity"):
            results[name] = module.main_graph_parity(replayed, fast, spec, default, prompts, plain, rules, same)
    return results


def main_graph_lines(result: dict) -> str:
    """The log's words on each method's main-graph check in a backend_parity result."""
    lines = []
    for name in registry.names():
        module = registry.part(name, "graph")
        if module is not None and hasattr(module, "main_graph_line") and result.get(name) is not None:
            lines.append(module.main_graph_line(result[name]))
    return "".join(lines)


class KnownAnswerDrafter:
    """Drafts a chain from the answer plain decoding gave, spoiling its last draft every other step."""

    uses_streams = False
    name = CHAIN.name

    def __init__(self, tree: TreeSpec, answer: Sequence[int]):
        self.tree, self.answer, self.position, self.steps = tree, list(answer), 0, 0

    def start(self, prompt_ids, prefill, root, capacity) -> int:
        self.position, self.steps = 1, 0  # the root is the answer's first token
        return 0

    def propose(self, root: int) -> Draft:
        depth = self.tree.depth
        drafts = (self.answer[self.position : self.position + depth] + [0] * depth)[:depth]
        self.steps += 1
        if self.steps % 2 == 0:
            drafts[-1] = drafts[-1] - 1 if drafts[-1] else 1
        return Draft(self.tree, [root, *drafts])

    def observe(self, draft: Draft, out, path, correction) -> None:
        self.position += len(path)  # the accepted drafts and the correction


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first token index where two outputs differ (the shorter one's end if one is a prefix); None if equal."""
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return index
    return None if len(got) == len(want) else min(len(got), len(want))


def check_parity(backend: str, result: dict, against_eager: bool, names: Sequence[str] = ()) -> None:
    """ParityError naming the backend, the prompt and the first differing token, unless `result`
    (backend_parity's) is lossless: SS equals its own plain decoding on every tree, and with
    against_eager (fp32 graphs) also torch eager's tokens, every step output within tolerance.
    names: the prompts' input ids (dialogue ids), for the message."""
    failed = [m for m in result["mismatches"] if against_eager or m["check"] != EAGER]
    if failed:
        first = failed[0]
        prompt = names[first["prompt"]] if first["prompt"] < len(names) else f"parity prompt {first['prompt']}"
        raise ParityError(
            f"parity failed on {backend}: {first['check']} differs on {prompt} from generated token "
            f"{first['position']} ({len(failed)} mismatches in all); the artifact was not installed"
        )
    if against_eager and result["within_tolerance"] is False:
        over = sorted(
            k for k, diff in result["max_abs_diff"].items() if diff > result["tolerance"].get(k, float("inf"))
        )
        raise ParityError(
            f"parity failed on {backend}: step outputs {', '.join(over)} differ from torch eager beyond "
            f"tolerance ({RELATIVE_TOLERANCE:g} relative); the artifact was not installed"
        )
