"""mpicomm.sparse: Allgather Top-k, the exact Top-k, AR-Top-k, and what all the sparse
collectives share. Multi-rank tests (``@pytest.mark.mpi``) run at every rank count of the
suite; each rank generates every rank's input from a seed (``tests/sparse_pairs.py``), so
it can compute the single-process reference (:mod:`mpicomm.sparse.reference`) itself and
compare bit for bit. They check Allgather Top-k and the exact Top-k against it, AR-Top-k's
choice of source (STAR, VAR, largest), its values and residual, that every sparse
collective keeps its inputs' framework and device, and that bad inputs raise on every
rank. Byte counts come from ``comm.traffic`` and are compared with closed forms written
here independently of the implementation. Serial tests check the cost formulas and the
bad inputs at one rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicomm
from mpicomm.buffers import inspect
from mpicomm.collectives import cost
from mpicomm.compress.topk_select import topk_indices
from mpicomm.sparse import ARTopKState, artopk, exact_topk, gtopk, topk_allgather
from mpicomm.sparse import reference as ref

from .arrays import cases
from .sparse_pairs import assert_identical_on_all_ranks, assert_same_bits, bits, rank_pairs
from .traffic_forms import binomial_fanout, doubling_allreduce_bytes, ring_allreduce_bytes


# ---------------------------------------------------------------------- helpers
def device_of(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return "cpu"
    if isinstance(a, torch.Tensor):
        return str(a.device)
    return f"cuda:{a.device.id}"  # cupy


# ====================================================================== serial
def test_cost_formulas():
    c = cost.CostParams(alpha=1e-5, beta=1e-9, gamma=0.0)
    k, s = 1000, 8
    for p in (2, 3, 4, 5, 8, 16):
        p2 = 1 << (p.bit_length() - 1)
        extra = 2 if p != p2 else 0
        # the fold adds two messages' bytes and one or two latencies (the unfolded
        # ranks start at once: see cost.folded_butterfly)
        alpha_only = cost.CostParams(alpha=1.0, beta=0.0, gamma=0.0)
        beta_only = cost.CostParams(alpha=0.0, beta=1.0, gamma=0.0)
        assert cost.gtopk(k, s, p, beta_only) == pytest.approx((math.log2(p2) + extra) * k * s)
        assert math.log2(p2) + extra / 2 <= cost.gtopk(k, s, p, alpha_only) \
            <= math.log2(p2) + extra
        assert cost.gtopk(k, s, p, c) <= (math.log2(p2) + extra) * (c.alpha + k * s * c.beta)
        assert cost.topk_allgather(k, s, p, c) == pytest.approx((p - 1) * (c.alpha
                                                                           + k * s * c.beta))
        assert cost.artopk_ring(k, 4, 4, p, c) == pytest.approx(
            math.ceil(math.log2(p)) * (c.alpha + 4 * k * c.beta)
            + 2 * (p - 1) * c.alpha + 2 * (p - 1) / p * 4 * k * c.beta)
        assert cost.artopk_tree(k, 4, 4, p, c) == pytest.approx(
            cost.broadcast_binomial(4 * k, p, c)
            + cost.allreduce_recursive_doubling(4 * k, p, c))
    # the bandwidth argument at P = 8: gTop-k moves 3/7 of the Allgather's bytes
    assert cost.gtopk(k, s, 8, cost.CostParams(alpha=0.0, beta=1.0, gamma=0.0)) / \
        cost.topk_allgather(k, s, 8, cost.CostParams(alpha=0.0, beta=1.0, gamma=0.0)) \
        == pytest.approx(3 / 7)


def test_bad_inputs_single_rank():
    comm = mpicomm.world()
    idx, val = np.array([1, 5, 7]), np.array([1.0, -2.0, 3.0], dtype=np.float32)
    _check_bad_inputs(comm, idx, val)


# ====================================================================== multi-rank
@pytest.mark.mpi
@pytest.mark.parametrize("backend,dtype", cases(["float32"]))
def test_gtopk_and_allgather_keep_framework_and_device(comm, backend, dtype):
    pairs = rank_pairs(comm.size, 4242, 64, [6] * comm.size, dtype)
    i_np, v_np = pairs[comm.rank]
    idx = backend.make(i_np, "int32")
    val = backend.make(v_np, dtype)
    gi, gv, dropped = gtopk(idx, val, 6, comm=comm, size=64, return_dropped=True)
    for out, like in ((gi, idx), (gv, val), (dropped, val)):
        assert type(out) is type(like)
        assert device_of(out) == device_of(like)
    assert inspect(gi).dtype == "int32"
    assert_same_bits((backend.to_numpy(gi), backend.to_numpy(gv)),
                     ref.simulate_gtopk(pairs, 6))
    dense = topk_allgather(idx, val, 64, comm=comm)
    assert type(dense) is type(val)
    np.testing.assert_array_equal(backend.to_numpy(dense), ref.scatter_add(pairs, 64))
    ei, ev = exact_topk(idx, val, 6, comm=comm, size=64)
    assert_same_bits((backend.to_numpy(ei), backend.to_numpy(ev)), ref.exact_topk(pairs, 6))
    x = backend.make(np.random.default_rng(comm.rank).standard_normal(64), dtype)
    ai, av, res = artopk(x, 6, 0, comm=comm, return_residual=True)
    assert type(ai) is type(x) and type(res) is type(x)
    assert device_of(av) == device_of(x) == device_of(res)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_topk_allgather_variable_k(comm, op, dtype):
    d = 120
    counts = [3 + 4 * r for r in range(comm.size)]
    pairs = rank_pairs(comm.size, 61, d, counts, dtype)
    before = comm.traffic.snapshot()
    dense = topk_allgather(*pairs[comm.rank], d, op=op, comm=comm)
    moved = comm.traffic - before
    want = ref.scatter_add(pairs, d, op)
    assert dense.dtype == want.dtype and dense.shape == (d,)
    assert bits(dense) == bits(want)
    s = 4 + np.dtype(dtype).itemsize
    right = (comm.rank + 1) % comm.size
    expected = (sum(counts) - counts[right]) * s if comm.size > 1 else 0
    assert moved.sent_bytes == expected  # ring: every block but the right neighbour's


@pytest.mark.mpi
def test_topk_allgather_traffic_equal_k(comm):
    k, d = 50, 1000
    pairs = rank_pairs(comm.size, 62, d, [k] * comm.size, "float32")
    before = comm.traffic.snapshot()
    topk_allgather(*pairs[comm.rank], d, comm=comm)
    assert (comm.traffic - before).sent_bytes == (comm.size - 1) * k * 8


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_topk_matches_reference(comm, dtype):
    for seed, (d, k) in enumerate([(40, 6), (500, 25), (12, 12)]):
        pairs = rank_pairs(comm.size, 70 + seed, d, [min(k, d) - seed] * comm.size, dtype)
        got = exact_topk(*pairs[comm.rank], k, comm=comm, size=d)
        assert_same_bits(got, ref.exact_topk(pairs, k))
        # against a dense numpy sum: same index set, values equal to float rounding
        total = np.zeros(d)
        for i, v in pairs:
            total[i] += v
        support = np.unique(np.concatenate([i for i, _ in pairs]))
        order = sorted(support, key=lambda j: (-abs(total[j]), j))[:k]
        np.testing.assert_array_equal(got[0], np.sort(order))
        np.testing.assert_allclose(got[1], total[got[0]], rtol=1e-6)


# ---------------------------------------------------------------------- AR-Top-k
def ar_inputs(p: int, d: int, seed: int, dtype: str = "float64",
              scale: list[float] | None = None) -> list[np.ndarray]:
    out = []
    for r in range(p):
        rng = np.random.default_rng(seed * 1009 + r)
        out.append((rng.standard_t(3, d) * (1.0 if scale is None else scale[r])).astype(dtype))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_artopk_star(comm, algorithm, dtype):
    p, d, k = comm.size, 257, 19
    sources = []
    for step in range(p, 2 * p):  # P consecutive steps (not starting at 0)
        xs = ar_inputs(p, d, step, dtype)
        x = torch.from_numpy(xs[comm.rank])
        state = ARTopKState()
        idx, val, res = artopk(x, k, step, comm=comm, algorithm=algorithm, state=state,
                               return_residual=True)
        src = step % p
        sources.append(state.source)
        assert state.source == src
        assert idx.dtype == torch.int64 and val.dtype == x.dtype
        want_idx = topk_indices(xs[src], k)                  # the source's local top-k
        np.testing.assert_array_equal(idx.numpy(), want_idx)
        mean = np.mean([xr[want_idx].astype(np.float64) for xr in xs], axis=0)
        np.testing.assert_allclose(val.numpy(), mean, rtol=1e-6 if dtype == "float32"
                                   else 1e-13, atol=1e-6 if dtype == "float32" else 1e-13)
        assert_identical_on_all_ranks(comm, idx.numpy(), val.numpy())
        expect_res = xs[comm.rank].copy()
        expect_res[want_idx] = 0
        np.testing.assert_array_equal(res.numpy(), expect_res)
        # mass conservation: sum_r x_r = P*u + sum_r e_r
        u = np.zeros(d)
        u[idx.numpy()] = val.numpy()
        e_sum = comm.allgather_object(res.numpy())
        np.testing.assert_allclose(np.sum(xs, axis=0, dtype=np.float64),
                                   p * u + np.sum(e_sum, axis=0, dtype=np.float64),
                                   rtol=1e-5, atol=1e-5 if dtype == "float32" else 1e-12)
    assert sorted(sources) == list(range(p))  # one turn each in P consecutive steps


@pytest.mark.mpi
def test_artopk_var_picks_largest_ewma(comm):
    p, d, k = comm.size, 100, 5
    # rank with the largest gradient scale: p // 2; EWMA follows it across steps
    scale = [1.0 + 9.0 * (r == p // 2) for r in range(p)]
    state = ARTopKState(smoothing=0.5)
    for step in range(3):
        xs = ar_inputs(p, d, 300 + step, scale=scale)
        idx, val = artopk(xs[comm.rank], k, step, source="var", comm=comm, state=state)
        norms = comm.allgather_object(state.ewma)
        assert state.norms == norms
        assert state.source == int(np.argmax(norms)) == p // 2
        np.testing.assert_array_equal(idx, topk_indices(xs[p // 2], k))
    # ties go to the lowest rank; grad= feeds the statistic instead of x
    state = ARTopKState()
    x = ar_inputs(p, d, 400)[comm.rank]
    artopk(x, k, 0, source="var", comm=comm, state=state, grad=np.ones(d))
    assert state.source == 0 and state.norms == [10.0] * p


@pytest.mark.mpi
def test_artopk_largest_picks_the_largest_error_fed_vector(comm):
    """``source="largest"``: the rank whose ``x`` has the largest L2 norm at this step
    selects the indices (no state needed; a state records the norms and the source);
    ties go to the lowest rank."""
    p, d, k = comm.size, 100, 5
    for step in range(3):
        big = (p // 2 + step) % p
        xs = ar_inputs(p, d, 500 + step, scale=[1.0 + 9.0 * (r == big) for r in range(p)])
        state = ARTopKState()
        idx, val = artopk(xs[comm.rank], k, step, source="largest", comm=comm, state=state)
        assert state.source == big
        assert state.norms == pytest.approx([np.linalg.norm(x) for x in xs], rel=1e-12)
        np.testing.assert_array_equal(idx, topk_indices(xs[big], k))
        np.testing.assert_allclose(val, np.mean([x[idx] for x in xs], axis=0),
                                   rtol=1e-12)
        plain = artopk(xs[comm.rank], k, step, source="largest", comm=comm)
        np.testing.assert_array_equal(plain[0], idx)
    state = ARTopKState()
    artopk(np.ones(d), k, 0, source="largest", comm=comm, state=state)
    assert state.source == 0 and state.norms == [10.0] * p


@pytest.mark.mpi
def test_artopk_charges_the_norm_only_where_the_source_needs_it(comm, monkeypatch):
    """The virtual clock charges ``"largest"``'s and ``"var"``'s norm as one elementwise
    reduction over ``x``'s bytes (the gradient's for VAR with ``grad``); STAR computes
    none."""
    from mpicomm import clock

    p, d, k = comm.size, 100, 5
    x = ar_inputs(p, d, 520, "float32")[comm.rank]

    def reductions(nbytes: int, **kwargs) -> list[float]:
        charged: list[tuple[str, float]] = []
        monkeypatch.setattr(clock, "charge", lambda op, n=1.0: charged.append((op, n)))
        artopk(x, k, 0, comm=comm, **kwargs)
        monkeypatch.undo()
        return [n for op, n in charged if op == "reduce" and n == nbytes]

    assert reductions(d * 4, source="star") == []
    assert reductions(d * 4, source="largest") == [d * 4]
    assert reductions(d * 4, source="var", state=ARTopKState()) == [d * 4]
    grad = np.ones(d)  # float64: its 8 bytes per element are what the norm reads
    assert reductions(d * 8, source="var", state=ARTopKState(), grad=grad) == [d * 8]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_artopk_traffic(comm, algorithm):
    p, d, k = comm.size, 1000, 37
    for step in range(p):
        x = ar_inputs(p, d, 800 + step, "float32")[comm.rank]
        before = comm.traffic.snapshot()
        artopk(x, k, step, comm=comm, algorithm=algorithm)
        moved = comm.traffic - before
        bcast = binomial_fanout(comm.rank, step % p, p) * k * 4
        values = (ring_allreduce_bytes(comm.rank, p, k, 4) if algorithm == "ring"
                  else doubling_allreduce_bytes(comm.rank, p, k, 4))
        assert moved.sent_bytes == bcast + values, (step, moved)
        # every non-source rank receives the k indices exactly once
        assert comm.allreduce_value(bcast) == (p - 1) * k * 4
    # VAR and largest add an allgather of one float64 per rank (Bruck: P-1 of them sent)
    for source in ("var", "largest"):
        state = ARTopKState()
        before = comm.traffic.snapshot()
        artopk(x, k, 0, source=source, comm=comm, state=state, algorithm=algorithm)
        moved = comm.traffic - before
        bcast = binomial_fanout(comm.rank, state.source, p) * k * 4
        values = (ring_allreduce_bytes(comm.rank, p, k, 4) if algorithm == "ring"
                  else doubling_allreduce_bytes(comm.rank, p, k, 4))
        assert moved.sent_bytes == bcast + values + (p - 1) * 8


@pytest.mark.mpi
def test_artopk_source_indices(comm):
    p, d, k = comm.size, 50, 4
    x = ar_inputs(p, d, 5)[comm.rank]
    given = np.array([40, 3, 17, 8])  # any order; used only on the source
    idx, val = artopk(x, k, 1, comm=comm, source_indices=given)
    np.testing.assert_array_equal(idx, np.sort(given))
    xs = ar_inputs(p, d, 5)
    np.testing.assert_allclose(val, np.mean([xr[np.sort(given)] for xr in xs], axis=0),
                               rtol=1e-13)


# ---------------------------------------------------------------------- bad inputs
def _raises(exc: type[Exception], match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _check_bad_inputs(comm: mpicomm.Communicator, idx: np.ndarray, val: np.ndarray) -> None:
    """Every bad argument raises on every rank (same bad input everywhere)."""
    kw = {"comm": comm, "size": 10}
    for k in (0, -1, 1.5, True, 11):
        _raises(ValueError, "k", gtopk, idx, val, k, **kw)
        _raises(ValueError, "k", exact_topk, idx, val, k, **kw)
    _raises(ValueError, "outside", gtopk, np.array([1, 10, 2]), val, 2, **kw)
    _raises(ValueError, "outside", gtopk, np.array([-1, 3, 2]), val, 2, **kw)
    _raises(ValueError, "outside", gtopk, np.array([1, 2**31, 2]), val, 2, comm=comm)
    _raises(ValueError, "duplicate", gtopk, np.array([1, 5, 1]), val, 2, **kw)
    _raises(ValueError, "length", gtopk, idx[:2], val, 2, **kw)
    _raises(ValueError, "1-D", gtopk, idx.reshape(3, 1), val.reshape(3, 1), 2, **kw)
    for bad in (np.nan, np.inf):
        v = val.copy()
        v[1] = bad
        _raises(ValueError, "NaN or infinity", gtopk, idx, v, 2, **kw)
        _raises(ValueError, "NaN or infinity", topk_allgather, idx, v, 10, comm=comm)
    _raises(TypeError, "integer dtype", gtopk, idx.astype(np.float64), val, 2, **kw)
    _raises(TypeError, "floating dtype", gtopk, idx, idx, 2, **kw)
    _raises(TypeError, "numpy", gtopk, torch.from_numpy(idx), val, 2, **kw)
    _raises(ValueError, "size", gtopk, idx, val, 2, comm=comm, size=0)
    _raises(ValueError, "op", topk_allgather, idx, val, 10, op="max", comm=comm)
    _raises(ValueError, "outside", topk_allgather, idx, val, 6, comm=comm)
    x = np.linspace(-1, 1, 20)
    _raises(ValueError, "exceeds", artopk, x, 21, 0, comm=comm)
    _raises(ValueError, "k", artopk, x, 0, 0, comm=comm)
    _raises(ValueError, "step", artopk, x, 3, -1, comm=comm)
    _raises(ValueError, "source", artopk, x, 3, 0, source="min", comm=comm)
    _raises(ValueError, "algorithm", artopk, x, 3, 0, algorithm="bus", comm=comm)
    _raises(ValueError, "state", artopk, x, 3, 0, source="var", comm=comm)
    _raises(TypeError, "floating", artopk, np.arange(20), 3, 0, comm=comm)
    _raises(ValueError, "source_indices", artopk, x, 3, 0, comm=comm,
            source_indices=np.array([1, 1, 2]))
    xn = x.copy()
    xn[4] = np.nan
    _raises(ValueError, "NaN or infinity", artopk, xn, 3, 0, comm=comm)
    # explicitly allowed non-finite values go through (inf ranks first)
    v = val.copy()
    v[0] = np.inf
    got = gtopk(idx, v, 1, comm=comm, size=10, allow_nonfinite=True)
    np.testing.assert_array_equal(got[0], [idx[0]])
    # the communicator is still usable afterwards
    assert gtopk(idx, val, 1, **kw)[0].size == 1


@pytest.fixture(scope="module")
def plain() -> Iterator[mpicomm.Communicator]:
    """A communicator with checked mode off."""
    c = mpicomm.Communicator(MPI.COMM_WORLD.Dup(), check=False)
    yield c
    c.free()


@pytest.mark.mpi
def test_bad_inputs_raise_on_every_rank(comm, plain):
    idx, val = np.array([1, 5, 7]), np.array([1.0, -2.0, 3.0], dtype=np.float32)
    _check_bad_inputs(comm, idx, val)
    _check_bad_inputs(plain, idx, val)


@pytest.mark.mpi(min_size=2)
def test_one_bad_rank_raises_everywhere_in_checked_mode(comm):
    last = comm.size - 1
    idx = np.array([1, 5, 7]) if comm.rank != last else np.array([1, 5, 1])
    val = np.ones(3, dtype=np.float32)
    with pytest.raises(ValueError, match="duplicate" if comm.rank == last else f"rank {last}"):
        gtopk(idx, val, 2, comm=comm, size=10)
    good = np.array([1, 5, 7])
    with pytest.raises(TypeError, match="integer dtype" if comm.rank == 0 else "rank 0"):
        topk_allgather(good if comm.rank else good.astype(np.float32), val, 10, comm=comm)
    x = np.linspace(-1, 1, 20)
    with pytest.raises(ValueError, match="NaN" if comm.rank == last else f"rank {last}"):
        artopk(np.where(np.arange(20) == 3, np.nan, x) if comm.rank == last else x, 3, 0,
               comm=comm)
    # disagreements between ranks (checked mode): k, size, source, step
    with pytest.raises(ValueError, match="k is"):
        gtopk(np.array([1, 5, 7]), val, 2 + (comm.rank == last), comm=comm, size=10)
    with pytest.raises(ValueError, match="size is"):
        topk_allgather(np.array([1, 5, 7]), val, 10 + (comm.rank == last), comm=comm)
    with pytest.raises(ValueError, match="source is"):
        artopk(x, 3, 0, source="var" if comm.rank == last else "star", comm=comm,
               state=ARTopKState())
    with pytest.raises(ValueError, match="step is"):
        artopk(x, 3, comm.rank, comm=comm)
    with pytest.raises(ValueError, match="dtype is"):
        gtopk(np.array([1, 5, 7]), val.astype(np.float64) if comm.rank == last else val, 2,
              comm=comm, size=10)
    assert gtopk(np.array([1, 5, 7]), val, 2, comm=comm, size=10)[0].size == 2
