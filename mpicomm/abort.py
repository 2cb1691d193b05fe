"""The error policy: a failure on one rank ends the whole job, never a hang, and prints
one message, not one per rank.

:func:`install_abort_handler` (installed when mpicomm is imported in a job of several
ranks, and by :func:`mpicomm.init` and the first collective of a script without it,
unless ``MPICOMM_ABORT_ON_ERROR=0``; :func:`install_from_env` is that decision) makes an
uncaught exception on any rank, in any thread, end the job through ``MPI_Abort``, so
``mpiexec`` ends every rank within seconds. Before aborting, the failing ranks tell each
other what failed (a small message to every rank on ``MPI_COMM_WORLD``, tag
:data:`mpicomm.tags.TAG_FAILURE`) and only the lowest failing rank prints:

* the same ``ValueError``/``TypeError`` (a bad argument, a bad ``MPICOMM_*`` value, too
  few ranks: :class:`UsageError` is the explicit form) on every rank: one
  ``prog: error: message`` line (plus, unless it is a :class:`UsageError`, a line saying
  where it was raised), exit status 2;
* ``KeyboardInterrupt`` (Ctrl-C; ``mpiexec`` forwards it to every rank) on any rank:
  ``prog: interrupted``, exit status 130;
* anything else: one traceback, the earliest failure's, with the ranks that failed,
  exit status 1.

``MPICOMM_TRACEBACK=1`` adds the traceback to the first two. :func:`abort_job` is the
explicit form (what :meth:`mpicomm.Communicator.abort` calls): it prints its message
from the calling rank at once. When several jobs share the processes (the Crossover
scheduler), :func:`job_scope` names the job whose code is running, so that the message
says which one failed (``MPI_Abort`` ends them all).

Cost: nothing until a failure. Then the failing rank waits for the other ranks' reports
until all have reported or :data:`GATHER_S` has passed (an error that the other ranks
will raise too may come seconds later from a rank that started later; an error of one
rank alone thus ends the job that much later), flushes, sleeps :data:`ABORT_GRACE_S` so
that the launcher forwards the message, unlinks the MPI library's named shared memory
(:func:`release_mpi_shared_memory`) and calls ``MPI_Abort``. A rank whose lower
neighbour failed too stays silent until the job is ended, or for :data:`SILENT_S` at most
(then it prints its own error and aborts).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from .config import env_flag
from .tags import TAG_FAILURE

__all__ = ["install_abort_handler", "install_from_env", "abort_job", "abort_after_flush",
           "job_scope", "current_job", "program_name", "UsageError", "ABORT_GRACE_S",
           "GATHER_S", "SILENT_S", "EXIT_USAGE", "EXIT_INTERRUPTED", "exit_status"]

#: Exit status of a usage error (as argparse) and of an interrupted job (128 + SIGINT).
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: Seconds between printing a fatal message and ``MPI_Abort``: launchers forward each
#: rank's output asynchronously and may kill the job before a message that was already
#: written reaches the terminal (seen with MPICH's hydra when a rank fails at start-up).
ABORT_GRACE_S = 0.5

#: Name prefixes, under ``/dev/shm``, of the shared-memory segments an MPI library keeps
#: named until ``MPI_Finalize`` (MPICH's per-node segment), which an abort would leave.
MPI_SHM_PREFIXES = ("mpich_shm_",)

#: Seconds the lowest failing rank waits for the other ranks' reports (ends early when
#: every rank has reported): longer for errors that every rank is expected to raise.
GATHER_S = {"usage": 3.0, "interrupt": 1.0, "error": 1.0}

#: Seconds a silent rank (a lower rank failed too and prints) waits to be ended.
SILENT_S = 15.0


class UsageError(ValueError):
    """A bad argument or setting that every rank finds the same way (from the arguments,
    the environment and the rank count alone, before communicating). Left uncaught it
    ends the job with one ``prog: error: ...`` line from the lowest rank and exit
    status 2, like argparse."""


_abort_lock = threading.Lock()
#: The (sys, threading) exception hooks the installed handler replaced; None when it is
#: not installed.
_replaced_hooks: tuple[Any, Any] | None = None
_failing = threading.Lock()   # held by the one thread that reports this rank's failure
_job_local = threading.local()
_show_traceback = False


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


def _prefix(job: str | None, rank: int | None = None) -> str:
    world = MPI.COMM_WORLD
    rank = world.Get_rank() if rank is None else rank
    return f"[mpicomm rank {rank}/{world.Get_size()}{f' job {job!r}' if job else ''}]"


def program_name() -> str:
    """How the user started this program, for messages: ``train.py``, ``python -m
    mpicomm.bench``, ``python -c``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name[:-len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return f"python -m {name}"
    arg0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    return "python -c" if arg0 == "-c" else os.path.basename(arg0)


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


def abort_after_flush(code: int = 1, *, quiet: bool = False) -> None:
    """Flush stdout/stderr, give the launcher a moment to forward them, then abort.

    ``quiet``: the MPI library's own "application called MPI_Abort" line is dropped (this
    process's stderr goes to ``/dev/null`` just before the call), for callers that have
    printed the whole story. Never returns: ``MPI_Abort`` may hand the kill to the
    launcher and return before this process is gone (seen with MPICH's hydra on a loaded
    machine), so the process then leaves at once with ``code`` rather than run the
    caller's next statement.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
            stream.flush()
    time.sleep(ABORT_GRACE_S)
    if quiet:
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
    release_mpi_shared_memory()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def release_mpi_shared_memory(maps: str = "/proc/self/maps") -> list[str]:
    """Unlink the MPI library's named shared-memory segments that this process maps
    (:data:`MPI_SHM_PREFIXES` under ``/dev/shm``) and return their paths.

    ``MPI_Finalize`` removes them; ``MPI_Abort`` does not, so every aborted job would
    leave its node's segment (a few MB of memory) in ``/dev/shm``. Unlinking only drops
    the name: the ranks still running keep their mappings until they are ended. Linux
    (``/proc``); elsewhere nothing. The world communicator drops the names as soon as
    every rank maps them (:func:`drop_mpi_shared_memory_names`); this call at an abort
    covers a job that fails before."""
    try:
        with open(maps) as f:
            paths = {line.split(maxsplit=5)[5].strip() for line in f
                     if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")}
    except OSError:
        return []
    gone = []
    for path in sorted(paths):
        if os.path.dirname(path) == "/dev/shm" and \
                os.path.basename(path).startswith(MPI_SHM_PREFIXES):
            with contextlib.suppress(OSError):
                os.unlink(path)
                gone.append(path)
    return gone


def drop_mpi_shared_memory_names(mpi_comm: MPI.Intracomm) -> list[str]:
    """Unlink the MPI library's named node segments once every rank of ``mpi_comm``
    maps them: collective (one barrier), then each rank unlinks what it maps
    (:func:`release_mpi_shared_memory`; the ranks of a node share one segment, so one of
    them finds the name and the others find it gone) and returns what it unlinked.

    The mappings stay, so MPI goes on as before (its ``MPI_Finalize`` then finds the
    name gone, which MPICH ignores); what this buys is that a job ended without
    ``MPI_Finalize`` or ``MPI_Abort``, a rank killed by a signal (a launcher's or a
    scheduler's time limit, the out-of-memory killer), leaves nothing in ``/dev/shm``:
    the memory goes back when the last rank exits. Cost: one barrier and one read of
    ``/proc/self/maps``, when the world communicator is made."""
    if not sys.platform.startswith("linux"):
        return []
    mpi_comm.Barrier()          # every rank has mapped its node's segment
    return release_mpi_shared_memory()


# ---------------------------------------------------------------------- failure reports
@dataclass
class _Failure:
    """What one rank tells the others about its uncaught exception."""

    rank: int
    kind: str          # "usage" (ValueError/TypeError), "interrupt" or "error"
    type: str          # the exception's class name
    message: str
    where: str         # innermost frame: "file:line in function"
    text: str          # the formatted traceback (tail)
    header: str        # "[mpicomm rank r/N job 'x'] uncaught exception in thread 't'"
    explicit: bool     # a UsageError: the message says all
    time: float
    status: int = 1    # exit status of an "error" (exit_status)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.kind, self.type, self.message


def _kind(exc_type: type[BaseException]) -> str:
    if issubclass(exc_type, KeyboardInterrupt):
        return "interrupt"
    return "usage" if issubclass(exc_type, (ValueError, TypeError)) else "error"


def _where(tb: Any) -> str:
    frames = traceback.extract_tb(tb) if tb is not None else []
    if not frames:
        return "unknown place"
    frame = frames[-1]
    path = frame.filename
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    return f"{path}:{frame.lineno} in {frame.name}"


def _failure(exc_type: type[BaseException], exc: BaseException | None, tb: Any,
             thread_name: str | None) -> _Failure:
    job = getattr(exc, "mpicomm_job", None) or current_job()
    where = f" in thread {thread_name!r}" if thread_name else ""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    return _Failure(rank=MPI.COMM_WORLD.Get_rank(), kind=_kind(exc_type),
                    type=exc_type.__name__, message=str(exc)[:2000], where=_where(tb),
                    text=text[-16000:], header=f"{_prefix(job)} uncaught exception{where}",
                    explicit=issubclass(exc_type, UsageError), time=time.time(),
                    status=exit_status(exc))


def exit_status(exc: BaseException | None) -> int:
    """The status a job ends with after an unexpected error ``exc``: its ``exit_status``
    attribute when that is an int in 1..255 (``mpicomm.checkpoint.CheckpointError`` sets
    2, the status that ``python -m mpicomm run --restarts`` never restarts: the same input
    fails again), else 1."""
    code = getattr(exc, "exit_status", 1)
    return code if isinstance(code, int) and 1 <= code <= 255 else 1


def _can_communicate() -> bool:
    """Whether this thread may send MPI messages now: MPI is up, and either the library
    is thread-safe or no other thread is running (that might be inside MPI)."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return False
    return (MPI.Query_thread() >= MPI.THREAD_MULTIPLE or threading.active_count() == 1)


class _Exchange:
    """This rank's side of the failure reports: send ours to every rank, collect theirs."""

    def __init__(self, mine: _Failure):
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.failures: dict[int, _Failure] = {mine.rank: mine}
        self.claimed_by: int | None = None
        self._sends: list[Any] = []
        self._tell(("failure", mine))

    def _tell(self, message: tuple[str, Any]) -> None:
        for dest in range(self.size):
            if dest != self.rank:
                self._sends.append(self.world.isend(message, dest=dest, tag=TAG_FAILURE))

    def claim(self) -> None:
        """Tell every rank that this one prints the report (late failures stay silent)."""
        self._tell(("claim", self.rank))

    def drain(self) -> None:
        status = MPI.Status()
        while self.world.iprobe(source=MPI.ANY_SOURCE, tag=TAG_FAILURE, status=status):
            what, value = self.world.recv(source=status.Get_source(), tag=TAG_FAILURE)
            if what == "failure":
                self.failures[value.rank] = value
            elif what == "claim" and self.claimed_by is None:
                self.claimed_by = value

    def someone_else_reports(self) -> bool:
        return self.claimed_by is not None or min(self.failures) < self.rank

    def gather(self, seconds: float) -> bool:
        """Collect reports until every rank has failed or ``seconds`` passed; ``True`` if
        this rank is the one to print (no lower rank failed, no rank has claimed)."""
        deadline = time.monotonic() + seconds
        while True:
            self.drain()
            if self.someone_else_reports():
                return False
            if len(self.failures) == self.size or time.monotonic() >= deadline:
                return True
            time.sleep(0.005)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 12:
        return ", ".join(map(str, ranks[:10])) + f", ... ({len(ranks)} ranks)"
    return ", ".join(map(str, ranks))


def compose_report(failures: dict[int, _Failure], size: int, prog: str,
                   show_traceback: bool = False) -> tuple[str, int]:
    """The one message of a failed job and its exit status, from every failure known.

    Pure (tested without MPI): the rules of the module docstring.
    """
    ranks = sorted(failures)
    first = min(failures.values(), key=lambda f: (f.time, f.rank))
    everywhere = len(ranks) == size
    interrupts = [f for f in failures.values() if f.kind == "interrupt"]
    if interrupts:
        text = f"{prog}: interrupted\n"
        if show_traceback:
            text += min(interrupts, key=lambda f: f.rank).text
        return text, EXIT_INTERRUPTED
    same = everywhere and len({f.key for f in failures.values()}) == 1
    if same and first.kind == "usage":
        text = f"{prog}: error: {first.message or first.type}\n"
        if show_traceback:
            text += first.text
        elif not first.explicit:
            on = f" on all {size} ranks" if size > 1 else ""
            text += (f"  ({first.type}{on}, raised at {first.where}; MPICOMM_TRACEBACK=1 "
                     "prints the traceback)\n")
        return text, EXIT_USAGE
    if same:
        first = failures[ranks[0]]
        which = f"the same on all {size} ranks" if size > 1 else "rank 0 of 1"
    else:
        which = f"ranks that failed: {_ranks_text(ranks)} of {size}"
    return f"{first.header}; aborting the job ({which}):\n{first.text}", first.status


def _report_and_abort(exc_type: type[BaseException], exc: BaseException | None, tb: Any,
                      thread_name: str | None = None) -> None:
    """Tell the other ranks, print the job's one message if this rank is the one to
    print it, and end the job (never returns)."""
    if not _failing.acquire(blocking=False):   # another thread of this rank reports
        time.sleep(SILENT_S + max(GATHER_S.values()))
        os._exit(1)
    mine = _failure(exc_type, exc, tb, thread_name)
    prog = program_name()
    if not _can_communicate():   # report alone
        text, code = compose_report({mine.rank: mine}, MPI.COMM_WORLD.Get_size(), prog,
                                    _show_traceback)
        sys.stderr.write(text)
        abort_after_flush(code, quiet=True)
    exchange = _Exchange(mine)
    if exchange.gather(GATHER_S[mine.kind]):
        exchange.claim()
        text, code = compose_report(exchange.failures, exchange.size, prog, _show_traceback)
        sys.stderr.write(text)
        abort_after_flush(code, quiet=True)
    # a lower rank failed too (or a rank has printed already): it reports and aborts
    time.sleep(SILENT_S)
    sys.stderr.write(f"{mine.header} (no other rank ended the job):\n{mine.text}")
    abort_after_flush(1)


def install_abort_handler() -> None:
    """Make an uncaught exception on this rank (any thread) abort the whole MPI job.

    Without it, one rank dying while the others wait in a collective hangs the job
    forever. The handler reports the failure to the other ranks, the lowest failing rank
    prints the job's one message (see the module docstring), and then calls
    ``MPI_Abort(MPI_COMM_WORLD, code)``; ``mpiexec`` ends every rank with that status.
    It is not installed in an interactive single-process session, where an exception at
    the prompt must not kill the interpreter. Idempotent; communicates nothing until a
    failure, so it may be called before :func:`mpicomm.init` and by one rank alone.
    ``ValueError`` on an unreadable ``MPICOMM_TRACEBACK``.
    """
    global _show_traceback, _replaced_hooks
    with _abort_lock:
        interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive)
        if _replaced_hooks is None and not (interactive and MPI.COMM_WORLD.Get_size() == 1):

            def excepthook(exc_type, exc, tb):
                _report_and_abort(exc_type, exc, tb)

            def thread_hook(args: threading.ExceptHookArgs) -> None:
                if args.exc_type is SystemExit:
                    return
                name = args.thread.name if args.thread is not None else None
                _report_and_abort(args.exc_type, args.exc_value, args.exc_traceback, name)

            _replaced_hooks = (sys.excepthook, threading.excepthook)
            sys.excepthook = excepthook
            threading.excepthook = thread_hook
    # read after installing, at every call: an unreadable value is itself reported as a
    # usage error
    _show_traceback = env_flag("MPICOMM_TRACEBACK", False)


def remove_abort_handler() -> None:
    """Put back the exception hooks :func:`install_abort_handler` replaced (nothing when
    it is not installed)."""
    global _replaced_hooks
    with _abort_lock:
        if _replaced_hooks is not None:
            sys.excepthook, threading.excepthook = _replaced_hooks
            _replaced_hooks = None


def install_from_env(enabled: bool | None = None) -> bool:
    """Install the handler when ``enabled`` (default: ``MPICOMM_ABORT_ON_ERROR``, on), else
    remove it; returns whether it is installed. What importing mpicomm in a job of several
    ranks, :func:`mpicomm.init` (whose ``abort_on_error=False`` so removes the handler the
    import installed) and the entry points (``python -m mpicomm``, the benchmark suites,
    the examples) call first."""
    if enabled is None:
        try:
            enabled = env_flag("MPICOMM_ABORT_ON_ERROR", True)
        except ValueError:   # reported through the default policy, once
            install_abort_handler()
            raise
    if enabled:
        install_abort_handler()
    else:
        remove_abort_handler()
    return _replaced_hooks is not None
