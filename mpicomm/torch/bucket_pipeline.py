"""The buckets of one synchronized backward: launched as their gradients complete,
aggregated strictly in index order on a communication thread.

``BucketPipeline`` is the machinery under ``GradientSync``. Autograd's hooks report each
parameter whose gradient is accumulated (``grad_ready``); when the last one of a bucket
arrives, the bucket is *launched*: a CUDA event is recorded per device and the bucket is
handed to the thread, which averages the buckets in index order (``aggregate_bucket``),
so every rank issues the same collectives in the same order whatever order its
gradients arrived in. ``finish`` ends a step: it launches the buckets still incomplete
(parameters without a gradient on this rank count as zeros), waits for the thread, and
returns the step's outcome. Without ``MPI_THREAD_MULTIPLE`` there is no thread and
``finish`` aggregates every bucket on the calling thread, in the same order.

Cost on the autograd thread: a lock and a counter per parameter, plus an event record
per CUDA device and bucket; all communication runs on the thread.

Virtual clock (``mpicomm.clock``): each bucket is handed to the thread with the time
its gradients are ready and the thread continues from the later of that and its own
time; ``finish`` returns at the later of the end of backward and the last bucket's
averaging. When the cost table has a ``backward`` entry (the model's backward, per
step), backward is charged here: starting when the step's first gradient arrives, a
bucket is ready after the share of that cost of the parameters launched so far (backward
produces gradients in bucket order). Without it, buckets are ready at the time of the
thread that launches them (whatever the training loop charged).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .. import clock
from ..comm import Communicator
from ..observe.timeline import Timeline
from ..strategies import Strategy
from . import comm_thread
from .buckets import Bucket, aggregate_bucket

__all__ = ["BucketPipeline", "Step", "THREAD_NAME"]

#: Name of the communication thread (it shows in timelines and thread listings).
THREAD_NAME = "mpicomm-gradsync"


class Step:
    """The communication state of one synchronized backward pass."""

    def __init__(self, nbuckets: int):
        self.launched = [False] * nbuckets
        self.events: list[list[Any]] = [[] for _ in range(nbuckets)]
        #: Virtual clock: when each bucket was handed over, when backward started, how
        #: many parameters the hooks have launched, when the last bucket was averaged.
        self.stamps = [0.0] * nbuckets
        self.start = clock.stamp()
        self.hooked = 0
        self.done = 0.0
        self.finished = False
        #: An exception raised while communicating (re-raised by the caller of ``finish``).
        self.error: BaseException | None = None
        #: Why the step must not be applied: a bucket held a NaN or an Inf on some rank.
        self.nonfinite: str | None = None


class BucketPipeline:
    """Launch ``buckets`` as their gradients complete; aggregate them in order.

    ``strategy`` averages each bucket over ``comm`` (a communicator of its own: the
    thread's collectives must not interleave with the caller's). ``stats`` is an object
    with ``buckets`` and ``comm_seconds`` counters, incremented per aggregated bucket.
    With ``threaded`` a daemon thread named ``THREAD_NAME`` communicates; otherwise
    ``finish`` does, on the calling thread.
    """

    def __init__(self, buckets: Sequence[Bucket], strategy: Strategy, comm: Communicator,
                 timeline: Timeline, stats: Any, *, threaded: bool):
        self.buckets = list(buckets)
        self.strategy = strategy
        self.comm = comm
        self.timeline = timeline
        self.stats = stats
        #: Every parameter of the buckets, in bucket order (a slot per parameter).
        self.slots = [p for b in self.buckets for p in b.params]
        self._bucket_of = [b.index for b in self.buckets for _ in b.params]
        self._cond = threading.Condition()
        self._ready = [False] * len(self.slots)
        self._remaining = [len(b.params) for b in self.buckets]
        #: The step under way (a gradient arrived since the last ``finish``), or ``None``.
        self.step: Step | None = None
        self._stopping = False
        self._handoff = clock.Handoff()
        self._numel = [sum(p.numel() for p in b.params) for b in self.buckets]
        self._thread_error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if threaded:
            self.thread = clock.start_thread(self._run, name=THREAD_NAME)

    # ------------------------------------------------------------------ autograd side
    def counted(self, slot: int) -> bool:
        """Whether parameter ``slot``'s gradient was already counted in the step under
        way (then a new backward has started before ``finish``)."""
        return self._ready[slot]

    def grad_ready(self, slot: int) -> None:
        """Count parameter ``slot``'s gradient; launch its bucket when it is complete."""
        with self._cond:
            if self._ready[slot]:  # pragma: no cover - GradientSync waits before this
                raise RuntimeError("a gradient was accumulated twice in one step")
            step = self.step
            if step is None:
                step = self.step = Step(len(self.buckets))
                self._cond.notify_all()
            self._ready[slot] = True
            b = self._bucket_of[slot]
            self._remaining[b] -= 1
            complete = self._remaining[b] == 0
        if complete:
            self.timeline.instant(f"bucket {b} ready", cat="bucket", bucket=b, at="hook")
            step.hooked += self._numel[b]
            self._launch(step, b, self._ready_at(step, step.hooked))

    def finish(self) -> Step | None:
        """End the step under way: launch what is left, wait until every bucket is done.

        Returns the step (see ``Step.error`` and ``Step.nonfinite``), or ``None`` when no
        gradient arrived since the last call. ``RuntimeError`` if the thread has died.
        """
        with self._cond:
            step = self.step
        if step is None:
            return None
        clock.join(self._ready_at(step, sum(self._numel)))   # backward has ended
        for b in range(len(self.buckets)):
            if not step.launched[b]:
                self.timeline.instant(f"bucket {b} ready", cat="bucket", bucket=b, at="wait")
                self._launch(step, b, clock.stamp())
        if self.thread is None:  # no MPI_THREAD_MULTIPLE: communicate here, in order
            for b in range(len(self.buckets)):
                clock.join(step.stamps[b])
                self._process(step, b)
            step.finished = True
        with self._cond, clock.waiting_for_threads():
            while not step.finished:
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError("the gradient communication thread has stopped")
                self._cond.wait(1.0)
            self.step = None
            self._ready = [False] * len(self.slots)
            self._remaining = [len(b.params) for b in self.buckets]
        clock.join(step.done)
        return step

    def stop(self, timeout: float | None) -> bool:
        """Tell the thread to stop and join it for up to ``timeout`` seconds (``None``:
        for as long as it takes). Returns whether no thread is left running."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.thread is None:
            return True
        self.thread.join(timeout=timeout)
        return not self.thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _ready_at(self, step: Step, numel: int) -> float:
        """Virtual time at which backward has produced the gradients of the first
        ``numel`` parameters (see the module docstring)."""
        table = clock.cost_table()
        if table is None or "backward" not in table.ops:
            return clock.stamp()
        total = sum(self._numel) or 1
        return step.start + table.cost("backward") * min(numel, total) / total

    def _launch(self, step: Step, b: int, at: float) -> None:
        events = comm_thread.record_events(self.buckets[b].cuda_devices)
        with self._cond:
            step.events[b] = events
            step.stamps[b] = self._handoff.give(at)
            step.launched[b] = True
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            comm_thread.bind_thread_device(self.buckets)
        except BaseException as exc:  # reported by the first finish(), like any thread error
            self._thread_error = exc
        while True:
            with self._cond, self._handoff.idle():
                while not self._stopping and (self.step is None or self.step.finished):
                    self._cond.wait()
                if self._stopping:
                    return
                step = self.step
            for b in range(len(self.buckets)):
                with self._cond, self._handoff.idle():
                    while not step.launched[b] and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                self._handoff.take(step.stamps[b])
                self._process(step, b)
            with self._cond:
                step.done = clock.stamp()
                step.finished = True
                self._cond.notify_all()

    def _process(self, step: Step, b: int) -> None:
        bucket = self.buckets[b]
        if self._thread_error is not None and step.error is None:
            step.error = self._thread_error
        # Once a bucket was non-finite every rank knows it (the flag was reduced), so all
        # of them skip the rest identically. After a local error, skipping lets finish()
        # return it promptly; the other ranks then end with the abort handler.
        if step.error is not None or step.nonfinite is not None:
            return
        start = clock.now()
        try:
            for ev in step.events[b]:
                ev.synchronize()
            with self.timeline.span(f"aggregate bucket {b}", cat="comm", bucket=b,
                                    params=len(bucket.params), bytes=bucket.nbytes):
                step.nonfinite = aggregate_bucket(bucket, self.strategy, self.comm)
        except BaseException as exc:  # re-raised on the caller's thread
            step.error = exc
            return
        self.stats.buckets += 1
        self.stats.comm_seconds += clock.now() - start
