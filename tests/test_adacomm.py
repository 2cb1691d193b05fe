"""AdaComm, the controller of Local SGD's communication period: serial tests
(``-m "not mpi"``) of its rule, decision intervals, clamps, drift-noise variant and
argument checks, and of ``initial_period``; multi-rank tests (``@pytest.mark.mpi``) of
AdaComm inside ``LocalSGD`` (one decision on every rank, replayed from the losses, the
replicas' spread as drift, wall-clock intervals) and of ``platform_period`` on a declared
virtual platform; a child job runs ``bench localsgd --tau0 auto``.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from mpicomm.control import AdaComm, initial_period
from mpicomm.control.adacomm import adacomm_period
from mpicomm.torch import LocalSGD

from .launch import run_job

torch.set_num_threads(1)


# ====================================================================== AdaComm (serial)
def test_rule_matches_formula():
    for tau0, f, f0, lr, lr0, p, finf in [(16, 0.5, 2.0, 0.1, 0.1, 1.0, 0.0),
                                           (10, 1.3, 2.3, 0.01, 0.1, 1.5, 0.2),
                                           (7, 3.0, 2.0, 0.1, 0.1, 1.0, 0.0)]:
        tau, raw = adacomm_period(tau0, f, f0, lr, lr0, lr_exponent=p, f_inf=finf)
        expected = tau0 * math.sqrt((lr0 / lr) ** p * (f - finf) / (f0 - finf))
        assert raw == pytest.approx(expected, rel=1e-15)
        assert tau == math.ceil(expected)


@pytest.mark.parametrize("step_s, round_s, reference, expected",
                         [(1e-3, 10.4926e-3, 32, 104), (1e-3, 1.0556e-3, 32, 33),
                          (1.0, 1.0, 32, 32), (1.0, 4.0, 8, 16), (2.0, 0.5, 32, 16),
                          (1.0, 0.0, 32, 1), (1.0, 1e-6, 32, 1), (1.0, 2.0, 1.5, 3)])
def test_initial_period_scales_the_reference_with_the_root_of_the_round_time(
        step_s, round_s, reference, expected):
    """tau0 = ceil(reference * sqrt(D/Y)), at least 1: 100x the round time, 10x the
    period."""
    tau = initial_period(step_s, round_s, reference)
    assert tau == expected
    assert tau - 1 < max(1.0, reference * math.sqrt(round_s / step_s)) <= tau + 1e-9
    if round_s > 0:
        assert initial_period(step_s, 100 * round_s, reference) == \
            math.ceil(10 * reference * math.sqrt(round_s / step_s) - 1e-9)


@pytest.mark.parametrize("args, message", [((0.0, 1.0), "step_s > 0"), ((1.0, -1.0), "round_s"),
                                           ((1.0, 1.0, 0.5), "reference"),
                                           ((1.0, float("nan")), "finite")])
def test_initial_period_rejects_bad_times(args, message):
    with pytest.raises(ValueError, match=message):
        initial_period(*args)


def test_tau_is_at_least_one_and_clamped():
    rng = np.random.default_rng(0)
    ada = AdaComm(5, interval_rounds=1, f_inf=0.1)
    ada.start(2.0, 0.1)
    for _ in range(200):
        loss = float(rng.choice([0.0, 0.1, 1e-300, rng.uniform(-5, 5)]))
        lr = float(10 ** rng.uniform(-6, 3))
        assert ada.observe(loss, lr) >= 1
    assert min(d.tau for d in ada.history) == 1  # reached: losses at/below f_inf
    clamped = AdaComm(8, interval_rounds=1, tau_min=3, tau_max=12)
    clamped.start(1.0, 0.1)
    assert clamped.observe(1e-9, 0.1) == 3
    assert clamped.observe(1.0, 1e-6) == 12


def test_fixed_lr_falling_loss_never_grows_tau():
    rng = np.random.default_rng(1)
    for trial in range(20):
        losses = np.sort(rng.uniform(0.01, 3.0, size=50))[::-1]
        ada = AdaComm(int(rng.integers(1, 64)), interval_rounds=1,
                      lr_exponent=float(rng.choice([0.0, 1.0, 1.5])))
        ada.start(float(losses[0]), 0.05)
        taus = [ada.observe(float(f), 0.05) for f in losses[1:]]
        assert all(b <= a for a, b in zip(taus, taus[1:])), (trial, taus)
        assert taus[-1] <= ada.tau0
    ada = AdaComm(32, interval_rounds=1)
    ada.start(3.0, 0.05)
    assert ada.observe(0.03, 0.05) < 32  # it does shrink (the check above can fail)


@pytest.mark.parametrize("p, expected", [(1.0, 100 * math.sqrt(10)), (1.5, 100 * 10 ** 0.75),
                                         (0.0, 100.0)])
def test_lr_drop_multiplies_tau(p, expected):
    ada = AdaComm(100, interval_rounds=1, lr_exponent=p)
    ada.start(2.0, 0.1)
    tau = ada.observe(2.0, 0.01)  # same loss, lr / 10
    assert abs(tau - expected) <= 1
    assert tau == math.ceil(expected - 1e-9)
    if p == 1.0:
        assert 315 <= tau <= 317


def test_bench_starts_adacomm_at_the_platforms_initial_period(tmp_path):
    """``bench localsgd --tau0 auto``: AdaComm's first period is initial_period(Y, D) of
    the declared platform, recorded in the result; a bad value is one usage error."""
    out = tmp_path / "auto.json"
    args = [sys.executable, "-m", "mpicomm.bench", "localsgd", "--workload", "digits-mlp",
            "--hidden", "8", "--clock", "model", "--step-ms", "0.2", "--rate-gbit", "1",
            "--latency-us", "50", "--budget-s", "0.03", "--taus", "4", "--seeds", "1",
            "--schedules", "fixed", "--eval-every", "4", "--tau0", "auto"]
    result = run_job(2, [*args, "--json", str(out)], timeout=240)
    assert result.returncode == 0, result.output
    res = json.loads(out.read_text())
    assert res["tau0"] == initial_period(res["step_s"], res["delay_s"]) > 1
    (ada,) = [c for c in res["curves"] if c["method"] == "adacomm"]
    assert ada["adacomm"][0]["tau"] == res["tau0"]
    bad = run_job(2, [*args[:-1], "0"], timeout=120)
    assert bad.returncode != 0 and bad.output.count("--tau0 must be") == 1, bad.output


def test_interval_rounds_semantics():
    ada = AdaComm(16, interval_rounds=3)
    ada.start(4.0, 0.1)
    taus = []
    for r in range(1, 10):
        boundary = ada.due()
        assert boundary == (r % 3 == 0)
        loss = 4.0 / (r + 1)
        taus.append(ada.observe(loss if boundary else None, 0.1 if boundary else None))
    assert taus[:2] == [16, 16] and taus[2] == math.ceil(16 * math.sqrt(1 / 4))
    assert taus[3:5] == [taus[2]] * 2
    assert [d.round for d in ada.history] == [0, 3, 6, 9]
    assert ada.rounds == 9
    one = AdaComm(4, interval_rounds=1)
    one.start(1.0, 0.1)
    with pytest.raises(ValueError, match="ends an interval"):
        one.observe()


def test_interval_s_semantics():
    ada = AdaComm(16, interval_s=1.0)
    ada.start(4.0, 0.1, elapsed=0.5)
    seen = []
    for elapsed in (0.7, 1.2, 1.5, 2.6, 3.0, 3.6, 3.61):
        boundary = ada.due(elapsed)
        ada.observe(1.0, 0.1, elapsed=elapsed)
        seen.append(boundary)
    # boundaries: 1.5 (>= 0.5+1), then the interval restarts at 1.5: 2.6, then 3.6
    assert seen == [False, False, True, True, False, True, False]
    assert [d.elapsed for d in ada.history] == [0.5, 1.5, 2.6, 3.6]
    with pytest.raises(ValueError, match="elapsed"):
        ada.observe(1.0, 0.1)


def test_history_and_period_for():
    ada = AdaComm(10, interval_rounds=2, lr_exponent=1.0)
    with pytest.raises(RuntimeError):
        ada.period_for(1.0, 0.1)
    ada.start(2.0, 0.1)
    assert ada.period_for(0.5, 0.1) == 5
    assert ada.tau == 10  # period_for does not change state
    ada.observe()
    ada.observe(0.5, 0.1)
    last = ada.history[-1]
    assert (last.round, last.loss, last.lr, last.tau) == (2, 0.5, 0.1, 5)
    assert last.raw == pytest.approx(5.0)
    with pytest.raises(RuntimeError):
        ada.start(2.0, 0.1)


@pytest.mark.parametrize("kwargs, exc", [
    ({"tau0": 0, "interval_rounds": 1}, ValueError),
    ({"tau0": 2.5, "interval_rounds": 1}, TypeError),
    ({"tau0": 4}, ValueError),                                   # neither interval
    ({"tau0": 4, "interval_s": 1.0, "interval_rounds": 2}, ValueError),  # both
    ({"tau0": 4, "interval_s": 0.0}, ValueError),
    ({"tau0": 4, "interval_s": float("nan")}, ValueError),
    ({"tau0": 4, "interval_rounds": 0}, ValueError),
    ({"tau0": 4, "interval_rounds": 1, "lr_exponent": -0.5}, ValueError),
    ({"tau0": 4, "interval_rounds": 1, "tau_min": 0}, ValueError),
    ({"tau0": 4, "interval_rounds": 1, "tau_min": 3, "tau_max": 2}, ValueError),
    ({"tau0": 20, "interval_rounds": 1, "tau_max": 16}, ValueError),
    ({"tau0": 4, "interval_rounds": 1, "f_inf": float("inf")}, ValueError),
])
def test_adacomm_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        AdaComm(**kwargs)


def test_adacomm_drift_noise_cancels_a_noise_that_falls_with_the_loss():
    """noise="drift": when the measured noise sigma^2 = drift / lr^2 falls in proportion
    to the loss, the period stays at the first decision's; with the noise constant it is
    the paper's rule; the first decision is the paper's either way."""
    paper, drift, still = (AdaComm(32, interval_rounds=1, noise=n)
                           for n in ("constant", "drift", "drift"))
    for a in (paper, drift, still):
        a.start(2.0, 0.1)
    lr = 0.1
    for loss in (1.0, 0.5, 0.1, 0.02):
        p = paper.observe(loss, lr)
        d = drift.observe(loss, lr, drift=3e-4 * loss * lr ** 2)   # sigma^2 = 3e-4 F
        c = still.observe(loss, lr, drift=1e-5 * lr ** 2)           # sigma^2 constant
        assert p == math.ceil(32 * math.sqrt(loss / 2.0)) == c
        assert d == math.ceil(32 * math.sqrt(1.0 / 2.0))
        assert drift.history[-1].noise == pytest.approx(3e-4 * loss)
    assert [h.tau for h in paper.history][-1] == 4 and drift.tau == 23
    assert paper.history[-1].noise is None and drift.noise_ref == pytest.approx(3e-4)
    # drift 0 (the replicas never moved) keeps the paper's ratio at that decision
    assert drift.observe(0.02, lr, drift=0.0) == 4


def test_adacomm_drift_bad_input():
    with pytest.raises(ValueError, match="noise must be one of"):
        AdaComm(4, interval_rounds=1, noise="smooth")
    ada = AdaComm(4, interval_rounds=1, noise="drift")
    ada.start(1.0, 0.1)
    with pytest.raises(ValueError, match="needs drift"):
        ada.observe(0.5, 0.1)
    with pytest.raises(ValueError, match="drift must be >= 0"):
        ada.observe(0.5, 0.1, drift=-1.0)
    with pytest.raises(TypeError, match="drift must be a real number"):
        ada.observe(0.5, 0.1, drift="x")


def test_adacomm_bad_observations():
    ada = AdaComm(4, interval_rounds=1, f_inf=0.5)
    with pytest.raises(ValueError, match="F0"):
        ada.start(0.5, 0.1)  # F0 <= f_inf
    with pytest.raises(ValueError, match="lr"):
        ada.start(1.0, 0.0)
    with pytest.raises(ValueError, match="finite"):
        ada.start(float("nan"), 0.1)
    ada.start(1.0, 0.1)
    with pytest.raises(ValueError, match="finite"):
        ada.observe(float("inf"), 0.1)


# ====================================================================== AdaComm (multi-rank)
def _run_synthetic(local: LocalSGD, opt, steps: int, lr_drop_at: int | None = None):
    """Drive ``local`` with synthetic per-rank losses; return the steps that averaged."""
    averaged = []
    for t in range(steps):
        if t == lr_drop_at:
            for g in opt.param_groups:
                g["lr"] /= 10
        loss = 8.0 / (1 + t) + 0.25 * local.comm.rank
        if local.step(torch.tensor(loss, dtype=torch.float64)):
            averaged.append(t)
    return averaged


@pytest.mark.mpi
def test_adacomm_in_localsgd_rounds(comm):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ada = AdaComm(8, interval_rounds=2)
    local = LocalSGD(model, ada, opt, comm=comm)
    averaged = _run_synthetic(local, opt, 160, lr_drop_at=80)
    hist = local.history
    assert comm.allgather_object(hist) == [hist] * comm.size  # identical decisions
    # replay: F_0 is the rank-mean of the first step's loss; a decision at averaging round
    # k is fed the rank-mean of each rank's mean loss over window k-1 (0-based)
    shift = 0.25 * (comm.size - 1) / 2
    windows = [averaged[0] + 1] + [b - a for a, b in zip(averaged, averaged[1:])]
    starts = [0] + [a + 1 for a in averaged]
    f = [np.mean([8.0 / (1 + t) for t in range(s, s + w)]) + shift
         for s, w in zip(starts, windows)]
    assert (hist[0].round, hist[0].tau, hist[0].lr) == (0, 8, 0.1)
    assert hist[0].loss == pytest.approx(8.0 + shift, rel=1e-12)
    assert [d.round for d in hist[1:]] == list(range(2, len(averaged) + 1, 2))
    for d in hist[1:]:
        assert d.loss == pytest.approx(f[d.round - 1], rel=1e-12)
        assert d.tau == max(1, math.ceil(8 * math.sqrt((0.1 / d.lr) * d.loss / hist[0].loss)))
    # the period in force is what separates averaging steps
    taus = {d.round: d.tau for d in hist[1:]}
    tau = 8
    for r, w in enumerate(windows):
        assert w == tau, (r, w, tau)
        tau = taus.get(r + 1, tau)
    assert hist[1].tau < 8  # loss fell: communicate more often
    after_drop = [d for d in hist if d.lr < 0.05]
    before_drop = [d for d in hist if d.lr > 0.05]
    assert after_drop and after_drop[0].tau > before_drop[-1].tau  # lr drop: tau jumps up


@pytest.mark.mpi
def test_adacomm_drift_is_the_replicas_spread_per_step(comm):
    """LocalSGD with AdaComm(noise="drift") feeds the rule mean_i ||x_i - xbar||^2 / tau
    (here computed directly from every rank's replica before the averaging), the same on
    every rank."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    local = LocalSGD(model, AdaComm(3, interval_rounds=1, noise="drift"), opt, comm=comm)
    gen = torch.Generator().manual_seed(100 + comm.rank)
    want = []
    for _ in range(30):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        tau = local.period
        if local.steps_since_average + 1 == tau:   # this step averages: read x_i first
            mine = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
            every = torch.stack(comm.allgather_object(mine))
            spread = float((every - every.mean(0)).pow(2).sum(1).mean()) / tau
            want.append(spread / 0.05 ** 2)
        local.step(loss)
    hist = local.history
    assert comm.allgather_object(hist) == [hist] * comm.size
    got = [h.noise for h in hist[1:]]
    assert len(got) == len(want) >= 3, got
    if comm.size == 1:   # one replica: no spread, the paper's rule
        assert got == [None] * len(want)
    else:
        # float32 averaging: ||xbar||^2 is off by ~eps32 ||x||^2 against the float64 mean
        assert got == pytest.approx(want, rel=1e-3)
        assert all(g > 0 for g in got)


@pytest.mark.mpi
def test_adacomm_wall_clock_intervals_agree(comm):
    """Rank clocks disagree; the agreed elapsed (max over ranks) gives one decision."""
    now = [0.0]
    rate = 1 + 0.01 * comm.rank  # rank clocks run at different speeds

    def clock():
        return now[0] * rate

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSGD(model, AdaComm(4, interval_s=1.0), opt, comm=comm, clock=clock)
    for t in range(60):
        now[0] += 0.1
        local.step(5.0 / (1 + t) + comm.rank)
    hist = local.history
    assert len(hist) >= 3
    assert comm.allgather_object(hist) == [hist] * comm.size
    for a, b in zip(hist[1:], hist[2:]):
        assert b.elapsed - a.elapsed >= 1.0 - 1e-9
    # the agreed elapsed is the fastest clock's (rank size-1), read at the first step
    assert hist[0].elapsed == pytest.approx(0.1 * (1 + 0.01 * (comm.size - 1)), rel=1e-12)


@pytest.mark.mpi
def test_platform_period_on_a_declared_virtual_platform(comm):
    """``platform_period`` under the virtual clock: ``Y`` is the declared step, ``D`` the
    network model's averaging round (the cost model's allreduce of the parameters),
    ``tau0 = initial_period(Y, D)``, the same on every rank; one rank has no round."""
    from mpicomm import clock
    from mpicomm.bench.harness import Spec
    from mpicomm.bench.localsgd import platform_period
    from mpicomm.collectives import cost
    from mpicomm.costtable import CostTable, OpCost
    from mpicomm.emulate.vnet import platform_from_env

    plat = platform_from_env(comm.size, {"MPICOMM_VIRTUAL_RATE": "100mbit",
                                         "MPICOMM_VIRTUAL_DELAY": "1ms"})
    table = CostTable({op: OpCost(0.0, 0.0, "byte") for op in ("reduce", "copy")})
    spec = Spec(workload="digits-mlp", options={"hidden": 16, "layers": 1}, batch=16,
                lr=0.05, momentum=0.9, weight_decay=0.0, epoch_stats=False)
    with clock.session(plat, table):
        sub = comm.dup()   # a communicator the virtual clock times
        sub.check = False
        try:
            for op, ms in (("forward", 0.2), ("backward", 0.5), ("optimizer", 0.3)):
                clock.declare(op, ms * 1e-3)
            tau0, step_s, round_s = platform_period(spec, sub, algorithm="ring")
        finally:
            sub.free()
    assert step_s == pytest.approx(1e-3)
    assert tau0 == initial_period(step_s, round_s)
    assert comm.allgather_object((tau0, step_s, round_s)) == [(tau0, step_s, round_s)] * comm.size
    if comm.size == 1:
        assert round_s < 1e-9 and tau0 == 1
        return
    nbytes = 4 * (64 * 16 + 16 + 16 * 10 + 10)   # the MLP 64-16-10's parameters, float32
    params = cost.CostParams(alpha=1e-3, beta=1 / 12.5e6)
    predicted = cost.predict("allreduce", "ring", nbytes, comm.size, params)
    assert round_s == pytest.approx(predicted, rel=0.02)
