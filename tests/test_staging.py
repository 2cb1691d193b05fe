"""Chunked, streamed staging of CUDA data (mpicomm.staging), checked on the CPU.

A stand-in stream (:class:`FakeStream`) plays the device: "device" arrays are CPU
tensors marked as CUDA, and queued copies run only when an event is waited for (in
issue order, like one CUDA stream), so an algorithm that read a pinned chunk before
waiting for its download, or returned before its uploads finished, would see stale
data. The real CUDA runs of the same paths are the ``gpu`` tests in test_buffers.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import mpicomm
from mpicomm import buffers, cudampi
from mpicomm.p2p import Ctx
from mpicomm.staging import Pipeline, StagingPool, staging_pool

from .test_buffers import needs_cuda, needs_cupy

CHUNK_BYTES = 40          # 10 float32 elements per staging copy
SEGMENT_BYTES = 64        # 16 float32 elements per ring segment


class FakeStream:
    """One device stream: copies are queued and run in order when an event is waited."""

    def __init__(self, log: list[tuple[Any, ...]], like: Any = None):
        self.log = log
        self.like = like
        self.queue: list[tuple[Any, Any]] = []
        self.ran = 0

    def _queue(self, kind: str, dst: Any, src: Any) -> int:
        self.queue.append((dst, src))
        self.log.append((kind, len(self.queue), int(dst.shape[0])))
        return len(self.queue)

    def download(self, host: Any, dev: Any) -> int:
        return self._queue("d2h", host, dev)

    def upload(self, dev: Any, host: Any) -> None:
        self._queue("h2d", dev, host)

    def event(self) -> int:
        return len(self.queue)

    def wait(self, event: int) -> None:
        self.log.append(("wait", event))
        for dst, src in self.queue[self.ran:event]:
            dst.copy_(src)
        self.ran = max(self.ran, event)

    def empty(self, shape: tuple[int, ...]) -> Any:
        return mark(torch.full(shape, float("nan"), dtype=self.like.dtype))


def mark(t: torch.Tensor) -> torch.Tensor:
    t._fake_cuda = True  # seen as cuda:1 by the patched inspect below
    return t


class FakeGPU:
    """Patches the buffer layer so that marked CPU tensors are staged CUDA data."""

    def __init__(self, monkeypatch: Any):
        self.log: list[tuple[Any, ...]] = []
        self.allocations: list[int] = []
        real_inspect = buffers.inspect

        def inspect(x: Any) -> buffers.BufferInfo:
            info = real_inspect(x)
            if getattr(x, "_fake_cuda", False):
                info = dataclasses.replace(info, device="cuda:1")
            return info

        def allocate(info: buffers.BufferInfo, numel: int) -> Any:
            self.allocations.append(numel)
            return torch.full((numel,), float("nan"), dtype=getattr(torch, info.dtype))

        monkeypatch.setattr(buffers, "inspect", inspect)
        monkeypatch.setattr(buffers, "cuda_aware", lambda: False)
        monkeypatch.setattr(buffers, "device_io", lambda x, fw: FakeStream(self.log, x))
        monkeypatch.setattr(StagingPool, "_allocate", staticmethod(allocate))
        monkeypatch.setenv("MPICOMM_STAGING_CHUNK_BYTES", str(CHUNK_BYTES))
        monkeypatch.setenv("MPICOMM_RING_SEGMENT_BYTES", str(SEGMENT_BYTES))
        for name in ("send", "recv", "sendrecv", "isend", "irecv"):
            self._log_calls(monkeypatch, name)

    def _log_calls(self, monkeypatch: Any, name: str) -> None:
        real = getattr(Ctx, name)
        log = self.log

        def logged(ctx: Ctx, *args: Any) -> Any:
            log.append((name,))
            return real(ctx, *args)

        monkeypatch.setattr(Ctx, name, logged)


@pytest.fixture
def fake_gpu(monkeypatch) -> FakeGPU:
    return FakeGPU(monkeypatch)


@pytest.fixture
def real_staging(monkeypatch):
    """Real device buffers staged through host memory (CUDA-aware MPI off) in the test's
    small chunks and ring segments; the cached CUDA-aware probe is cleared around it."""
    cudampi._probe_cuda_aware.cache_clear()
    monkeypatch.setenv("MPICOMM_CUDA_AWARE", "0")
    monkeypatch.setenv("MPICOMM_STAGING_CHUNK_BYTES", str(CHUNK_BYTES))
    monkeypatch.setenv("MPICOMM_RING_SEGMENT_BYTES", str(SEGMENT_BYTES))
    yield
    cudampi._probe_cuda_aware.cache_clear()


@pytest.fixture
def own_comm(comm):
    c = comm.dup()
    yield c
    c.free()


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32).reshape(-1).tolist()


# ---------------------------------------------------------------------- Pipeline (serial)
def test_pipeline_cuts_chunks_at_multiples_and_waits_for_the_newest_needed():
    log: list[tuple[Any, ...]] = []
    stream = FakeStream(log)
    dev = torch.arange(25, dtype=torch.float32)
    host = torch.zeros(25)
    pipe = Pipeline(stream, host, torch.zeros(25), chunk=10)
    pipe.prefetch(dev, 0, [(20, 25), (3, 20), (0, 3)])
    assert [e[2] for e in log] == [5, 7, 10, 3]       # pieces cut at 10, 20
    pipe.need(12, 14)                                 # only the piece 10:20 (event 3)
    assert log[-1] == ("wait", 3)
    assert host[20:].tolist() == list(range(20, 25)) and host[:3].tolist() == [0] * 3
    pipe.need(20, 25)                                 # event 1 ran before 3: no wait
    assert log[-1] == ("wait", 3)
    pipe.need(0, 1)
    assert log[-1] == ("wait", 4) and host.tolist() == list(range(25))
    pipe.final(5, 8)
    pipe.final(8, 12)                                 # contiguous, < 10: coalesced
    assert log[-1] == ("wait", 4)                     # nothing queued yet
    pipe.final(12, 16)                                # 5:16 reaches a chunk: queued
    assert [e for e in log if e[0] == "h2d"] == [("h2d", 5, 5), ("h2d", 6, 6)]
    pipe.final(20, 25)
    pipe.final(16, 20)                                # not contiguous: 20:25 queued
    assert pipe.dev_out[5:].tolist() == [0] * 20      # nothing ran before the drain
    pipe.drain()
    assert log[-1] == ("wait", 8)                     # one event after all 8 copies
    assert pipe.uploaded == 20 and pipe.dev_out[5:].tolist() == list(range(5, 25))
    assert pipe.dev_out[:5].tolist() == [0] * 5


def test_pipeline_rejects_a_zero_chunk():
    with pytest.raises(ValueError, match="chunk"):
        Pipeline(FakeStream([]), torch.zeros(1), None, chunk=0)


def test_staging_chunk_bytes_is_checked(monkeypatch):
    from mpicomm.config import STAGING_CHUNK_BYTES, staging_chunk_bytes

    monkeypatch.delenv("MPICOMM_STAGING_CHUNK_BYTES", raising=False)
    assert staging_chunk_bytes() == STAGING_CHUNK_BYTES == 4 << 20
    monkeypatch.setenv("MPICOMM_STAGING_CHUNK_BYTES", "0")
    with pytest.raises(ValueError, match="MPICOMM_STAGING_CHUNK_BYTES"):
        staging_chunk_bytes()


def test_whole_buffer_staging_round_trip(fake_gpu):
    """The unstreamed path (1 rank, non-ring algorithms): chunked copies, waited."""
    x = mark(torch.randn(23))
    b = buffers.Buffer(x, {})
    assert b.staged
    host = b.input_view()
    assert bits(host) == bits(x)
    host.mul_(3)
    result = b.deliver(host, (23,))
    assert bits(result) == bits(x * 3)
    assert sum(1 for e in fake_gpu.log if e[0] == "d2h") == 3   # 23 elements, chunks of 10


# ---------------------------------------------------------------------- collectives
CASES = [
    ("allreduce", {"algorithm": "ring", "op": "sum"}),
    ("allreduce", {"algorithm": "ring", "op": "avg"}),
    ("allreduce", {"algorithm": "ring", "op": "max"}),
    ("allreduce", {"algorithm": "recursive_doubling", "op": "sum"}),
    ("allgather", {"algorithm": "ring"}),
    ("allgather", {"algorithm": "bruck"}),
    ("broadcast", {"algorithm": "scatter_allgather", "root": -1}),
    ("broadcast", {"algorithm": "binomial", "root": 0}),
    ("reduce_scatter", {"algorithm": "ring", "op": "avg"}),
    ("reduce_scatter", {"algorithm": "direct", "op": "sum"}),
]


def run(comm: Any, name: str, kwargs: dict[str, Any], x: Any, out: Any = None) -> Any:
    kwargs = dict(kwargs)
    if kwargs.get("root") == -1:
        kwargs["root"] = comm.size - 1
    return getattr(mpicomm, name)(x, comm=comm, out=out, **kwargs)


@pytest.mark.mpi
@pytest.mark.parametrize("name,kwargs", CASES, ids=lambda c: str(c))
def test_staged_results_are_bitwise_the_host_results(own_comm, fake_gpu, name, kwargs):
    """Odd sizes, sizes on chunk and segment boundaries, fresh and ``out=`` results."""
    comm = own_comm
    gen = torch.Generator().manual_seed(1234 + comm.rank)
    for n in (1, 7, 160, 1003):  # < p, odd, on chunk and segment edges, many segments
        data = torch.randn(n * (comm.size if name == "reduce_scatter" else 1),
                           generator=gen)
        expected = run(comm, name, kwargs, data.clone())
        got = run(comm, name, kwargs, mark(data.clone()))
        assert bits(got) == bits(expected), (name, kwargs, n)
        out = mark(torch.full_like(expected, float("nan")))
        assert run(comm, name, kwargs, mark(data.clone()), out=out) is out
        assert bits(out) == bits(expected), (name, kwargs, n, "out=")
        if name == "allreduce":
            inplace = mark(data.clone())
            run(comm, name, kwargs, inplace, out=inplace)
            assert bits(inplace) == bits(expected), (name, kwargs, n, "in place")


@pytest.mark.mpi
def test_staged_allgatherv_is_bitwise_the_host_result(own_comm, fake_gpu):
    comm = own_comm
    data = torch.randn(3 * comm.rank + 5, generator=torch.Generator().manual_seed(comm.rank))
    expected = mpicomm.allgatherv(data.clone(), comm=comm, algorithm="ring")
    got = mpicomm.allgatherv(mark(data.clone()), comm=comm, algorithm="ring")
    assert bits(got) == bits(expected)


@pytest.mark.mpi
def test_pinned_pool_is_reused_across_steps(own_comm, fake_gpu):
    comm = own_comm
    x = mark(torch.randn(1003))
    for _ in range(2):
        mpicomm.allreduce(x, algorithm="ring", comm=comm, out=x)
        mpicomm.allgather(x, algorithm="ring", comm=comm)
    pool_bytes, allocations = staging_pool(comm.resources).nbytes, len(fake_gpu.allocations)
    for _ in range(3):
        mpicomm.allreduce(x, algorithm="ring", comm=comm, out=x)
        mpicomm.allgather(x, algorithm="ring", comm=comm)
    assert staging_pool(comm.resources).nbytes == pool_bytes > 0
    assert len(fake_gpu.allocations) == allocations


@pytest.mark.mpi
def test_copies_overlap_the_ring_communication(own_comm, fake_gpu):
    """Every download is queued before the first message, the first message waits only
    for its own chunks (the rest are still in flight while it is sent), and uploads of
    finished segments are queued before the last receive is posted."""
    comm = own_comm
    if comm.size < 2:
        pytest.skip("the overlap needs communication (2 or more ranks)")
    n = 1000
    mpicomm.allreduce(mark(torch.randn(n)), algorithm="ring", comm=comm)
    log = fake_gpu.log
    kinds = [e[0] for e in log]
    downloads = [i for i, k in enumerate(kinds) if k == "d2h"]
    first_comm = next(i for i, k in enumerate(kinds) if k in ("isend", "irecv"))
    assert len(downloads) >= 2 * comm.size and downloads[-1] < first_comm
    waited_before = [e[1] for e in log[:first_comm] if e[0] == "wait"]
    assert waited_before and max(waited_before) < len(downloads)
    assert any(e[0] == "wait" for e in log[first_comm:])  # later chunks waited for later
    uploads = [i for i, k in enumerate(kinds) if k == "h2d"]
    last_recv = max(i for i, k in enumerate(kinds) if k == "irecv")
    assert uploads and uploads[0] < last_recv
    assert sum(log[i][2] for i in uploads) == n             # every element uploaded once


# ---------------------------------------------------------------------- real CUDA (gpu)
@pytest.mark.mpi
@needs_cuda
def test_real_cuda_streamed_staging_is_bitwise_the_host_result(own_comm, real_staging):
    """The same comparison with real CUDA tensors, async copies and events (TorchIO)."""
    comm = own_comm
    gen = torch.Generator().manual_seed(99 + comm.rank)
    for name, kwargs in CASES:
        for n in (7, 1003):
            data = torch.randn(n * (comm.size if name == "reduce_scatter" else 1),
                               generator=gen)
            expected = run(comm, name, kwargs, data.clone())
            dev = data.cuda()
            got = run(comm, name, kwargs, dev)
            assert got.device == dev.device
            assert bits(got.cpu()) == bits(expected), (name, kwargs, n)
            if name == "allreduce":
                run(comm, name, kwargs, dev, out=dev)
                assert bits(dev.cpu()) == bits(expected), (name, kwargs, n, "in place")


@pytest.mark.mpi
@needs_cupy
def test_real_cupy_streamed_staging_is_bitwise_the_host_result(own_comm, real_staging):
    """cupy through CupyIO (``get(blocking=False)`` / ``set`` on the array's stream)."""
    import cupy
    import numpy as np

    comm = own_comm
    rng = np.random.default_rng(comm.rank)
    for name, kwargs in CASES:
        n = 1003 * (comm.size if name == "reduce_scatter" else 1)
        data = rng.standard_normal(n).astype(np.float32)
        expected = run(comm, name, kwargs, data.copy())
        got = run(comm, name, kwargs, cupy.asarray(data))
        assert isinstance(got, cupy.ndarray)
        assert cupy.asnumpy(got).view(np.int32).tolist() == \
            expected.view(np.int32).tolist(), (name, kwargs)


@pytest.mark.mpi
def test_staging_waits_appear_on_the_timeline(own_comm, fake_gpu):
    from mpicomm.observe import trace

    with trace.recording(None, own_comm) as tl:
        mpicomm.allreduce(mark(torch.randn(500)), algorithm="ring", comm=own_comm)
    waits = [e for e in tl.events() if e.get("name") == "staging wait"]
    assert waits and all(e["cat"] == "staging" for e in waits)
    assert len(waits) == sum(1 for e in fake_gpu.log if e[0] == "wait")
