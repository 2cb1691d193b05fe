"""The timeline of everything: one decorator on mpicomm's front-end functions.

Every collective (``allreduce``, ``allgather``, ``allgatherv``, ``broadcast``,
``reduce_scatter``), sparse collective (``gtopk``, ``topk_allgather``, ``artopk``,
``exact_topk``), strategy aggregation, host staging copy and controller decision is
wrapped by :func:`traced`. While a recording is active the wrapper records one span per
call into a :class:`~mpicomm.timeline.Timeline` with:

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

    with mpicomm.trace.recording("trace.json", comm):
        train()
    # rank 0 wrote trace.json: every rank's events (pid = rank, one row per thread)

Other subsystems join with one line: ``@traced("selector.decide", cat="control",
outcome=lambda d: {"collective": d.collective})`` on a front-end function or method (the
span gets ``describe``/``outcome`` args, traffic when it has a ``comm`` argument or a
``self.comm``), or ``with trace.block("name", "cat", comm, **args):`` around a block;
``trace.instant(...)`` marks a point. All are a ``None`` check when nothing records.

The merged file is a Chrome trace: open it in Perfetto (ui.perfetto.dev) or
``chrome://tracing``, or render it with ``python -m mpicomm plot trace.json``.

Cost: with no recording (and no stall inspector) a traced call costs one extra Python
call and a check of two module globals for ``None`` (~0.1 µs, invisible next to a
collective's >= 10 µs; measured within noise on a 16-element 1-rank allreduce).
Recording roughly doubles a small collective's Python overhead (argument binding, one
cost-model evaluation, the event: tens of µs per traced call); large collectives do not
notice.

Deviation from the project's "no module-level mutable state" rule: the active recording
and stall inspector are module globals, because an environment variable must reach
every collective without a parameter; they are set only by :func:`recording`,
:func:`start_from_env` and :mod:`mpicomm.stall`, and restored on exit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .timeline import Timeline

__all__ = ["traced", "block", "recording", "active", "start_from_env", "chrome_trace",
           "span", "instant", "describe_dense", "describe_sparse", "describe_strategy"]

#: The recording in progress, or ``None`` (see the module docstring's deviation note).
_timeline: Timeline | None = None
#: The stall inspector of :mod:`mpicomm.stall`, or ``None``: ``enter``/``leave`` per call.
_watch: Any = None
_local = threading.local()
_env_started = False


def active() -> Timeline | None:
    """The timeline being recorded into, or ``None``."""
    return _timeline


def set_watch(watch: Any) -> Any:
    """Install the stall inspector (``None`` removes it); returns the previous one."""
    global _watch
    previous, _watch = _watch, watch
    return previous


# ---------------------------------------------------------------------- the decorator
Describe = Callable[[inspect.BoundArguments, Any], dict[str, Any]]


def traced(name: str, cat: str = "collective", describe: Describe | None = None,
           outcome: Callable[[Any], dict[str, Any]] | None = None
           ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a front-end function so that calls are recorded while a recording is active.

    ``describe(bound_arguments, comm)`` returns the span's extra ``args`` before the
    call, ``outcome(result)`` those known after it (both run only when recording). The
    communicator is the call's ``comm`` argument (``None``: the world) or, for methods,
    ``self.comm``; functions with neither get no traffic counts and no stall tracking.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        has_comm = "comm" in sig.parameters

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _timeline is None and _watch is None:
                return fn(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # let the function raise its own error
            comm = _comm_of(bound, has_comm)
            info = _describe(describe, bound, comm) if _timeline is not None else {}
            with block(name, cat, comm, **info) as args_out:
                result = fn(*args, **kwargs)
                if outcome is not None and args_out is not None:
                    args_out.update(outcome(result))
                return result

        wrapper.__traced__ = name  # type: ignore[attr-defined]
        return wrapper

    return wrap


def _comm_of(bound: inspect.BoundArguments, has_comm: bool) -> Any:
    from .comm import Communicator, resolve

    if not has_comm:
        comm = getattr(bound.arguments.get("self"), "comm", None)
        return comm if isinstance(comm, Communicator) else None
    comm = bound.arguments.get("comm")
    try:
        return resolve(comm)
    except TypeError:  # a bad argument: the function itself will say so
        return None


def _describe(describe: Describe | None, bound: inspect.BoundArguments, comm: Any
              ) -> dict[str, Any]:
    if describe is None:
        return {}
    try:
        return describe(bound, comm)
    except (TypeError, ValueError, AttributeError, KeyError):
        return {}  # bad arguments: the call raises them, with its own clear message


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None


def block(name: str, cat: str = "", comm: Any = None, **info: Any
          ) -> contextlib.AbstractContextManager:
    """Trace a block like a traced call (span with traffic, ``self_us``, stall tracking);
    yields the span's args dict (add to it inside), or ``None`` when nothing records.
    Costs a ``None`` check when no recording and no stall inspector are active."""
    if _timeline is None and _watch is None:
        return _nothing()
    return _block(_timeline, _watch, name, cat, comm, info)


@contextlib.contextmanager
def _block(tl: Timeline | None, watch: Any, name: str, cat: str, comm: Any,
           info: dict[str, Any]) -> Iterator[dict[str, Any] | None]:
    token = watch.enter(name, comm) if watch is not None and comm is not None else None
    try:
        if tl is None:
            yield None
        else:
            yield from _span(tl, name, cat, comm, info)
    finally:
        if token is not None:
            watch.leave(token)


def _span(tl: Timeline, name: str, cat: str, comm: Any, info: dict[str, Any]
          ) -> Iterator[dict[str, Any]]:
    """Record the span of the body of :func:`_block` (traffic, nesting, self time)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    frame = [0.0]  # time of nested traced calls, in µs
    stack.append(frame)
    counting = comm.traffic.measure() if comm is not None else contextlib.nullcontext()
    start = tl.now()
    ok = False
    try:
        with counting as moved:
            yield info
        ok = True
    finally:
        end = tl.now()
        stack.pop()
        if stack:
            stack[-1][0] += end - start
        if moved is not None:
            info.update(ranks=comm.size, sent=moved.sent_bytes, recv=moved.recv_bytes)
        info["self_us"] = round(end - start - frame[0], 3)
        if not ok:
            info["error"] = True
        tl.complete(name, start, end, cat=cat, **info)


# ---------------------------------------------------------------------- describers
def describe_dense(collective: str) -> Describe:
    """Span args of a dense collective: bytes, the algorithm ``auto`` resolves to and the
    cost model's prediction (``predicted_s``)."""

    def describe(bound: inspect.BoundArguments, comm: Any) -> dict[str, Any]:
        from .buffers import inspect as inspect_buffer
        from .collectives import cost

        nbytes = inspect_buffer(bound.arguments["buf"]).nbytes
        algorithm = bound.arguments.get(
            "algorithm", bound.signature.parameters["algorithm"].default)
        p = comm.size if comm is not None else 1
        params = comm.resources.get("cost_params") if comm is not None else None
        model_bytes = nbytes * p if collective in ("allgather", "allgatherv") else nbytes
        out: dict[str, Any] = {"bytes": nbytes, "algorithm": algorithm}
        if algorithm == "auto":
            algorithm = out["algorithm"] = cost.choose(collective, model_bytes, p, params)
            out["chosen_by"] = "cost model"
        if p > 1:
            out["predicted_s"] = cost.predict(collective, algorithm, model_bytes, p, params)
        return out

    return describe


def describe_sparse(collective: str) -> Describe:
    """Span args of a sparse collective: ``k``, value bytes and, for ``gtopk`` and
    ``topk_allgather``, the cost model's prediction."""

    def describe(bound: inspect.BoundArguments, comm: Any) -> dict[str, Any]:
        from .buffers import inspect as inspect_buffer
        from .collectives import cost

        a = bound.arguments
        first = a.get("values", a.get("x"))
        info = inspect_buffer(first)
        out: dict[str, Any] = {"bytes": info.nbytes}
        k = a.get("k")
        if k is None and "indices" in a:
            k = inspect_buffer(a["indices"]).numel
        out["k"] = k
        p = comm.size if comm is not None else 1
        params = comm.resources.get("cost_params") if comm is not None else None
        formula = {"gtopk": cost.gtopk, "topk_allgather": cost.topk_allgather}.get(collective)
        if formula is not None and k and p > 1 and "indices" in a:
            s = inspect_buffer(a["indices"]).nbytes // max(1, inspect_buffer(
                a["indices"]).numel) + info.nbytes // max(1, info.numel)
            out["predicted_s"] = formula(k, s, p, params or cost.CostParams())
        return out

    return describe


def describe_strategy(strategy: Any, tensors: Any) -> dict[str, Any]:
    """Span args of a strategy's aggregation: its scalar settings and the tensor count."""
    return {**{k: v for k, v in strategy.describe().items()
               if isinstance(v, (int, float, str))}, "tensors": len(tensors)}


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
    global _timeline
    from .comm import resolve

    comm = resolve(comm)
    if _timeline is not None:
        raise RuntimeError("a timeline recording is already active in this process")
    tl = timeline if timeline is not None else Timeline()
    _timeline = tl
    try:
        yield tl
    except BaseException:
        _timeline = None
        if path is not None:
            _write(f"{path}.rank{tl.rank}.json", tl.events())
        raise
    _timeline = None
    merged = tl.gather(comm)
    if path is not None and merged is not None:
        _write(path, merged)


def start_from_env(comm: Any = None) -> Timeline | None:
    """Start recording for the whole run when ``MPICOMM_TIMELINE`` names a file.

    Called by :func:`mpicomm.init` (idempotent). At interpreter exit the ranks gather
    their events on rank 0, which writes the merged trace there; every rank must reach
    a normal exit (an error on one rank aborts the job, and no trace is written).
    """
    global _timeline, _env_started
    path = os.environ.get("MPICOMM_TIMELINE")
    if not path or _env_started:
        return None
    from .comm import resolve

    comm = resolve(comm)
    _env_started = True
    if _timeline is not None:
        return None
    tl = _timeline = Timeline()

    def finish() -> None:
        global _timeline
        from mpi4py import MPI

        if MPI.Is_finalized() or _timeline is not tl:
            return
        _timeline = None
        merged = tl.gather(comm)
        if merged is not None:
            _write(path, merged)

    atexit.register(finish)
    return tl


def span(name: str, cat: str = "", **args: Any) -> contextlib.AbstractContextManager:
    """A span in the active recording around a block (a no-op without one)."""
    tl = _timeline
    if tl is None:
        return contextlib.nullcontext()
    return tl.span(name, cat, **args)


def instant(name: str, cat: str = "", **args: Any) -> None:
    """An instant event in the active recording (nothing without one)."""
    tl = _timeline
    if tl is not None:
        tl.instant(name, cat, **args)
