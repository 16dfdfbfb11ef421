"""Benchmark table: one row per (method, backend) and per peer, Spec-Bench style.

Speed-up is a throughput ratio against a baseline measured in the same run: AR on the same backend
for streamfuse rows, streamfuse AR on torch for peers. When the outputs are equal (SS vs AR, lossless
peers) it is the time ratio; when a peer's outputs differ, tokens/s is the fair measure.
"After the first token" divides tokens after the first by the time after it (prompt processing,
which SS and AR share, left out). Tokens/s over a whole input depends on how many tokens a model
writes (time to the first token weighs more in a short answer), so rows whose outputs differ in
length compare on the two phases instead: tokens/s after the first token and prompt
milliseconds per prompt token.
CR = new tokens / model calls with the prefill counted (AR: 1.0); mean accepted tokens = tokens per
SS decoding step (Spec-Bench's "mean accepted tokens"; AR: 1.0). Peers expose neither.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from streamfuse.metrics.rouge import rouge
from streamfuse.runtime.methods import registry
from streamfuse.tools.bench_data import BenchInput

REFERENCE_BACKEND = "torch"  # the peers are compared with plain decoding on it


def _rate(run: dict) -> float:
    return run["new_tokens"] / run["seconds"] if run["seconds"] > 0 else 0.0


def _decode_rate(runs: Sequence[dict]) -> float:
    """Tokens after the first over the time after it: the decoding phase alone, prompt processing excluded."""
    return sum(r["new_tokens"] - 1 for r in runs) / max(sum(r["seconds"] - r["ttft_s"] for r in runs), 1e-9)


def _speedups(runs: Sequence[dict], baseline: Sequence[dict] | None) -> dict:
    if not baseline:
        return {
            "speedup_total_time": None,
            "speedup_median_per_input": None,
            "speedup_after_first_token": None,
            "speedup_by_fifth": None,
            "mismatches": None,
        }
    total = lambda rs: sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)  # noqa: E731
    # Consecutive fifths of the inputs: a speed-up that holds on each is not carried by a few inputs.
    fifths = [slice(len(runs) * k // 5, len(runs) * (k + 1) // 5) for k in range(5)] if len(runs) >= 5 else []
    return {
        "speedup_total_time": total(runs) / total(baseline),
        "speedup_by_fifth": [total(runs[part]) / total(baseline[part]) for part in fifths] or None,
        "speedup_after_first_token": _decode_rate(runs) / _decode_rate(baseline),
        "speedup_median_per_input": statistics.median(_rate(r) / _rate(b) for r, b in zip(runs, baseline)),
        "mismatches": sum(r["token_ids"] != b["token_ids"] for r, b in zip(runs, baseline)),
    }


def _stats(
    runs: Sequence[dict], baseline: Sequence[dict] | None, inputs: Sequence[BenchInput], prompt_tokens: Sequence[int]
) -> dict:
    return {
        "inputs": len(runs),
        "new_tokens": sum(r["new_tokens"] for r in runs),
        "seconds_total": sum(r["seconds"] for r in runs),
        "tokens_per_s_median": statistics.median(_rate(r) for r in runs),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in runs),
        "decode_tokens_per_s": _decode_rate(runs),
        "prompt_ms_per_token_median": statistics.median(1e3 * r["ttft_s"] / n for r, n in zip(runs, prompt_tokens)),
        **_speedups(runs, baseline),
        # inputs without references (unlabelled dialogues) have no score
        "rouge": rouge([r["text"] for r in runs], [i.references for i in inputs])
        if all(i.references for i in inputs)
        else None,
        "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in runs),
    }


def _streamfuse_row(method: str, backend: str, rows: Sequence[dict], inputs: Sequence[BenchInput]) -> dict:
    runs = [r[method] for r in rows]
    steps = [t for r in runs for t in r["step_tokens"]]
    plain = registry.plain()
    baseline = [r[plain] for r in rows] if plain in rows[0] else None
    return {
        "name": f"{method}/{backend}",
        "kind": "streamfuse",
        "method": method,
        "backend": backend,
        "baseline": f"{plain}/{backend}" if baseline else None,
        **_stats(runs, baseline, inputs, [r["prompt_tokens"] for r in rows]),
        "call_reduction": sum(r["new_tokens"] for r in runs) / sum(r["model_calls"] for r in runs),
        "draft_calls": sum(r["draft_calls"] for r in runs),
        "mean_accepted_tokens": (statistics.mean(steps) if steps else None) if method != plain else 1.0,
        "mean_draft_nodes": statistics.mean(d for r in runs for d in r["step_drafts"]) if steps else None,
        # the host's time in the drafter per drafted step (PEARL: waiting for its worker's drafts)
        "draft_ms_per_step": 1000 * statistics.mean(d for r in runs for d in r["step_draft_s"]) if steps else None,
    }


def table(
    rows: Sequence[dict],
    peer_rows: Sequence[dict],
    inputs: Sequence[BenchInput],
    methods: Sequence[str],
    info: dict[str, dict],
) -> list[dict]:
    """info: row unit (backend or peer name) -> {"precision", "model", "load_rss_bytes"}."""
    out = []
    by_backend: dict[str, list[dict]] = {}
    for row in rows:
        by_backend.setdefault(row["backend"], []).append(row)
    for backend, backend_rows in by_backend.items():
        for method in methods:
            out.append({**_streamfuse_row(method, backend, backend_rows, inputs), **info[backend]})
    method, backend = registry.plain(), REFERENCE_BACKEND
    reference = [r[method] for r in by_backend.get(backend, []) if method in r] or None
    for name in peer_rows[0]["results"] if peer_rows else {}:
        runs = [r["results"][name] for r in peer_rows]
        out.append(
            {
                "name": name,
                "kind": "peer",
                "method": name,
                "backend": None,
                "baseline": f"{method}/{backend}" if reference else None,
                **_stats(runs, reference, inputs, [r["prompt_tokens"] for r in peer_rows]),
                "call_reduction": None,
                "draft_calls": None,
                "mean_accepted_tokens": None,
                "mean_draft_nodes": None,
                "draft_ms_per_step": None,
                **info[name],
            }
        )
    return out


# Weight formats compared with each other: the same bits per weight, whatever the engine's layout
# (q4-native holds the base GGUF's own Q4_1 codes, as llama.cpp's q4_1 rows do).
WEIGHT_BITS = {
    "q4-native": "4-bit",
    "q4_1": "4-bit",
    "q4_0": "4-bit",
    "8da4w": "4-bit",
    "int8": "8-bit",
    "q8_0": "8-bit",
}


def weight_class(precision: str) -> str:
    return WEIGHT_BITS.get(precision, precision)


def matched_precision(rows: Sequence[dict]) -> list[dict]:
    """Per weight class (weight_class): the fastest fine-tuned peer vs the fastest streamfuse SS backend, by
    tokens/s (medians over inputs) and by tokens/s after the first token (which output length does not sway)."""
    found = []
    ss_rows = [r for r in rows if r["kind"] == "streamfuse" and r["method"] == registry.default()]
    for precision in dict.fromkeys(weight_class(r["precision"]) for r in ss_rows):
        ss = [r for r in ss_rows if weight_class(r["precision"]) == precision]
        peers = [
            r
            for r in rows
            if r["kind"] == "peer" and weight_class(r["precision"]) == precision and r["model"] == "fine-tuned"
        ]
        if not peers:
            continue
        best = max(ss, key=lambda r: r["tokens_per_s_median"])
        peer = max(peers, key=lambda r: r["tokens_per_s_median"])
        found.append(
            {
                "precision": precision,
                "streamfuse": best["name"],
                "peer": peer["name"],
                "streamfuse_tokens_per_s": best["tokens_per_s_median"],
                "peer_tokens_per_s": peer["tokens_per_s_median"],
                "ratio": best["tokens_per_s_median"] / peer["tokens_per_s_median"],
                "decode_ratio": best["decode_tokens_per_s"] / peer["decode_tokens_per_s"],
            }
        )
    return found
