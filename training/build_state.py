"""What a build stage reads of the running build (training/pipeline.py's Build has it all): the stages and the
method parts take this, so the pipeline imports them and nothing of theirs imports the pipeline back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from streamfuse.adapters.model import SpeculativeStreamingLM
    from streamfuse.training.tasks.base import Task


class BuildState(Protocol):
    args: argparse.Namespace
    config: Any  # training/config.py's BuildConfig (which imports the method parts that take this)
    task: Task
    run_dir: Path
    tokenizer: Any
    pad_id: int
    frozen_states: Any
    train_examples: list
    train_items: list

    def new_model(self) -> SpeculativeStreamingLM: ...

    def inference_model(self, directory: Path) -> SpeculativeStreamingLM: ...

    def own_answers(self, model, key: str, examples, split: str) -> list: ...

    def target_answers(self, target: SpeculativeStreamingLM, target_key: str, unlabelled: bool) -> tuple[list, int]: ...
