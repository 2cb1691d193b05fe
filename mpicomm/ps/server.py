"""The server loop: receive requests from every worker, apply updates, answer pulls.

One thread, one event loop over matched probes (``MPI_Improbe`` on any source), so a
server serves all workers concurrently without a thread per worker: pushes are applied
in arrival order, pulls that the consistency model lets through are answered at once with
a nonblocking send of a snapshot, the others wait in a list that is re-examined after
every push or close. While nothing arrives the loop sleeps with a backoff (see
:mod:`mpicomm.ps.wire`), so an idle server costs no core.

State per piece (:class:`PieceState`): the values, the optimizer state, ``version`` (sync:
steps applied; async/SSP: pushes applied), and ``last_seq[w]``, the sequence number of the
last push of worker ``w`` applied (pushes of a worker on a key are numbered 1, 2, ...).
A push whose number is not above ``last_seq[w]`` is a duplicate and is skipped (counted in
``duplicates``); one that skips a number means an update was lost and stops the job.
That, and checkpointing ``last_seq`` with the values, is the exactly-once guarantee.

Consistency (``c_w = last_seq[w]``, the pushes worker ``w`` made on the key so far):

* sync: pushes of step ``t`` are held in per-worker slots until all ``W`` are in, then
  ``p <- opt(p, sum_w g_w / W)`` (summed in worker order, so runs are reproducible);
  a pull of ``w`` is served once ``version >= c_w``.
* async: every push is applied at once as ``opt(p, g / W)``; pulls are served at once.
* ssp(s): applied as async; a pull of ``w`` is served once every worker still open has
  ``c_v >= c_w - s`` (a worker that closed no longer holds the others back).

Staleness of a served pull: ``c_w - min_v c_v`` (how far the worker being served is ahead
of the slowest worker); ``max_staleness`` is its maximum.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..comm import Communicator
from ..compress import Compressor, Payload
from ..linkdelay import link_delay
from . import wire
from .checkpoint import to_numpy
from .optim import ShardOptimizer

__all__ = ["PieceState", "Server"]


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
    last_seq: np.ndarray = field(default=None)  # type: ignore[assignment]
    slots: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.last_seq is None:
            self.last_seq = np.zeros(self.workers, dtype=np.int64)


class Server:
    """The state and event loop of one server rank (built by :class:`~mpicomm.ps.KVStore`)."""

    def __init__(self, comm: Communicator, workers: int, mode: str, staleness: int,
                 optimizer: ShardOptimizer, compressor: Compressor | None) -> None:
        self.comm = comm
        self.mpi = comm.p2p
        self.delay = link_delay(comm)  # the emulated cluster's latency; None elsewhere
        self.workers = workers
        self.mode = mode
        self.staleness = staleness
        self.optimizer = optimizer
        self.compressor = compressor
        self.pieces: dict[tuple[int, int], PieceState] = {}
        self.closed = np.zeros(workers, dtype=bool)
        self.pending: list[tuple[int, PieceState]] = []  # (worker, piece) pulls waiting
        self.sends: list[tuple[MPI.Request, Any]] = []
        self.ckpt_requests = 0
        self.templates: dict[tuple[int, int], Payload] = {}
        self.stats = {"max_staleness": 0, "pushes": 0, "pulls": 0, "bytes_pushed": 0,
                      "bytes_pulled": 0, "duplicates": 0, "updates": 0, "idle_s": 0.0, "cpu_s": 0.0,
                      "wall_s": 0.0}

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Run until every worker has closed; any error aborts the job naming this rank."""
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            self._loop()
            self.stats["cpu_s"] = time.process_time() - cpu
            self.stats["wall_s"] = time.perf_counter() - wall
        except Exception as exc:  # noqa: BLE001 - every failure must end the job
            self.comm.abort(f"parameter server failed: {type(exc).__name__}: {exc}; aborting "
                            f"the job.\n{traceback.format_exc()}")

    def _loop(self) -> None:
        backoff = wire.Backoff(wire.BACKOFF_MIN_S, wire.BACKOFF_MAX_S)
        status = MPI.Status()
        while not (self.closed.all() and not self.sends):
            msg = self.mpi.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                self._reap_sends()
                t0 = time.perf_counter()
                backoff.idle(urgent=bool(self.sends))
                self.stats["idle_s"] += time.perf_counter() - t0
                continue
            backoff.busy()
            source, tag = status.Get_source(), status.Get_tag()
            if tag == wire.TAG_REQUEST:
                buf = wire.recv_bytes(msg, status, self.delay)
                self._handle(source, wire.unpack(buf), buf.nbytes)
            elif tag == wire.TAG_CONTROL:
                self._control(source, msg.recv())
            else:
                raise RuntimeError(f"unexpected message with tag {tag} from rank {source}")
            self._reap_sends()
        wire.wait_requests([r for r, _ in self.sends])
        self.sends.clear()

    def _reap_sends(self) -> None:
        if self.sends:
            self.sends = [(r, b) for r, b in self.sends if not r.Test()]

    # ------------------------------------------------------------------ requests
    def _handle(self, source: int, m: wire.Message, nbytes: int) -> None:
        if m.op == wire.PUSH:
            self.stats["bytes_pushed"] += nbytes
            self._push(self._piece(m), m)
        elif m.op == wire.PULL:
            self.pending.append((m.a, self._piece(m)))
            self._serve_pending()
        elif m.op == wire.CLOSE:
            self.closed[m.a] = True
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

    def _push(self, st: PieceState, m: wire.Message) -> None:
        seq, w, step = m.a, m.b, m.c
        last = int(st.last_seq[w])
        if seq <= last:  # already applied (a replay after restore, a resend): skip
            self.stats["duplicates"] += 1
            return
        if seq != last + 1:
            raise RuntimeError(f"lost update: worker {w} pushed key {st.name} with sequence "
                               f"number {seq}, the last applied was {last}")
        grad = self._decode(st, m, step)
        if grad.shape != st.value.shape or grad.dtype != st.value.dtype:
            raise RuntimeError(f"push of key {st.name} by worker {w}: got {grad.dtype} "
                               f"{tuple(grad.shape)}, hold {st.value.dtype} "
                               f"{tuple(st.value.shape)}")
        st.last_seq[w] = seq
        self.stats["pushes"] += 1
        if self.mode == "sync":
            slots = st.slots.setdefault(seq, [None] * self.workers)
            slots[w] = grad.clone()
            while (ready := st.slots.get(st.version + 1)) is not None and all(
                    g is not None for g in ready):
                del st.slots[st.version + 1]
                total = ready[0]
                for g in ready[1:]:
                    total = total + g
                self.optimizer.step(st.value, total / self.workers, st.opt)
                st.version += 1
                self.stats["updates"] += 1
        else:
            self.optimizer.step(st.value, grad / self.workers, st.opt)
            st.version += 1
            self.stats["updates"] += 1
        self._serve_pending()

    def _decode(self, st: PieceState, m: wire.Message, step: int) -> torch.Tensor:
        """The dense gradient of a push. A compressed push carries the payload's arrays
        only; the local context a compressor needs to decompress (shape, k, and for
        random-k the indices drawn from the piece's name and the step) is rebuilt by
        compressing zeros under the same name and step. Where that context does not
        depend on the step (all but random-k) it is built once per piece and reused."""
        if self.compressor is None:
            return m.arrays[0]
        template = self.templates.get((st.key_id, st.index))
        if template is None:
            template = self._template(st, step)
            if _same(template.ctx, self._template(st, step + 1).ctx):
                self.templates[(st.key_id, st.index)] = template
        names = sorted(template.arrays)
        if len(names) != len(m.arrays):
            raise RuntimeError(f"compressed push of key {st.name}: {len(m.arrays)} arrays, "
                               f"the compressor makes {len(names)}")
        payload = Payload(dict(zip(names, m.arrays)), template.ctx)
        return self.compressor.decompress(payload).reshape(-1)

    def _template(self, st: PieceState, step: int) -> Payload:
        assert self.compressor is not None
        return self.compressor.compress(torch.zeros_like(st.value), name=st.name, step=step)

    # ------------------------------------------------------------------ pulls
    def _ready(self, w: int, st: PieceState) -> bool:
        c_w = int(st.last_seq[w])
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
        open_ = ~self.closed
        open_[w] = True
        return int(st.last_seq[open_].min())

    def _serve_pending(self) -> None:
        keep = []
        for w, st in self.pending:
            if self._ready(w, st):
                self._reply(w, st)
            else:
                keep.append((w, st))
        self.pending = keep

    def _reply(self, w: int, st: PieceState) -> None:
        stale = max(0, int(st.last_seq[w]) - self._slowest(w, st))
        self.stats["max_staleness"] = max(self.stats["max_staleness"], stale)
        self.stats["pulls"] += 1
        buf = wire.pack(wire.REPLY, st.key_id, st.index, stale, int(st.last_seq.sum()),
                        st.version, arrays=[st.value])
        self.stats["bytes_pulled"] += buf.nbytes
        self.sends.append((wire.isend_bytes(self.mpi, buf, w, wire.TAG_REPLY, self.delay), buf))

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
            if p.get("version") is not None:
                st.version = int(p["version"])
                st.last_seq = np.array(p["last_seq"], dtype=np.int64).copy()
            self.pieces[key] = st
        self.sends.append((self.mpi.isend({"op": "ack"}, source, wire.TAG_CONTROL), None))

    def _send_state(self, dest: int) -> None:
        """All workers asked for a checkpoint: everything they pushed before is in."""
        pieces = {}
        for key, st in self.pieces.items():
            if st.slots:
                raise RuntimeError(f"checkpoint while step {min(st.slots)} of key {st.name} "
                                   "is incomplete; call checkpoint() between steps")
            pieces[key] = {"value": to_numpy(st.value), "version": st.version,
                           "last_seq": st.last_seq.copy(),
                           "opt": {k: (to_numpy(v) if isinstance(v, torch.Tensor) else int(v))
                                   for k, v in st.opt.items()}}
        self.sends.append((self.mpi.isend({"pieces": pieces}, dest, wire.TAG_STATE), None))


def _same(a: Any, b: Any) -> bool:
    """Equality of two compressor contexts (dataclasses of metadata and tensors)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a) if f.name != "step")
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``dtype`` owning a copy of ``a`` (bfloat16 arrives as int16 bits)."""
    t = torch.from_numpy(np.array(a, copy=True)).reshape(-1)
    return t.view(dtype) if dtype == torch.bfloat16 else t.to(dtype)
