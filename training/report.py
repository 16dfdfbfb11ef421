"""eval.json and the printed tables of a build: quality, stream accuracy, parameters, bars."""

from __future__ import annotations

from pathlib import Path

from streamfuse.adapters.base_model import resolve_base_model
from streamfuse.adapters.checkpoint import read_manifest
from streamfuse.methods.ss import NAME as SS_MODEL  # the SS model's results (training/stages.py)
from streamfuse.runtime.methods import registry

FIRST_STAGE = f"{SS_MODEL}_first_stage"
LABELS = {
    "zero_shot": "zero-shot base",
    "lora_baseline": "LoRA baseline (next-token)",
    SS_MODEL: "Speculative Streaming",
    FIRST_STAGE: "Speculative Streaming, first stage (before self-distillation)",
}
STAGE_FIELDS = ("train_seconds", "train_tokens", "optimizer_steps", "final_losses")


def medusa_parameters(hidden: int, vocab: int, heads: int) -> int:
    """Medusa heads as the paper counts them: one residual block (h^2 + h) and one LM head (h*v) each."""
    return heads * (hidden * hidden + hidden + hidden * vocab)


def summarise(build, ss_dir: Path, baseline_dir: Path | None, results: dict) -> dict:
    from transformers import AutoConfig

    base_config = AutoConfig.from_pretrained(resolve_base_model(build.args.base_model))
    ss_info = read_manifest(ss_dir)["info"]
    gamma = build.config.streams.num_streams
    training = {SS_MODEL: {k: ss_info[k] for k in STAGE_FIELDS}}
    if "first_stage" in ss_info:
        training[FIRST_STAGE] = {k: ss_info["first_stage"][k] for k in STAGE_FIELDS}
    if baseline_dir is not None:
        info = read_manifest(baseline_dir)["info"]
        training["lora_baseline"] = {k: info[k] for k in STAGE_FIELDS}
    summary = {
        "task": build.task.name,
        "preset": build.config.preset,
        "base_model": build.args.base_model,
        "headline_metrics": list(build.task.headline_metrics),
        "test_examples": len(build.test),
        "validation_examples": len(build.validation_items),
        "streams": {"gamma": gamma, "msa_layers": build.config.streams.msa_layers},
        "quality": {name: result["test"]["scores"] for name, result in results.items()},
        "samples": {name: result["test"]["samples"] for name, result in results.items()},
        "stream_accuracy": results[SS_MODEL].get("stream_accuracy", {}),
        "stream_accuracy_own": results[SS_MODEL].get("stream_accuracy_own", {}),
        "extra_parameters": {
            **ss_info["extra_parameters"],
            "medusa_same_gamma": medusa_parameters(base_config.hidden_size, base_config.vocab_size, gamma),
        },
        "training": training,
    }
    summary["bars"] = bars(summary)
    return summary


# Stream 1's top-1 on the SS model's greedy test answers, a floor for the drafts: the `cpu` preset reads
# 54-56 % there, and its 4-node tree accepts ~2.0 tokens a step (the references read ~15 points lower).
STREAM1_BAR = 50.0


def bars(summary: dict) -> list[dict]:
    """The build's acceptance bars (docs/results.md), evaluated on this run's numbers."""
    quality, checks = summary["quality"], []
    metric = "rougeLsum" if "rougeLsum" in quality[SS_MODEL] else summary["headline_metrics"][-1]
    ss = quality[SS_MODEL][metric]
    if "lora_baseline" in quality:
        limit = quality["lora_baseline"][metric] - 1.0
        checks.append({"bar": f"SS {metric} >= LoRA baseline - 1.0", "value": ss, "limit": limit, "pass": ss >= limit})
    if "zero_shot" in quality:
        limit = quality["zero_shot"][metric] + 5.0
        checks.append({"bar": f"SS {metric} >= zero-shot + 5.0", "value": ss, "limit": limit, "pass": ss >= limit})
    # Stream 1 is judged on the model's own answers: the tokens acceptance compares its drafts with.
    stream1 = summary["stream_accuracy_own"].get("stream_1", {}).get("top1")
    if stream1 is not None:
        checks.append(
            {
                "bar": f"stream-1 top-1 accuracy on own answers >= {STREAM1_BAR:.0f}%",
                "value": stream1,
                "limit": STREAM1_BAR,
                "pass": stream1 >= STREAM1_BAR,
            }
        )
    return checks


def markdown(summary: dict) -> str:
    metrics = sorted({m for scores in summary["quality"].values() for m in scores})
    lines = [
        f"## {summary['task']} ({summary['preset']} preset): test split, {summary['test_examples']} examples, greedy",
        "",
        "| model | " + " | ".join(metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for name in ("zero_shot", "lora_baseline", SS_MODEL):
        if name in summary["quality"]:
            scores = summary["quality"][name]
            lines.append(f"| {LABELS[name]} | " + " | ".join(f"{scores[m]:.2f}" for m in metrics) + " |")
    lines += accuracy_table(summary)
    extra = summary["extra_parameters"]
    lines += [
        "",
        f"Extra parameters (besides LoRA): streams {extra['streams']:,} + pruning head {extra['pruning_head']:,} "
        f"= {extra['total']:,}; Medusa heads for the same gamma would add {extra['medusa_same_gamma']:,}.",
    ]
    for name, info in summary["training"].items():
        lines.append(
            f"Training {LABELS[name]}: {info['train_seconds'] / 60:.1f} min, {info['train_tokens']:,} tokens, "
            f"{info['optimizer_steps']} steps."
        )
    lines += ["", "| bar | value | limit | |", "|---|---:|---:|---|"]
    for check in summary["bars"]:
        lines.append(
            f"| {check['bar']} | {check['value']:.2f} | {check['limit']:.2f} | {'PASS' if check['pass'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def accuracy_table(summary: dict) -> list[str]:
    """Teacher-forced accuracy against the validation references and against the model's own
    greedy test answers (the tokens decoding accepts drafts against)."""
    references, own = summary["stream_accuracy"], summary.get("stream_accuracy_own", {})
    if not references:
        return []
    top_key = next(k for k in next(iter(references.values())) if k.startswith("top") and k != "top1")
    lines = [
        "",
        f"Teacher-forced accuracy on {summary['validation_examples']} validation examples (answer tokens), "
        "against the references; and on the test inputs against the model's own greedy answers:",
        "",
        f"| predictor | top-1 % | {top_key} % | tokens | own test answers: top-1 % | {top_key} % |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in references.items():
        mine = own.get(name)
        tail = f"{mine['top1']:.1f} | {mine[top_key]:.1f}" if mine else "- | -"
        lines.append(f"| {name} | {row['top1']:.1f} | {row[top_key]:.1f} | {row['tokens']} | {tail} |")
    return lines


# within_tolerance -> the table's word; None: a low-bit format, whose error against fp32 is recorded, not judged
TOLERANCE = {True: "yes", False: "NO", None: "n/a (low-bit)"}


def artifact_markdown(manifest: dict) -> str:
    """Files, sizes, export times and parity of an exported artifact."""
    nodes = ", ".join(str(tree["num_nodes"]) for tree in manifest["trees"])
    lines = [
        f"## Artifact: trees of {nodes} nodes (the default first), KV capacity {manifest['graphs']['capacity']}, "
        f"prefill chunk {manifest['graphs']['prefill_chunk']}",
        "",
        "| backend | weights | files | MiB | export s | SS == torch eager fp32 | SS == own plain | step outputs in "
        "tolerance |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for backend, files in manifest["files"].items():
        size = sum(entry["bytes"] for entry in files.values()) / 2**20
        parity = manifest["parity"].get(backend)
        checks = (
            f"{parity['ss_equals_torch_eager']}/{parity['prompts']} | {parity['ss_equals_own_plain']}/"
            f"{parity['plain_prompts']} | {TOLERANCE[parity['within_tolerance']]}"
            if parity
            else "not run here | | "
        )
        names = ", ".join(sorted({entry["path"].split("/")[0] for entry in files.values()}))
        weights = manifest["graphs"]["quantize"][backend]
        lines.append(
            f"| {backend} | {weights} | {names} | {size:.0f} | {manifest['export_seconds'][backend]:.0f} | {checks} |"
        )
    return "\n".join(lines)


def profile_markdown(manifest: dict) -> str:
    result = manifest.get("profile")
    if not result:
        return "No profile in the manifest."
    bench, profile = result["bench"], result["profile"]
    depth = " / ".join(f"{row['acceptance'] * 100:.1f} %" for row in profile.get("acceptance_per_depth", []))
    return "\n".join(
        [
            f"## Profile: {bench['backend']}, {bench['inputs']} test inputs, greedy, {bench['threads']} threads, "
            f"load {bench['load_average'][0]:.2f} -> {bench['load_average'][1]:.2f}",
            "",
            "| metric | value |",
            "|---|---:|",
            f"| SS output != plain output (inputs) | {bench['parity_mismatches']} |",
            f"| call reduction CR (new tokens / SS calls, prefill counted) | {bench['call_reduction']:.2f} |",
            f"| acceptance per depth | {depth} |",
            f"| speed-up, total time (plain / SS) | {bench['speedup_total_time']:.2f}x |",
            f"| tokens/s median, plain / SS | {bench[f'{registry.plain()}_tokens_per_s_median']:.1f} / "
            f"{bench[f'{registry.default()}_tokens_per_s_median']:.1f} |",
            f"| peak process memory | {bench['peak_memory_bytes'] / 2**20:.0f} MiB |",
        ]
    )


def calibration_markdown(manifest: dict) -> str:
    """Per backend calibrated here: the plain step, the chosen tree, its cost and expected speed-up."""
    backends = manifest["calibration"]["backends"]
    if not backends:
        return "No calibration in the manifest."
    lines = [
        "## Calibration: the draft tree per backend on this machine",
        "",
        "| backend | plain step ms | tree nodes | step ms (x plain) | greedy step as (the other way's ms) "
        "| tokens / step: model (timed runs) | expected speed-up |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for backend, data in backends.items():
        chosen = next(row for row in data["trees"] if row["tree"]["hash"] == data["choice"]["hash"])
        way = "step, then streams" if chosen["two_calls"] else "greedy_step"
        other = f" ({chosen['other_ms']:.1f})" if chosen["other_ms"] is not None else ""
        lines.append(
            f"| {backend} | {data['plain_ms']:.1f} | {chosen['tree']['num_nodes']} | {chosen['step_ms']:.1f} "
            f"(x{chosen['step_cost']:.2f}) | {way}{other} | {chosen['expected_tokens']:.2f} "
            f"({chosen['realised_tokens']:.2f}) | {data['expected_speedup']:.2f}x |"
        )
    return "\n".join(lines)
