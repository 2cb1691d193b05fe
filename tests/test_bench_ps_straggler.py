"""``bench ps``: the straggler models (fixed, random) and the time-to-target section with
seeds and medians. Serial tests of the pause schedule and the summary; a multi-rank run
of the section on the digits MLP (a few steps, wall clock: what is checked is which steps
were slow and what the rows hold, not times)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from mpicomm.bench import ps as bench
from mpicomm.bench import straggler
from mpicomm.bench._util import UsageError


def pause(model: str, worker: int, workers: int = 3, **kw) -> straggler.StragglerPause:
    return straggler.StragglerPause(model, worker, workers, 0.010, 3.0, **kw)


def test_fixed_straggler_is_worker_zero_at_every_step():
    slow, fast = pause("fixed", 0), pause("fixed", 2)
    assert [slow() for _ in range(5)] == pytest.approx([0.030] * 5)
    assert [fast() for _ in range(5)] == pytest.approx([0.010] * 5)
    assert (slow.slow_steps, fast.slow_steps) == (5, 0)


def test_random_straggler_is_seeded_per_worker_and_hits_p():
    a, b = pause("random", 1, seed=4), pause("random", 1, seed=4)
    seq = [a() for _ in range(3000)]
    assert seq == [b() for _ in range(3000)]          # the same on every run
    assert set(np.round(seq, 6)) == {0.010, 0.030}
    assert a.p == pytest.approx(1 / 3)                # default: 1/W
    assert a.slow_steps / 3000 == pytest.approx(1 / 3, abs=0.03)
    other = pause("random", 2, seed=4)
    assert [other() for _ in range(3000)] != seq      # workers draw independently
    reseeded = pause("random", 1, seed=5)
    assert [reseeded() for _ in range(3000)] != seq
    never, always = pause("random", 0, p=0.0), pause("random", 0, p=1.0)
    assert {never() for _ in range(50)} == {0.010}
    assert {always() for _ in range(50)} == {0.030}


@pytest.mark.parametrize("kw, message", [
    (dict(model="sometimes"), "straggler model must be one of fixed, random"),
    (dict(model="random", p=1.5), "--straggler-p must be in [0, 1]"),
])
def test_bad_straggler_settings_are_one_clear_error(kw, message):
    model = kw.pop("model")
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        pause(model, 0, **kw)


def test_option_parsers_reject_bad_lists():
    assert straggler.parse_stragglers("fixed, random") == ["fixed", "random"]
    assert straggler.parse_seeds("0,1,2") == [0, 1, 2]
    assert straggler.parse_options("channels=32") == {"channels": 32}
    for parse, text in ((straggler.parse_stragglers, "fixed,slowly"),
                        (straggler.parse_stragglers, ""), (straggler.parse_seeds, "0,x"),
                        (straggler.parse_seeds, "-1"), (straggler.parse_options, "channels")):
        with pytest.raises(UsageError):
            parse(text)


def test_server_sgd_settings_are_checked():
    straggler.check_sgd(0.05, 0.9)
    straggler.check_sgd(0.1, 0.0)
    for lr, momentum, message in ((0.0, 0.0, "--conv-lr"), (float("nan"), 0.0, "--conv-lr"),
                                  (0.1, 1.0, "--conv-momentum"),
                                  (0.1, -0.1, "--conv-momentum")):
        with pytest.raises(UsageError, match=message):
            straggler.check_sgd(lr, momentum)


def _row(kind, seed, mode, t, pushes, rate):
    return {"straggler": kind, "seed": seed, "mode": mode, "time_to_target_s": t,
            "pushes_to_target": pushes, "pushes_per_s": rate, "best_accuracy": 0.9,
            "max_staleness": 2}


def test_summary_takes_medians_over_seeds_and_splits_the_ratio():
    rows = [_row("random", s, m, t, p, r) for s, m, t, p, r in (
        (0, "sync", 3.0, 300, 100), (1, "sync", 5.0, 310, 90), (2, "sync", 4.0, 320, 80),
        (0, "async", 2.0, 400, 200), (1, "async", None, None, 190), (2, "async", 3.0, 420, 210),
        (0, "ssp(s=2)", 2.0, 300, 150), (1, "ssp(s=2)", 2.5, 330, 150),
        (2, "ssp(s=2)", 1.5, 310, 160))]
    summary = straggler.convergence_summary(rows)
    assert [g["mode"] for g in summary] == ["sync", "async", "ssp(s=2)"]
    sync, asy, ssp = summary
    assert (sync["time_to_target_s"], sync["reached"]) == (4.0, 3)
    assert (asy["time_to_target_s"], asy["reached"], asy["pushes_to_target"]) == (2.5, 2, 410)
    assert ssp["bsp/ssp"] == pytest.approx(2.0)
    assert ssp["async/ssp"] == pytest.approx(1.25)
    assert ssp["pushes_ratio"] == pytest.approx(310 / 410)
    assert ssp["rate_ratio"] == pytest.approx(200 / 150)


def test_target_from_bsp_and_the_first_point_that_reaches_it():
    curve = [[0.1, 10, 0.3, 30], [0.2, 20, 0.5, 60], [0.3, 30, 0.45, 90],
             [0.4, 40, 0.7, 120]]
    rows = [{"mode": "sync", "curve": curve},
            {"mode": "sync", "curve": [[0.1, 10, 0.2, 30], [0.2, 20, 0.6, 60],
                                       [0.3, 30, 0.4, 90], [0.4, 40, 0.9, 120]]},
            {"mode": "async", "curve": [[0.05, 10, 0.55, 25]]}]
    assert straggler.conv_target("0.42", rows) == 0.42
    # the best by 75% of 40 steps (30): 0.5 and 0.6; the lowest of them
    assert straggler.conv_target("bsp:0.75", rows) == 0.5
    straggler.reach(rows, 0.5)
    assert [(r["time_to_target_s"], r["pushes_to_target"]) for r in rows] == [
        (0.2, 60), (0.2, 60), (0.05, 25)]
    straggler.reach(rows, 0.95)
    assert {r["time_to_target_s"] for r in rows} == {None}
    for bad in ("bsp:0", "bsp:1.5", "soon"):
        with pytest.raises(UsageError, match="--target"):
            straggler.parse_target(bad)


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--compute-ms", "1", "--conv-steps", "6", "--conv-eval", "2",
                              "--target", "0.2", "--stragglers", "random,fixed",
                              "--seeds", "3"])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


@pytest.mark.mpi
def test_time_to_target_runs_every_model_seed_and_mode(comm, monkeypatch):
    """At ``P`` ranks (``P - 1`` workers, one server): a row per model and mode,
    the same on every rank; a BSP run's slow steps are exactly the random draws of its
    workers for its steps; the summary holds the medians; every store gets the servers'
    SGD settings of the command line."""
    args = _args(conv_lr=0.07, conv_momentum=0.5)
    stores = []
    store = bench._store

    def spy(comm, servers, **kw):
        stores.append(kw)
        return store(comm, servers, **kw)

    monkeypatch.setattr(bench, "_store", spy)
    if comm.size < 2:   # one rank: the pause schedule alone, identical on every rank
        draws = [pause("random", 0, seed=3)() for _ in range(6)]
        assert draws == [pause("random", 0, seed=3)() for _ in range(6)]
        return
    rows, summary = bench.bench_convergence(args, comm)
    assert comm.allgather_object(len(rows)) == [6] * comm.size
    assert [(r["straggler"], r["seed"], r["mode"]) for r in rows] == [
        (k, 3, m) for k in ("random", "fixed") for m in ("sync", "async", "ssp(s=2)")]
    workers = comm.size - 1
    for r in rows:
        assert r["workers"] == workers and r["workload"] == "digits-mlp"
        assert r["curve"] and all(len(p) == 4 for p in r["curve"])
        assert r["max_staleness"] <= (2 if r["mode"].startswith("ssp") else
                                      0 if r["mode"] == "sync" else 10 ** 6)
        if r["mode"] != "sync":
            continue
        pushes = workers * args.conv_steps
        if r["straggler"] == "fixed":
            want = args.conv_steps
        else:
            want = sum(sum(bool(d) for d in _draws(w, workers, r["seed"], args.conv_steps))
                       for w in range(workers))
        assert r["slow_share"] * pushes == pytest.approx(want)
    assert [(kw["mode"], kw["lr"], kw["momentum"]) for kw in stores] == [
        (m, 0.07, 0.5) for _ in ("random", "fixed") for m in ("sync", "async", "ssp")]
    assert [(g["straggler"], g["mode"], g["seeds"]) for g in summary] == [
        (k, m, 1) for k in ("random", "fixed") for m in ("sync", "async", "ssp(s=2)")]


def _draws(worker: int, workers: int, seed: int, steps: int) -> list[bool]:
    p = pause("random", worker, workers, seed=seed)
    return [p.slow() for _ in range(steps)]


def test_configured_link_is_the_emulated_clusters_rate_and_delay(monkeypatch):
    """On the emulated cluster the push + pull bound is also read from the link as
    configured (the fitted beta of a ``tc`` link is too fast: its bucket lets bursts
    through); elsewhere, and on an unshaped link, there is none."""
    from mpicomm.collectives.cost import CostParams, ps_push_pull

    fitted = CostParams(alpha=150e-6, beta=1 / 0.22e9, gamma=1 / 40e9)
    for var in ("MPICOMM_EMU_HOSTS", "MPICOMM_EMU_RATE", "MPICOMM_EMU_DELAY"):
        monkeypatch.delenv(var, raising=False)
    assert bench.configured_link(fitted) is None
    monkeypatch.setenv("MPICOMM_EMU_HOSTS", "2")
    monkeypatch.setenv("MPICOMM_EMU_RATE", "unshaped")
    assert bench.configured_link(fitted) is None
    monkeypatch.setenv("MPICOMM_EMU_RATE", "1gbit")
    monkeypatch.setenv("MPICOMM_EMU_DELAY", "0.0001")
    link = bench.configured_link(fitted)
    assert (link.alpha, link.beta, link.gamma) == (1e-4, 8e-9, 0.0)
    n = 1 << 20   # 1 MiB each way at 1 Gbit/s: 8.39 ms, plus 0.1 ms of delay each way
    assert ps_push_pull(n, 1, 1, link) == pytest.approx(2 * (1e-4 + n * 8e-9))
