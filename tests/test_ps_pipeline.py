"""Chunked pieces and the pipelined ``KVStore.push_pull`` (:mod:`mpicomm.ps`).

Multi-rank tests run every (servers, workers) split the rank count allows, as in
``ps_cases.py``; at one rank a parameter server cannot exist and they skip (the
configuration test checks the error instead).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
import torch

from mpicomm import hooks
from mpicomm.ps import KVStore
from mpicomm.ps.sharding import DEFAULT_CHUNK_BYTES, ShardPlan

from .ps_cases import finish, splits, worker_comm

torch.set_num_threads(1)

N = 1001          # float32 elements: 4004 bytes, not a multiple of any chunk below
CHUNK = 600       # bytes: 7 chunks of one piece, 4 per piece over two servers


def _grad(step: int, w: int, n: int = N) -> np.ndarray:
    return np.random.default_rng([step, w]).standard_normal(n).astype(np.float32)


def _steps(kv: KVStore, steps: int, pipelined: bool) -> list[np.ndarray]:
    """The values of key ``"w"`` after each of ``steps`` steps of this worker's
    ``_grad``: ``push_pull`` into the gradient itself, or ``push`` then ``pull``."""
    values = []
    for step in range(steps):
        g = _grad(step, kv.worker_rank)
        if pipelined:
            assert kv.push_pull("w", g, out=g) is g
            values.append(g.copy())
        else:
            kv.push("w", g)
            values.append(kv.pull("w"))
    return values


class _Order:
    """A recorder that keeps the parameter server's instants in the order they happen."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []

    def now(self) -> float:
        return 0.0

    def complete(self, name: str, start_us: float, end_us: float, cat: str = "",
                 **args: Any) -> None:
        pass

    def span(self, name: str, cat: str = "", **args: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def instant(self, name: str, cat: str = "", **args: Any) -> None:
        if cat == "ps":
            self.events.append((name, args["worker"], args["piece"]))


# ====================================================================== multi-rank
@pytest.mark.mpi
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_chunked_push_pull_equals_unchunked_bitwise(comm, monkeypatch, momentum):
    """Sync SGD (with and without momentum) through chunked pieces and ``push_pull``
    (``out`` = the pushed array itself) gives, step by step, bit for bit the values of
    the unchunked store's ``push`` then ``pull``, with the key split over the servers
    and a size no chunk divides."""
    monkeypatch.setenv("MPICOMM_PS_SPLIT_BYTES", "1024")
    steps = 4
    for servers, workers in splits(comm.size):
        got = {}
        for chunk in (CHUNK, 0):
            kv = KVStore(comm, servers=servers, mode="sync", lr=0.1, momentum=momentum,
                         chunk_bytes=chunk)
            if kv.is_worker:
                kv.init("w", np.linspace(-1, 1, N, dtype=np.float32))
                pieces = len(kv._worker.info("w").pieces)
                want = -(-N * 4 // (servers * CHUNK)) * servers if servers > 1 else 7
                assert pieces == (want if chunk else servers), (pieces, servers)
                got[chunk] = _steps(kv, steps, pipelined=bool(chunk))
            finish(kv)
        if comm.rank < workers:
            for step in range(steps):
                np.testing.assert_array_equal(got[CHUNK][step], got[0][step],
                                              err_msg=f"{servers} servers, step {step}")
        comm.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["compressor", "pull_compressor"])
def test_push_pull_of_a_compressed_store_is_push_then_pull(comm, monkeypatch, kind):
    """With a push or pull compressor no key is cut into chunks and ``push_pull`` is
    ``push`` then ``pull``: bit for bit the same values, step by step."""
    monkeypatch.setenv("MPICOMM_PS_SPLIT_BYTES", "1024")
    for servers, workers in splits(comm.size):
        got = {}
        for pipelined in (True, False):
            kv = KVStore(comm, servers=servers, mode="sync", lr=0.1, **{kind: "fp16"})
            if kv.is_worker:
                kv.init("w", np.linspace(-1, 1, N, dtype=np.float32))
                assert len(kv._worker.info("w").pieces) == servers
                got[pipelined] = _steps(kv, 3, pipelined)
            finish(kv)
        if comm.rank < workers:
            for a, b in zip(got[True], got[False]):
                np.testing.assert_array_equal(a, b)
        comm.barrier()


@pytest.mark.mpi
def test_push_pull_applies_every_push_once_in_every_mode(comm, monkeypatch):
    """Chunked ``push_pull`` in sync, async and SSP: after ``steps`` pushes of ones per
    worker the value is ``steps`` updates of ``-lr`` (sync) or ``steps * W`` of
    ``-lr / W`` (async, SSP) on every element, each chunk
    was updated once per push (sync: once per step) and answered once per push; the
    torch ``out=`` and new-array forms return the same."""
    monkeypatch.setenv("MPICOMM_PS_SPLIT_BYTES", "1024")
    lr, steps = 0.25, 3
    for servers, workers in splits(comm.size):
        for mode in ("sync", "async", "ssp"):
            kw = {"staleness": 1} if mode == "ssp" else {}
            kv = KVStore(comm, servers=servers, mode=mode, lr=lr, chunk_bytes=CHUNK, **kw)
            wc = worker_comm(comm, servers)
            if kv.is_worker:
                kv.init("w", np.zeros(N, dtype=np.float32))
                for step in range(steps):
                    ones = torch.ones(N)
                    out = (kv.push_pull("w", ones.numpy()) if step % 2 else
                           kv.push_pull("w", ones, out=torch.empty(N)))
                    assert out.shape == (N,)
                wc.barrier()   # every push is in before the final pull
                ref = torch.zeros(N)
                if mode == "sync":   # one update per step: the sum's mean
                    for _ in range(steps):
                        ref.add_(torch.full((N,), float(workers)) / workers, alpha=-lr)
                else:                # one update per push, scaled by 1/W
                    for _ in range(steps * workers):
                        ref.add_(torch.ones(N) / workers, alpha=-lr)
                assert torch.equal(torch.from_numpy(kv.pull("w")), ref), (mode, servers)
                wc.free()
            stats = finish(kv)
            if kv.is_server:
                held = len(kv._server.pieces)
                assert stats["updates"] == steps * (1 if mode == "sync" else workers) * held
                assert stats["pulls"] == (steps + 1) * workers * held, stats
                assert stats["duplicates"] == 0
            comm.barrier()


@pytest.mark.mpi
def test_server_answers_chunk_0_before_the_last_chunk_arrives(comm):
    """The overlap, by message order: a server answers a worker's chunk 0 before it
    receives that worker's last chunk (sync with one worker, async with every worker:
    nothing else holds the reply back), so replies go out while the push still
    arrives. With ``chunk_bytes=0`` the reply follows the whole push."""
    for servers, workers in splits(comm.size):
        modes = ["async"] + (["sync"] if workers == 1 else [])
        for mode in modes:
            for chunk in (CHUNK, 0):
                kv = KVStore(comm, servers=servers, mode=mode, lr=0.1, chunk_bytes=chunk)
                order = _Order()
                if kv.is_worker:
                    kv.init("w", np.zeros(N, dtype=np.float32))
                    kv.push_pull("w", _grad(0, kv.worker_rank))
                    kv.close()
                    continue
                previous = hooks.set_recorder(order)
                try:
                    kv.serve()
                finally:
                    hooks.set_recorder(previous)
                pieces = sorted({p for _, _, p in order.events})
                for w in range(workers):
                    mine = [(name, p) for name, v, p in order.events if v == w]
                    assert [p for name, p in mine if name == "ps push"] == \
                        [p for name, p in mine if name == "ps reply"]
                    if not pieces:
                        continue
                    first_reply = mine.index(("ps reply", pieces[0]))
                    last_push = mine.index(("ps push", pieces[-1]))
                    if chunk:
                        assert len(pieces) > 1 and first_reply < last_push, mine
                    else:
                        assert first_reply > last_push, mine
            comm.barrier()


@pytest.mark.mpi
def test_checkpoint_of_a_chunked_store_restores_into_other_chunks(comm, monkeypatch):
    """A snapshot taken with one chunk size restores into a store with another (or
    none) and the run continues bit for bit, every push applied once."""
    monkeypatch.setenv("MPICOMM_PS_SPLIT_BYTES", "1024")
    for servers, workers in splits(comm.size):
        finals = {}
        for second in (CHUNK, 1000, 0):
            kv = KVStore(comm, servers=servers, mode="sync", optimizer="adam", lr=0.01,
                         chunk_bytes=CHUNK)
            snap = None
            if kv.is_worker:
                kv.init("w", np.linspace(0, 1, N, dtype=np.float32))
                for step in range(2):
                    kv.push_pull("w", _grad(step, kv.worker_rank))
                snap = kv.snapshot()
            finish(kv)
            kv = KVStore(comm, servers=servers, mode="sync", optimizer="adam", lr=0.01,
                         chunk_bytes=second)
            if kv.is_worker:
                kv.restore(snap if kv.worker_rank == 0 else "")
                for step in range(2, 4):
                    finals[second] = kv.push_pull("w", _grad(step, kv.worker_rank))
            stats = finish(kv)
            if kv.is_server:
                assert stats["updates"] == 2 * len(kv._server.pieces)
                assert stats["duplicates"] == 0
        if comm.rank < workers:
            np.testing.assert_array_equal(finals[CHUNK], finals[1000])
            np.testing.assert_array_equal(finals[CHUNK], finals[0])
        comm.barrier()


@pytest.mark.mpi
def test_bad_chunk_bytes_raise_everywhere(comm):
    servers = 1 if comm.size > 1 else 0   # at one rank every store is refused first
    for kwargs in (dict(chunk_bytes=-1), dict(chunk_bytes=1.5),
                   dict(chunk_bytes=4096, compressor="topk"),
                   dict(chunk_bytes=4096, pull_compressor="fp16")):
        with pytest.raises(ValueError):
            KVStore(comm, servers=servers, **kwargs)


# ====================================================================== serial
def test_chunks_cut_each_servers_piece():
    plan = ShardPlan(2, split_bytes=1024, chunk_bytes=1000)
    pieces = plan.place(0, 1001, 4)   # 2000 bytes on server 0, 2004 on server 1
    assert [(p.index, p.server, p.chunk) for p in pieces] == \
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 1, 2)]
    assert [p.start for p in pieces] == [0, 250, 500, 667, 834]
    assert pieces[-1].stop == 1001 and all(a.stop == b.start for a, b in
                                           zip(pieces, pieces[1:]))
    assert plan.load == [2000, 2004]
    assert len(ShardPlan(1, chunk_bytes=0).place(0, 1 << 20, 4)) == 1
    assert len(ShardPlan(1, chunk_bytes=1 << 20).place(0, 1 << 20, 4)) == 4
    assert len(ShardPlan(1, chunk_bytes=1).place(0, 3, 4)) == 3   # at most one per element
    assert len(ShardPlan(1, chunk_bytes=8).place(0, 0, 4)) == 1   # an empty key: one piece
    assert ShardPlan(1).chunk_bytes == 0   # the store decides: no policy of its own
    with pytest.raises(ValueError):
        ShardPlan(1, chunk_bytes=-1)


def test_chunk_bytes_from_environment(monkeypatch):
    """The variable is read in one place, the store's, and a bad value names it."""
    from mpicomm.ps.kvstore import _chunk_bytes

    monkeypatch.setenv("MPICOMM_PS_CHUNK_BYTES", "4096")
    assert ShardPlan(1).chunk_bytes == 0 and _chunk_bytes(None, False, 1) == 4096
    monkeypatch.setenv("MPICOMM_PS_CHUNK_BYTES", "-3")
    with pytest.raises(ValueError, match="MPICOMM_PS_CHUNK_BYTES"):
        _chunk_bytes(None, False, 1)


def test_chunks_by_default_only_across_hosts(monkeypatch):
    """Unset, ``chunk_bytes`` is ``DEFAULT_CHUNK_BYTES`` where the ranks span hosts and 0 on
    one host (shared memory: nothing to overlap); the variable and the argument win; a
    compressed store cuts none."""
    from mpicomm.ps.kvstore import _chunk_bytes

    monkeypatch.delenv("MPICOMM_PS_CHUNK_BYTES", raising=False)
    assert _chunk_bytes(None, False, 1) == 0
    assert _chunk_bytes(None, False, 2) == DEFAULT_CHUNK_BYTES
    assert _chunk_bytes(None, True, 2) == 0
    assert _chunk_bytes(4096, False, 1) == 4096
    monkeypatch.setenv("MPICOMM_PS_CHUNK_BYTES", "8192")
    assert _chunk_bytes(None, False, 1) == 8192 and _chunk_bytes(None, False, 4) == 8192


def test_waits_poll_without_sleeping_where_every_rank_has_a_core(monkeypatch):
    """The spin window: ``SPIN_DEDICATED_US`` when the host has no more ranks than cores,
    ``SPIN_SHARED_US`` when it has more or nothing reported it; the variable wins."""
    from mpicomm.emulate.mpienv import usable_cores
    from mpicomm.ps import wire

    monkeypatch.delenv("MPICOMM_PS_SPIN_US", raising=False)
    monkeypatch.setattr(wire, "_dedicated", False)
    assert wire.spin_window_s() == wire.SPIN_SHARED_US * 1e-6
    wire.set_host_ranks(usable_cores())
    assert wire.spin_window_s() == wire.SPIN_DEDICATED_US * 1e-6
    assert wire.Backoff().spin_s == wire.SPIN_DEDICATED_US * 1e-6
    wire.set_host_ranks(usable_cores() + 1)
    assert wire.spin_window_s() == wire.SPIN_SHARED_US * 1e-6
    monkeypatch.setenv("MPICOMM_PS_SPIN_US", "50")
    assert wire.Backoff().spin_s == pytest.approx(50e-6)
