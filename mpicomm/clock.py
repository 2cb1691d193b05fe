r"""One clock for every timing in mpicomm: the wall clock, or a virtual network's time.

:func:`now` is what the selector, calibration, AdaComm, Crossover, the parameter server,
the metrics and the benchmarks read. Two modes, chosen by ``MPICOMM_CLOCK``:

``wall`` (default)
    ``time.perf_counter()``.
``virtual``
    Every rank (every thread with its own clock: a communication thread, a server loop)
    keeps a virtual time that only two things advance:

    * **messages**: every point-to-point message mpicomm sends carries its virtual send
      time; a receive completes at the later of the receiver's time and the message's
      arrival in the network model of :mod:`mpicomm.emulate.vnet` (per-host upload and
      download links as serial resources, one-way latency, shared memory within a
      host, a schedule of changes), resolved in virtual-time order across processes by
      :mod:`mpicomm.emulate.vengine`. A send completes when its message has left the
      upload link. MPI's own collectives (``algorithm="mpi"``, the communicator's
      ``barrier``/``allreduce_value``/``bcast_object``/``allgather_object``) are
      synchronising: everyone leaves at the latest entry time plus a documented model
      cost (:mod:`mpicomm.vwire`).
    * **compute**, charged from a cost table (:mod:`mpicomm.costtable`) at the compute
      sites (:func:`charge`) or declared (:func:`compute`). Time spent running Python,
      waiting in MPI or sleeping counts for nothing, so virtual times are the same
      whatever the machine's load and whatever order the OS runs the ranks in.

    ``mpiexec -n P python script.py`` with ``MPICOMM_CLOCK=virtual`` and the platform
    variables (``MPICOMM_VIRTUAL_RATE``, ``MPICOMM_VIRTUAL_DELAY``,
    ``MPICOMM_VIRTUAL_RANKS_PER_HOST`` or ``MPICOMM_HOST_SIZES``,
    ``MPICOMM_VIRTUAL_SCHEDULE``; :func:`mpicomm.emulate.vnet.platform_from_env`) is a
    virtual cluster of ``P/R`` hosts; ``launchers/emulated-cluster --clock virtual``
    sets them from its own options. The clock starts when the world communicator is
    created (:func:`mpicomm.init` or the first collective, collective; a bad platform
    raises one ``ValueError`` on every rank there); its origin is 0. Before that,
    :func:`now` reads the origin plus what :func:`compute` declared, and the clock
    starts from there (so ``t0 = now()`` may come first); what :func:`charge` charged
    before the start is priced from the table when the clock starts (the table exists
    only from then on) and added to the start as well.

    Measuring is not working: while :func:`calibrate` or :func:`calibrate_calls` (or
    the start's own measurement) times its kernels, their charges and declared compute
    count for nothing on the measuring thread.

Threads: a thread other than the one that started the clock gets its own virtual time,
starting at the main thread's; work handed over through :class:`Queue` carries the
giver's time (the taker continues from the later of both), and a thread that waits for
another one's result joins that result's time (:func:`join`). So overlap of
communication with compute is measured, not assumed.

Compute costs (tuning): the standard sites charge ``reduce``/``copy`` per byte,
``select``/``scatter`` per element, ``merge`` per pair and ``compress:NAME`` /
``decompress:NAME`` per element; a training loop charges ``step`` (declare it from a
measurement or a published profile). Measure a table once
(``python -m mpicomm.bench costs --json FILE``) and reuse it with
``MPICOMM_VIRTUAL_COSTS=FILE`` so that every run of a comparison is charged alike.
Without one, the core ops are measured when the clock starts.
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mpi4py import MPI

from . import costtable
from .costtable import CostTable
from .emulate import linkdelay, vengine
from .emulate.vnet import ENV_STALL_S, Platform, platform_from_env, stall_seconds_from_env

__all__ = ["now", "mode", "is_virtual", "charge", "compute", "sleep", "declare", "stamp",
           "join", "calibrate", "calibrate_calls", "cost_table", "platform", "describe",
           "report_step", "Queue", "Handoff", "waiting_for_threads", "start_thread", "start",
           "started", "session", "reset_mode", "ENV_CLOCK", "MODES"]

ENV_CLOCK = "MPICOMM_CLOCK"
MODES = ("wall", "virtual")


def _mode_from_env() -> str:
    value = os.environ.get(ENV_CLOCK, "").strip().lower() or "wall"
    if value not in MODES:
        raise ValueError(f"{ENV_CLOCK}={value!r}: expected 'wall' or 'virtual'")
    return value


class _Actor:
    """A thread's virtual time (published to the engine's table)."""

    __slots__ = ("aid", "t", "step", "engine", "gap", "owner", "__weakref__")

    def __init__(self, engine: vengine.Engine, aid: int, t: float,
                 owner: _Virtual | None = None):
        self.engine, self.aid, self.t, self.step = engine, aid, t, -1
        self.owner = owner       # returns the actor's slot when the thread ends
        from .emulate.vnet import GapLink

        self.gap = GapLink()     # this actor's own download link (one-rank hosts)

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.t += seconds
            self.engine.set_clock(self.aid, self.t)

    def to(self, t: float) -> None:
        if t > self.t:
            self.t = t
            self.engine.set_clock(self.aid, t)

    def close(self) -> None:
        """The thread has ended: the actor stops counting and its slot is free (once)."""
        owner, self.owner = self.owner, None
        if owner is None:
            return
        with contextlib.suppress(Exception):
            if _virtual is owner:
                self.engine.close_actor(self.aid)
                with owner.lock:
                    owner.free.append(self.aid % self.engine.T)

    def __del__(self) -> None:   # the thread ended (or the process exits)
        self.close()


class _Virtual:
    """Process-wide state of the virtual clock."""

    def __init__(self, platform_: Platform, engine: vengine.Engine, rank: int,
                 table: CostTable):
        self.platform, self.engine, self.rank, self.table = platform_, engine, rank, table
        self.local = threading.local()
        self.lock = threading.Lock()
        self.free = list(range(1, engine.T))   # actor slots of this rank's threads
        self.main: _Actor | None = None
        self.step = -1                   # the training step reported (report_step)
        #: no-progress limit in real seconds (MPICOMM_VIRTUAL_STALL_S; None: the default)
        self.stall_s: float | None = None

    def open(self, start_t: float) -> _Actor:
        """A new actor of this rank at ``start_t`` (the lowest free slot: the same slot
        whatever order the threads ran in)."""
        with self.lock:
            if not self.free:
                raise RuntimeError(f"virtual clock: more than {self.engine.T} threads of "
                                   f"rank {self.rank} keep their own virtual time")
            index = min(self.free)
            self.free.remove(index)
        aid = self.engine.open_actor(self.rank, index, start_t)
        a = _Actor(self.engine, aid, start_t, self)
        if self.step >= 0:      # a helper thread sends on the rank's current step
            a.step = self.step
            self.engine.set_step(aid, self.step)
        return a

    def actor(self) -> _Actor:
        a = getattr(self.local, "actor", None)
        if a is None:
            a = self.open(self.main.t if self.main is not None else 0.0)
            self.local.actor = a
        return a


_virtual: _Virtual | None = None
_mode: str | None = None
#: virtual seconds declared by :func:`compute` before the clock started (the process's
#: main thread starts from them)
_before_start = 0.0
#: ``(op, units)`` charged by :func:`charge` before the clock started: priced from the
#: table when it starts, and the main thread starts that much later
_charged_before_start: list[tuple[str, float]] = []
#: per thread: ``on`` while a cost measurement runs (:func:`_measuring`)
_measurement = threading.local()
_start_lock = threading.Lock()


def mode() -> str:
    """``"wall"`` or ``"virtual"`` (from ``MPICOMM_CLOCK``)."""
    global _mode
    if _mode is None:
        _mode = _mode_from_env()
    return _mode


def reset_mode() -> None:
    """Read ``MPICOMM_CLOCK`` again at the next :func:`mode` (before the clock starts;
    for launchers and command lines that set it in-process)."""
    global _mode
    if _virtual is not None:
        raise RuntimeError("the virtual clock already runs")
    _mode = None


def is_virtual() -> bool:
    return mode() == "virtual"


def started() -> bool:
    """Whether the virtual clock runs in this process (False in wall mode)."""
    return _virtual is not None


def now() -> float:
    """Seconds on this rank's (this thread's) clock: wall or virtual."""
    v = _virtual
    if v is None:
        return _before_start if mode() == "virtual" else time.perf_counter()
    return v.actor().t


def charge(op: str, units: float = 1.0) -> None:
    """Charge ``units`` of compute ``op`` from the cost table (no-op on the wall clock;
    before the virtual clock starts, priced when it starts and added to its start).

    Call it where the work is done, before doing it."""
    v = _virtual
    if (v is None and mode() != "virtual") or getattr(_measurement, "on", False):
        return
    if v is None:
        _charged_before_start.append((op, float(units)))
    else:
        v.actor().advance(v.table.cost(op, units))


def compute(seconds: float) -> None:
    """Charge ``seconds`` of compute declared by the caller (no-op on the wall clock;
    before the virtual clock starts, the time it starts from)."""
    global _before_start
    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    if getattr(_measurement, "on", False):
        return
    v = _virtual
    if v is not None:
        v.actor().advance(float(seconds))
    elif mode() == "virtual":
        _before_start += float(seconds)


@contextlib.contextmanager
def _measuring() -> Iterator[None]:
    """Within the block, this thread's :func:`charge` and :func:`compute` count for
    nothing: a cost table's kernels run there to be timed, not as the job's work."""
    outer = getattr(_measurement, "on", False)
    _measurement.on = True
    try:
        yield
    finally:
        _measurement.on = outer


def sleep(seconds: float) -> None:
    """Wait ``seconds``: ``time.sleep`` on the wall clock; on the virtual clock this
    thread's time moves on by ``seconds`` at once (an injected delay, an idle period)."""
    if _virtual is None:
        time.sleep(seconds)
    elif seconds > 0:
        _virtual.actor().advance(float(seconds))


def declare(op: str, seconds: float, per_call: float = 0.0, unit: str = "call") -> None:
    """Set ``op``'s cost by hand: ``per_call + seconds * units`` (e.g. ``"step"``)."""
    _table().declare(op, seconds, per_call, unit)


def stamp() -> float:
    """This thread's time, to hand over with a piece of work (0.0 on the wall clock)."""
    v = _virtual
    return 0.0 if v is None else v.actor().t


def join(t: float) -> None:
    """Continue from the later of this thread's time and ``t`` (a result's stamp)."""
    v = _virtual
    if v is not None:
        v.actor().to(float(t))


def report_step(step: int) -> None:
    """The training step this thread has reached, for ``step N`` schedule entries.

    Virtual clock: the step is the rank's, for every thread of it (the helper threads
    that send a gradient synchronization's messages included), and travels with every
    message sent from then on; the network conditions of a message are those of its
    sender's step. Wall clock: the emulated cluster's step file
    (:func:`mpicomm.emulate.linkdelay.report_step`; a no-op outside it)."""
    v = _virtual
    if v is None:
        linkdelay.report_step(step)
    else:
        step = int(step)
        if step != v.step:
            v.step = step
            T = v.engine.T
            for aid in range(v.rank * T, (v.rank + 1) * T):  # open or not: set alike
                v.engine.set_step(aid, step)
            for a in (getattr(v.local, "actor", None), v.main):
                if a is not None:
                    a.step = step


@contextlib.contextmanager
def waiting_for_threads() -> Iterator[None]:
    """Mark this thread as waiting for another thread of its rank (e.g. for a
    communication thread's result) while the block runs; then :func:`join` the result's
    stamp. Without it, a thread blocked outside mpicomm would hold back the virtual
    time of the threads it waits for."""
    v = _virtual
    if v is None:
        yield
        return
    a = v.actor()
    v.engine.set_state(a.aid, vengine.JOIN, a.t)
    try:
        yield
    finally:
        v.engine.set_state(a.aid, vengine.RUNNING, a.t)


def start_thread(target: Callable[[], None], name: str,
                 daemon: bool = True) -> threading.Thread:
    """Start a thread running ``target`` that keeps its own virtual time.

    Virtual clock: the thread's clock is opened here, in the calling thread, at the
    caller's time, so that it counts (as a floor on what it can still send) from this
    point of the caller's program on, whenever the operating system first runs it; a
    thread that opened its clock itself would do so at a moment that depends on the
    scheduler, and the virtual times would not repeat. Start every thread that sends
    through mpicomm or takes work from a :class:`Handoff` with it. Wall clock: a plain
    ``threading.Thread``."""
    v = _virtual
    if v is None:
        thread = threading.Thread(target=target, name=name, daemon=daemon)
        thread.start()
        return thread
    actor = v.open(v.actor().t)

    def run() -> None:
        v.local.actor = actor
        try:
            target()
        finally:
            actor.close()

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    try:
        thread.start()
    except BaseException:
        actor.close()
        raise
    return thread


class Handoff:
    """Work handed to one taker thread, each piece stamped with a virtual time.

    The giver calls :meth:`give` (the piece's time: the giver's, or an explicit later
    one); the taker waits for work inside :meth:`idle` (its floor is then the earliest
    time given and not yet taken, or the givers' time) and calls :meth:`take` with the
    piece's stamp, continuing from the later of its own time and the stamp. On the wall
    clock every method is (almost) free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stamps: list[float] = []
        self._taker: int | None = None

    def _publish(self) -> None:
        v = _virtual
        if v is not None and self._taker is not None:
            v.engine.set_qmin(self._taker, self._stamps[0] if self._stamps else vengine.INF)

    def give(self, t: float | None = None) -> float:
        """Hand over one piece of work at ``t`` (default: this thread's time)."""
        t = stamp() if t is None else float(t)
        if _virtual is not None:
            with self._lock:
                heapq.heappush(self._stamps, t)
                self._publish()
        return t

    def take(self, t: float) -> None:
        """The taker starts the piece given at ``t``."""
        if _virtual is None:
            return
        with self._lock:
            with contextlib.suppress(ValueError):
                self._stamps.remove(t)
                heapq.heapify(self._stamps)
            self._publish()
        join(t)

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """The taker blocks waiting for work during the block."""
        v = _virtual
        if v is None:
            yield
            return
        a = v.actor()
        with self._lock:
            self._taker = a.aid
            qmin = self._stamps[0] if self._stamps else vengine.INF
        v.engine.set_state(a.aid, vengine.IDLE, a.t, qmin=qmin)
        try:
            yield
        finally:
            v.engine.set_state(a.aid, vengine.RUNNING, a.t)


class Queue(queue.Queue):
    """A ``queue.Queue`` that carries virtual time (a :class:`Handoff` per queue):
    :meth:`put` stamps an item with the giver's time, :meth:`get` waits idle and
    continues from the later of its own time and the item's. On the wall clock it is a
    plain queue."""

    def __init__(self, maxsize: int = 0):
        super().__init__(maxsize)
        self.handoff = Handoff()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put((self.handoff.give(), item), block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        with self.handoff.idle():
            t, item = super().get(block, timeout)
        self.handoff.take(t)
        return item


# ---------------------------------------------------------------------- set-up
def _table() -> CostTable:
    v = _virtual
    if v is None:
        raise RuntimeError("the cost table belongs to the virtual clock "
                           f"({ENV_CLOCK}=virtual, started by mpicomm.init())")
    return v.table


def cost_table() -> CostTable | None:
    """The virtual clock's cost table (None on the wall clock)."""
    return None if _virtual is None else _virtual.table


def platform() -> Platform | None:
    """The virtual platform (None on the wall clock)."""
    return None if _virtual is None else _virtual.platform


def describe() -> dict[str, Any]:
    """What a result should record about its clock: the mode, and in virtual mode the
    platform and the cost table."""
    v = _virtual
    if v is None:
        return {"mode": mode()}
    return {"mode": "virtual", "platform": v.platform.describe(),
            "costs": v.table.to_json()}


def calibrate(ops: list[str] | None = None, repeats: int = costtable.REPEATS,
              mpi_comm: MPI.Comm | None = None, turns: int | None = None) -> CostTable:
    """Measure the registered compute kernels (:func:`mpicomm.costtable.calibrate`,
    ranks taking turns) into the clock's table; collective over ``mpi_comm`` (default
    the world). Measures and returns a table on the wall clock too. The kernels' own
    charges count for nothing (measuring is not the job's work)."""
    with _measuring():
        measured = costtable.calibrate(mpi_comm, ops, repeats, turns)
    if _virtual is not None:
        _virtual.table.update(measured)
    return measured


def calibrate_calls(calls: dict[str, Any], repeats: int = costtable.REPEATS,
                    mpi_comm: MPI.Comm | None = None, turns: int | None = None) -> CostTable:
    """Measure whole operations (``{"step": fn, ...}``, zero-argument callables; ranks
    taking turns, :func:`mpicomm.costtable.measure_calls`) into the clock's table, each
    then charged per call (``charge("step")``). Collective over ``mpi_comm``; what the
    calls charge while they are timed counts for nothing."""
    with _measuring():
        measured = costtable.measure_calls(calls, mpi_comm, repeats, turns)
    if _virtual is not None:
        _virtual.table.update(measured)
    return measured


def start(mpi_comm: MPI.Intracomm | None = None) -> None:
    """Start the virtual clock (collective over the world; idempotent; nothing on the
    wall clock). Called when the world communicator is created."""
    if mode() != "virtual" or _virtual is not None:
        return
    with _start_lock:
        if _virtual is None:
            world = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
            _begin(world, platform_from_env(world.Get_size()), costtable.load_from_env(),
                   _stall_from_env())
            atexit.register(_stop)


def _stall_from_env() -> float | None:
    """``MPICOMM_VIRTUAL_STALL_S`` (validated), or None when unset (then
    :data:`mpicomm.vwire.STALL_S` applies)."""
    return stall_seconds_from_env() if os.environ.get(ENV_STALL_S, "").strip() else None


def _begin(world: MPI.Intracomm, plat: Platform, table: CostTable | None,
           stall_s: float | None) -> None:
    global _virtual, _before_start
    if world.Get_size() != MPI.COMM_WORLD.Get_size():
        raise RuntimeError("virtual clock: start it on the world communicator")
    rank = world.Get_rank()
    path = vengine.Engine.new_path() if rank == 0 else None
    engine = vengine.Engine(path, plat, create=True) if rank == 0 else None
    path = world.bcast(path, root=0)
    if engine is None:
        engine = vengine.Engine(path, plat, create=False)
    origin, _before_start = _before_start, 0.0
    engine.open_actor(rank, 0, origin)
    world.Barrier()
    if rank == 0:
        os.unlink(path)
    if table is None:       # one rank measures, the others sleep (a few seconds)
        with _measuring():
            table = costtable.calibrate(world, sorted(costtable.kernels()), turns=1)
        table.info["source"] = "measured at start"
    try:
        charged = sum(table.cost(op, units) for op, units in _charged_before_start)
    except KeyError as exc:
        raise ValueError(f"{exc.args[0]} (it was charged before the clock started: "
                         "declare it after mpicomm.init(), then charge it)") from None
    finally:
        _charged_before_start.clear()
    v = _Virtual(plat, engine, rank, table)
    v.stall_s = stall_s
    main = _Actor(engine, rank * engine.T, origin)
    v.main = main
    v.local.actor = main
    _virtual = v
    if charged > 0:
        main.advance(charged)


@contextlib.contextmanager
def session(plat: Platform, table: CostTable,
            mpi_comm: MPI.Intracomm | None = None) -> Iterator[None]:
    """Run the block under a virtual clock on ``plat`` with ``table`` whatever
    ``MPICOMM_CLOCK`` says (collective over the world, from the thread that runs
    mpicomm; for tests and for benchmarks that compare both clocks in one job).
    Communicators created inside the block are timed; the clock then stops."""
    global _virtual, _mode
    world = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    if _virtual is not None:
        raise RuntimeError("a virtual clock already runs in this process")
    saved = _mode
    stall_s = _stall_from_env()
    with _start_lock:
        _begin(world, plat, table, stall_s)
        _mode = "virtual"
    try:
        yield
    finally:
        v = _virtual
        _stop()
        world.Barrier()
        with _start_lock:
            _virtual, _mode = None, saved
        if v is not None:
            v.local = threading.local()
            v.engine.close()


def _stop() -> None:
    """Mark this process's actors done (others stop waiting for them)."""
    v = _virtual
    if v is None:
        return
    with contextlib.suppress(Exception):
        for aid in range(v.rank * v.engine.T, (v.rank + 1) * v.engine.T):
            v.engine.close_actor(aid)
