"""The instrumentation registry: how every layer reports what it does to whoever listens.

The core and the layers above it mark their front-end functions and blocks; observers
(the timeline recorder and the stall inspector of :mod:`mpicomm.observe`, or your own)
register here. The instrumented code never imports an observer::

    @hooks.traced("allreduce", cat="collective", describe=describe_dense("allreduce"))
    def allreduce(buf, op="sum", *, comm=None, ...): ...

    with hooks.block("ddp bucket 3", "bucket", comm, bucket=3) as args:
        ...                          # args: the span's dict (add to it), or None
    hooks.instant("bucket 3 ready", "bucket")
    with hooks.span("decide", "control"): ...

Two kinds of observer, one slot each (:func:`set_recorder`, :func:`set_watch`; passing
``None`` unregisters, the previous one is returned so that it can be restored):

* a **recorder** (:class:`Recorder`, e.g. :class:`mpicomm.observe.timeline.Timeline`)
  gets one complete span per traced call with its ``args``: what ``describe(bound
  arguments, comm)`` says before the call, what ``outcome(result)`` says after it, the
  bytes this rank moved (``sent``/``recv``, from the communicator's traffic counters),
  ``ranks``, and ``self_us``: the span's time not spent in nested traced calls (a
  strategy's span encloses its collectives on the thread that ran them);
* a **watch** (:class:`Watch`, e.g. the stall inspector) is told when a traced call with
  a communicator starts (``enter(name, comm) -> token``) and ends (``leave(token)``).

The communicator of a traced call is its ``comm`` argument (``None``: the world) or, for
methods, ``self.comm``; functions with neither get no traffic counts and no watch.

Cost: with nothing registered a traced call costs one extra Python call and two
``None`` checks of module globals (~0.1 µs, invisible next to a collective's >= 10 µs);
:func:`block`, :func:`span` and :func:`instant` cost the checks. With a recorder, a
small collective pays tens of µs (argument binding, the describer, the event); large
ones do not notice.

Module-level state: the two slots are process globals on purpose, because an
environment variable (``MPICOMM_TIMELINE``, ``MPICOMM_STALL_S``) must reach every call
without a parameter; only observers set them, and they restore the previous value.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .comm import Communicator, resolve

__all__ = ["Recorder", "Watch", "Describe", "traced", "block", "span", "instant",
           "recorder", "watch", "set_recorder", "set_watch", "recording"]


class Recorder(Protocol):
    """What a recorder offers: a clock in µs and complete spans, spans around a block,
    instants (the methods of :class:`mpicomm.observe.timeline.Timeline`)."""

    def now(self) -> float: ...

    def complete(self, name: str, start_us: float, end_us: float, cat: str = "",
                 **args: Any) -> None: ...

    def span(self, name: str, cat: str = "", **args: Any
             ) -> contextlib.AbstractContextManager: ...

    def instant(self, name: str, cat: str = "", **args: Any) -> None: ...


class Watch(Protocol):
    """What a watch offers: told when a traced call over a communicator starts and ends."""

    def enter(self, name: str, comm: Communicator) -> Any: ...

    def leave(self, token: Any) -> None: ...


#: The registered recorder and watch, or ``None`` (see the module docstring).
_recorder: Recorder | None = None
_watch: Watch | None = None
_local = threading.local()

#: ``describe(bound_arguments, comm) -> span args`` of a traced function.
Describe = Callable[[inspect.BoundArguments, Any], dict[str, Any]]


def recorder() -> Recorder | None:
    """The registered recorder, or ``None``."""
    return _recorder


def watch() -> Watch | None:
    """The registered watch, or ``None``."""
    return _watch


def recording() -> bool:
    """Whether a recorder is registered (compute expensive span args only then)."""
    return _recorder is not None


def set_recorder(new: Recorder | None) -> Recorder | None:
    """Register ``new`` as the recorder (``None``: unregister); returns the previous one."""
    global _recorder
    previous, _recorder = _recorder, new
    return previous


def set_watch(new: Watch | None) -> Watch | None:
    """Register ``new`` as the watch (``None``: unregister); returns the previous one."""
    global _watch
    previous, _watch = _watch, new
    return previous


# ---------------------------------------------------------------------- the decorator
def traced(name: str, cat: str = "collective", describe: Describe | None = None,
           outcome: Callable[[Any], dict[str, Any]] | None = None
           ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a front-end function so that observers see its calls.

    ``describe(bound_arguments, comm)`` returns the span's extra ``args`` before the
    call, ``outcome(result)`` those known after it; both run only while a recorder is
    registered, and a describer that fails on bad arguments adds nothing (the call then
    raises its own clear error).
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        has_comm = "comm" in sig.parameters

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _recorder is None and _watch is None:
                return fn(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # let the function raise its own error
            comm = _comm_of(bound, has_comm)
            info = _describe(describe, bound, comm) if _recorder is not None else {}
            with block(name, cat, comm, **info) as args_out:
                result = fn(*args, **kwargs)
                if outcome is not None and args_out is not None:
                    args_out.update(outcome(result))
                return result

        wrapper.__traced__ = name  # type: ignore[attr-defined]
        return wrapper

    return wrap


def _comm_of(bound: inspect.BoundArguments, has_comm: bool) -> Communicator | None:
    if not has_comm:
        comm = getattr(bound.arguments.get("self"), "comm", None)
        return comm if isinstance(comm, Communicator) else None
    try:
        return resolve(bound.arguments.get("comm"))
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


def block(name: str, cat: str = "", comm: Communicator | None = None, **info: Any
          ) -> contextlib.AbstractContextManager:
    """Report a block like a traced call (span with traffic and ``self_us``, watched when
    ``comm`` is given); yields the span's args dict (add to it inside), or ``None`` when
    no recorder is registered. Two ``None`` checks when nothing is registered."""
    if _recorder is None and _watch is None:
        return _nothing()
    return _block(_recorder, _watch, name, cat, comm, info)


@contextlib.contextmanager
def _block(rec: Recorder | None, w: Watch | None, name: str, cat: str, comm: Any,
           info: dict[str, Any]) -> Iterator[dict[str, Any] | None]:
    token = w.enter(name, comm) if w is not None and comm is not None else None
    try:
        if rec is None:
            yield None
        else:
            yield from _span(rec, name, cat, comm, info)
    finally:
        if token is not None:
            w.leave(token)  # type: ignore[union-attr]


def _span(rec: Recorder, name: str, cat: str, comm: Any, info: dict[str, Any]
          ) -> Iterator[dict[str, Any]]:
    """Record the span of the body of :func:`_block` (traffic, nesting, self time)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    frame = [0.0]  # time of nested traced calls, in µs
    stack.append(frame)
    counting = comm.traffic.measure() if comm is not None else contextlib.nullcontext()
    start = rec.now()
    ok = False
    try:
        with counting as moved:
            yield info
        ok = True
    finally:
        end = rec.now()
        stack.pop()
        if stack:
            stack[-1][0] += end - start
        if moved is not None:
            info.update(ranks=comm.size, sent=moved.sent_bytes, recv=moved.recv_bytes)
        info["self_us"] = round(end - start - frame[0], 3)
        if not ok:
            info["error"] = True
        rec.complete(name, start, end, cat=cat, **info)


def span(name: str, cat: str = "", **args: Any) -> contextlib.AbstractContextManager:
    """A span of the registered recorder around a block (a no-op without one)."""
    rec = _recorder
    if rec is None:
        return contextlib.nullcontext()
    return rec.span(name, cat, **args)


def instant(name: str, cat: str = "", **args: Any) -> None:
    """An instant event of the registered recorder (nothing without one)."""
    rec = _recorder
    if rec is not None:
        rec.instant(name, cat, **args)
