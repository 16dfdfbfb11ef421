"""Medusa: heads on the target's last hidden state rank the drafts of SS's trees (the paper's baseline).
On torch the heads are attached to the backend; the exported graphs have a heads method."""

from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.methods.parallelspec import widths_tree
from streamfuse.runtime.stream_drafter import HeadDrafter
from streamfuse.runtime.tree import TreeSpec


def drafter(loaded, settings) -> HeadDrafter:
    if loaded.engine == "torch":
        from streamfuse.adapters.medusa import load_heads

        if loaded.backend.heads is None:
            loaded.backend.attach_heads(load_heads(loaded.artifact.drafter_path("medusa")))
        return HeadDrafter(settings.tree, loaded.backend.heads.num_heads)
    graphs = loaded.artifact.manifest["graphs"]["heads"]
    if graphs["training_key"] != loaded.artifact.drafters["medusa"]["training_key"]:
        raise ValueError(f"method medusa: the {loaded.backend.name} graphs of {loaded.artifact.path} have no heads "
                         f"method for its Medusa heads (they were added after the export); rebuild the artifact with "
                         f"export/build.py --set medusa.enabled=true, or pass --backend torch")
    return HeadDrafter(settings.tree, graphs["count"])


METHOD = Method("medusa", "Medusa: heads on the target's last state draft SS's tree", drafter=drafter,
                default_tree=lambda loaded: TreeSpec.from_dict(loaded.artifact.drafters["medusa"]["tree"]),
                build_flags="--set medusa.enabled=true", artifact_entries=("medusa",),
                variant=widths_tree)  # medusa:W1-W2-..: a tree of those widths, as parallelspec's (same-tree comparisons)
