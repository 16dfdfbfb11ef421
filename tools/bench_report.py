"""Benchmark report files: bench.md (tables), bench.json and PNG plots, each written atomically."""

from __future__ import annotations

import json
from pathlib import Path

from streamfuse.methods import sd
from streamfuse.runtime.methods import registry

PEER_COLOR, OTHER_COLOR = "#e08a2c", "#444444"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write beside the target, then rename: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _row(r: dict) -> str:
    rouge = r["rouge"] or {}
    return (
        f"| {r['name']} | {r['precision']} | {r['model']} | {r['tokens_per_s_median']:.1f} | "
        f"{_num(r['speedup_total_time'], '.2f', 'x')} | {_num(r['speedup_median_per_input'], '.2f', 'x')} | "
        f"{_num(r['speedup_after_first_token'], '.2f', 'x')} | "
        f"{r['baseline'] or '-'} | {_num(r['call_reduction'], '.2f')} | {_num(r['draft_calls'], 'd')} | "
        f"{_num(r['mean_accepted_tokens'], '.2f')} | {_num(r['mean_draft_nodes'], '.2f')} | "
        f"{_num(r['draft_ms_per_step'], '.1f')} | "
        f"{r['ttft_s_median']:.3f} | {r['decode_tokens_per_s']:.1f} | {r['prompt_ms_per_token_median']:.2f} | "
        f"{_num(rouge.get('rouge1'), '.2f')} | {_num(rouge.get('rougeLsum'), '.2f')} | "
        f"{_num(r['mismatches'], 'd')} | {_mib(r['load_rss_bytes'])} |"
    )


def _machine_line(m: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    start, end = m["load_average_start"], m.get("load_average_end") or [float("nan")] * 3
    return (
        f"Machine: {m['cpu']} ({m['cores']} cores), {m['threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy']}, "
        f"load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in start)} at start, "
        f"{'/'.join(f'{x:.2f}' for x in end)} at end; {versions}."
    )


def markdown(report: dict) -> str:
    cfg, s = report["settings"], report["summary"]
    lines = [
        f"## {cfg['task']} {cfg['split'] or Path(cfg['data']).name}: methods x backends x peers, {s['inputs']} inputs, "
        "greedy, batch 1",
        "",
        _machine_line(report["machine"]),
        f"Tree: {', '.join(f'{b} {n} nodes' for b, n in cfg['tree_nodes'].items())}; streams "
        f"{', '.join(f'{b} {mode}' for b, mode in cfg['stream_schedule'].items())}; "
        f"max {cfg['max_new_tokens']} new tokens; "
        f"{cfg['repeats']} interleaved repeat(s) per input (median time), {cfg['warmup']} warm-up input(s).",
        "",
        "| row | precision | model | tokens/s (median) | speed-up, total time | speed-up, median per input "
        "| speed-up after the first token | vs "
        "| call reduction CR (tokens / target calls) | draft-model calls | mean accepted tokens | mean drafts verified "
        "| draft ms per drafted step | TTFT (median, s) "
        "| tokens/s after the first token | prompt ms per token (median) | ROUGE-1 | ROUGE-Lsum "
        "| output != baseline (inputs) | RSS added at load (MiB) |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_row(r) for r in report["table"]),
        "",
        "Speed-up = tokens/s ratio against the row named under 'vs', measured in the same run (= time ratio "
        "where outputs are equal). CR counts the target's calls, the prefill included; AR rows have CR = mean accepted "
        "tokens = 1. Draft-model calls are a draft model's own (sd, specdec++), not in CR; SS and Medusa drafts come "
        "out of the target's pass. Mean drafts verified: draft tokens per speculative target call (the tree's nodes "
        "below the root; specdec++ chooses its chain's length per step).",
        f"A method's output != AR output on its own backend: {s['parity_mismatches']} (inputs, all backends).",
        *(
            f"{r['name']}: speed-up per fifth of the inputs (total time) "
            f"{' / '.join(f'{x:.2f}x' for x in r['speedup_by_fifth'])}."
            for r in report["table"]
            if r["kind"] == "streamfuse" and r["method"] != registry.plain() and r.get("speedup_by_fifth")
        ),
    ]
    for c in s["matched_precision"]:
        lines.append(
            f"Fastest fine-tuned peer at {c['precision']}: {c['peer']} {c['peer_tokens_per_s']:.1f} tokens/s; "
            f"fastest SS backend {c['streamfuse']} {c['streamfuse_tokens_per_s']:.1f} tokens/s: "
            f"**{c['ratio']:.2f}x**; after the first token **{c['decode_ratio']:.2f}x**."
        )
    lines.append(f"Process peak RSS (all models loaded in one process): {_mib(s['peak_memory_bytes'])} MiB.")
    lines += [f"Skipped peer {name}: {reason}" for name, reason in report["skipped"].items()]
    lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines)


def method_colors() -> dict[str, str]:
    """A bar's colour per method: plain decoding grey, the default method blue, the two-model draft green."""
    return {registry.plain(): "#8c8c8c", registry.default(): "#2b7bba", sd.NAME: "#3a9d5d"}


def _color(row: dict) -> str:
    return PEER_COLOR if row["kind"] == "peer" else method_colors().get(row["method"], OTHER_COLOR)


def _bars(ax, rows: list[dict], values: list[float], xlabel: str, fmt: str) -> None:
    labels = [f"{r['name']} ({r['precision']})" for r in rows]
    ax.barh(labels, values, color=[_color(r) for r in rows])
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel(xlabel)
    ax.margins(x=0.15)  # room for the value labels
    for y, value in enumerate(values):
        ax.annotate(f"{value:{fmt}}", (value, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)


def _save(fig, path: Path) -> None:
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    write_atomic(path, buffer.getvalue())


def plots(report: dict, out: Path) -> list[Path]:
    """tokens_per_s.png (every row) and speedup.png (SS per backend vs its AR; peers vs torch AR)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, title = report["table"], f"{report['settings']['task']}, {report['summary']['inputs']} inputs"
    written = []
    height = 0.9 + 0.35 * len(rows)
    fig, ax = plt.subplots(figsize=(7, height))
    _bars(ax, rows, [r["tokens_per_s_median"] for r in rows], "tokens/s (median per input)", ".1f")
    ax.set_title(f"Throughput, {title}")
    _save(fig, out / "tokens_per_s.png")
    written.append(out / "tokens_per_s.png")
    plt.close(fig)
    compared = [r for r in rows if r["method"] != registry.plain() and r["speedup_total_time"] is not None]
    if compared:
        fig, ax = plt.subplots(figsize=(7, 0.9 + 0.35 * len(compared)))
        _bars(
            ax,
            compared,
            [r["speedup_total_time"] for r in compared],
            "speed-up vs AR (total time; peers vs AR on torch)",
            ".2f",
        )
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"Speed-up vs AR on the same backend, {title}")
        _save(fig, out / "speedup.png")
        written.append(out / "speedup.png")
        plt.close(fig)
    return written


def write_report(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "bench.json", json.dumps(report, indent=1))
    write_atomic(out / "bench.md", markdown(report) + "\n")
    return [out / "bench.json", out / "bench.md", *plots(report, out)]
