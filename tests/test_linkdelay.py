"""The emulated cluster's injected latency under mpiexec: host map through split
communicators, delayed own collectives, undelayed MPI collectives (1..5 ranks)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpicomm import collectives as coll
from mpicomm.emulate import linkdelay


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch):
    """Every rank on its own emulated host, 20 ms one-way."""
    monkeypatch.setenv(linkdelay.ENV_RANKS_PER_HOST, "1")
    monkeypatch.setenv(linkdelay.ENV_DELAY, "0.02")
    monkeypatch.delenv(linkdelay.ENV_DELAY_FILE, raising=False)
    return 0.02


@pytest.mark.mpi
def test_host_map_follows_world_ranks_through_splits(comm, monkeypatch):
    monkeypatch.setenv(linkdelay.ENV_RANKS_PER_HOST, "2")
    world = MPI.COMM_WORLD.Get_rank()
    sub = comm.split(world % 2, key=-world)  # reversed order inside each half
    try:
        ld = linkdelay.link_delay(sub)
        ranks = sub.mpi.allgather(world)
        assert ld.hosts == [r // 2 for r in ranks]
        assert ld.host == world // 2
        assert linkdelay.link_delay(sub) is ld  # built once per communicator
    finally:
        sub.free()


@pytest.mark.mpi
def test_own_ring_is_delayed_mpi_is_not(comm, emulated, monkeypatch):
    p = comm.size
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(linkdelay.time, "sleep", sleep)
    c = comm.dup()  # a fresh communicator reads the environment
    try:
        x = np.full(64, float(c.rank + 1), dtype=np.float32)
        timings, sleeps = {}, {}
        for algorithm in ("ring", "mpi"):
            c.barrier()
            slept.clear()
            start = time.perf_counter()
            y = coll.allreduce(x.copy(), algorithm=algorithm, comm=c)
            timings[algorithm] = c.allreduce_value(time.perf_counter() - start, "max")
            sleeps[algorithm] = list(slept)
            np.testing.assert_allclose(y, p * (p + 1) / 2)
        # own ring: 2(p-1) dependent steps, each one delayed send; MPI's own: bypassed
        assert sleeps["ring"] == [emulated] * (2 * (p - 1)), sleeps
        assert sleeps["mpi"] == [], sleeps
        assert timings["ring"] >= 2 * (p - 1) * emulated * 0.95, timings
    finally:
        c.free()


@pytest.mark.mpi
def test_sparse_wire_is_delayed(comm, emulated):
    import torch

    from mpicomm.sparse import gtopk

    c = comm.dup()
    try:
        idx = torch.tensor([c.rank, 100 + c.rank])
        val = torch.tensor([1.0, 2.0 + c.rank])
        c.barrier()
        start = time.perf_counter()
        gi, gv = gtopk(idx, val, 2, comm=c, size=1000)
        elapsed = c.allreduce_value(time.perf_counter() - start, "max")
        want = {0, 100} if c.size == 1 else {99 + c.size, 98 + c.size}
        assert set(gi.tolist()) == want, gi
        if c.size > 1:
            rounds = (c.size.bit_length() - 1) + (c.size & (c.size - 1) != 0)
            assert elapsed >= rounds * emulated * 0.9, (elapsed, rounds)
    finally:
        c.free()


@pytest.mark.mpi
def test_injected_link_delays_every_message_of_a_collective(comm, monkeypatch):
    """set_link: alpha + beta·bytes before each message mpicomm's own ring sends (the
    traffic counters count the same messages); MPI's own allreduce bypasses it."""
    slept: list[float] = []
    monkeypatch.setattr(linkdelay.time, "sleep", slept.append)
    c = comm.dup()
    try:
        linkdelay.set_link(c, 1e-4, 1e-8)
        x = np.ones(64, dtype=np.float32)
        with c.traffic.measure() as moved:
            coll.allreduce(x, algorithm="ring", comm=c)
        assert len(slept) == moved.messages == 2 * (c.size - 1)
        assert sum(slept) == pytest.approx(1e-4 * moved.messages + 1e-8 * moved.sent_bytes)
        slept.clear()
        coll.allreduce(x, algorithm="mpi", comm=c)
        assert slept == []
        linkdelay.set_link(c, None)
        coll.allreduce(x, algorithm="ring", comm=c)
        assert slept == []
    finally:
        c.free()


def test_no_environment_no_injector(monkeypatch):
    import types

    monkeypatch.delenv(linkdelay.ENV_RANKS_PER_HOST, raising=False)
    assert linkdelay.link_delay(types.SimpleNamespace(resources={})) is None
