"""Call-reduction metrics of decode traces ("streamfuse.trace/3") of any backend and method, and
their report: profile.json, profile.md and three PNG plots.

A library, no CLI (tools/profiler.py is the entry point; the build's profile stage calls it too).
Pure Python + matplotlib (Agg, loaded only to plot): no torch, so a trace recorded on any
accelerator can be profiled on any machine. Every metric is defined in LEGEND, which profile.md repeats.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from statistics import fmean

from streamfuse.runtime.request.trace import SPANS, load_trace

SCHEMA = "streamfuse.profile/1"
PLOTS = {"acceptance": "acceptance.png", "tokens_per_call": "tokens_per_call.png", "time_split": "time_split.png"}

LEGEND = {
    "model_calls": "forward calls summed over runs, prefill included (+1 convention: plain decoding of "
    "n tokens makes n calls, the prefill producing the first token)",
    "call_reduction": "CR = calls plain decoding would need / calls made = sum(new_tokens) / sum(model_calls); "
    "CR(plain decoding) = 1 exactly",
    "tokens_per_s": "sum(new_tokens) / sum(seconds)",
    "mean_tokens_per_step": "mean of step.tokens: tokens per verify call, prefill excluded",
    "mean_accepted_depth": "mean of step.accepted_depth (accepted draft tokens per verify call)",
    "acceptance": "acceptance at depth d (= stream d, which drafts depth d): fraction of steps with "
    "accepted_depth >= d",
    "conditional_acceptance": "P(accepted_depth >= d | accepted_depth >= d-1)",
    "tree_utilisation": "mean(accepted_depth + 1) / mean(tree_nodes)",
    "mean_step_utilisation": "per-step mean of (accepted_depth + 1) / tree_nodes",
    "lookup_share": "sum(step.lookup_accepted) / sum(step.accepted_depth): accepted drafts that came "
    "from the tree's prompt-lookup branch rather than the streams (0 without one)",
    "mean_pruned_nodes": "mean of tree_nodes - kept_nodes per step",
    "pruned_fraction": "sum(tree_nodes - kept_nodes) / sum(tree_nodes)",
    "time_split": "each span summed over runs; fraction of total = max(sum(seconds), sum(spans)); "
    "'other' = time no span covered",
    "plain_calls": "calls that verified the root alone: plain decoding's after the prefill, and a speculative "
    "run's while its fallback had switched speculation off (runtime/speculation/fallback.py)",
    "draft_calls": "a draft model's calls summed over runs, its prefill included (0 where drafts come out "
    "of the target's own pass: SS streams, Medusa heads); not in model_calls",
    "draft_latency_s": "draft span / drafted steps: proposing a draft (a draft model's calls, or filling a tree)",
    "switches_to_plain": "times a run's fallback switched to plain decoding (a block of steps yielded fewer "
    "tokens than it cost)",
    "switches_to_ss": "times a run went back to speculating (a probe) after a plain stretch",
    "forward_latency_s": "forward span / calls after the prefill (steps + plain_calls)",
    "streams_latency_s": "streams span / verify calls: getting the next draft's stream logits (a pass of "
    "their own with deferred streams)",
    "prefill_per_run_s": "prefill span / runs",
    "peak_memory_bytes": "max peak_memory_bytes over runs (null if no run recorded it)",
    "tokens_per_call_histogram": "count of steps per step.tokens value",
    "measured_call_ratio": "baseline model_calls / these model_calls, over run ids present in both",
    "speedup": "wall-clock speed-up = baseline seconds / these seconds, over run ids present in both",
}


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _mean(values: list[float]) -> float | None:
    return fmean(values) if values else None


def _per_depth(steps: list[dict], max_depth: int) -> list[dict]:
    """Acceptance of each tree depth; stream j drafts depth j, so this is also per stream."""
    rows = []
    reached_before = len(steps)  # every step reaches depth 0 (the root is always kept)
    for depth in range(1, max_depth + 1):
        reached = sum(step["accepted_depth"] >= depth for step in steps)
        rows.append(
            {
                "depth": depth,
                "stream": depth,
                "steps_reaching": reached,
                "acceptance": _ratio(reached, len(steps)),
                "conditional_acceptance": _ratio(reached, reached_before),
            }
        )
        reached_before = reached
    return rows


def _step_metrics(steps: list[dict], tree_depth: int) -> dict:
    nodes = [step["tree_nodes"] for step in steps]
    pruned = [step["tree_nodes"] - step["kept_nodes"] for step in steps]
    accepted_nodes = [step["accepted_depth"] + 1 for step in steps]
    max_depth = max([tree_depth, *(step["accepted_depth"] for step in steps)])
    histogram = Counter(step["tokens"] for step in steps)
    return {
        "steps": len(steps),
        "mean_tokens_per_step": _mean([step["tokens"] for step in steps]),
        "mean_accepted_depth": _mean([step["accepted_depth"] for step in steps]),
        "acceptance_per_depth": _per_depth(steps, max_depth),
        # mean(a) / mean(b) over the same steps is sum(a) / sum(b).
        "tree_utilisation": _ratio(sum(accepted_nodes), sum(nodes)),
        # Steps with no tree (tree_nodes 0) have no utilisation to average.
        "mean_step_utilisation": _mean([used / n for used, n in zip(accepted_nodes, nodes) if n]),
        "lookup_share": _ratio(
            sum(step["lookup_accepted"] for step in steps), sum(step["accepted_depth"] for step in steps)
        ),
        "mean_pruned_nodes": _mean(pruned),
        "pruned_fraction": _ratio(sum(pruned), sum(nodes)),
        # String keys: what JSON keeps, so profile.json and the returned dict agree.
        "tokens_per_call_histogram": {str(k): histogram[k] for k in sorted(histogram)},
    }


def _time_split(runs: list[dict]) -> dict:
    names = list(SPANS) + sorted({name for run in runs for name in run["spans"]} - set(SPANS))
    spans = {name: sum(run["spans"].get(name, 0.0) for run in runs) for name in names}
    covered = sum(spans.values())
    # Spans may not cover the whole run (tokenising, sampling); 'other' keeps fractions summing to 1.
    total = max(sum(run["seconds"] for run in runs), covered)
    spans["other"] = total - covered
    return {
        "total_seconds": total,
        "spans": {name: {"seconds": s, "fraction": _ratio(s, total)} for name, s in spans.items()},
    }


def _totals_by_id(trace: dict) -> dict[str, tuple[int, float]]:
    """Calls and seconds per run id; repeated ids (timing repeats) are summed."""
    totals: dict[str, tuple[int, float]] = {}
    for run in trace["runs"]:
        calls, seconds = totals.get(run["id"], (0, 0.0))
        totals[run["id"]] = (calls + run["model_calls"], seconds + run["seconds"])
    return totals


def compare(trace: dict, baseline: dict) -> dict:
    """Measured call ratio and speed-up against a baseline, only over run ids both traces have."""
    ours, theirs = _totals_by_id(trace), _totals_by_id(baseline)
    matched = sorted(ours.keys() & theirs.keys())
    calls = sum(ours[i][0] for i in matched)
    base_calls = sum(theirs[i][0] for i in matched)
    seconds = sum(ours[i][1] for i in matched)
    base_seconds = sum(theirs[i][1] for i in matched)
    return {
        "matched_runs": len(matched),
        "runs": len(ours),
        "baseline_runs": len(theirs),
        "baseline_method": baseline.get("meta", {}).get("method"),
        "model_calls": calls,
        "baseline_model_calls": base_calls,
        "measured_call_ratio": _ratio(base_calls, calls),
        "seconds": seconds,
        "baseline_seconds": base_seconds,
        "speedup": _ratio(base_seconds, seconds),
    }


def profile_trace(trace: dict, baseline: dict | None = None) -> dict:
    """All metrics of a loaded trace (see LEGEND); `baseline` adds the comparison block."""
    runs = trace["runs"]
    meta = trace["meta"]
    steps = [step for run in runs for step in run["steps"]]
    calls = sum(run["model_calls"] for run in runs)
    tokens = sum(run["new_tokens"] for run in runs)
    seconds = sum(run["seconds"] for run in runs)
    verify_calls = sum(len(run["steps"]) + run["plain_calls"] for run in runs)
    switches = Counter(switch["to"] for run in runs for switch in run["switches"])
    split = _time_split(runs)
    peaks = [run["peak_memory_bytes"] for run in runs if run["peak_memory_bytes"] is not None]
    return {
        "schema": SCHEMA,
        "meta": meta,
        "runs": len(runs),
        "model_calls": calls,
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": _ratio(tokens, seconds),
        "call_reduction": _ratio(tokens, calls),
        **_step_metrics(steps, ((meta.get("tree") or {}).get("depth") or 0)),
        "plain_calls": sum(run["plain_calls"] for run in runs),
        "draft_calls": sum(run["draft_calls"] for run in runs),
        # "to" is "plain" or the run's method: every other switch goes back to speculating
        "switches_to_plain": switches["plain"],
        "switches_to_ss": sum(switches.values()) - switches["plain"],
        "time_split": split,
        "forward_latency_s": _ratio(split["spans"]["forward"]["seconds"], verify_calls),
        "streams_latency_s": _ratio(split["spans"]["streams"]["seconds"], verify_calls),
        "draft_latency_s": _ratio(split["spans"]["draft"]["seconds"], len(steps)),
        "prefill_per_run_s": _ratio(split["spans"]["prefill"]["seconds"], len(runs)),
        "peak_memory_bytes": max(peaks, default=None),
        "baseline": compare(trace, baseline) if baseline is not None else None,
    }


def profile_files(trace_path: Path, baseline_path: Path | None = None) -> dict:
    """Load and profile; ValueError naming the file for a wrong schema or invalid JSON."""

    def load(path: Path) -> dict:
        try:
            return load_trace(path)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc

    return profile_trace(load(trace_path), load(baseline_path) if baseline_path is not None else None)


# --- report ----------------------------------------------------------------------------------
def fmt(value: object) -> str:
    """A value as the report and the CLI's summary line print it."""
    if value is None:
        return "—"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]


HEADLINE = (
    "runs",
    "model_calls",
    "new_tokens",
    "seconds",
    "tokens_per_s",
    "call_reduction",
    "steps",
    "mean_tokens_per_step",
    "mean_accepted_depth",
    "tree_utilisation",
    "mean_step_utilisation",
    "lookup_share",
    "mean_pruned_nodes",
    "pruned_fraction",
    "plain_calls",
    "draft_calls",
    "switches_to_plain",
    "switches_to_ss",
    "forward_latency_s",
    "streams_latency_s",
    "draft_latency_s",
    "prefill_per_run_s",
    "peak_memory_bytes",
)


def render_markdown(metrics: dict) -> str:
    meta = metrics["meta"]
    lines = [
        f"# Decode profile: {meta.get('method', '?')} on {meta.get('backend', '?')} / {meta.get('device', '?')}",
        "",
        *_table(["metric", "value"], [[key, metrics[key]] for key in HEADLINE]),
    ]
    if metrics["baseline"] is not None:
        base = metrics["baseline"]
        lines += [
            "",
            f"Baseline ({base['baseline_method']}): {base['matched_runs']} run ids matched "
            f"(of {base['runs']} here, {base['baseline_runs']} in the baseline).",
            "",
            *_table(["metric", "value"], [[k, base[k]] for k in ("measured_call_ratio", "speedup")]),
        ]
    lines += ["", "## Acceptance per depth (= per stream)", ""]
    if metrics["acceptance_per_depth"]:
        lines += _table(
            ["depth d / stream d", "steps reaching", "acceptance", "P(>= d \\| >= d-1)"],
            [
                [r["depth"], r["steps_reaching"], r["acceptance"], r["conditional_acceptance"]]
                for r in metrics["acceptance_per_depth"]
            ],
        )
    else:
        lines.append("No draft depths: the trace has no speculative steps.")
    lines += [
        "",
        "## Time split",
        "",
        *_table(
            ["span", "seconds", "fraction"],
            [[name, s["seconds"], s["fraction"]] for name, s in metrics["time_split"]["spans"].items()],
        ),
        "",
        "## Plots",
        "",
    ]
    lines += [f"![{name}]({file})" for name, file in PLOTS.items()]
    lines += ["", "## Legend", ""] + [f"- **{key}**: {text}" for key, text in LEGEND.items()]
    return "\n".join(lines) + "\n"


def _figure(width: float = 5.0, height: float = 3.2):
    # A bare Figure on the Agg canvas, not pyplot: no global backend switch for a host app.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _no_data(axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes)
    axes.set_axis_off()


def _plots(metrics: dict) -> dict:
    acceptance, ax = _figure()
    rows = metrics["acceptance_per_depth"]
    if rows:
        ax.bar([r["depth"] for r in rows], [r["acceptance"] or 0.0 for r in rows], label="P(depth >= d)")
        ax.plot(
            [r["depth"] for r in rows],
            [r["conditional_acceptance"] or 0.0 for r in rows],
            "o-",
            color="C1",
            label="P(>= d | >= d-1)",
        )
        ax.set(
            xlabel="tree depth d (= stream d)", ylabel="acceptance", ylim=(0, 1.05), xticks=[r["depth"] for r in rows]
        )
        ax.legend(loc="upper right")  # deep depths have the low bars
    else:
        _no_data(ax, "no speculative steps")

    histogram, ax = _figure()
    counts = metrics["tokens_per_call_histogram"]
    if counts:
        ax.bar([int(k) for k in counts], list(counts.values()))
        ax.set(xlabel="tokens per verify call", ylabel="steps", xticks=[int(k) for k in counts])
    else:
        _no_data(ax, "no speculative steps")

    split, ax = _figure(6.0, 2.4)
    left = 0.0
    for index, (name, span) in enumerate(metrics["time_split"]["spans"].items()):
        ax.barh([0], [span["seconds"]], left=left, color=f"C{index}", label=name)
        left += span["seconds"]
    ax.set(xlabel="seconds (all runs)", yticks=[])
    ax.legend(ncol=6, fontsize="small", loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return {"acceptance": acceptance, "tokens_per_call": histogram, "time_split": split}


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # readers never see a half-written report


def write_report(metrics: dict, out_dir: Path) -> list[Path]:
    """profile.json, profile.md and the PNG plots in out_dir; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "profile.json", out_dir / "profile.md"]
    _write_text(written[0], json.dumps(metrics, indent=1) + "\n")
    _write_text(written[1], render_markdown(metrics))
    for name, figure in _plots(metrics).items():
        path = out_dir / PLOTS[name]
        tmp = path.with_name(path.name + ".tmp")
        figure.savefig(tmp, format="png")  # the .tmp suffix hides the format from matplotlib
        os.replace(tmp, path)
        written.append(path)
    return written
