"""The server loop: receive requests from every worker, apply updates, answer pulls.

One thread, one event loop over matched probes (``MPI_Improbe`` on any source), so a
server serves all workers concurrently without a thread per worker: pushes are applied
in arrival order, pulls that the consistency model lets through are answered at once with
a nonblocking send of a snapshot, the others wait in a list that is re-examined after
every push or close. While nothing arrives the loop sleeps with a backoff (see
:mod:`mpicomm.ps.wire`), so an idle server costs no core.

Under the virtual clock (:mod:`mpicomm.clock`) "arrival order" is the simulated
cluster's: the loop takes the message that arrives first in virtual time
(:func:`mpicomm.p2p.improbe`), so async and SSP runs are the same in every run; sums and
updates are charged from the cost table (:data:`UPDATE_PASSES`).

State per piece (:class:`PieceState`): the values, the optimizer state, ``version`` (sync:
steps applied; async/SSP: pushes applied), and ``last_seq[w]``, the sequence number of the
last push of worker ``w`` applied (pushes of a worker on a key are numbered 1, 2, ...).
A push whose number is not above ``last_seq[w]`` is a duplicate and is skipped (counted in
``duplicates``); one that skips a number means an update was lost and stops the job.
That, and checkpointing ``last_seq`` with the values, is the exactly-once guarantee.

Consistency (``c_w = last_seq[w]``, the pushes worker ``w`` made on the key so far):

* sync: pushes of step ``t`` are summed in worker order (so runs are reproducible) as
  they come: a push is held in its worker's slot until the pushes of the workers before
  it are in the sum, so the sum overlaps the arrivals and only the last push's addition
  and the update follow the last arrival. Once all ``W`` are in,
  ``p <- opt(p, sum_w g_w / W)``; a pull of ``w`` is served once ``version >= c_w``.
* async: every push is applied at once as ``opt(p, g / W)``; pulls are served at once.
* ssp(s): applied as async; a pull of ``w`` is served once every worker still open has
  ``c_v >= c_w - s`` (a worker that closed no longer holds the others back).

Staleness of a served pull: ``c_w - min_v c_v`` (how far the worker being served is ahead
of the slowest worker); ``max_staleness`` is its maximum.

Order of the replies: pulls that become ready together (a sync step's ``W`` pulls, once
its update is done) are answered starting from worker ``s W / S`` for server ``s`` and
wrapping around, and each worker pushes and pulls its pieces starting from server
``w mod S``: at any moment the ``S`` servers send to (and receive from) different
workers, so no worker's link carries two servers' pieces at once while another idles.
Without that stagger (every server answering worker 0 first) a step takes about
``(W + S - 1) (n/S) beta`` each way instead of ``max(W/S, 1) n beta``.

Dense data path (no copy, no allocation in the steady state): a dense push arrives in the
detached form (:mod:`mpicomm.ps.wire`) and its values are received into one of the
piece's spare buffers (``spare``; one per push in flight, kept for the next step); sync
sums add into the first pushed buffer in place, the ``1/W`` scaling divides in place
(skipped for ``W = 1``: ``x / 1 == x`` exactly), the buffers go back to ``spare`` after
the update. A dense reply is sent straight from the piece's values; an update that
finds such a send still in flight first moves the values to a new buffer (copy on
write), so a reply never carries a half-updated value. An update that lets dense pulls
through (a sync step's last push, an async push with its pull) answers them while it
runs: for a piece of at least ``PIPELINE_MIN_BYTES`` the reply's header announces
its parts (:func:`reply_bounds`: two, or one per 2 MiB), the optimizer updates the piece part by
part (:meth:`~mpicomm.ps.optim.ShardOptimizer.step_parts`, the same bits as one step)
and each part is sent as soon as it is updated, so the transfer of one part overlaps the
update of the next (on a 2-core host 5% off a 1 MB push + pull and 12% off 4 MB, as
paired blocks of steps in one run). Only where every rank is on one host
(``split_replies``, which :class:`~mpicomm.ps.KVStore` sets from the host count): over
TCP the transfer does not wait for the update and a second message costs more than it
hides (on the emulated 1 Gbit/s cluster a 1 MB push + pull took 23.9-27.9 ms in parts
against 20.0-22.5 whole). Under the virtual clock, which charges the update as one pass,
replies go whole. Compressed pushes and replies are inline messages.

Pipelined push + pull (:meth:`mpicomm.ps.KVStore.push_pull`): a push whose header says
``PULL_AFTER`` (:mod:`mpicomm.ps.wire`) is also a pull of its piece, queued with the
pending pulls before the push is applied and answered by the same rules. With a key cut
into chunks (:mod:`mpicomm.ps.sharding`) the server answers chunk ``i`` as soon as it is
updated, and its reply (a nonblocking send) moves while the server receives chunk
``i + 1``: the update and the reply of all chunks but the last overlap the push.
Emitted per push and per reply: :func:`mpicomm.hooks.instant` ``"ps push"`` and
``"ps reply"`` (category ``"ps"``, with ``key_id``, ``piece``, ``worker``), the order
in which the server handled them.

Compressed pulls (a ``pull_compressor``): the server keeps one ``mirror`` per piece and
a chain of encodings. At most once per version, when a pull finds the value changed
since the last encoding, it compresses ``delta_n = value - mirror`` (``n`` = 1, 2, ...:
the compressor's step) and advances ``mirror += decode(delta_n)``; ``held[w]`` is the
link of the chain worker ``w``'s copy stands at. A reply to ``w`` carries the encodings
``held[w] + 1 .. n`` (header ``d = n``), which the worker decodes and adds in order, so
its copy equals the mirror bit for bit; or the mirror itself (``d = 0``) on a first
pull, after a restore, or when the encodings it misses are no longer kept (the chain
keeps the newest ones while their bytes add up to less than the dense piece, beyond
which the mirror is the cheaper reply). What was not sent stays in the next delta:
error feedback with no residual to keep. Cost: one compression per version however many
workers pull (was one per worker and pull: ``W`` times the encoding work in BSP), one
mirror per piece (was one per worker); a worker that pulls every ``k`` versions gets
``k`` encodings (in sync mode every worker pulls every version: one).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .. import clock, hooks, vwire
from ..comm import Communicator
from ..compress import Compressor
from ..emulate.linkdelay import link_delay
from ..p2p import improbe, isend_bytes, isend_object, recv_bytes, recv_object, sent, wait_sends
from . import wire
from .checkpoint import to_numpy
from .codec import Codec, PieceView, pull_name
from .optim import ShardOptimizer

__all__ = ["PieceState", "Server", "UPDATE_PASSES", "reply_bounds"]

#: The virtual clock charges a server's update as this many elementwise passes over the
#: piece (``reduce`` per byte: scaling the sum, the optimizer's update); each gradient
#: added into a sync sum is one more, keeping a pushed gradient a ``copy``.
UPDATE_PASSES = 3
#: A dense reply of at least this many bytes that an update lets through is updated and
#: sent in parts, each sent as soon as it is updated (module docstring): ``REPLY_PARTS``,
#: or one per ``REPLY_PART_BYTES`` where that is more. The first part's update is what the
#: reply waits for; each part costs a message (about 10 us of Python on both sides). On a
#: 2-core host, 1 worker + 1 server: 2 parts were best at 1 and 4 MB, 8 at 16 MB (3.9-4.5
#: against 4.2-5.5 ms with 2).
PIPELINE_MIN_BYTES = 512 * 1024
REPLY_PARTS = 2
REPLY_PART_BYTES = 2 * 1024 * 1024
#: Parts start at multiples of this many elements (a multiple of every CPU's vector width:
#: elementwise kernels then round every element as they do on the whole piece).
PART_ALIGN = 1024
#: The server drops its completed sends from its list when it is idle, or once this many
#: are listed (testing each one after every message would cost ``O(k^2)`` per push
#: of ``k`` chunks).
REAP_AT = 16


@dataclass
class PieceState:
    """One piece of one key held by this server."""

    key_id: int
    index: int
    name: str
    value: torch.Tensor
    opt: dict[str, Any]
    workers: int
    version: int = 0
    #: per worker, as Python ints: read on every push and reply, where numpy's scalar
    #: access and reductions cost microseconds each
    last_seq: list[int] = field(default=None)  # type: ignore[assignment]
    slots: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    sums: dict[int, tuple[torch.Tensor | None, int]] = field(default_factory=dict)
    reply: tuple[tuple[int, ...], np.ndarray] | None = None  # the last mirror reply packed
    spare: list[torch.Tensor] = field(default_factory=list)  # receive buffers of pushes
    reading: list[MPI.Request] = field(default_factory=list)  # replies sent from value
    push_view: PieceView | None = None  # layouts for the push / pull compressors
    pull_view: PieceView | None = None
    mirror: torch.Tensor | None = None  # compressed pulls (module docstring)
    encoded: int = 0  # links of the chain so far (n)
    encoded_version: int = -1  # the version the last link encodes
    chain: list[tuple[int, list[torch.Tensor], int]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # per worker: its link (-1: none)
    bounds: list[tuple[int, int]] = field(default_factory=list)  # reply_bounds of value
    cuts: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.last_seq is None:
            self.last_seq = [0] * self.workers
        self.held = [-1] * self.workers
        self.bounds = reply_bounds(self.value.numel(), self.value.element_size())

    def parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` cut at ``bounds``: views kept for the piece's own tensors (``value`` while
        it is the same tensor, the optimizer's state), made afresh for any other (a
        gradient buffer: keeping its views would keep it alive)."""
        if t is not self.value and not self._is_state(t):
            return [t[a:b] for a, b in self.bounds]
        kept = self.cuts.get(id(t))
        if kept is None or kept[0] is not t:
            if t is self.value:   # a new value buffer (copy on write): drop the old cut
                self.cuts = {i: c for i, c in self.cuts.items() if self._is_state(c[0])}
            kept = self.cuts[id(t)] = (t, [t[a:b] for a, b in self.bounds])
        return kept[1]

    def _is_state(self, t: torch.Tensor) -> bool:
        return any(t is v for v in self.opt.values())


def reply_bounds(numel: int, itemsize: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` parts in which a piece of ``numel`` elements is updated and
    sent when its update answers a dense pull: one part below ``PIPELINE_MIN_BYTES``,
    else ``max(REPLY_PARTS, bytes // REPLY_PART_BYTES)`` parts, cut at multiples of
    ``PART_ALIGN`` elements."""
    nbytes = numel * itemsize
    if nbytes < PIPELINE_MIN_BYTES:
        return [(0, numel)]
    parts = max(REPLY_PARTS, nbytes // REPLY_PART_BYTES)
    cuts = [0] + [numel * i // parts // PART_ALIGN * PART_ALIGN
                  for i in range(1, parts)] + [numel]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


class Server:
    """The state and event loop of one server rank (built by :class:`~mpicomm.ps.KVStore`)."""

    def __init__(self, comm: Communicator, workers: int, mode: str, staleness: int,
                 optimizer: ShardOptimizer, compressor: Compressor | None,
                 pull_compressor: Compressor | None = None,
                 split_replies: bool = True) -> None:
        self.comm = comm
        self.mpi = comm.p2p
        self.delay = link_delay(comm)  # the emulated cluster's latency; None elsewhere
        self.workers = workers
        self.mode = mode
        self.staleness = staleness
        self.optimizer = optimizer
        self.codec = Codec(compressor) if compressor is not None else None
        self.pull_codec = Codec(pull_compressor) if pull_compressor is not None else None
        self.split_replies = split_replies   # replies in parts (module docstring)
        self.pieces: dict[tuple[int, int], PieceState] = {}
        self.closed = np.zeros(workers, dtype=bool)
        self.finished = False   # every worker has closed
        self.some_closed = False
        self.pending: list[tuple[int, PieceState]] = []  # (worker, piece) pulls waiting
        servers = comm.size - workers
        self.first = (comm.rank - workers) * workers // servers  # replies start here
        self.sends: list[tuple[MPI.Request, Any]] = []
        self.ckpt_requests = 0
        self.stats = {"max_staleness": 0, "pushes": 0, "pulls": 0, "bytes_pushed": 0,
                      "bytes_pulled": 0, "duplicates": 0, "updates": 0, "idle_s": 0.0,
                      "cpu_s": 0.0, "wall_s": 0.0, "pull_encodings": 0}

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Run until every worker has closed; any error aborts the job naming this rank."""
        cpu, wall = time.process_time(), clock.now()
        try:
            self._loop()
            self.stats["cpu_s"] = time.process_time() - cpu
            self.stats["wall_s"] = clock.now() - wall
        except Exception as exc:  # noqa: BLE001 - every failure must end the job
            self.comm.abort(f"parameter server failed: {type(exc).__name__}: {exc}; aborting "
                            f"the job.\n{traceback.format_exc()}")

    def _loop(self) -> None:
        backoff = wire.Backoff(wire.BACKOFF_MIN_S, wire.BACKOFF_MAX_S)
        status = MPI.Status()
        virtual = vwire.active()   # no message can come once every worker has closed
        while not (self.finished and (virtual or not self.sends)):
            t0 = clock.now()
            msg = improbe(self.mpi, MPI.ANY_SOURCE, MPI.ANY_TAG, status,
                          tags=(wire.TAG_REQUEST, wire.TAG_CONTROL))
            if msg is None:
                self._reap_sends()
                backoff.idle(urgent=bool(self.sends))
                self.stats["idle_s"] += clock.now() - t0
                continue
            if virtual:          # the virtual clock's wait for the next message
                self.stats["idle_s"] += clock.now() - t0
            backoff.busy()
            source, tag = status.Get_source(), status.Get_tag()
            if tag == wire.TAG_REQUEST:
                buf = recv_bytes(msg, status, self.delay, self.mpi)
                self._handle(source, wire.unpack(buf), buf.nbytes)
            elif tag == wire.TAG_CONTROL:
                self._control(source, recv_object(msg, self.delay, status, self.mpi))
            else:
                raise RuntimeError(f"unexpected message with tag {tag} from rank {source}")
            if len(self.sends) >= REAP_AT:   # else when idle: a test per send costs
                self._reap_sends()
        wait_sends([r for r, _ in self.sends], 0.0, lambda reqs, _: wire.wait_requests(reqs))
        self.sends.clear()

    def _reap_sends(self) -> None:
        if self.sends:
            self.sends = [(r, b) for r, b in self.sends if not sent(r)]

    # ------------------------------------------------------------------ requests
    def _handle(self, source: int, m: wire.Message, nbytes: int) -> None:
        if m.op == wire.PUSH:
            st = self._piece(m)
            grad = None
            if m.follow:   # dense, detached: into a spare buffer of the piece
                grad = st.spare.pop() if st.spare else torch.empty_like(st.value)
                nbytes += wire.recv_detached(self.mpi, source, m, [grad])
            self.stats["bytes_pushed"] += nbytes
            hooks.instant("ps push", "ps", key_id=m.key_id, piece=m.piece, worker=m.b)
            if m.d == wire.PULL_AFTER:   # a pipelined push + pull: the pull of the piece
                self.pending.append((m.b, st))
            self._push(st, m, grad)
        elif m.op == wire.PULL:
            self.pending.append((m.a, self._piece(m)))
            self._serve_pending()
        elif m.op == wire.CLOSE:
            self.closed[m.a] = True
            self.finished = bool(self.closed.all())
            self.some_closed = True
            self._serve_pending()
        elif m.op == wire.CKPT:
            self.ckpt_requests += 1
            if self.ckpt_requests == self.workers:
                self.ckpt_requests = 0
                self._send_state(0)  # worker 0 writes the file
        else:
            raise RuntimeError(f"unknown request op {m.op} from rank {source}")

    def _piece(self, m: wire.Message) -> PieceState:
        try:
            return self.pieces[(m.key_id, m.piece)]
        except KeyError:
            raise RuntimeError(f"{wire.OP_NAMES.get(m.op, m.op)} for key id {m.key_id} piece "
                               f"{m.piece}, which this server does not hold") from None

    def _push(self, st: PieceState, m: wire.Message, grad: torch.Tensor | None) -> None:
        """Apply (or hold, in sync mode) the push ``m``: its dense gradient received
        into ``grad`` (a buffer of this server's own), or inline in ``m``."""
        seq, w = m.a, m.b
        last = st.last_seq[w]
        if seq <= last:  # already applied (a replay after restore, a resend): skip
            self.stats["duplicates"] += 1
            if grad is not None:
                self._release(st, grad, True)
            self._serve_pending()
            return
        if seq != last + 1:
            raise RuntimeError(f"lost update: worker {w} pushed key {st.name} with sequence "
                               f"number {seq}, the last applied was {last}")
        owned = grad is not None or self.codec is None  # inline dense: a fresh buffer
        if grad is None:
            grad = self._decode(st, m, m.c)
        if grad.shape != st.value.shape or grad.dtype != st.value.dtype:
            raise RuntimeError(f"push of key {st.name} by worker {w}: got {grad.dtype} "
                               f"{tuple(grad.shape)}, hold {st.value.dtype} "
                               f"{tuple(st.value.shape)}")
        st.last_seq[w] = seq
        self.stats["pushes"] += 1
        nbytes = grad.numel() * grad.element_size()
        if self.mode == "sync":
            if not owned:  # a decoded push may share the codec's memory
                clock.charge("copy", nbytes)
                grad = grad.clone()
            st.slots.setdefault(seq, [None] * self.workers)[w] = grad
            self._accumulate(st, seq, nbytes)
            while (ready := st.sums.get(st.version + 1)) is not None and \
                    ready[1] == self.workers:
                del st.slots[st.version + 1], st.sums[st.version + 1]
                clock.charge("reduce", UPDATE_PASSES * nbytes)   # scale + update
                self._update(st, ready[0], True)
        else:
            clock.charge("reduce", UPDATE_PASSES * nbytes)
            self._update(st, grad, owned)
        self._serve_pending()

    def _update(self, st: PieceState, total: torch.Tensor, owned: bool) -> None:
        """``p <- opt(p, total / W)``: in place where ``total`` is this server's own
        (bit for bit ``total / W``), on a new buffer where a reply still reads ``p``.
        The dense pulls this update lets through are answered part by part as the
        update proceeds (module docstring)."""
        if self.workers > 1 or not owned:
            total = total.div_(self.workers) if owned else total / self.workers
        if st.reading:
            st.reading = [r for r in st.reading if not r.Test()]
            if st.reading:     # copy on write: the replies in flight keep the old buffer
                st.value = st.value.clone()
                st.reading = []
        answers = self._answers(st) if len(st.bounds) > 1 else []
        if not answers:   # nobody to answer while it runs: one step
            self.optimizer.step(st.value, total, st.opt)
        else:
            parts = st.parts(st.value)
            for w in answers:
                self._reply_head(w, st, st.version + 1, parts)
            for i, _ in enumerate(self.optimizer.step_parts(st.value, total, st.opt,
                                                            st.bounds, st.parts)):
                for w in answers:
                    self._send_values(w, st, parts[i])
        st.version += 1
        self.stats["updates"] += 1
        self._release(st, total, True)

    def _release(self, st: PieceState, grad: torch.Tensor, owned: bool) -> None:
        """Keep an owned buffer of the piece's size for the next push's values."""
        if owned and len(st.spare) <= self.workers and grad.shape == st.value.shape and \
                grad.dtype == st.value.dtype and grad.is_contiguous():
            st.spare.append(grad)

    def _accumulate(self, st: PieceState, seq: int, nbytes: int) -> None:
        """Add the held pushes of step ``seq`` that are next in worker order to its sum
        (``g_0 + g_1 + ...``, left to right, whatever order they came in)."""
        slots = st.slots[seq]
        total, nxt = st.sums.get(seq, (None, 0))
        while nxt < self.workers and (g := slots[nxt]) is not None:
            if total is None:
                total = g
            else:   # every held gradient is this server's own buffer: sum into the first
                clock.charge("reduce", nbytes)
                total = total.add_(g)
                self._release(st, g, True)
            slots[nxt] = None
            nxt += 1
        st.sums[seq] = (total, nxt)

    def _decode(self, st: PieceState, m: wire.Message, step: int) -> torch.Tensor:
        """The dense gradient of a push (decoded with the piece's layout, see
        :mod:`mpicomm.ps.codec`, when compressed)."""
        if self.codec is None:
            return m.arrays[0]
        assert st.push_view is not None
        return self.codec.decode(st.push_view, m.arrays, st.name, step, st.value.dtype)

    # ------------------------------------------------------------------ pulls
    def _ready(self, w: int, st: PieceState) -> bool:
        c_w = st.last_seq[w]
        if self.mode == "sync":
            if st.version >= c_w:
                return True
            gone = [v for v in range(self.workers) if self.closed[v] and st.last_seq[v] < c_w]
            if gone:
                raise RuntimeError(f"sync mode: worker {w} waits for step {c_w} of key "
                                   f"{st.name}, but worker(s) {gone} closed before pushing it")
            return False
        if self.mode == "async":
            return True
        return self._slowest(w, st) >= c_w - self.staleness

    def _slowest(self, w: int, st: PieceState) -> int:
        if not self.some_closed:
            return min(st.last_seq)
        return min(c for v, c in enumerate(st.last_seq) if v == w or not self.closed[v])

    def _serve_pending(self) -> None:
        keep = []
        if len(self.pending) > 1:   # staggered over the servers (module docstring)
            self.pending.sort(key=lambda item: (item[0] - self.first) % self.workers)
        for w, st in self.pending:
            if self._ready(w, st):
                self._reply(w, st)
            else:
                keep.append((w, st))
        self.pending = keep

    def _answers(self, st: PieceState) -> list[int]:
        """The workers whose dense pull of ``st`` the coming update lets through (in the
        staggered order of :meth:`_serve_pending`), taken off the pending list; none
        where replies go whole: across hosts (``split_replies`` off), under the virtual
        clock, with a pull compressor."""
        if not self.split_replies or self.pull_codec is not None or vwire.active():
            return []
        after = st.version + 1
        take = [i for i, (w, s) in enumerate(self.pending) if s is st and (
            after >= st.last_seq[w] if self.mode == "sync" else self._ready(w, st))]
        if not take:
            return []
        answers = sorted((self.pending[i][0] for i in take),
                         key=lambda w: (w - self.first) % self.workers)
        self.pending = [item for i, item in enumerate(self.pending) if i not in take]
        return answers

    def _reply_head(self, w: int, st: PieceState, version: int,
                    arrays: list[torch.Tensor]) -> tuple[int, int, int]:
        """Count a reply to ``w`` carrying ``version`` of ``st``; for a dense one (given
        ``arrays``, the parts of the values it announces) send its header. Returns the
        reply header's ``(staleness, pushes applied, version)``."""
        stale = max(0, st.last_seq[w] - self._slowest(w, st))
        self.stats["max_staleness"] = max(self.stats["max_staleness"], stale)
        self.stats["pulls"] += 1
        hooks.instant("ps reply", "ps", key_id=st.key_id, piece=st.index, worker=w)
        head = (stale, sum(st.last_seq), version)
        if arrays:
            self.sends.append(wire.isend_head(self.mpi, w, wire.TAG_REPLY, wire.REPLY,
                                              st.key_id, st.index, *head, 0, arrays,
                                              self.delay))
            self.stats["bytes_pulled"] += wire.message_nbytes([st.value])
        return head

    def _send_values(self, w: int, st: PieceState, values: torch.Tensor) -> None:
        """Send ``values`` (the piece's values or a part of them) to ``w`` as an array of
        a detached reply; the update's copy on write waits for it."""
        send = wire.isend_array(self.mpi, w, values)
        st.reading.append(send[0])
        self.sends.append(send)

    def _reply(self, w: int, st: PieceState) -> None:
        if self.pull_codec is None:   # dense: straight from the values (module docstring)
            self._reply_head(w, st, st.version, [st.value])
            self._send_values(w, st, st.value)
            return
        head = self._reply_head(w, st, st.version, [])
        arrays, number = self._pull_payload(w, st)
        head = (*head, number)
        if number == 0 and st.reply is not None and st.reply[0] == head and \
                arrays[0] is (st.value if st.mirror is None else st.mirror):
            buf = st.reply[1]   # the same bytes for every worker: packed once
        else:
            buf = wire.pack(wire.REPLY, st.key_id, st.index, *head, arrays=arrays)
            if number == 0:
                st.reply = (head, buf)
        self.stats["bytes_pulled"] += buf.nbytes
        self.sends.append((isend_bytes(self.mpi, buf, w, wire.TAG_REPLY, self.delay), buf))

    def _pull_payload(self, w: int, st: PieceState) -> tuple[list[torch.Tensor], int]:
        """What a pull reply to ``w`` carries and its number ``d`` (module docstring):
        the mirror (``d = 0``), or the encodings ``w`` misses, the last one ``d``."""
        if self.pull_codec is None:
            return [st.value], 0
        if st.mirror is None:
            st.mirror, st.encoded_version = st.value.clone(), st.version
        elif st.version != st.encoded_version:
            self._encode(st)
        have, st.held[w] = st.held[w], st.encoded
        missing = [e for e in st.chain if e[0] > have]
        if have < 0 or st.encoded == 0 or len(missing) != st.encoded - have:
            return [st.mirror], 0
        return [a for _, arrays, _ in missing for a in arrays], st.encoded

    def _encode(self, st: PieceState) -> None:
        """The next link of ``st``'s chain: ``value - mirror`` compressed; the chain keeps
        the newest links whose bytes add up to less than the dense piece."""
        assert st.pull_view is not None and st.mirror is not None
        st.encoded += 1
        payload, decoded = self.pull_codec.encode(st.pull_view, st.value - st.mirror,
                                                  pull_name(st.name), st.encoded)
        st.mirror += decoded
        st.encoded_version = st.version
        self.stats["pull_encodings"] += 1
        arrays = self.pull_codec.arrays(payload)
        st.chain.append((st.encoded, arrays, sum(a.nbytes for a in arrays)))
        while st.chain and sum(e[2] for e in st.chain) >= st.value.nbytes:
            st.chain.pop(0)

    # ------------------------------------------------------------------ control
    def _control(self, source: int, obj: dict[str, Any]) -> None:
        op = obj.get("op")
        if op != "init":
            raise RuntimeError(f"unknown control message {op!r} from rank {source}")
        for p in obj["pieces"]:
            key = (p["key_id"], p["index"])
            if key in self.pieces:
                raise RuntimeError(f"key {p['name']} initialised twice")
            dtype = getattr(torch, p["dtype"])
            value = _from_numpy(p["value"], dtype)
            opt = p.get("opt")
            opt = (self.optimizer.init_state(value) if opt is None else
                   {k: (_from_numpy(v, dtype) if isinstance(v, np.ndarray) else int(v))
                    for k, v in opt.items()})
            st = PieceState(p["key_id"], p["index"], p["name"], value, opt, self.workers)
            shape, start = tuple(p["shape"]), int(p["start"])
            if self.codec is not None:
                st.push_view = self.codec.view(shape, start, start + value.numel())
            if self.pull_codec is not None:
                st.pull_view = self.pull_codec.view(shape, start, start + value.numel())
            if p.get("version") is not None:
                st.version = int(p["version"])
                st.last_seq = [int(v) for v in p["last_seq"]]
            self.pieces[key] = st
        self.sends.append((isend_object(self.mpi, {"op": "ack"}, source, wire.TAG_CONTROL,
                                        self.delay), None))

    def _send_state(self, dest: int) -> None:
        """All workers asked for a checkpoint: everything they pushed before is in."""
        pieces = {}
        for key, st in self.pieces.items():
            if st.slots:
                raise RuntimeError(f"checkpoint while step {min(st.slots)} of key {st.name} "
                                   "is incomplete; call checkpoint() between steps")
            pieces[key] = {"value": to_numpy(st.value), "version": st.version,
                           "last_seq": np.array(st.last_seq, dtype=np.int64),
                           "opt": {k: (to_numpy(v) if isinstance(v, torch.Tensor) else int(v))
                                   for k, v in st.opt.items()}}
        self.sends.append((isend_object(self.mpi, {"pieces": pieces}, dest, wire.TAG_STATE,
                                        self.delay), None))


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``dtype`` owning a copy of ``a`` (bfloat16 arrives as int16 bits)."""
    t = torch.from_numpy(np.array(a, copy=True)).reshape(-1)
    return t.view(dtype) if dtype == torch.bfloat16 else t.to(dtype)
