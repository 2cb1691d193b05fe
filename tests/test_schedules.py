"""mpicomm.control.schedules: density warm-up schedules, and the strategies that follow them.

Serial tests check the values per step against the references' schedules written out by
hand (gTop-k's code, Tyagi & Swany's, Deep Gradient Compression); the multi-rank test
checks that every rank uses the same k at the same step in every sparsifying strategy and
that quantizers switch from dense to compressed exactly when the byte budget says so.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpicomm.compress.topk import k_for
from mpicomm.control import (
    BudgetRamp,
    FinalPhase,
    Schedule,
    dgc_warmup,
    exp_warmup,
    gtopk_warmup,
    linear_warmup,
    parse_finish,
    parse_schedule,
)
from mpicomm.strategies import (
    ARTopK,
    GTopK,
    PowerSGDAllreduce,
    QSGDAllgather,
    RandomKAllreduce,
    SignAllgather,
    TopKAllgather,
)

if MPI.COMM_WORLD.Get_size() > 1:
    torch.set_num_threads(1)


# ====================================================================== values per step
def test_gtopk_warmup_is_0004_for_epoch_0_then_final():
    s = gtopk_warmup(steps_per_epoch=3)
    assert s.densities(7, 0.001) == [0.004] * 3 + [0.001] * 4
    assert s.warmup_steps == 3
    # never sparser than the final density
    assert s.densities(4, 0.01) == [0.01] * 4


def test_dgc_warmup_is_exponential_one_stage_per_epoch():
    s = dgc_warmup(steps_per_epoch=2)
    assert s.densities(11, 0.001) == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                                      0.004, 0.004, 0.001, 0.001, 0.001]
    # final 0.01: the 0.004 stage is lifted to 0.01
    assert s.densities(9, 0.01)[4:] == [0.015625, 0.015625, 0.01, 0.01, 0.01]
    by_steps = dgc_warmup(length=3, unit="step")
    assert by_steps.densities(13, 0.001) == [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + \
        [0.004] * 3 + [0.001]


def test_linear_warmup_anneals_from_dense():
    s = linear_warmup(steps_per_epoch=2, length=2)  # 4 steps
    want = [1.0, 1.0 + (0.1 - 1.0) / 4, 1.0 + 2 * (0.1 - 1.0) / 4, 1.0 + 3 * (0.1 - 1.0) / 4,
            0.1, 0.1]
    np.testing.assert_allclose(s.densities(6, 0.1), want, rtol=0, atol=1e-15)
    half = linear_warmup(length=4, start=0.5, unit="step")
    np.testing.assert_allclose(half.densities(5, 0.1), [0.5, 0.4, 0.3, 0.2, 0.1], atol=1e-15)


def test_exp_warmup_falls_geometrically_to_the_final_density():
    s = exp_warmup(length=4, start=0.16, unit="step")
    # 0.16·(0.01/0.16)^(t/4): halves every step, then the final density
    np.testing.assert_allclose(s.densities(6, 0.01), [0.16, 0.08, 0.04, 0.02, 0.01, 0.01],
                               rtol=1e-12)
    # never below the final density, and a start under it is the final density throughout
    assert exp_warmup(length=3, start=0.005, unit="step").densities(4, 0.01) == [0.01] * 4
    by_epoch = parse_schedule("exp:2,0.04", steps_per_epoch=3)
    assert by_epoch.warmup_steps == 6 and by_epoch(0, 0.001) == 0.04
    assert by_epoch(6, 0.001) == 0.001
    # the whole ramp's traffic: (s - ρ)·L / ln(s/ρ) density-steps in the continuous limit
    long = exp_warmup(length=1000, start=0.03, unit="step")
    assert sum(long.densities(1000, 0.001)) == pytest.approx(
        (0.03 - 0.001) * 1000 / math.log(30), rel=0.01)


def test_budget_ramp_spends_the_same_density_steps_at_any_final_density():
    r = BudgetRamp(0.03, 9.311)
    # at 0.001 it is exp:1092,0.03@step; at 0.01 the ramp is shorter, at 0.03 absent
    assert r.steps(0.001) == 1092 and r.steps(0.01) == 511 and r.steps(0.03) == 0
    np.testing.assert_allclose([r(t, 0.001) for t in range(1093)],
                               exp_warmup(length=1092, start=0.03, unit="step").densities(
                                   1093, 0.001), rtol=1e-12)
    for final in (0.001, 0.003, 0.01):
        sent = sum(r(t, final) for t in range(r.steps(final)))
        assert sent == pytest.approx(9.311, rel=0.01), final
    assert [r(t, 0.05) for t in range(3)] == [0.05] * 3
    assert parse_schedule("ramp:0.03,9.311") == r and parse_schedule(r.spec()) == r
    for bad in ("ramp:0.03", "ramp:0.03,9@step", "ramp:0.03,-1", "ramp:2,5"):
        with pytest.raises(ValueError, match="bad schedule"):
            parse_schedule(bad, steps_per_epoch=2)


def test_final_phase_ends_denser_after_its_inner_schedule():
    ramp = BudgetRamp(0.03, 6.2)
    f = FinalPhase(0.01, 3263, ramp)
    values = [f(t, 0.001) for t in range(3626)]
    assert values[:3263] == [ramp(t, 0.001) for t in range(3263)]
    assert values[0] == 0.03 and values[3262] == 0.001 and set(values[3263:]) == {0.01}
    # never below the final density; no inner schedule: the final density before start
    assert FinalPhase(0.01, 2)(5, 0.05) == 0.05
    assert [FinalPhase(0.01, 2)(t, 0.001) for t in range(4)] == [0.001, 0.001, 0.01, 0.01]
    assert f.spec() == "ramp:0.03,6.2+finish:0.01,3263"
    assert FinalPhase(0.004, 10).spec() == "finish:0.004,10"
    assert parse_finish("finish:0.01,3263", ramp) == f
    for bad in ("finish:0.01", "finish:2,5", "finish:0.01,-1", "finish:0.01,1.5",
                "end:0.01,5"):
        with pytest.raises(ValueError, match="bad final phase"):
            parse_finish(bad)
    with pytest.raises(ValueError, match="schedule"):
        FinalPhase(0.01, 5, "ramp")
    strategy = TopKAllgather(density=0.01, schedule=FinalPhase(0.1, 3))
    ks = []
    for _ in range(5):
        strategy.aggregate([torch.randn(1000)], ["w"])
        ks.append(strategy.stats.extra["k"]["w"])
    assert ks == [10, 10, 10, 100, 100]
    assert strategy.describe()["schedule"] == "finish:0.1,3"


def test_final_phase_for_a_run_covers_its_last_fraction():
    ramp = BudgetRamp(0.03, 6.2)
    assert FinalPhase.for_run(3626, 0.01, 0.1, ramp) == FinalPhase(0.01, 3263, ramp)
    assert FinalPhase.for_run(3626, 0.01) == FinalPhase(0.01, 3263)   # a tenth by default
    assert FinalPhase.for_run(7, 0.1, 0.01).start == 6   # at least the last step
    assert FinalPhase.for_run(5, 0.1, 1.0).start == 0    # the whole run
    for steps, fraction in ((0, 0.1), (10, 0.0), (10, 1.5), (10, True)):
        with pytest.raises(ValueError, match="steps|fraction"):
            FinalPhase.for_run(steps, 0.01, fraction)
    with pytest.raises(ValueError, match="density"):
        FinalPhase.for_run(10, 0.0)


def test_relative_traffic_and_spec_round_trip():
    s = dgc_warmup(steps_per_epoch=1)
    assert s.relative_traffic(5, 0.001) == pytest.approx(
        (0.25 + 0.0625 + 0.015625 + 0.004 + 0.001) / (5 * 0.001))
    for spec in ("gtopk", "dgc", "linear:5", "linear:2,0.5", "warmup:0.1,0.03/2",
                 "dgc:20@step", "gtopk:2", "exp:7", "exp:1092,0.03@step"):
        parsed = parse_schedule(spec, steps_per_epoch=4)
        again = parse_schedule(parsed.spec(), steps_per_epoch=4)
        assert again == parsed, spec
    assert parse_schedule("none") is None and parse_schedule(None) is None
    assert parse_schedule("warmup:0.1,0.03/2", 5).densities(21, 0.01)[::10] == \
        [0.1, 0.03, 0.01]


@pytest.mark.parametrize("bad", ["dgc:x", "warmup:", "warmup:2", "cosine", "linear:0",
                                 "dgc@hour", "warmup:0.1@epochs"])
def test_bad_specs_raise(bad):
    with pytest.raises(ValueError, match="bad schedule"):
        parse_schedule(bad, steps_per_epoch=2)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="steps_per_epoch"):
        dgc_warmup()  # unit epoch without steps_per_epoch
    with pytest.raises(ValueError, match="length"):
        linear_warmup(steps_per_epoch=2, length=0)
    with pytest.raises(ValueError, match="kind"):
        Schedule("cosine", unit="step")
    with pytest.raises(ValueError, match="warm-up value"):
        Schedule("stepwise", (0.5, 0.0), unit="step")
    with pytest.raises(ValueError, match="at least one"):
        Schedule("stepwise", (), unit="step")
    s = gtopk_warmup(unit="step")
    with pytest.raises(ValueError, match="step"):
        s(-1, 0.01)
    with pytest.raises(ValueError, match="final density"):
        s(0, 0.0)


def test_strategies_reject_a_non_schedule():
    with pytest.raises(TypeError, match="schedule"):
        GTopK(density=0.01, schedule="dgc")
    with pytest.raises(ValueError, match="momentum_correction needs error_feedback"):
        TopKAllgather(density=0.01, error_feedback=False, momentum_correction=0.9)
    with pytest.raises(ValueError, match="momentum"):
        ARTopK(density=0.01, momentum_correction=1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        RandomKAllreduce(density=0.01, clip_norm=0.0)


def test_scheduled_k_and_describe_on_one_rank():
    s = dgc_warmup(steps_per_epoch=1)
    strategy = TopKAllgather(density=0.01, schedule=s)
    ks = []
    for _ in range(6):
        strategy.aggregate([torch.randn(1000)], ["w"])
        ks.append(strategy.stats.extra["k"]["w"])
    assert ks == [250, 63, 16, 10, 10, 10]
    assert strategy.describe()["schedule"] == "warmup:0.25,0.0625,0.015625,0.004"
    # k given instead of density: the warm-up never goes below k
    by_k = GTopK(k=2, schedule=s)
    ks = []
    for _ in range(5):
        by_k.aggregate([torch.randn(1000)], ["w"])
        ks.append(by_k.stats.extra["k"]["w"])
    assert ks == [250, 63, 16, 4, 2]


# ====================================================================== multi-rank
SPARSIFIERS = {
    "topk": lambda s: TopKAllgather(density=0.01, schedule=s),
    "topk-sampled": lambda s: TopKAllgather(density=0.01, sampled=True, schedule=s),
    "gtopk": lambda s: GTopK(density=0.01, schedule=s),
    "artopk": lambda s: ARTopK(density=0.01, schedule=s),
    "randomk": lambda s: RandomKAllreduce(density=0.01, schedule=s),
}


@pytest.mark.mpi
@pytest.mark.parametrize("which", list(SPARSIFIERS))
def test_every_rank_follows_the_same_schedule(comm, which):
    schedule = parse_schedule("warmup:0.2,0.05/2@step")  # 0.2, 0.2, 0.05, 0.05, 0.01..
    strategy = SPARSIFIERS[which](schedule).bind(comm)
    numel, ks = 2000, []
    for step in range(6):
        g = torch.from_numpy(np.random.default_rng(step * 31 + comm.rank).standard_normal(
            numel).astype(np.float32))
        out = strategy.aggregate([g], ["w"])[0]
        k = strategy.stats.extra["k"]["w"]
        nonzero = int((out != 0).sum())
        ks.append((k, nonzero))
    everyone = comm.allgather_object(ks)
    assert all(e == everyone[0] for e in everyone), "ranks used different k"
    want = [k_for(numel, d) for d in schedule.densities(6, 0.01)]
    if which == "topk-sampled":  # the sampled threshold keeps at most k
        assert all(k <= w for (k, _), w in zip(ks, want))
        assert ks[0][0] > ks[-1][0]
    else:
        assert [k for k, _ in ks] == want
    for k, nonzero in ks:  # the update has k entries per rank at most
        assert nonzero <= min(numel, k * comm.size)


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["qsgd", "sign", "powersgd"])
def test_quantizers_are_dense_while_the_budget_allows(comm, which):
    schedule = linear_warmup(length=4, unit="step")  # 1.0, 0.75, 0.5, 0.25, final
    strategy = {
        "qsgd": lambda: QSGDAllgather(bits=4, bucket_size=64, schedule=schedule),  # ~0.19
        "sign": lambda: SignAllgather(schedule=schedule),                          # ~0.03
        "powersgd": lambda: PowerSGDAllreduce(rank=1, schedule=schedule),           # ~0.06
    }[which]().bind(comm)
    dense_steps = []
    for step in range(6):
        rng = np.random.default_rng(step * 17 + comm.rank)
        g = torch.from_numpy(rng.standard_normal((32, 16)).astype(np.float64))
        out = strategy.aggregate([g], ["w"])[0]
        everyone = comm.allgather_object(g.numpy())
        exact = np.mean(everyone, axis=0)
        dense_steps.append(bool(np.allclose(out.numpy(), exact, rtol=1e-12, atol=1e-12)))
    # every scheduled density of steps 0-3 exceeds these strategies' wire fractions, the
    # final one (their own fraction) does not: exact for 4 steps, compressed afterwards
    assert dense_steps == [True] * 4 + [False] * 2
    assert comm.allgather_object(dense_steps) == [dense_steps] * comm.size
    if strategy.memory is not None and which != "powersgd":
        assert math.isfinite(strategy.memory.norm())


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["topk", "gtopk", "artopk"])
def test_warmup_dense_steps_where_the_sparse_collective_sends_more(comm, which):
    """``warmup_dense=True``: a warm-up step is a dense exact mean (residual flushed)
    exactly when the sparse collective at that step's k would send more bytes per rank
    than a ring allreduce, 2(P-1)/P·d·itemsize (critical-path bytes written out here)."""
    p, numel = comm.size, 512
    schedule = linear_warmup(length=4, unit="step")  # 1.0, ~0.75, ~0.5, ~0.26, final
    strategy = {"topk": TopKAllgather, "gtopk": GTopK, "artopk": ARTopK}[which](
        density=0.01, schedule=schedule, warmup_dense=True).bind(comm)
    p2 = 1 << (p.bit_length() - 1)
    lg = math.ceil(math.log2(p)) if p > 1 else 0
    per_k = {"topk": (p - 1) * 12,                                  # allgather of k pairs
             "gtopk": (p2.bit_length() - 1 + 2 * (p != p2)) * 12,   # butterfly of k pairs
             "artopk": lg * 4 + 2 * (p - 1) / p * 8}[which]         # bcast idx + ring vals
    dense_bytes = 2 * (p - 1) / p * numel * 8
    want, got = [], []
    residual = np.zeros(numel)
    for step in range(6):
        rng = np.random.default_rng(step * 13 + comm.rank)
        g = torch.from_numpy(rng.standard_normal(numel))
        k = k_for(numel, schedule(step, 0.01))
        want.append(p > 1 and step < 4 and k * per_k > dense_bytes)
        before = strategy.stats.extra.get("dense_steps", 0)
        out = strategy.aggregate([g], ["w"])[0].numpy()
        is_dense = strategy.stats.extra.get("dense_steps", 0) == before + 1
        got.append(is_dense)
        exact = np.mean(comm.allgather_object(g.numpy() + residual), axis=0)
        residual = strategy.residual("w").numpy().copy()
        if is_dense:  # the exact mean of the compensated gradients, residual flushed
            np.testing.assert_allclose(out, exact, rtol=1e-12, atol=1e-12)
            assert not residual.any()
        else:  # sparse: k entries per rank at most
            assert np.count_nonzero(out) <= k * p
    assert got == want
    assert comm.allgather_object(got) == [got] * p
    if p >= 3:  # at 3+ ranks the first (dense) steps are dense, the last ones sparse
        assert got[0] and not got[-1]
    assert strategy.describe()["warmup_dense"] is True


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["topk", "gtopk", "artopk"])
def test_flush_every_sends_every_hth_step_densely_and_empties_the_residual(comm, which):
    """``flush_every=3``: steps 2 and 5 are the exact mean of the compensated buffers
    with the residual flushed; the others are sparse (k entries per rank at most)."""
    p, numel = comm.size, 300
    strategy = {"topk": TopKAllgather, "gtopk": GTopK, "artopk": ARTopK}[which](
        density=0.01, flush_every=3).bind(comm)
    k = k_for(numel, 0.01)
    residual = np.zeros(numel)
    got = []
    for step in range(6):
        rng = np.random.default_rng(step * 7 + comm.rank)
        g = torch.from_numpy(rng.standard_normal(numel))
        out = strategy.aggregate([g], ["w"])[0].numpy()
        exact = np.mean(comm.allgather_object(g.numpy() + residual), axis=0)
        residual = strategy.residual("w").numpy().copy()
        got.append(strategy.stats.extra.get("dense_steps", 0))
        if step % 3 == 2:
            np.testing.assert_allclose(out, exact, rtol=1e-12, atol=1e-12)
            assert not residual.any()
        else:
            assert np.count_nonzero(out) <= k * p
            if p > 1:
                assert residual.any()
    assert got == [0, 0, 1, 1, 1, 2]
    assert strategy.describe()["flush_every"] == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_flush_every_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="flush_every"):
        GTopK(density=0.01, flush_every=bad)
