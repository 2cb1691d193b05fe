"""Restart a whole MPI job when one of its ranks dies: ``python -m mpicomm run --restarts K``.

Standard MPI cannot keep a job alive after a rank has died, so recovery is a restart of
every rank, with the training resuming from the newest complete checkpoint
(:mod:`mpicomm.checkpoint`). :func:`supervise` runs the launcher command (``mpiexec -n N
cmd``) in a process group of its own and waits for it:

* exit status 0: done;
* :data:`NO_RESTART` (2, the status of a usage error: bad arguments, a checkpoint of
  another model or world size): returned at once, never restarted, since the same input
  would fail the same way;
* anything else (a rank killed by a signal, an uncaught exception ending the job through
  ``MPI_Abort``, an out-of-memory kill): every process left in the job's group is
  killed, and the command starts again, up to ``restarts`` times. Each start gets
  ``MPICOMM_RESTART`` = the number of restarts so far (0 for the first run), and a
  restart also ``MPICOMM_RESTART_FAILED_AT`` (when the launcher of the failed attempt
  was seen to exit) and ``MPICOMM_RESTART_LAUNCHED_AT`` (when this one was started),
  both ``time.time()`` seconds, so that a job can split its restart time into phases.

MPICH's ``mpiexec`` (Hydra) ends the other ranks when one dies; the kill of the process
group afterwards covers launchers that leave some behind, so nothing of an attempt
survives into the next. Cost of a restart: the launcher's start-up (Python, imports,
``MPI_Init``: a few seconds) plus the checkpoint load; no time is spent waiting for a
timeout, since the launcher reports a dead rank as soon as the operating system does.

Tuning: ``K`` bounds the restarts of a job that keeps failing (a bug, not a lost node:
it fails again at the same step); checkpoint often enough that a restart loses little
work, e.g. every minute of training (:class:`mpicomm.checkpoint.Checkpointer`'s
``every``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["supervise", "describe_status", "ENV_RESTART", "ENV_FAILED_AT", "ENV_LAUNCHED_AT",
           "NO_RESTART"]

#: Exported to every rank: how many times the job was restarted before this start.
ENV_RESTART = "MPICOMM_RESTART"
#: Exported on a restart: ``time.time()`` when the failed attempt's launcher exited.
ENV_FAILED_AT = "MPICOMM_RESTART_FAILED_AT"
#: Exported on a restart: ``time.time()`` just before this attempt's launcher started.
ENV_LAUNCHED_AT = "MPICOMM_RESTART_LAUNCHED_AT"
#: The exit status that is never restarted (usage errors, as argparse exits).
NO_RESTART = 2


def describe_status(status: int) -> str:
    """A launcher's exit status in words (``-9``: killed by signal 9, SIGKILL)."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"killed by {name}"
    if status > 128:
        try:
            return f"exit status {status} (a rank killed by {signal.Signals(status - 128).name}?)"
        except ValueError:
            pass
    return f"exit status {status}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process still in the job's process group (none left: no-op)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class _Terminated(Exception):
    """SIGTERM reached the supervisor: end the job, do not restart it."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def supervise(argv: Sequence[str], env: dict[str, str], restarts: int,
              say: Callable[[str], None] | None = None) -> int:
    """Run ``argv`` (the launcher command) with ``env``; restart it after a failure up to
    ``restarts`` times (module docstring). Returns the last exit status (130 after
    Ctrl-C, 143 after SIGTERM: either ends the job, every process of it, and is not
    restarted)."""
    if restarts < 0:
        raise ValueError(f"--restarts must be >= 0, got {restarts}")
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _attempts(argv, env, restarts, say)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _attempts(argv: Sequence[str], env: dict[str, str], restarts: int,
              say: Callable[[str], None]) -> int:
    status, failed_at = 0, None
    for attempt in range(restarts + 1):
        env = {**env, ENV_RESTART: str(attempt)}
        if failed_at is not None:
            env[ENV_FAILED_AT] = repr(failed_at)
            env[ENV_LAUNCHED_AT] = repr(time.time())
        proc = subprocess.Popen(list(argv), env=env, start_new_session=True)
        try:
            status = proc.wait()
            failed_at = time.time()
        except (KeyboardInterrupt, _Terminated) as exc:
            sig = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            _kill_group(proc)
            proc.wait()
            return 130 if sig == signal.SIGINT else 143
        finally:
            _kill_group(proc)
        if status == 0 or status == NO_RESTART:
            return status
        if attempt == restarts:
            if restarts:
                say(f"python -m mpicomm run: the job failed ({describe_status(status)}) "
                    f"after {restarts} restart(s); giving up")
            return status
        say(f"python -m mpicomm run: the job failed ({describe_status(status)}) at "
            f"{time.strftime('%H:%M:%S')}; restart {attempt + 1} of {restarts}")
    return status
