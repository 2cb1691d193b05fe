"""DGC momentum correction, momentum factor masking and local clipping (Lin et al.,
arXiv 1712.01887).

The two-step example is computed by hand below (no code of the implementation is used);
density 1 without masking must equal heavy-ball momentum SGD exactly; the multi-rank tests
check the same identities with every rank's own gradients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpicomm.compress import ErrorFeedback
from mpicomm.strategies import ARTopK, GTopK, RandomKAllreduce, TopKAllgather

if MPI.COMM_WORLD.Get_size() > 1:
    torch.set_num_threads(1)

G1 = [1.0, -3.0, 2.0]
G2 = [2.0, 1.0, -1.0]


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ====================================================================== the memory alone
def test_two_step_hand_computed_dgc_update_with_masking():
    """m = 0.5, k = 1.  Step 1: u = g1 = [1,-3,2]; v = u; send v[1] = -3; v = [1,0,2];
    masking: u = [1,0,2].  Step 2: u = 0.5·[1,0,2] + [2,1,-1] = [2.5,1,0];
    v = [1,0,2] + u = [3.5,1,2]; send v[0] = 3.5; v = [0,1,2]; u = [0,1,0]."""
    strategy = TopKAllgather(k=1, momentum_correction=0.5)
    out1 = strategy.aggregate([_t(G1)], ["w"])[0]
    assert out1.tolist() == [0.0, -3.0, 0.0]
    assert strategy.residual("w").tolist() == [1.0, 0.0, 2.0]
    assert strategy.memory.velocity("w").tolist() == [1.0, 0.0, 2.0]
    out2 = strategy.aggregate([_t(G2)], ["w"])[0]
    assert out2.tolist() == [3.5, 0.0, 0.0]
    assert strategy.residual("w").tolist() == [0.0, 1.0, 2.0]
    assert strategy.memory.velocity("w").tolist() == [0.0, 1.0, 0.0]


def test_two_step_hand_computed_dgc_update_without_masking():
    """As above without masking: step 2 u = 0.5·[1,-3,2] + [2,1,-1] = [2.5,-0.5,0];
    v = [1,0,2] + u = [3.5,-0.5,2]; send 3.5; v = [0,-0.5,2]; u stays [2.5,-0.5,0]."""
    strategy = GTopK(k=1, momentum_correction=0.5, momentum_masking=False)
    strategy.aggregate([_t(G1)], ["w"])
    out2 = strategy.aggregate([_t(G2)], ["w"])[0]
    assert out2.tolist() == [3.5, 0.0, 0.0]
    assert strategy.residual("w").tolist() == [0.0, -0.5, 2.0]
    assert strategy.memory.velocity("w").tolist() == [2.5, -0.5, 0.0]


def test_memory_state_round_trip_and_errors():
    ef = ErrorFeedback(momentum=0.9)
    c = ef.compensate("w", np.array([1.0, 2.0]))
    ef.update_sparse("w", c, np.array([1]))
    state = ef.state_dict()
    assert set(state) == {"residuals", "velocities"}
    other = ErrorFeedback(momentum=0.9)
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.velocity("w"), [1.0, 0.0])
    np.testing.assert_array_equal(other.residual("w"), [1.0, 0.0])
    with pytest.raises(ValueError, match="without momentum"):
        ErrorFeedback().load_state_dict(state)
    with pytest.raises(ValueError, match="momentum"):
        ErrorFeedback(momentum=-0.1)
    with pytest.raises(ValueError, match="masking"):
        ErrorFeedback(momentum=0.9, masking=1)
    with pytest.raises(KeyError, match="velocity"):
        ErrorFeedback(momentum=0.9).velocity("nothing")
    ef.reset()
    assert len(ef) == 0
    with pytest.raises(KeyError):
        ef.velocity("w")
    # the strategy's checkpoint carries the velocities too
    s = TopKAllgather(k=1, momentum_correction=0.5)
    s.aggregate([_t(G1)], ["w"])
    restored = TopKAllgather(k=1, momentum_correction=0.5)
    restored.load_state_dict(s.state_dict())
    assert restored.aggregate([_t(G2)], ["w"])[0].tolist() == [3.5, 0.0, 0.0]


def _heavy_ball(grads: list[np.ndarray], m: float) -> list[np.ndarray]:
    b, out = None, []
    for g in grads:
        b = g.copy() if b is None else m * b + g
        out.append(b.copy())
    return out


def test_density_one_without_masking_is_momentum_sgd_on_a_model():
    """Train the same tiny model twice: momentum correction at density 1 + plain SGD, and
    heavy-ball SGD (torch.optim.SGD momentum 0.9): identical weights."""
    x = torch.randn(32, 5, generator=torch.Generator().manual_seed(0))
    y = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    weights = []
    for corrected in (True, False):
        torch.manual_seed(3)
        model = torch.nn.Linear(5, 1).double()
        strategy = TopKAllgather(density=1.0, momentum_correction=0.9,
                                 momentum_masking=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.05,
                              momentum=0.0 if corrected else 0.9)
        for step in range(6):
            opt.zero_grad()
            batch = slice(4 * step, 4 * step + 8)
            torch.nn.functional.mse_loss(model(x[batch].double()), y[batch].double()).backward()
            if corrected:
                grads = [p.grad for p in model.parameters()]
                for p, g in zip(model.parameters(), strategy.aggregate(grads, ["w", "b"])):
                    p.grad = g
            opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_clipping_scales_to_the_local_threshold():
    strategy = TopKAllgather(density=1.0, clip_norm=2.0)
    out = strategy.aggregate([_t([3.0, 4.0])], ["w"])[0]  # norm 5 -> 2 (P = 1)
    np.testing.assert_allclose(out.numpy(), [1.2, 1.6])
    assert strategy.stats.extra["clipped"] == 1
    out = strategy.aggregate([_t([0.3, 0.4])], ["w"])[0]  # below the threshold: untouched
    np.testing.assert_allclose(out.numpy(), [0.3, 0.4])
    assert strategy.describe()["clip_norm"] == 2.0


# ====================================================================== multi-rank
BUILD = {
    "topk": lambda **kw: TopKAllgather(density=1.0, **kw),
    "gtopk": lambda **kw: GTopK(density=1.0, **kw),
    "artopk": lambda **kw: ARTopK(density=1.0, **kw),
    "randomk": lambda **kw: RandomKAllreduce(density=1.0, **kw),
}


def _rank_grads(p: int, step: int, n: int = 40) -> list[np.ndarray]:
    return [np.random.default_rng(1000 * step + r).standard_normal(n) for r in range(p)]


@pytest.mark.mpi
@pytest.mark.parametrize("which", list(BUILD))
def test_density_one_is_heavy_ball_on_the_mean_on_every_rank(comm, which):
    strategy = BUILD[which](momentum_correction=0.9, momentum_masking=False).bind(comm)
    means = [np.mean(_rank_grads(comm.size, t), axis=0) for t in range(4)]
    for t, want in enumerate(_heavy_ball(means, 0.9)):
        g = torch.from_numpy(_rank_grads(comm.size, t)[comm.rank])
        out = strategy.aggregate([g], ["w"])[0]
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)
        assert float(strategy.residual("w").abs().max()) == 0.0


@pytest.mark.mpi
@pytest.mark.parametrize("which", list(BUILD))
def test_masking_at_density_one_is_plain_sgd_and_clipping_uses_sqrt_p(comm, which):
    strategy = BUILD[which](momentum_correction=0.9, clip_norm=1.0).bind(comm)
    limit = 1.0 / math.sqrt(comm.size)
    for t in range(3):
        everyone = _rank_grads(comm.size, t)  # norms ~6 > limit: every rank clips
        clipped = [g * min(1.0, limit / np.linalg.norm(g)) for g in everyone]
        out = strategy.aggregate([torch.from_numpy(everyone[comm.rank])], ["w"])[0]
        np.testing.assert_allclose(out.numpy(), np.mean(clipped, axis=0), rtol=1e-12,
                                   atol=1e-12)
        assert float(strategy.memory.velocity("w").abs().max()) == 0.0  # all masked


@pytest.mark.mpi
@pytest.mark.parametrize("seed", [50, 51, 52])
def test_gtopk_own_contribution_puts_truncated_picks_back(comm, seed):
    """Picks whose own value was truncated on the butterfly path go back to the residual
    (a subset of the index rule's zeroed positions); on a power of two, mass is then
    conserved: Σ_r g_r = P·u + Σ_r e_r (first step: the compensated vector is g)."""
    p = comm.size
    everyone = _rank_grads(p, seed, n=24)
    g = torch.from_numpy(everyone[comm.rank])
    own, ref = GTopK(k=3).bind(comm), GTopK(k=3, own_contribution=False).bind(comm)
    out = own.aggregate([g], ["w"])[0]
    np.testing.assert_array_equal(out.numpy(), ref.aggregate([g], ["w"])[0].numpy())
    zero_own, zero_ref = own.residual("w") == 0, ref.residual("w") == 0
    assert bool((zero_own <= zero_ref).all())
    if p & (p - 1) == 0:
        total_e = np.sum(comm.allgather_object(own.residual("w").numpy()), axis=0)
        np.testing.assert_allclose(p * out.numpy() + total_e, np.sum(everyone, axis=0),
                                   rtol=1e-12, atol=1e-12)
