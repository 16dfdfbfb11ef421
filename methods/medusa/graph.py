"""What method medusa adds to the artifact's graphs: the heads method (export/graph.py runs the heads on the target's
last hidden state), checked at export: Medusa decodes the parity prompts on it, against the backend's own plain
decoding (export/verify.py calls main_graph_parity; its result is recorded under the method's name)."""

from __future__ import annotations

from streamfuse.methods.medusa import METHOD
from streamfuse.methods.medusa.drafter import HeadDrafter, heads_tree
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec

OWN_PLAIN = "SS vs its own plain decoding"  # export/verify.py's name for the check


def main_graph_parity(replayed, fast, spec, default: TreeSpec, prompts, plain, rules: StopRules, same) -> dict | None:
    """Medusa on the heads method, SS's tree cut to the heads' depth: equal to own plain decoding on each prompt of
    `plain` (the first replayed, so the heads' logits join the step outputs checked); None without heads."""
    if not spec.heads:
        return None
    tree = heads_tree(default, spec.heads)
    settings = DecodeSettings(METHOD.name, rules, tree=tree)
    equal = sum(
        same(
            f"{OWN_PLAIN}, {METHOD.name}",
            index,
            generate(replayed if index == 0 else fast, ids, settings, drafter=HeadDrafter(tree, spec.heads)).token_ids,
            want,
        )
        for index, (ids, want) in enumerate(zip(prompts, plain))
    )
    return {"tree": tree.to_dict(), "prompts": len(plain), "medusa_equals_own_plain": equal}


def main_graph_line(result: dict) -> str:
    return f"; Medusa == own plain: {result['medusa_equals_own_plain']}/{result['prompts']}"
