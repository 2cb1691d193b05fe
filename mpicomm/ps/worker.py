"""The worker side of the parameter server: push gradients, pull values, by key.

A worker talks to every server point to point on the store's private communicator:

* ``push``: one message per piece of the key (see :mod:`mpicomm.ps.sharding`), sent with
  ``MPI_Isend``. Every push of a key carries the worker's next sequence number for that
  key (1, 2, ...). A dense push goes in the detached form (:mod:`mpicomm.ps.wire`):
  straight from the caller's gradient, no copy, so ``push`` returns once the servers
  hold the bytes (the caller may then change the gradient; MPI only moves a large
  message while both sides call into it, so a send left in flight would not have moved
  much before the next call anyway). With a compressor, each piece is compressed on its
  own (name ``"<key>/<piece>"``, layout :mod:`mpicomm.ps.codec`) after error feedback,
  which stays on the worker; those sends own their buffers and complete lazily (a later
  call waits for them).
* ``pull``: one small request per piece, then the replies are received by matched probe
  as they come (a server may hold a pull back for consistency). A dense reply's values
  are received straight into place (``out`` itself for ``pull(key, out=...)`` on the
  CPU). With a pull compressor a reply is either the whole piece (the first pull, and
  the first after a restore) or a compressed delta that the worker adds to its own copy
  of the piece, which then mirrors, bit for bit, the server's record of that copy.
* ``push_pull``: ``push`` then ``pull`` in one pass (dense stores): every piece's push
  header also asks for its pull (:data:`mpicomm.ps.wire.PULL_AFTER`), so no request
  message is sent, nothing waits for the push to complete first, and with chunked
  pieces the replies of the first chunks arrive while the last ones still go out.
* Waiting for a reply: the worker polls without sleeping for about twice the time the
  reply's bytes took to arrive last time (:meth:`Worker.expected_wait`: the server's
  update and the transfer), then backs off (:class:`mpicomm.ps.wire.Backoff`); a reply
  that comes while the worker sleeps is late by up to a sleep.

A worker sends its pieces starting from server ``w mod S`` (the servers answer in a
matching staggered order), so that the workers do not all queue at server 0 first.

Cost of a dense push + pull of ``n`` bytes with ``S`` servers (alpha-beta, one worker):
``S`` requests and ``S`` replies each way, ``about 2*alpha + 2*n*beta`` per worker plus
the server's queueing; with ``W`` workers on one server link the server's port carries
``2*W*n`` bytes per step, see :func:`mpicomm.collectives.cost.ps_push_pull`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .. import clock
from ..buffers import FLOAT_DTYPES, from_torch, inspect, to_torch
from ..comm import Communicator
from ..compress import Compressor, ErrorFeedback
from ..emulate.linkdelay import LinkDelay
from ..p2p import improbe, isend_bytes, isend_object, recv_bytes, recv_object, sent, wait_sends
from . import checkpoint as ckpt
from . import wire
from .codec import Codec, PieceView, pull_name
from .keys import KeyInfo, piece_name
from .sharding import Piece, ShardPlan

__all__ = ["KeyInfo", "Worker", "piece_name", "LARGE_BYTES"]

#: Detached receives at least this large time the link for :meth:`Worker.expected_wait`.
LARGE_BYTES = 1 << 16


class Worker:
    """One worker's client (built by :class:`~mpicomm.ps.KVStore`)."""

    def __init__(self, mpi: MPI.Intracomm, group: Communicator, workers: int, servers: int,
                 mode: str, optimizer: dict[str, Any], compressor: Compressor | None,
                 delay: LinkDelay | None = None,
                 pull_compressor: Compressor | None = None,
                 chunk_bytes: int = 0) -> None:
        self.mpi = mpi
        self.delay = delay  # the emulated cluster's injected latency; None elsewhere
        self.group = group
        self.rank = group.rank
        self.workers = workers
        self.servers = servers
        self.mode = mode
        self.optimizer = optimizer
        self.compressor = compressor
        self.ef = ErrorFeedback() if compressor is not None else None
        self.codec = Codec(compressor) if compressor is not None else None
        self.pull_codec = Codec(pull_compressor) if pull_compressor is not None else None
        self.copies: dict[tuple[int, int], torch.Tensor] = {}  # compressed pulls' mirror
        self.plan = ShardPlan(servers, chunk_bytes=chunk_bytes)
        self.keys: dict[Hashable, KeyInfo] = {}
        self.seq: dict[int, int] = {}
        self.sends: list[tuple[MPI.Request, Any]] = []
        self.byte_s = 0.0  # seconds per byte of the last large detached receive (0: none)
        self.server_ranks = [self.server_rank(s) for s in range(servers)]
        self.stats = {"max_staleness": 0, "pushes": 0, "pulls": 0, "bytes_pushed": 0,
                      "bytes_pulled": 0, "server_pushes": 0, "wait_s": 0.0,
                      "staleness": 0}

    def server_rank(self, server: int) -> int:
        """The rank (in the store's communicator) of server index ``server``."""
        return self.workers + server

    # ------------------------------------------------------------------ init
    def init_many(self, items: Sequence[tuple[Hashable, Any]]) -> None:
        """Register keys with their initial values (worker 0's values win); collective
        over the workers. Mismatched keys, shapes or dtypes: ``ValueError`` everywhere."""
        error, desc = None, []
        try:
            for key, value in items:
                desc.append(self._describe(key, value))
        except (TypeError, ValueError) as exc:
            error = exc
        everyone = self.group.allgather_object(
            (None if error is None else f"{type(error).__name__}: {error}", desc))
        for w, (err, _) in enumerate(everyone):
            if err is not None:
                if error is not None:
                    raise error
                raise ValueError(f"KVStore.init: worker {w} rejected its arguments: {err}")
        for w, (_, theirs) in enumerate(everyone):
            if theirs != desc:
                raise ValueError(f"KVStore.init: worker {w} initialises {_show(theirs)}, "
                                 f"worker {self.rank} {_show(desc)}; every worker must init "
                                 "the same keys with the same shapes and dtypes, in order")
        new = [self._register(key, shape, dtype, fw, dev)
               for (key, shape, dtype, fw, dev) in desc]
        messages: dict[int, list[dict[str, Any]]] = {}
        if self.rank == 0:
            for info, (_, value) in zip(new, items):
                flat = _flat_cpu(value)
                for p in info.pieces:
                    messages.setdefault(p.server, []).append(
                        self._init_piece(info, p, flat[p.start:p.stop]))
        self._send_init(messages)

    def _describe(self, key: Hashable, value: Any) -> tuple[Any, ...]:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"keys must be str or int, got {type(key).__name__}")
        if key in self.keys:
            raise ValueError(f"key {key!r} is already initialised")
        info = inspect(value)
        if info.dtype not in FLOAT_DTYPES:
            raise TypeError(f"key {key!r}: values must be floating point, got {info.dtype}")
        return (key, info.shape, info.dtype, info.framework, info.device)

    def _register(self, key: Hashable, shape: tuple[int, ...], dtype: str, framework: str,
                  device: str) -> KeyInfo:
        key_id = len(self.keys)
        tdtype = getattr(torch, dtype)
        numel = int(np.prod(shape, dtype=np.int64))
        pieces = self.plan.place(key_id, numel, tdtype.itemsize)
        info = KeyInfo(key, key_id, tuple(shape), tdtype, framework, device, pieces)
        self.keys[key] = info
        self.seq[key_id] = 0
        return info

    def _init_piece(self, info: KeyInfo, p: Piece, value: torch.Tensor,
                    state: dict[str, Any] | None = None) -> dict[str, Any]:
        msg = {"key_id": info.key_id, "index": p.index, "name": piece_name(info.key, p.index),
               "dtype": str(info.dtype).replace("torch.", ""), "value": ckpt.to_numpy(value),
               "shape": list(info.shape), "start": p.start}
        if state is not None:
            msg.update(state)
        return msg

    def _send_init(self, messages: dict[int, list[dict[str, Any]]]) -> None:
        """Worker 0 sends each server its new pieces and waits for the acks; then every
        worker waits for worker 0, so no push can reach a server before its piece."""
        if self.rank == 0 and messages:
            reqs = [isend_object(self.mpi, {"op": "init", "pieces": pieces},
                                 self.server_rank(s), wire.TAG_CONTROL, self.delay)
                    for s, pieces in messages.items()]
            for s in messages:
                msg, status = wire.probe_wait(self.mpi, self.server_rank(s), wire.TAG_CONTROL)
                recv_object(msg, self.delay, status, self.mpi)
            self._wait(reqs)
        self.group.barrier()

    # ------------------------------------------------------------------ push / pull
    def info(self, key: Hashable) -> KeyInfo:
        try:
            return self.keys[key]
        except (KeyError, TypeError):
            raise ValueError(f"unknown key {key!r}; init() it first (known: "
                             f"{list(self.keys)[:8]})") from None

    def check_value(self, info: KeyInfo, x: Any, what: str) -> None:
        if type(x) is np.ndarray:      # the usual cases, without a full inspection
            if x.dtype == info.numpy_dtype and x.shape == info.shape:
                return
        elif type(x) is torch.Tensor and x.dtype == info.dtype and x.shape == info.shape:
            return
        xi = inspect(x)
        if xi.shape != info.shape:
            raise ValueError(f"{what} of key {info.key!r}: shape {xi.shape}, the key has "
                             f"{info.shape}")
        if getattr(torch, xi.dtype) != info.dtype:
            raise TypeError(f"{what} of key {info.key!r}: dtype {xi.dtype}, the key has "
                            f"{str(info.dtype).replace('torch.', '')}")

    def push(self, key: Hashable, grad: Any, wait: bool = True) -> None:
        """Push ``grad``; with ``wait=False`` a dense push may still be reading ``grad``
        when the call returns (the caller then leaves it unchanged until :meth:`flush`)."""
        info = self.info(key)
        self.check_value(info, grad, "push")
        self._reap()
        seq = self.seq[info.key_id] + 1
        sends = self.send_push(info, _flat_cpu(grad), seq)
        self.seq[info.key_id] = seq
        if wait and sends:
            self._wait([r for r, _ in sends])

    def staggered(self, pieces: Sequence[Piece]) -> list[Piece]:
        """``pieces`` in chunk order, and within a chunk position starting from server
        ``rank mod S`` and wrapping around, so that the workers spread their first
        pieces over the servers (:mod:`mpicomm.ps.server`) and every server gets its
        first chunk early."""
        if len(pieces) < 2:
            return list(pieces)
        return sorted(pieces, key=lambda p: (p.chunk, (p.server - self.rank) % self.servers))

    def send_push(self, info: KeyInfo, flat: torch.Tensor, seq: int
                  ) -> list[tuple[MPI.Request, Any]]:
        """Send the pieces of one push numbered ``seq``; returns the sends that read
        ``flat`` itself (a dense push's), also kept in :attr:`sends`."""
        if self.codec is None:
            return [s for p in self.staggered(info.pieces)
                    for s in self.send_dense(info, p, flat, seq, 0)]
        for p in self.staggered(info.pieces):
            part = flat[p.start:p.stop]
            assert self.ef is not None
            name = piece_name(info.key, p.index)
            comp = self.ef.compensate(name, part)
            payload, sent = self.codec.encode(self.view(self.codec, info, p), comp, name, seq)
            self.ef.update(name, comp, sent)
            arrays = self.codec.arrays(payload)
            buf = wire.pack(wire.PUSH, info.key_id, p.index, seq, self.rank, seq,
                            arrays=arrays)
            self.stats["bytes_pushed"] += buf.nbytes
            self.sends.append((isend_bytes(self.mpi, buf, self.server_rank(p.server),
                                              wire.TAG_REQUEST, self.delay), buf))
        self.stats["pushes"] += 1
        return []

    def send_dense(self, info: KeyInfo, p: Piece, flat: torch.Tensor, seq: int,
                   then: int) -> list[tuple[MPI.Request, Any]]:
        """Send piece ``p`` of a dense push numbered ``seq`` straight from ``flat``
        (detached form); ``then = wire.PULL_AFTER`` asks the server to answer a pull of
        the piece right after applying it. Returns the sends (also in :attr:`sends`)."""
        part = _piece_of(flat, p)
        sends = wire.isend_detached(self.mpi, self.server_rank(p.server), wire.TAG_REQUEST,
                                    wire.PUSH, info.key_id, p.index, seq, self.rank, seq,
                                    then, arrays=[part], delay=self.delay)
        self.stats["bytes_pushed"] += wire.message_nbytes([part])
        if p.index == len(info.pieces) - 1:
            self.stats["pushes"] += 1
        self.sends += sends
        return sends

    def push_pull_many(self, infos: Sequence[KeyInfo], grads: Sequence[torch.Tensor],
                       outs: Sequence[torch.Tensor | None] | None = None
                       ) -> list[torch.Tensor]:
        """Push ``grads`` (flat CPU tensors of the keys' dtypes) and pull the keys, as
        ``push`` then :meth:`pull_many`, pipelined: every piece's push asks for its
        pull (``wire.PULL_AFTER``, no request message), so a server answers piece ``i``
        while piece ``i + 1`` arrives and the replies are received while later pieces
        still go out. ``outs`` may be ``grads`` themselves: a piece's reply is received
        only once its push has left. Returns like :meth:`pull_many`, once every send is
        complete. Stores with a push or pull compressor push, then pull."""
        self._reap()
        if self.codec is not None or self.pull_codec is not None:
            for info, flat in zip(infos, grads):
                self.seq[info.key_id] += 1
                self._wait([r for r, _ in self.send_push(info, flat, self.seq[info.key_id])])
            return self.pull_many(infos, outs)
        results = self._results(infos, outs)
        where, pushing = {}, {}
        for slot, (info, flat) in enumerate(zip(infos, grads)):
            seq = self.seq[info.key_id] + 1
            for p in self.staggered(info.pieces):
                where[(info.key_id, p.index)] = (slot, p)
                pushing[(info.key_id, p.index)] = [
                    r for r, _ in self.send_dense(info, p, flat, seq, wire.PULL_AFTER)]
            self.seq[info.key_id] = seq
        self._collect(infos, results, where, pushing)
        self._wait([r for reqs in pushing.values() for r in reqs])
        return results

    def pull(self, key: Hashable, out: Any = None) -> Any:
        info = self.info(key)
        return self._pull_into(info, out, lambda target: self.pull_many([info], [target])[0])

    def _pull_into(self, info: KeyInfo, out: Any,
                   fetch: Callable[[torch.Tensor | None], torch.Tensor]) -> Any:
        """The value ``fetch(target)`` returns, in ``out`` (checked first) or as a new
        array of the key's framework and device; ``target`` is ``out`` itself where it is
        a CPU array (received in place), else ``None``."""
        if out is not None:
            self.check_value(info, out, "pull out=")
            contiguous = (out.is_contiguous() if isinstance(out, torch.Tensor)
                          else out.flags.c_contiguous)
            if not contiguous:
                raise ValueError("pull: out must be contiguous")
        target = None if out is None else _flat_cpu(out, copy=False)
        direct = target is not None and target.device.type == "cpu"
        flat = fetch(target if direct else None)
        if target is not None:
            if not direct:
                target.copy_(flat)
                torch.cuda.current_stream(target.device).synchronize()
            return out
        result = flat.reshape(info.shape)
        if info.device != "cpu":
            result = result.to(info.device)
        return from_torch(result, like=info.like())

    def push_pull(self, key: Hashable, grad: Any, out: Any = None) -> Any:
        """:meth:`push` then :meth:`pull`, pipelined (:meth:`push_pull_many`)."""
        info = self.info(key)
        self.check_value(info, grad, "push_pull")
        return self._pull_into(info, out, lambda target: self.push_pull_many(
            [info], [_flat_cpu(grad)], [target])[0])

    def pull_many(self, infos: Sequence[KeyInfo],
                  outs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Request every piece of ``infos`` at once; return their flat CPU values (in
        ``outs[i]``, flat contiguous CPU tensors of the key's dtype, where given)."""
        results = self._results(infos, outs)
        where = {}
        for slot, info in enumerate(infos):
            for p in self.staggered(info.pieces):
                where[(info.key_id, p.index)] = (slot, p)
                buf = wire.pack(wire.PULL, info.key_id, p.index, self.rank)
                self.sends.append((isend_bytes(self.mpi, buf, self.server_rank(p.server),
                                                  wire.TAG_REQUEST, self.delay), buf))
        self._collect(infos, results, where)
        return results

    @staticmethod
    def _results(infos: Sequence[KeyInfo], outs: Sequence[torch.Tensor | None] | None
                 ) -> list[torch.Tensor]:
        outs = outs if outs is not None else [None] * len(infos)
        return [torch.empty(i.numel, dtype=i.dtype) if o is None else o
                for i, o in zip(infos, outs)]

    def _collect(self, infos: Sequence[KeyInfo], results: list[torch.Tensor],
                 where: dict[tuple[int, int], tuple[int, Piece]],
                 pushing: dict[tuple[int, int], list[MPI.Request]] | None = None) -> None:
        """Receive the replies to the pulls of ``where`` (``(key id, piece) -> (slot,
        piece)``) into ``results`` as they come; ``pushing``: the sends of each piece's
        push, completed before its reply is received (``results`` may be the pushed
        values)."""
        t0 = clock.now()
        expected = sum(p.numel * infos[slot].dtype.itemsize for slot, p in where.values())
        seen_pushes = None
        stalest = 0
        backoff = wire.Backoff(wire.BACKOFF_MIN_S, wire.BACKOFF_MAX_S)
        backoff.expect(self.expected_wait(expected))
        status = MPI.Status()
        while where:
            msg = improbe(self.mpi, MPI.ANY_SOURCE, wire.TAG_REPLY, status,
                          sources=self.server_ranks)
            if msg is None:
                self._reap()
                backoff.idle(urgent=bool(self.sends))
                continue
            backoff.busy()
            buf = recv_bytes(msg, status, self.delay, self.mpi)
            m = wire.unpack(buf)
            slot, p = where.pop((m.key_id, m.piece))
            if pushing:    # its push has arrived (the server answers after it): done
                self._wait(pushing.pop((m.key_id, m.piece)))
            nbytes = buf.nbytes
            if m.follow:   # a dense value, detached (maybe in parts): straight into place
                t1 = time.perf_counter()
                target = _piece_of(results[slot], p)
                into = (list(torch.split(target, [n for _, n in m.follow]))
                        if len(m.follow) > 1 else [target])
                got = wire.recv_detached(self.mpi, status.Get_source(), m, into)
                if got >= LARGE_BYTES:
                    self.byte_s = (time.perf_counter() - t1) / got
                # counted as the one-array message it stands for, however many parts
                nbytes = wire.reply_nbytes(p.numel, infos[slot].dtype.itemsize)
            else:
                results[slot][p.start:p.stop] = self._received(infos[slot], p, m)
            self.stats["bytes_pulled"] += nbytes
            self.stats["max_staleness"] = max(self.stats["max_staleness"], m.a)
            stalest = max(stalest, m.a)
            seen_pushes = m.b if seen_pushes is None else min(seen_pushes, m.b)
        self._reap()
        self.stats["pulls"] += len(infos)
        self.stats["staleness"] = stalest  # of this pull, for per-step metrics
        if seen_pushes is not None:
            self.stats["server_pushes"] = seen_pushes
        self.stats["wait_s"] += clock.now() - t0

    def expected_wait(self, nbytes: int) -> float:
        """How long a pull of ``nbytes`` may take once requested when the servers have
        its values: the transfer at the last measured rate, twice (the server's update
        pass streams the bytes too); 0 before a large reply was measured."""
        return 2 * nbytes * self.byte_s

    def view(self, codec: Codec, info: KeyInfo, p: Piece) -> PieceView:
        """How ``codec`` lays out piece ``p`` of ``info`` (see :mod:`mpicomm.ps.codec`)."""
        return codec.view(info.shape, p.start, p.stop)

    def _received(self, info: KeyInfo, p: Piece, m: wire.Message) -> torch.Tensor:
        """The piece's value from a pull reply: the value itself (``d == 0``), or, with a
        pull compressor, this worker's copy advanced by each decoded delta of the reply
        in order, the last one number ``d`` (:mod:`mpicomm.ps.server`)."""
        if self.pull_codec is None:
            return m.arrays[0]
        where = (info.key_id, p.index)
        if m.d == 0:
            self.copies[where] = m.arrays[0].clone()
        else:
            held = self.copies.get(where)
            if held is None:
                raise RuntimeError(f"compressed pull reply for key {info.key!r} piece "
                                   f"{p.index}, but this worker holds no copy of it")
            name = pull_name(piece_name(info.key, p.index))
            for delta in self.pull_codec.decode_chain(self.view(self.pull_codec, info, p),
                                                      m.arrays, name, m.d, info.dtype):
                held += delta
        return self.copies[where]

    def _reap(self) -> None:
        if self.sends:
            self.sends = [(r, b) for r, b in self.sends if not sent(r)]

    def _wait(self, requests: list[MPI.Request]) -> None:
        """Complete this worker's own sends (:func:`mpicomm.ps.wire.wait_requests`,
        polling without sleeping: a large message moves only while the sender calls
        into MPI), timed by the virtual clock where it runs."""
        wait_sends(requests, 0.0, lambda reqs, _: wire.wait_requests(reqs, urgent=True))

    def flush(self) -> None:
        self._wait([r for r, _ in self.sends])
        self.sends.clear()

    def _to_all_servers(self, op: int) -> None:
        for s in range(self.servers):
            buf = wire.pack(op, 0, 0, self.rank)
            self.sends.append((isend_bytes(self.mpi, buf, self.server_rank(s),
                                              wire.TAG_REQUEST, self.delay), buf))

    def close(self) -> None:
        self._to_all_servers(wire.CLOSE)
        self.flush()

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> dict[str, Any] | None:
        """Collective over the workers: every server's shards, optimizer state and
        counters, and every worker's sequence numbers and residuals, joined into the
        checkpoint dict on worker 0 (``None`` on the others). ``RuntimeError`` on every
        worker if worker 0 could not assemble it."""
        self._to_all_servers(wire.CKPT)
        mine = {"seq": [self.seq[self.keys[k].key_id] for k in self.keys],
                "residuals": ({} if self.ef is None else
                              {n: ckpt.to_torch_cpu(v) for n, v in
                               self.ef.state_dict()["residuals"].items()}),
                "compressor": _compressor_state(self.compressor)}
        gathered = self.group.gather_object(mine, root=0)
        data, error = None, None
        if self.rank == 0:
            try:
                states = {}
                for s in range(self.servers):
                    msg, status = wire.probe_wait(self.mpi, self.server_rank(s),
                                                  wire.TAG_STATE)
                    states[s] = recv_object(msg, self.delay, status, self.mpi)["pieces"]
                data = ckpt.assemble(list(self.keys.values()), states, gathered,
                                     workers=self.workers, mode=self.mode,
                                     optimizer=self.optimizer)
            except Exception as exc:  # noqa: BLE001 - reported on every worker below
                error = f"{type(exc).__name__}: {exc}"
        self.flush()
        error = self.group.bcast_object(error)
        if error is not None:
            raise RuntimeError(f"KVStore checkpoint failed on worker 0: {error}")
        return data

    def checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Collective over the workers: :meth:`snapshot`, written to ``path`` by worker 0."""
        data = self.snapshot()
        error = None
        if data is not None:
            try:
                ckpt.write_atomic(data, path)
            except Exception as exc:  # noqa: BLE001 - reported on every worker below
                error = f"{type(exc).__name__}: {exc}"
        error = self.group.bcast_object(error)
        if error is not None:
            raise RuntimeError(f"KVStore.checkpoint({os.fspath(path)!r}) failed on worker 0: "
                               f"{error}")

    def check_checkpoint(self, data: Any) -> dict[str, Any]:
        """``data`` (a loaded checkpoint) if this store can restore it, else ``ValueError``
        (local: no message)."""
        return ckpt.check(data, workers=self.workers, optimizer=self.optimizer,
                          stateful_compressor=hasattr(self.compressor, "load_state_dict"))

    def restore(self, source: str | os.PathLike[str] | dict[str, Any]) -> None:
        """Collective over the workers: load a checkpoint (a file, or on worker 0 the
        loaded dict) into this (empty) store."""
        if self.keys:  # the same on every worker (init is collective): no message needed
            raise ValueError("KVStore.restore: the store already has keys; restore into a new "
                             "store instead of calling init()")
        what = "a checkpoint" if isinstance(source, dict) else repr(os.fspath(source))
        data, error = None, None
        if self.rank == 0:
            try:
                data = (self.check_checkpoint(source) if isinstance(source, dict) else
                        ckpt.load(source, workers=self.workers, optimizer=self.optimizer,
                                  stateful_compressor=hasattr(self.compressor,
                                                              "load_state_dict")))
            except (OSError, ValueError, TypeError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = self.group.bcast_object(error)
        if error is not None:
            raise ValueError(f"KVStore.restore({what}): {error}")
        meta = self.group.bcast_object(None if data is None else ckpt.metadata(data))
        mine = self.group.scatter_object(None if data is None else ckpt.worker_states(data),
                                         root=0)
        if mine["compressor"] and not hasattr(self.compressor, "load_state_dict"):
            # every worker gets here alike: all saved the same compressor kind
            raise ValueError(f"KVStore.restore({what}): the checkpoint holds push "
                             f"compressor state, this store's compressor "
                             f"{self.compressor!r} keeps none")
        infos = [self._register(k, tuple(shape), dt, fw, "cpu")
                 for k, shape, dt, fw in zip(meta["keys"], meta["shapes"], meta["dtypes"],
                                             meta["frameworks"])]
        for info, seqs in zip(infos, meta["last_seq"]):
            self.seq[info.key_id] = int(seqs[self.rank])
        if self.ef is not None:
            self.ef.load_state_dict({"residuals": mine["residuals"]})
        if mine["compressor"]:
            self.compressor.load_state_dict(mine["compressor"])  # type: ignore[union-attr]
        messages: dict[int, list[dict[str, Any]]] = {}
        if data is not None:
            for k, info in enumerate(infos):
                flat = data["values"][k].reshape(-1)
                for p in info.pieces:
                    state = ckpt.piece_state(data, k, p.start, p.stop)
                    messages.setdefault(p.server, []).append(
                        self._init_piece(info, p, flat[p.start:p.stop], state))
        self._send_init(messages)


def _compressor_state(compressor: Compressor | None) -> dict[str, Any]:
    """A stateful compressor's checkpointable state (PowerSGD's warm-start Q per piece),
    as CPU torch tensors; ``{}`` for the stateless ones."""
    if compressor is None or not hasattr(compressor, "state_dict"):
        return {}
    return _to_cpu(compressor.state_dict())


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return ckpt.to_torch_cpu(obj)


def _piece_of(flat: torch.Tensor, p: Piece) -> torch.Tensor:
    """Piece ``p``'s elements of a key's flat tensor: the tensor itself where the piece
    is the whole key (a slice costs about a microsecond on a hot path)."""
    return flat if p.numel == flat.numel() else flat[p.start:p.stop]


def _flat_cpu(x: Any, copy: bool = True) -> torch.Tensor:
    """``x`` as a flat torch tensor: a view where it is a contiguous CPU array (numpy or
    torch), else a flat copy on the CPU (``copy=False``: left on its device)."""
    if type(x) is np.ndarray and x.flags.c_contiguous:
        return torch.from_numpy(x).view(-1)
    t = to_torch(x).detach()
    if copy and t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1)


def _show(desc: list[tuple[Any, ...]]) -> str:
    return ", ".join(f"{k!r} {tuple(s)} {d}" for k, s, d, *_ in desc) or "no keys"
