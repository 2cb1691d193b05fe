"""The stall inspector: who has not arrived in a collective, and where each of them is.

When a rank has waited in an mpicomm collective (or sparse collective, or strategy
aggregation) longer than ``threshold_s``, its inspector thread asks every other rank of
that collective's group, over a private duplicate of ``MPI.COMM_WORLD``, what it is doing
now, and logs (``mpicomm.stall`` logger, stderr) and keeps a report like::

    [mpicomm rank 0] stall: waiting 2.0 s in allreduce (call #4 over ranks [0, 1, 2]).
      not arrived: rank 1: in no mpicomm collective (last: allreduce #3, finished 2.1 s ago)
      not arrived: rank 2: in allreduce (call #1 over ranks [1, 2]) for 2.0 s
      arrived: ranks [0]

The job is not stopped: the report is diagnostic, the collective goes on waiting. Each
stalled call is reported once, and only the innermost one of a thread (a strategy's
aggregation waiting in its gTop-k exchange is reported as the exchange).

How it works: the inspector is the registered watch of :mod:`mpicomm.hooks`, so every
traced front-end call registers itself while it runs (name, the world ranks of its
communicator, a per-group call count, start time, thread): a dict insert and delete
under a lock per call. Each rank runs one
daemon thread that every ``poll_s`` answers queries from other ranks and checks its own
running calls against the threshold. Answers come from that thread, so a rank that is
computing, sleeping or blocked inside MPI still answers (the GIL is released in MPI and
in sleeps; pure-Python compute yields it every few milliseconds). A rank whose thread
does not answer within ``reply_timeout_s`` is reported as "no answer" (it is likely
stuck holding the GIL in native code, or dead).

"Arrived" means: that rank is currently inside a call of the same name over the same
group of ranks. Call counts are per group of world ranks and count every traced call on
any communicator over that group, so they tell order ("#3 vs #4") when the program uses
one communicator per group, and are indicative otherwise.

Turn it on with ``MPICOMM_STALL_S=seconds`` (read by :func:`mpicomm.init`), with checked
mode (``MPICOMM_CHECK=1`` / ``init(check=True)``: threshold :data:`CHECKED_DEFAULT_S`
unless ``MPICOMM_STALL_S`` says otherwise; ``MPICOMM_STALL_S=0`` turns it off), or
explicitly::

    with StallInspector(threshold_s=5.0):          # collective: duplicates the world
        train()

Needs ``MPI_THREAD_MULTIPLE`` (the inspector's thread talks MPI while the training
thread is in a collective); without it a warning is logged and nothing starts. Cost
when on: per traced call ~1 µs (the registration); one ``Iprobe`` per ``poll_s`` on the
inspector's thread; nothing on the network until a stall.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from .. import hooks
from ..emulate.linkdelay import world_ranks
from ..tags import TAG_STALL_QUERY, TAG_STALL_REPLY

__all__ = ["StallInspector", "StallReport", "start_from_env", "CHECKED_DEFAULT_S"]

log = logging.getLogger("mpicomm.stall")

#: Threshold (seconds) in checked mode when ``MPICOMM_STALL_S`` is not set.
CHECKED_DEFAULT_S = 300.0


@dataclass
class _Call:
    name: str
    group: tuple[int, ...]
    count: int
    start: float
    thread: str


@dataclass
class StallReport:
    """One stalled call: what this rank waits in, and what the others are doing.

    ``peers`` maps a world rank to its answer: ``{"active": [(name, group, count,
    seconds, thread), ...], "last": (name, count, seconds_ago) or None}``, or ``None``
    when it did not answer in time. ``missing`` lists the ranks that have not arrived.
    """

    rank: int
    call: str
    group: tuple[int, ...]
    count: int
    waited_s: float
    peers: dict[int, Any]
    missing: list[int]
    message: str


def _world_ranks(comm: Any) -> tuple[int, ...]:
    cached = comm.resources.get("world_ranks")
    if cached is None:
        cached = tuple(world_ranks(comm.mpi))
        comm.resources["world_ranks"] = cached
    return cached


class StallInspector:
    """Report collectives that wait longer than ``threshold_s`` (see the module docstring).

    Construction is collective over ``MPI.COMM_WORLD`` (one ``Dup``); :meth:`close` (or
    the end of a ``with`` block, or interpreter exit) stops the thread and frees the
    communicator. One inspector per process at a time (``RuntimeError`` otherwise).

    Parameters
    ----------
    threshold_s:
        Seconds a call may wait before it is reported (> 0).
    poll_s:
        How often the thread answers queries and checks (default ``min(0.05,
        threshold_s / 4)``).
    reply_timeout_s:
        How long to wait for each peer's answer (default ``max(1.0, 2 * poll_s)``).
    """

    def __init__(self, threshold_s: float, *, poll_s: float | None = None,
                 reply_timeout_s: float | None = None):
        if isinstance(threshold_s, bool) or not isinstance(threshold_s, (int, float)) \
                or not threshold_s > 0:
            raise ValueError(f"threshold_s must be a positive number, got {threshold_s!r}")
        self.threshold_s = float(threshold_s)
        self.poll_s = min(0.05, self.threshold_s / 4) if poll_s is None else float(poll_s)
        self.reply_timeout_s = (max(1.0, 2 * self.poll_s) if reply_timeout_s is None
                                else float(reply_timeout_s))
        if not self.poll_s > 0 or not self.reply_timeout_s > 0:
            raise ValueError("poll_s and reply_timeout_s must be positive")
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.reports: list[StallReport] = []
        self.enabled = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._counts: dict[tuple[int, ...], int] = {}
        self._last: tuple[str, int, float] | None = None
        self._reported: set[int] = set()
        self._tokens = itertools.count(1)
        self._stop = threading.Event()
        self._closed = False
        self._mpi = MPI.COMM_WORLD.Dup()  # collective, also when disabled: same on all ranks
        self._thread: threading.Thread | None = None
        if not self.enabled:
            log.warning("rank %d: the stall inspector needs MPI_THREAD_MULTIPLE; it is off",
                        self.rank)
            return
        if hooks.set_watch(self) is not None:
            hooks.set_watch(None)
            self._mpi.Free()
            raise RuntimeError("a stall inspector is already running in this process")
        self._thread = threading.Thread(target=self._run, name="mpicomm-stall", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return (f"StallInspector(threshold_s={self.threshold_s}, rank={self.rank}, "
                f"reports={len(self.reports)}{', closed' if self._closed else ''})")

    # ------------------------------------------------------------------ registration
    def enter(self, name: str, comm: Any) -> int:
        """A traced call starts (called by :mod:`mpicomm.hooks`); returns its token."""
        group = _world_ranks(comm)
        token = next(self._tokens)
        now = time.monotonic()
        with self._lock:
            count = self._counts.get(group, 0) + 1
            self._counts[group] = count
            self._calls[token] = _Call(name, group, count, now,
                                       threading.current_thread().name)
        return token

    def leave(self, token: int) -> None:
        """The call of ``token`` ended."""
        with self._lock:
            call = self._calls.pop(token, None)
            if call is not None:
                self._last = (call.name, call.count, time.monotonic())
            self._reported.discard(token)

    def snapshot(self) -> dict[str, Any]:
        """What this rank is doing now (the answer to a peer's query)."""
        now = time.monotonic()
        with self._lock:
            active = [(c.name, list(c.group), c.count, now - c.start, c.thread)
                      for c in self._calls.values()]
            last = None if self._last is None else (self._last[0], self._last[1],
                                                    now - self._last[2])
        return {"active": active, "last": last}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._answer()
            stalled = []
            now = time.monotonic()
            with self._lock:
                # the innermost running call of each thread is the one that waits
                inner: dict[str, tuple[int, _Call]] = {}
                for token, call in self._calls.items():
                    if call.thread not in inner or token > inner[call.thread][0]:
                        inner[call.thread] = (token, call)
                for token, call in inner.values():
                    if token not in self._reported and now - call.start > self.threshold_s:
                        self._reported.add(token)
                        stalled.append(call)
            for call in stalled:
                self._inspect(call)

    def _answer(self) -> None:
        status = MPI.Status()
        while self._mpi.Iprobe(MPI.ANY_SOURCE, TAG_STALL_QUERY, status):
            src = status.Get_source()
            self._mpi.recv(source=src, tag=TAG_STALL_QUERY)
            self._mpi.send(self.snapshot(), dest=src, tag=TAG_STALL_REPLY)

    def _ask(self, peers: list[int]) -> dict[int, Any]:
        for r in peers:
            self._mpi.send(None, dest=r, tag=TAG_STALL_QUERY)
        answers: dict[int, Any] = {r: None for r in peers}
        pending = set(peers)
        deadline = time.monotonic() + self.reply_timeout_s
        status = MPI.Status()
        while pending and time.monotonic() < deadline:
            self._answer()  # a peer may be asking us at the same time
            got = False
            for r in list(pending):
                if self._mpi.Iprobe(r, TAG_STALL_REPLY, status):
                    answers[r] = self._mpi.recv(source=r, tag=TAG_STALL_REPLY)
                    pending.discard(r)
                    got = True
            if not got:
                time.sleep(min(0.005, self.poll_s))
        return answers

    def _inspect(self, call: _Call) -> None:
        waited = time.monotonic() - call.start
        peers = [r for r in call.group if r != self.rank]
        answers = self._ask(peers)
        missing, arrived, lines = [], [self.rank], []
        for r in peers:
            answer = answers[r]
            if answer is None:
                missing.append(r)
                lines.append(f"  not arrived: rank {r}: no answer within "
                             f"{self.reply_timeout_s:g} s")
                continue
            same = [a for a in answer["active"]
                    if a[0] == call.name and tuple(a[1]) == call.group]
            if same:
                arrived.append(r)
                continue
            missing.append(r)
            if answer["active"]:
                where = "; ".join(f"in {n} (call #{c} over ranks {g}) for {s:.1f} s"
                                  + (f" [thread {t}]" if t != "MainThread" else "")
                                  for n, g, c, s, t in answer["active"])
            else:
                last = answer["last"]
                where = "in no mpicomm collective" + (
                    f" (last: {last[0]} #{last[1]}, finished {last[2]:.1f} s ago)"
                    if last else " (none called yet)")
            lines.append(f"  not arrived: rank {r}: {where}")
        head = (f"[mpicomm rank {self.rank}] stall: waiting {waited:.1f} s in {call.name} "
                f"(call #{call.count} over ranks {list(call.group)})"
                + (f" [thread {call.thread}]" if call.thread != "MainThread" else ""))
        if not missing:
            lines.append("  every rank is in this call: it is slow, not stalled")
        lines.append(f"  arrived: ranks {sorted(arrived)}")
        message = "\n".join([head + ".", *lines])
        self.reports.append(StallReport(self.rank, call.name, call.group, call.count,
                                        waited, answers, missing, message))
        log.warning("%s", message)
        hooks.instant("stall", cat="stall", call=call.name, missing=missing)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop the thread and free the communicator (local; no communication)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if hooks.watch() is self:
                hooks.set_watch(None)
        if not MPI.Is_finalized():
            self._mpi.Free()

    def __enter__(self) -> StallInspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_env_inspector: StallInspector | None = None


def start_from_env(check: bool = False) -> StallInspector | None:
    """Start the process's inspector from ``MPICOMM_STALL_S`` (or checked mode).

    Called by :func:`mpicomm.init` (collective there; idempotent). ``MPICOMM_STALL_S``:
    seconds (``0`` = off); unset: :data:`CHECKED_DEFAULT_S` when ``check`` is true, else
    off. ``ValueError`` for a value that is not a number >= 0.
    """
    global _env_inspector
    if _env_inspector is not None:
        return _env_inspector
    raw = os.environ.get("MPICOMM_STALL_S", "").strip()
    if raw:
        try:
            threshold = float(raw)
        except ValueError:
            raise ValueError(f"MPICOMM_STALL_S={raw!r}: expected seconds (0 = off)") from None
        if not threshold >= 0:
            raise ValueError(f"MPICOMM_STALL_S={raw!r}: expected seconds (0 = off)")
    else:
        threshold = CHECKED_DEFAULT_S if check else 0.0
    if threshold == 0 or hooks.watch() is not None:
        return None
    _env_inspector = StallInspector(threshold)
    atexit.register(_env_inspector.close)
    if not _env_inspector.enabled:
        return None
    log.info("stall inspector on: threshold %.3g s", threshold)
    return _env_inspector
