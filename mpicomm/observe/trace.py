"""The timeline of everything: record every traced call of a run as one Chrome trace.

Every collective (``allreduce``, ``allgather``, ``allgatherv``, ``broadcast``,
``reduce_scatter``), sparse collective (``gtopk``, ``topk_allgather``, ``artopk``,
``exact_topk``), strategy aggregation, host staging copy and controller decision is
marked with :func:`mpicomm.hooks.traced`. While a recording is active (this module
registers a :class:`~mpicomm.observe.timeline.Timeline` as the recorder of
:mod:`mpicomm.hooks`) every call becomes one span with:

* ``algorithm`` (the one ``"auto"`` resolved to) and ``predicted_s`` (the alpha-beta
  model's time in :mod:`mpicomm.collectives.cost`, with the communicator's
  ``cost_params``) for dense collectives; ``k`` and the model's time for gTop-k and the
  sparse allgather;
* ``bytes`` (the input buffer), ``sent``/``recv`` (bytes this rank moved, from the
  communicator's traffic counters), ``ranks``;
* ``self_us``: the span's time not spent in nested traced calls. For a strategy's
  ``aggregate`` span that is compression, selection, error feedback and copies; for a
  collective it is its local reductions and copies.

GradientSync created while a recording is active records its ``bucket ready`` instants,
``aggregate bucket`` spans and ``wait`` spans into the same timeline. Spans nest: a
strategy's span encloses its collectives, on the thread that ran them.

Start a recording with the ``MPICOMM_TIMELINE=path`` environment variable (picked up by
:func:`mpicomm.init`; the merged trace is written at exit) or the collective context
manager :func:`recording`::

    from mpicomm.observe import trace
    with trace.recording("trace.json", comm):
        train()
    # rank 0 wrote trace.json: every rank's events (pid = rank, one row per thread)

The merged file is a Chrome trace: open it in Perfetto (ui.perfetto.dev) or
``chrome://tracing``, or render it with ``python -m mpicomm plot trace.json``.

Cost: see :mod:`mpicomm.hooks` (a ``None`` check per traced call when nothing records;
tens of µs per small collective while recording).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import hooks
from ..comm import resolve
from .timeline import Timeline

__all__ = ["recording", "active", "start_from_env", "chrome_trace"]

_env_started = False


def active() -> Timeline | None:
    """The timeline being recorded into (the registered recorder), or ``None``."""
    rec = hooks.recorder()
    return rec if isinstance(rec, Timeline) else None


# ---------------------------------------------------------------------- recording
def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A Chrome-trace document of ``events``: thread names become integer ``tid`` values
    with ``thread_name`` metadata, every ``pid`` gets a ``rank N`` process name."""
    tids: dict[tuple[Any, Any], int] = {}
    out = []
    for e in events:
        e = dict(e)
        key = (e["pid"], e["tid"])
        if key not in tids:
            tids[key] = len([k for k in tids if k[0] == e["pid"]]) + 1
        e["tid"] = tids[key]
        out.append(e)
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": p, "tid": 0, "args": {"name": f"rank {p}"}}
        for p in sorted({k[0] for k in tids})]
    meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
              "args": {"name": str(name)}} for (pid, name), tid in tids.items()]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def _write(path: str | Path, events: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


@contextlib.contextmanager
def recording(path: str | os.PathLike | None = None, comm: Any = None, *,
              timeline: Timeline | None = None) -> Iterator[Timeline]:
    """Record every traced call in the body; on a normal exit merge onto rank 0.

    Collective over ``comm`` (default: the world) on exit: every rank's events are
    gathered on rank 0, shifted onto its clock, and written to ``path`` (if given) as
    one Chrome trace. Yields this rank's :class:`Timeline` (add your own spans with
    ``tl.span(...)``). After an exception nothing is gathered (other ranks may not get
    here); with a ``path`` this rank's own events go to ``path.rank<r>.json``.
    Recordings do not nest: an inner one raises ``RuntimeError``.
    """
    comm = resolve(comm)
    if hooks.recorder() is not None:
        raise RuntimeError("a timeline recording is already active in this process")
    tl = timeline if timeline is not None else Timeline()
    hooks.set_recorder(tl)
    try:
        yield tl
    except BaseException:
        hooks.set_recorder(None)
        if path is not None:
            _write(f"{path}.rank{tl.rank}.json", tl.events())
        raise
    hooks.set_recorder(None)
    merged = tl.gather(comm)
    if path is not None and merged is not None:
        _write(path, merged)


def start_from_env(comm: Any = None) -> Timeline | None:
    """Start recording for the whole run when ``MPICOMM_TIMELINE`` names a file.

    Called by :func:`mpicomm.init` (idempotent). At interpreter exit the ranks gather
    their events on rank 0, which writes the merged trace there; every rank must reach
    a normal exit (an error on one rank aborts the job, and no trace is written). Rank 0
    says on stderr where the trace went.
    """
    global _env_started
    path = os.environ.get("MPICOMM_TIMELINE")
    if not path or _env_started:
        return None
    comm = resolve(comm)
    _env_started = True
    if hooks.recorder() is not None:
        return None
    tl = Timeline()
    hooks.set_recorder(tl)

    def finish() -> None:
        from mpi4py import MPI

        if MPI.Is_finalized() or hooks.recorder() is not tl:
            return
        hooks.set_recorder(None)
        merged = tl.gather(comm)
        if merged is not None:
            print(f"mpicomm: trace written to {_write(path, merged)} (MPICOMM_TIMELINE)",
                  file=sys.stderr, flush=True)

    atexit.register(finish)
    return tl
