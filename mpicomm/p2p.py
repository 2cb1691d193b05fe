"""The point-to-point layer: every message mpicomm's own algorithms send or receive.

The dense collectives, the sparse collectives, gossip, the calibration ping-pong and
the parameter server move their data through this module, never through mpi4py
directly, so that three things happen at one place for every message:

* traffic is counted (the communicator's :class:`~mpicomm.comm.Traffic`: bytes sent,
  bytes received, messages sent);
* the emulated link (:mod:`mpicomm.emulate.linkdelay`) delays messages for other
  emulated hosts (:func:`before_send` / :func:`after_receive`);
* waits follow the communicator's ``wait_poll_s`` (:func:`mpicomm.comm.wait_all`).

What is here:

* :class:`Ctx`: the run context of a dense algorithm (fixed-size messages of flat work
  arrays of one framework: send, recv, sendrecv, isend, irecv, wait);
* :class:`Wire`: packed byte messages whose length the receiver learns from the
  message (``MPI_Mprobe``), host or CUDA tensors (staged or direct);
* byte packing: :func:`pack_bytes` / :func:`unpack_bytes` (several tensors in one
  message), :func:`pack` / :func:`unpack` / :func:`pair_bytes` (a sparse set: indices
  as ``index_dtype``, then values; ``s = index bytes + value bytes`` per pair);
* :func:`isend_bytes` / :func:`recv_bytes`, :func:`isend_object` / :func:`recv_object`:
  the parameter server's matched byte messages and its pickled control messages;
* rank folding for algorithms that need a power of two (:func:`fold_layout`,
  :func:`virtual_rank`, :func:`real_rank`, :func:`first_real_block`) and
  :func:`block_bounds`.

Cost: a message costs what MPI charges (``alpha + n beta`` in the model of
:mod:`mpicomm.collectives.cost`) plus a few hundred nanoseconds of Python here; with
the emulated link also its sleep. torch is imported on first use only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from . import vwire
from .arrayops import ArrayOps, ops_for
from .buffers import BufferInfo
from .comm import Communicator, Traffic, poll_until, wait_all
from .config import RING_SEGMENT_BYTES, ring_segment_bytes
from .cudampi import cuda_aware
from .emulate.linkdelay import LinkDelay, link_delay
from .staging import Pipeline, staging_pool

if TYPE_CHECKING:
    import torch

__all__ = ["Ctx", "Wire", "pack_bytes", "unpack_bytes", "pack", "unpack", "pair_bytes",
           "isend_bytes", "recv_bytes", "isend_object", "recv_object", "improbe", "sent",
           "wait_sends", "before_send",
           "after_receive", "block_bounds", "fold_layout", "virtual_rank", "real_rank",
           "first_real_block"]


# ---------------------------------------------------------------------- every message
def before_send(link: LinkDelay | None, traffic: Traffic | None, dest: int,
                nbytes: int) -> None:
    """Account a message of ``nbytes`` to ``dest`` about to be handed to MPI: counted
    in ``traffic`` (if given), delayed by the emulated ``link`` (if any)."""
    if traffic is not None:
        traffic.sent_bytes += nbytes
        traffic.messages += 1
    if link is not None:
        link.before_send(dest, nbytes)


def after_receive(link: LinkDelay | None, traffic: Traffic | None, nbytes: int) -> None:
    """Account a received message of ``nbytes`` (counted; ends the link's burst)."""
    if traffic is not None:
        traffic.recv_bytes += nbytes
    if link is not None:
        link.after_receive()


# ---------------------------------------------------------------------- dense messages
@dataclass
class Ctx:
    """Everything a dense algorithm needs: the private MPI communicator, array kernels,
    and the communicator's traffic counter (every send and receive below is counted),
    the emulated link (:mod:`mpicomm.emulate.linkdelay`; None outside it), and how to
    wait for messages (``poll_s``, the communicator's ``wait_poll_s``): algorithms
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
    #: The emulated link (:mod:`mpicomm.emulate.linkdelay`); None outside it.
    delay: LinkDelay | None = None
    #: Sleep between request tests (:func:`mpicomm.comm.wait_all`); None: block in MPI.
    poll_s: float | None = None
    #: Staged CUDA data: the streamed copies (:class:`mpicomm.staging.Pipeline`) whose
    #: :meth:`need` / :meth:`final` hooks the ring passes call; None otherwise.
    stage: Pipeline | None = None
    #: Under the virtual clock every message is posted to it (:mod:`mpicomm.vwire`).
    virtual: bool = False

    @classmethod
    def of(cls, comm: Communicator, ops: ArrayOps, segment_bytes: int | None = None,
           stage: Pipeline | None = None) -> Ctx:
        """The context for running an algorithm on ``comm``.

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

    def sendrecv(self, send: Any, dest: int, recv: Any, source: int, tag: int) -> None:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source``."""
        if self.poll_s is None:
            before_send(self.delay, self.traffic, dest, self._nbytes(send))
            after_receive(self.delay, self.traffic, self._nbytes(recv))
            self.mpi.Sendrecv(self.ops.msg(send), dest, tag, self.ops.msg(recv), source, tag)
            return
        self.waitall([self.irecv(recv, source, tag), self.isend(send, dest, tag)])

    def send(self, data: Any, dest: int, tag: int) -> None:
        if self.poll_s is None:
            before_send(self.delay, self.traffic, dest, self._nbytes(data))
            self.mpi.Send(self.ops.msg(data), dest, tag)
        else:
            self.wait(self.isend(data, dest, tag))

    def recv(self, data: Any, source: int, tag: int) -> None:
        if self.poll_s is None:
            after_receive(self.delay, self.traffic, self._nbytes(data))
            self.mpi.Recv(self.ops.msg(data), source, tag)
        else:
            self.wait(self.irecv(data, source, tag))

    def isend(self, data: Any, dest: int, tag: int) -> MPI.Request:
        nbytes = self._nbytes(data)
        before_send(self.delay, self.traffic, dest, nbytes)
        if self.virtual:
            token = vwire.isend(self.mpi, dest, tag, nbytes)
            return vwire.track(self.mpi.Isend(self.ops.msg(data), dest, tag), token)
        return self.mpi.Isend(self.ops.msg(data), dest, tag)

    def irecv(self, data: Any, source: int, tag: int) -> MPI.Request:
        after_receive(self.delay, self.traffic, self._nbytes(data))
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


# ---------------------------------------------------------------------- byte packing
def pack_bytes(arrays: Sequence[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of several tensors (one device) back to back, as uint8.

    Empty tensors contribute nothing (torch cannot byte-view them).
    """
    import torch

    parts = [a.contiguous().reshape(-1).view(torch.uint8) for a in arrays if a.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=arrays[0].device)
    return torch.cat(parts)


def unpack_bytes(buf: torch.Tensor, layout: Sequence[tuple[torch.dtype, int]]
                 ) -> list[torch.Tensor]:
    """Inverse of :func:`pack_bytes` for ``layout`` = ``[(dtype, numel), ...]``.

    Each part is copied into its own (suitably aligned) storage before the dtype view.
    """
    out, offset = [], 0
    for dtype, numel in layout:
        nbytes = numel * dtype.itemsize
        out.append(buf[offset:offset + nbytes].clone().view(dtype))
        offset += nbytes
    if offset != buf.shape[0]:
        raise RuntimeError(f"payload of {buf.shape[0]} bytes, expected {offset}: the ranks "
                           "disagree on the tensors being aggregated")
    return out


def pack(idx: torch.Tensor, val: torch.Tensor, index_dtype: torch.dtype) -> torch.Tensor:
    """One uint8 tensor: the indices as ``index_dtype``, then the values (raw bytes)."""
    return pack_bytes([idx.to(index_dtype), val])


def pair_bytes(index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """``s``: bytes per (index, value) pair on the wire."""
    return index_dtype.itemsize + value_dtype.itemsize


def unpack(buf: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`; the pair count follows from the byte length."""
    import torch

    s = pair_bytes(index_dtype, value_dtype)
    nbytes = buf.shape[0]
    if nbytes % s:
        raise RuntimeError(f"received {nbytes} bytes, not a multiple of the {s}-byte pair "
                           "size: the ranks disagree on the value dtype or index space")
    n = nbytes // s
    idx, val = unpack_bytes(buf, [(index_dtype, n), (value_dtype, n)])
    return idx.to(torch.int64), val


# ---------------------------------------------------------------------- byte messages
class Wire:
    """Point-to-point transfer of packed byte messages whose length the receiver does
    not know.

    Host tensors go to MPI as they are. CUDA tensors go as device pointers when the MPI
    library is CUDA-aware (after synchronizing the current stream); otherwise they are
    staged through the communicator's reusable pinned host buffers
    (:class:`mpicomm.staging.StagingPool`, slots ``sparse-send``/``sparse-recv``) and
    moved back to the device after receipt. Every message is counted in
    ``comm.traffic`` (bytes sent, bytes received, messages sent). With the
    communicator's ``wait_poll_s`` set, sends complete and receives are probed by test +
    sleep (:func:`mpicomm.comm.wait_all`, ``MPI_Improbe``) instead of blocking in MPI.
    """

    def __init__(self, comm: Communicator, device: torch.device):
        self.mpi = comm.p2p
        self.traffic = comm.traffic
        self.device = device
        self.staged = device.type == "cuda" and not cuda_aware()
        self.direct = device.type == "cuda" and not self.staged
        self._resources = comm.resources
        self._ops = ops_for("torch", self.direct)
        self.virtual = vwire.active()
        # the emulated link (None outside it and under the virtual clock)
        self.delay = None if self.virtual else link_delay(comm)
        self.poll_s = comm.wait_poll_s
        if self.virtual and self.poll_s is None:
            self.poll_s = vwire.POLL_S

    def _host(self, numel: int, slot: str) -> torch.Tensor:
        info = BufferInfo("torch", "uint8", (numel,), str(self.device), 1)
        return staging_pool(self._resources).get(info, numel, slot)

    def _outgoing(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        import torch

        torch.cuda.current_stream(t.device).synchronize()
        if self.direct:
            return t
        host = self._host(t.shape[0], "sparse-send")
        host.copy_(t)
        return host

    def _isend(self, out: torch.Tensor, dest: int, tag: int) -> MPI.Request:
        before_send(self.delay, self.traffic, dest, int(out.shape[0]))
        if not self.virtual:
            return self.mpi.Isend([out, MPI.BYTE], dest, tag)
        token = vwire.isend(self.mpi, dest, tag, int(out.shape[0]))
        return vwire.track(self.mpi.Isend([out, MPI.BYTE], dest, tag), token)

    def _wait(self, request: MPI.Request) -> None:
        if self.virtual:
            vwire.complete([request], self.poll_s, wait_all)
        else:
            wait_all([request], self.poll_s)

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        out = self._outgoing(t)
        if self.poll_s is None:
            before_send(self.delay, self.traffic, dest, int(out.shape[0]))
            self.mpi.Send([out, MPI.BYTE], dest, tag)
        else:
            self._wait(self._isend(out, dest, tag))

    def recv(self, source: int, tag: int) -> torch.Tensor:
        import torch

        status = MPI.Status()
        if self.virtual:
            vwire.block([], sources=[vwire.world_rank(self.mpi, source)])
        if self.poll_s is None:
            message = self.mpi.Mprobe(source, tag, status)
        else:
            message = poll_until(lambda: self.mpi.Improbe(source, tag, status), self.poll_s)
        token = vwire.probed(self.mpi, status) if self.virtual else None
        n = status.Get_count(MPI.BYTE)
        if self.staged:
            buf = self._host(n, "sparse-recv")
        else:  # direct: the fresh block is synchronized before MPI writes into it
            buf = self._ops.empty(n, torch.uint8, device=self.device)
        message.Recv([buf, MPI.BYTE])
        if token is not None:
            vwire.finish([token])
        after_receive(self.delay, self.traffic, n)
        return buf.to(self.device) if self.staged else buf

    def exchange(self, t: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        """Send ``t`` to ``peer`` while receiving ``peer``'s message of unknown length."""
        request = self._isend(self._outgoing(t), peer, tag)
        try:
            got = self.recv(peer, tag)
        finally:
            self._wait(request)
        return got


def improbe(mpi: MPI.Intracomm, source: int, tag: int, status: MPI.Status,
            tags: Sequence[int] = (), sources: Sequence[int] | None = None
            ) -> MPI.Message | None:
    """A matched probe (the parameter server's event loops).

    Wall clock: ``MPI_Improbe`` (None when no message is there yet). Virtual clock: the
    message that arrives first in virtual time among those that may come
    (:func:`mpicomm.vwire.next_source`; ``tags`` lists what ``MPI.ANY_TAG`` stands for,
    ``sources`` what ``MPI.ANY_SOURCE`` stands for, default every other rank), waiting
    for it: so the order in which a server serves its workers is the simulated
    cluster's, the same in every run."""
    if not vwire.active():
        return mpi.improbe(source, tag, status)
    if source == MPI.ANY_SOURCE or tag == MPI.ANY_TAG:
        wanted = tuple(tags) if tag == MPI.ANY_TAG else (tag,)
        from_ = sources if source == MPI.ANY_SOURCE else [source]
        source, tag = vwire.next_source(mpi, wanted, from_)
    else:
        vwire.block([], sources=[vwire.world_rank(mpi, source)])
    return poll_until(lambda: mpi.improbe(source, tag, status), vwire.POLL_S)


def recv_bytes(msg: MPI.Message, status: MPI.Status, delay: LinkDelay | None = None,
               mpi: MPI.Intracomm | None = None) -> np.ndarray:
    """Receive a matched binary message (:func:`improbe`) into a fresh uint8 buffer (the
    parameter server's requests and replies; not counted in a communicator's traffic,
    the store keeps its own statistics). ``mpi``: the communicator it was probed on
    (needed by the virtual clock)."""
    token = vwire.probed(mpi, status) if vwire.active() and mpi is not None else None
    buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
    msg.Recv([buf, MPI.BYTE])
    if token is not None:
        vwire.finish([token])
    after_receive(delay, None, buf.nbytes)
    return buf


def isend_bytes(mpi: MPI.Intracomm, buf: np.ndarray, dest: int, tag: int,
                delay: LinkDelay | None = None, nbytes: int | None = None) -> MPI.Request:
    """``MPI_Isend`` of a packed byte message; the emulated link's delay (if any) is
    waited first, as for every other message of this module. ``nbytes`` (default the
    buffer's): the bytes it stands for on the emulated link and the virtual clock (a
    header whose payload follows in messages of their own)."""
    nbytes = buf.nbytes if nbytes is None else nbytes
    before_send(delay, None, dest, nbytes)
    if vwire.active():
        token = vwire.isend(mpi, dest, tag, nbytes)
        return vwire.track(mpi.Isend([buf, MPI.BYTE], dest, tag), token)
    return mpi.Isend([buf, MPI.BYTE], dest, tag)


def isend_object(mpi: MPI.Intracomm, obj: Any, dest: int, tag: int,
                 delay: LinkDelay | None = None) -> MPI.Request:
    """Nonblocking send of a small picklable object (the parameter server's control and
    checkpoint messages), behind the emulated link's latency like every other message
    (its size is unknown before pickling: counted as 0 bytes; the virtual clock charges
    its pickled size)."""
    before_send(delay, None, dest, 0)
    if vwire.active():
        import pickle

        nbytes = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        token = vwire.isend(mpi, dest, tag, nbytes)
        return vwire.track(mpi.isend(obj, dest, tag), token)
    return mpi.isend(obj, dest, tag)


def recv_object(msg: MPI.Message, delay: LinkDelay | None = None,
                status: MPI.Status | None = None, mpi: MPI.Intracomm | None = None) -> Any:
    """Receive the matched pickled message ``msg`` (see :func:`isend_object`); ``status``
    and ``mpi`` of its probe are needed by the virtual clock."""
    token = (vwire.probed(mpi, status)
             if vwire.active() and mpi is not None and status is not None else None)
    obj = msg.recv()
    if token is not None:
        vwire.finish([token])
    after_receive(delay, None, 0)
    return obj


def sent(request: MPI.Request) -> bool:
    """Whether a send request has completed (``MPI_Test``), for loops that drop their
    finished sends without waiting; under the virtual clock the sender then does not
    wait for that message's completion time; a send still on its link in virtual time
    is not done yet, whatever MPI says (:func:`mpicomm.vwire.sent`)."""
    if vwire.active():
        return vwire.sent(request)
    return request.Test()


def wait_sends(requests: Sequence[MPI.Request], poll_s: float,
               wait: Any = None) -> None:
    """Complete ``requests`` with ``wait(requests, poll_s)`` (default
    :func:`mpicomm.comm.wait_all`); under the virtual clock the caller continues from
    their completion times."""
    wait = wait_all if wait is None else wait
    if vwire.active():
        vwire.complete(list(requests), poll_s, wait)
    else:
        wait(list(requests), poll_s)


# ---------------------------------------------------------------------- rank folding
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
