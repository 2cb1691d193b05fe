"""The :class:`Communicator`: the one object every mpicomm call takes.

A ``Communicator`` wraps an mpi4py communicator and adds what the rest of the library
needs:

* topology: ``rank``/``size``, the host layout (:attr:`Communicator.topology`, from
  :mod:`mpicomm.topology`: ``MPICOMM_HOST_SIZES`` or MPI's shared-memory split),
  ``local_rank``/``local_size`` (ranks on the same host as this one), ``node`` (index of
  this host) and ``nodes``;
* private duplicates of the wrapped communicator, so that the library's own
  point-to-point traffic never matches a user's message (``p2p``) and so that checked
  mode and small control reductions do not interleave with it (``ctl``);
* checked mode (``MPICOMM_CHECK=1`` or ``init(check=True)``): before every collective
  the ranks exchange a short description of the call (operation, shape, dtype, options)
  and raise ``ValueError`` on *every* rank naming the first disagreement, instead of
  deadlocking or silently reducing mismatched buffers;
* :func:`init`, which also installs the error policy of :mod:`mpicomm.abort` (an
  uncaught exception on any rank aborts the job) and runs the hooks that observers added
  with :func:`on_init`.

Creating a communicator is collective (it duplicates and splits the wrapped one), so
every rank of the wrapped communicator must construct it, in the same order.

Thread safety: a ``Communicator`` runs one collective at a time. Two threads that both
communicate (a training loop and a background gradient thread, say) must each use their
own ``comm.dup()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from . import clock, vwire
from .abort import abort_job, drop_mpi_shared_memory_names, install_from_env
from .config import env_flag
from .topology import Topology, detect
from .traffic import Traffic
from .validate import NotAnIntegerError, check_int, check_poll_s

__all__ = [
    "Communicator",
    "Roles",
    "Traffic",
    "init",
    "world",
    "resolve",
    "on_init",
    "configure_logging",
    "wait_all",
    "poll_until",
]

log = logging.getLogger("mpicomm")

#: The :attr:`Communicator.resources` keys that hold a calibration of the cost model
#: (:func:`mpicomm.collectives.cost.calibrated` and ``host_costs`` read them: the slowest
#: link, the compute rates, the link between ranks of one host); ``dup``/``split`` copy
#: them.
CALIBRATION_KEYS = ("cost_params", "compute_params", "host_cost_params")

_SCALAR_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "avg": MPI.SUM}

#: Argument errors re-raised with the same type on the ranks that did not find them.
_ARGUMENT_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (ValueError, TypeError, NotAnIntegerError)}


@dataclass(frozen=True)
class Roles:
    """This rank's place in a parameter-server split (see :meth:`Communicator.split_roles`).

    ``group`` holds the ranks with the same role (all servers, or all workers); ``index``
    is this rank's position in it; ``servers``/``workers`` list the ranks of the parent
    communicator by role.
    """

    role: str
    group: Communicator
    index: int
    servers: tuple[int, ...]
    workers: tuple[int, ...]

    @property
    def is_server(self) -> bool:
        return self.role == "server"

    @property
    def is_worker(self) -> bool:
        return self.role == "worker"


class Communicator:
    """A group of ranks that run mpicomm collectives together.

    Parameters
    ----------
    mpi_comm:
        The mpi4py intra-communicator to wrap (default ``MPI.COMM_WORLD``). It is not
        freed by :meth:`free` unless ``owns`` is true; the duplicates made here always are.
    check:
        Checked mode; ``None`` reads ``MPICOMM_CHECK`` (default off). Costs one small
        allgather per collective; use it while developing and in tests.
    owns:
        Free ``mpi_comm`` too in :meth:`free` (set by :meth:`dup` and :meth:`split`, whose
        new MPI communicators belong to the object they return).
    job:
        Name of the job this communicator serves, when several jobs share the processes
        (the Crossover scheduler): :meth:`abort` names it, because ``MPI_Abort`` ends every
        job of the world, not only the failing one. Inherited by :meth:`dup`/:meth:`split`.
    wait_poll_s:
        How mpicomm's own algorithms wait for their messages on this communicator (see
        :func:`wait_all`): ``None`` (default) blocks in MPI, whose progress engine
        busy-polls a core until the message is there; seconds in ``(0, 1)`` test the
        requests and sleep that long between tests, leaving the core to other threads
        (e.g. another job's compute under the Crossover scheduler) while a slow network
        carries the data. Inherited by :meth:`dup`/:meth:`split`; settable afterwards.
    topology:
        The host layout (:class:`mpicomm.topology.Topology`, one host per rank entry);
        ``None`` (default) detects it (:func:`mpicomm.topology.detect`:
        ``MPICOMM_HOST_SIZES``, else MPI's shared-memory split). Give one to run the
        hierarchical algorithms on a layout of your choosing (tests, what-if runs);
        ``ValueError`` when it does not place exactly this communicator's ranks.
        Inherited by :meth:`dup`; :meth:`split` detects its own.
    """

    def __init__(self, mpi_comm: MPI.Intracomm | None = None, *, check: bool | None = None,
                 owns: bool = False, job: str | None = None,
                 wait_poll_s: float | None = None, topology: Topology | None = None):
        if job is not None and not isinstance(job, str):
            raise TypeError(f"job must be a str or None, got {type(job).__name__}")
        wait_poll_s = check_poll_s("wait_poll_s", wait_poll_s)
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a mpicomm.topology.Topology or None, got "
                            f"{type(topology).__name__}")
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(base, MPI.Intracomm):
            raise TypeError(f"expected an mpi4py Intracomm, got {type(base).__name__}")
        if base == MPI.COMM_NULL:
            raise ValueError("cannot wrap MPI.COMM_NULL")
        if clock.is_virtual() and not clock.started():
            if base.Get_size() != MPI.COMM_WORLD.Get_size():
                raise RuntimeError("virtual clock: call mpicomm.init() on every rank before "
                                   "creating communicators over part of the world")
            clock.start(base)
        self.mpi: MPI.Intracomm = base
        self.rank: int = base.Get_rank()
        self.size: int = base.Get_size()
        self.check: bool = env_flag("MPICOMM_CHECK", False) if check is None else bool(check)
        #: The host layout of these ranks (:mod:`mpicomm.topology`).
        self.topology: Topology = detect(base) if topology is None \
            else topology.checked(self.size)
        self.node: int = self.topology.hosts[self.rank]
        self.nodes: int = self.topology.num_hosts
        self.local_rank: int = self.topology.local_rank(self.rank)
        self.local_size: int = self.topology.host_sizes[self.node]
        self.p2p: MPI.Intracomm = base.Dup()
        self.ctl: MPI.Intracomm = base.Dup()
        #: The ranks of this host (an MPI communicator, in rank order).
        self.local_mpi: MPI.Intracomm = base.Split(self.node, key=self.rank)
        vwire.register(self.p2p)   # the virtual clock's ids (no-op on the wall clock)
        vwire.register(self.ctl)
        #: Per-communicator caches owned by lower layers (e.g. pinned staging buffers, the
        #: hierarchical collectives' sub-communicators); an entry with a ``free()`` method
        #: holds MPI objects and is freed with this communicator.
        self.resources: dict[str, Any] = {}
        #: Bytes moved by mpicomm's own algorithms on this communicator.
        self.traffic = Traffic()
        self._owns = bool(owns) and base != MPI.COMM_WORLD and base != MPI.COMM_SELF
        self._freed = False
        #: The job this communicator serves (named in fatal messages), or ``None``.
        self.job: str | None = job
        #: How mpicomm's algorithms wait for messages (:func:`wait_all`; None: block in MPI).
        self.wait_poll_s: float | None = wait_poll_s

    # ------------------------------------------------------------------ structure
    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, node={self.node}, nodes={self.nodes}, "
            f"check={self.check})"
        )

    def dup(self) -> Communicator:
        """A new communicator over the same ranks (collective).

        It inherits checked mode, the job name, ``wait_poll_s``, the topology and the
        calibration (the
        cost-model
        parameters in :attr:`resources`, so ``algorithm="auto"`` and every strategy's
        ``predict`` see the same numbers as on this one).
        """
        return self._inherit(Communicator(self.mpi.Dup(), check=self.check, owns=True,
                                          job=self.job, wait_poll_s=self.wait_poll_s,
                                          topology=self.topology))

    def _inherit(self, child: Communicator) -> Communicator:
        """Copy the calibrated cost-model parameters (immutable values) into ``child``."""
        for key in CALIBRATION_KEYS:
            if key in self.resources:
                child.resources[key] = self.resources[key]
        return child

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Partition the ranks by ``color`` (collective); ``None`` opts this rank out.

        Ranks with the same color form one new communicator, ordered by ``key`` (default:
        the current rank). Returns ``None`` on ranks that passed ``color=None``.
        """
        if color is not None:
            color = check_int("color", color, 0)
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color,
                             self.rank if key is None else key)
        if sub == MPI.COMM_NULL:
            return None
        return self._inherit(Communicator(sub, check=self.check, owns=True, job=self.job,
                                          wait_poll_s=self.wait_poll_s))

    def split_roles(self, num_servers: int, placement: str = "first") -> Roles:
        """Split the ranks into ``num_servers`` parameter servers and the rest workers.

        ``placement="first"`` makes ranks ``0..S-1`` the servers; ``"spread"`` spreads the
        servers evenly over the rank range (one per node when ``S`` equals the number of
        nodes and ranks are placed by node). Every rank must pass the same arguments.
        """
        num_servers = check_int("num_servers", num_servers)
        if not 1 <= num_servers < self.size:
            raise ValueError(
                f"num_servers must be in [1, size-1] = [1, {self.size - 1}] so that at least "
                f"one worker remains, got {num_servers}"
            )
        if placement == "first":
            servers = tuple(range(num_servers))
        elif placement == "spread":
            servers = tuple(sorted({(i * self.size) // num_servers for i in range(num_servers)}))
        else:
            raise ValueError(f"placement must be 'first' or 'spread', got {placement!r}")
        self.check_collective("split_roles", num_servers=num_servers, placement=placement)
        workers = tuple(r for r in range(self.size) if r not in servers)
        role = "server" if self.rank in servers else "worker"
        group = self.split(0 if role == "server" else 1)
        assert group is not None
        return Roles(role, group, group.rank, servers, workers)

    # ------------------------------------------------------------------ control
    def _timed(self, kind: str, run: Callable[[], Any],
               nbytes: Callable[[Any], float] = lambda result: 8) -> Any:
        """Run a control collective; under the virtual clock every rank leaves at the
        latest entry plus :func:`mpicomm.vwire.small_collective_cost` for ``nbytes(result)``
        bytes per rank (the model of MPI's own small collectives)."""
        if not vwire.active():
            return run()
        out: list[Any] = []

        def timed_run() -> Any:
            out.append(run())
            return out[0]

        return vwire.collective(self.ctl, timed_run, lambda a, b, p: vwire.small_collective_cost(
            kind, nbytes(out[0]), p, a, b))

    def barrier(self, poll_s: float | None = None) -> None:
        """Wait until every rank is here. ``poll_s``: wait asleep (``MPI_Ibarrier``,
        tested with sleeps of up to ``poll_s``, :func:`wait_all`) so that a rank waiting
        leaves the CPU to those still working (calibration turns, Crossover gates)."""
        if poll_s is None:
            self._timed("barrier", self.ctl.Barrier)
        elif not vwire.active():
            wait_all([self.ctl.Ibarrier()], poll_s)
        else:
            started = vwire.start_collective(self.ctl)
            vwire.complete_collectives(
                [started], [self.ctl.Ibarrier()], poll_s, wait_all,
                lambda a, b, p: vwire.small_collective_cost("barrier", 0, p, a, b))

    def allreduce_value(self, value: float | int | bool, op: str = "sum") -> Any:
        """Reduce one Python scalar over the ranks (for control decisions, not tensors).

        ``op`` is ``sum``, ``avg``, ``max`` or ``min``; the result is identical on every rank.
        """
        if op not in _SCALAR_OPS:
            raise ValueError(f"op must be one of {sorted(_SCALAR_OPS)}, got {op!r}")
        result = self._timed("allreduce",
                             lambda: self.ctl.allreduce(value, op=_SCALAR_OPS[op]))
        return result / self.size if op == "avg" else result

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one small picklable object from every rank, in rank order."""
        return self._timed("allgather", lambda: self.ctl.allgather(obj),
                           lambda got: max(_pickled(o) for o in got))

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Gather one small picklable object from every rank on ``root`` (the list in rank
        order there, ``None`` elsewhere)."""
        return self._timed("allgather", lambda: self.ctl.gather(obj, root=root),
                           lambda got: max((_pickled(o) for o in got), default=8)
                           if got is not None else _pickled(obj))

    def scatter_object(self, objs: Sequence[Any] | None, root: int = 0) -> Any:
        """Send ``objs[r]`` from ``root`` to every rank ``r`` (``objs`` used on ``root``
        only); returns this rank's object."""
        return self._timed("allgather", lambda: self.ctl.scatter(objs, root=root), _pickled)

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast one small picklable object from ``root``."""
        return self._timed("bcast", lambda: self.ctl.bcast(obj, root=root), _pickled)

    def check_collective(self, name: str, **description: Any) -> None:
        """In checked mode, verify that every rank is making the same call.

        ``description`` holds what must agree (shape, dtype, op, root, k, ...). When the
        ranks disagree, every rank raises the same ``ValueError`` naming the first
        mismatching field and the ranks involved. Does nothing outside checked mode.
        """
        self.agree(name, None, **description)

    def agree(self, name: str, error: Exception | None, **description: Any) -> None:
        """Raise a local argument ``error`` (if any) so that no rank is left hanging.

        In checked mode the ranks exchange their local verdicts together with
        ``description`` in one small allgather on the control communicator: an error on
        any rank raises the same exception type on *every* rank (the rank that found it
        re-raises its own; the others name that rank), and otherwise the descriptions
        are compared as in :meth:`check_collective`. Outside checked mode a local error
        is raised on its own rank only: a disagreement cannot be detected without
        communicating, and the abort handler ends the job.
        """
        if not self.check or self.size == 1:
            if error is not None:
                raise error
            return
        verdict = None if error is None else (type(error).__name__, str(error))
        everyone = self.allgather_object((verdict, name, tuple(description.items())))
        for rank, (theirs, _, _) in enumerate(everyone):
            if theirs is None:
                continue
            if error is not None:
                raise error
            kind = _ARGUMENT_ERRORS.get(theirs[0], ValueError)
            raise kind(f"{name}: rank {rank} rejected its arguments: {theirs[1]}")
        problem = describe_mismatch([(n, d) for _, n, d in everyone])
        if problem is not None:
            raise ValueError(f"mpicomm checked mode: {problem}")

    @contextlib.contextmanager
    def validating(self, name: str) -> Iterator[dict[str, Any]]:
        """Run a collective's argument checks so that a failure cannot hang other ranks.

        The body validates its arguments and fills the yielded dict with what must agree
        across ranks; on leaving, :meth:`agree` runs with the body's ``ValueError`` or
        ``TypeError`` (if any) and that description::

            with comm.validating("allreduce") as desc:
                op = check_op(op)
                desc.update(shape=shape, dtype=dtype, op=op)
        """
        description: dict[str, Any] = {}
        try:
            yield description
        except (ValueError, TypeError) as exc:
            self.agree(name, exc, **description)
            raise
        self.agree(name, None, **description)

    def abort(self, message: str = "", code: int = 1, *, job: str | None = None) -> None:
        """Print ``message`` with this rank's id (and job) and end the whole MPI job.

        ``job`` (default: this communicator's :attr:`job`, else the thread's
        :func:`job_scope`) is named in the message: ``MPI_Abort`` ends every job sharing
        the world, and the message must say which one failed.
        """
        abort_job(message, code, job=job if job is not None else self.job)

    def free(self) -> None:
        """Release the duplicates this object made (collective), and the wrapped
        communicator when this object owns it (made by :meth:`dup` or :meth:`split`).
        The per-communicator caches (:attr:`resources`, e.g. pinned staging buffers) are
        dropped too, after freeing those that hold MPI objects (a ``free()`` method)."""
        held = list(self.resources.values())
        self.resources.clear()
        if self._freed or MPI.Is_finalized():
            return
        for resource in held:
            release = getattr(resource, "free", None)
            if callable(release):
                release()
        self._freed = True
        owned = [self.p2p, self.ctl, self.local_mpi] + ([self.mpi] if self._owns else [])
        for c in owned:
            c.Free()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


def _pickled(obj: Any) -> int:
    """Bytes of ``obj`` pickled (what the virtual clock charges a control message)."""
    import pickle

    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return 64


def wait_all(requests: Sequence[MPI.Request], poll_s: float | None = None) -> None:
    """Complete every MPI request of ``requests``.

    ``poll_s=None``: ``MPI_Waitall``, the fastest way for the caller, but MPI libraries
    spin on a core meanwhile (shared-memory and TCP progress engines alike). Seconds:
    ``MPI_Testall`` at once, then after sleeps that start at ``poll_s / 16`` and double
    up to ``poll_s``, until all are done: the thread sleeps (holding no core and no GIL;
    mpi4py releases it in MPI calls) while the data are on the wire. A short wait costs
    a few extra wake-ups, a long one one per ``poll_s``; the extra latency is at most
    about one sleep. MPI makes progress only inside the tests (MPICH's default), so keep
    ``poll_s`` below the time the transport's socket buffers take to drain (128 KiB:
    about 1 ms at 1 Gbit/s). Each wake-up also costs a computing thread of the same
    process some time (a GIL hand-off, a context switch): in a measurement here a torch
    compute thread used 13% more CPU next to a waiter polling every 1 ms, 25% every
    0.2 ms and 32% every 0.05 ms; a spinning waiter instead takes a whole core.
    """
    if not requests:
        return
    if poll_s is None:
        MPI.Request.Waitall(requests)
        return
    poll_until(lambda: MPI.Request.Testall(requests), poll_s)


def poll_until(test: Callable[[], Any], poll_s: float) -> Any:
    """Call ``test()`` until it returns something other than ``None``/``False`` and
    return that, sleeping ``poll_s / 16`` after the first failed call, doubling up to
    ``poll_s`` (the backoff of :func:`wait_all`; also the sparse layer's probe loop)."""
    sleep = poll_s / 16
    while (result := test()) is None or result is False:
        time.sleep(sleep)
        sleep = min(2 * sleep, poll_s)
    return result


def describe_mismatch(calls: Sequence[tuple[str, tuple[tuple[str, Any], ...]]]) -> str | None:
    """Explain the first difference between the per-rank call descriptions, or ``None``.

    Fields are compared in the order the call described them (its arguments before what
    follows from them: a shape mismatch is named rather than the different algorithm
    ``auto`` picked for each shape)."""
    ref_name, ref_fields = calls[0]
    for rank, (name, fields) in enumerate(calls):
        if name != ref_name:
            return f"rank 0 calls {ref_name} but rank {rank} calls {name}"
        ref, other = dict(ref_fields), dict(fields)
        if ref == other:
            continue
        for key in [*ref, *(k for k in other if k not in ref)]:
            if ref.get(key) != other.get(key):
                return (
                    f"ranks disagree on {name}: {key} is {ref.get(key)!r} on rank 0 "
                    f"but {other.get(key)!r} on rank {rank}"
                )
    return None


# ---------------------------------------------------------------------- logging
def configure_logging(level: str | None = None) -> None:
    """Set the ``mpicomm`` logger's level from ``level`` or ``MPICOMM_LOG_LEVEL``.

    When a level is set and the logger has no handler yet, one writing to stderr with a
    ``[rank r]`` prefix is added (applications that configure logging themselves keep
    their handlers). Unset: the logger is left alone (Python's default: warnings only).
    """
    name = level if level is not None else os.environ.get("MPICOMM_LOG_LEVEL")
    if not name:
        return
    value = logging.getLevelName(name.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"MPICOMM_LOG_LEVEL={name!r}: expected DEBUG, INFO, WARNING, "
                         "ERROR or CRITICAL")
    log.setLevel(value)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            f"[rank {MPI.COMM_WORLD.Get_rank()}] %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


# ---------------------------------------------------------------------- the world
_world: Communicator | None = None
_world_lock = threading.Lock()


def world() -> Communicator:
    """The communicator over ``MPI.COMM_WORLD`` used when a call gets ``comm=None``.

    Collective the first time. Created here rather than by :func:`init` (a collective
    called without ``init``), it sets up what ``init`` does by default: the abort handler
    (``MPICOMM_ABORT_ON_ERROR``) and logging (``MPICOMM_LOG_LEVEL``)."""
    if _world is None:
        install_from_env()
        configure_logging()
    return _open_world()


def _open_world() -> Communicator:
    global _world
    with _world_lock:
        if _world is None:
            clock.start()   # the virtual clock, if MPICOMM_CLOCK=virtual (collective)
            _world = Communicator(MPI.COMM_WORLD)
            # a rank killed by a signal then leaves no segment behind (collective)
            drop_mpi_shared_memory_names(MPI.COMM_WORLD)
        return _world


def init(
    mpi_comm: MPI.Intracomm | None = None,
    *,
    check: bool | None = None,
    abort_on_error: bool | None = None,
) -> Communicator:
    """Start using mpicomm on this rank and return a :class:`Communicator`.

    With no ``mpi_comm`` this returns the world communicator, which is also what every
    collective uses when given ``comm=None``; ``check=True`` turns checked mode on for it.
    With an mpi4py communicator it returns a new ``Communicator`` wrapping that one.
    ``abort_on_error`` (default ``MPICOMM_ABORT_ON_ERROR``, on) installs
    :func:`install_abort_handler` (``False`` removes it: importing mpicomm in a job of
    several ranks installs it). Collective over the ranks of the communicator.
    """
    install_from_env(abort_on_error)
    configure_logging()
    if mpi_comm is None:
        comm = _open_world()
        _run_init_hooks(comm, world=True, check=comm.check if check is None else bool(check))
        if check is not None:
            comm.check = bool(check)
        return comm
    comm = Communicator(mpi_comm, check=check)
    _run_init_hooks(comm, world=False, check=comm.check)
    return comm


#: Functions :func:`init` calls after making its communicator (see :func:`on_init`).
_init_hooks: list[Callable[..., None]] = []


def on_init(hook: Callable[..., None]) -> None:
    """Have :func:`init` call ``hook(comm, world=..., check=...)`` (idempotent).

    ``comm`` is the communicator ``init`` returns, ``world`` whether it is the world
    communicator (hooks that communicate over the world run only then, when every rank
    is known to call), ``check`` whether checked mode is requested. This is how layers
    above the core start from the environment (:mod:`mpicomm.observe` starts
    ``MPICOMM_TIMELINE`` and ``MPICOMM_STALL_S``) without the core importing them.
    """
    if hook not in _init_hooks:
        _init_hooks.append(hook)


def _run_init_hooks(comm: Communicator, *, world: bool, check: bool) -> None:
    for hook in tuple(_init_hooks):
        hook(comm, world=world, check=check)


def resolve(comm: Communicator | MPI.Intracomm | None) -> Communicator:
    """Turn a ``comm=`` argument into a :class:`Communicator` (``None`` -> the world).

    A raw mpi4py communicator is refused with a ``TypeError``: wrapping is collective, so
    it is done once, explicitly, with :func:`init`.
    """
    if comm is None:
        return world()
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Intracomm):
        raise TypeError(
            "pass an mpicomm.Communicator (mpicomm.init(mpi_comm) wraps an mpi4py "
            "communicator once; wrapping on every call would be collective and slow)"
        )
    raise TypeError(f"comm must be an mpicomm.Communicator or None, got {type(comm).__name__}")
