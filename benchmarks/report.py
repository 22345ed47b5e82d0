"""From the workers' raw records to the numbers per run, the JSON file and the Markdown table.

Per (run, trace):

* **step time**: per step, the median over the timed passes (rank 0's clock; the ranks are synchronised by
  their collectives), the instrumented pass's times when there is no timed pass;
* **tokens/s**: every token of the trace over the sum of the step times (the whole job: with data
  parallelism one step trains ``p`` sequences); ``tokens_per_s_trainable`` leaves the OOM steps out;
  per length bucket the same ratio over the steps whose (longest) sequence falls in the bucket;
* **peak memory**: the largest absolute peak of any step on any rank (instrumented pass);
* **OOM steps**: steps whose peak on some rank exceeds the budget (or that CUDA could not run);
* **bytes sent per step**: mean over steps and ranks, every ``torch.distributed`` collective counted
  (``comm_bytes_per_step``; ``collectives_per_step`` counts the calls) and, for ParaDySe runs, the
  package's ``CommCounter`` (``paradyse_comm_bytes_per_step``);
* **model FLOP/s per rank**: ``6 N s + 6 L h s^2`` FLOPs per sequence of length ``s`` (``N`` matrix
  parameters, causal attention; recomputation not counted) over ``p`` times the wall time, and its fraction
  of the measured float32 matmul rate of one process (``mfu``);
* **largest trainable length**: the length search's result (``max_len_capped`` when it reached the cap).

Ratios: against the *best static mode* and the *best Lightning built-in*: the fastest (tokens/s) of those
that trained the whole trace without an OOM step (the fastest of all of them if none did).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.runs import run_spec
from benchmarks.settings import BenchSettings, ModelSettings
from benchmarks.workload import Trace

MiB = 2**20


def model_flops(model: ModelSettings, length: int) -> float:
    """Training FLOPs of one causal sequence of ``length`` tokens (forward + backward, no recomputation)."""
    m = model.config()
    matrix_params = m.num_params() - m.vocab_size * m.hidden - (2 * m.n_layers + 1) * m.hidden  # no embedding, norms
    return 6.0 * matrix_params * length + 6.0 * m.n_layers * m.hidden * length * length


def _pass_times(fits: Sequence[dict[str, Any]]) -> list[list[float]]:
    """Rank 0's step times of every timed pass (of the instrumented pass when there is none)."""
    timed = [f for f in fits if f["pass"] > 0] or list(fits)
    return [[s["seconds"] for s in f["steps"][0]] for f in timed]


def _median_times(per_pass: list[list[float]], n_steps: int) -> list[float]:
    return [statistics.median(p[i] for p in per_pass) for i in range(n_steps)]


def _buckets(trace: Trace, lengths: list[int], tokens: list[int], times: list[float]) -> dict[str, float | None]:
    labels = trace.labels
    tok, sec = [0] * len(labels), [0.0] * len(labels)
    for length, t, s in zip(lengths, tokens, times):
        b = trace.bucket(length)
        tok[b] += t
        sec[b] += s
    return {labels[b]: (tok[b] / sec[b] if sec[b] > 0 else None) for b in range(len(labels))}


def _step_table(instrumented: dict[str, Any], budget: int, data_parallel: bool) -> dict[str, list[Any]]:
    """Per step: longest sequence, tokens trained (data parallel: every rank's sequence), peak, OOM, bytes."""
    ranks = instrumented["steps"]
    n = len(ranks[0])
    seqs = [[r[i]["len"] for r in ranks] if data_parallel else [ranks[0][i]["len"]] for i in range(n)]
    peaks = [max(r[i]["peak"] for r in ranks) for i in range(n)]
    oom = [peaks[i] > budget or any(r[i]["cuda_oom"] or r[i].get("skipped") for r in ranks) for i in range(n)]
    return {
        "sequences": seqs,
        "lengths": [max(s) for s in seqs],
        "tokens": [sum(s) for s in seqs],
        "peaks": peaks,
        "peak_by_rank": [max(s["peak"] for s in r) for r in ranks],
        "oom": oom,
        "comm": [statistics.fmean(r[i]["comm"] for r in ranks) for i in range(n)],
        "calls": [statistics.fmean(r[i].get("comm_calls", 0) for r in ranks) for i in range(n)],
        "comm_pkg": [statistics.fmean(r[i]["comm_pkg"] or 0.0 for r in ranks) for i in range(n)],
        "skipped": [bool(ranks[0][i].get("skipped")) for i in range(n)],
        "plans": [ranks[0][i].get("plan") for i in range(n)],
        "predicted": [(ranks[0][i].get("pred_time_s"), ranks[0][i].get("pred_peak")) for i in range(n)],
    }


def _mape(pairs: list[tuple[float | None, float]]) -> float | None:
    """Mean absolute percentage error of ``(predicted, measured)`` pairs with a prediction."""
    errors = [abs(p - m) / m * 100 for p, m in pairs if p is not None and m > 0]
    return statistics.fmean(errors) if errors else None


def _prediction_fields(table: dict[str, Any], times: list[float]) -> dict[str, Any]:
    """The cost model's accuracy on this run's steps (adaptive run with a profile), and the plans."""
    if not any(plan is not None for plan in table["plans"]):
        return {"plans": None}
    pred = table["predicted"]
    return {
        "plans": table["plans"],
        "skipped_steps": sum(table["skipped"]),
        "predicted_step_time_s": [t for t, _ in pred],
        "predicted_peak_bytes": [m for _, m in pred],
        "cost_model_time_mape": _mape([(t, times[i]) for i, (t, _) in enumerate(pred)]),
        "cost_model_peak_mape": _mape([(m, table["peaks"][i]) for i, (_, m) in enumerate(pred)]),
    }


def summarise(name: str, trace: Trace, fits: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one (run, trace) from its fits (pass 0 instrumented, the others timed)."""
    spec = run_spec(name)
    base = {"name": name, "family": spec.family, "trace": trace.name}
    errors = [f["error"] for f in fits if "error" in f]
    if errors:
        return {**base, "error": errors[0], **ctx["search"].get(name, {})}
    table = _step_table(next(f for f in fits if f["pass"] == 0), ctx["budget"], spec.data_parallel)
    per_pass = _pass_times(fits)
    times = _median_times(per_pass, len(table["lengths"]))
    total_s, tokens = sum(times), sum(table["tokens"])
    ok = [i for i, bad in enumerate(table["oom"]) if not bad]
    flops = sum(model_flops(ctx["model"], length) for seqs in table["sequences"] for length in seqs)
    flops_per_rank = flops / (ctx["world"] * total_s)
    planner = [s["plan_s"] for f in fits if f["pass"] > 0 for s in f["steps"][0] if s["plan_s"] is not None]
    first_oom = next((i for i, bad in enumerate(table["oom"]) if bad), None)
    return {
        **base,
        "tokens": tokens,
        "seconds": total_s,
        "tokens_per_s": tokens / total_s,
        "tokens_per_s_trainable": sum(table["tokens"][i] for i in ok) / max(sum(times[i] for i in ok), 1e-12),
        "tokens_per_s_by_bucket": _buckets(trace, table["lengths"], table["tokens"], times),
        "step_lengths": table["lengths"],
        "step_tokens": table["tokens"],
        "step_time_s": times,
        "step_time_s_by_pass": per_pass,
        "tokens_per_s_by_pass": [tokens / sum(p) for p in per_pass],
        "step_time_median_s": statistics.median(times),
        "oom_steps": len(table["oom"]) - len(ok),
        "first_oom_step": first_oom,
        "seconds_before_first_oom": sum(times[:first_oom]) if first_oom is not None else total_s,
        "completed": first_oom is None,
        "peak_memory_bytes": max(table["peaks"]),
        "peak_memory_by_rank": table["peak_by_rank"],
        "step_peak_bytes": table["peaks"],
        "planner_ms_per_batch": 1e3 * statistics.fmean(planner) if planner else None,
        "comm_bytes_per_step": statistics.fmean(table["comm"]),
        "collectives_per_step": statistics.fmean(table["calls"]),
        "paradyse_comm_bytes_per_step": statistics.fmean(table["comm_pkg"]) if spec.uses_paradyse else None,
        "model_flops_per_s_per_rank": flops_per_rank,
        "mfu": flops_per_rank / ctx["matmul"],
        **(_prediction_fields(table, times) if spec.family == "paradyse" else {}),
        **ctx["search"].get(name, {}),
    }


def _search_fields(result: dict[str, Any]) -> dict[str, Any]:
    probes = {str(k): v for k, v in sorted(result["probes"].items())}
    return {"max_trainable_len": result["max_len"], "max_len_capped": result["capped"], "length_probes": probes}


def aggregate(raw: list[dict[str, Any]], settings: BenchSettings, traces: list[Trace]) -> list[dict[str, Any]]:
    """Every (run, trace) summary, runs in ``settings.runs`` order within each trace."""
    main = raw[0]
    ctx = {
        "budget": settings.budget,
        "model": settings.model,
        "world": len(raw),
        "matmul": statistics.fmean(r["matmul"] for r in raw),
        "search": {name: _search_fields(res) for name, res in main["search"].items()},
    }
    out = []
    for trace in traces:
        for name in settings.runs:
            fits = [f for f in main["fits"] if f["run"] == name and f["trace"] == trace.name]
            out.append(summarise(name, trace, fits, ctx))
    return out


def best(runs: list[dict[str, Any]], family: str) -> dict[str, Any] | None:
    """The fastest run of ``family`` that completed the trace (the fastest of all of them if none did)."""
    members = [r for r in runs if r["family"] == family and "error" not in r]
    done = [r for r in members if r["completed"]] or members
    return max(done, key=lambda r: r["tokens_per_s"]) if done else None


def _fmt(x: float | None, digits: int = 0, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x / scale:,.{digits}f}"


def _ratio(r: dict[str, Any], ref: dict[str, Any] | None) -> str:
    if ref is None or "error" in r:
        return "—"
    return f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}×"


def _max_len(r: dict[str, Any]) -> str:
    if r.get("max_trainable_len") is None:
        return "—"
    return ("≥ " if r["max_len_capped"] else "") + f"{r['max_trainable_len']:,}"


HEADER = (
    "| Run | tokens/s | vs best static | vs best Lightning | OOM steps | peak MiB/rank | max length "
    "| median step ms | planner ms | MiB sent/step | MFU |"
)


def _row(r: dict[str, Any], static: dict[str, Any] | None, builtin: dict[str, Any] | None) -> str:
    if "error" in r:
        return f"| {r['name']} | failed: {r['error'][:80]} | | | | | {_max_len(r)} | | | | |"
    cells = [
        r["name"] + (" **(best static)**" if r is static else " **(best Lightning)**" if r is builtin else ""),
        _fmt(r["tokens_per_s"]) + ("" if r["completed"] else " †"),
        _ratio(r, static),
        _ratio(r, builtin),
        f"{r['oom_steps']} / {len(r['step_lengths'])}",
        _fmt(r["peak_memory_bytes"], 1, MiB),
        _max_len(r),
        _fmt(r["step_time_median_s"], 0, 1e-3),
        _fmt(r["planner_ms_per_batch"], 3),
        _fmt(r["comm_bytes_per_step"], 2, MiB),
        f"{100 * r['mfu']:.1f}%",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_trace(runs: list[dict[str, Any]], trace: Trace, budget: int) -> str:
    """One trace's table: every run, with ratios against the best static mode and the best built-in."""
    static, builtin = best(runs, "static"), best(runs, "lightning")
    lengths = trace.lengths
    head = (
        f"### Trace `{trace.name}`: {len(lengths)} sequences, {min(lengths):,}–{max(lengths):,} tokens "
        f"({sum(lengths):,} in all), budget {_fmt(budget, 0, MiB)} MiB per rank"
    )
    rows = [_row(r, static, builtin) for r in runs]
    return "\n".join([head, "", HEADER, "|" + "---|" * 11, *rows, *_notes(runs, static, builtin)])


def _notes(runs: list[dict[str, Any]], static: dict[str, Any] | None, builtin: dict[str, Any] | None) -> list[str]:
    """Footnotes of a trace's table: OOM marks, fallbacks of the references, the adaptive run's cost model."""
    notes = [""]
    if any("error" not in r and not r["completed"] for r in runs):
        notes.append(
            "† some steps exceeded the budget (they would fail on a device with this much memory; on CPU they ran, "
            "and their time is in the tokens/s)."
        )
    for label, ref in (("static mode", static), ("Lightning built-in", builtin)):
        if ref is not None and not ref["completed"]:
            notes.append(f"No {label} trained the whole trace within the budget: its ratios are against the fastest.")
    for r in runs:
        if r.get("cost_model_time_mape") is not None:
            notes.append(
                f"{r['name']}: the cost model predicted its step times within {r['cost_model_time_mape']:.0f}% and "
                f"its peak memory within {r['cost_model_peak_mape']:.0f}% (mean absolute error); "
                f"{r['skipped_steps']} batch(es) skipped because no plan fits (counted as OOM)."
            )
    return notes if len(notes) > 1 else []


def markdown(report: dict[str, Any], traces: list[Trace]) -> str:
    """Every trace's table and its tokens/s per length bucket, then the largest trainable lengths."""
    parts = []
    for trace in traces:
        runs = [r for r in report["runs"] if r["trace"] == trace.name]
        parts += [markdown_trace(runs, trace, report["settings"]["budget"]), "", bucket_table(runs, trace), ""]
    if traces:
        first = [r for r in report["runs"] if r["trace"] == traces[0].name]
        parts += [length_table(first, report["settings"]["budget"]), ""]
    return "\n".join(parts).rstrip() + "\n"


def _longest(runs: list[dict[str, Any]], family: str) -> dict[str, Any] | None:
    found = [r for r in runs if r["family"] == family and r.get("max_trainable_len")]
    return max(found, key=lambda r: r["max_trainable_len"]) if found else None


def length_table(runs: list[dict[str, Any]], budget: int) -> str:
    """The largest length one training step fits in the budget, per run, against the longest static and built-in."""
    static, builtin = _longest(runs, "static"), _longest(runs, "lightning")

    def ratio(r: dict[str, Any], ref: dict[str, Any] | None) -> str:
        if ref is None or not r.get("max_trainable_len"):
            return "—"
        return f"{r['max_trainable_len'] / ref['max_trainable_len']:.2f}×"

    rows = [
        f"### Largest trainable length under {_fmt(budget, 0, MiB)} MiB per rank (doubling, then bisection; "
        "one training step per probe)",
        "",
        "| Run | largest length | vs longest static | vs longest Lightning | probes |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        probes = len(r.get("length_probes") or {})
        rows.append(f"| {r['name']} | {_max_len(r)} | {ratio(r, static)} | {ratio(r, builtin)} | {probes} |")
    return "\n".join(rows)


def bucket_table(runs: list[dict[str, Any]], trace: Trace) -> str:
    """Tokens/s per length bucket (the paper's buckets, scaled) for every run."""
    labels = trace.labels
    used = sorted({trace.bucket(n) for n in trace.lengths})
    head = "| Run (tokens/s per length bucket) | " + " | ".join(labels[b] for b in used) + " |"
    rows = [head, "|" + "---|" * (len(used) + 1)]
    for r in runs:
        if "error" in r:
            continue
        cells = [_fmt(r["tokens_per_s_by_bucket"].get(labels[b])) for b in used]
        rows.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


__all__ = [
    "aggregate",
    "best",
    "bucket_table",
    "length_table",
    "markdown",
    "markdown_trace",
    "model_flops",
    "summarise",
]
