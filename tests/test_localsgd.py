"""Local SGD and gossip averaging: serial tests (``-m "not mpi"``) of the gossip
topologies and mixing matrices and of the argument checks of ``LocalSGD`` and
``GossipAveraging``; multi-rank tests (``@pytest.mark.mpi``, run under ``mpiexec -n
1..5``) of ``LocalSGD`` (tau = 1 is synchronous SGD, identical replicas right after each
averaging, momentum averaging, the delay hook), ``neighbor_average`` and
``GossipAveraging``.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm.control import AdaComm
from mpicomm.gossip import (
    Topology,
    consensus_distance,
    make_topology,
    mixing_matrix,
    neighbor_average,
)
from mpicomm.torch import GossipAveraging, LocalSGD

torch.set_num_threads(1)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def same_everywhere(comm, tensors) -> bool:
    return len(set(comm.allgather_object(digest(tensors)))) == 1


# ====================================================================== topologies (serial)
@pytest.mark.parametrize("name, size, offsets", [
    ("ring", 1, ()), ("ring", 2, (1,)), ("ring", 3, (1, 2)), ("ring", 6, (1, 5)),
    ("exponential", 1, ()), ("exponential", 2, (1,)), ("exponential", 3, (1, 2)),
    ("exponential", 5, (1, 2, 4)), ("exponential", 8, (1, 2, 4)),
    ("exponential", 9, (1, 2, 4, 8)),
])
def test_topology_offsets(name, size, offsets):
    topo = make_topology(name, size)
    assert topo.offsets == offsets
    assert topo.weight == pytest.approx(1 / (len(offsets) + 1))


@pytest.mark.parametrize("name", ["ring", "exponential"])
@pytest.mark.parametrize("size", range(1, 13))
def test_mixing_matrix_doubly_stochastic_and_contracting(name, size):
    w = mixing_matrix(name, size)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-15)
    assert (w >= 0).all()
    if name == "ring" and size >= 3:
        assert np.count_nonzero(w[0]) == 3 and w[0, 0] == pytest.approx(1 / 3)
    if size > 1:  # connected: every non-consensus direction shrinks
        sigma = np.linalg.svd(w - np.full((size, size), 1 / size), compute_uv=False)
        assert sigma.max() < 1 - 1e-9


def test_topology_bad_arguments():
    with pytest.raises(ValueError, match="unknown topology"):
        make_topology("star", 4)
    with pytest.raises(ValueError):
        make_topology("ring", 0)
    with pytest.raises(ValueError):
        Topology("custom", 4, (1, 1))
    with pytest.raises(ValueError):
        Topology("custom", 4, (4,))
    with pytest.raises(ValueError, match="size"):
        mixing_matrix("ring")


# ====================================================================== LocalSGD arguments
def test_localsgd_bad_arguments():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="period"):
        LocalSGD(model, 0)
    with pytest.raises(TypeError, match="period"):
        LocalSGD(model, 2.0)
    with pytest.raises(ValueError, match="optimizer"):
        LocalSGD(model, AdaComm(4, interval_rounds=1))
    with pytest.raises(ValueError, match="optimizer"):
        LocalSGD(model, 4, average_momentum=True)
    with pytest.raises(ValueError, match="algorithm"):
        LocalSGD(model, 4, opt, algorithm="bruck")
    with pytest.raises(ValueError, match="delay_s"):
        LocalSGD(model, 4, opt, delay_s=-1.0)
    with pytest.raises(ValueError, match="no parameters"):
        LocalSGD(torch.nn.ReLU(), 4)
    with pytest.raises(TypeError):
        LocalSGD("model", 4)
    with pytest.raises(ValueError, match="unknown topology"):
        GossipAveraging(model, topology="star")
    local = LocalSGD(model, AdaComm(4, interval_rounds=1), opt)
    with pytest.raises(ValueError, match="step\\(loss\\)"):
        local.step()


# ====================================================================== LocalSGD (multi-rank)
LR = 0.125  # a power of two: lr * g is exact


def _dyadic_problem(rank: int, size: int, steps: int, batch: int = 2, dim: int = 4):
    """Each rank's minibatches: features in {-1, 0, 1}, targets small integers."""
    rng = np.random.default_rng(1234)
    x = rng.integers(-1, 2, size=(steps, size, batch, dim)).astype(np.float64)
    y = rng.integers(-3, 4, size=(steps, size, batch)).astype(np.float64)
    return torch.from_numpy(x[:, rank]), torch.from_numpy(y[:, rank])


def _dyadic_model(dim: int = 4) -> torch.nn.Linear:
    model = torch.nn.Linear(dim, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25, 1.0, 0.0]], dtype=torch.float64))
        model.bias.fill_(0.5)
    return model


def _mse(model, x, y):
    return ((model(x).squeeze(-1) - y) ** 2).mean()


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["auto", "ring", "recursive_doubling", "mpi"])
def test_tau1_equals_gradient_averaging(comm, algorithm):
    """tau = 1 with plain SGD is synchronous SGD: mean_j(x - lr g_j) == x - lr mean_j(g_j).

    Exact (bit for bit) at P = 1, 2, 4: floating-point results are only reproducible
    across different evaluation orders when nothing rounds, so every value is kept a
    dyadic rational with few significant bits: features in {-1, 0, 1}, integer targets,
    dyadic initial weights, batch 2 (the MSE gradient is then X^T r, no division that
    rounds), lr = 1/8, float64, 8 steps. Replaying it in exact rationals shows at most
    39 significant bits at P = 4 (53 available), so every product, sum and the division
    by P = 2^k are exact, whatever order the allreduce algorithm adds in. At P = 3 and 5
    the division by P rounds, and the two sides divide different quantities (updated
    parameters vs gradients), so they may differ in the last bits: compared at 1e-12.
    """
    steps = 8
    x, y = _dyadic_problem(comm.rank, comm.size, steps)
    model, ref = _dyadic_model(), _dyadic_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    local = LocalSGD(model, 1, opt, comm=comm, algorithm=algorithm)
    exact = comm.size & (comm.size - 1) == 0
    for t in range(steps):
        opt.zero_grad()
        loss = _mse(model, x[t], y[t])
        loss.backward()
        opt.step()
        assert local.step(loss) is True
        # reference: average the gradients with mpicomm.allreduce, then one SGD step
        ref_opt.zero_grad()
        _mse(ref, x[t], y[t]).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        if t == 0 and comm.size > 1:
            assert len(set(comm.allgather_object(grads.numpy().tobytes()))) > 1
        avg = mpicomm.allreduce(grads, op="avg", algorithm=algorithm, comm=comm)
        offset = 0
        for p in ref.parameters():
            p.grad.copy_(avg[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            if exact:
                assert torch.equal(p, q), (t, p, q)
            else:
                torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert (local.rounds, local.local_steps, local.period) == (steps, steps, 1)
    assert not torch.equal(model.weight, _dyadic_model().weight)  # it trained


def _bn_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.mpi
def test_identical_right_after_each_averaging(comm):
    torch.manual_seed(100 + comm.rank)  # different init per rank: the broadcast fixes it
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    local = LocalSGD(model, 3, opt, comm=comm)
    state = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    assert same_everywhere(comm, state)
    gen = torch.Generator().manual_seed(7 + comm.rank)  # different data per rank
    averaged, sent = [], []
    for _ in range(9):
        xb = torch.randn(16, 5, generator=gen)
        yb = torch.randint(0, 2, (16,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        did = local.step(loss)
        averaged.append(did)
        if did:
            sent.append(local.traffic.sent_bytes)
            assert same_everywhere(comm, state)
        elif comm.size > 1:
            assert not same_everywhere(comm, list(model.parameters()))
    assert averaged == [False, False, True] * 3
    assert (local.rounds, local.local_steps, local.steps_since_average) == (3, 9, 0)
    per_round = np.diff([0, *sent])
    assert (per_round == per_round[0]).all()
    assert (per_round[0] > 0) == (comm.size > 1)
    nbytes = sum(t.numel() * t.element_size() for t in state)
    assert local.bytes_per_round == nbytes


@pytest.mark.mpi
@pytest.mark.parametrize("average_momentum", [True, False])
def test_momentum_averaging(comm, average_momentum):
    torch.manual_seed(3)
    model = torch.nn.Linear(6, 3, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    local = LocalSGD(model, 2, opt, average_momentum=average_momentum, comm=comm,
                     algorithm="ring")
    gen = torch.Generator().manual_seed(11 + comm.rank)
    for t in range(4):
        opt.zero_grad()
        loss = (model(torch.randn(4, 6, generator=gen, dtype=torch.float64)) ** 2).mean()
        loss.backward()
        opt.step()
        moms = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
        before = [m.clone() for m in moms]
        if local.step(loss):
            assert same_everywhere(comm, list(model.parameters()))
            if average_momentum:
                assert same_everywhere(comm, moms)
                for m, b in zip(moms, before):
                    expect = mpicomm.allreduce(b, op="avg", comm=comm)
                    torch.testing.assert_close(m, expect, rtol=1e-12, atol=1e-14)
            else:
                assert all(torch.equal(m, b) for m, b in zip(moms, before))
                if comm.size > 1:
                    assert not same_everywhere(comm, moms)
        assert local.rounds == (t + 1) // 2
    params = sum(p.numel() * 8 for p in model.parameters())
    assert local.bytes_per_round == params * (2 if average_momentum else 1)


@pytest.mark.mpi
def test_delay_hook_and_broadcast(comm):
    torch.manual_seed(comm.rank)
    model = torch.nn.Linear(3, 2)
    calls = []
    local = LocalSGD(model, 2, comm=comm, delay_s=lambda r: calls.append(r) or 0.0)
    assert same_everywhere(comm, list(model.parameters()))
    for _ in range(6):
        local.step()
    assert calls == [0, 1, 2]
    slow = LocalSGD(model, 1, comm=comm, delay_s=0.05)
    start = time.perf_counter()
    slow.step()
    slow.step()
    assert time.perf_counter() - start >= 0.1


# ====================================================================== gossip (multi-rank)
@pytest.mark.mpi
@pytest.mark.parametrize("name", ["ring", "exponential"])
def test_neighbor_average_consensus(comm, name):
    topo = make_topology(name, comm.size)
    rng = np.random.default_rng(50 + comm.rank)
    x = rng.normal(size=257) * (1 + comm.rank)
    mean0 = mpicomm.allreduce(x, op="avg", comm=comm)
    everyone = np.stack(comm.allgather_object(x))
    w = mixing_matrix(topo)
    dist = [consensus_distance(x, comm)]
    for r in range(12):
        before = comm.traffic.snapshot()
        x = neighbor_average(x, topo, comm=comm)
        moved = comm.traffic.snapshot() - before
        assert moved.sent_bytes == moved.recv_bytes == topo.degree * x.nbytes
        if r == 0:  # the mix is W @ X, row = this rank
            np.testing.assert_allclose(x, (w @ everyone)[comm.rank], rtol=1e-13, atol=1e-13)
        dist.append(consensus_distance(x, comm))
        np.testing.assert_allclose(mpicomm.allreduce(x, op="avg", comm=comm), mean0,
                                   rtol=1e-12, atol=1e-12)
    for a, b in zip(dist, dist[1:]):
        assert b <= a * (1 + 1e-12) + 1e-15
        if a > 1e-9:
            assert b < a
    if comm.size > 1:
        assert dist[0] > 1.0 and dist[-1] < 0.5 * dist[0]
    else:
        assert dist == [0.0] * len(dist)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["ring", "exponential"])
def test_gossip_averaging_model(comm, name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    gossip = GossipAveraging(model, topology=name, comm=comm)
    assert gossip.consensus_distance() == pytest.approx(0.0, abs=1e-7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(comm.rank)))
    total = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean0 = mpicomm.allreduce(total.double(), op="avg", comm=comm)
    dist = [gossip.consensus_distance()]
    for _ in range(6):
        gossip.step()
        dist.append(gossip.consensus_distance())
    for a, b in zip(dist, dist[1:]):
        assert b <= a * (1 + 1e-5) + 1e-6
        if a > 1e-4:
            assert b < a
    total = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(mpicomm.allreduce(total.double(), op="avg", comm=comm), mean0,
                               rtol=1e-5, atol=1e-5)
    nbytes = total.numel() * total.element_size()
    assert gossip.traffic.sent_bytes == 6 * gossip.topology.degree * nbytes
    assert gossip.rounds == 6
