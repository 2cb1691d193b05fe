"""The parameter server's messages: one contiguous byte buffer per request or reply.

Layout (all little-endian, native MPI bytes)::

    int64[8]  fixed header: op, key id, piece index, a, b, c, d, number of arrays n
    int64[2n] per array: dtype code, element count
    bytes     the arrays, each padded to 8 bytes

``a..d`` depend on ``op``: a push carries (sequence number, worker, step), a pull
(worker), a reply (staleness, pushes applied so far, version). One message per request
keeps the matching trivial (a matched probe receives it whole, so requests from many
workers never interleave) at the price of one copy of the payload into the buffer.

Also here: the polling waits (:class:`Backoff`). MPICH's blocking waits spin on a core; a
server or a worker held back by bounded staleness may wait for seconds, so every wait in
this package probes or tests, yields the CPU for the first 200 us of an idle period, then
sleeps with an exponential backoff from ``BACKOFF_MIN_S`` to 1 ms (so a reply after a
long idle period is late by at most 1 ms; a busy server never sleeps, nor does a rank
whose own sends are in flight). Both windows are settings (``MPICOMM_PS_SPIN_US``,
``MPICOMM_PS_MAX_SLEEP_US``): a longer spin window or shorter sleeps cut the latency of
push+pull right after an idle gap (the gap between steps) at the price of CPU time
while waiting; with compute steps much longer than the push+pull, the defaults cost
almost nothing. Measure with ``mpiexec -n 5 python -m mpicomm.bench ps --sections comm``
under each setting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from .. import vwire
from ..config import env_int
from ..tags import TAG_PS_CONTROL, TAG_PS_REPLY, TAG_PS_REQUEST, TAG_PS_STATE

__all__ = ["PUSH", "PULL", "CLOSE", "CKPT", "REPLY", "TAG_REQUEST", "TAG_REPLY", "TAG_CONTROL",
           "TAG_STATE", "Message", "pack", "unpack", "reply_nbytes", "Backoff",
           "wait_requests", "probe_wait"]

# operations
PUSH, PULL, CLOSE, CKPT, REPLY = 1, 2, 3, 4, 5
OP_NAMES = {PUSH: "push", PULL: "pull", CLOSE: "close", CKPT: "checkpoint", REPLY: "reply"}

# tags (the "ps" range of the registry mpicomm.tags)
TAG_REQUEST = TAG_PS_REQUEST   # binary
TAG_REPLY = TAG_PS_REPLY       # binary
TAG_CONTROL = TAG_PS_CONTROL   # pickled objects (init / restore, acks)
TAG_STATE = TAG_PS_STATE       # pickled object (checkpoint)

FIXED = 8
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


@dataclass
class Message:
    """A decoded message: the fixed header fields and the arrays (views of the buffer)."""

    op: int
    key_id: int
    piece: int
    a: int
    b: int
    c: int
    d: int
    arrays: list[torch.Tensor]


def _pad(n: int) -> int:
    return (n + 7) & ~7


def pack(op: int, key_id: int, piece: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0,
         arrays: Sequence[torch.Tensor] = ()) -> np.ndarray:
    """One message as a uint8 buffer (the arrays are copied in; CPU tensors)."""
    flat = [t.detach().reshape(-1) for t in arrays]
    head = FIXED + 2 * len(flat)
    sizes = [_pad(t.numel() * t.element_size()) for t in flat]
    buf = np.zeros(head * 8 + sum(sizes), dtype=np.uint8)
    words = buf[:head * 8].view(np.int64)
    words[:FIXED] = (op, key_id, piece, a, b, c, d, len(flat))
    pos = head * 8
    for i, (t, size) in enumerate(zip(flat, sizes)):
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send a {t.dtype} array")
        words[FIXED + 2 * i:FIXED + 2 * i + 2] = (_CODE[t.dtype], t.numel())
        nbytes = t.numel() * t.element_size()
        if nbytes:
            src = t.cpu().contiguous().view(torch.uint8).numpy()
            buf[pos:pos + nbytes] = src
        pos += size
    return buf


def unpack(buf: np.ndarray) -> Message:
    """Decode a buffer made by :func:`pack`; the arrays are torch views into ``buf``."""
    words = buf[:FIXED * 8].view(np.int64)
    n = int(words[7])
    desc = buf[FIXED * 8:(FIXED + 2 * n) * 8].view(np.int64)
    pos = (FIXED + 2 * n) * 8
    arrays = []
    raw = torch.from_numpy(buf)
    for i in range(n):
        dtype, numel = _DTYPES[int(desc[2 * i])], int(desc[2 * i + 1])
        nbytes = numel * dtype.itemsize
        arrays.append(raw[pos:pos + nbytes].view(dtype))
        pos += _pad(nbytes)
    return Message(*(int(w) for w in words[:7]), arrays)


def reply_nbytes(numel: int, itemsize: int) -> int:
    """Size of a pull reply carrying one array of ``numel`` elements."""
    return (FIXED + 2) * 8 + _pad(numel * itemsize)


class Backoff:
    """Yield the CPU for the first ``spin_s`` of an idle period, then sleep a little
    longer each time nothing happened (``min_s`` doubling up to ``max_s``); :meth:`busy`
    starts over.

    The first phase keeps replies fast (a probe every few microseconds, but the core is
    offered to other processes between probes: ``sched_yield``); the sleeps keep a rank
    that waits long off the CPU. ``idle(urgent=True)`` never sleeps: used while this
    rank's own sends are in flight, since a large message (MPI's rendezvous protocol)
    only moves when both sides call into MPI.
    """

    def __init__(self, min_s: float = 20e-6, max_s: float | None = None,
                 spin_s: float | None = None) -> None:
        if max_s is None:
            max_s = env_int("MPICOMM_PS_MAX_SLEEP_US", 1000, 1) * 1e-6
        if spin_s is None:
            spin_s = env_int("MPICOMM_PS_SPIN_US", 200, 0) * 1e-6
        self.min_s, self.max_s, self.spin_s = min_s, max(min_s, max_s), spin_s
        self.delay = 0.0
        self.since: float | None = None

    def idle(self, urgent: bool = False) -> None:
        now = time.perf_counter()
        if self.since is None:
            self.since = now
        if urgent or now - self.since < self.spin_s:
            time.sleep(0)
            return
        if self.delay:
            time.sleep(self.delay)
        self.delay = min(self.max_s, max(self.min_s, 2 * self.delay))

    def busy(self) -> None:
        self.delay = 0.0
        self.since = None


BACKOFF_MIN_S, BACKOFF_MAX_S = 20e-6, None  # None: MPICOMM_PS_MAX_SLEEP_US (1000 us)


def wait_requests(requests: list[MPI.Request]) -> None:
    """Complete ``requests`` without spinning a core (tests, then sleeps with backoff)."""
    backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
    while requests and not MPI.Request.Testall(requests):
        backoff.idle()


def probe_wait(comm: MPI.Intracomm, source: int, tag: int) -> tuple[MPI.Message, MPI.Status]:
    """A matched probe for a message from ``source`` with ``tag``, polling with backoff."""
    status = MPI.Status()
    if vwire.active():      # the virtual clock waits, timed (mpicomm.p2p.improbe)
        from ..p2p import improbe

        return improbe(comm, source, tag, status), status
    backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
    while True:
        msg = comm.improbe(source, tag, status)
        if msg is not None:
            return msg, status
        backoff.idle()
