"""``python -m mpicomm.bench adaptive``: seeds, per-step accuracy checks, medians.

``median_row`` is pure; the serial tests below start short child ``mpiexec`` jobs
(tests/launch.py) and check the JSON the bench writes: one 3-rank job of two seeds with
``--stop-at-target`` (about 15 s) is shared by the two tests that read it.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mpicomm.abort import UsageError
from mpicomm.bench.adaptive import auto_options, lgreco_summary, median_row, ratio_moves

from .launch import load_script, run_job


def _run(seed, reached, acc, step_ms):
    return {"method": "m", "seed": seed, "time_to_target_s": reached, "final_acc": acc,
            "seconds": 10.0, "steps": 4, "step_ms": step_ms, "sent_kB_step": 1.0}


def test_median_row_takes_medians_and_counts_a_miss_as_infinitely_slow():
    runs = [_run(0, 3.0, 0.96, 50.0), _run(1, None, 0.95, 70.0), _run(2, 2.0, 0.97, 60.0)]
    row = median_row(runs)
    assert row["time_to_target_s"] == 3.0          # median of (2, 3, inf)
    assert row["final_acc"] == pytest.approx(0.96) and row["step_ms"] == 60.0
    assert row["runs"] == runs and "seed" not in row
    # half the runs missed: no time
    assert median_row(runs[:2])["time_to_target_s"] is None
    one = median_row(runs[:1])
    assert one["time_to_target_s"] == 3.0 and one["runs"] == runs[:1]


def test_auto_options_reads_flags_numbers_and_tuples():
    assert auto_options(["momentum_correction=false", "window=3", "weights=0.8,0.2"]) == {
        "momentum_correction": False, "window": 3, "weights": (0.8, 0.2)}
    for bad, why in ((["weights=0.8,x"], "must be a number"),
                     (["weights=0.8,0.2,0.1"], "weights must be two positive numbers"),
                     (["no_such_option=1"], "--auto-option")):
        with pytest.raises(UsageError, match=why):
            auto_options(bad)


def test_ratio_moves_compares_the_ratio_before_a_change_with_the_settled_one():
    line = [(s, "gtopk", 0.1 if s < 5 else 0.01 if s < 12 else 0.02,
             10.0 if s < 4 else 0.1 if s < 10 else 1.0, 0.05 if s < 4 else 5.0)
            for s in range(16)]
    moves = ratio_moves(line, settle=3)
    assert [m["step"] for m in moves] == [4, 10]
    first, second = moves
    assert (first["ratio_before"], first["ratio_after"]) == (0.1, 0.01)   # step 7
    assert first["factor"] == pytest.approx(10.0)
    assert (first["from_gbit"], first["to_gbit"], first["to_delay_ms"]) == (10.0, 0.1, 5.0)
    assert (second["ratio_before"], second["ratio_after"]) == (0.01, 0.02)  # step 13
    assert second["factor"] == pytest.approx(2.0)
    # a change too close to the end: the ratio at the last step
    assert ratio_moves(line[:12], settle=5)[-1]["ratio_after"] == 0.01
    assert ratio_moves([(0, "dense", 1.0, 1.0, 1.0)]) == []


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    """dense, gTop-k at 0.1 and auto for 2 epochs on 2 seeds at 3 ranks, the fixed choice
    stopped at the target: the bench's JSON."""
    out = tmp_path_factory.mktemp("adaptive") / "adaptive.json"
    result = run_job(3, [sys.executable, "-m", "mpicomm.bench", "adaptive", "--epochs", "2",
                         "--hidden", "32", "--static", "gtopk@0.1", "--seeds", "2",
                         "--target", "0.3", "--stop-at-target", "--lgreco-families", "",
                         "--schedule", "0:0.1:100", "--json", str(out)],
                     timeout=240)
    assert result.returncode == 0, result.output
    return json.loads(out.read_text())


def test_bench_adaptive_runs_every_method_per_seed_and_reports_medians(two_seeds):
    data = two_seeds
    assert [r["method"] for r in data["rows"]] == ["dense", "gtopk@0.1", "auto"]
    for row in data["rows"]:
        runs = row["runs"]
        assert [r["seed"] for r in runs] == [0, 1]
        # the batch order differs between seeds: so does the trajectory
        assert runs[0]["final_acc"] != runs[1]["final_acc"] or \
            runs[0]["time_to_target_s"] != runs[1]["time_to_target_s"]
        times = [r["time_to_target_s"] for r in runs]
        assert all(t is not None and t > 0 for t in times), row
        # checked every step: reached before the end of the run
        assert row["time_to_target_s"] == pytest.approx(float(np.median(times)))
        assert all(r["time_to_target_s"] <= r["seconds"] + 1e-9 for r in runs)
    assert data["summary"]["auto_speedup_vs_dense"] is not None
    # the controllers' own time, per run: calibration happened, nothing is negative
    for run in data["rows"][-1]["runs"]:
        own = run["overheads"]
        assert set(own) == {"calibration_s", "probe_s", "reference_s", "exploration_s",
                            "lgreco_s", "probes", "windows"}
        assert own["calibration_s"] > 0 and min(own.values()) >= 0
        assert 0 < run["overhead_pct"] < 100
        # one entry per step: the scheme and ratio against the injected link's schedule
        line = run["timeline"]
        # (a step's times are agreed during the next one: the last may be missing)
        assert [p[0] for p in line] == list(range(len(line)))
        assert len(line) >= run["steps"] - 2
        assert all(p[1] in ("dense", "allgather_topk", "gtopk", "artopk_ring",
                            "artopk_tree", "powersgd") and 0 < p[2] <= 1 for p in line)
        assert all(p[3:] == [pytest.approx(0.1), pytest.approx(0.1)] for p in line)
    assert data["summary"]["auto_vs_best_static_target"] == 1.05   # a constant network
    assert "ratio_moves" not in data["summary"]
    assert data["rows"][0]["overhead_pct"] is None   # dense has no controllers
    assert data["options"]["seeds"] == 2 and data["options"]["eval_every"] == 1


def test_bench_adaptive_seed_offset_runs_the_later_seeds(two_seeds, tmp_path):
    """``--seed-offset 1 --seeds 1`` runs seed 1 alone: the same run as the second seed of
    ``--seeds 2`` (so a committed result can get more seeds without rerunning seed 0)."""
    out = tmp_path / "offset.json"
    result = run_job(3, [sys.executable, "-m", "mpicomm.bench", "adaptive", "--epochs", "2",
                         "--hidden", "32", "--static", "gtopk@0.1", "--only", "gtopk@0.1",
                         "--seeds", "1", "--seed-offset", "1", "--target", "0.3",
                         "--stop-at-target", "--lgreco-families", "",
                         "--schedule", "0:0.1:100", "--json", str(out)],
                     timeout=240)
    assert result.returncode == 0, result.output
    (run,) = json.loads(out.read_text())["rows"][0]["runs"]
    second = two_seeds["rows"][1]["runs"][1]
    assert run["seed"] == second["seed"] == 1
    assert run["final_acc"] == second["final_acc"] and run["steps"] == second["steps"]
    assert run["sent_kB_step"] == second["sent_kB_step"]


def test_bench_adaptive_rejects_zero_seeds(capsys):
    """In this process: the checks come first in ``run`` (a UsageError under mpiexec is
    one error line and status 2 on every rank: tests/test_bench_usage.py)."""
    from mpicomm.bench.__main__ import main

    for args, message in ((["--seeds", "0"], "--seeds and --eval-every must be >= 1"),
                          (["--seed-offset", "-1"], "--seed-offset >= 0"),
                          (["--max-steps", "0"], "--max-steps must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            main(["adaptive", *args])
        assert exc.value.code == 2, args
        err = capsys.readouterr().err
        assert message in err, err


def test_bench_adaptive_stops_a_fixed_choice_at_the_target_and_auto_at_the_end(two_seeds,
                                                                            tmp_path):
    dense, fixed, auto = two_seeds["rows"]
    assert fixed["stopped_at_target"]
    assert not auto["stopped_at_target"] and not dense["stopped_at_target"]
    assert dense["steps"] == auto["steps"]      # dense runs to the end: the reference
    for stopped, full in zip(fixed["runs"], auto["runs"]):
        # checked every step: the run ended at the step that reached the target
        assert stopped["steps"] < full["steps"]
        assert stopped["time_to_target_s"] == pytest.approx(stopped["seconds"])
        assert stopped["final_acc"] >= 0.3
    out = tmp_path / "adaptive.json"
    # every run ends after --max-steps steps
    result = run_job(3, [sys.executable, "-m", "mpicomm.bench", "adaptive", "--epochs", "2",
                         "--hidden", "32", "--static", "gtopk@0.1", "--only", "gtopk@0.1",
                         "--target", "2", "--max-steps", "3", "--lgreco-families", "",
                         "--schedule", "0:0.1:100", "--json", str(out)], timeout=240)
    assert result.returncode == 0, result.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps"] == 3 and row["time_to_target_s"] is None
    assert not row["stopped_at_target"]


def _merge_module():
    return load_script("benchmarks/adaptive_merge.py")


def _result(only, rows, **options):
    opts = {"workload": "mnist1d-cnn", "target": 0.9, "seeds": 1, "only": only,
            "json": f"{only}.json", **options}
    return {"suite": "adaptive", "ranks": 8, "clock": {"mode": "virtual"}, "options": opts,
            "rows": rows, "lgreco": [], "summary": {}, "training_runs": [{"label": only}]}


def test_adaptive_merge_puts_separate_jobs_together_and_recomputes_the_targets():
    merge = _merge_module().merge
    auto = dict(_run(0, 8.0, 0.97, 20.0), method="auto", timeline=[])
    auto["runs"] = [auto]
    fixed = [dict(_run(0, t, 0.96, 30.0), method=m, stopped_at_target=True)
             for m, t in (("gtopk@0.1", 10.0), ("artopk_tree@0.01", 12.0))]
    dense = dict(_run(0, 16.0, 0.975, 40.0), method="dense", stopped_at_target=False)
    parts = [_result("auto", [auto]), _result("gtopk", fixed, stop_at_target=True),
             _result("dense", [dense])]
    out = merge(parts, ["a", "g", "d"])
    assert [r["method"] for r in out["rows"]] == ["dense", "gtopk@0.1", "artopk_tree@0.01",
                                                  "auto"]
    s = out["summary"]
    assert s["best_static"] == "gtopk@0.1" and s["auto_vs_best_static"] == pytest.approx(0.8)
    assert s["auto_speedup_vs_dense"] == pytest.approx(2.0)
    assert s["auto_acc_loss_points"] == pytest.approx(0.5)
    assert s["auto_vs_best_static_target"] == 1.05      # no change of the network
    assert len(out["training_runs"]) == 3 and out["options"]["merged_from"] == ["a", "g", "d"]
    # a dense run stopped at the target has no final accuracy to compare with
    parts[2]["rows"][0]["stopped_at_target"] = True
    assert merge(parts, ["a", "g", "d"])["summary"]["auto_acc_loss_points"] is None
    # jobs of different comparisons are refused
    with pytest.raises(ValueError, match="options \\['target'\\] differ"):
        merge([parts[0], _result("dense", [dense], target=0.8)], ["a", "d"])
    with pytest.raises(ValueError, match="appears twice"):
        merge([parts[0], parts[0]], ["a", "b"])


def test_adaptive_merge_joins_the_seeds_of_one_method_from_several_jobs():
    merge = _merge_module().merge

    def job(method, seeds, times, offset=0):
        runs = [dict(_run(s, t, 0.96, 30.0), method=method, timeline=[])
                for s, t in zip(seeds, times)]
        row = median_row(runs)
        return _result(method, [row], seeds=len(seeds), seed_offset=offset)

    parts = [job("auto", [0, 1, 2], [8.0, 9.0, 7.0]), job("gtopk@0.1", [0], [10.0]),
             job("gtopk@0.1", [1, 2], [14.0, 11.0], offset=1)]
    out = merge(parts, ["a", "g0", "g12"])
    fixed = out["rows"][0]
    assert fixed["method"] == "gtopk@0.1" and [r["seed"] for r in fixed["runs"]] == [0, 1, 2]
    assert fixed["time_to_target_s"] == 11.0                  # median of 10, 14, 11
    assert out["summary"]["auto_vs_best_static"] == pytest.approx(8.0 / 11.0)
    assert out["options"]["seeds"] == 3 and out["options"]["seed_offset"] == 0
    # a merged result merges again; its sources are listed, not the merged file
    again = merge([merge(parts[:1], ["a"]), job("dense", [0, 1, 2], [20.0, 21.0, 22.0])],
                  ["m", "d"])
    assert again["options"]["merged_from"] == ["a", "d"]
    assert again["summary"]["auto_speedup_vs_dense"] == pytest.approx(21.0 / 8.0)
    with pytest.raises(ValueError, match="different seeds"):
        merge(parts[:2], ["a", "g0"])
    with pytest.raises(ValueError, match="appears twice"):
        merge([parts[1], parts[1]], ["g0", "g0"])


def test_adaptive_merge_compares_clocks_by_what_they_charge():
    merge = _merge_module().merge
    op = {"per_call": 1e-3, "per_unit": 0.0, "unit": "call", "source": "declared"}
    absent = {"per_call": 0.0, "per_unit": 0.0, "unit": "kept element", "source": "absent"}

    def part(only, fmt, ops, method):
        row = dict(_run(0, 10.0, 0.96, 20.0), method=method, stopped_at_target=False,
                   timeline=[])
        row["runs"] = [row]
        r = _result(only, [row])
        r["clock"] = {"mode": "virtual", "platform": {"rate_bits": 1e9},
                      "costs": {"format": fmt, "ops": ops}}
        return r

    old = part("auto", "mpicomm-cost-table/1", {"forward": op}, "auto")
    new = part("gtopk", "mpicomm-cost-table/2", {"forward": op, "select:kept": absent},
               "gtopk@0.1")
    assert len(merge([old, new], ["a", "g"])["rows"]) == 2
    dearer = part("dense", "mpicomm-cost-table/2", {"forward": dict(op, per_call=2e-3)},
                  "dense")
    with pytest.raises(ValueError, match="clock differs"):
        merge([old, dearer], ["a", "d"])
    charged = part("dense", "mpicomm-cost-table/2",
                   {"forward": op, "select:kept": dict(absent, source="measured",
                                                       per_unit=1e-9)}, "dense")
    with pytest.raises(ValueError, match="clock differs"):
        merge([old, charged], ["a", "d"])


def test_lgreco_summary_is_the_median_over_seeds_of_each_seed_ratio():
    """One (uniform, L-GreCo) pair per seed: each target is the median of the per-seed
    ratios, not a ratio of medians; a run that missed the target is infinitely late."""
    def pair(seed, uniform_s, lgreco_s, lgreco_kb):
        return [{"family": "topk", "seed": seed, "time_to_target_s": uniform_s,
                 "sent_kB_step": 300.0},
                {"family": "topk", "seed": seed, "time_to_target_s": lgreco_s,
                 "sent_kB_step": lgreco_kb, "dp_size_vs_uniform": 0.25 + seed / 100}]
    rows = pair(0, 20.0, 16.0, 100.0) + pair(1, 10.0, 9.5, 150.0) + pair(2, 30.0, 21.0, 120.0)
    summary = lgreco_summary(rows)
    assert summary["lgreco_time_to_target_ratio"] == pytest.approx(0.8)   # 0.8, 0.95, 0.7
    assert summary["lgreco_bytes_ratio"] == pytest.approx(2.5)            # 3, 2, 2.5
    assert summary["lgreco_dp_size_vs_uniform"] == pytest.approx(0.26)
    # L-GreCo missed on one seed of three: infinitely late, the median is the next
    one_missed = pair(0, 20.0, 16.0, 100.0) + pair(1, 10.0, None, 150.0) + \
        pair(2, 30.0, 21.0, 120.0)
    assert lgreco_summary(one_missed)["lgreco_time_to_target_ratio"] == pytest.approx(0.8)
    # missed on one of two (the median is infinite), or both missed on a seed: no ratio
    missed = pair(0, 20.0, None, 100.0) + pair(1, 10.0, 9.5, 150.0)
    assert lgreco_summary(missed)["lgreco_time_to_target_ratio"] is None
    both = pair(0, None, None, 100.0) + pair(1, 10.0, 9.5, 150.0) + pair(2, 30.0, 21.0, 120.0)
    assert lgreco_summary(both)["lgreco_time_to_target_ratio"] is None
    # uniform alone missed: L-GreCo was first (ratio 0 on that seed)
    first = pair(0, None, 16.0, 100.0) + pair(1, 10.0, 9.5, 150.0) + pair(2, 30.0, 21.0, 120.0)
    assert lgreco_summary(first)["lgreco_time_to_target_ratio"] == pytest.approx(0.7)
    qsgd = [dict(r, family="qsgd") for r in pair(0, 20.0, 18.0, 150.0)]
    assert lgreco_summary(qsgd)["lgreco_time_to_target_ratio_qsgd"] == pytest.approx(0.9)


def test_bench_adaptive_lgreco_runs_each_seed_of_the_offset(tmp_path):
    """``--only lgreco --seeds 2 --seed-offset 1``: uniform and L-GreCo on seeds 1 and 2,
    in that order, and the summary is the median of the two seeds' ratios."""
    out = tmp_path / "lgreco.json"
    result = run_job(3, [sys.executable, "-m", "mpicomm.bench", "adaptive", "--epochs", "1",
                         "--hidden", "32", "--only", "lgreco", "--lgreco-families", "topk",
                         "--lgreco-ratio", "0.1", "--lgreco-steps", "12", "--seeds", "2",
                         "--seed-offset", "1", "--target", "0.2",
                         "--schedule", "0:0.1:100", "--json", str(out)],
                     timeout=240)
    assert result.returncode == 0, result.output
    data = json.loads(out.read_text())
    rows = data["lgreco"]
    assert [(r["setting"], r["seed"]) for r in rows] == [
        ("uniform", 1), ("lgreco", 1), ("uniform", 2), ("lgreco", 2)]
    # the batch order differs between seeds
    assert rows[0]["final_acc"] != rows[2]["final_acc"]
    ratios = [u["sent_kB_step"] / l["sent_kB_step"] for u, l in zip(rows[::2], rows[1::2])]
    assert data["summary"]["lgreco_bytes_ratio"] == pytest.approx(float(np.median(ratios)))
