r"""Crossover scheduling: several jobs time-share the same ranks, one job's communication
hidden behind another's compute.

What is the paper's and what is ours
------------------------------------
From the paper (Luo et al., "CrossoverScheduler", arXiv 2103.07974; built from the abstract's
description): several distributed training
applications time-share the same devices *alternately*, so that one application's
gradient synchronization is filled with another application's computation; no job's
mathematics changes (no loss of convergence or accuracy); about 1.2x throughput on
ImageNet classification, on a Horovod prototype.

Ours (the abstract gives no mechanism; this follows the inferred design of section E.4):

* jobs run as *threads of one process per rank* (not one process per job and device),
  so the token is a plain in-process object (:class:`~mpicomm.sched.token.Token`) and
  costs no message;
* the scheduling unit is one iteration, cut into a compute phase and a sync phase
  (:class:`~mpicomm.sched.job.Job`);
* one token per rank cycles over the jobs in a fixed order, the same on every rank; a
  job that finishes its compute phase hands the token on and starts its sync phase on
  its own synchronization thread and its own communicator (``comm.dup()``), and its
  next compute phase waits for that sync (synchronous-SGD semantics, bit-identical
  trajectories);
* the cycle is strict: when the job whose turn it is still synchronizes, the token
  waits for it instead of letting another job compute twice (keeps the order
  identical on every rank and the per-job progress balanced); a job that has done all
  its iterations leaves the cycle and the others go on;
* an error in any phase of any job ends the whole run, naming the job
  (:class:`CrossoverError`; with several ranks, ``MPI_Abort``, since the job's peers
  may be blocked in its collectives and cannot be released otherwise).

Cost and expected gain
----------------------
With ``n`` identical jobs of compute time ``C`` and sync time ``S`` per iteration,
running them one after the other takes ``n(C + S)`` per round of iterations. When the
compute resource and the network each serve one job at a time (section E.4's model), a
round takes at least ``n max(C, S)``, so the ideal speedup is

.. math::  \frac{C+S}{\max(C,S)} \le 2 .

When the syncs of different jobs do not compete with each other (latency-bound
communication, e.g. an injected delay), only the token is exclusive: a round takes
``max(nC, C + S)`` and the bound is ``n(C+S) / max(nC, C+S)``; both agree for ``S <= C``.

The scheduler's own overhead is a thread wake-up and a condition-variable wait per
phase (tens of microseconds). Real gains are lower wherever the sync phase *uses* the
resources the compute phase needs: with MPI shared-memory transports on a CPU-only
host, the copies of an allreduce compete with the other job's compute for the cores,
so only the part of ``S`` that is waiting (network latency, a slow link, stragglers)
can be hidden. Waiting itself costs a core too: MPI libraries spin in their blocking
calls (MPICH over shared memory and over TCP alike), so a job whose data are on the wire
would keep a core busy that the computing job needs. ``wait_poll_s`` (ours; default on
when the ranks span several nodes) makes the jobs' collectives test their requests and
sleep in between (:func:`mpicomm.comm.wait_all`); the waiting thread then holds neither a
core nor the GIL (``time.sleep`` and mpi4py's MPI calls release it), and the compute
phase runs at nearly its solo speed (the ``Cx_ms`` column of ``python -m mpicomm.bench
crossover``).

Tuning: pair jobs whose sync time is comparable to the compute time of the *others*
(``S <= (n-1)C``); beyond that the token idles. Keep compute phases free of
communication (it would serialize the jobs). ``stats.jobs[name].wait_seconds`` is the
synchronization that was *not* hidden; the timeline (one row per job, plus a ``token``
row with the waits) shows where.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import clock
from ..abort import abort_after_flush
from ..comm import Communicator, describe_mismatch, resolve
from ..config import env_flag
from ..observe.timeline import Timeline
from ..validate import check_poll_s
from .job import Job
from .token import Token

__all__ = ["CrossoverScheduler", "CrossoverError", "CrossoverStats", "JobStats"]

log = logging.getLogger("mpicomm.sched")

#: Seconds between checks for other jobs' failures while waiting for a sync.
_POLL_S = 0.05
#: Seconds to let synchronization threads end after a failure before giving up on them.
_STOP_GRACE_S = 1.0
#: The timeline row of the token (waits for a job's sync, i.e. communication not hidden).
TOKEN_ROW = "token"
#: ``wait_poll_s="auto"`` on a communicator that spans several nodes (hosts).
NETWORK_WAIT_POLL_S = 1e-3


def auto_wait_poll_s(comm: Communicator) -> float | None:
    """What ``wait_poll_s="auto"`` means on ``comm``: :data:`NETWORK_WAIT_POLL_S` when it
    spans more than one node (its waits are mostly wire time), else ``None`` (spin)."""
    return NETWORK_WAIT_POLL_S if comm.nodes > 1 else None


class CrossoverError(RuntimeError):
    """One job of a Crossover run failed; the message names the job, phase, step, rank."""

    def __init__(self, message: str, job: str = ""):
        super().__init__(message)
        #: The failed job's name.
        self.job = job

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with its job name
        return (type(self), (str(self), self.job))


@dataclass
class JobStats:
    """One job's measurements on this rank (seconds are wall-clock).

    ``compute_seconds``/``sync_seconds``: time in its compute (and finish) and sync
    phases; ``wait_seconds``: time the token waited for this job's sync, i.e. the
    synchronization that no other job's compute hid; ``finished_at``: seconds from the
    start of :meth:`CrossoverScheduler.run` to the end of its finish phase.
    """

    steps: int = 0
    compute_seconds: float = 0.0
    sync_seconds: float = 0.0
    wait_seconds: float = 0.0
    finished_at: float | None = None

    @property
    def hidden_fraction(self) -> float:
        """Share of the sync time that overlapped other work (1.0 = fully hidden)."""
        if self.sync_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.sync_seconds)


@dataclass
class CrossoverStats:
    """What :meth:`CrossoverScheduler.run` did on this rank."""

    seconds: float = 0.0
    jobs: dict[str, JobStats] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return sum(j.steps for j in self.jobs.values())


class _SyncThread:
    """A job's synchronization thread: runs ``job.sync(step)`` when started, one at a time."""

    def __init__(self, job: Job, stats: JobStats, timeline: Timeline, row: str,
                 gate_poll_s: float | None = None):
        self.job = job
        self._gate_poll_s = gate_poll_s
        self._stats = stats
        self._timeline = timeline
        self._row = row
        self._cond = threading.Condition()
        self._handoff = clock.Handoff()     # the virtual clock: phases carry their time
        self._given = 0.0
        self._done = 0.0
        self._pending: int | None = None
        self._busy = False
        self._stopping = False
        self.error: BaseException | None = None
        self.error_step = -1
        self._thread = clock.start_thread(self._run, name=f"crossover-sync-{job.name}")

    def start(self, step: int) -> None:
        with self._cond:
            assert not self._busy, "a sync phase is already running"
            self._given = self._handoff.give()
            self._pending, self._busy = step, True
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Whether the last sync phase has ended (waits up to ``timeout`` seconds); when
        it has, the caller's clock joins the phase's end (the virtual clock)."""
        with self._cond:
            if self._busy:
                with clock.waiting_for_threads():
                    self._cond.wait(timeout)
            if not self._busy:
                clock.join(self._done)
            return not self._busy

    def stop(self, timeout: float | None) -> bool:
        """Stop after the running sync (if any); ``True`` if the thread has ended."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _gate(self) -> None:
        """Meet the job's other ranks at a nonblocking barrier polled with short sleeps.

        MPI libraries busy-poll while a blocking call waits for a late peer; on cores
        shared with the next job's compute phase that polling slows the compute. After
        the gate every rank of the job is in its sync phase, so the job's collectives
        only move data."""
        comm = self.job.comm
        if self._gate_poll_s is None or comm is None or comm.size == 1:
            return
        comm.barrier(poll_s=self._gate_poll_s)

    def _run(self) -> None:
        while True:
            with self._cond, self._handoff.idle():
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._pending is None:
                    return
                step, self._pending = self._pending, None
            self._handoff.take(self._given)
            start = clock.now()
            try:
                with self._timeline.span("sync", cat="comm", tid=self._row, step=step):
                    self._gate()
                    self.job.sync(step)
            except BaseException as exc:  # reported by the scheduler's thread
                self.error, self.error_step = exc, step
            self._stats.sync_seconds += clock.now() - start
            with self._cond:
                self._done = clock.stamp()
                self._busy = False
                self._cond.notify_all()


class CrossoverScheduler:
    r"""Run ``n >= 2`` data-parallel jobs on the same ranks, alternating their phases.

    Construction is collective over ``comm``: every rank must pass the same jobs (names,
    kinds and step counts; checked with one small allgather, a mismatch or a bad
    argument raises ``ValueError``/``TypeError`` on every rank), and each job then gets
    its own duplicate of ``comm`` and runs its :meth:`~mpicomm.sched.Job.setup` on it,
    in job order (e.g. a :class:`~mpicomm.torch.TorchJob` broadcasts rank 0's weights).
    :meth:`run` executes the jobs to completion (see the module docstring for the
    schedule) and returns a :class:`CrossoverStats`; :meth:`close` (or a ``with`` block)
    releases the threads, the jobs and their communicators::

        a = TorchJob("resnet", model_a, opt_a, loader_a, F.cross_entropy, strategy="dense")
        b = TorchJob("mlp", model_b, opt_b, loader_b, F.cross_entropy, local_sgd=4)
        with CrossoverScheduler([a, b], comm=comm, timeline=True) as sched:
            stats = sched.run()
            events = sched.timeline.gather(comm)      # Chrome trace on rank 0

    Parameters
    ----------
    jobs:
        The :class:`~mpicomm.sched.Job` objects, at least two, unique names; the list
        order is the token's cycle. Jobs may differ in step count, step time and
        strategy; one that finishes early leaves the cycle.
    comm:
        The :class:`~mpicomm.Communicator` over the ranks every job spans (default:
        world). Never used for a job's traffic: each job gets ``comm.dup()``.
    timeline:
        A :class:`~mpicomm.observe.timeline.Timeline` (``True``: a new one) that receives, per
        rank, a ``compute``/``finish`` and a ``sync`` span per iteration on the row
        ``"job <name>"`` and, on the row ``"token"``, a ``wait <name>`` span whenever
        the token had to wait for a job's sync.
    abort_on_error:
        With more than one rank, a failing job makes this rank print the error (job,
        phase, step, traceback) and call ``MPI_Abort``, since the job's peers may be
        blocked in its collectives; ``False`` raises :class:`CrossoverError` here
        instead (then the caller must end the run itself). Default
        ``MPICOMM_ABORT_ON_ERROR`` (on). With one rank it always raises.
    gate_poll_s:
        ``None`` (default) starts each sync phase at once. Seconds: each sync phase
        first meets the job's other ranks at a nonblocking barrier (on the job's control
        communicator) polled every ``gate_poll_s``, so that a rank whose peers are late
        sleeps instead of busy-polling inside MPI while another job computes on its
        cores (ours; useful when ranks share CPU cores with compute, e.g. CPU training
        or oversubscription; costs one barrier latency per iteration plus up to one poll
        interval; try 1e-4-1e-3). Jobs whose communication starts inside the compute
        phase (GradientSync's buckets during backward) are not gated by it. With
        ``wait_poll_s`` set, the jobs' collectives already sleep while a peer is late,
        so the gate adds little.
    wait_poll_s:
        How the jobs' communication waits for messages: set as ``wait_poll_s`` on every
        job's communicator before :meth:`~mpicomm.sched.Job.setup` (so what the job
        builds on it, e.g. GradientSync's thread communicator, inherits it), see
        :func:`mpicomm.comm.wait_all`. Seconds: mpicomm's collectives test their
        requests and sleep between tests instead of spinning in MPI, so a job waiting on
        the wire leaves the core to the job that computes (ours; the abstract says
        nothing about it). ``None``: block in MPI (spinning). ``"auto"`` (default):
        :data:`NETWORK_WAIT_POLL_S` when ``comm`` spans more than one node (its data
        cross a network, where the wait is mostly wire time), ``None`` on one node
        (shared memory: the copies need the waiting thread's core anyway). Only
        mpicomm's own algorithms follow it; code that calls mpi4py directly still spins.
        Cost: up to about one interval per dependent message step (a ring allreduce
        over p ranks has 2(p-1); the sleeps back off from ``wait_poll_s / 16``),
        negligible when steps take tens of milliseconds, not for phases of a few
        milliseconds or on a microsecond network with many ranks: there pass a smaller
        value (e.g. 1e-4) or ``None``.

    Requires ``MPI_THREAD_MULTIPLE`` with more than one rank (the jobs' sync threads
    communicate concurrently); mpi4py requests it by default.
    """

    def __init__(self, jobs: Sequence[Job], comm: Communicator | None = None, *,
                 timeline: Timeline | bool | None = None,
                 abort_on_error: bool | None = None, gate_poll_s: float | None = None,
                 wait_poll_s: float | str | None = "auto"):
        self.comm = resolve(comm)
        error: Exception | None = None
        try:
            jobs = self._check_jobs(jobs)
            timeline = self._check_timeline(timeline)
            gate_poll_s = check_poll_s("gate_poll_s", gate_poll_s)
            if wait_poll_s == "auto":
                wait_poll_s = auto_wait_poll_s(self.comm)
            wait_poll_s = check_poll_s("wait_poll_s", wait_poll_s)
            self._check_thread_level()
        except (TypeError, ValueError, RuntimeError) as exc:
            error = exc
        self._agree(error, None if error else [j.describe() for j in jobs])
        assert isinstance(timeline, Timeline)
        self.jobs: list[Job] = list(jobs)
        self.timeline = timeline
        self.abort_on_error = (env_flag("MPICOMM_ABORT_ON_ERROR", True)
                               if abort_on_error is None else bool(abort_on_error))
        self.stats = CrossoverStats(jobs={j.name: JobStats() for j in self.jobs})
        #: The ``wait_poll_s`` given to every job's communicator ("auto" resolved).
        self.wait_poll_s: float | None = wait_poll_s  # type: ignore[assignment]
        self._comms: list[Communicator] = []
        self._threads: dict[str, _SyncThread] = {}
        self._ran = False
        self._closed = False
        self._failed = False
        try:
            for job in self.jobs:  # collective, in the same order on every rank
                job_comm = self.comm.dup()
                job_comm.wait_poll_s = self.wait_poll_s
                self._comms.append(job_comm)
                job.setup(job_comm)
            for job in self.jobs:
                self._threads[job.name] = _SyncThread(job, self.stats.jobs[job.name],
                                                      self.timeline, self.row(job.name),
                                                      gate_poll_s)
        except BaseException:
            self._release(collective=False)
            raise

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_jobs(jobs: Any) -> list[Job]:
        if isinstance(jobs, (str, bytes)) or not isinstance(jobs, Sequence):
            raise TypeError(f"jobs must be a sequence of Job objects, got {type(jobs).__name__}")
        for job in jobs:
            if not isinstance(job, Job):
                raise TypeError(f"every job must be an mpicomm.sched.Job (FunctionJob, "
                                f"TorchJob, ...), got {type(job).__name__}")
        if len(jobs) < 2:
            raise ValueError(f"crossover scheduling needs at least 2 jobs, got {len(jobs)}")
        names = [j.name for j in jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"job names must be unique, got {names}")
        if len({id(j) for j in jobs}) != len(jobs):
            raise ValueError("the same Job object appears twice")
        return list(jobs)

    @staticmethod
    def _check_timeline(timeline: Any) -> Timeline:
        if timeline is None or timeline is False:
            return Timeline(enabled=False)
        if timeline is True:
            return Timeline()
        if not isinstance(timeline, Timeline):
            raise TypeError(f"timeline must be a Timeline, a bool or None, got "
                            f"{type(timeline).__name__}")
        return timeline

    def _check_thread_level(self) -> None:
        from mpi4py import MPI

        if self.comm.size > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("CrossoverScheduler needs MPI_THREAD_MULTIPLE (the jobs' "
                               "synchronization threads communicate concurrently); MPI "
                               "was initialized with a lower thread level")

    def _agree(self, error: Exception | None, description: list[Any] | None) -> None:
        """Raise a local argument error on every rank, or a job-list mismatch (one
        allgather on the control communicator)."""
        if self.comm.size == 1:
            if error is not None:
                raise error
            return
        verdict = None if error is None else (type(error).__name__, str(error))
        everyone = self.comm.allgather_object((verdict, description))
        for rank, (theirs, _) in enumerate(everyone):
            if theirs is None:
                continue
            if error is not None:
                raise error
            kind = {"TypeError": TypeError, "RuntimeError": RuntimeError}.get(theirs[0],
                                                                              ValueError)
            raise kind(f"CrossoverScheduler: rank {rank} rejected its arguments: {theirs[1]}")
        problem = describe_mismatch([("CrossoverScheduler", (("jobs", tuple(d)),))
                                     for _, d in everyone])
        if problem is not None:
            raise ValueError(f"every rank must pass the same jobs (name, kind, steps) in the "
                             f"same order: {problem}")

    # ------------------------------------------------------------------ running
    @staticmethod
    def row(name: str) -> str:
        """The timeline row (``tid``) of job ``name``."""
        return f"job {name}"

    def __repr__(self) -> str:
        return (f"CrossoverScheduler(jobs={[j.name for j in self.jobs]}, "
                f"ranks={self.comm.size}{', closed' if self._closed else ''})")

    def run(self) -> CrossoverStats:
        """Run every job to completion on this rank's token; returns the measurements.

        Call it once, on every rank. An error in any job's compute, sync or finish
        phase ends the run with a :class:`CrossoverError` (or ``MPI_Abort``, see
        ``abort_on_error``) naming the job.
        """
        if self._closed:
            raise RuntimeError("this CrossoverScheduler is closed")
        if self._ran:
            raise RuntimeError("CrossoverScheduler.run() may be called only once")
        self._ran = True
        by_name = {j.name: j for j in self.jobs}
        token = Token(list(by_name))
        next_step = dict.fromkeys(by_name, 0)
        start = clock.now()
        while token.turn is not None:
            name = token.turn
            job, stats = by_name[name], self.stats.jobs[name]
            self._wait_for_sync(job, stats)
            step = next_step[name]
            phase = "compute" if step < job.steps else "finish"
            token.acquire(name)
            t0 = clock.now()
            try:
                with self.timeline.span(phase, cat="compute", tid=self.row(name), step=step):
                    if phase == "compute":
                        job.compute(step)
                    else:
                        job.finish()
            except Exception as exc:
                self._fail(job, phase, step, exc)
            except BaseException:  # KeyboardInterrupt, SystemExit: stop, then let it go
                self._stop_threads(_STOP_GRACE_S)
                raise
            stats.compute_seconds += clock.now() - t0
            if phase == "compute":
                self._threads[name].start(step)
                next_step[name] = step + 1
                stats.steps += 1
                token.pass_on()
            else:
                stats.finished_at = clock.now() - start
                token.leave()
            self._check_errors()
        self.stats.seconds = clock.now() - start
        return self.stats

    def _wait_for_sync(self, job: Job, stats: JobStats) -> None:
        """Block until ``job``'s last sync ended, failing fast if any job's sync failed."""
        thread = self._threads[job.name]
        t0 = self.timeline.now()
        start = clock.now()
        while not thread.wait(_POLL_S):
            self._check_errors()
        waited = clock.now() - start
        self._check_errors()
        stats.wait_seconds += waited
        if waited > 20e-6:
            self.timeline.complete(f"wait {job.name}", t0, self.timeline.now(), cat="wait",
                                   tid=TOKEN_ROW)

    def _check_errors(self) -> None:
        for job in self.jobs:
            thread = self._threads[job.name]
            if thread.error is not None:
                self._fail(job, "sync", thread.error_step, thread.error)

    def _fail(self, job: Job, phase: str, step: int, exc: BaseException) -> None:
        rank = self.comm.rank
        message = (f"crossover job {job.name!r} failed in its {phase} phase at step {step} "
                   f"on rank {rank}/{self.comm.size}: {type(exc).__name__}: {exc}")
        self._failed = True
        if self.comm.size > 1 and self.abort_on_error:
            # at once: the other jobs' threads may be blocked on peers that wait for us
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            sys.stderr.write(f"[mpicomm rank {rank}/{self.comm.size}] {message}; aborting "
                             f"the run.\n{text}")
            abort_after_flush(1)
        self._stop_threads(_STOP_GRACE_S)
        raise CrossoverError(message, job.name) from exc

    # ------------------------------------------------------------------ cleanup
    def _stop_threads(self, timeout: float | None) -> bool:
        """Stop every sync thread; ``True`` when all have ended within ``timeout`` each."""
        ended = True
        for thread in self._threads.values():
            ended = thread.stop(timeout) and ended
        return ended

    def _release(self, collective: bool) -> None:
        # after a failure a thread may be blocked for good (_fail already gave it the
        # grace period): do not wait for it again
        if self._failed:
            timeout: float | None = 0.05
        else:
            timeout = None if collective else _STOP_GRACE_S
        ended = self._stop_threads(timeout)
        if not ended:  # a thread is stuck in communication: its communicator stays
            log.warning("a crossover sync thread did not stop; its communicator is not freed")
            return
        if not collective:
            return
        errors = []
        for job in self.jobs:
            if job.comm is None:
                continue
            try:
                job.close()
            except Exception as exc:  # keep releasing the others
                errors.append(exc)
        for c in self._comms:
            c.free()
        self._comms.clear()
        if errors and not self._failed:
            raise errors[0]

    def close(self) -> None:
        """Stop the threads, close the jobs and free their communicators (collective).

        Idempotent. After a failed run, only what no thread still uses is released.
        """
        if self._closed:
            return
        self._closed = True
        self._release(collective=not self._failed or self.comm.size == 1)

    def __enter__(self) -> CrossoverScheduler:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None or self.comm.size == 1:
            self.close()
        else:  # another rank may not be here: no collective, leave the communicators
            self._closed = True
            self._release(collective=False)
