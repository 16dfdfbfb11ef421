"""A method added by one folder: a toy drafter (a bigram table "trained" on the SS model's own answers) declared
in a package outside streamfuse, registered, built into a tiny artifact with --set toy.enabled=true and decoded
through the runtime, token for token plain decoding's output."""

import json
import sys
import textwrap

from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training import build, build_part

from conftest import end_half_the_answers, smoke_build_args, write_tiny_dialogsum

RUNTIME = '''
import json

from streamfuse.runtime.methods.method import Method, recorded_tree
from streamfuse.runtime.request.drafter import Draft


class BigramDrafter:
    """Drafts a chain: each token the one the table gives after the one before (token 0 where it has none)."""

    name, uses_streams = "toy", False

    def __init__(self, table, tree):
        self.table, self.tree = table, tree

    def start(self, prompt_ids, prefill, root, capacity):
        return 0

    def propose(self, root):
        drafts = [root]
        for _ in range(self.tree.depth):
            drafts.append(self.table.get(drafts[-1], 0))
        return Draft(self.tree, drafts)

    def observe(self, draft, out, path, correction):
        pass


def drafter(loaded, settings):
    table = json.loads((loaded.artifact.drafter_path("toy") / "table.json").read_text())["table"]
    return BigramDrafter({int(k): v for k, v in table.items()}, settings.tree)


METHOD = Method("toy", "Toy: a bigram table drafts a chain", drafter=drafter, default_tree=recorded_tree("toy"),
                build_flags="--set toy.enabled=true", artifact_entries=("toy",), chain=True)
'''

BUILD = '''
import json
from collections import Counter
from dataclasses import dataclass

from streamfuse.export.artifact import install_drafter
from streamfuse.training.build_part import MethodBuild
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.stage import OutputFormat, Stage, recipe
from streamfuse.training.stages import model_key


@dataclass(frozen=True)
class ToyConfig:
    enabled: bool = False
    drafts: int = 3

    def validate(self):
        if self.drafts < 1:
            raise ValueError(f"toy.drafts must be >= 1, got {self.drafts}")


def read(folder):
    return json.loads((folder / "table.json").read_text())


def train(build, ss_dir, trained):
    """The most frequent next token after each token of the SS model's own answers."""
    target_key = model_key(ss_dir)

    def run(folder, stage):
        items, answers = build.target_answers(build.inference_model(ss_dir), target_key, False)
        pairs = Counter((a, b) for item in items for a, b in
                        zip(item.input_ids[item.prompt_len - 1 :], item.input_ids[item.prompt_len :]))
        table = {}
        for (a, b), _ in pairs.most_common():
            table.setdefault(a, b)
        (folder / "table.json").write_text(json.dumps({"table": table, "info": {"training_key": stage.key}}))
        return f"{len(table)} bigrams from {len(items)} of {answers} own answers"

    inputs = {"target": target_key, "toy": recipe(build.config.section("toy"))}
    return Stage("toy", build.run_dir / "toy", "toy", inputs, OutputFormat("table.json", read), run).output()


def install(build, artifact, ss_dir, trained, export):
    drafts = build.config.section("toy").drafts
    install_drafter(artifact, "toy", trained, {"tree": TreeSpec.chain(drafts).to_dict(),
                                               "training_key": read(trained)["info"]["training_key"]})
    print(f"[toy] bigram table added to {artifact}/drafters/toy", flush=True)


BUILD = MethodBuild("toy", ToyConfig, train, install, chain=lambda config: config.drafts)
'''


def test_a_method_added_by_one_folder_builds_and_decodes_as_plain(tiny_base_dir, tmp_path, monkeypatch, capsys):
    package = tmp_path / "packages" / "toy_built_method"  # not tests/toy_method.py, which test_methods imports
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(RUNTIME))
    (package / "build.py").write_text(textwrap.dedent(BUILD))
    monkeypatch.syspath_prepend(str(tmp_path / "packages"))
    monkeypatch.setattr(registry, "_METHODS", dict(registry._loaded()))  # the toy leaves with the test
    monkeypatch.setattr(registry, "_PACKAGES", dict(registry._PACKAGES))
    registry.register_package("toy_built_method")
    assert "toy" in registry.names() and build_part.parts()[-1].section == "toy"

    data = write_tiny_dialogsum(tmp_path / "data")
    end_half_the_answers(monkeypatch)
    artifact = tmp_path / "artifact"
    argv = smoke_build_args(tiny_base_dir, data, tmp_path / "work") + [
        "--backends",
        "torch,onnxruntime",
        "--out",
        str(artifact),
        *(
            f"--set={a}"
            for a in (
                "toy.enabled=true",
                "toy.drafts=3",
                "stages.baseline=false",
                "stages.zero_shot=false",
                "stages.profile_limit=0",
                "export.capacity=256",
                "export.parity_prompts=1",
                "export.buckets=4",
                "data.test_limit=2",
            )
        ),
    ]
    assert build.main(argv) == 0
    out = capsys.readouterr().out
    assert "[toy] bigram table added to" in out and "bigrams from" in out
    entry = json.loads((artifact / "manifest.json").read_text())["drafters"]["toy"]
    assert entry["path"] == "drafters/toy" and TreeSpec.from_dict(entry["tree"]) == TreeSpec.chain(3)
    assert (artifact / "drafters" / "toy" / "table.json").is_file()

    loaded = load(artifact, "torch")
    assert "toy" in loaded.methods
    rules = StopRules(12, loaded.stop_token_ids)
    settings = DecodeSettings("toy", rules, tree=loaded.method_tree("toy"))
    for prompt in ([5, 9, 14, 3], [7, 7, 21], [3, 4]):
        result = generate(loaded.backend, prompt, settings, drafter=loaded.drafter(settings))
        assert result.token_ids == generate(loaded.backend, prompt, DecodeSettings("ar", rules)).token_ids
        assert any(step.tree_nodes == settings.tree.num_nodes for step in result.run.steps)  # the table's chains
    # A rerun finds the stage's table and reuses it.
    assert build.main(argv) == 0
    assert "[toy] reusing" in capsys.readouterr().out
    assert sys.modules["toy_built_method.build"].BUILD.section == "toy"
