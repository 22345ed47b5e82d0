"""From the workers' raw records to the numbers per run, the JSON file and the Markdown tables.

Every run trains the same global batches (one per optimizer step, :mod:`benchmarks.workload`), so step ``i`` of
every run is the same batch. Per (run, trace):

* **step time**: per step, its slowest rank's time, the median over the timed passes (the instrumented pass's
  times when there is no timed pass);
* **tokens/s**: the real tokens of every global batch (padding not counted) over the sum of the step times (the
  whole job); ``tokens_per_s_trainable`` leaves the OOM steps out; per length bucket the same ratio over the
  steps whose batch's longest row falls in the bucket;
* **peak memory**: the largest absolute peak of any step on any rank (instrumented pass);
* **OOM steps**: steps whose peak on some rank exceeds the budget (or that CUDA could not run, or that the
  adaptive run skipped because no plan fits);
* **bytes sent per step**: mean over steps and ranks, every ``torch.distributed`` collective counted
  (``comm_bytes_per_step``; ``collectives_per_step`` counts the calls) and, for ParaDySe runs, the
  package's ``CommCounter`` (``paradyse_comm_bytes_per_step``);
* **model FLOP/s per rank**: ``6 N s + 6 L h s^2`` FLOPs per real row of length ``s`` (``N`` matrix parameters,
  causal attention; padding and recomputation not counted) over ``p`` times the wall time, and its fraction of
  the measured float32 matmul rate of one process (``mfu``);
* **decision time** (ParaDySe runs, ``planner_ms_per_batch``): per step, on groups the whole decision
  (``groups/solve_s``: split, assignment of the rows, every group's plan), else the planner's call; mean over the
  timed passes' steps;
* **group splits** (ParaDySe runs): how many steps ran on 1, 2, ... groups (``group_counts``) and with which
  sizes (``group_splits``, e.g. ``{"2": 3, "1+1": 5}``; one group of every rank when the strategy did not split),
  from the first timed pass, and the measured imbalance of the steps on several groups (slowest group over the
  mean);
* **largest trainable length**: the length search's result (``max_len_capped`` when it reached the cap);
* ``fit_s_by_pass``: the wall seconds of every pass's ``trainer.fit`` (the instrumented pass first; setup, the
  warm-up steps and the end of the fit included), what the benchmark's own duration is made of.

Ratios: against the *best static mode*, the *best groups run* and the *best Lightning built-in*: the fastest
(tokens/s) of those that trained the whole trace without an OOM step (the fastest of all of them if none did).

**Regret** of the adaptive run against a per-step oracle (:func:`oracle`): for every step, the fastest time
among the candidate runs of the same invocation (the ``groups-<mode>`` and static runs) that kept that step
within the budget (all candidates when none did); regret = sum of the adaptive run's step times over the sum of
those minima, minus 1 (0: it matched the best candidate at every step; it can be negative).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from benchmarks.runs import run_spec
from benchmarks.settings import BenchSettings, ModelSettings
from benchmarks.workload import Trace

MiB = 2**20
CANDIDATE_FAMILIES = ("groups", "static")
"""The families whose runs are the adaptive run's candidates in the per-step oracle."""


def model_flops(model: ModelSettings, length: int) -> float:
    """Training FLOPs of one causal sequence of ``length`` tokens (forward + backward, no recomputation)."""
    m = model.config()
    matrix_params = m.num_params() - m.vocab_size * m.hidden - (2 * m.n_layers + 1) * m.hidden  # no embedding, norms
    return 6.0 * matrix_params * length + 6.0 * m.n_layers * m.hidden * length * length


def _timed(fits: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed passes' fits (the instrumented pass when there is none)."""
    return [f for f in fits if f["pass"] > 0] or list(fits)


def _pass_times(fits: Sequence[dict[str, Any]]) -> list[list[float]]:
    """Every timed pass's step times, each step its slowest rank's."""
    return [[max(r[i]["seconds"] for r in f["steps"]) for i in range(len(f["steps"][0]))] for f in _timed(fits)]


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


def _step_table(instrumented: dict[str, Any], trace: Trace, budget: int) -> dict[str, list[Any]]:
    """Per step (global batch): its rows' real lengths, longest row, real tokens, peak, OOM, bytes, plan."""
    ranks = instrumented["steps"]
    n = len(ranks[0])
    if n != len(trace.batches):
        raise ValueError(f"{n} steps recorded for the {len(trace.batches)} global batches of trace {trace.name!r}")
    rows = [trace.batch_lengths(i) for i in range(n)]
    peaks = [max(r[i]["peak"] for r in ranks) for i in range(n)]
    oom = [peaks[i] > budget or any(r[i]["cuda_oom"] or r[i].get("skipped") for r in ranks) for i in range(n)]
    return {
        "rows": rows,
        "lengths": [max(s) for s in rows],
        "tokens": [sum(s) for s in rows],
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


def _timed_predictions(fits: Sequence[dict[str, Any]], n_steps: int, key: str = "pred_time_s") -> list[float | None]:
    """Every step's predicted seconds as the timed passes made them (the median over them; ``None`` where one has
    none), read under ``key``: ``pred_time_s`` as the strategy logged it, ``pred_unscaled_s`` with its priced part
    unscaled (:mod:`~lightning_paradyse.lightning.fixed_cost`). A step on groups adds the fixed part the strategy
    measured on the fit's earlier steps: in the
    instrumented pass those ran under its Python dispatch modes (several times slower for small ops), so only the
    timed passes' predictions are compared with the timed passes' steps."""
    out: list[float | None] = []
    for i in range(n_steps):
        got = [f["steps"][0][i].get(key) for f in _timed(fits)]
        known = [float(t) for t in got if t is not None]
        out.append(statistics.median(known) if known and len(known) == len(got) else None)
    return out


def _prediction_fields(
    table: dict[str, Any], times: list[float], timed: list[float | None], unscaled: list[float | None]
) -> dict[str, Any]:
    """The cost model's accuracy on this run's steps (adaptive run with a profile), and the plans: the predicted
    times of the timed passes (:func:`_timed_predictions`; the instrumented pass's where they have none), the
    predicted peaks of the instrumented pass (which measures the peaks)."""
    if not any(plan is not None for plan in table["plans"]):
        return {"plans": None}
    pred = [(t if t is not None else t0, m) for t, (t0, m) in zip(timed, table["predicted"])]
    return {
        "plans": table["plans"],
        "skipped_steps": sum(table["skipped"]),
        "predicted_step_time_s": [t for t, _ in pred],
        "predicted_peak_bytes": [m for _, m in pred],
        "cost_model_time_mape": _mape([(t, times[i]) for i, (t, _) in enumerate(pred)]),
        # the same with the priced part as the cost model alone predicts it (the strategy's records scale it by the
        # measured ratio of the fit's earlier steps of the same split): steps on one group of every rank as above
        "cost_model_time_mape_unscaled": _mape(
            [(u if u is not None else t, times[i]) for i, ((t, _), u) in enumerate(zip(pred, unscaled))]
        ),
        "cost_model_peak_mape": _mape([(m, table["peaks"][i]) for i, (_, m) in enumerate(pred) if m is not None]),
    }


def _split_name(split: Sequence[int] | None) -> str:
    return "skipped" if not split else "+".join(map(str, split))


def _group_fields(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """ParaDySe runs: the decision time per step, the group split of every step and the counts of splits."""
    timed = _timed(fits)
    decide = [s["decide_s"] for f in timed for s in f["steps"][0] if s.get("decide_s") is not None]
    first = timed[0]["steps"][0]
    splits = [s.get("split") for s in first]
    differ = sum(
        1 for i, s in enumerate(splits) if any(f["steps"][0][i].get("split") != s for f in timed[1:])
    )  # a rerun of a step decided another split
    imbalances = [s["imbalance"] for s in first if s.get("imbalance") is not None and len(s.get("split") or ()) > 1]
    return {
        "planner_ms_per_batch": 1e3 * statistics.fmean(decide) if decide else None,
        "decision_ms_by_step": [1e3 * s["decide_s"] if s.get("decide_s") is not None else None for s in first],
        "step_splits": splits,
        "group_splits": dict(Counter(_split_name(s) for s in splits)),
        "group_counts": dict(sorted(Counter(str(len(s)) for s in splits if s).items())),
        "splits_differing_between_passes": differ,
        "measured_imbalance": statistics.fmean(imbalances) if imbalances else None,
    }


def summarise(name: str, trace: Trace, fits: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one (run, trace) from its fits (pass 0 instrumented, the others timed)."""
    spec = run_spec(name)
    base = {"name": name, "family": spec.family, "trace": trace.name}
    errors = [f["error"] for f in fits if "error" in f]
    if errors:
        return {**base, "error": errors[0], **ctx["search"].get(name, {})}
    table = _step_table(next(f for f in fits if f["pass"] == 0), trace, ctx["budget"])
    per_pass = _pass_times(fits)
    times = _median_times(per_pass, len(table["lengths"]))
    total_s, tokens = sum(times), sum(table["tokens"])
    ok = [i for i, bad in enumerate(table["oom"]) if not bad]
    flops = sum(model_flops(ctx["model"], length) for rows in table["rows"] for length in rows)
    flops_per_rank = flops / (ctx["world"] * total_s)
    first_oom = next((i for i, bad in enumerate(table["oom"]) if bad), None)
    return {
        **base,
        "tokens": tokens,
        "seconds": total_s,
        "tokens_per_s": tokens / total_s,
        "tokens_per_s_trainable": sum(table["tokens"][i] for i in ok) / max(sum(times[i] for i in ok), 1e-12),
        "tokens_per_s_by_bucket": _buckets(trace, table["lengths"], table["tokens"], times),
        "step_rows": [len(r) for r in table["rows"]],
        "step_lengths": table["lengths"],
        "step_tokens": table["tokens"],
        "step_time_s": times,
        "step_time_s_by_pass": per_pass,
        "step_oom": table["oom"],
        "tokens_per_s_by_pass": [tokens / sum(p) for p in per_pass],
        "fit_s_by_pass": [f.get("fit_s") for f in sorted(fits, key=lambda f: f["pass"])],
        "step_time_median_s": statistics.median(times),
        "oom_steps": len(table["oom"]) - len(ok),
        "first_oom_step": first_oom,
        "seconds_before_first_oom": sum(times[:first_oom]) if first_oom is not None else total_s,
        "completed": first_oom is None,
        "peak_memory_bytes": max(table["peaks"]),
        "peak_memory_by_rank": table["peak_by_rank"],
        "step_peak_bytes": table["peaks"],
        "planner_ms_per_batch": None,
        "comm_bytes_per_step": statistics.fmean(table["comm"]),
        "collectives_per_step": statistics.fmean(table["calls"]),
        "paradyse_comm_bytes_per_step": statistics.fmean(table["comm_pkg"]) if spec.uses_paradyse else None,
        "model_flops_per_s_per_rank": flops_per_rank,
        "mfu": flops_per_rank / ctx["matmul"],
        **(_group_fields(fits) if spec.uses_paradyse else {}),
        **(
            _prediction_fields(
                table,
                times,
                _timed_predictions(fits, len(times)),
                _timed_predictions(fits, len(times), "pred_unscaled_s"),
            )
            if spec.family == "paradyse"
            else {}
        ),
        **ctx["search"].get(name, {}),
    }


def _search_fields(result: dict[str, Any]) -> dict[str, Any]:
    probes = {str(k): v for k, v in sorted(result["probes"].items())}
    return {"max_trainable_len": result["max_len"], "max_len_capped": result["capped"], "length_probes": probes}


def oracle(adaptive: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The adaptive run's regret against the per-step oracle over ``runs``' candidates (see the module docstring):
    ``oracle_regret``, the candidates, how many steps each was the fastest, and the oracle's step times."""
    steps = len(adaptive.get("step_time_s") or [])
    candidates = [
        r
        for r in runs
        if r["family"] in CANDIDATE_FAMILIES and "error" not in r and len(r["step_time_s"]) == steps and steps
    ]
    if not candidates or "error" in adaptive:
        return {"oracle_regret": None, "oracle_candidates": [r["name"] for r in candidates]}
    fastest: list[float] = []
    wins: Counter[str] = Counter()
    for i in range(steps):
        fitting = [r for r in candidates if not r["step_oom"][i]] or candidates
        best_run = min(fitting, key=lambda r: r["step_time_s"][i])
        fastest.append(best_run["step_time_s"][i])
        wins[best_run["name"]] += 1
    return {
        "oracle_regret": sum(adaptive["step_time_s"]) / sum(fastest) - 1,
        "oracle_candidates": [r["name"] for r in candidates],
        "oracle_wins": dict(wins),
        "oracle_step_time_s": fastest,
    }


def aggregate(raw: list[dict[str, Any]], settings: BenchSettings, traces: list[Trace]) -> list[dict[str, Any]]:
    """Every (run, trace) summary, runs in ``settings.runs`` order within each trace; the adaptive run's carries
    its regret against the per-step oracle (:func:`oracle`)."""
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
        runs = []
        for name in settings.runs:
            fits = [f for f in main["fits"] if f["run"] == name and f["trace"] == trace.name]
            runs.append(summarise(name, trace, fits, ctx))
        for run in runs:
            if run["family"] == "paradyse":
                run.update(oracle(run, runs))
        out += runs
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
    if ref is None or "error" in r or "error" in ref:
        return "—"
    return f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}×"


def _max_len(r: dict[str, Any]) -> str:
    if r.get("max_trainable_len") is None:
        return "—"
    return ("≥ " if r["max_len_capped"] else "") + f"{r['max_trainable_len']:,}"


HEADER = (
    "| Run | tokens/s | vs best static | vs best Lightning | OOM steps | peak MiB/rank | max length "
    "| median step ms | decision ms | MiB sent/step | MFU |"
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
        _fmt(r["planner_ms_per_batch"], 2),
        _fmt(r["comm_bytes_per_step"], 2, MiB),
        f"{100 * r['mfu']:.1f}%",
    ]
    return "| " + " | ".join(cells) + " |"


def _trace_head(trace: Trace, settings: dict[str, Any]) -> str:
    lengths = trace.lengths
    rows = [len(b) for b in trace.batches]
    return (
        f"### Trace `{trace.name}`: {len(lengths)} sequences, {min(lengths):,}–{max(lengths):,} tokens "
        f"({sum(lengths):,} in all) in {len(rows)} global batches of at most {settings['batch_tokens']:,} tokens "
        f"({min(rows)}–{max(rows)} rows), budget {_fmt(settings['budget'], 0, MiB)} MiB per rank"
    )


def markdown_trace(runs: list[dict[str, Any]], trace: Trace, settings: dict[str, Any]) -> str:
    """One trace's table: every run, with ratios against the best static mode and the best built-in."""
    static, builtin = best(runs, "static"), best(runs, "lightning")
    rows = [_row(r, static, builtin) for r in runs]
    notes = _notes(runs, static, builtin)
    return "\n".join([_trace_head(trace, settings), "", HEADER, "|" + "---|" * 11, *rows, *notes])


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
            peak = r["cost_model_peak_mape"]
            notes.append(
                f"{r['name']}: the cost model predicted its step times within {r['cost_model_time_mape']:.0f}% "
                + (
                    f"({r['cost_model_time_mape_unscaled']:.0f}% without the measured scale of its priced part) "
                    if r.get("cost_model_time_mape_unscaled") not in (None, r["cost_model_time_mape"])
                    else ""
                )
                + (f"and its peak memory within {peak:.0f}% " if peak is not None else "")
                + f"(mean absolute error); {r['skipped_steps']} batch(es) skipped because no plan fits (counted as "
                "OOM)."
            )
    return notes if len(notes) > 1 else []


def groups_table(runs: list[dict[str, Any]]) -> str:
    """The ParaDySe runs' steps per number of groups, their splits, imbalance, decision time and the adaptive
    run's regret against the per-step oracle."""
    mine = [r for r in runs if "error" not in r and r.get("group_counts") is not None]
    if not mine:
        return ""
    counts = sorted({int(k) for r in mine for k in r["group_counts"]})
    head = (
        "| Run (steps per number of groups) | "
        + " | ".join(f"{k} group{'s' if k > 1 else ''}" for k in counts)
        + " | splits (sizes: steps) | measured imbalance | decision ms/step | regret vs per-step oracle |"
    )
    rows = [head, "|" + "---|" * (len(counts) + 5)]
    for r in mine:
        cells = [str(r["group_counts"].get(str(k), 0)) for k in counts]
        splits = ", ".join(f"{k}: {v}" for k, v in r["group_splits"].items())
        regret = r.get("oracle_regret")
        rows.append(
            f"| {r['name']} | "
            + " | ".join(cells)
            + f" | {splits} | {_fmt(r['measured_imbalance'], 2)} | {_fmt(r['planner_ms_per_batch'], 2)} | "
            + (f"{100 * regret:+.1f}%" if regret is not None else "—")
            + " |"
        )
    for r in mine:
        if r.get("oracle_wins"):
            wins = ", ".join(f"{k} {v}" for k, v in sorted(r["oracle_wins"].items(), key=lambda kv: -kv[1]))
            rows += [
                "",
                f"{r['name']}: the per-step oracle takes, at every step, the fastest of "
                f"{', '.join(r['oracle_candidates'])} that kept the step within the budget (fastest per step: {wins}).",
            ]
        if r.get("splits_differing_between_passes"):
            rows.append(
                f"{r['name']}: {r['splits_differing_between_passes']} step(s) split differently between passes."
            )
    return "\n".join(rows)


def _label(r: dict[str, Any]) -> str:
    """A reference's name, marked when it went over the budget."""
    return r["name"] + ("" if r["completed"] else ", over the budget")


def _adaptive_ratios(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The adaptive run's tokens/s over the best static mode, DDP, the best built-in and the best groups run."""
    adaptive = next((r for r in runs if r["family"] == "paradyse" and "error" not in r), None)
    if adaptive is None:
        return None
    ddp = next((r for r in runs if r["name"] == "lightning-ddp" and "error" not in r), None)
    refs = {"best-static": best(runs, "static"), "DDP": ddp, "best-built-in": best(runs, "lightning")}
    refs["best-groups"] = best(runs, "groups")
    ratios = {k: (adaptive["tokens_per_s"] / r["tokens_per_s"], _label(r)) if r else None for k, r in refs.items()}
    return {"ratios": ratios, "regret": adaptive.get("oracle_regret")}


def ratio_lines(report: dict[str, Any]) -> list[str]:
    """One line per trace: ``<trace>: adaptive/best-static 1.23x (static-tp_sp), adaptive/DDP 0.80x, ...`` and
    the regret against the per-step oracle (``—`` where a reference did not run)."""
    lines = []
    for trace in report["traces"]:
        found = _adaptive_ratios([r for r in report["runs"] if r["trace"] == trace])
        if found is None:
            continue
        parts = []
        for key, value in found["ratios"].items():
            if value is None:
                parts.append(f"adaptive/{key} —")
            else:
                parts.append(f"adaptive/{key} {value[0]:.2f}x ({value[1]})")
        regret = found["regret"]
        parts.append("regret vs per-step oracle " + (f"{100 * regret:+.1f}%" if regret is not None else "—"))
        lines.append(f"{trace}: " + ", ".join(parts))
    return lines


def markdown(report: dict[str, Any], traces: list[Trace]) -> str:
    """Every trace's table, its groups table and its tokens/s per length bucket, then the largest trainable
    lengths and the adaptive run's ratios per trace."""
    parts = []
    settings = report["settings"]
    for trace in traces:
        runs = [r for r in report["runs"] if r["trace"] == trace.name]
        parts += [markdown_trace(runs, trace, settings), ""]
        table = groups_table(runs)
        parts += [table, ""] if table else []
        parts += [bucket_table(runs, trace), ""]
    if traces:
        first = [r for r in report["runs"] if r["trace"] == traces[0].name]
        parts += [length_table(first, settings["budget"]), ""]
    lines = ratio_lines(report)
    if lines:
        parts += ["### The adaptive run against the references, per trace", "", *(f"* {line}" for line in lines), ""]
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
        "one training step of one sequence per probe)",
        "",
        "| Run | largest length | vs longest static | vs longest Lightning | probes |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        probes = len(r.get("length_probes") or {})
        rows.append(f"| {r['name']} | {_max_len(r)} | {ratio(r, static)} | {ratio(r, builtin)} | {probes} |")
    return "\n".join(rows)


def bucket_table(runs: list[dict[str, Any]], trace: Trace) -> str:
    """Tokens/s per length bucket (the paper's buckets, scaled; a batch in its longest row's) for every run."""
    labels = trace.labels
    used = sorted({trace.bucket(max(trace.batch_lengths(i))) for i in range(len(trace.batches))})
    head = (
        "| Run (tokens/s per length bucket of the batch's longest row) | " + " | ".join(labels[b] for b in used) + " |"
    )
    rows = [head, "|" + "---|" * (len(used) + 1)]
    for r in runs:
        if "error" in r:
            continue
        cells = [_fmt(r["tokens_per_s_by_bucket"].get(labels[b])) for b in used]
        rows.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


__all__ = [
    "CANDIDATE_FAMILIES",
    "aggregate",
    "best",
    "bucket_table",
    "groups_table",
    "length_table",
    "markdown",
    "markdown_trace",
    "model_flops",
    "oracle",
    "ratio_lines",
    "summarise",
]
