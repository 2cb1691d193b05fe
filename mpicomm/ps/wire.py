"""The parameter server's messages: one contiguous byte buffer per request or reply.

Layout (all little-endian, native MPI bytes)::

    int64[8]  fixed header: op, key id, piece index, a, b, c, d, number of arrays n
    int64[2|n|] per array: dtype code, element count
    bytes     the arrays, each padded to 8 bytes (only if n >= 0)

``a..d`` depend on ``op``: a push carries (sequence number, worker, step, then), a pull
(worker), a reply (staleness, pushes applied so far, version). ``then = PULL_AFTER``
makes a push also a pull of its piece, answered as soon as the consistency model allows
(the pipelined push + pull: no request message, and no wait for the push to complete
before the pull is asked for).

Two forms. *Inline* (``n >= 0``): one message holds the header and the arrays, so a
matched probe receives it whole and requests from many workers never interleave, at the
price of one copy of the payload into the buffer (compressed payloads, small messages).
*Detached* (``n < 0``, :func:`isend_detached`): the header, then each of the ``-n``
arrays as its own message with ``TAG_DATA`` straight from the array's memory; the
receiver of the header receives the arrays next, from the header's source, straight
into memory of its own (:func:`recv_detached`: the server's receive buffers, a worker's
``out``). MPI keeps the messages of one source and tag in order and the receiver takes a
header's arrays before it probes again, so a header's arrays are always the next
``TAG_DATA`` messages of its source. The dense push and the dense pull reply go this
way: no copy and no allocation on either side, one more latency per message
(microseconds; noncontiguous MPI datatypes that would join the two parts were 5-10x
slower than contiguous messages on MPICH's shared memory). The virtual clock and the
emulated link's delay see one message of the inline form's size (the header carries the
charge for its arrays), so their times do not depend on the form.

Also here: the polling waits (:class:`Backoff`). MPICH's blocking waits spin on a core; a
server or a worker held back by bounded staleness may wait for seconds, so every wait in
this package probes or tests and yields the CPU between probes for the first part of an
idle period (the spin window, :func:`spin_window_s`), then sleeps with an exponential
backoff from ``BACKOFF_MIN_S`` to 1 ms (so a reply after a long idle period is late by
at most 1 ms; a busy server never sleeps, nor does a rank whose own sends are in
flight, nor a worker within the time its pull's reply is expected to take,
:meth:`Backoff.expect`). The spin window depends on the host: where every rank has a
core of its own (``KVStore`` reports the ranks of its host, :func:`set_host_ranks`),
a waiting rank polls for up to ``SPIN_DEDICATED_US`` (1 s: in practice it never
sleeps, as MPI's own blocking waits; the core it polls on has nothing else to run, and
a sleep adds up to the wake-up latency to every reply: 1 MB push+pull took 1.5 ms with
sleeps against 0.6 ms without on a 2-core host); with more ranks than cores the window
is ``SPIN_SHARED_US`` (200 us) and a waiting rank leaves its core to the others. Both
windows are settings (``MPICOMM_PS_SPIN_US``, ``MPICOMM_PS_MAX_SLEEP_US``) that
override this. Measure with ``mpiexec -n 2 python -m mpicomm.bench ps --sections comm``
under each setting.
"""

from __future__ import annotations

import functools
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .. import vwire
from ..config import env_int
from ..emulate.linkdelay import LinkDelay
from ..emulate.mpienv import usable_cores
from ..p2p import isend_bytes
from ..tags import TAG_PS_CONTROL, TAG_PS_DATA, TAG_PS_REPLY, TAG_PS_REQUEST, TAG_PS_STATE

__all__ = ["PUSH", "PULL", "CLOSE", "CKPT", "REPLY", "PULL_AFTER", "TAG_REQUEST", "TAG_REPLY",
           "TAG_CONTROL", "TAG_STATE", "TAG_DATA", "Message", "pack", "unpack", "reply_nbytes",
           "Backoff", "spin_window_s", "set_host_ranks", "wait_requests", "probe_wait",
           "isend_detached", "isend_head", "isend_array", "recv_detached", "message_nbytes"]

# operations
PUSH, PULL, CLOSE, CKPT, REPLY = 1, 2, 3, 4, 5
OP_NAMES = {PUSH: "push", PULL: "pull", CLOSE: "close", CKPT: "checkpoint", REPLY: "reply"}
#: A push's ``d``: also pull the piece once the push is applied.
PULL_AFTER = 1

# tags (the "ps" range of the registry mpicomm.tags)
TAG_REQUEST = TAG_PS_REQUEST   # binary
TAG_REPLY = TAG_PS_REPLY       # binary
TAG_CONTROL = TAG_PS_CONTROL   # pickled objects (init / restore, acks)
TAG_STATE = TAG_PS_STATE       # pickled object (checkpoint)
TAG_DATA = TAG_PS_DATA         # binary: the arrays of a detached message

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
    #: detached form: the (dtype, element count) of each array that follows
    follow: list[tuple[torch.dtype, int]] = field(default_factory=list)


def _pad(n: int) -> int:
    return (n + 7) & ~7


@functools.cache
def _words(count: int) -> struct.Struct:
    """``count`` little-endian int64 words (the header's layout)."""
    return struct.Struct(f"<{count}q")


def pack(op: int, key_id: int, piece: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0,
         arrays: Sequence[torch.Tensor] = (), detached: bool = False) -> np.ndarray:
    """One message as a uint8 buffer (the arrays are copied in; CPU tensors); with
    ``detached`` only the header, which announces the arrays (module docstring)."""
    desc: list[int] = []
    for t in arrays:
        code = _CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"cannot send a {t.dtype} array")
        desc += (code, t.numel())
    head = FIXED + len(desc)
    if detached:
        buf = np.empty(head * 8, dtype=np.uint8)
        _words(head).pack_into(buf, 0, op, key_id, piece, a, b, c, d, -len(arrays), *desc)
        return buf
    flat = [t.detach().reshape(-1) for t in arrays]
    sizes = [_pad(t.numel() * t.element_size()) for t in flat]
    buf = np.empty(head * 8 + sum(sizes), dtype=np.uint8)
    _words(head).pack_into(buf, 0, op, key_id, piece, a, b, c, d, len(arrays), *desc)
    pos = head * 8
    for t, size in zip(flat, sizes):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            src = t.cpu().contiguous().view(torch.uint8).numpy()
            buf[pos:pos + nbytes] = src
        buf[pos + nbytes:pos + size] = 0
        pos += size
    return buf


def unpack(buf: np.ndarray) -> Message:
    """Decode a buffer made by :func:`pack`; the arrays are torch views into ``buf``."""
    fields = _words(FIXED).unpack_from(buf, 0)
    n = fields[7]
    desc = _words(2 * abs(n)).unpack_from(buf, FIXED * 8) if n else ()
    kinds = [(_DTYPES[desc[2 * i]], desc[2 * i + 1]) for i in range(abs(n))]
    if n < 0:
        return Message(*fields[:7], [], kinds)
    pos = (FIXED + 2 * n) * 8
    arrays = []
    raw = torch.from_numpy(buf)
    for dtype, numel in kinds:
        nbytes = numel * dtype.itemsize
        arrays.append(raw[pos:pos + nbytes].view(dtype))
        pos += _pad(nbytes)
    return Message(*fields[:7], arrays)


def _raw(t: torch.Tensor) -> np.ndarray:
    """The memory of a contiguous CPU tensor, as a numpy view (no copy; sent and
    received as ``MPI.BYTE``, so its element type does not matter)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a detached array must be a contiguous CPU tensor")
    if t.dtype == torch.bfloat16:   # numpy has no bfloat16: the same bits as int16
        t = t.view(torch.int16)
    return (t.detach() if t.requires_grad else t).numpy()


def isend_detached(mpi: MPI.Intracomm, dest: int, tag: int, op: int, key_id: int, piece: int,
                   a: int = 0, b: int = 0, c: int = 0, d: int = 0,
                   arrays: Sequence[torch.Tensor] = (), delay: LinkDelay | None = None
                   ) -> list[tuple[MPI.Request, Any]]:
    """Send a message in the detached form (module docstring): the header with ``tag``,
    then every array from its own memory with ``TAG_DATA``. Returns the ``(request,
    buffer)`` pairs; each buffer must stay unchanged until its request completes. The
    header stands for the inline message's bytes on the virtual clock and the emulated
    link."""
    sends = [isend_head(mpi, dest, tag, op, key_id, piece, a, b, c, d, arrays, delay)]
    return sends + [isend_array(mpi, dest, t) for t in arrays]


def isend_head(mpi: MPI.Intracomm, dest: int, tag: int, op: int, key_id: int, piece: int,
               a: int, b: int, c: int, d: int, arrays: Sequence[torch.Tensor],
               delay: LinkDelay | None = None) -> tuple[MPI.Request, Any]:
    """The header of a detached message announcing ``arrays`` (their dtypes and sizes;
    the values are not read), standing for the whole message on the virtual clock and
    the emulated link. Each array must follow, in order, by :func:`isend_array`; that
    may be later (a reply sent part by part as its parts are computed)."""
    head = pack(op, key_id, piece, a, b, c, d, arrays=arrays, detached=True)
    return isend_bytes(mpi, head, dest, tag, delay, nbytes=message_nbytes(arrays)), head


def isend_array(mpi: MPI.Intracomm, dest: int, t: torch.Tensor) -> tuple[MPI.Request, Any]:
    """One array of a detached message, straight from ``t``'s memory (unchanged until the
    request completes)."""
    return mpi.Isend([_raw(t), MPI.BYTE], dest, TAG_DATA), t


def recv_detached(mpi: MPI.Intracomm, source: int, m: Message,
                  into: Sequence[torch.Tensor]) -> int:
    """Receive the arrays that follow header ``m`` from ``source`` straight into ``into``
    (contiguous CPU tensors of the announced dtypes and sizes); returns their bytes
    padded as in the inline form (the message's size for statistics)."""
    if len(into) != len(m.follow):
        raise RuntimeError(f"{OP_NAMES.get(m.op, m.op)} of key id {m.key_id} piece {m.piece} "
                           f"announces {len(m.follow)} arrays, {len(into)} expected")
    status = MPI.Status()
    total = 0
    for (dtype, numel), t in zip(m.follow, into):
        if t.dtype != dtype or t.numel() != numel:
            raise RuntimeError(f"{OP_NAMES.get(m.op, m.op)} of key id {m.key_id} piece "
                               f"{m.piece}: {numel} {dtype} announced, {t.numel()} "
                               f"{t.dtype} expected")
        mpi.Recv([_raw(t), MPI.BYTE], source, TAG_DATA, status)
        got = status.Get_count(MPI.BYTE)
        if got != numel * dtype.itemsize:
            raise RuntimeError(f"detached array of {got} bytes, {numel * dtype.itemsize} "
                               "announced")
        total += _pad(got)
    return total


def reply_nbytes(numel: int, itemsize: int) -> int:
    """Size of a pull reply carrying one array of ``numel`` elements."""
    return (FIXED + 2) * 8 + _pad(numel * itemsize)


def message_nbytes(arrays: Sequence[torch.Tensor]) -> int:
    """Size of the inline message carrying ``arrays`` (what a detached one stands for)."""
    return (FIXED + 2 * len(arrays)) * 8 + sum(_pad(t.numel() * t.element_size())
                                               for t in arrays)


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
            spin_s = spin_window_s()
        self.min_s, self.max_s, self.spin_s = min_s, max(min_s, max_s), spin_s
        self.delay = 0.0
        self.since: float | None = None

    def expect(self, seconds: float) -> None:
        """Poll without sleeping for at least ``seconds`` (at most ``SPIN_CAP_S``) of
        the next idle period: a reply expected that soon is not waited for asleep."""
        self.spin_s = max(self.spin_s, min(seconds, SPIN_CAP_S))

    def idle(self, urgent: bool = False) -> None:
        now = time.perf_counter()
        if self.since is None:
            self.since = now
        if urgent or now - self.since < self.spin_s:
            _yield()
            return
        if self.delay:
            time.sleep(self.delay)
        self.delay = min(self.max_s, max(self.min_s, 2 * self.delay))

    def busy(self) -> None:
        self.delay = 0.0
        self.since = None


def _sleep0() -> None:
    time.sleep(0)


#: Offer the core to another runnable process and return at once if there is none
#: (``sched_yield``, under a microsecond). Not ``time.sleep(0)``: that is a timed sleep
#: which Linux rounds up by the thread's timer slack (50 us by default), so a loop of
#: them moves a large message's pieces 50-100 us apart.
_yield = getattr(os, "sched_yield", _sleep0)

BACKOFF_MIN_S, BACKOFF_MAX_S = 20e-6, None  # None: MPICOMM_PS_MAX_SLEEP_US (1000 us)
#: The spin window where the host has more ranks than cores, or its occupancy is unknown.
SPIN_SHARED_US = 200
#: The spin window where every rank of the host has a core of its own.
SPIN_DEDICATED_US = 1_000_000
_dedicated = False   # every rank of this host has a core (set_host_ranks)


def set_host_ranks(ranks: int) -> None:
    """Record how many ranks run on this process's host (``KVStore`` does, from its
    communicator's ``local_size``), compared once with this process's usable cores;
    :func:`spin_window_s` reads the result."""
    global _dedicated
    _dedicated = int(ranks) <= usable_cores()


def spin_window_s() -> float:
    """How long an idle wait polls before it sleeps, in seconds: ``MPICOMM_PS_SPIN_US``
    when set; else ``SPIN_DEDICATED_US`` when :func:`set_host_ranks` reported no more
    ranks on this host than this process has cores, otherwise ``SPIN_SHARED_US``."""
    default = SPIN_DEDICATED_US if _dedicated else SPIN_SHARED_US
    return env_int("MPICOMM_PS_SPIN_US", default, 0) * 1e-6
#: The longest no-sleep window :meth:`Backoff.expect` grants (an expected transfer).
SPIN_CAP_S = 0.05


def wait_requests(requests: list[MPI.Request], urgent: bool = False) -> None:
    """Complete ``requests`` without spinning a core (tests, then sleeps with backoff;
    ``urgent``: tests and yields, never sleeps: for this rank's own large sends, which
    move only while it calls into MPI)."""
    if not requests or MPI.Request.Testall(requests):
        return      # done already (the common case): no backoff to set up
    backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
    while not MPI.Request.Testall(requests):
        backoff.idle(urgent)


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
