"""The build's calibration: the acceptance model of a fine-tuned checkpoint, and which draft trees its
graphs get (runtime/speculation/calibration.py defines both; tools/calibrate.py measures step costs).

    validation inputs -> own greedy answers -> teacher-forced stream ranks + lookup matches
        -> AcceptanceModel -> best tree per size -> timed on this machine (torch) -> trees to export

Streams see each answer position exactly as decoding does (the context is the same tokens), so a
teacher-forced rank is the rank that position's draft would have had.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.runtime.speculation.calibration import MAX_TREE_NODES, AcceptanceModel, BackendCalibration
from streamfuse.runtime.speculation.lookup import PromptLookup
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.data import Encoded, collate
from streamfuse.training.loss import stream_targets
from streamfuse.training.train import forward_batch

MAX_RANK = 8  # candidates per stream the model records: wider trees than any calibration tries
MEMORY_BOUND_NODES = 8  # the wide tree: where a step costs about one plain step (NPUs, mobile and Jetson GPUs)


def acceptance_model(
    model: SpeculativeStreamingLM, items: Sequence[Encoded], pad_id: int, max_rank: int = MAX_RANK
) -> AcceptanceModel:
    """items: prompt + the model's own greedy answer. One row per answer position whose root is not
    the answer's last token (no step follows the last)."""
    answers = [
        (position_ranks(model, item, pad_id), lookup_matches(item.input_ids, item.prompt_len, model.num_streams))
        for item in tqdm(items, desc="acceptance model", unit="ex", dynamic_ncols=True)
    ]
    return AcceptanceModel.from_answers(answers, max_rank, model.num_streams)


@torch.inference_mode()
def position_ranks(model: SpeculativeStreamingLM, item: Encoded, pad_id: int) -> list[list[int]]:
    """Per answer position (root = input_ids[r], r from prompt_len to len - 2), each stream d's rank of
    input_ids[r + d] at the root's parent (-1 past the end): stream d at anchor r - 1 drafts depth d."""
    if len(item.input_ids) - item.prompt_len < 2:
        return []
    batch = collate([item], pad_id)
    output = forward_batch(model, batch, with_streams=True)
    per_depth = []
    for depth in range(1, model.num_streams + 1):
        targets = stream_targets(batch.labels, batch.anchors, batch.anchor_valid, depth)[0]
        logits = model.logits(output.stream_hidden[0, :, depth - 1]).float()
        picked = logits.gather(1, targets.clamp(min=0)[:, None])
        per_depth.append(torch.where(targets >= 0, (logits > picked).sum(-1), -1))
    return torch.stack(per_depth, dim=1)[:-1].tolist()


def lookup_matches(ids: Sequence[int], prompt_len: int, depth: int) -> list[int]:
    """Per answer position (root = ids[r], r from prompt_len to len - 2): how many of prompt lookup's
    proposed tokens continue the answer, -1 where it proposed none (runtime/speculation/lookup.py, as decoding runs
    it)."""
    lookup = PromptLookup(ids[: prompt_len + 1])
    matches = []
    for root in range(prompt_len, len(ids) - 1):
        draft = lookup.draft(depth)
        after = ids[root + 1 : root + 1 + depth]
        count = 0
        while count < min(len(draft), len(after)) and draft[count] == after[count]:
            count += 1
        matches.append(count if draft else -1)
        lookup.extend([ids[root + 1]])
    return matches


def trees_to_export(
    acceptance: AcceptanceModel,
    calibration: BackendCalibration,
    quantized: bool,
    max_nodes: int,
    cheap_trees: bool = False,
) -> list[TreeSpec]:
    """The artifact's trees (data; the graphs run any tree of up to max_nodes nodes), the default first:
    the tree of up to max_nodes that pays most on this machine (torch); the best tree of up to
    MEMORY_BOUND_NODES nodes (where a step costs about a plain one: NPUs, mobile and Jetson GPUs); a cheap
    tree for the exported CPU engines, whose plain step is faster than torch's, so a tree step costs more
    of them: fp32, the 4-node tree (ONNX Runtime's calibrated choice on 2 cores, docs/benchmarks.md);
    quantized, the 2-node tree (the 4-node one where the default has 2 nodes); with cheap_trees (a method
    that picks each step's tree among the artifact's) the best 2- and 4-node trees both. An engine's own
    calibration (tools/calibrate.py) picks among all sizes."""
    best = acceptance.best_trees(min(MAX_TREE_NODES, max_nodes))
    fitting = [cost for cost in calibration.trees if cost.tree.num_nodes <= max_nodes]
    fastest = max(fitting, key=lambda cost: cost.speedup(calibration.plain_seconds)) if fitting else None
    default = fastest.tree if fastest is not None else best[max(best)]
    wide = max((tree for nodes, tree in best.items() if nodes <= MEMORY_BOUND_NODES), key=acceptance.expected_tokens)
    small = [best[2] if default.num_nodes > 2 else best.get(4, default)] if quantized else [best.get(4, default)]
    cheap = [best[n] for n in (2, 4) if n in best] if cheap_trees else []
    trees: list[TreeSpec] = []
    for tree in (default, wide, *small, *cheap):
        if all(tree.hash() != kept.hash() for kept in trees):
            trees.append(tree)
    return trees


def tree_text(tree: TreeSpec) -> str:
    """A tree as ExportConfig.trees holds it (TreeSpec.parse reads it back, lookup branch included)."""
    return json.dumps({"paths": [list(p) for p in tree.paths], "lookup": list(tree.lookup)})
