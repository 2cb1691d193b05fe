"""Waiting by test + sleep (``Communicator.wait_poll_s``, :func:`mpicomm.comm.wait_all`).

Every collective algorithm gives bit-identical results whether it blocks in MPI or tests
its requests and sleeps in between; the setting is inherited by dup/split and checked.
Multi-rank tests run at every rank count of ``make test`` (1..5); the backoff is a
serial unit test.
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


@pytest.mark.mpi
def test_the_sparse_layer_gives_the_same_bits_when_polling(comm):
    import torch

    from mpicomm.sparse import artopk, gtopk, topk_allgather

    blocking, polling = comm.dup(), comm.dup()
    polling.wait_poll_s = 1e-4
    try:
        x = torch.from_numpy(_inputs(comm, 500))
        idx = torch.topk(x.abs(), 20).indices.sort().values
        runs = {
            "gtopk": lambda c: gtopk(idx, x[idx], 20, comm=c, size=500),
            "topk_allgather": lambda c: (topk_allgather(idx, x[idx], 500, comm=c),),
            "artopk": lambda c: artopk(x, 20, 0, comm=c),
        }
        for name, run in runs.items():
            want, got = run(blocking), run(polling)
            assert len(want) == len(got), name
            for a, b in zip(want, got):
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a, b), name
    finally:
        polling.free()
        blocking.free()


def test_polling_backs_off_from_a_sixteenth_to_the_interval(monkeypatch):
    from mpicomm import comm as comm_module

    slept: list[float] = []
    monkeypatch.setattr(comm_module.time, "sleep", slept.append)
    answers = iter([None, False, None, None, None, None, None, "done"])
    assert comm_module.poll_until(lambda: next(answers), 1.6e-3) == "done"
    assert slept == pytest.approx([1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3, 1.6e-3, 1.6e-3])
