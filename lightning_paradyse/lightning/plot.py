"""The picture of a fit: the plan per layer and step, the group split per step, predicted against measured time.

:func:`steps_svg` draws the training steps a :class:`~lightning_paradyse.lightning.callbacks.ParaDySeSwitcher`
recorded as one SVG file (no plotting library needed: the file is written by hand and opens in any browser):

* two heat maps, attention and MLP: one column per step, one row per layer, coloured by mode (recomputed ops
  lighter);
* the group split of every step: a stacked bar of the group sizes (one group of ``P``: a single block);
* the predicted and the measured step time, two lines on one axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from lightning_paradyse.modes.plan import Plan

MODE_COLOURS = {"tp_sp": "#4c72b0", "ulysses": "#55a868", "ring": "#c44e52", "metp": "#8172b2", "dsp": "#ccb974"}
"""Fill colour of each mode (recomputed ops are drawn at 55% opacity)."""
SIZE_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c"]
"""Fill colour of a group of ``2^k`` ranks: entry ``k``."""


@dataclass(frozen=True)
class StepPoint:
    """One training step as the picture shows it."""

    step: int
    plan: Plan | None
    """Rank 0's plan (``None``: the step was skipped)."""
    split: tuple[int, ...]
    """Group sizes, largest first (``()``: one group of every rank)."""
    predicted_s: float | None
    measured_s: float | None


def _heat(points: Sequence[StepPoint], op: str, x0: float, y0: float, width: float, height: float) -> list[str]:
    layers = max((len(p.plan) for p in points if p.plan is not None), default=0)
    if not layers:
        return []
    cw, ch = width / len(points), height / layers
    out = [f'<text x="{x0}" y="{y0 - 6}" font-size="13">{op} mode per layer (rows) and step (columns)</text>']
    for i, point in enumerate(points):
        if point.plan is None:
            continue
        for layer, lp in enumerate(point.plan.layers):
            chosen = lp.op(op)
            colour = MODE_COLOURS.get(chosen.mode, "#999999")
            opacity = 0.55 if chosen.recompute else 1.0
            out.append(
                f'<rect x="{x0 + i * cw:.2f}" y="{y0 + layer * ch:.2f}" width="{cw:.2f}" height="{ch:.2f}" '
                f'fill="{colour}" fill-opacity="{opacity}"><title>step {point.step}, layer {layer}: {chosen.mode}'
                f"{' + recompute' if chosen.recompute else ''}</title></rect>"
            )
    out.append(f'<rect x="{x0}" y="{y0}" width="{width}" height="{height}" fill="none" stroke="#333"/>')
    return out


def _splits(points: Sequence[StepPoint], world: int, x0: float, y0: float, width: float, height: float) -> list[str]:
    cw = width / len(points)
    out = [f'<text x="{x0}" y="{y0 - 6}" font-size="13">group split per step (bar height: {world} ranks)</text>']
    for i, point in enumerate(points):
        sizes = point.split or (world,)
        top = y0
        for g in sizes:
            h = height * g / max(world, 1)
            colour = SIZE_COLOURS[min(g.bit_length() - 1, len(SIZE_COLOURS) - 1)]
            out.append(
                f'<rect x="{x0 + i * cw:.2f}" y="{top:.2f}" width="{max(cw - 1, 0.5):.2f}" height="{h:.2f}" '
                f'fill="{colour}" stroke="white" stroke-width="0.5"><title>step {point.step}: groups '
                f"{'+'.join(map(str, sizes))}</title></rect>"
            )
            top += h
    out.append(f'<rect x="{x0}" y="{y0}" width="{width}" height="{height}" fill="none" stroke="#333"/>')
    return out


def _times(points: Sequence[StepPoint], x0: float, y0: float, width: float, height: float) -> list[str]:
    values = [v for p in points for v in (p.predicted_s, p.measured_s) if v is not None]
    out = [f'<text x="{x0}" y="{y0 - 6}" font-size="13">step time (s): predicted (dashed) and measured</text>']
    out.append(f'<rect x="{x0}" y="{y0}" width="{width}" height="{height}" fill="none" stroke="#333"/>')
    if not values:
        return out
    top = max(values) * 1.1
    cw = width / len(points)
    for attr, dash in (("predicted_s", ' stroke-dasharray="5,3"'), ("measured_s", "")):
        pts = [
            f"{x0 + (i + 0.5) * cw:.2f},{y0 + height - height * getattr(p, attr) / top:.2f}"
            for i, p in enumerate(points)
            if getattr(p, attr) is not None
        ]
        if pts:
            out.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="#222" stroke-width="1.5"{dash}/>')
    for frac in (0.0, 0.5, 1.0):
        y = y0 + height - height * frac
        out.append(f'<text x="{x0 - 4}" y="{y + 4:.2f}" font-size="10" text-anchor="end">{top * frac:.3g}</text>')
    return out


def _legend(x0: float, y0: float, world: int) -> list[str]:
    out = []
    x = x0
    for mode, colour in MODE_COLOURS.items():
        out.append(f'<rect x="{x}" y="{y0}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="{y0 + 10}" font-size="11">{mode}</text>')
        x += 80
    out.append(f'<text x="{x}" y="{y0 + 10}" font-size="11">(lighter: recomputed)</text>')
    x, g = x0, 1
    while g <= world:
        colour = SIZE_COLOURS[min(g.bit_length() - 1, len(SIZE_COLOURS) - 1)]
        out.append(f'<rect x="{x}" y="{y0 + 18}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="{y0 + 28}" font-size="11">group of {g}</text>')
        x, g = x + 100, g * 2
    return out


def steps_svg(points: Sequence[StepPoint], world: int, title: str = "ParaDySe: what every training step ran") -> str:
    """The SVG document of the module docstring for the training steps ``points`` on ``world`` ranks."""
    width, left, panel = 900, 60, 110
    body: list[str] = []
    if points:
        y = 60.0
        for op in ("attention", "mlp"):
            body += _heat(points, op, left, y, width - left - 20, panel)
            y += panel + 40
        body += _splits(points, world, left, y, width - left - 20, 80)
        y += 80 + 40
        body += _times(points, left, y, width - left - 20, panel)
        y += panel + 20
        body += _legend(left, y, world)
        height = y + 40
    else:
        body.append('<text x="60" y="60" font-size="13">no training step was recorded</text>')
        height = 100
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
        f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>'
        f'<text x="{left}" y="28" font-size="16">{escape(title)}</text>'
    )
    return "\n".join([head, *body, "</svg>"]) + "\n"


__all__ = ["MODE_COLOURS", "StepPoint", "steps_svg"]
