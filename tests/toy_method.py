"""A method defined outside streamfuse, as a user adds one: this module and one `registry.register_package` call.

toy-repeat drafts the root token repeated down a chain (right whenever the answer repeats a token).
"""

from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.speculation.tree import TreeSpec


class RepeatDrafter:
    name = "toy-repeat"
    uses_streams = False

    def __init__(self, tree: TreeSpec):
        self.tree = tree

    def start(self, prompt_ids, prefill, root, capacity) -> int:
        return 0

    def propose(self, root: int) -> Draft:
        return Draft(self.tree, [root] * self.tree.num_nodes)

    def observe(self, draft, out, path, correction) -> None:
        pass


METHOD = Method(
    "toy-repeat",
    "Toy: the root repeated down a chain",
    drafter=lambda loaded, settings: RepeatDrafter(settings.tree),
    default_tree=lambda loaded: TreeSpec.chain(2),
    chain=True,
)
