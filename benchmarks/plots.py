"""PNG plots of a benchmark report (matplotlib, the optional ``bench`` extra: ``pip install -e ".[bench]"``).

* ``cumulative-<trace>.png``: cumulative training time against the global batch's longest row for every run
  (the trace sorted shortest first as in the paper's figures; against the step for a shuffled trace); a curve
  is faded from its first OOM step on, marked ``x``.
* ``plan-<trace>.png``: the adaptive run's plan as a heat map, one row per (layer, op), one column per
  batch (on groups: rank 0's group's plan; the split under the batch's length), the colour the mode (lighter:
  with recomputation).

Without matplotlib, :func:`write_plots` prints a note and returns no paths: plots are never required.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

MODE_COLOURS = {"tp_sp": "#1f77b4", "ulysses": "#2ca02c", "ring": "#d62728", "metp": "#9467bd"}
SKIPPED = "skipped (no plan fits)"
BUILTIN_COLOURS = {
    "lightning-ddp": "#ff7f0e",
    "lightning-ddp+ac": "#ffbb78",
    "lightning-fsdp2": "#8c564b",
    "lightning-fsdp2+ac": "#c49c94",
    "lightning-tp": "#17becf",
}


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (the ``bench`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _style(run: dict[str, Any]) -> dict[str, Any]:
    name = run["name"]
    if run["family"] == "paradyse":
        return {"color": "black", "linewidth": 2.6, "linestyle": "-", "zorder": 5}
    if run["family"] == "lightning":
        return {"color": BUILTIN_COLOURS.get(name, "grey"), "linewidth": 1.6, "linestyle": ":"}
    mode = name.removeprefix(f"{run['family']}-").removesuffix("+rc")
    if run["family"] == "groups":
        return {"color": MODE_COLOURS.get(mode, "grey"), "linewidth": 2.2, "linestyle": "-.", "zorder": 4}
    dashed = name.endswith("+rc")
    return {"color": MODE_COLOURS.get(mode, "grey"), "linewidth": 1.4, "linestyle": "--" if dashed else "-"}


def cumulative_plot(runs: list[dict[str, Any]], trace: str, budget_mib: float, path: Path) -> None:
    """Cumulative time against the batch's longest row (or the step), one curve per run; from its first step over
    the budget (``x``) on, the curve is faded (every step of a token-budget batch is about as large, so a run over
    the budget is usually over it from the start)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(9, 5.5))
    lengths = next((run["step_lengths"] for run in runs if "error" not in run), [])
    by_length = all(a <= b for a, b in itertools.pairwise(lengths))  # sorted trace: x is the length, else the step
    for run in runs:
        if "error" in run:
            continue
        first = run["first_oom_step"]
        stop = first if first is not None else len(run["step_time_s"])
        xs = run["step_lengths"] if by_length else list(range(1, len(run["step_time_s"]) + 1))
        y = list(itertools.accumulate(run["step_time_s"]))
        style = _style(run)
        ax.plot(xs[: stop + 1], y[: stop + 1], label=run["name"], **style)
        if first is not None:  # over the budget from this step on (the step's point and after)
            ax.plot(xs[stop:], y[stop:], alpha=0.3, **style)
            ax.plot(xs[stop], y[stop], marker="x", markersize=9, color=style["color"])
    if by_length and lengths and max(lengths) >= 10 * min(lengths):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(
        "longest row of the global batch (tokens; trace sorted shortest first)"
        if by_length
        else "global batch (shuffled trace)"
    )
    ax.set_ylabel("cumulative training time (s)")
    ax.set_title(f"trace {trace}: cumulative time; x = first step over the {budget_mib:.0f} MiB budget, faded after")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_heatmap(run: dict[str, Any], trace: str, path: Path) -> None:
    """The adaptive run's plan per batch: rows (layer, op), columns batches, colour the mode."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, to_rgb
    from matplotlib.patches import Patch

    n_layers = len(next(plan for plan in run["plans"] if plan is not None))
    plans = [plan or [[SKIPPED, SKIPPED]] * n_layers for plan in run["plans"]]  # None: skipped, no plan fits
    names = sorted({op for plan in plans for layer in plan for op in layer}, key=_mode_order)
    index = {name: i for i, name in enumerate(names)}
    grid = [[index[plan[layer][op]] for plan in plans] for layer in range(n_layers) for op in (0, 1)]
    colours = [_mode_colour(name, to_rgb) for name in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * len(plans) + 2), 1.0 + 0.45 * len(grid)))
    ax.imshow(
        grid, aspect="auto", cmap=ListedColormap(colours), vmin=-0.5, vmax=len(names) - 0.5, interpolation="nearest"
    )
    ax.set_yticks(range(len(grid)), [f"layer {i // 2} {'attn' if i % 2 == 0 else 'mlp'}" for i in range(len(grid))])
    ticks = sorted(set(range(0, len(plans), max(1, len(plans) // 10))) | {len(plans) - 1})
    splits = run.get("step_splits") or [None] * len(plans)
    labels = [str(run["step_lengths"][t]) + (f"\n{'+'.join(map(str, splits[t]))}" if splits[t] else "") for t in ticks]
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_xlabel("global batch (labelled with its longest row and its group split)")
    ax.set_title(f"trace {trace}: adaptive plan per batch")
    ax.legend(
        handles=[Patch(color=c, label=n) for n, c in zip(names, colours)],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mode_order(name: str) -> tuple[int, bool]:
    mode = name.removesuffix("+rc")
    order = list(MODE_COLOURS)
    return (order.index(mode) if mode in order else len(order), name.endswith("+rc"))


def _mode_colour(name: str, to_rgb: Any) -> tuple[float, float, float]:
    if name == SKIPPED:
        return (0.85, 0.85, 0.85)
    r, g, b = to_rgb(MODE_COLOURS.get(name.removesuffix("+rc"), "grey"))
    if name.endswith("+rc"):  # lighter: recomputed
        return (r + (1 - r) * 0.55, g + (1 - g) * 0.55, b + (1 - b) * 0.55)
    return (r, g, b)


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every plot of ``report`` under ``out_dir``; a note and no plots when matplotlib is missing."""
    if not matplotlib_available():
        print('note: matplotlib is not installed, so no plots were made (pip install -e ".[bench]")')
        return []
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    budget_mib = report["settings"]["budget"] / 2**20
    for trace in report["traces"]:
        runs = [r for r in report["runs"] if r["trace"] == trace]
        path = out_dir / f"cumulative-{trace}.png"
        cumulative_plot(runs, trace, budget_mib, path)
        paths.append(path)
        adaptive = next((r for r in runs if r["family"] == "paradyse" and any(r.get("plans") or [])), None)
        if adaptive is not None:
            path = out_dir / f"plan-{trace}.png"
            plan_heatmap(adaptive, trace, path)
            paths.append(path)
    return paths


__all__ = ["cumulative_plot", "matplotlib_available", "plan_heatmap", "write_plots"]
