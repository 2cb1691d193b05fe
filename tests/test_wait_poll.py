"""Waiting by test + sleep (``Communicator.wait_poll_s``, :func:`mpicomm.comm.wait_all`).

Every collective algorithm gives bit-identical results whether it blocks in MPI or tests
its requests and sleeps in between; the setting is inherited by dup/split and checked.
Runs at every rank count of ``make test`` (1..5).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicomm
from mpicomm.collectives import ALGORITHMS
from mpicomm.comm import Communicator, wait_all


def _inputs(comm, n: int = 1003) -> np.ndarray:
    return np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)


@pytest.mark.mpi
def test_every_algorithm_gives_the_same_bits_when_polling(comm):
    blocking, polling = comm.dup(), comm.dup()
    polling.wait_poll_s = 1e-4
    try:
        x = _inputs(comm, 1003 * comm.size)
        for algorithm in ALGORITHMS["allreduce"]:
            want = mpicomm.allreduce(x, "sum", algorithm, comm=blocking)
            got = mpicomm.allreduce(x, "sum", algorithm, comm=polling)
            assert got.tobytes() == want.tobytes(), algorithm
        for algorithm in ALGORITHMS["reduce_scatter"]:
            want = mpicomm.reduce_scatter(x, "sum", algorithm, comm=blocking)
            got = mpicomm.reduce_scatter(x, "sum", algorithm, comm=polling)
            assert got.tobytes() == want.tobytes(), algorithm
        for algorithm in ALGORITHMS["allgather"]:
            want = mpicomm.allgather(x[:7], algorithm, comm=blocking)
            got = mpicomm.allgather(x[:7], algorithm, comm=polling)
            assert got.tobytes() == want.tobytes(), algorithm
        for algorithm in ALGORITHMS["broadcast"]:
            want = mpicomm.broadcast(x, comm.size - 1, comm=blocking, algorithm=algorithm)
            got = mpicomm.broadcast(x, comm.size - 1, comm=polling, algorithm=algorithm)
            assert got.tobytes() == want.tobytes(), algorithm
    finally:
        polling.free()
        blocking.free()


@pytest.mark.mpi
def test_the_setting_is_inherited_and_checked(comm):
    parent = comm.dup()
    try:
        parent.wait_poll_s = 2e-4
        child = parent.dup()
        part = parent.split(0)
        assert child.wait_poll_s == part.wait_poll_s == 2e-4
        part.free()
        child.free()
    finally:
        parent.free()
    for bad, kind in ((0, ValueError), (1.5, ValueError), ("fast", TypeError),
                      (True, TypeError)):
        with pytest.raises(kind, match="wait_poll_s"):  # local check, before any Dup
            Communicator(MPI.COMM_WORLD, wait_poll_s=bad)


@pytest.mark.mpi
def test_wait_all_completes_requests_by_polling(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out, got = np.full(3, comm.rank, dtype=np.int64), np.empty(3, dtype=np.int64)
    wait_all([comm.p2p.Irecv(got, left, 7), comm.p2p.Isend(out, right, 7)], 1e-4)
    assert (got == left).all()
    wait_all([], 1e-4)  # nothing to wait for
