"""Compression ratios against dense (``python -m mpicomm.bench ratios``) on real inputs.

Multi-rank (``@pytest.mark.mpi``, ``mpiexec -n 1..5``): the probe on a short MNIST-1D run
sees what each strategy sends (Top-k's update touches at most P·k entries per step, dense
all of them), the error-feedback residual, and the run's total bytes (summed over the
ranks) against the formulas. Serial: strategy labels, and the suite as a 2-rank child job
whose rows file has exactly the documented keys and ratios.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from mpicomm import strategies, workloads
from mpicomm.bench._util import UsageError
from mpicomm.bench.harness import Spec, train
from mpicomm.bench.probe import CompressionProbe
from mpicomm.bench.ratios import (
    ROW_KEYS,
    collect,
    is_rows,
    medians,
    metric_gap,
    platform,
    runs_by_file,
    stale_default,
)
from mpicomm.bench.recipes import label_density, label_strategy, named_options
from mpicomm.bench.sync import GradientMethod

from .launch import run_job

SMALL = {"train_examples": 400, "channels": 16}


@pytest.mark.mpi
def test_probe_and_bytes_of_topk_against_dense(comm):
    p = comm.size
    spec = Spec(workload="mnist1d-cnn", seed=3, batch=8, options=SMALL, max_steps=8,
                eval_every=None)
    runs, probes = {}, {}
    for label in ("dense", "topk"):
        w = workloads.get("mnist1d-cnn", rank=comm.rank, size=p, seed=3, batch=8, **SMALL)
        recipe = label_strategy(label, density=0.01)
        probe = CompressionProbe(comm, every=4)
        runs[label] = train(spec, GradientMethod(recipe.strategy, label=label,
                                                 owns_momentum=recipe.owns_momentum),
                            comm, workload=w, on_step=probe.on_step)
        probes[label] = probe.as_dict()
    d = sum(probes["dense"]["sizes"])
    k = math.ceil(0.01 * d)  # one fused buffer: the whole model
    for label, probe in probes.items():
        assert probe["steps"] == [4, 8] and len(probe["density"]) == 2
        assert runs[label].sent_bytes_total == \
            comm.allreduce_value(runs[label].sent_bytes, "sum")
        for window in probe["density"]:
            touched = sum(f * n for f, n in zip(window, probe["sizes"]))  # entries/step
            if label == "topk":
                assert 0 < touched <= min(p * k, d) + 1e-9, (window, p * k)
            else:
                assert touched > 0.5 * d, window
    assert probes["dense"]["residual_norm"] == [0.0, 0.0]  # no memory
    assert all(r > 0 for r in probes["topk"]["residual_norm"])
    assert all(u > 0 for u in probes["topk"]["update_norm"])
    # whole-run bytes: dense ring allreduce 2(P-1)/P·4d, Top-k's allgather (P-1)·k·s per
    # rank and step
    steps = runs["dense"].steps
    assert steps == runs["topk"].steps == 8
    dense_total = runs["dense"].sent_bytes_total
    if p == 1:
        assert dense_total == runs["topk"].sent_bytes_total == 0
        return
    assert dense_total == pytest.approx(steps * p * 2 * (p - 1) / p * 4 * d, rel=0.01)
    # Top-k by name at density 0.01 codes its pairs: at least a value byte and a varint
    # byte a pair and 12 a message, fewer than the 8 a pair of plain pairs
    coded_floor, plain = steps * p * (p - 1) * (12 + 2 * k), steps * p * (p - 1) * k * 8
    assert coded_floor * 0.99 <= runs["topk"].sent_bytes_total < plain


def test_bare_labels_are_the_strategies_defaults():
    for name in ("topk", "gtopk", "artopk"):
        for density in (0.001, 0.01):
            recipe = label_strategy(name, density=density)
            made = strategies.make(name, density=density)
            assert recipe.strategy.describe() == made.describe()
            # topk takes the momentum from the optimizer at the first step, gtopk and
            # artopk leave it there: the harness builds the optimizer with its
            # momentum, as a user would
            # (by name only below density 0.003; from there plain error feedback)
            assert made.momentum_correction == (
                "optimizer" if name == "topk" and density < 0.003 else 0.0)
            assert not recipe.owns_momentum
            assert label_density(name, density) == density
    assert label_density("gtopk+ef+mc", 0.001) == 0.001
    assert label_density("topk-noef", 0.01) == 0.01
    assert label_density("powersgd:rank=2", 0.01) is None
    assert label_density("dense", 0.01) is None


def test_named_options_labels():
    assert named_options("powersgd:rank=2") == ("powersgd", {"rank": 2})
    assert named_options("qsgd:bits=4,bucket_size=128") == \
        ("qsgd", {"bits": 4, "bucket_size": 128})
    assert named_options("topk+ef") is None and named_options("dense") is None
    s = label_strategy("powersgd:rank=4").strategy
    assert type(s).__name__ == "PowerSGDAllreduce" and s.describe()["rank"] == 4
    assert label_strategy("qsgd:bits=2").strategy.describe()["bits"] == 2
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
        label_strategy("powersgd:rank")
    with pytest.raises(ValueError, match="not a number, true/false or a name"):
        label_strategy("powersgd:rank=2x")
    with pytest.raises(ValueError, match="rank must be an integer"):
        label_strategy("powersgd:rank=two")  # a name reaches the constructor
    assert named_options("artopk:source=largest") == ("artopk", {"source": "largest"})
    assert label_strategy("artopk:source=largest", density=0.001).strategy.source == \
        "largest"
    with pytest.raises(ValueError, match="powersgd:ranks=2"):
        label_strategy("powersgd:ranks=2")


def test_sparsifier_labels_with_options_keep_the_default_recipe_at_the_density():
    """``gtopk:flush_every=100``: the default recipe at ``density`` with that option."""
    s = label_strategy("gtopk:flush_every=100", density=0.001).strategy
    d = s.describe()
    assert (d["density"], d["flush_every"], d["own_contribution"]) == (0.001, 100, True)
    assert s.momentum_correction == 0.0 and d["schedule"] == "ramp:0.03,6.2"
    assert (d["exact_values"], d["coding"]) == (True, None)   # the recipe below 0.003
    d = label_strategy("gtopk:flush_every=100,density=0.01", density=0.001).strategy.describe()
    assert (d["schedule"], d["coding"]) == ("ramp:0.03,7.48", "log8")
    assert label_density("gtopk:flush_every=100", 0.001) == 0.001
    assert label_density("artopk:flush_every=50,density=0.01", 0.001) == 0.01
    assert label_strategy("artopk:flush_every=50,density=0.01",
                          density=0.001).strategy.describe()["density"] == 0.01
    assert label_density("topk:k=10", 0.001) is None


def test_layer_modifier_gives_every_tensor_its_own_buffer():
    """``+layer``: ``fusion_bytes=1``, so each tensor is a buffer of its own and gets
    its own top-k at the density (every other option as the label says)."""
    s = label_strategy("artopk+ef+layer", density=0.001).strategy
    assert s.fusion_bytes == 1 and s.error_feedback and s.momentum_correction == 0.0
    assert label_strategy("artopk+ef", density=0.001).strategy.fusion_bytes > 1 << 20
    assert label_density("gtopk+ef+layer", 0.01) == 0.01


def test_finish_modifier_ends_the_label_schedule_denser():
    """``+finish:D,S``: the label's schedule (or none) and density at least D from step
    S; with the default's options spelled out it is the default at 0.001 up to S."""
    label = "gtopk+ef+own+exact+ramp:0.03,6.2+finish:0.01,3263"
    s = label_strategy(label, density=0.001).strategy
    default = strategies.make("gtopk", density=0.001).describe()
    d = s.describe()
    assert d["schedule"] == "ramp:0.03,6.2+finish:0.01,3263"
    assert {**d, "schedule": default["schedule"]} == default
    assert [s.schedule(t, 0.001) for t in (0, 3262, 3263)] == [0.03, 0.001, 0.01]
    assert label_strategy("topk+ef+finish:0.05,10").strategy.describe()["schedule"] == \
        "finish:0.05,10"
    assert label_density(label, 0.001) == 0.001
    for bad, message in (("topk+ef+finish:0.05", "bad final phase"),
                         ("topk+finish:0.1,5+finish:0.2,6", "at most one finish")):
        with pytest.raises(ValueError, match=message):
            label_strategy(bad)


def test_metric_gap_signs():
    acc = {"metric": "accuracy", "direction": "max"}
    ppl = {"metric": "perplexity", "direction": "min"}
    assert metric_gap({**acc, "curve": [{"accuracy": 0.97}]},
                      {**acc, "curve": [{"accuracy": 0.98}]}) == pytest.approx(-1.0)
    assert metric_gap({**ppl, "curve": [{"perplexity": 102.0}]},
                      {**ppl, "curve": [{"perplexity": 100.0}]}) == pytest.approx(-2.0)


def test_ratios_suite_rows_on_a_short_run(tmp_path):
    out, rows_path = tmp_path / "ratios" / "r.json", tmp_path / "rows.json"
    res = run_job(2, [sys.executable, "-m", "mpicomm.bench", "ratios",
                      "--workload", "mnist1d-cnn", "--option", "train_examples=400",
                      "--option", "channels=16", "--steps", "6", "--eval-every", "3",
                      "--probe-every", "3", "--seeds", "2", "--density", "0.01",
                      "--strategy", "dense", "--strategy", "gtopk",
                      "--strategy", "powersgd:rank=2", "--json", str(out)], timeout=240)
    assert res.returncode == 0, res.output
    data = json.loads(out.read_text())
    runs = data["training_runs"]
    assert data["suite"] == "ratios" and len(runs) == 6
    assert all(r["probe"]["steps"] == [3, 6] and r["sent_bytes_total"] > 0 for r in runs)
    res = run_job(1, [sys.executable, "-m", "mpicomm.bench", "ratios", "--collect",
                      str(tmp_path / "ratios"), "--rows", str(rows_path)], timeout=60)
    assert res.returncode == 0, res.output
    rows = json.loads(rows_path.read_text())
    assert is_rows(rows) and len(rows) == 4
    assert all(tuple(row) == ROW_KEYS for row in rows)
    by = {(r["label"], r["seed"]): r for r in runs}
    for row in rows:
        mine, dense = by[(row["strategy"], row["seed"])], by[("dense", row["seed"])]
        assert row["bytes_vs_dense"] == pytest.approx(
            dense["sent_bytes_total"] / mine["sent_bytes_total"], rel=1e-3)
        assert row["metric_gap"] == pytest.approx(
            100 * (mine["curve"][-1]["accuracy"] - dense["curve"][-1]["accuracy"]), abs=1e-3)
        assert row["ranks"] == 2 and row["workload"] == "mnist1d-cnn"
        assert row["density"] == (0.01 if row["strategy"] == "gtopk" else None)
        assert row["bytes_vs_dense"] > (10 if row["strategy"] == "gtopk" else 2)
    assert collect([r for r in runs if r["label"] != "dense"]) == []  # no reference


def test_collect_compares_runs_of_the_same_length():
    """A run cut short is compared with the dense run of its own length, never with a
    longer one of the same seed."""
    def run(label, steps, acc, sent):
        return {"workload": "w", "ranks": 8, "seed": 0, "steps": steps, "label": label,
                "metric": "accuracy", "direction": "max", "density": 0.01,
                "curve": [{"accuracy": acc}], "sent_bytes_total": sent}

    rows = collect([run("dense", 100, 0.90, 1000), run("dense", 400, 0.98, 4000),
                    run("gtopk", 100, 0.89, 10), run("gtopk+ef", 400, 0.97, 40)])
    got = {r["strategy"]: (r["metric_gap"], r["bytes_vs_dense"]) for r in rows}
    assert got == {"gtopk": (pytest.approx(-1.0), 100.0),
                   "gtopk+ef": (pytest.approx(-1.0), 100.0)}


def _lm_run(label: str, ppl: float, sent: int = 1000) -> dict:
    """A run record of seed 0 that ended at perplexity ``ppl`` having sent ``sent`` bytes."""
    return {"workload": "w", "ranks": 8, "seed": 0, "steps": 100, "label": label,
            "metric": "perplexity", "direction": "min", "density": 0.001,
            "curve": [{"perplexity": ppl}], "sent_bytes_total": sent}


def test_collect_prefers_the_dense_run_of_the_runs_own_file():
    """Two files each with a dense run of the same seed and length (two jobs, perhaps two
    machines): a run is compared with its own file's, whichever file is read last; a
    file without a dense run of its own borrows the last one read."""
    files = [{"training_runs": [_lm_run("dense", 100.0), _lm_run("topk", 101.0, 10)]},
             {"training_runs": [_lm_run("dense", 110.0), _lm_run("gtopk", 111.0, 20)]},
             {"training_runs": [_lm_run("artopk", 112.0, 40)]}]
    got = {r["strategy"]: (r["metric_gap"], r["bytes_vs_dense"])
           for r in collect(runs_by_file(files))}
    assert got == {"topk": (pytest.approx(-1.0), 100.0),
                   "gtopk": (pytest.approx(-100 / 110, abs=1e-4), 50.0),
                   "artopk": (pytest.approx(-200 / 110, abs=1e-4), 25.0)}
    flat = [x for data in files for x in data["training_runs"]]       # no sources: last read
    assert {r["strategy"]: r["metric_gap"] for r in collect(flat)}["topk"] == \
        pytest.approx(100 * (110 - 101) / 110, abs=1e-4)


def test_collect_borrows_a_dense_run_of_the_same_platform():
    """A file without a dense run borrows one from a file whose machine record names the
    same CPU and torch build, even when another machine's file is read later; a file of
    unrecorded platform borrows from another such file."""
    epyc = {"cpu": "AMD EPYC", "torch": {"version": "2.13.0+cpu", "cpu_capability": "AVX2"}}
    xeon = {"cpu": "Intel Xeon", "torch": {"version": "2.13.0+cpu",
                                           "cpu_capability": "AVX512"}}
    files = [{"machine": {}, "training_runs": [_lm_run("dense", 100.0)]},
             {"machine": epyc, "training_runs": [_lm_run("dense", 110.0)]},
             {"machine": {}, "training_runs": [_lm_run("topk", 101.0, 10)]},
             {"machine": epyc, "training_runs": [_lm_run("gtopk", 111.0, 20)]},
             {"machine": xeon, "training_runs": [_lm_run("dense", 120.0)]}]
    got = {r["strategy"]: r["metric_gap"] for r in collect(runs_by_file(files))}
    assert got == {"topk": pytest.approx(-1.0), "gtopk": pytest.approx(-100 / 110, abs=1e-4)}
    assert platform(epyc) == ("AMD EPYC", "2.13.0+cpu", "AVX2")
    assert platform({}) == (None, None, None)


def test_medians_keep_short_and_full_runs_apart():
    """With the step counts, a label's short screen and its full-length runs get a median
    each; without them (the rows file) they share one."""
    def run(label, seed, steps, acc, sent):
        return {"workload": "w", "ranks": 8, "seed": seed, "steps": steps, "label": label,
                "metric": "accuracy", "direction": "max", "density": None,
                "curve": [{"accuracy": acc}], "sent_bytes_total": sent}

    runs = [run("dense", 0, 100, 0.90, 1000), run("powersgd", 0, 100, 0.80, 10)]
    for seed in range(3):
        runs += [run("dense", seed, 400, 0.98, 4000), run("powersgd", seed, 400, 0.975, 40)]
    apart = medians(collect(runs, steps=True))
    assert sorted((m["steps"], m["seeds"], round(m["metric_gap"], 6)) for m in apart) == \
        [(100, 1, -10.0), (400, 3, -0.5)]
    assert [m["seeds"] for m in medians(collect(runs))] == [4]
    assert all("steps" not in row for row in collect(runs))


def test_a_run_of_an_earlier_default_is_never_read_as_todays():
    """A run labelled by a sparsifier's bare name records the recipe it ran; when that is
    no longer what the name builds, collecting refuses it (naming the run and what
    changed) until it is relabelled with the recipe it ran; the adopted momentum of
    ``momentum_correction="optimizer"`` counts as the optimizer's."""
    def run(label, describe, momentum=0.9, acc=0.97, density=0.001):
        return {"workload": "w", "ranks": 8, "seed": 0, "steps": 100, "label": label,
                "metric": "accuracy", "direction": "max", "density": density,
                "curve": [{"accuracy": acc}], "sent_bytes_total": 10,
                "config": {"momentum": momentum}, "extra": {"describe": describe}}

    now = strategies.make("gtopk", density=0.001).describe()
    earlier = {**strategies.GTopK(density=0.001).describe(), "momentum_correction": 0.9}
    dense = run("dense", None, acc=0.98) | {"sent_bytes_total": 1000}
    assert stale_default(run("gtopk", now)) == {}
    assert stale_default(run("gtopk", earlier)) == {
        "momentum_correction": (0.9, None), "momentum_masking": (True, None),
        "schedule": (None, "ramp:0.03,6.2"), "exact_values": (False, True),
        "collective": ("gtopk(butterfly)", "gtopk(butterfly)+allreduce(ring)")}
    # the recipe of density 0.01 run at 0.001: stale, the name builds more there now
    at_001 = strategies.make("gtopk", density=0.01).describe() | {"density": 0.001}
    assert stale_default(run("gtopk", at_001)) == {
        "schedule": ("ramp:0.03,7.48", "ramp:0.03,6.2"), "coding": ("log8", None)}
    assert stale_default(run("gtopk+ef+own+exact+log8+ramp:0.03,7.48", at_001)) == {}
    assert stale_default(run("gtopk:flush_every=100", earlier | {"flush_every": 100}))
    assert stale_default(run("gtopk+ef+mc+own", earlier)) == {}  # explicit: not a default
    assert stale_default(run("gtopk", None)) == {}                # nothing recorded
    # an option added after the run counts as the class's default (what ran before it)
    now_001 = strategies.make("gtopk", density=0.01).describe()
    older = {k: v for k, v in now_001.items() if k != "coding"}
    assert stale_default(run("gtopk", older, density=0.01)) == {"coding": (None, "log8")}
    assert stale_default(run("gtopk:coding=none", older, density=0.01)) == {}
    # Top-k's default takes the optimizer's momentum over: recorded as the factor
    topk = strategies.make("topk", density=0.001).describe()
    assert stale_default(run("topk", topk | {"momentum_correction": 0.9})) == {}
    plain = {k: v for k, v in topk.items() if not k.startswith("momentum_")}
    assert stale_default(run("topk", plain, momentum=0.0)) == {}
    assert stale_default(run("topk", plain))  # momentum 0.9 but nothing taken over

    with pytest.raises(UsageError, match=r"gtopk \(w, 8 ranks, density 0.001, seed 0, "
                                         r"100 steps\): collective ran 'gtopk\(butterfly\)', "
                                         r"now 'gtopk\(butterfly\)\+allreduce\(ring\)'.*"
                                         r"momentum_correction ran 0.9"):
        collect([dense, run("gtopk", earlier)])
    rows = collect([dense, run("gtopk+ef+mc+own", earlier), run("gtopk", now)])
    assert [r["strategy"] for r in rows] == ["gtopk", "gtopk+ef+mc+own"]
