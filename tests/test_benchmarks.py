"""The benchmark harness: ``python benchmarks/run.py --quick`` end to end, and its pure helpers.

The smoke run spawns two gloo processes that train the adaptive run, a grouped run, a static mode and DDP on
the same global batches of a tiny trace; the test checks the structure of what it writes (every run present,
numbers finite and positive, the adaptive and static runs through the whole trace, plots when matplotlib is
installed). It measures; it never asserts that one run is faster than another.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.instrument import collective_bytes
from benchmarks.plots import matplotlib_available
from benchmarks.report import best, model_flops
from benchmarks.run import QUICK_RESULTS, RESULTS, adaptive_profile, output_path, parse_args, settings_from
from benchmarks.runs import BenchLM, run_spec
from benchmarks.settings import QUICK_RUNS, BenchSettings, ModelSettings
from benchmarks.step_overhead import FUNCTIONS, PHASES, StepClock
from benchmarks.sync_readme import sync
from benchmarks.worker import rotated

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str, timeout: int) -> list[str]:
    """The output lines of ``python *args`` run from the repository root, which must exit with status 0."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    # one pass over half the trace, the length search capped at 512 tokens: a smoke
    args = ["--quick", "--repeats", "1", "--trace-len", "32", "--search-cap", "512", "--out", str(out)]
    run_script("benchmarks/run.py", *args, timeout=170)
    return json.loads(out.read_text()), out


@pytest.mark.dist
def test_quick_run_reports_every_run(quick: tuple[dict[str, Any], Path]) -> None:
    report, out = quick
    traces = report["traces"]
    names = [(r["name"], r["trace"]) for r in report["runs"]]
    assert sorted(names) == sorted((n, t) for n in QUICK_RUNS for t in traces)
    for run in report["runs"]:
        assert "error" not in run, f"{run['name']}: {run.get('error')}"
        for key in ("tokens_per_s", "peak_memory_bytes", "max_trainable_len", "comm_bytes_per_step", "mfu"):
            assert isinstance(run[key], (int, float)) and math.isfinite(run[key]) and run[key] > 0, (run["name"], key)
        assert isinstance(run["oom_steps"], int) and run["oom_steps"] >= 0
        assert all(t > 0 for t in run["step_time_s"])
        assert set(run["tokens_per_s_by_bucket"]) == set(traces[run["trace"]]["labels"])
    assert out.with_suffix(".md").read_text().count("| paradyse-auto") >= 1


@pytest.mark.dist
def test_quick_run_adaptive_and_static_complete_the_trace(quick: tuple[dict[str, Any], Path]) -> None:
    report, _ = quick
    for run in report["runs"]:
        trace = report["traces"][run["trace"]]
        assert len(run["step_time_s"]) == len(trace["batches"]), run["name"]  # every run: the same global batches
        if run["family"] != "lightning":
            assert run["completed"] and run["oom_steps"] == 0, run["name"]
            assert sum(run["step_tokens"]) == sum(trace["lengths"]), run["name"]
    adaptive = next(r for r in report["runs"] if r["family"] == "paradyse")
    assert len(adaptive["plans"]) == len(adaptive["step_time_s"])
    assert adaptive["planner_ms_per_batch"] is not None and adaptive["planner_ms_per_batch"] >= 0


def test_length_search_doubles_then_bisects_to_the_largest_length_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.worker as worker
    from benchmarks.settings import SearchSettings

    def run(largest: int, search: SearchSettings) -> tuple[dict[str, Any], list[int]]:
        probed: list[int] = []

        def probe(ctx: Any, spec: Any, length: int) -> dict[str, Any]:
            probed.append(length)
            return {"fits": length <= largest}

        monkeypatch.setattr(worker, "probe", probe)
        ctx = SimpleNamespace(settings=SimpleNamespace(search=search), world=2, tick=lambda: None)
        return worker.search_length(ctx, None), probed  # type: ignore[arg-type]

    quick = SearchSettings(start=256, cap=1024, resolution=0.25, min_step=128)  # the quick preset's
    found, probed = run(640, quick)  # DDP's under the quick preset's budget
    assert found["max_len"] == 640 and not found["capped"] and probed == [256, 512, 1024, 768, 640], probed
    found, probed = run(5000, quick)
    assert found == {"max_len": 1024, "capped": True, "probes": found["probes"]} and probed == [256, 512, 1024]
    found, probed = run(100, quick)  # even the first probe fails: halving
    assert found["max_len"] == 64 and probed[:3] == [256, 128, 64], probed
    found, probed = run(700, SearchSettings(start=256, cap=4096, resolution=0.05, min_step=16))
    assert found["max_len"] <= 700 < found["max_len"] + 32 and not found["capped"], (found["max_len"], probed)
    assert run(5000, SearchSettings(cap=0))[0] == {"max_len": None, "capped": False, "probes": {}}


def test_predicted_step_times_are_the_timed_passes() -> None:
    """The cost model's accuracy compares the timed passes' steps with the timed passes' predictions (their median;
    the instrumented pass's only where a timed pass has none)."""
    from benchmarks.report import _prediction_fields, _timed_predictions

    def fit(pass_index: int, preds: list[float | None]) -> dict[str, Any]:
        return {"pass": pass_index, "steps": [[{"pred_time_s": t} for t in preds]]}

    fits = [fit(0, [9.0, 9.0, 9.0]), fit(1, [1.0, 2.0, None]), fit(2, [3.0, 2.0, 5.0]), fit(3, [2.0, 2.0, 5.0])]
    timed = _timed_predictions(fits, 3)
    assert timed == [2.0, 2.0, None]
    table = {"plans": [["p"]] * 3, "skipped": [False] * 3, "predicted": [(9.0, 10)] * 3, "peaks": [10] * 3}
    fields = _prediction_fields(table, [2.0, 4.0, 9.0], timed, [1.0, None, None])
    assert fields["predicted_step_time_s"] == [2.0, 2.0, 9.0] and fields["predicted_peak_bytes"] == [10, 10, 10]
    assert fields["cost_model_time_mape"] == pytest.approx((0 + 50 + 0) / 3)
    # the priced part unscaled where the records give it, else the prediction as it is
    assert fields["cost_model_time_mape_unscaled"] == pytest.approx((50 + 50 + 0) / 3)


@pytest.mark.dist
def test_quick_run_plots(quick: tuple[dict[str, Any], Path]) -> None:
    _, out = quick
    pngs = sorted(p.name for p in out.parent.glob("*.png"))
    if matplotlib_available():
        assert pngs == ["cumulative-github.png", "plan-github.png"]
    else:
        assert pngs == []


def test_collective_bytes_follow_the_comm_counter_conventions() -> None:
    import torch

    x = torch.zeros(1000)  # 4000 bytes
    assert collective_bytes("allreduce_", ([x],), 4) == pytest.approx(2 * 4000 * 3 / 4)
    assert collective_bytes("_allgather_base_", (torch.zeros(4000), x), 4) == 3 * 4000
    assert collective_bytes("_reduce_scatter_base_", (x, torch.zeros(4000)), 4) == pytest.approx(4 * 4000 * 3 / 4)
    assert collective_bytes("send", ([x], 1, 0), 2) == 4000
    assert collective_bytes("recv_", ([x], 1, 0), 2) == 0
    assert collective_bytes("allreduce_", ([x],), 1) == 0


def test_runs_settings_and_helpers() -> None:
    assert run_spec("static-ring+rc").plan(2) == [{"attention": "ring", "mlp": "ring", "recompute": True}] * 2
    assert run_spec("paradyse-auto").plan(3) == "auto"
    assert run_spec("lightning-fsdp2").data_parallel and not run_spec("lightning-tp").data_parallel
    assert run_spec("lightning-ddp+ac").checkpointing and run_spec("lightning-ddp+ac").builtin == "ddp"
    assert not run_spec("lightning-fsdp2").checkpointing
    for name in ("static", "lightning-tp+ac", "lightning-ddp+rc"):
        with pytest.raises(ValueError, match="unknown run"):
            run_spec(name)
    assert rotated(("a", "b", "c"), 1) == ["b", "c", "a"]
    model = ModelSettings(layers=1, hidden=8, heads=2, kv_heads=1, ffn=16, vocab=4, max_seq_len=64)
    assert model_flops(model, 2) == pytest.approx(2 * model_flops(model, 1) + 6 * 8 * 2)  # linear + quadratic
    quick = BenchSettings.quick()
    assert quick.runs == QUICK_RUNS and quick.repeats >= 1
    runs = [
        {"family": "static", "tokens_per_s": 5.0, "completed": False},
        {"family": "static", "tokens_per_s": 3.0, "completed": True},
    ]
    assert best(runs, "static") is runs[1]
    assert best(runs, "lightning") is None


def test_a_quick_run_leaves_the_committed_results_alone(tmp_path: Path) -> None:
    """Without ``--out`` the smoke run writes into a folder git ignores; the full run into the committed results. A
    missing ``--profile`` stops the harness before it starts; ``--profile measured`` plans on the machine the strategy
    measures at setup (no profile, the default path)."""
    assert output_path(parse_args(["--quick"])) == QUICK_RESULTS / "results.json"
    assert output_path(parse_args([])) == RESULTS / "results.json"
    assert output_path(parse_args(["--quick", "--out", str(tmp_path / "q.json")])) == tmp_path / "q.json"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(QUICK_RESULTS / "results.json")], cwd=RESULTS.parent.parent, check=False
    )
    with pytest.raises(SystemExit, match="no such file"):  # before any process starts
        settings_from(parse_args(["--quick", "--profile", str(tmp_path / "missing.json")]))
    measured = settings_from(parse_args(["--quick", "--profile", "measured"]))
    assert adaptive_profile(measured, tmp_path) == ("measured", {"measured": True})
    if ignored.returncode == 128:  # not a git checkout (an unpacked archive): nothing to ask
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, "benchmarks/results/quick/ must be ignored by git (.gitignore)"


def test_groups_and_dsp_reports_from_fake_runs() -> None:
    """The two scripts' data and reports (their runs are measured by hand: see the README)."""
    import argparse

    from benchmarks import dsp, groups

    data = groups.batches(3, max_len=2048, max_tokens=2048, seed=0)
    assert len(data) == 3 and all(b["input_ids"].shape[1] <= 2048 and "doc_ids" in b for b in data)
    fake = {
        "groups": {
            "times": [1.0, 0.5, 0.5],
            "groups": [{"count": 4, "predicted_imbalance": 1.1, "measured_imbalance": 1.2}] * 3,
        },
        "tp_sp": {"times": [1.0, 1.0, 1.0], "groups": []},
    }
    summary = groups.summarise(fake, data, warmup=1)
    assert summary["runs"]["groups"]["tokens_per_s"] == 2 * summary["runs"]["tp_sp"]["tokens_per_s"]
    args = argparse.Namespace(devices=4, steps=3, warmup=1, max_len=2048, max_tokens=2048)
    report = groups.markdown(summary, args)
    assert "| groups | 1.00 |" in report and "2.00x" in report and "predicted 1.10, measured 1.20" in report
    runs = {
        name: {"seconds": t, "bytes": b}
        for name, t, b in [
            ("dsp", 1.0, {"all_to_all": 1e6, "all_gather": 5e6}),
            ("ulysses", 1.0, {"all_to_all": 2e6, "all_gather": 5e6}),
        ]
    }
    table = dsp.markdown({2: runs}, argparse.Namespace(frames=8, patches=8, reps=1))
    assert "| 2 | dsp | 1.00 | 5.00 | 0.50 |" in table


def test_activation_checkpointing_of_the_built_in_runs_is_exact() -> None:
    """``lightning-*+ac`` recompute every block in backward: the same loss and gradients, in float64."""
    import torch

    model = ModelSettings(layers=2, hidden=16, heads=2, kv_heads=1, ffn=24, vocab=32, max_seq_len=64)
    batch = {"input_ids": torch.randint(0, 32, (2, 12)), "targets": torch.randint(0, 32, (2, 12))}
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        module = BenchLM(model.config(), checkpointing=checkpointing).double()
        module.configure_model()
        loss = module.loss(batch)
        loss.backward()
        results.append((loss.detach(), {n.replace(".block.", "."): p.grad for n, p in module.named_parameters()}))
    (plain, grads), (checkpointed, grads_ac) = results
    assert torch.equal(plain, checkpointed) and grads.keys() == grads_ac.keys()
    assert all(torch.allclose(grads[n], grads_ac[n], rtol=1e-12, atol=1e-14) for n in grads)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_trace_of_both_presets_is_built_for_2_4_and_8_processes(world: int) -> None:
    """The quick preset and the full benchmark start on every trace at 2, 4 and 8 processes (``--devices 4`` and
    ``8`` once stopped here: a length bucket left without a length): every sequence in one batch, each at least
    ``2 * world`` tokens long (a rank of a sequence-parallel group holds tokens of both halves of a causal row)."""
    from benchmarks.workload import build_trace

    for preset in (BenchSettings.quick(), BenchSettings.full()):
        for settings in preset.traces:
            trace = build_trace(settings, world, preset.batch_tokens)
            rows = sorted(i for batch in trace.batches for i in batch)
            assert rows == list(range(len(trace.sequences))), (preset.preset, settings.name)
            assert min(trace.lengths) >= 2 * world, (preset.preset, settings.name)


def test_decision_times_replay_a_trace_as_a_fit_decides_it() -> None:
    """``decision_time.py --traces``: one decision a global batch of the trace, planners warmed as at setup, and the
    seconds of them the garbage collector took."""
    from benchmarks.decision_time import trace_seconds
    from benchmarks.settings import TraceSettings
    from benchmarks.workload import build_trace

    cluster = str(Path(__file__).resolve().parents[1] / "configs" / "clusters" / "h100-80gb-nvlink-8.yaml")
    trace = build_trace(TraceSettings("github", n=24, max_len=512, seed=1), 2, 1024)
    times, collected = trace_seconds(2, trace, cluster, 64 * 2**20)
    assert len(times) == len(trace.batches) > 1 and all(t > 0 for t in times)
    assert 0 <= collected <= sum(times)


def test_step_clock_leaves_on_before_backward_alone() -> None:
    """A callback overriding ``on_before_backward`` makes our strategy hand it the global loss: one more all-reduce per
    step on groups, which the quick preset's steps do not make (``step_overhead.py`` measured 0.82-0.91x DDP with it,
    0.97-1.22x without, on 2026-12-02)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    assert not is_overridden("on_before_backward", StepClock(0, None))


@pytest.mark.dist
def test_step_overhead_times_both_runs_and_names_the_split() -> None:
    """The splits are the planner's, which weighs measured times (data parallel on an idle machine, maybe not on a
    loaded one): counted and printed, not asserted; then a time and the main thread's CPU time for every part of the
    step of both runs (``--no-poll``: ours blocking in its exchanges; ``--logged``: every step logged, ours with the
    switcher), with ``--calls`` the calls made in each part, and with ``--functions`` the time a call of the step's
    own functions takes."""
    args = ["--steps", "8", "--warmup", "2", "--repeats", "1", "--calls", "--functions", "--no-poll", "--logged"]
    lines = run_script("benchmarks/step_overhead.py", *args, timeout=200)
    at = next(i for i, line in enumerate(lines) if line.startswith("  rank 0's functions"))
    lines, functions = lines[:at], lines[at + 2 :]
    times, calls = lines[:-4], lines[-4:]
    assert times[-11].split()[0] == "paradyse" and "(timed steps per split: " in times[-11], lines
    assert sum(int(n) for n in re.findall(r": (\d+)", times[-11].split("split:")[1])) == 8 - 2, lines  # every step
    assert times[-10].split()[0] == "ddp" and times[-9].startswith("  DDP / ours"), lines
    assert "CPU" in times[-4] and "blocking in its exchanges" in times[-4], lines
    for table in (times[-7:-4], times[-3:]):  # wall, then CPU
        assert table[0].split() == " ".join(PHASES).split(), lines
        for line, run in zip(table[1:], ("paradyse", "ddp")):
            assert line.split()[0] == run and len(line.split()) == 6, lines
            assert all(float(x) >= 0 for x in line.split()[1:]), lines
    # --calls: every part of a step makes calls, and a step is their sum
    assert calls[1].split() == [*" ".join(PHASES).split(), "step"], lines
    for line, run in zip(calls[2:], ("paradyse", "ddp")):
        counts = [float(x) for x in line.split()[1:]]
        assert line.split()[0] == run and len(counts) == 6 and all(n > 0 for n in counts), lines
        assert abs(sum(counts[:-1]) - counts[-1]) <= len(PHASES), lines  # each rounded
    # --functions: ours runs its step's own functions once a step, the model's forward in both runs
    rows = {(line.split()[0], line.split()[1]): [float(x) for x in line.split()[2:]] for line in functions}
    named = {name.split(".")[-1] for _, name in FUNCTIONS}
    assert {name.split(".")[-1] for name, _ in rows} <= named, functions
    for name in ("StepCycle.begin", "GroupRunner.decide", "StepCycle.after_backward", "LanguageModel.forward"):
        n, wall, cpu = rows[(name, "paradyse")]
        assert n == 1.0 and wall > 0 and cpu > 0, functions
    assert rows[("LanguageModel.forward", "ddp")][0] == 1.0, functions


@pytest.mark.dist
def test_meetings_times_each_collective_of_both_steps() -> None:
    """``meetings.py``: a time for DDP's two meetings, ParaDySe's two (its all-gather both ways), the all-gather back to
    back, and the return after the compute against the return overlapped with it."""
    lines = run_script("benchmarks/meetings.py", "--iters", "5", "--compute-ms", "1", "--chunks", "3", timeout=120)[-8:]
    labels = ["broadcast", "all-reduce", "all-gather", "all-gather at once", "all-to-all", "all-gather, back to back"]
    labels += ["compute, then all-to-all", "compute, 3 all-to-alls overlapped"]
    assert [line.split("  ")[1].strip() for line in lines] == labels, lines
    assert all(line.split()[-1] == "ms" and float(line.split()[-2]) > 0 for line in lines), lines


@pytest.mark.dist
def test_single_rank_modes_times_every_mode_on_one_rank() -> None:
    """``single_rank_modes.py``: one line per shape and op, a time for every mode."""
    rows = run_script("benchmarks/single_rank_modes.py", "--shapes", "2x32", "--reps", "1", timeout=120)[-2:]
    assert [row.split()[3] for row in rows] == ["attention", "mlp"], rows
    assert all(len(row.split()) == 4 + 4 and all(float(x) > 0 for x in row.split()[4:]) for row in rows), rows


def test_readme_benchmarks_section_is_results_md() -> None:
    """``benchmarks/sync_readme.py`` rewrites the README's Benchmarks section from ``benchmarks/RESULTS.md``: a
    paragraph written into the README alone would be lost on the next sync. Edit RESULTS.md, then sync."""
    readme = (ROOT / "README.md").read_text()
    assert sync(readme, (ROOT / "benchmarks" / "RESULTS.md").read_text()) == readme
