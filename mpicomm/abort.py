"""The error policy: a failure on one rank ends the whole job, never a hang.

:func:`install_abort_handler` (installed by :func:`mpicomm.init` unless
``MPICOMM_ABORT_ON_ERROR=0``) makes an uncaught exception on any rank, in any thread,
print that rank's traceback and call ``MPI_Abort``, so ``mpiexec`` ends every rank
within seconds. :func:`abort_job` is the explicit form (what
:meth:`mpicomm.Communicator.abort` calls). When several jobs share the processes (the
Crossover scheduler), :func:`job_scope` names the job whose code is running, so that the
message says which one failed (``MPI_Abort`` ends them all).

Cost: nothing until a failure; then a flush, :data:`ABORT_GRACE_S` of sleep (so that
the launcher forwards the message) and ``MPI_Abort``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator

from mpi4py import MPI

__all__ = ["install_abort_handler", "abort_job", "abort_after_flush", "exit_status",
           "job_scope", "current_job", "ABORT_GRACE_S"]

_abort_lock = threading.Lock()
_abort_installed = False
_job_local = threading.local()


def current_job() -> str | None:
    """The job name set by the innermost :func:`job_scope` on this thread, or ``None``."""
    return getattr(_job_local, "name", None)


@contextlib.contextmanager
def job_scope(name: str) -> Iterator[None]:
    """Mark the code in the block as working for job ``name`` (this thread only).

    For several jobs in one process (the Crossover scheduler): a fatal error inside the
    block (an uncaught exception, :meth:`Communicator.abort`, :func:`abort_job`) names the
    job in the message that precedes ``MPI_Abort``. An exception leaving the block carries
    the name in its ``mpicomm_job`` attribute, so the abort handler still names the job
    after the block has been left.
    """
    if not isinstance(name, str):
        raise TypeError(f"job name must be a str, got {type(name).__name__}")
    previous = current_job()
    _job_local.name = name
    try:
        yield
    except BaseException as exc:
        if getattr(exc, "mpicomm_job", None) is None:
            with contextlib.suppress(AttributeError, TypeError):
                exc.mpicomm_job = name  # type: ignore[attr-defined]
        raise
    finally:
        _job_local.name = previous


def _prefix(job: str | None) -> str:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return f"[mpicomm rank {rank}/{size}{f' job {job!r}' if job else ''}]"


def abort_job(message: str = "", code: int = 1, *, job: str | None = None) -> None:
    """Print ``message`` prefixed with the rank and job, then ``MPI_Abort`` (all ranks).

    ``job`` defaults to the thread's :func:`job_scope`. With a job, the message adds that
    every job sharing these processes ends too.
    """
    job = job if job is not None else current_job()
    others = " (MPI_Abort ends every job sharing these processes)" if job else ""
    if message:
        sys.stderr.write(f"{_prefix(job)} {message}{others}\n")
    abort_after_flush(code)


def _abort_with_traceback(kind: str, exc_type, exc, tb, thread_name: str | None = None) -> None:
    job = getattr(exc, "mpicomm_job", None) or current_job()
    where = f" in thread {thread_name!r}" if thread_name else ""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"{_prefix(job)} uncaught {kind}{where}; aborting the job.\n{text}")
    abort_after_flush(exit_status(exc))


def exit_status(exc: BaseException | None) -> int:
    """The status a job ends with after ``exc``: its ``exit_status`` attribute when that is
    an int in 1..255 (``mpicomm.checkpoint.CheckpointError`` sets 2, the status that
    ``python -m mpicomm run --restarts`` never restarts: the same input fails again),
    else 1."""
    code = getattr(exc, "exit_status", 1)
    return code if isinstance(code, int) and 1 <= code <= 255 else 1


#: Seconds between printing a fatal message and ``MPI_Abort``: launchers forward each
#: rank's output asynchronously and may kill the job before a message that was already
#: written reaches the terminal (seen with MPICH's hydra when a rank fails at start-up).
ABORT_GRACE_S = 0.5


def abort_after_flush(code: int = 1) -> None:
    """Flush stdout/stderr, give the launcher a moment to forward them, then abort.

    Never returns: ``MPI_Abort`` may hand the kill to the launcher and return before
    this process is gone (seen with MPICH's hydra on a loaded machine), so the process
    then leaves at once with ``code`` rather than run the caller's next statement.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
            stream.flush()
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def install_abort_handler() -> None:
    """Make an uncaught exception on this rank (any thread) abort the whole MPI job.

    Without it, one rank dying while the others wait in a collective hangs the job
    forever. The handler prints the traceback prefixed with the rank, then calls
    ``MPI_Abort(MPI_COMM_WORLD, code)`` (``code``: :func:`exit_status`, usually 1);
    ``mpiexec`` then ends every rank with a non-zero status. It is not installed in an
    interactive single-process session, where an exception at the prompt must not kill
    the interpreter. Idempotent.
    """
    global _abort_installed
    with _abort_lock:
        if _abort_installed:
            return
        interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive)
        if interactive and MPI.COMM_WORLD.Get_size() == 1:
            return
        previous = sys.excepthook

        def excepthook(exc_type, exc, tb):
            if issubclass(exc_type, KeyboardInterrupt) and MPI.COMM_WORLD.Get_size() == 1:
                previous(exc_type, exc, tb)
                return
            _abort_with_traceback("exception", exc_type, exc, tb)

        def thread_hook(args: threading.ExceptHookArgs) -> None:
            if args.exc_type is SystemExit:
                return
            name = args.thread.name if args.thread is not None else None
            _abort_with_traceback("exception", args.exc_type, args.exc_value,
                                  args.exc_traceback, name)

        sys.excepthook = excepthook
        threading.excepthook = thread_hook
        _abort_installed = True
