"""The parity gate of an artifact's backends (ArtifactBuilder's part: export/artifact.py): each backend that runs
here decodes the parity prompts against torch eager and its own plain decoding (export/verify.py), and runs each
batched step against its sequences' own calls (export/artifact_batch.py); an artifact that is not lossless is
refused before it is installed."""

from __future__ import annotations

import shutil

from streamfuse.export.artifact_batch import batch_parity, check_batches
from streamfuse.export.backend_export import tensors_stage
from streamfuse.export.eager import TorchBackend
from streamfuse.export.formats import RUNS_HERE, SPAN
from streamfuse.export.verify import (
    EagerRunner,
    ParityError,
    backend_parity,
    check_parity,
    eager_tokens,
    main_graph_lines,
)
from streamfuse.runtime.request.emitter import StopRules


class ParityGate:
    """ArtifactBuilder's parity checks: reads its model, trees, prompts and staging folder."""

    def _gate(self, parity: dict[str, dict]) -> None:
        """Refuse an artifact that is not lossless: the staging folder goes (a rerun exports afresh,
        for a fixed exporter), the installed artifact stays as it was."""
        try:
            for backend, result in parity.items():
                check_parity(backend, result, against_eager=self.format(backend) == "none", names=self.prompt_names)
                check_batches(backend, result)
        except ParityError:
            shutil.rmtree(self.staging)
            raise

    def _parity_stage(self, backend: str, files: dict) -> dict | None:
        """The parity check of a backend that runs here (None for the others)."""
        if backend not in RUNS_HERE:
            return None
        return self._stage(parity_stage(backend, self.key), lambda: self._parity(backend, files))

    def rules(self) -> StopRules:
        return StopRules(self.max_new_tokens, (self.model_and_tokenizer()[1].eos_token_id,))

    def expected_tokens(self) -> list[list[int]]:
        """Torch eager's greedy SS tokens on the parity prompts, computed once per staging folder
        by whichever export process checks parity first (the worker usually), then read."""
        if self._expected is None:
            self._expected = self._stage("expected-tokens", self._eager_tokens)["tokens"]
        return self._expected

    def _eager_tokens(self) -> dict:
        # kernels="eager": the oracle is plain PyTorch, and the same model object is exported later.
        eager = TorchBackend(self.model_and_tokenizer()[0], stream_schedule="deferred", kernels="eager")
        return {"tokens": eager_tokens(eager, self.trees[0], self.prompts, self.rules())}

    def _parity(self, backend: str, files: dict) -> dict:
        from safetensors.numpy import load_file

        from streamfuse.runtime.backends.runners import open_runner

        runner = open_runner(backend, {name: self.graph_file(entry) for name, entry in files.items()})
        if self.config.task_inputs:  # the task's tensors, written first where parity runs right after the export
            self._stage(tensors_stage(backend, self.key), lambda: self._task_file(backend))
            runner.bind_task(load_file(self.task_folder / f"{backend}.safetensors"))
        model, _, _ = self.model_and_tokenizer()
        if backend in SPAN:  # the span graphs need the kernel's attention
            from streamfuse.export.span_attention import span_model

            model = span_model(model)
        # the fp32 model, same layout: a low-bit format's error is measured against it
        reference = EagerRunner(self.modules(model, span=backend in SPAN))
        fmt = self.format(backend)
        # a low-bit format is lossless against its own plain decoding on every prompt; its tokens may differ from fp32
        own = {} if fmt == "none" else {"plain_prompts": len(self.prompts), "relative_tolerance": None}
        result = backend_parity(
            runner,
            reference,
            self.graph_spec(backend),
            self.trees,
            self.prompts,
            self.expected_tokens(),
            self.rules(),
            **own,
        )
        result["batches"] = batch_parity(runner, self.graph_spec(backend))  # each batched step == its single calls
        if own:
            result["note"] = f"weights {fmt}: step outputs differ from the fp32 model by max_abs_diff (not a tolerance)"
        others = result["other_trees"]
        print(
            f"[verify] {backend} ({fmt}): SS == torch eager fp32 on {result['ss_equals_torch_eager']}/"
            f"{result['prompts']} prompts; SS == own plain on {result['ss_equals_own_plain']}/"
            f"{result['plain_prompts']}; other trees SS == own plain: "
            f"{sorted(others['ss_equals_own_plain'].values())}/{others['prompts']}{main_graph_lines(result)}; step "
            f"outputs within tolerance: {result['within_tolerance']}; batched steps == their single calls: "
            f"{all(all(checks.values()) for checks in result['batches'].values())}",
            flush=True,
        )
        return result


def parity_stage(backend: str, key: str) -> str:
    """A parity check's stage: it depends on the trees and prompts, which the staging folder's key leaves out."""
    return f"parity-{backend}-{key}"
