"""Medusa: heads on the target's last hidden state rank the drafts of SS's trees (the paper's baseline).
On torch the heads are attached to the backend (torch_pass.py); the exported graphs have a heads method."""

from streamfuse.methods.medusa.drafter import HeadDrafter
from streamfuse.runtime.methods import registry
from streamfuse.runtime.methods.method import tree_drafter

NAME = "medusa"


def drafter(loaded, settings) -> HeadDrafter:
    if loaded.engine == "torch":
        heads = registry.part(NAME, "torch_pass").attach_heads(loaded.backend, loaded.artifact.drafter_path(NAME))
        return HeadDrafter(settings.tree, heads)
    graphs = loaded.artifact.manifest["graphs"]["heads"]
    if graphs["training_key"] != loaded.artifact.drafters[NAME]["training_key"]:
        raise ValueError(
            f"method medusa: the {loaded.backend.name} graphs of {loaded.artifact.path} have no heads "
            f"method for its Medusa heads (they were added after the export); rebuild the artifact with "
            f"streamfuse build {METHOD.build_flags}, or pass --backend torch"
        )
    return HeadDrafter(settings.tree, graphs["count"])


# its variant: a tree of those widths, as the fused drafters' (same-tree comparisons)
METHOD = tree_drafter(
    NAME, "Medusa: heads on the target's last state draft SS's tree", drafter, ("tree", "training_key")
)
