"""Falcon's drafter scored on held-out own answers, without the target or an engine: what the k x m sweep and the
CSGD ablation in docs/results.md come from.

    python -m streamfuse.methods.falcon.heldout --task dialogsum --held-out 80 [--set falcon.block=3] \\
        [--set falcon.glance=false]

After a build has trained the SS model (its own answers and states are cached under <run>/distill), a drafter of
the build's falcon recipe trains on all but the last --held-out answers; on those, each step t's m passes are
replayed (the runtime's inputs: its own predicted states and top tokens) and every drafted depth is checked
against the target's own answer. Prints (and writes with --json) the top-1 per depth and the accepted length
of greedy chains of 1..3 passes and of widths trees.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

TREES = ("2-1", "2-1-1-1", "2-1-1-1-1-1")
DEPTH = 6  # depths scored


def tree_accepted(candidates: dict[int, Sequence[int]], truth: Sequence[int], widths: Sequence[int]) -> int:
    """Tokens a widths tree accepts (methods/parallelspec/__init__.py widths_tree: W_d children at depth d under
    the top path): candidates[d] the drafted tokens at depth d, best first; truth[d - 1] the target's token there.
    A chain is widths 1-1-..."""
    accepted = 0
    for depth, width in enumerate(widths, 1):
        if depth > len(truth) or depth not in candidates:
            break
        if candidates[depth][0] == truth[depth - 1]:
            accepted = depth
            continue
        accepted = depth if truth[depth - 1] in list(candidates[depth][:width]) else accepted
        break
    return accepted


@torch.no_grad()
def replay(
    drafter, embed: torch.nn.Module, pieces: Sequence[tuple[torch.Tensor, Sequence[int]]], trees: Sequence[str] = TREES
) -> dict:
    """pieces: (target states [A, H], own answer [A]). -> top-1 per depth, chain accepted length per pass count,
    accepted length per tree."""
    from streamfuse.methods.falcon.train import falcon_layout, forward, glanced_inputs, pack

    k = drafter.block
    passes = -(-DEPTH // k)
    hits, seen = torch.zeros(DEPTH), torch.zeros(DEPTH)
    chains, lengths = {m: [] for m in range(1, passes + 1)}, {tree: [] for tree in trees}
    for states, answer in pieces:
        packed = pack([(states, answer)], k, passes, 0.0)
        _, logits = forward(drafter, embed, packed, *glanced_inputs(drafter, embed, packed, passes, 0.0))
        top = drafter.vocab_ids[logits.topk(min(3, logits.shape[-1]), -1).indices].tolist()
        layout = falcon_layout(len(answer), k, passes)
        for t in range(k - 1, len(answer) - 1):
            rows = (layout.group == t).nonzero().flatten().tolist()
            candidates = {int(layout.inputs[r]) + k - t: top[r] for r in rows}
            truth = list(answer[t + 1 : t + 1 + DEPTH])
            for depth in range(1, min(DEPTH, len(truth)) + 1):
                hits[depth - 1] += candidates.get(depth, [None])[0] == truth[depth - 1]
                seen[depth - 1] += 1
            for m in chains:
                chains[m].append(tree_accepted(candidates, truth, [1] * (k * m)))
            for tree in trees:
                lengths[tree].append(tree_accepted(candidates, truth, [int(w) for w in tree.split("-")]))
    mean = lambda values: round(sum(values) / max(len(values), 1), 3)  # noqa: E731
    return {
        "block": k,
        "top1": [round(float(h / max(s, 1)), 3) for h, s in zip(hits, seen)],
        "chain": {m: mean(v) for m, v in chains.items()},
        "trees": {t: mean(v) for t, v in lengths.items()},
    }


def main(argv: list[str] | None = None) -> int:
    from streamfuse.adapters.checkpoint import load_checkpoint
    from streamfuse.methods.falcon.model import FalconModel
    from streamfuse.methods.falcon.train import FalconTraining, train_falcon
    from streamfuse.methods.fused.train import AnswerStates, answer_pieces, answer_states, embed_scale
    from streamfuse.training import stages
    from streamfuse.training.build_options import build_config, parse_args
    from streamfuse.training.pipeline import Build

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--held-out", type=int, default=80)
    own.add_argument("--json", type=Path, default=None)
    ours, rest = own.parse_known_args(argv)
    args = parse_args(rest)
    config = build_config(args)
    build = Build(args, config)
    build.load_data()
    ss_dir, falcon = build.run_dir / "ss", config.section("falcon")
    if not (ss_dir / "streamfuse.json").is_file():
        print(f"error: {ss_dir} holds no SS model: run streamfuse build --task {args.task} first", file=sys.stderr)
        return 2
    states, items, _ = stages.target_features(
        build, ss_dir, stages.model_key(ss_dir), falcon.unlabelled, "answer-states", answer_states
    )
    if not 0 < ours.held_out < len(items):
        print(f"error: --held-out must be between 1 and {len(items) - 1}, got {ours.held_out}", file=sys.stderr)
        return 2
    cut = len(items) - ours.held_out
    ends = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), states.lengths]), 0)
    training_states = AnswerStates(states.hidden[: ends[cut]], states.lengths[:cut])
    vocab = build.vocab("falcon head", [item.input_ids for item in items], falcon.vocab)  # the build's: all answers
    eager, _, _ = load_checkpoint(ss_dir, args.base_model, merge_lora=True)
    torch.manual_seed(config.train.seed)
    ids = torch.tensor(vocab.ids) if vocab is not None else torch.arange(eager.parts.vocab_size)
    drafter = FalconModel.like(eager.model, ids, falcon.block)
    drafter.start_fused(embed_scale(training_states, eager.parts.embed))
    recipe = FalconTraining(
        falcon.epochs,
        falcon.learning_rate,
        falcon.items,
        falcon.passes,
        falcon.glance,
        distill_weight=falcon.distill_weight,
        seed=config.train.seed,
    )
    trained = train_falcon(drafter, eager.parts.embed, items[:cut], training_states, recipe)
    pieces = answer_pieces(items, states)[cut:]
    result = {
        "recipe": {"block": falcon.block, "passes": falcon.passes, "glance": falcon.glance, "epochs": falcon.epochs},
        "held_out": ours.held_out,
        "training": trained,
        **replay(drafter, eager.parts.embed, pieces),
    }
    print(json.dumps(result, indent=2))
    if ours.json is not None:
        ours.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
