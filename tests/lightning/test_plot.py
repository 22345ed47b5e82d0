"""The picture of a fit (plan per layer and step, group split, predicted against measured time) is valid SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from lightning_paradyse.lightning.plot import StepPoint, steps_svg
from lightning_paradyse.modes.plan import uniform_plan


def test_steps_svg_draws_every_step_layer_and_group() -> None:
    points = [
        StepPoint(0, uniform_plan("tp_sp", 2), (), 0.10, 0.12),
        StepPoint(1, uniform_plan("ring", 2, True), (2, 1, 1), 0.20, None),
        StepPoint(2, None, (1, 1, 1, 1), None, 0.05),
    ]
    root = ET.fromstring(steps_svg(points, 4))
    titles = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert sum("layer" in t for t in titles) == 2 * 2 * 2  # two ops, two planned steps, two layers
    assert sum("groups" in t for t in titles) == 1 + 3 + 4  # one group of 4, then 2+1+1, then 1+1+1+1
    assert any("ring + recompute" in t for t in titles)
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 2  # predicted and measured
    assert ET.fromstring(steps_svg([], 2)) is not None
