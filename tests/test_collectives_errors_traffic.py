"""The errors the dense collectives raise and the traffic they send, at whatever rank count
runs the suite (under ``mpiexec -n P python -m pytest --with-mpi -m mpi``). Bad arguments,
bad ``out=`` buffers and, in checked mode, arguments that differ between ranks raise on
every rank before anything is sent, and leave the communicator usable. Each algorithm
(ring, recursive doubling and halving, Rabenseifner, Bruck, direct, binomial and
scatter-allgather) sends and receives the bytes and messages of its closed form, written
here independently of the implementation and compared with ``comm.traffic``; empty buffers
and the MPI library's own collectives count nothing, and over all ranks the bytes sent
equal the bytes received.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mpicomm
from mpicomm.collectives import ALGORITHMS
from mpicomm.comm import Traffic
from mpicomm.p2p import block_bounds, fold_layout

from .traffic_forms import binomial_children

pytestmark = pytest.mark.mpi


# ---------------------------------------------------------------------- bad out=
def bad_outs(x: np.ndarray) -> list[tuple[Any, type[Exception]]]:
    """Wrong shape, dtype, framework, and a non-contiguous view, for an output like ``x``."""
    import torch

    wide = np.empty((x.shape[0], 2), dtype=x.dtype)
    return [(np.empty(x.shape[0] + 1, dtype=x.dtype), ValueError),
            (np.empty(x.shape, dtype=np.float64), TypeError),
            (torch.empty(x.shape, dtype=torch.float32), TypeError),
            (wide[:, 0], ValueError)]


def test_bad_out_raises_before_communicating(comm):
    p = comm.size
    x = np.ones(2 * p, dtype=np.float32)
    calls: list[tuple[Callable[[Any], Any], tuple[int, ...]]] = [
        (lambda o: mpicomm.allreduce(x, algorithm="ring", comm=comm, out=o), x.shape),
        (lambda o: mpicomm.allgather(x, algorithm="ring", comm=comm, out=o), (2 * p * p,)),
        (lambda o: mpicomm.broadcast(x, algorithm="binomial", comm=comm, out=o), x.shape),
        (lambda o: mpicomm.reduce_scatter(x, algorithm="ring", comm=comm, out=o), (2,)),
        (lambda o: mpicomm.allgatherv(x, comm=comm, out=o), (2 * p * p,)),
    ]
    for call, shape in calls:
        for out, error in bad_outs(np.empty(shape, dtype=np.float32)):
            before = comm.traffic.snapshot()
            with pytest.raises(error, match="out"):
                call(out)
            assert comm.traffic.snapshot() == before
    # nothing is left half-done: the communicator still works
    np.testing.assert_array_equal(mpicomm.allreduce(x, comm=comm), np.full(2 * p, p))


# ---------------------------------------------------------------------- bad arguments
def every_collective(x: Any, comm: mpicomm.Communicator, **kw: Any) -> list[Callable[[], Any]]:
    return [lambda: mpicomm.allreduce(x, comm=comm, **kw),
            lambda: mpicomm.allgather(x, comm=comm, **kw),
            lambda: mpicomm.allgatherv(x, comm=comm, **kw),
            lambda: mpicomm.broadcast(x, comm=comm, **kw),
            lambda: mpicomm.reduce_scatter(x, comm=comm, **kw)]


def test_bad_arguments_raise_on_every_rank(comm):
    import torch

    p = comm.size
    x = np.ones(p, dtype=np.float32)
    before = comm.traffic.snapshot()
    for call in every_collective(x, comm, algorithm="butterfly"):
        with pytest.raises(ValueError, match="algorithm"):
            call()
    for bad in ([1.0] * p, 3.0, 7, None, "abc", np.float32(1.0)):
        for call in every_collective(bad, comm):
            with pytest.raises(TypeError):
                call()
    for bad in (np.ones(p, dtype=np.complex64), np.ones(p, dtype=bool),
                torch.ones(p, dtype=torch.complex64), np.ones(p, dtype=object)):
        for call in every_collective(bad, comm):
            with pytest.raises(TypeError):
                call()
    for op in ("prod", "SUM", None):
        with pytest.raises(ValueError, match="op"):
            mpicomm.allreduce(x, op=op, comm=comm)
        with pytest.raises(ValueError, match="op"):
            mpicomm.reduce_scatter(x, op=op, comm=comm)
    for ints in (np.ones(p, dtype=np.int32), torch.ones(p, dtype=torch.int8)):
        with pytest.raises(TypeError, match="avg"):
            mpicomm.allreduce(ints, op="avg", comm=comm)
        with pytest.raises(TypeError, match="avg"):
            mpicomm.reduce_scatter(ints, op="avg", comm=comm)
    for root in (p, -1, 10 * p):
        with pytest.raises(ValueError, match="root"):
            mpicomm.broadcast(x, root=root, comm=comm)
    for root in (0.0, "0", True, None):
        with pytest.raises(TypeError, match="root"):
            mpicomm.broadcast(x, root=root, comm=comm)
    for shape in ((), (p + 1,), (2 * p + 1, 3)) if p > 1 else ((),):
        with pytest.raises(ValueError, match="divisible"):
            mpicomm.reduce_scatter(np.ones(shape, dtype=np.float32), comm=comm)
    assert comm.traffic.snapshot() == before
    np.testing.assert_array_equal(mpicomm.allreduce(x, comm=comm), np.full(p, p))


@pytest.mark.mpi(min_size=2)
def test_allgatherv_trailing_mismatch_raises_on_every_rank(comm):
    shape = (2, 3) if comm.rank == 0 else (2, 4)
    with pytest.raises(ValueError, match="trailing shape"):
        mpicomm.allgatherv(np.ones(shape, dtype=np.float32), comm=comm)
    dtype = np.float32 if comm.rank else np.float64
    with pytest.raises(ValueError, match="trailing shape"):
        mpicomm.allgatherv(np.ones((comm.rank, 2), dtype=dtype), comm=comm)
    algorithm = "ring" if comm.rank else "mpi"
    with pytest.raises(ValueError, match="algorithm"):
        mpicomm.allgatherv(np.ones(2, dtype=np.float32), comm=comm, algorithm=algorithm)
    result = mpicomm.allgatherv(np.ones((comm.rank, 2), dtype=np.float32), comm=comm)
    assert result.shape == (sum(range(comm.size)), 2)


def rank_dependent(comm: mpicomm.Communicator, first: Any, others: Any) -> Any:
    """``first`` on the last rank, ``others`` elsewhere (a disagreement to detect)."""
    return first if comm.rank == comm.size - 1 else others


@pytest.mark.mpi(min_size=2)
def test_checked_mode_rejects_mismatches_on_every_rank(comm):
    assert comm.check
    p = comm.size
    n = rank_dependent(comm, 2 * p + p, 2 * p)
    dtype = rank_dependent(comm, np.float64, np.float32)
    before = comm.traffic.snapshot()
    shaped = [lambda: mpicomm.allreduce(np.ones(n, np.float32), comm=comm),
              lambda: mpicomm.allgather(np.ones(n, np.float32), comm=comm),
              lambda: mpicomm.broadcast(np.ones(n, np.float32), comm=comm),
              lambda: mpicomm.reduce_scatter(np.ones(n, np.float32), comm=comm)]
    for call in shaped:
        with pytest.raises(ValueError, match="checked mode: .*shape"):
            call()
    typed = [lambda: mpicomm.allreduce(np.ones(p, dtype), comm=comm),
             lambda: mpicomm.allgather(np.ones(p, dtype), comm=comm),
             lambda: mpicomm.broadcast(np.ones(p, dtype), comm=comm),
             lambda: mpicomm.reduce_scatter(np.ones(p, dtype), comm=comm)]
    for call in typed:
        with pytest.raises(ValueError, match="checked mode: .*dtype"):
            call()
    x = np.ones(p, np.float32)
    op = rank_dependent(comm, "max", "sum")
    with pytest.raises(ValueError, match="checked mode: .*op"):
        mpicomm.allreduce(x, op=op, comm=comm)
    with pytest.raises(ValueError, match="checked mode: .*op"):
        mpicomm.reduce_scatter(x, op=op, comm=comm)
    with pytest.raises(ValueError, match="checked mode: .*root"):
        mpicomm.broadcast(x, root=rank_dependent(comm, 1, 0), comm=comm)
    algorithm = rank_dependent(comm, "mpi", "ring")
    for call in (lambda: mpicomm.allreduce(x, algorithm=algorithm, comm=comm),
                 lambda: mpicomm.allgather(x, algorithm=algorithm, comm=comm),
                 lambda: mpicomm.reduce_scatter(x, algorithm=algorithm, comm=comm)):
        with pytest.raises(ValueError, match="checked mode: .*algorithm"):
            call()
    assert comm.traffic.snapshot() == before
    np.testing.assert_array_equal(mpicomm.allreduce(x, comm=comm), np.full(p, p))


# ---------------------------------------------------------------------- traffic
def measure(comm: mpicomm.Communicator, call: Callable[[], Any]) -> Traffic:
    before = comm.traffic.snapshot()
    call()
    return comm.traffic.snapshot() - before


def lowest_bit(x: int) -> int:
    return x & -x


TRAFFIC_SIZES = [1, 3, 11, 64, 1001]


@pytest.mark.parametrize("n", TRAFFIC_SIZES)
def test_traffic_ring_allreduce(comm, n):
    """Reduce-scatter pass: every block but the one a rank finishes (block r+1) is sent
    once (forwarded after reducing); allgather pass: every block but r+2 is sent. A rank
    receives all blocks but r (first pass) and r+1 (second pass). One message per
    non-empty block sent (segments are 1 MiB, larger than these messages)."""
    p, r, item = comm.size, comm.rank, 4
    sizes = np.diff(block_bounds(n, p))
    t = measure(comm, lambda: mpicomm.allreduce(np.ones(n, np.float32), algorithm="ring",
                                                comm=comm))
    if p == 1:
        assert t == Traffic()
        return
    sent_blocks = [b for b in range(p) if b != (r + 1) % p] + \
                  [b for b in range(p) if b != (r + 2) % p]
    assert t.sent_bytes == item * (2 * n - sizes[(r + 1) % p] - sizes[(r + 2) % p])
    assert t.recv_bytes == item * (2 * n - sizes[r] - sizes[(r + 1) % p])
    assert t.messages == sum(1 for b in sent_blocks if sizes[b])
    if n % p == 0:  # the textbook figure: 2(p-1)/p * n each way
        assert t.sent_bytes == t.recv_bytes == item * 2 * (p - 1) * n // p


@pytest.mark.parametrize("n", TRAFFIC_SIZES)
def test_traffic_recursive_doubling_allreduce(comm, n):
    """n bytes per round over lg p2 rounds; folded pairs add one n-byte message each way
    (even rank: only those two messages)."""
    p, r, nbytes = comm.size, comm.rank, 8 * n
    p2, rem = fold_layout(p)
    rounds = int(math.log2(p2))
    t = measure(comm, lambda: mpicomm.allreduce(np.ones(n), algorithm="recursive_doubling",
                                                comm=comm))
    if r < 2 * rem and r % 2 == 0:
        expected = (nbytes, nbytes, 1)
    elif r < 2 * rem:
        expected = ((rounds + 1) * nbytes, (rounds + 1) * nbytes, rounds + 1)
    else:
        expected = (rounds * nbytes, rounds * nbytes, rounds)
    assert (t.sent_bytes, t.recv_bytes, t.messages) == expected


@pytest.mark.parametrize("n", TRAFFIC_SIZES)
def test_traffic_rabenseifner_allreduce_total(comm, n):
    """Summed over ranks: each halving step moves the whole vector once per pair group,
    (p2-1)·n over the halving and as much over the doubling, plus 2n per folded pair."""
    p = comm.size
    p2, rem = fold_layout(p)
    t = measure(comm, lambda: mpicomm.allreduce(np.ones(n, np.int32), algorithm="rabenseifner",
                                                comm=comm))
    total = comm.allreduce_value(t.sent_bytes)
    assert total == comm.allreduce_value(t.recv_bytes)
    assert total == 4 * (2 * (p2 - 1) * n + 2 * rem * n)
    if p == p2 and n % p == 0:
        assert t.sent_bytes == 4 * 2 * (p - 1) * n // p


@pytest.mark.parametrize("m", [1, 5, 300])
@pytest.mark.parametrize("algorithm", ["ring", "bruck", "direct"])
def test_traffic_allgather(comm, algorithm, m):
    """Ring, Bruck and direct all send and receive exactly the p-1 blocks a rank lacks;
    ring and direct in p-1 messages, Bruck in ⌈lg p⌉."""
    p = comm.size
    t = measure(comm, lambda: mpicomm.allgather(np.ones(m, np.int16), algorithm=algorithm,
                                                comm=comm))
    assert t.sent_bytes == t.recv_bytes == 2 * m * (p - 1)
    assert t.messages == (math.ceil(math.log2(p)) if algorithm == "bruck" else p - 1)


@pytest.mark.parametrize("algorithm", ALGORITHMS["allgatherv"][:-1])
def test_traffic_allgatherv(comm, algorithm):
    """Each rank receives every other rank's rows once and sends its own rows to p-1
    ranks (forwarded along the ring, or directly); empty contributions send nothing."""
    p, r = comm.size, comm.rank
    rows = [(q * 3) % 4 for q in range(p)]  # rank 0 (and every 4th) contributes nothing
    t = measure(comm, lambda: mpicomm.allgatherv(np.ones((rows[r], 2), np.float32),
                                                 algorithm=algorithm, comm=comm))
    assert t.recv_bytes == 8 * (sum(rows) - rows[r])
    if algorithm == "direct":
        assert t.sent_bytes == 8 * rows[r] * (p - 1)
        assert t.messages == (p - 1 if rows[r] else 0)
    assert comm.allreduce_value(t.sent_bytes) == comm.allreduce_value(t.recv_bytes)


@pytest.mark.parametrize("m", [1, 7])
def test_traffic_recursive_doubling_allgather(comm, m):
    """Unfolded ranks receive the p-1 blocks they lack; the even rank of a folded pair
    sends its block and receives the whole result."""
    p, r = comm.size, comm.rank
    _, rem = fold_layout(p)
    t = measure(comm, lambda: mpicomm.allgather(np.ones(m), algorithm="recursive_doubling",
                                                comm=comm))
    if r < 2 * rem and r % 2 == 0:
        assert (t.sent_bytes, t.recv_bytes, t.messages) == (8 * m, 8 * m * p, 1)
    else:
        assert t.recv_bytes == 8 * m * (p - 1)
    assert comm.allreduce_value(t.sent_bytes) == comm.allreduce_value(t.recv_bytes)


@pytest.mark.parametrize("n", [1, 4, 999])
def test_traffic_binomial_broadcast(comm, n):
    """Every non-root receives the vector once; each node sends it once per child."""
    p = comm.size
    for root in range(p):
        rel = (comm.rank - root) % p
        t = measure(comm, lambda root=root: mpicomm.broadcast(
            np.ones(n, np.float32), root=root, algorithm="binomial", comm=comm))
        children = binomial_children(rel, p)
        assert t.recv_bytes == (4 * n if rel else 0)
        assert t.sent_bytes == 4 * n * len(children)
        assert t.messages == len(children)
        # the tree spans all ranks: p - 1 edges
        assert comm.allreduce_value(len(children)) == p - 1


@pytest.mark.parametrize("n", [1, 10, 1001])
def test_traffic_scatter_allgather_broadcast(comm, n):
    """Binomial scatter of the chunks below each subtree, then a ring allgather that sends
    every chunk but (rel+1) and receives every chunk but rel."""
    p = comm.size
    chunk = np.diff(block_bounds(n, p))
    for root in range(p):
        rel = (comm.rank - root) % p
        t = measure(comm, lambda root=root: mpicomm.broadcast(
            np.ones(n, np.float32), root=root, algorithm="scatter_allgather", comm=comm))
        if p == 1:
            assert t == Traffic()
            continue
        got = chunk[rel:rel + lowest_bit(rel)].sum() if rel else 0
        scattered = sum(chunk[c:c + (c - rel)].sum() for c in binomial_children(rel, p))
        assert t.recv_bytes == 4 * (got + n - chunk[rel])
        assert t.sent_bytes == 4 * (scattered + n - chunk[(rel + 1) % p])


@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_halving", "direct"])
def test_traffic_reduce_scatter(comm, algorithm, m):
    """Ring and direct: each rank sends and receives the p-1 blocks it does not end with,
    in p-1 messages. Recursive halving, summed over ranks: (p2-1)·N over the halving, N
    per folded pair going in and m (the even rank's block) coming back."""
    p, N = comm.size, comm.size * m
    p2, rem = fold_layout(p)
    t = measure(comm, lambda: mpicomm.reduce_scatter(np.ones(N), algorithm=algorithm,
                                                     comm=comm))
    if algorithm in ("ring", "direct"):
        assert t.sent_bytes == t.recv_bytes == 8 * m * (p - 1)
        assert t.messages == p - 1
    else:
        total = comm.allreduce_value(t.sent_bytes)
        assert total == comm.allreduce_value(t.recv_bytes)
        assert total == 8 * ((p2 - 1) * N + rem * N + rem * m)


def test_traffic_of_empty_and_native_calls_is_zero(comm):
    """Nothing is sent for empty buffers; the MPI library's own collectives are not ours."""
    for name, algorithms in ALGORITHMS.items():
        fn = getattr(mpicomm, name)
        for algorithm in algorithms:
            t = measure(comm, lambda fn=fn, algorithm=algorithm: fn(
                np.ones(0, np.float32), algorithm=algorithm, comm=comm))
            assert t == Traffic()
        t = measure(comm, lambda fn=fn: fn(np.ones(comm.size, np.float32), algorithm="mpi",
                                           comm=comm))
        assert t == Traffic()


@pytest.mark.parametrize("n", [1, 77])
def test_traffic_is_conserved(comm, n):
    """Summed over ranks, every own algorithm receives exactly the bytes it sends."""
    p = comm.size
    x = np.ones(n * p, np.float32)
    for name, algorithms in ALGORITHMS.items():
        fn = getattr(mpicomm, name)
        for algorithm in (a for a in algorithms if a != "mpi"):
            t = measure(comm, lambda fn=fn, algorithm=algorithm: fn(x, algorithm=algorithm,
                                                                   comm=comm))
            assert comm.allreduce_value(t.sent_bytes) == comm.allreduce_value(t.recv_bytes)
            if p > 1:
                assert comm.allreduce_value(t.messages) > 0
