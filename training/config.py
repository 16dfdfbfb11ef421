"""Typed build configuration, the named presets (smoke, cpu, cpu-distill, paper) and the one way
to change them: `--set section.field=value` (streamfuse build; `--print-config` shows every field).
A preset is self-consistent, and an override that makes it inconsistent is refused with the field
to set, never silently compensated by changing another field."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from streamfuse.adapters.config import LoraSettings, StreamConfig
from streamfuse.export.artifact import ExportConfig
from streamfuse.training import build_part


@dataclass(frozen=True)
class DataConfig:
    max_source_tokens: int = 384  # the source text is cut to this many tokens before prompting
    max_target_tokens: int = 96
    train_limit: int | None = None
    validation_limit: int | None = 100
    test_limit: int | None = 100
    # The validation split's rows past validation_limit train too (the held-out slice stays out):
    # the local DialogSum has 601 train rows but 500 dev rows, of which validation uses 100.
    train_on_validation_rest: bool = False

    def validate(self) -> None:
        if self.train_on_validation_rest and self.validation_limit is None:
            raise ValueError(
                "train_on_validation_rest needs a validation_limit: the rows past it train, the rest stay held out"
            )


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 1.0
    learning_rate: float = 5e-4
    warmup_ratio: float = 0.03
    micro_batch: int = 1  # examples per forward; 1 avoids padding work on a CPU
    grad_accumulation: int = 4
    weight_decay: float = 0.0
    main_weight: float = 1.0  # alpha_0 of eq. 5
    stream_weight: float = 0.1  # alpha_j of eq. 5 (0 gives the next-token "LoRA baseline")
    pruning_weight: float = 1.0
    # Stream-identifier embeddings start tiny next to a residual stream of RMS ~10-20; at the
    # LoRA learning rate they would barely move, leaving streams near-copies of the main stream.
    stream_lr_scale: float = 20.0
    # Each stream's f_eta block (StreamConfig.init_rank) trains only on its stream's loss; from
    # scratch in a short first stage it needs more than the LoRA rate (the second stage uses 1e-3).
    init_lr_scale: float = 1.0
    mixed_precision: str = "no"  # "bf16" on GPUs
    save_every: int = 25  # optimizer steps between resumable snapshots
    seed: int = 0

    def validate(self) -> None:
        if self.epochs <= 0 or self.learning_rate <= 0:
            raise ValueError("epochs and learning_rate must be > 0")
        if self.micro_batch < 1 or self.grad_accumulation < 1:
            raise ValueError("micro_batch and grad_accumulation must be >= 1")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be no, bf16 or fp16, got {self.mixed_precision!r}")


MAIN_TARGETS = ("own", "references", "frozen")


@dataclass(frozen=True)
class DistillConfig:
    """Second training stage on the SS model's own greedy answers (training/distill.py).

    It starts from the first stage's weights. main_targets "own": the main stream trains on the
    own answers too (its targets are its own argmax, which mostly holds it in place);
    "references": the epoch mixes the reference answers (main stream and streams, as in the first
    stage) with the own answers (streams only), so the main stream keeps learning the task;
    "frozen": LoRA stays as the first stage left it, so the main stream (and the task quality)
    cannot change, and only the stream parameters and the pruning head train, on the own answers
    (and on the references too with with_references: more rows, better drafts on both).
    init_rank > 0 gives the streams an f_eta of that rank at this stage (one per stream with
    init_per_stream): the capacity they lack when the shared LoRA is frozen."""

    enabled: bool = False
    epochs: float = 1.0
    learning_rate: float = 1e-3  # suits fresh f_eta blocks (Medusa trains its heads at 1e-3); 3e-4 when LoRA trains
    stream_weight: float = 0.5
    main_targets: str = "frozen"
    init_rank: int = 128
    init_per_stream: bool = True
    with_references: bool = False  # frozen only: the streams train on the reference answers too
    unlabelled: bool = False  # the task's unlabelled inputs too (their own answers; DialogSum: 1,398 dialogues)
    batch_size: int = 8  # generation batch

    def validate(self) -> None:
        if self.main_targets not in MAIN_TARGETS:
            raise ValueError(
                f"distill.main_targets must be one of {', '.join(MAIN_TARGETS)}, got {self.main_targets!r}"
            )
        if self.init_rank < 0:
            raise ValueError(f"distill.init_rank must be >= 0, got {self.init_rank}")
        if self.with_references and self.main_targets != "frozen":
            raise ValueError(
                f"distill.with_references applies to distill.main_targets 'frozen' ('references' already "
                f"trains on them), got {self.main_targets!r}: set distill.with_references=false"
            )

    def train_config(self, base: TrainConfig) -> TrainConfig:
        return replace(
            base,
            epochs=self.epochs,
            learning_rate=self.learning_rate,
            stream_weight=self.stream_weight,
            init_lr_scale=1.0,
        )


@dataclass(frozen=True)
class EvalConfig:
    max_new_tokens: int = 96
    batch_size: int = 8
    top_k: int = 5  # stream accuracy is reported as top-1 and top-k


@dataclass(frozen=True)
class StagesConfig:
    """The build's stages around training: which run, and on how many inputs."""

    baseline: bool = True  # train and evaluate the next-token LoRA baseline
    zero_shot: bool = True  # evaluate the untuned base model
    calibration_inputs: int = 4  # validation inputs each backend's calibration times (step cost per tree)
    profile_limit: int = 20  # test inputs of the profile stage; 0 skips it

    def validate(self) -> None:
        if self.calibration_inputs < 1 or self.profile_limit < 0:
            raise ValueError(
                f"stages.calibration_inputs must be >= 1 and stages.profile_limit >= 0, got "
                f"{self.calibration_inputs} and {self.profile_limit}"
            )


# The build's export settings: trees () means the ones calibration picks on this machine
# (training/calibration.py); two export processes (ExecuTorch lowers while ONNX and Core ML export).
BUILD_EXPORT = ExportConfig(trees=(), workers=2)


@dataclass(frozen=True)
class BuildConfig:
    """The build's settings: the SS model's sections here, and one section per method build part
    (training/build_part.py), read with `section(name)` (or as an attribute); `methods` holds those set
    away from their defaults, so a method registered later gets its section all the same."""

    preset: str
    streams: StreamConfig = field(default_factory=StreamConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = BUILD_EXPORT
    stages: StagesConfig = field(default_factory=StagesConfig)
    methods: Mapping[str, Any] = field(default_factory=dict)  # method section name -> its settings

    def section(self, name: str):
        """A section by name: its own field, or a method build part's section."""
        if name in OWN_SECTIONS:
            return getattr(self, name)
        if name in self.methods:
            return self.methods[name]
        return build_part.part(name).config()

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "methods":
            raise AttributeError(name)
        try:
            return self.section(name)
        except KeyError:
            raise AttributeError(f"BuildConfig has no section {name!r}") from None

    def with_section(self, name: str, value) -> BuildConfig:
        if name in OWN_SECTIONS:
            return replace(self, **{name: value})
        return replace(self, methods={**self.methods, name: value})

    def section_names(self) -> tuple[str, ...]:
        """Every section --set reaches: its own, then the method build parts'."""
        return (*OWN_SECTIONS, *(part.section for part in build_part.parts()))

    def validate(self) -> None:
        """Every section's own checks, then those across sections; bad settings fail before any work."""
        unknown = set(self.methods) - set(self.section_names())
        if unknown:
            raise ValueError(f"no method build part has a section {', '.join(sorted(unknown))}")
        for name in ("data", "train", "distill", *self.section_names()[len(OWN_SECTIONS) :], "stages"):
            self.section(name).validate()
        for part in build_part.enabled(self):
            for need in part.needs:
                if not self.section(need).enabled:
                    raise ValueError(f"{part.section}.enabled needs {need}.enabled=true: it reads what {need} trains")
        # Trees () are picked by calibration later; the other export settings are checked meanwhile.
        dataclasses.replace(self.export, trees=self.export.trees or ("gamma=1,k=1",)).validate()
        if self.streams.init_per_stream and not self.streams.init_rank:
            raise ValueError(
                "streams.init_per_stream needs streams.init_rank > 0 (each stream's f_eta rank); "
                "set streams.init_per_stream=false for the identity f_eta"
            )
        if self.distill.enabled and self.streams.init_rank and self.distill.init_rank:
            raise ValueError(
                f"the first stage already gives the streams an f_eta (streams.init_rank="
                f"{self.streams.init_rank}); set distill.init_rank=0 to train it on in the second stage"
            )

    def as_dict(self) -> dict:
        """Every section as plain data, the method sections after distill (--print-config, a checkpoint's info)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "methods"}
        ordered = {}
        for name, value in own.items():
            ordered[name] = asdict(value) if dataclasses.is_dataclass(value) else value
            if name == "distill":
                ordered.update({part.section: asdict(self.section(part.section)) for part in build_part.parts()})
        return ordered


# The sections BuildConfig holds itself (the method build parts' come from the registry).
OWN_SECTIONS = ("streams", "lora", "data", "train", "distill", "eval", "export", "stages")


# What the two 2-core CPU presets share: the LoRA, the data cuts, the evaluation, and the 4-bit artifact
# (the base GGUF's own codes, LoRA beside them: docs/export.md; its .pte is 126 MB against fp32's 660 MB)
# with every linear on streamfuse's op on both engines (on ExecuTorch it beats XNNPACK's 8da4w on decode,
# prefill and memory: docs/benchmarks.md) and one step bucket of 4 rows: at 4 bits even a 4-row greedy step
# costs 1.6-1.75 plain calls for about 2 tokens (docs/benchmarks.md, each graph method's call time per
# engine); --set export.buckets=4,8 adds the 8-row bucket. No batched steps: each adds ~4 min of
# single-threaded ExecuTorch lowering on the slowest 2-core machine here, which four of them put past
# make build's hour (docs/results.md); a server's build adds them with --set export.batches=2x1,4x1,8x1,4x4
# (runtime/request/batch.py; export/batch_pass.py), the training reused.
_CPU_BASE = BuildConfig(
    preset="cpu",
    lora=LoraSettings(rank=32, alpha=64.0, top_layers=10),
    data=DataConfig(max_source_tokens=320, max_target_tokens=80, validation_limit=100, test_limit=100),
    eval=EvalConfig(max_new_tokens=80, batch_size=8),
    export=replace(BUILD_EXPORT, quantize="q4-native", buckets=(4,), pte_linear="streamfuse"),
)

PRESETS: dict[str, BuildConfig] = {
    # Minutes on a laptop CPU: proves the pipeline end to end, not the quality.
    "smoke": BuildConfig(
        preset="smoke",
        streams=StreamConfig(num_streams=3, msa_layers=2),
        lora=LoraSettings(rank=8, alpha=16.0, top_layers=4),
        data=DataConfig(max_source_tokens=128, max_target_tokens=32, train_limit=16, validation_limit=8, test_limit=8),
        train=TrainConfig(epochs=1.0, grad_accumulation=2, save_every=4),
        distill=DistillConfig(epochs=1.0, batch_size=4),
        eval=EvalConfig(max_new_tokens=24, batch_size=4),
    ),
    # The default of `make build` on a 2-core CPU, export included (timing in docs/results.md): what
    # ships, not the paper's comparisons (--set stages.baseline=true --set stages.zero_shot=true).
    # One stage, as in the paper, but each stream has its own rank-128 f_eta from the start (at 4x
    # the LoRA rate) and alpha_j = 0.5: the streams learn far more than with the identity f_eta at
    # alpha_j = 0.1, at the same ROUGE. It trains on the 601 train rows plus the 400 dev rows
    # validation leaves out, for 1.2 epochs: the 300 optimizer steps of two epochs over the train
    # rows alone (where the second epoch mostly memorises: ROUGE falls, own-answer accuracy stays).
    # No LoRA dropout (the paper gives none): its random masks take ~20 % of a CPU training step.
    # Streams on the top 4 layers, not the paper's N/2: about the same drafts (stream 1-3 top-1 on
    # the model's own answers 54.0 / 41.0 / 31.8 % against 55.7 / 41.8 / 32.6 with 8) for a greedy step
    # a tenth cheaper on a CPU (docs/benchmarks.md, "Stream layers"); 2 layers gain nothing more.
    "cpu": replace(
        _CPU_BASE,
        preset="cpu",
        lora=replace(_CPU_BASE.lora, dropout=0.0),
        data=replace(_CPU_BASE.data, train_on_validation_rest=True),
        streams=StreamConfig(num_streams=3, msa_layers=4, init_rank=128, init_per_stream=True),
        train=TrainConfig(epochs=1.2, learning_rate=5e-4, grad_accumulation=4, stream_weight=0.5, init_lr_scale=4.0),
        distill=DistillConfig(init_rank=0),  # if enabled: the streams' f_eta from the first stage trains on
        # The paper's comparisons (LoRA baseline, zero-shot; docs/results.md) are asked for: they cost
        # ~17 min of the hour and change nothing in the artifact.
        stages=StagesConfig(baseline=False, zero_shot=False),
    ),
    # The benchmarked model (docs/benchmarks.md): about 2 h 10 min of training and evaluation on a
    # 2-core CPU. Two epochs of eq. 5, then a streams-only second stage, two epochs on the model's
    # own answers and the references: better drafts, the same main stream (docs/results.md).
    "cpu-distill": replace(
        _CPU_BASE,
        preset="cpu-distill",
        streams=StreamConfig(num_streams=3, msa_layers=8),
        train=TrainConfig(epochs=2.0, learning_rate=5e-4, grad_accumulation=4),
        distill=DistillConfig(enabled=True, epochs=2.0, with_references=True, unlabelled=True),
    ),
    # The paper's recipe (A.2): 5 epochs, lr 5e-4, linear schedule, bf16, N_s = N/2; for a GPU.
    "paper": BuildConfig(
        preset="paper",
        streams=StreamConfig(num_streams=4, msa_layers=15),
        lora=LoraSettings(rank=32, alpha=64.0),
        data=DataConfig(max_source_tokens=768, max_target_tokens=128, validation_limit=500, test_limit=None),
        train=TrainConfig(epochs=5.0, learning_rate=5e-4, micro_batch=8, grad_accumulation=1, mixed_precision="bf16"),
        eval=EvalConfig(max_new_tokens=128, batch_size=32),
    ),
}


def preset(name: str, **overrides) -> BuildConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]


def with_overrides(config: BuildConfig, assignments: list[str]) -> BuildConfig:
    """config with each "section.field=value" applied in order (the value parsed by the field's type)."""
    for assignment in assignments:
        path, sep, text = assignment.partition("=")
        section_name, dot, name = path.strip().partition(".")
        sections = config.section_names()
        if not sep or not dot or section_name not in sections:
            raise ValueError(
                f"--set {assignment!r}: write SECTION.FIELD=VALUE, SECTION one of {', '.join(sections)} "
                f"(--print-config lists every field)"
            )
        section = config.section(section_name)
        hints = typing.get_type_hints(type(section))
        if name not in hints or name not in {f.name for f in dataclasses.fields(section)}:
            raise ValueError(
                f"--set {assignment!r}: {section_name} has no field {name!r}; its fields: "
                f"{', '.join(f.name for f in dataclasses.fields(section))}"
            )
        value = parse_value(text.strip(), hints[name], f"--set {path.strip()}")
        config = config.with_section(section_name, replace(section, **{name: value}))
    return config


def parse_value(text: str, kind, where: str):
    """Text -> a value of the annotated type: bool, int, float, str, Literal, Optional, tuple[str, ...] and
    tuple[int, ...]."""
    options = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if text.lower() == "none" and type(None) in options:
            return None
        (kind,) = [option for option in options if option is not type(None)]
        options = typing.get_args(kind)
    if typing.get_origin(kind) is tuple and options[0] is int:  # numbers: ',' or ';'-separated
        parts = [part.strip() for part in text.replace(";", ",").split(",") if part.strip()]
        if not all(part.isdigit() for part in parts):
            raise ValueError(f"{where}: {text!r} is not a list of whole numbers (e.g. 4,8)")
        return tuple(int(part) for part in parts)
    if typing.get_origin(kind) is tuple:  # ';'-separated: trees contain commas
        return tuple(part.strip() for part in text.split(";") if part.strip())
    if typing.get_origin(kind) is typing.Literal:
        if text not in options:
            raise ValueError(f"{where}: {text!r} is not one of {', '.join(map(str, options))}")
        return text
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{where}: {text!r} is not true or false")
        return text.lower() in ("true", "1", "yes")
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {text!r} is not a valid {kind.__name__}") from None
