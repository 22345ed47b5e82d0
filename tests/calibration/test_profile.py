"""A saved profile's memory factors belong to the memory formulas of the version that reads it."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_paradyse.calibration.profile import load_profile, refit_memory

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-2proc-llama-tiny.json"


def test_memory_factors_are_fitted_again_when_a_profile_is_read(tmp_path: Path) -> None:
    """Stale factors in the file (as a version with other formulas wrote them) are replaced by the factors of the
    stored segment measurements on this version's formulas; the time constants and the measurements are kept, and
    the validation's predicted peaks follow the new factors."""
    data = json.loads(SHIPPED.read_text())
    shipped = load_profile(SHIPPED)
    for constants in data["calibration"].values():
        constants.update(saved=3.0, fwd=0.5, bwd=2.0)  # stale
    for row in data["validation"]:
        row["pred_peak"] = 1.0
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(data))
    read = load_profile(stale)
    for key, constants in read.calibration.items():
        if key == "step":  # no segment of its own: left as it was
            continue
        assert (constants.saved, constants.fwd, constants.bwd) == (
            shipped.calibration[key].saved,
            shipped.calibration[key].fwd,
            shipped.calibration[key].bwd,
        ), key
        assert constants.time_fixed == data["calibration"][key]["time_fixed"], key
    assert [r["pred_peak"] for r in read.validation] == [r["pred_peak"] for r in shipped.validation]
    assert all(r["pred_peak"] > 1.0 for r in read.validation)
    assert refit_memory(read) == read  # fitting again changes nothing
