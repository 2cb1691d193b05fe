"""Chunked, asynchronous staging copies between a CUDA array and pinned host memory.

Under an MPI that is not CUDA-aware a device buffer travels through a pinned host buffer
(:class:`StagingPool`). Copying it whole and only then communicating
costs ``t_copy_in + t_comm + t_copy_out``. This module cuts the copies into chunks of at
most ``MPICOMM_STAGING_CHUNK_BYTES``, issues them *asynchronously on the buffer's own
stream* (torch: ``copy_(non_blocking=True)`` on ``torch.cuda.current_stream(device)``;
cupy: ``get``/``set`` with ``stream=`` and ``blocking=False``), and records one event per
chunk. The host waits for a chunk's event only right before MPI reads it, and uploads a
part of the result as soon as the algorithm says it is final, so the copy engine works
while the host communicates: ideally ``max(t_copy, t_comm)`` plus one chunk.

How the collectives use it (:class:`Pipeline`; hooks ``Ctx.need`` / ``Ctx.final`` in
:mod:`mpicomm.collectives._ring`)
    * all downloads are issued at once, in the order the algorithm will read the
      chunks (for the ring allreduce: block ``r``, ``r-1``, ...), before the first
      message; the algorithm waits chunk by chunk (``need``);
    * every segment a ring pass has finished (own block, then each segment as it
      arrives in the allgather pass) is uploaded at once (``final``) while the next
      segments are still being received; ``deliver`` waits for the last upload only.
    * Because downloads and uploads go to the same stream, an upload can never overtake
      a download issued before it: in-place calls (``out=buf``) are safe, and kernels
      queued earlier on that stream (the producer of the data) finish before the copy.

What is streamed and what is not (ours, not from a paper)
    * Streamed: ring allreduce (both halves), ring allgather / allgatherv, broadcast's
      scatter-allgather (uploads; the root needs its whole input for the scatter), ring
      reduce-scatter (downloads; its result, one block, is uploaded whole).
      These are the algorithms ``auto`` picks for large messages, where staging costs.
    * Whole-buffer (copies still chunked, but waited for all at once, then uploaded
      after the algorithm): recursive doubling / Rabenseifner / ``mpi`` allreduce,
      bruck / recursive-doubling / direct allgather, binomial broadcast, halving /
      direct / ``mpi`` reduce-scatter, and the sparse layer's ``Wire`` (a message of
      unknown length that a host rank must be able to receive in one piece). Their
      messages carry the whole buffer, or a reduction needs all of it, so there is
      nothing to overlap without changing the messages.
    * Why not split the *messages* into chunks with two small pinned buffers: it would
      change the message pattern, so a rank with host data and a rank with staged
      device data (both allowed) would no longer match, and chunking a ring reduction
      moves its block boundaries and hence the order of floating-point sums. Streaming
      the copies inside the existing segmented passes keeps every message and every
      arithmetic operation as it was: the result is bitwise the unstaged one.
      The pinned buffer is therefore the whole buffer (the ring reads all of it), taken
      from the communicator's pool and reused every step.

Tuning ``MPICOMM_STAGING_CHUNK_BYTES`` (default 4 MiB, a positive integer; it changes
no message, so ranks may differ): a chunk costs a copy launch and an event (~10-20 µs
of Python and driver time) and pinned copies run at ~25-55 GB/s, so 4 MiB (~80-160 µs of
copying) keeps the overhead near 10 %. Use smaller chunks (1 MiB, the default ring
segment) when buffers are only a few MiB, larger ones (16 MiB) when the host is slow.
Chunks are cut at multiples of the chunk size and at the algorithm's block edges, so a
ring segment larger than a chunk waits for several events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from .hooks import traced

__all__ = ["DeviceIO", "TorchIO", "CupyIO", "Pipeline", "device_io", "StagingPool",
           "staging_pool"]


class DeviceIO(Protocol):
    """Asynchronous copies on one device stream (what :class:`Pipeline` needs)."""

    def download(self, host: Any, dev: Any) -> Any:
        """Queue ``host[:] = dev`` on the stream; return an event that marks its end."""

    def upload(self, dev: Any, host: Any) -> None:
        """Queue ``dev[:] = host`` on the stream."""

    def event(self) -> Any:
        """An event marking the end of everything queued on the stream so far."""

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` has happened."""

    def empty(self, shape: tuple[int, ...]) -> Any:
        """A new device array of ``shape`` like the staged one (same dtype and device)."""


class TorchIO:
    """:class:`DeviceIO` for a CUDA tensor: the current stream of *its* device."""

    def __init__(self, x: Any):
        import torch

        self.torch = torch
        self.like = x
        self.stream = torch.cuda.current_stream(x.device)

    def _event(self) -> Any:
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def download(self, host: Any, dev: Any) -> Any:
        with self.torch.cuda.stream(self.stream):
            host.copy_(dev, non_blocking=True)
        return self._event()

    def upload(self, dev: Any, host: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)

    def event(self) -> Any:
        return self._event()

    def wait(self, event: Any) -> None:
        event.synchronize()

    def empty(self, shape: tuple[int, ...]) -> Any:
        return self.torch.empty(shape, dtype=self.like.dtype, device=self.like.device)


class CupyIO:
    """:class:`DeviceIO` for a cupy array: the current stream of *its* device."""

    def __init__(self, x: Any):
        import cupy

        self.cupy = cupy
        self.like = x
        with x.device:
            self.stream = cupy.cuda.get_current_stream()

    def _event(self) -> Any:
        with self.like.device:
            event = self.cupy.cuda.Event()
            event.record(self.stream)
        return event

    def download(self, host: Any, dev: Any) -> Any:
        with self.like.device:
            dev.get(stream=self.stream, out=host, blocking=False)
        return self._event()

    def upload(self, dev: Any, host: Any) -> None:
        with self.like.device:
            dev.set(host, stream=self.stream)

    def event(self) -> Any:
        return self._event()

    def wait(self, event: Any) -> None:
        event.synchronize()

    def empty(self, shape: tuple[int, ...]) -> Any:
        with self.like.device:
            return self.cupy.empty(shape, dtype=self.like.dtype)


def device_io(x: Any, framework: str) -> DeviceIO:
    """The :class:`DeviceIO` for the CUDA array ``x`` (torch or cupy)."""
    return TorchIO(x) if framework == "torch" else CupyIO(x)


class Pipeline:
    """Chunked asynchronous copies between device arrays and one pinned host array.

    ``host`` is the flat pinned work array the algorithm runs on; ``dev_out`` the flat
    device array the result goes to (same length and layout as ``host``).

    Downloads are the pieces of each requested range cut at multiples of ``chunk``
    elements; each gets its own event. Events are numbered in issue order, and since
    one stream runs its work in order, having waited for event ``k`` means every
    earlier copy is done: :meth:`need` waits only for the newest event it needs.
    Uploads need no event each: contiguous final parts are coalesced until they reach
    ``chunk`` elements (a ring delivers segments in order), then queued; :meth:`drain`
    queues the rest and waits for one event recorded after everything.
    """

    def __init__(self, io: DeviceIO, host: Any, dev_out: Any, chunk: int):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 element, got {chunk}")
        self.io = io
        self.host = host
        self.dev_out = dev_out
        self.chunk = chunk
        self._issued = 0       # download events so far (sequence numbers 1, 2, ...)
        self._done = 0         # every download up to this number has landed
        self._pending: dict[int, list[tuple[int, Any]]] = {}  # grid cell -> downloads
        self._up = (0, 0)      # final part not queued yet (coalescing)
        self._queued = False   # anything queued since the last drain
        self.uploaded = 0      # elements declared final so far

    def _pieces(self, a: int, b: int) -> Iterable[tuple[int, int]]:
        c = self.chunk
        lo = a
        while lo < b:
            hi = min((lo // c + 1) * c, b)
            yield lo, hi
            lo = hi

    def prefetch(self, dev_src: Any, host_lo: int, ranges: Iterable[tuple[int, int]]
                 ) -> None:
        """Queue downloads of ``dev_src`` into ``host[host_lo:]`` for the host ranges
        ``ranges`` (in that order: the order the algorithm will read them)."""
        for a, b in ranges:
            for lo, hi in self._pieces(a, b):
                event = self.io.download(self.host[lo:hi],
                                         dev_src[lo - host_lo:hi - host_lo])
                self._issued += 1
                self._queued = True
                self._pending.setdefault(lo // self.chunk, []).append((self._issued, event))

    def need(self, a: int, b: int) -> None:
        """Wait until every download overlapping ``host[a:b]`` has landed."""
        if not self._pending or b <= a:
            return
        newest: tuple[int, Any] | None = None
        for cell in range(a // self.chunk, (b - 1) // self.chunk + 1):
            for seq, event in self._pending.get(cell, ()):
                if seq > self._done and (newest is None or seq > newest[0]):
                    newest = (seq, event)
        if newest is not None:
            self._wait(newest[1])
            self._done = newest[0]

    def final(self, a: int, b: int) -> None:
        """``host[a:b]`` holds its final value: queue its upload (coalesced with the
        parts before it while they are contiguous and shorter than a chunk)."""
        if b <= a:
            return
        self.uploaded += b - a
        lo, hi = self._up
        if a != hi or hi == lo:
            self._flush()
            lo = a
        self._up = (lo, b)
        if b - lo >= self.chunk:
            self._flush()

    def _flush(self) -> None:
        lo, hi = self._up
        for a, b in self._pieces(lo, hi):
            self.io.upload(self.dev_out[a:b], self.host[a:b])
            self._queued = True
        self._up = (hi, hi)

    def download_all(self, dev_src: Any, host_lo: int = 0) -> None:
        """Copy all of ``dev_src`` into ``host[host_lo:]`` and wait for it."""
        n = int(dev_src.shape[0])
        self.prefetch(dev_src, host_lo, [(host_lo, host_lo + n)])
        self.need(host_lo, host_lo + n)

    @traced("staging wait", cat="staging")
    def _wait(self, event: Any) -> None:
        """The host waits for the copies (a span on the timeline when one records)."""
        self.io.wait(event)

    def drain(self) -> None:
        """Queue the last final part and wait for every copy queued so far (one event
        after all of them: one stream runs them in order)."""
        self._flush()
        if self._queued:
            self._wait(self.io.event())
            self._queued = False
            self._done = self._issued


# ---------------------------------------------------------------------- pinned buffers
class StagingPool:
    """Reusable pinned host buffers for CUDA data under an MPI that is not CUDA-aware.

    One buffer per (framework, dtype, slot); a request larger than the buffer held
    replaces it with one of twice the size (amortized growth), a smaller one gets a view.
    Not thread-safe: like its communicator, a pool serves one collective at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str, str], Any] = {}

    def get(self, info: Any, numel: int, slot: str) -> Any:
        key = (info.framework, info.dtype, slot)
        held = self._buffers.get(key)
        if held is None or held.shape[0] < numel:
            capacity = max(numel, 2 * held.shape[0] if held is not None else 0, 1)
            held = self._allocate(info, capacity)
            self._buffers[key] = held
        return held[:numel]

    @staticmethod
    def _allocate(info: Any, numel: int) -> Any:
        if info.framework == "torch":
            import torch

            return torch.empty(numel, dtype=getattr(torch, info.dtype), pin_memory=True)
        import cupyx

        return cupyx.empty_pinned((numel,), dtype=info.dtype)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self._buffers.values())


def staging_pool(resources: dict[str, Any]) -> StagingPool:
    """The pool kept in a communicator's ``resources`` (created on first use)."""
    pool = resources.get("staging")
    if pool is None:
        pool = resources["staging"] = StagingPool()
    return pool
