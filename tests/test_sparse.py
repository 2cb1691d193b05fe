"""mpicomm.sparse: gTop-k, Allgather Top-k, AR-Top-k and the exact reference.

Multi-rank tests (``@pytest.mark.mpi``) run at every rank count of the suite; each rank
generates *every* rank's input from a seed, so it can compute the single-process
reference (:mod:`mpicomm.sparse.reference`) itself and compare bit for bit. Serial tests
check the reference simulator, the cost formulas and, through a child ``mpiexec`` job,
gTop-k at 6, 7 and 8 ranks. Byte counts come from ``comm.traffic`` and are compared with
closed forms written here independently of the implementation.
"""

from __future__ import annotations

import math
import sys
import textwrap
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
from .launch import run_job

Pairs = tuple[np.ndarray, np.ndarray]


# ---------------------------------------------------------------------- helpers
def rank_pairs(p: int, seed: int, d: int, counts: list[int], dtype: str = "float64",
               nonneg: bool = False, integer: bool = False) -> list[Pairs]:
    """Every rank's (indices, values): ``counts[r]`` distinct indices in [0, d)."""
    out = []
    for r in range(p):
        rng = np.random.default_rng(seed * 1009 + r)
        idx = rng.choice(d, size=counts[r], replace=False).astype(np.int64)
        if integer:
            val = rng.integers(1 if nonneg else -9, 10, size=counts[r]).astype(dtype)
        else:
            val = rng.standard_t(3, size=counts[r])
            val = (np.abs(val) if nonneg else val).astype(dtype)
        out.append((idx, val))
    return out


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def assert_same_bits(got: Pairs, want: Pairs) -> None:
    gi, gv = got
    wi, wv = want
    np.testing.assert_array_equal(np.asarray(gi, dtype=np.int64), wi)
    assert np.asarray(gv).dtype == wv.dtype
    assert bits(np.asarray(gv)) == bits(wv), (gv, wv)


def assert_identical_on_all_ranks(comm: mpicomm.Communicator, *arrays: Any) -> None:
    mine = tuple(bits(np.asarray(a)) for a in arrays)
    everyone = comm.allgather_object(mine)
    assert all(e == everyone[0] for e in everyone)


def device_of(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return "cpu"
    if isinstance(a, torch.Tensor):
        return str(a.device)
    return f"cuda:{a.device.id}"  # cupy


def sub_comm(comm: mpicomm.Communicator, n: int) -> mpicomm.Communicator | None:
    """Communicator over ranks 0..n-1 (collective; None on the others)."""
    return comm.split(0 if comm.rank < n else None)


def gtopk_bytes(rank: int, p: int, pairs_per_message: int, s: int) -> tuple[int, int]:
    """(bytes, messages) rank sends in gTop-k when every message holds the same count."""
    p2 = 1 << (p.bit_length() - 1)
    rem, rounds = p - p2, p2.bit_length() - 1
    if rank < 2 * rem:
        msgs = 1 if rank % 2 == 0 else rounds + 1
    else:
        msgs = rounds
    return msgs * pairs_per_message * s, msgs


def binomial_children(rank: int, root: int, p: int) -> int:
    """Children of ``rank`` in a binomial broadcast tree rooted at ``root``."""
    rel = (rank - root) % p
    low = rel & -rel if rel else 1 << max(p - 1, 1).bit_length()
    children, mask = 0, 1
    while mask < low and mask < p:
        if rel + mask < p:
            children += 1
        mask <<= 1
    return children


def ring_allreduce_bytes(rank: int, p: int, n: int, itemsize: int) -> int:
    """Bytes rank sends in a ring allreduce of n elements (blocks = near-equal split)."""
    if p == 1:
        return 0
    size = [((j + 1) * n) // p - (j * n) // p for j in range(p)]
    return (2 * n - size[(rank + 1) % p] - size[(rank + 2) % p]) * itemsize


def rd_allreduce_bytes(rank: int, p: int, n: int, itemsize: int) -> int:
    """Bytes rank sends in a recursive-doubling allreduce (fold of the first 2*rem)."""
    p2 = 1 << (p.bit_length() - 1)
    rem, rounds = p - p2, p2.bit_length() - 1
    msgs = (1 if rank % 2 == 0 else rounds + 1) if rank < 2 * rem else rounds
    return msgs * n * itemsize


# ====================================================================== serial
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", [1, 2])
def test_simulator_is_exact_for_one_and_two_ranks(p, dtype):
    for seed in range(20):
        pairs = rank_pairs(p, seed, 60, [8] * p, dtype)
        assert_same_bits(ref.simulate_gtopk(pairs, 8), ref.exact_topk(pairs, 8))


@pytest.mark.parametrize("p", [3, 4, 5, 6, 7, 8])
def test_simulator_is_exact_without_truncation(p):
    # the union of the supports has <= k indices: nothing is ever dropped
    for seed in range(10):
        pairs = rank_pairs(p, seed, 12, [5] * p, "float64", integer=True)
        got = ref.simulate_gtopk(pairs, 12)
        assert_same_bits(got, ref.exact_topk(pairs, 12))
        assert got[0].size == len(set(np.concatenate([i for i, _ in pairs])))
    # every rank picks the same index set (integer values: sums exact in any order)
    shared = np.array([3, 17, 40, 41, 99])
    pairs = [(shared, np.arange(1, 6, dtype=np.float64) * (r + 1)) for r in range(p)]
    assert_same_bits(ref.simulate_gtopk(pairs, 5), ref.exact_topk(pairs, 5))


def test_simulator_a6_counterexample_is_not_exact():
    """docs/algorithms.md (gTop-k): P=4, k=1 - gTop-k keeps c:7 although a:10 is the true top-1."""
    a, b, c = 0, 1, 2
    pairs = [(np.array([a]), np.array([5.0])), (np.array([b]), np.array([6.0])),
             (np.array([a]), np.array([5.0])), (np.array([c]), np.array([7.0]))]
    assert_same_bits(ref.simulate_gtopk(pairs, 1), (np.array([c]), np.array([7.0])))
    assert_same_bits(ref.exact_topk(pairs, 1), (np.array([a]), np.array([10.0])))
    # partial values: a is kept with 7, but its true sum is 5 + 7 = 12
    d = 3
    pairs = [(np.array([a]), np.array([5.0])), (np.array([b]), np.array([6.0])),
             (np.array([a]), np.array([7.0])), (np.array([d]), np.array([1.0]))]
    assert_same_bits(ref.simulate_gtopk(pairs, 1), (np.array([a]), np.array([7.0])))
    assert_same_bits(ref.exact_topk(pairs, 1), (np.array([a]), np.array([12.0])))


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_simulator_invariants(p):
    for seed in range(10):
        k = 7
        pairs = rank_pairs(p, seed, 50, [k + (seed + r) % 4 for r in range(p)], nonneg=True)
        idx, val = ref.simulate_gtopk(pairs, k)
        union = np.unique(np.concatenate([i for i, _ in pairs]))
        assert idx.size == min(k, union.size)
        assert np.all(np.diff(idx) > 0)  # ascending, no duplicates
        assert np.isin(idx, union).all()
        total = ref.scatter_add(pairs, 50)
        assert np.all(val >= 0) and np.all(val <= total[idx] + 1e-12)


def test_simulator_association_follows_the_butterfly():
    # the association of a 4-way float sum is fixed by the butterfly: (v0+v1)+(v2+v3)
    vals = [np.float32(1e8), np.float32(1.0), np.float32(-1e8), np.float32(1.0)]
    pairs = [(np.array([4]), np.array([v])) for v in vals]
    idx, val = ref.simulate_gtopk(pairs, 1)
    assert val[0] == (vals[0] + vals[1]) + (vals[2] + vals[3])
    assert val[0] != ((vals[0] + vals[1]) + vals[2]) + vals[3]  # rank-order sum differs


def test_simulator_traffic_closed_form():
    for p in range(1, 17):
        k = 6
        # disjoint supports of k each: every message holds exactly k pairs
        pairs = [(np.arange(r * k, (r + 1) * k), np.ones(k) * (r + 1)) for r in range(p)]
        trace = ref.GTopKTrace(p)
        ref.simulate_gtopk(pairs, k, trace=trace)
        for r in range(p):
            assert (trace.bytes_sent(r, 12), trace.messages(r)) == gtopk_bytes(r, p, k, 12)


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


_CHILD = textwrap.dedent("""
    import numpy as np, torch, mpicomm
    from mpicomm.sparse import gtopk, reference as ref
    world = mpicomm.init(check=True)
    done = []
    for p in (6, 7, 8):
        comm = world.split(0 if world.rank < p else None)
        if comm is None:
            world.barrier(); continue
        for seed, (d, k, n, dt) in enumerate([(300, 12, 12, "float64"), (300, 12, 12, "float32"),
                                               (40, 9, 5, "float64"), (2**31 + 10, 4, 6,
                                               "float32")]):
            pairs = []
            for r in range(p):
                rng = np.random.default_rng(seed * 1009 + r)
                i = rng.choice(d, size=n + r % 3, replace=False) if d < 1000 else \\
                    (2**31 - 3 + np.arange(n + r % 3) * (r + 2)) % d
                pairs.append((i.astype(np.int64), rng.standard_t(3, n + r % 3).astype(dt)))
            trace = ref.GTopKTrace(p)
            want = ref.simulate_gtopk(pairs, k, trace=trace)
            before = comm.traffic.snapshot()
            got = gtopk(torch.from_numpy(pairs[comm.rank][0]),
                        torch.from_numpy(pairs[comm.rank][1]), k, comm=comm, size=d)
            moved = comm.traffic - before
            assert np.array_equal(got[0].numpy(), want[0]), (p, seed)
            assert got[1].numpy().tobytes() == want[1].tobytes(), (p, seed)
            s = (4 if d < 2**31 else 8) + np.dtype(dt).itemsize
            assert moved.sent_bytes == trace.bytes_sent(comm.rank, s), (p, seed, moved)
            assert moved.messages == trace.messages(comm.rank)
        comm.free()
        world.barrier()
        done.append(p)
    if world.rank == 0:
        print("GTOPK_CHILD_OK", *done)
""")


def test_gtopk_matches_simulator_at_6_7_8_ranks():
    result = run_job(8, [sys.executable, "-c", _CHILD], timeout=150)
    assert result.returncode == 0, result.output[-3000:]
    assert "GTOPK_CHILD_OK 6 7 8" in result.output, result.output[-3000:]


# ====================================================================== multi-rank
CONFIGS = [  # (d, k, pairs per rank as a function of rank)
    (200, 10, lambda r: 10),
    (200, 10, lambda r: 10 + 3 * r),     # more than k: truncated locally first
    (200, 16, lambda r: 4 + 5 * r),      # fewer than k on some ranks
    (30, 8, lambda r: 0 if r == 1 else 6),  # a rank with nothing
    (25, 25, lambda r: 5),               # k = size
]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_gtopk_matches_simulator_bitwise(comm, dtype, config):
    d, k, count = CONFIGS[config]
    for seed in range(3):
        pairs = rank_pairs(comm.size, 31 * config + seed, d,
                           [count(r) for r in range(comm.size)], dtype)
        mine = pairs[comm.rank]
        rng = np.random.default_rng(seed + comm.rank)
        order = rng.permutation(mine[0].size)  # callers may pass pairs in any order
        idx, val = gtopk(mine[0][order], mine[1][order], k, comm=comm, size=d)
        assert isinstance(idx, np.ndarray) and idx.dtype == np.int64 and val.dtype == dtype
        assert_same_bits((idx, val), ref.simulate_gtopk(pairs, k))
        assert_identical_on_all_ranks(comm, idx, val)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gtopk_association_is_the_simulators(comm, dtype):
    # one shared index whose float sum depends on the association: the distributed sum
    # must be the butterfly's, bit for bit, on every rank (and the simulator's)
    big = {"float32": 1e8, "float64": 1e17}[dtype]
    vals = [big, 1.0, -big, 1.0, 3.0]
    pairs = [(np.array([4, 10 + r]), np.array([vals[r % len(vals)], 0.5], dtype=dtype))
             for r in range(comm.size)]
    got = gtopk(*pairs[comm.rank], 1, comm=comm, size=10 + comm.size)
    assert_same_bits(got, ref.simulate_gtopk(pairs, 1))
    assert_identical_on_all_ranks(comm, *got)


@pytest.mark.mpi
def test_gtopk_invariants(comm):
    k, d = 9, 80
    for seed in range(4):
        pairs = rank_pairs(comm.size, 500 + seed, d, [k] * comm.size, nonneg=True)
        idx, val = gtopk(*pairs[comm.rank], k, comm=comm, size=d)
        union = np.unique(np.concatenate([i for i, _ in pairs]))
        assert idx.size == min(k, union.size)
        assert np.all(np.diff(idx) > 0)
        assert np.isin(idx, union).all()
        total = ref.scatter_add(pairs, d)
        assert np.all(val >= 0) and np.all(val <= total[idx] + 1e-12)


@pytest.mark.mpi
def test_gtopk_equals_exact_without_truncation(comm):
    p = comm.size
    # (a) every rank picks the same index set
    shared = np.array([2, 11, 12, 30, 77, 78], dtype=np.int64)
    vals = (np.arange(1, 7, dtype=np.float64) * (comm.rank + 1)) * (-1) ** comm.rank
    got = gtopk(shared, vals, 6, comm=comm, size=100)
    assert_same_bits(got, exact_topk(shared, vals, 6, comm=comm, size=100))
    # (b) the union of supports has fewer than k indices: all of them come back
    pairs = rank_pairs(p, 7, 10, [4] * p, integer=True)
    got = gtopk(*pairs[comm.rank], 10, comm=comm, size=10)
    want = exact_topk(*pairs[comm.rank], 10, comm=comm, size=10)
    assert_same_bits(got, want)
    assert_same_bits(got, ref.exact_topk(pairs, 10))
    dense = topk_allgather(*pairs[comm.rank], 10, comm=comm)
    np.testing.assert_array_equal(dense[got[0]], got[1])  # == the Allgather Top-k result


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gtopk_is_exact_on_two_ranks(comm, dtype):
    two = sub_comm(comm, 2)
    if two is not None:
        for seed in range(5):
            pairs = rank_pairs(2, 900 + seed, 40, [8, 8], dtype)
            got = gtopk(*pairs[two.rank], 8, comm=two, size=40)
            assert_same_bits(got, exact_topk(*pairs[two.rank], 8, comm=two, size=40))
        two.free()
    comm.barrier()


@pytest.mark.mpi(min_size=4)
def test_gtopk_a6_counterexample(comm):
    """Documented non-exactness (docs/algorithms.md, gTop-k): P=4, k=1."""
    four = sub_comm(comm, 4)
    if four is not None:
        a, b, c = 0, 1, 2
        inputs = [(a, 5.0), (b, 6.0), (a, 5.0), (c, 7.0)]
        i, v = inputs[four.rank]
        idx, val = np.array([i]), np.array([v])
        got = gtopk(idx, val, 1, comm=four, size=3)
        exact = exact_topk(idx, val, 1, comm=four, size=3)
        pairs = [(np.array([j]), np.array([w])) for j, w in inputs]
        assert_same_bits(got, ref.simulate_gtopk(pairs, 1))
        assert_same_bits(got, (np.array([c]), np.array([7.0])))
        assert_same_bits(exact, (np.array([a]), np.array([10.0])))
        four.free()
    comm.barrier()


@pytest.mark.mpi
def test_gtopk_residual_bookkeeping(comm):
    d, k = 300, 12
    rng = np.random.default_rng(77 + comm.rank)
    acc = rng.standard_t(3, d)                      # g + eps, this rank's error-fed gradient
    local = topk_indices(acc, k)                    # L_i
    picks = acc[local]
    residual = acc.copy()
    residual[local] = 0.0                           # provisional residual
    idx, val, dropped = gtopk(local, picks, k, comm=comm, return_dropped=True, size=d)
    assert dropped.dtype == np.bool_ and dropped.shape == local.shape
    np.testing.assert_array_equal(dropped, ~np.isin(local, idx))
    residual[local[dropped]] += picks[dropped]      # put back what did not survive
    kept = np.zeros(d)
    kept[local[~dropped]] = acc[local[~dropped]]    # acc restricted to L_i ∩ I
    np.testing.assert_array_equal(acc, residual + kept)
    n_dropped = comm.allreduce_value(int(dropped.sum()))
    if comm.size > 1:  # independent Student-t picks: some must lose at P >= 2
        assert n_dropped > 0
    else:
        assert n_dropped == 0


@pytest.mark.mpi
def test_gtopk_own_contribution_returns_exactly_the_values_that_reached_the_result(comm):
    """With ``own_contribution``, a pick is kept only where this rank's value is part of
    the result: at a power-of-two P the kept picks of all ranks add up to the result
    exactly (integer values, no rounding). Every pick the index rule drops is dropped
    too, and without ``return_dropped`` nothing is tracked and the result is the same."""
    d, k = 400, 24
    rng = np.random.default_rng(5 + comm.rank)
    acc = rng.integers(-1000, 1000, d).astype(np.float64)
    local = topk_indices(acc, k)
    picks = acc[local]
    idx, val, by_value = gtopk(local, picks, k, comm=comm, size=d, return_dropped=True,
                               own_contribution=True)
    by_index = gtopk(local, picks, k, comm=comm, size=d, return_dropped=True)[2]
    plain = gtopk(local, picks, k, comm=comm, size=d)
    assert_same_bits(plain, (idx, val))
    np.testing.assert_array_equal(by_index, ~np.isin(local, idx))
    assert not (by_index & ~by_value).any()
    kept = np.zeros(d)
    kept[local[~by_value]] = picks[~by_value]
    total = np.zeros(d)
    comm.mpi.Allreduce(kept, total)
    result = np.zeros(d)
    result[idx] = val
    if comm.size & (comm.size - 1) == 0:
        np.testing.assert_array_equal(total, result)
    if comm.size == 4:  # the check has teeth: some values were cut on their way
        assert comm.allreduce_value(int((by_value & ~by_index).sum())) > 0


@pytest.mark.mpi
def test_gtopk_dropped_mask_follows_the_callers_order(comm):
    """The same pairs in a shuffled order give the same result and the same dropped mask,
    shuffled alike, under both rules (more picks than k, so the local truncation drops
    some too)."""
    d, k = 600, 20
    rng = np.random.default_rng(11 + comm.rank)
    local = np.sort(rng.choice(d, 3 * k, replace=False))
    picks = rng.standard_normal(3 * k)
    perm = rng.permutation(3 * k)
    for own in (False, True):
        ordered = gtopk(local, picks, k, comm=comm, size=d, return_dropped=True,
                        own_contribution=own)
        shuffled = gtopk(local[perm], picks[perm], k, comm=comm, size=d,
                         return_dropped=True, own_contribution=own)
        assert_same_bits(ordered[:2], shuffled[:2])
        np.testing.assert_array_equal(shuffled[2], ordered[2][perm])
        if own:   # the local truncation's drops are marked too
            assert ordered[2].sum() >= 2 * k


def test_tagged_merges_follow_the_pairs_they_tag():
    """``merge_truncate_tagged`` gives ``merge_truncate``'s set, and a tag ends on its own
    pair's index exactly while that pair survives (what a search for it would find)."""
    from mpicomm.sparse.sets import (
        members,
        merge_truncate,
        merge_truncate_tagged,
        truncate_tagged,
        union_tagged,
    )

    g = torch.Generator().manual_seed(7)
    for na, nb, k in ((0, 5, 3), (5, 0, 3), (40, 40, 30), (100, 60, 10), (60, 100, 200)):
        a = (torch.randperm(300, generator=g)[:na].sort().values,
             torch.randint(-3, 4, (na,), generator=g).double())   # ties on purpose
        b = (torch.randperm(300, generator=g)[:nb].sort().values,
             torch.randint(-3, 4, (nb,), generator=g).double())
        ta, tb = (torch.arange(na),), (torch.full((nb,), -1),)
        idx, val, (tag,) = merge_truncate_tagged(a, b, ta, tb, k)
        plain = merge_truncate(a, b, k)
        assert torch.equal(idx, plain[0]) and torch.equal(val, plain[1])
        own = tag >= 0
        assert torch.equal(a[0][tag[own]], idx[own])   # each tag sits on its pair's index
        assert torch.equal(idx[own], a[0][members(idx, a[0])])  # and every survivor has one
    with pytest.raises(ValueError, match="tags"):
        union_tagged(a, b, ta, ())
    i, v, t = truncate_tagged(a[0], a[1], (torch.arange(na),), na)  # nothing to cut
    assert t[0].shape[0] == na


def test_members_is_isin_on_a_sorted_set():
    from mpicomm.sparse.sets import members

    g = torch.Generator().manual_seed(3)
    for n, m in ((0, 5), (5, 0), (1, 1), (300, 1000), (1000, 300)):
        idx = torch.randperm(2000, generator=g)[:n].sort().values
        query = torch.randint(0, 2000, (m,), generator=g)
        assert torch.equal(members(idx, query), torch.isin(query, idx))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype,d", [("float32", 500), ("float64", 500),
                                     ("float32", 2**31 + 100)])
def test_gtopk_traffic_full_sets(comm, dtype, d):
    k, p = 16, comm.size
    # disjoint supports of exactly k pairs each: every union has >= k entries
    base = 0 if d < 2**31 else 2**31 - 2 * k  # ranks >= 2 use indices above 2^31
    pairs = [(base + np.arange(r * k, (r + 1) * k),
              (np.linspace(1, 2, k) * (r + 1)).astype(dtype)) for r in range(p)]
    s = (4 if d < 2**31 else 8) + np.dtype(dtype).itemsize
    before = comm.traffic.snapshot()
    got = gtopk(*pairs[comm.rank], k, comm=comm, size=d)
    moved = comm.traffic - before
    assert_same_bits(got, ref.simulate_gtopk(pairs, k))
    assert (moved.sent_bytes, moved.messages) == gtopk_bytes(comm.rank, p, k, s)
    total_recv = comm.allreduce_value(moved.recv_bytes)
    assert total_recv == comm.allreduce_value(moved.sent_bytes)


@pytest.mark.mpi
def test_gtopk_traffic_small_union(comm):
    # all ranks hold the same m < k indices: every message carries m pairs, never k
    k, m = 20, 3
    idx = np.array([5, 9, 14])
    val = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    before = comm.traffic.snapshot()
    got = gtopk(idx, val, k, comm=comm, size=64)
    moved = comm.traffic - before
    assert got[0].size == m
    assert (moved.sent_bytes, moved.messages) == gtopk_bytes(comm.rank, comm.size, m, 8)


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
        bcast = binomial_children(comm.rank, step % p, p) * k * 4
        values = (ring_allreduce_bytes(comm.rank, p, k, 4) if algorithm == "ring"
                  else rd_allreduce_bytes(comm.rank, p, k, 4))
        assert moved.sent_bytes == bcast + values, (step, moved)
        # every non-source rank receives the k indices exactly once
        assert comm.allreduce_value(bcast) == (p - 1) * k * 4
    # VAR and largest add an allgather of one float64 per rank (Bruck: P-1 of them sent)
    for source in ("var", "largest"):
        state = ARTopKState()
        before = comm.traffic.snapshot()
        artopk(x, k, 0, source=source, comm=comm, state=state, algorithm=algorithm)
        moved = comm.traffic - before
        bcast = binomial_children(comm.rank, state.source, p) * k * 4
        values = (ring_allreduce_bytes(comm.rank, p, k, 4) if algorithm == "ring"
                  else rd_allreduce_bytes(comm.rank, p, k, 4))
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
