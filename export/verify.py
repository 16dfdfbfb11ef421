"""Parity of an exported backend against torch eager, recorded in the artifact manifest.

Two checks per backend, on the same prompts:
- tokens: greedy SS on the backend equals greedy SS on the torch eager model (and its own plain
  greedy decoding), token for token;
- step outputs: every call the backend made, replayed through the eager graph modules with the
  same inputs, differs by at most the tolerance (max |diff| per output name is recorded; integer
  outputs, greedy_step's token ids, must be equal: their figure is the count of differing ids).
The first numeric prompt runs the separate step + streams calls (what sampling uses), the others
greedy_step. The artifact's other draft trees decode the first `plain_prompts` prompts too, each
against the backend's own plain decoding (lossless on every tree calibration may pick).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from streamfuse.runtime.autoregressive import generate_autoregressive
from streamfuse.runtime.backends.pytorch import TorchBackend
from streamfuse.runtime.backends.static_graph import OUTPUT_NAMES, GraphSpec, Session, StaticGraphBackend, base_method
from streamfuse.runtime.decode import generate_speculative
from streamfuse.runtime.emitter import StopRules

# Absolute tolerance per output, relative to the output's largest magnitude (fp32 graphs).
RELATIVE_TOLERANCE = 1e-4


class EagerSession:
    """The graph modules run by torch eager: the reference every exported engine must match."""

    name = "torch:eager-graph"

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules

    @torch.inference_mode()
    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        outputs = self.modules[method](*inputs)
        return list(outputs) if isinstance(outputs, tuple) else [outputs]


class ReplaySession:
    """Wraps a session; replays each call through the reference and keeps the largest differences."""

    def __init__(self, session: Session, reference: Session):
        self.session, self.reference = session, reference
        self.name = session.name
        self.max_diff: dict[str, float] = {}
        self.max_ref: dict[str, float] = {}

    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        inputs = [t.clone() for t in inputs]  # the host mutates its cache after the call
        outputs = self.session.run(method, inputs)
        for name, out, ref in zip(OUTPUT_NAMES[base_method(method)], outputs, self.reference.run(method, inputs)):
            key = f"{method}.{name}"
            exact = not ref.dtype.is_floating_point
            diff = float((out != ref).sum()) if exact else float((out.float() - ref.float()).abs().max())
            self.max_diff[key] = max(self.max_diff.get(key, 0.0), diff)
            self.max_ref[key] = None if exact else max(self.max_ref.get(key, 0.0), float(ref.float().abs().max()))
        return outputs


def eager_tokens(eager: TorchBackend, tree, prompts: Sequence[Sequence[int]], rules: StopRules) -> list[list[int]]:
    """Greedy SS tokens of the torch eager model: the reference of every backend's token parity."""
    return [generate_speculative(eager, ids, tree, rules).token_ids for ids in prompts]


def backend_parity(session: Session, reference: EagerSession, spec: GraphSpec, prompts: Sequence[Sequence[int]],
                   expected: Sequence[Sequence[int]], rules: StopRules, numeric_prompts: int = 2,
                   plain_prompts: int = 5, relative_tolerance: float | None = RELATIVE_TOLERANCE) -> dict:
    """Greedy token parity of `session` on all prompts against `expected` (eager_tokens), its own
    plain decoding on the first `plain_prompts`, and step-output differences on the first
    `numeric_prompts` (each call replayed through the eager graphs). relative_tolerance None: the
    differences are recorded, not judged (a low-bit format against the fp32 model)."""
    replay = ReplaySession(session, reference)
    fast = StaticGraphBackend(session, spec)
    checked = [StaticGraphBackend(replay, spec, use_greedy_step=False), StaticGraphBackend(replay, spec)]
    same_as_eager = same_as_plain = 0
    plain = []
    for index, (ids, want) in enumerate(zip(prompts, expected)):
        backend = checked[min(index, 1)] if index < numeric_prompts else fast
        tokens = generate_speculative(backend, ids, spec.tree, rules).token_ids
        same_as_eager += tokens == list(want)
        if index < plain_prompts:
            plain.append(generate_autoregressive(fast, ids, rules).token_ids)
            same_as_plain += tokens == plain[-1]
    others = {tree.hash(): sum(generate_speculative(fast, ids, tree, rules).token_ids == want
                               for ids, want in zip(prompts, plain)) for tree in spec.trees[1:]}
    tolerance = {} if relative_tolerance is None else {
        k: 0.0 if ref is None else relative_tolerance * max(1.0, ref) for k, ref in replay.max_ref.items()}
    return {"prompts": len(prompts), "ss_equals_torch_eager": same_as_eager,
            "plain_prompts": min(plain_prompts, len(prompts)), "ss_equals_own_plain": same_as_plain,
            "other_trees": {"prompts": len(plain), "ss_equals_own_plain": others},
            "numeric_prompts": min(numeric_prompts, len(prompts)), "tolerance": tolerance,
            "max_abs_diff": replay.max_diff,
            "within_tolerance": None if relative_tolerance is None else
            all(replay.max_diff[k] <= tolerance[k] for k in tolerance)}
