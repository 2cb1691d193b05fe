"""Checks of the hierarchical collectives on one host layout, shared by the multi-rank
tests (tests/test_hierarchical.py, at every rank count of the suite) and a child job at
6 ranks (``python tests/hier_checks.py`` under ``mpiexec -n 6``).

Every rank builds every rank's input from a seed, so it can compute the expected result
(the flat algorithm's, or a numpy reference of the hierarchical semantics) itself.
Integers (and floats holding small integers) must match exactly; other floats within a
tolerance, since the hierarchy associates the sums differently.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI

import mpicomm
from mpicomm.p2p import block_bounds
from mpicomm.sparse import artopk, exact_topk, gtopk, hierarchical_topk, topk_allgather
from mpicomm.sparse import reference as ref
from mpicomm.sparse.hierarchical import lane_k
from mpicomm.strategies import HierarchicalARTopK, HierarchicalGTopK, HierarchicalTopK
from mpicomm.topology import Topology

#: Layouts with several ranks on some host: (2,2), (1,2,3), (3,3) and uneven hosts,
#: host counts that are not powers of two.
SEVERAL_PER_HOST = [(2, 2), (1, 2, 3), (3, 3), (2, 2, 2), (1, 2), (2, 1), (1, 3),
                    (2, 2, 1), (1, 2, 2), (3, 2)]


def layouts(p: int, trivial: bool = True) -> list[tuple[int, ...]]:
    """Host sizes to test at ``p`` ranks: those of :data:`SEVERAL_PER_HOST` that fit,
    and (``trivial``) one host and one rank per host."""
    out = {s for s in SEVERAL_PER_HOST if sum(s) == p}
    if trivial:
        out |= {(p,), (1,) * p}
    return sorted(out)


def communicator(sizes: Sequence[int]) -> mpicomm.Communicator:
    return mpicomm.Communicator(MPI.COMM_WORLD.Dup(), check=True,
                                topology=Topology.from_sizes(sizes))


def same_everywhere(comm: mpicomm.Communicator, a: np.ndarray) -> None:
    everyone = comm.allgather_object(np.ascontiguousarray(a).tobytes())
    assert all(e == everyone[0] for e in everyone), "ranks got different results"


def rank_vectors(p: int, seed: int, n: int, dtype: str) -> list[np.ndarray]:
    out = []
    for r in range(p):
        rng = np.random.default_rng(seed * 7919 + r)
        if dtype.startswith("int"):
            out.append(rng.integers(-50, 51, n).astype(dtype))
        else:
            out.append(rng.standard_t(3, n).astype(dtype))
    return out


# ---------------------------------------------------------------------- dense
def check_dense(comm: mpicomm.Communicator) -> None:
    """Hierarchical allreduce and allgather against the ring, numpy and torch."""
    p = comm.size
    ops = {"int64": ("sum", "max"), "float64": ("sum", "avg", "min"), "float32": ("sum",)}
    for n in (0, 7, 1000):
        for dtype, dtype_ops in ops.items():
            xs = rank_vectors(p, n + 3, n, dtype)
            for op in dtype_ops:
                got = mpicomm.allreduce(xs[comm.rank], op=op, algorithm="hierarchical",
                                        comm=comm)
                want = mpicomm.allreduce(xs[comm.rank], op=op, algorithm="ring", comm=comm)
                if dtype == "int64" or op in ("max", "min"):
                    assert np.array_equal(got, want), (op, n, dtype)
                else:
                    tol = 1e-5 if dtype == "float32" else 1e-12
                    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
                same_everywhere(comm, got)
        t = torch.arange(n, dtype=torch.float32) * (comm.rank + 1)
        out = torch.empty_like(t)
        got = mpicomm.allreduce(t, op="avg", algorithm="hierarchical", comm=comm, out=out)
        assert got is out
        torch.testing.assert_close(got, torch.arange(n, dtype=torch.float32) * (p + 1) / 2)
        for rows in (1, 3):
            block = (np.arange(rows * 2).reshape(rows, 2) + 100 * comm.rank).astype(np.int32)
            got = mpicomm.allgather(block, algorithm="hierarchical", comm=comm)
            want = mpicomm.allgather(block, algorithm="ring", comm=comm)
            assert got.shape == want.shape and np.array_equal(got, want)


def check_allgather_any_placement(comm: mpicomm.Communicator) -> None:
    """Hosts that do not hold consecutive ranks (round-robin placement)."""
    hosts = [r % 2 for r in range(comm.size)]
    c = mpicomm.Communicator(comm.mpi.Dup(), check=True, topology=Topology.from_hosts(hosts))
    try:
        block = np.arange(5, dtype=np.int64) + 10 * c.rank
        got = mpicomm.allgather(block, algorithm="hierarchical", comm=c)
        assert np.array_equal(got, np.concatenate([np.arange(5) + 10 * r
                                                   for r in range(c.size)]))
        x = np.arange(9, dtype=np.int64) * (c.rank + 1)
        got = mpicomm.allreduce(x, algorithm="hierarchical", comm=c)
        assert np.array_equal(got, np.arange(9) * c.size * (c.size + 1) // 2)
    finally:
        c.free()


# ---------------------------------------------------------------------- sparse
def expected_sparse(topo: Topology, xs: list[np.ndarray], k: int, inner: str, sliced: bool,
                    step: int) -> tuple[np.ndarray, np.ndarray]:
    """The hierarchical semantics in numpy: host sums, per-lane top-k, ``inner`` over
    the hosts' sets (the sparse reference), lanes concatenated."""
    d = xs[0].shape[0]
    sums = [np.sum([xs[r] for r in m], axis=0) for m in topo.members]
    lanes = topo.lanes if sliced else 1
    lb = block_bounds(d, lanes)
    ks = lane_k(k, lanes, [lb[j + 1] - lb[j] for j in range(lanes)])
    out_i, out_v = [], []
    for j in range(lanes):
        parts = [s[lb[j]:lb[j + 1]] for s in sums]
        sets = [ref.truncate((np.arange(len(s)), s), ks[j]) for s in parts]
        if inner == "gtopk":
            idx, val = ref.simulate_gtopk(sets, ks[j])
        elif inner == "allgather":
            dense = np.zeros(len(parts[0]))
            for si, sv in sets:
                dense[si] += sv
            idx = np.unique(np.concatenate([s[0] for s in sets]))
            val = dense[idx]
        else:
            idx = np.sort(sets[(step + j) % topo.num_hosts][0])
            val = np.sum(parts, axis=0)[idx]
        out_i.append(idx + lb[j])
        out_v.append(val)
    return np.concatenate(out_i), np.concatenate(out_v)


def check_sparse(comm: mpicomm.Communicator) -> None:
    """hierarchical_topk against the reference, mass conservation of the applied
    indices, agreement; equal to the flat collectives where the layout makes it so."""
    topo, p, d = comm.topology, comm.size, 60
    xs = rank_vectors(p, 11, d, "int64")
    xs = [x.astype(np.float64) for x in xs]  # small integers: every sum is exact
    total = np.sum(xs, axis=0)
    for inner in ("gtopk", "artopk", "allgather"):
        for sliced in (False, True):
            for k in (1, 9, d):
                idx, val, applied = hierarchical_topk(torch.from_numpy(xs[comm.rank]), k,
                                                      comm, inner=inner, sliced=sliced,
                                                      step=5)
                idx, val, applied = idx.numpy(), val.numpy(), applied.numpy()
                want_i, want_v = expected_sparse(topo, xs, k, inner, sliced, 5)
                assert np.array_equal(idx, want_i) and np.array_equal(val, want_v), \
                    (inner, sliced, k)
                same_everywhere(comm, np.concatenate([idx, val]))
                hosts = dict(comm.allgather_object((comm.node, applied.tolist())))
                left = [x.copy() for x in xs]
                for r in range(p):
                    left[r][hosts[topo.hosts[r]]] = 0
                update = np.zeros(d)
                update[idx] = val
                assert np.array_equal(update + np.sum(left, axis=0), total), (inner, k)
                if k == d:  # nothing truncated: the exact sum
                    assert np.array_equal(update, total)
    if topo.num_hosts == p:  # one rank per host: the flat collectives, bit for bit
        picks = ref.truncate((np.arange(d), xs[comm.rank]), 9)
        flat_i, flat_v = gtopk(picks[0], picks[1], 9, comm)
        idx, val, _ = hierarchical_topk(xs[comm.rank], 9, comm, inner="gtopk")
        assert np.array_equal(idx, flat_i) and np.array_equal(val, flat_v)
        flat_i, flat_v = artopk(xs[comm.rank], 9, step=5, comm=comm)
        idx, val, _ = hierarchical_topk(xs[comm.rank], 9, comm, inner="artopk", step=5,
                                        op="avg")
        assert np.array_equal(idx, flat_i) and np.array_equal(val, flat_v)
        flat = topk_allgather(picks[0], picks[1], d, comm=comm)
        idx, val, _ = hierarchical_topk(xs[comm.rank], 9, comm, inner="allgather")
        dense = np.zeros(d)
        dense[idx] = val
        assert np.array_equal(dense, flat)
    if topo.num_hosts == 1:  # one host: the exact top-k of the sum
        ex_i, ex_v = exact_topk(np.arange(d), xs[comm.rank], 9, comm)
        for inner in ("gtopk", "artopk", "allgather"):
            idx, val, _ = hierarchical_topk(xs[comm.rank], 9, comm, inner=inner)
            assert np.array_equal(idx, ex_i) and np.array_equal(val, ex_v), inner


def check_strategies(comm: mpicomm.Communicator) -> None:
    """Error-fed hierarchical strategies: identical results on every rank, and over
    several steps ``P·Σ_t u_t + Σ_r e_r = Σ_r Σ_t g_r`` exactly (integer gradients)."""
    p = comm.size
    for cls in (HierarchicalTopK, HierarchicalGTopK, HierarchicalARTopK):
        for sliced in (False, True):
            s = cls(density=0.1, sliced=sliced).bind(comm)
            applied, total = np.zeros(48), np.zeros(48)
            for step in range(3):
                gs = [x.astype(np.float64) for x in rank_vectors(p, 40 + step, 48, "int64")]
                out = s.aggregate([torch.from_numpy(gs[comm.rank][:40].reshape(8, 5)),
                                   torch.from_numpy(gs[comm.rank][40:])], ["w", "b"])
                flat = torch.cat([o.reshape(-1) for o in out]).numpy()
                same_everywhere(comm, flat)
                applied += flat
                total += np.sum(gs, axis=0)
            res = np.sum(comm.allgather_object(s.residual("w..b").numpy()), axis=0)
            np.testing.assert_allclose(p * applied + res, total, rtol=0, atol=1e-9)


def run_all(comm: mpicomm.Communicator) -> None:
    check_dense(comm)
    check_sparse(comm)
    check_strategies(comm)


if __name__ == "__main__":  # the child job at 6 ranks
    world = MPI.COMM_WORLD
    for sizes in layouts(world.Get_size(), trivial=False):  # those run at 1..5 ranks
        c = communicator(sizes)
        run_all(c)
        c.free()
    check_allgather_any_placement(mpicomm.init())
    if world.Get_rank() == 0:
        print("HIER_CHECKS_OK", world.Get_size(), layouts(world.Get_size(), trivial=False),
              flush=True)
    sys.exit(0)
