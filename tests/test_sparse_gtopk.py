"""mpicomm.sparse: gTop-k against the single-process reference simulator, bit for bit.

Serial tests check the simulator (:mod:`mpicomm.sparse.reference`): exact where nothing
is truncated, the documented counterexample, its invariants, the butterfly's association
of the sums and its traffic; the tagged set merges behind the dropped-pick masks; and,
through a child ``mpiexec`` job, gTop-k at 6, 7 and 8 ranks. Multi-rank tests
(``@pytest.mark.mpi``) run at every rank count of the suite; each rank generates every
rank's input from a seed (``tests/sparse_pairs.py``) and compares gTop-k with the
simulator and the exact Top-k: results, association, invariants, the dropped-pick masks
of error feedback, and the bytes and messages sent (``comm.traffic``) against closed
forms written here independently of the implementation.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm.compress.topk_select import topk_indices
from mpicomm.sparse import exact_topk, gtopk, topk_allgather
from mpicomm.sparse import reference as ref

from .launch import run_job
from .sparse_pairs import assert_identical_on_all_ranks, assert_same_bits, rank_pairs
from .traffic_forms import doubling_messages


# ---------------------------------------------------------------------- helpers
def sub_comm(comm: mpicomm.Communicator, n: int) -> mpicomm.Communicator | None:
    """Communicator over ranks 0..n-1 (collective; None on the others)."""
    return comm.split(0 if comm.rank < n else None)


def gtopk_traffic(rank: int, p: int, pairs_per_message: int, s: int) -> tuple[int, int]:
    """(bytes, messages) rank sends in gTop-k when every message holds the same count."""
    msgs = doubling_messages(rank, p)
    return msgs * pairs_per_message * s, msgs


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
            assert (trace.bytes_sent(r, 12), trace.messages(r)) == gtopk_traffic(r, p, k, 12)


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
    assert (moved.sent_bytes, moved.messages) == gtopk_traffic(comm.rank, p, k, s)
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
    assert (moved.sent_bytes, moved.messages) == gtopk_traffic(comm.rank, comm.size, m, 8)
