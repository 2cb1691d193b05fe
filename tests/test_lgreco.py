"""L-GreCo: the per-layer DP against brute force and its input checks, the Top-k tail
errors it weighs, the Top-k, QSGD and PowerSGD families fitting the error budget with less
than the uniform setting, and, on several ranks, rank 0's assignment used everywhere and
what ``AutoStrategy(lgreco=True)`` puts on the wire in fused buckets."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from mpicomm.collectives.cost import CostParams
from mpicomm.control import LGreco, lgreco_solve
from mpicomm.strategies.lgreco_errors import LayerErrors, layer_shape, topk_tail_errors

from .auto_runs import ZERO, train_auto


# ---------------------------------------------------------------------- L-GreCo
def brute(sizes, errors, budget, buckets):
    unit = budget / buckets
    best = None
    for picks in itertools.product(*[range(len(s)) for s in sizes]):
        units = [max(1, math.ceil(errors[l][j] / unit)) for l, j in enumerate(picks)]
        if sum(units) > buckets:
            continue
        size = sum(sizes[l][j] for l, j in enumerate(picks))
        if best is None or size < best:
            best = size
    return best


@pytest.mark.parametrize("seed", range(40))
def test_lgreco_dp_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    layers, cands = rng.randint(1, 6), rng.randint(1, 4)
    sizes = [[rng.randint(1, 50) for _ in range(cands)] for _ in range(layers)]
    errors = [[rng.uniform(0.0, 5.0) for _ in range(cands)] for _ in range(layers)]
    budget = sum(min(e) for e in errors) + rng.uniform(0.5, 6.0)
    buckets = rng.choice([20, 100, 1000])
    expected = brute(sizes, errors, budget, buckets)
    if expected is None:
        with pytest.raises(ValueError, match="budget"):
            lgreco_solve(sizes, errors, budget, buckets)
        return
    picks = lgreco_solve(sizes, errors, budget, buckets)
    assert len(picks) == layers
    assert sum(sizes[l][j] for l, j in enumerate(picks)) == expected
    assert sum(errors[l][j] for l, j in enumerate(picks)) <= budget + 1e-12


def test_lgreco_solve_input_checks():
    assert lgreco_solve([], [], 1.0) == []
    assert lgreco_solve([[3, 1]], [[0.1, float("inf")]], 1.0) == [0]
    with pytest.raises(ValueError, match="layers"):
        lgreco_solve([[1]], [], 1.0)
    with pytest.raises(ValueError, match="budget"):
        lgreco_solve([[1]], [[1]], 0.0)
    with pytest.raises(ValueError, match="equal"):
        lgreco_solve([[1, 2]], [[1]], 1.0)


def test_topk_tail_error_is_exact_and_non_increasing():
    a = torch.tensor([3.0, -4.0, 1.0, 0.5])
    errs = topk_tail_errors(a, [1, 2, 3, 4])
    assert errs == pytest.approx([math.sqrt(9 + 1 + 0.25), math.sqrt(1.25), 0.5, 0.0])


def test_lgreco_per_layer_budget_beats_uniform_at_the_same_error():
    """Layers with very different gradient spectra: the DP moves density to where it
    buys the most error, total size <= uniform and total error <= uniform's."""
    gen = torch.Generator().manual_seed(0)
    lg = LayerErrors(LGreco(0.05, every=10, acc_steps=2))
    numels = {"flat": 4000, "peaky": 4000, "mid": 2000}
    for _ in range(2):
        lg.accumulate("flat", torch.randn(4000, generator=gen) * 0.01)
        peaky = torch.zeros(4000)
        peaky[:50] = torch.randn(50, generator=gen) * 10
        lg.accumulate("peaky", peaky + torch.randn(4000, generator=gen) * 0.001)
        lg.accumulate("mid", torch.randn(2000, generator=gen) ** 3)
    decision = lg.solve(numels)
    assert decision["error"] <= decision["budget"] + 1e-9
    assert decision["size"] <= decision["uniform_size"]
    assert decision["size"] < 0.8 * decision["uniform_size"]
    assert decision["densities"]["peaky"] < 0.05  # its mass sits in 50 entries


def _lgreco_layers(lg, gen, scale=1.0):
    """Four layers with different spectra: iid noise, a fixed rank-2 matrix, a cubed
    (heavy-tailed) matrix and a bias vector."""
    u, v = torch.randn(48, 2, generator=gen), torch.randn(2, 40, generator=gen)
    for _ in range(lg.lgreco.acc_steps):
        lg.accumulate("flat", torch.randn(48 * 40, generator=gen) * 0.01 * scale)
        lg.accumulate("lowrank", (u @ v).reshape(-1) * scale
                      + torch.randn(48 * 40, generator=gen) * 1e-3)
        lg.accumulate("heavy", torch.randn(32 * 60, generator=gen) ** 3 * scale)
        lg.accumulate("bias", torch.randn(48, generator=gen) * scale)
    return {"flat": (48, 40), "lowrank": (48, 40), "heavy": (32, 60), "bias": 48}


@pytest.mark.parametrize(("family", "default"), [("topk", 0.05), ("qsgd", 4),
                                                 ("powersgd", 4)])
def test_lgreco_families_fit_the_budget_and_beat_uniform(family, default):
    lg = LayerErrors(LGreco(default, family=family, every=4, acc_steps=2))
    shapes = _lgreco_layers(lg, torch.Generator().manual_seed(3))
    layers, sizes, errors, cands = lg.problem(shapes)
    assert default in cands and len(cands) >= 3
    decision = lg.solve(shapes)
    uniform = cands.index(default)
    assert decision["budget"] == pytest.approx(sum(e[uniform] for e in errors))
    assert decision["error"] <= decision["budget"] * (1 + 1e-9)
    assert decision["size"] < decision["uniform_size"]
    # sizes are the project's compressor's wire bytes at the chosen settings
    if family != "topk":
        lg.lgreco.values = dict(decision["densities"])
        wire = 0
        for n in layers:
            shape = layer_shape(shapes[n])
            extra = {"shape": shape} if family == "powersgd" else {}
            wire += lg.compressor(n).wire_bytes(math.prod(shape), 4, **extra)
        assert decision["size"] == wire
    if family == "powersgd":
        assert decision["densities"]["lowrank"] <= 2  # a rank-2 layer needs no more


def test_lgreco_family_input_checks():
    with pytest.raises(ValueError, match="family"):
        LGreco(0.1, family="sign")
    with pytest.raises(ValueError, match="bits"):
        LGreco(9, family="qsgd")
    with pytest.raises(ValueError, match="rank"):
        LGreco(0.5, family="powersgd")
    with pytest.raises(ValueError, match="bucket_size"):
        LGreco(4, family="qsgd", bucket_size=0)


# ---------------------------------------------------------------------- multi-rank
@pytest.mark.mpi
def test_auto_lgreco_densities_identical_and_no_larger_than_uniform(comm):
    auto, _, _ = train_auto(comm, 7, ratio=0.1, lgreco=True, lgreco_every=3,
                             lgreco_acc_steps=2, schemes=("allgather_topk", "artopk_ring"))
    assert len(auto.lgreco.history) == 2
    mine = [sorted(h["densities"].items()) for h in auto.lgreco.history]
    assert comm.allgather_object(mine) == [mine] * comm.size
    for h in auto.lgreco.history:
        assert h["densities"], "rank 0 accumulated every layer"
        assert h["size"] <= h["uniform_size"]
        assert h["error"] <= h["budget"] * (1 + 1e-9)
    assert {r.scheme for r in auto.records} <= {"allgather_topk", "artopk_ring", "dense"}


@pytest.mark.mpi
@pytest.mark.parametrize(("family", "default"), [("topk", 0.05), ("qsgd", 4),
                                                 ("powersgd", 4)])
def test_lgreco_families_agree_on_every_rank(comm, family, default):
    """Every rank accumulates different gradients; rank 0's solution is everyone's."""
    lg = LayerErrors(LGreco(default, family=family, every=4, acc_steps=2))
    shapes = _lgreco_layers(lg, torch.Generator().manual_seed(10 + comm.rank),
                            scale=1.0 + comm.rank)
    values = lg.adjust(comm, shapes)
    assert set(values) == set(shapes)
    assert comm.allgather_object(sorted(values.items())) == [sorted(values.items())] * \
        comm.size
    h = lg.lgreco.history[-1]
    assert h["family"] == family
    assert h["error"] <= h["budget"] * (1 + 1e-9) and h["size"] <= h["uniform_size"]
    assert all(lg.lgreco.value(n) == v for n, v in values.items())


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data - d.data.mean(0)) / np.where(d.data.std(0) > 0, d.data.std(0), 1.0)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(d.target)
    return x[:1400], y[:1400], x[1400:], y[1400:]



@pytest.mark.mpi
@pytest.mark.parametrize(("family", "default"), [("qsgd", 3), ("powersgd", 4)])
def test_auto_lgreco_bits_and_ranks_are_what_goes_on_the_wire(comm, family, default):
    """Per-layer QSGD bits / PowerSGD ranks inside fused buckets: every step's bytes are
    the prediction for the assignment in force, the assignment is rank 0's (identical
    everywhere, error <= budget, size <= uniform), and the model still learns."""
    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.lgreco_buckets import FAMILY_SCHEMES, predict_bucket
    from mpicomm.torch import GradientSync

    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    auto = AutoStrategy(calibrate_links=0, lgreco=True, lgreco_family=family,
                        lgreco_default=default, lgreco_every=3, lgreco_acc_steps=2,
                        schemes=(FAMILY_SCHEMES[family],))
    gen = torch.Generator().manual_seed(100 + comm.rank)
    with torch.no_grad():
        first = float(torch.nn.functional.cross_entropy(model(xte), yte))
    bytes_ok, used = [], []
    beta_only = CostParams(alpha=0.0, beta=1.0, gamma=0.0)
    with GradientSync(model, strategy=auto, comm=comm, bucket_mb=0.004) as sync:
        traffic = sync.strategy.comm.traffic
        for _ in range(12):
            idx = torch.randint(0, xtr.shape[0], (32,), generator=gen)
            opt.zero_grad()
            before = traffic.snapshot()  # before backward: buckets leave during it
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            sync.step(opt)
            sent = (traffic - before).sent_bytes
            values = {layer: auto.lgreco.value(layer) for segs in auto._segments.values()
                      for layer, _, _ in segs}
            expected = sum(predict_bucket(family, [s for _, _, s in segs],
                                          [values[n] for n, _, _ in segs], 4, comm.size,
                                          beta_only, ZERO, auto.lgreco.bucket_size)["comm"]
                           for segs in auto._segments.values())
            # ring allreduce blocks differ by one element: <= 8 bytes per allreduce
            bytes_ok.append(abs(sent - expected) <= 16 * len(auto._segments))
            used.append(sorted(values.items()))
    assert len(auto._segments) >= 2, "the test wants several fused buckets"
    assert all(bytes_ok), bytes_ok
    assert {r.scheme for r in auto.records} == {FAMILY_SCHEMES[family]}
    history = auto.lgreco.history
    assert len(history) == 3
    assert any(dict(u) != {k: default for k, _ in u} for u in used), \
        "L-GreCo moved no layer away from the uniform setting"
    mine = (used, [sorted(h["densities"].items()) for h in history])
    assert comm.allgather_object(mine) == [mine] * comm.size
    for h in history:
        assert h["family"] == family
        assert h["error"] <= h["budget"] * (1 + 1e-9) and h["size"] <= h["uniform_size"]
    with torch.no_grad():
        last = float(torch.nn.functional.cross_entropy(model(xte), yte))
    assert last < 0.85 * first, (first, last)  # held-out loss falls: it still learns
    if family == "powersgd":  # per-layer warm starts travel with the state
        fresh = AutoStrategy(calibrate_links=0, lgreco=True, lgreco_family=family)
        fresh.load_state_dict(auto.state_dict())
        assert {r: sorted(c.state_dict()["q"]) for r, c in fresh._psgd.items()} == \
            {r: sorted(c.state_dict()["q"]) for r, c in auto._psgd.items()} != {}
