"""A small, thread-safe recorder of Chrome-trace events (``chrome://tracing``, Perfetto).

Every event is a dict in the Trace Event Format: ``name``, ``cat``, ``ph`` (``"X"`` for a
span with a duration, ``"i"`` for an instant), ``ts`` and ``dur`` in microseconds since
the timeline was created, ``pid`` = the rank, ``tid`` = the name of the thread that
recorded it, and ``args`` (any small JSON-able values). Open a saved file in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``::

    tl = Timeline()                       # pid = this process's MPI rank
    with tl.span("allreduce", cat="comm", bytes=n):
        ...
    tl.instant("bucket 3 ready", cat="bucket")
    tl.save("trace-{rank}.json")          # one file per rank
    merged = tl.gather(comm)              # or every rank's events, on rank 0 only

Costs: a recorded event is one ``perf_counter_ns`` pair, a dict and an append under a
lock (about a microsecond). A disabled timeline (``Timeline(enabled=False)``) returns a
shared no-op context from :meth:`span` and returns at once from :meth:`instant`, so
instrumented code can keep its ``with tl.span(...)`` lines in production.

Clocks: ``ts`` is measured with the monotonic ``perf_counter`` from this timeline's
creation; the wall-clock time of that origin is kept too, and :meth:`gather` shifts every
rank's events by the difference of origins so that merged traces line up (to the accuracy
of the hosts' clock synchronization; on one host, exactly enough to read overlap).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..comm import resolve

__all__ = ["Timeline"]

_NULL = contextlib.nullcontext()


def _world_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except Exception:  # pragma: no cover - no MPI available: a single process
        return 0


class Timeline:
    """Record spans and instants from any thread; save or gather them as a Chrome trace.

    Parameters
    ----------
    enabled:
        ``False`` makes every method a no-op (nothing is recorded).
    rank:
        The ``pid`` of the events (default: this process's rank in ``MPI.COMM_WORLD``).
    """

    def __init__(self, enabled: bool = True, rank: int | None = None):
        self.enabled = bool(enabled)
        self.rank = _world_rank() if rank is None else int(rank)
        self._origin_ns = time.perf_counter_ns()
        self._origin_wall_us = time.time_ns() / 1e3
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"Timeline({state}, rank={self.rank}, events={len(self._events)})"

    # ------------------------------------------------------------------ recording
    def now(self) -> float:
        """Microseconds since this timeline was created (the ``ts`` of a new event)."""
        return (time.perf_counter_ns() - self._origin_ns) / 1e3

    def _add(self, event: dict[str, Any], tid: str | None = None) -> None:
        event["pid"] = self.rank
        event["tid"] = threading.current_thread().name if tid is None else tid
        with self._lock:
            self._events.append(event)

    def span(self, name: str, cat: str = "", *, tid: str | None = None,
             **args: Any) -> contextlib.AbstractContextManager:
        """A context manager recording a complete event (``ph: "X"``) around its body.

        The event is recorded when the body ends, also when it raises. ``tid`` names the
        row (default: the calling thread's name), e.g. one row per Crossover job.
        """
        if not self.enabled:
            return _NULL
        return self._span(name, cat, args, tid)

    @contextlib.contextmanager
    def _span(self, name: str, cat: str, args: dict[str, Any],
              tid: str | None = None) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            end = self.now()
            self._add({"name": name, "cat": cat, "ph": "X", "ts": start, "dur": end - start,
                       "args": args}, tid)

    def instant(self, name: str, cat: str = "", *, tid: str | None = None,
                **args: Any) -> None:
        """Record a point in time (``ph: "i"``, thread scope; ``tid`` as in :meth:`span`)."""
        if not self.enabled:
            return
        self._add({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self.now(),
                   "args": args}, tid)

    def complete(self, name: str, start_us: float, end_us: float, cat: str = "", *,
                 tid: str | None = None, **args: Any) -> None:
        """Record a span measured elsewhere (``start_us``/``end_us`` from :meth:`now`)."""
        if not self.enabled:
            return
        self._add({"name": name, "cat": cat, "ph": "X", "ts": start_us,
                   "dur": end_us - start_us, "args": args}, tid)

    # ------------------------------------------------------------------ reading
    def events(self) -> list[dict[str, Any]]:
        """A copy of the events recorded so far on this rank, in recording order."""
        with self._lock:
            return [dict(e) for e in self._events]

    def clear(self) -> None:
        """Forget the events recorded so far (the time origin stays)."""
        with self._lock:
            self._events.clear()

    def gather(self, comm: Any = None, root: int = 0) -> list[dict[str, Any]] | None:
        """Every rank's events, merged and sorted by time, on ``root``; ``None`` elsewhere.

        Collective over ``comm`` (an :class:`mpicomm.Communicator`, default the world).
        Timestamps are shifted onto ``root``'s time origin using each rank's wall clock.
        """
        comm = resolve(comm)
        mine = (self._origin_wall_us, self.events())
        everyone = comm.ctl.gather(mine, root=root)
        if comm.rank != root:
            return None
        base = everyone[root][0]
        merged: list[dict[str, Any]] = []
        for origin, events in everyone:
            for e in events:
                e["ts"] = e["ts"] + (origin - base)
                merged.append(e)
        merged.sort(key=lambda e: e["ts"])
        return merged

    def save(self, path: str | Path, events: list[dict[str, Any]] | None = None) -> Path:
        """Write a Chrome-trace JSON file and return its path.

        ``{rank}`` in ``path`` is replaced by this rank (one file per rank). ``events``
        defaults to this rank's own; pass the result of :meth:`gather` on rank 0 to write
        the merged trace. Process-name metadata is added for every ``pid`` present.
        """
        path = Path(str(path).format(rank=self.rank))
        events = self.events() if events is None else events
        pids = sorted({e["pid"] for e in events} | {self.rank})
        meta = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": f"rank {p}"}}
                for p in pids]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
        return path
