"""Plumbing shared by the collective algorithms: argument checks and the run context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from .. import vwire
from ..buffers import REDUCE_OPS, ArrayOps, BufferInfo
from ..comm import Traffic, wait_all
from ..config import RING_SEGMENT_BYTES, ring_segment_bytes
from ..linkdelay import LinkDelay, link_delay
from ..staging import Pipeline
from ..tags import (  # noqa: F401  (the one tag registry; re-exported for the algorithms)
    TAG_ALLGATHER,
    TAG_ALLREDUCE,
    TAG_BCAST,
    TAG_FOLD,
    TAG_REDUCE_SCATTER,
)
from ..validate import check_algorithm, check_int  # noqa: F401  (the one validation kit)


@dataclass
class Ctx:
    """Everything an algorithm needs: the private MPI communicator, array kernels, and the
    communicator's traffic counter (every send and receive below is counted), the
    emulated cluster's latency injector (:mod:`mpicomm.linkdelay`; None outside it), and
    how to wait for messages (``poll_s``, the communicator's ``wait_poll_s``): algorithms
    complete their requests with :meth:`wait`/:meth:`waitall`, never ``Request.Wait``,
    and the blocking helpers below are nonblocking ones plus :meth:`waitall` when
    ``poll_s`` is set."""

    mpi: MPI.Intracomm
    rank: int
    size: int
    ops: ArrayOps
    traffic: Traffic
    #: Ring segment size (``MPICOMM_RING_SEGMENT_BYTES``), read once per collective.
    segment_bytes: int = RING_SEGMENT_BYTES
    #: The emulated cluster's injected latency (:mod:`mpicomm.linkdelay`); None outside it.
    delay: LinkDelay | None = None
    #: Sleep between request tests (:func:`mpicomm.comm.wait_all`); None: block in MPI.
    poll_s: float | None = None
    #: Staged CUDA data: the streamed copies (:class:`mpicomm.staging.Pipeline`) whose
    #: :meth:`need` / :meth:`final` hooks the ring passes call; None otherwise.
    stage: Pipeline | None = None
    #: Under the virtual clock every message is posted to it (:mod:`mpicomm.vwire`).
    virtual: bool = False

    @classmethod
    def of(cls, comm: Any, ops: ArrayOps, segment_bytes: int | None = None,
           stage: Pipeline | None = None) -> Ctx:
        """The context for running an algorithm on ``comm`` (an mpicomm Communicator).

        ``segment_bytes`` defaults to the environment's (checked) value; collectives pass
        the value their argument checks read, which checked mode compared across ranks.
        """
        seg = ring_segment_bytes() if segment_bytes is None else segment_bytes
        virtual = vwire.active()
        poll = comm.wait_poll_s if comm.wait_poll_s is not None or not virtual \
            else vwire.POLL_S
        delay = None if virtual else link_delay(comm)
        return cls(comm.p2p, comm.rank, comm.size, ops, comm.traffic, seg, delay, poll, stage,
                   virtual)

    def need(self, a: int, b: int) -> None:
        """Elements ``a:b`` of the work array are about to be read: wait for their
        staging download (no-op unless streaming staged data)."""
        if self.stage is not None:
            self.stage.need(a, b)

    def final(self, a: int, b: int) -> None:
        """Elements ``a:b`` of the work array hold their result: start their staging
        upload (no-op unless streaming staged data)."""
        if self.stage is not None:
            self.stage.final(a, b)

    def _nbytes(self, a: Any) -> int:
        return int(a.shape[0]) * self.ops.itemsize(a)

    def _count(self, sent: Any = None, received: Any = None) -> None:
        t = self.traffic
        if sent is not None:
            t.sent_bytes += self._nbytes(sent)
            t.messages += 1
        if received is not None:
            t.recv_bytes += self._nbytes(received)

    def sendrecv(self, send: Any, dest: int, recv: Any, source: int, tag: int) -> None:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``."""
        if self.poll_s is None:
            self._count(send, recv)
            if self.delay is not None:
                self.delay.before_send(dest)
                self.delay.after_receive()
            self.mpi.Sendrecv(self.ops.msg(send), dest, tag, self.ops.msg(recv), source, tag)
            return
        self.waitall([self.irecv(recv, source, tag), self.isend(send, dest, tag)])

    def send(self, data: Any, dest: int, tag: int) -> None:
        if self.poll_s is None:
            self._count(sent=data)
            if self.delay is not None:
                self.delay.before_send(dest)
            self.mpi.Send(self.ops.msg(data), dest, tag)
        else:
            self.wait(self.isend(data, dest, tag))

    def recv(self, data: Any, source: int, tag: int) -> None:
        if self.poll_s is None:
            self._count(received=data)
            if self.delay is not None:
                self.delay.after_receive()
            self.mpi.Recv(self.ops.msg(data), source, tag)
        else:
            self.wait(self.irecv(data, source, tag))

    def isend(self, data: Any, dest: int, tag: int) -> MPI.Request:
        self._count(sent=data)
        if self.delay is not None:
            self.delay.before_send(dest)
        if self.virtual:
            token = vwire.isend(self.mpi, dest, tag, self._nbytes(data))
            return vwire.track(self.mpi.Isend(self.ops.msg(data), dest, tag), token)
        return self.mpi.Isend(self.ops.msg(data), dest, tag)

    def irecv(self, data: Any, source: int, tag: int) -> MPI.Request:
        self._count(received=data)
        if self.delay is not None:
            self.delay.after_receive()
        if self.virtual:
            token = vwire.irecv(self.mpi, source, tag)
            return vwire.track(self.mpi.Irecv(self.ops.msg(data), source, tag), token)
        return self.mpi.Irecv(self.ops.msg(data), source, tag)

    def wait(self, request: MPI.Request) -> None:
        """Complete one request (blocking in MPI, or test + sleep with ``poll_s``)."""
        self.waitall([request])

    def waitall(self, requests: list[MPI.Request]) -> None:
        """Complete every request of ``requests`` (see :meth:`wait`); under the virtual
        clock, also their virtual times (:func:`mpicomm.vwire.complete`)."""
        if self.virtual:
            vwire.complete(requests, self.poll_s, wait_all)
        else:
            wait_all(requests, self.poll_s)


def check_op(op: Any) -> str:
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    return op


def check_op_dtype(op: str, info: BufferInfo) -> None:
    if op == "avg" and not info.is_float:
        raise TypeError(
            f"op='avg' needs a floating dtype, got {info.dtype} (use op='sum' and divide)"
        )


def check_root(root: Any, size: int) -> int:
    return check_int("root", root, 0, size - 1)


def block_bounds(n: int, parts: int) -> list[int]:
    """Boundaries splitting ``n`` elements into ``parts`` near-equal contiguous blocks."""
    return [(i * n) // parts for i in range(parts + 1)]


def fold_layout(size: int) -> tuple[int, int]:
    """``(p2, rem)``: the largest power of two ``p2 <= size`` and ``rem = size - p2``.

    Algorithms that need a power of two fold the first ``2*rem`` ranks pairwise: the even
    rank of each pair hands its data to the odd one and sits out, leaving ``p2`` active
    ranks whose *virtual* rank is ``rank // 2`` (paired) or ``rank - rem`` (unpaired).
    """
    p2 = 1 << (size.bit_length() - 1)
    return p2, size - p2


def virtual_rank(rank: int, rem: int) -> int:
    """Virtual rank after folding, or -1 for a rank that sits out (see fold_layout)."""
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


def real_rank(vrank: int, rem: int) -> int:
    """The real rank that plays virtual rank ``vrank`` after folding."""
    return 2 * vrank + 1 if vrank < rem else vrank + rem


def first_real_block(vrank: int, rem: int) -> int:
    """Index of the first real rank whose data virtual rank ``vrank`` represents.

    Virtual rank ``v < rem`` stands for real ranks ``2v, 2v+1``; the others for ``v+rem``.
    So a contiguous range of virtual ranks maps to a contiguous range of real ranks.
    """
    return 2 * vrank if vrank < rem else vrank + rem
