"""``cli.py profile`` and ``cli.py plan`` end to end (through ``profile_main`` / ``plan_main``).

* ``profile --quick`` on 2 gloo processes with the tiny Llama writes a JSON profile that the planner
  loads, and prints the predicted-against-measured table with a MAPE per mode; the held-out lengths
  include one at least 4x the longest profiled. Accuracy depends on the machine's load, so it is not
  asserted; the structure is, and so is the exactness of the saved-bytes formulas (deterministic).
* ``plan`` with each shipped cluster file and Llama-7B prints a plan per layer and op, its predicted
  time and memory, and the largest trainable length per mode and adaptive; ``--json`` carries the same
  (per length the plan as ``Plan.to_list()``), and the adaptive length is at least every mode's.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from lightning_paradyse.calibration.calibrate import fit_step_scale
from lightning_paradyse.calibration.profile import ONE_RANK_MODES, Profile, load_profile, mape_per_mode
from lightning_paradyse.cost.dims import dims_from_config
from lightning_paradyse.cost.memory import segment_memory
from lightning_paradyse.models import CONFIGS
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import parse_plan
from lightning_paradyse.planning.planner import make_planner
from lightning_paradyse.tools.cost_cli import parse_lengths, plan_main, profile_main

CLUSTERS = sorted((Path(__file__).resolve().parents[2] / "configs" / "clusters").glob("*.yaml"))


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = profile_main(
            ["--config", "llama-tiny", "--quick", "--world-size", "2", "--out", str(out), "--no-progress"]
        )
    assert code == 0
    return out, buffer.getvalue()


@pytest.mark.dist
def test_profile_writes_a_loadable_profile_and_the_accuracy_table(quick_profile: tuple[Path, str]) -> None:
    path, stdout = quick_profile
    print(stdout)  # the measured table, for the log
    profile = load_profile(path)
    assert profile.p == 2 and profile.dims == dims_from_config(CONFIGS["llama-tiny"], 4)
    lengths, heldout = profile.settings["lengths"], sorted({r["seq_len"] for r in profile.validation})
    assert max(heldout) >= 4 * max(lengths) and not set(heldout) & set(lengths)
    assert {(r["mode"], r["rc"]) for r in profile.validation} == {(m, rc) for m in MODES for rc in (False, True)}
    for row in profile.validation:
        assert row["time_s"] > 0 and row["pred_time_s"] > 0 and row["peak"] > 0 and row["pred_peak"] > 0
    mape = mape_per_mode(profile.validation)
    assert set(mape) == set(MODES) and all(set(v) == {"time", "memory"} for v in mape.values())
    assert "MAPE per mode" in stdout and "peak meas" in stdout and "time pred" in stdout
    for mode in MODES:
        assert any(
            line.strip().startswith(mode) and "time" in line and "memory" in line for line in stdout.splitlines()
        )
    keys = {f"{m}/{o}{r}" for m in MODES for o in ("attention", "mlp") for r in ("", "/rc")}
    assert set(profile.calibration) == keys | {"head", "step"}
    one = {f"{m}/{o}{r}" for m in ONE_RANK_MODES for o in ("attention", "mlp") for r in ("", "/rc")}
    assert set(profile.calibration_one) == one | {"head", "step"}  # a group of one's own constants
    assert load_profile(path) == profile and Profile.from_json(profile.to_json()) == profile  # round trip


@pytest.mark.dist
def test_saved_bytes_formulas_are_exact_on_the_profiled_segments(quick_profile: tuple[Path, str]) -> None:
    profile = load_profile(quick_profile[0])
    dims = profile.dims
    ratios = []
    for row in profile.measurements["segments"]:
        if row["mode"] == "head":
            continue
        want = segment_memory(row["mode"], row["op"], row["rc"], row["seq_len"], 1, profile.p, dims).saved.total
        ratios.append(row["saved"] / want)
    assert len(ratios) == 16 * len(profile.settings["lengths"])
    assert statistics.median(abs(r - 1) for r in ratios) < 0.01  # gloo may keep a buffer late: only ever more


@pytest.mark.dist
def test_a_group_of_one_is_measured_on_the_whole_weights(quick_profile: tuple[Path, str]) -> None:
    """The segments of a group of one (every rank alone, the weights gathered from the shards) keep what the
    formulas of one rank say, its whole steps fit its whole-step factor; the profile's cost model carries the
    constants."""
    profile = load_profile(quick_profile[0])
    rows = [r for r in profile.measurements["segments_one"] if r["mode"] != "head"]
    assert len(rows) == 2 * 4 * len(profile.settings["lengths"])
    ratios = [
        r["saved"] / segment_memory(r["mode"], r["op"], r["rc"], r["seq_len"], 1, 1, profile.dims).saved.total
        for r in rows
    ]
    assert statistics.median(abs(r - 1) for r in ratios) < 0.01
    assert profile.cost_model().one_rank == profile.calibration_one
    steps = profile.measurements["steps_one"]  # whole steps on one rank fit its whole-step factor
    step_lengths = profile.settings["step_lengths"] or profile.settings["lengths"]
    assert {(r["mode"], r["rc"], r["seq_len"]) for r in steps} == {
        (m, rc, s) for m in ONE_RANK_MODES for rc in (False, True) for s in step_lengths
    }
    assert profile.calibration_one["step"].time_scale == fit_step_scale(steps)


@pytest.mark.dist
def test_the_planner_loads_the_profile(quick_profile: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    path = quick_profile[0]
    planner = make_planner(CONFIGS["llama-tiny"], 2, 2**30, path)
    assert len(planner.plan(700, 1)) == CONFIGS["llama-tiny"].n_layers
    assert (
        plan_main(
            ["--config", "llama-tiny", "--profile", str(path), "--budget", "64MiB", "--lengths", "512,4k", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [e["seq_len"] for e in out["lengths"]] == [512, 4096] and out["p"] == 2
    assert plan_main(["--config", "llama-tiny", "--profile", str(path), "--lengths", "512"]) == 2  # no budget


def _check_json(out: dict[str, Any], n_layers: int, lengths: list[int]) -> None:
    assert [e["seq_len"] for e in out["lengths"]] == lengths
    for entry in out["lengths"]:
        if not entry["feasible"]:
            assert "tokens" in entry["error"] and entry["min_peak_bytes"] > out["budget_bytes"]
            continue
        plan = parse_plan(entry["plan"], n_layers)
        assert plan.to_list() == entry["plan"] and entry["time_s"] > 0
        assert 0 < entry["peak_bytes"] <= out["budget_bytes"]
    longest = out["max_length"]
    assert set(longest) == {*MODES, "adaptive"} and longest["adaptive"] > 0
    assert all(longest["adaptive"] >= longest[m] for m in MODES)
    assert all(out["max_length_no_recompute"]["adaptive"] >= out["max_length_no_recompute"][m] for m in MODES)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=[p.stem for p in CLUSTERS])
def test_plan_cli_with_each_cluster(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = [4096, 32768, 131072, 1048576]
    args = ["--config", "llama-7b", "--cluster", str(cluster), "--lengths", "4k,32k,128k,1M"]
    assert plan_main(args) == 0
    text = capsys.readouterr().out
    assert "largest trainable length" in text and "adaptive" in text and "attention" in text and "mlp" in text
    assert "layers 0-" in text or "layer 0" in text
    for mode in MODES:
        assert any(line.strip().startswith(mode) for line in text.splitlines())
    assert "length 1048576: infeasible" in text  # a million tokens do not fit 8 GPUs with this model
    assert plan_main([*args, "--json"]) == 0
    _check_json(json.loads(capsys.readouterr().out), CONFIGS["llama-7b"].n_layers, lengths)


def test_lengths_parse_with_suffixes() -> None:
    assert parse_lengths("4096, 32k,1M") == (4096, 32768, 1048576)
    with pytest.raises(Exception, match="not a length"):
        parse_lengths("lots")


def test_plan_cli_groups(capsys: pytest.CaptureFixture[str]) -> None:
    """``--groups``: one step's sequences split over groups of power-of-two sizes, text and JSON."""
    cluster = str(CLUSTERS[0])
    args = ["--config", "llama-7b", "--cluster", cluster, "--lengths", "8k,8k,8k,8k", "--groups"]
    assert plan_main(args) == 0
    text = capsys.readouterr().out
    assert "one step of 4 sequences on 8 ranks" in text and "group of" in text
    assert plan_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and sum(g["size"] for g in out["groups"]) == 8
    assert sorted(s for g in out["groups"] for s in g["lengths"]) == [8192] * 4
    assert all(g["lengths"] for g in out["groups"])  # no idle group
    assert out["time_s"] == max(g["time_s"] for g in out["groups"]) < out["one_group_time_s"]
    huge = ["--config", "llama-7b", "--cluster", cluster, "--lengths", "1M", "--groups", "--json"]
    assert plan_main(huge) == 0
    assert json.loads(capsys.readouterr().out)["feasible"] is False
    assert plan_main(["--config", "llama-tiny", "--profile", "x.json", "--lengths", "1k", "--groups"]) == 2
    assert "--groups needs --cluster" in capsys.readouterr().err


def test_model_config_files_for_profile_and_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--config`` takes a YAML/JSON file describing a model that is not among the named configs."""
    from lightning_paradyse.calibration.profile import ProfileSettings
    from lightning_paradyse.models import LlamaConfig, resolve_config

    yaml_file = tmp_path / "llama-3b.yaml"
    yaml_file.write_text(
        "family: llama\nvocab_size: 32000\nn_layers: 26\nhidden: 3200\nn_heads: 32\nn_kv_heads: 32\n"
        "ffn: 8640\nmax_seq_len: 1048576\n"
    )
    config = resolve_config(str(yaml_file))
    assert isinstance(config, LlamaConfig) and config.n_layers == 26 and config.hidden == 3200
    args = ["--config", str(yaml_file), "--cluster", str(CLUSTERS[0]), "--lengths", "8k", "--json"]
    assert plan_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lengths"][0]["feasible"] and len(out["lengths"][0]["plan"]) == 26
    assert ProfileSettings(model=str(yaml_file)).model == str(yaml_file)  # profiled by the same path on every rank

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"family": "llama", "hidden": 64, "layers": 2}))
    assert plan_main(["--config", str(bad), "--cluster", str(CLUSTERS[0]), "--lengths", "1k"]) == 2
    assert "unknown field(s) ['layers']" in capsys.readouterr().err
    assert plan_main(["--config", "llama-9000", "--cluster", str(CLUSTERS[0]), "--lengths", "1k"]) == 2
    err = capsys.readouterr().err
    assert "unknown model config 'llama-9000'" in err and "'family: llama'" in err
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping with 'family: llama'"):
        resolve_config(str(tmp_path / "list.yaml"))
