r"""The compute cost table of the virtual clock: what each kind of local work costs.

Under the virtual clock (:mod:`mpicomm.clock`) compute never advances a rank's time by
itself (on a machine with more ranks than cores even a thread's CPU time depends on the
load). Each compute site charges its work instead::

    mpicomm.clock.charge("reduce", nbytes)     # a collective's elementwise reduction
    mpicomm.clock.charge("select", numel)      # a top-k selection over numel elements
    mpicomm.clock.charge("step")               # one forward/backward of the model

and the cost comes from this table: ``per_call + per_unit * units`` seconds. An entry is
either **measured** by :func:`calibrate` or **declared** by the caller
(:meth:`CostTable.declare`, e.g. a GPU's step time from a published profile).

Calibration: the ranks take turns, one computing at a time while the others sleep in a
non-spinning barrier; each times every kernel with its thread's CPU time
(``time.thread_time``; torch limited to one thread meanwhile) at two sizes. A timed
sample is a batch of calls lasting at least 2 ms of CPU time (so short kernels are not
lost in the timer's overhead), and a size's cost is the *minimum* over ``repeats``
samples: other processes only ever add to a sample (preemptions refill caches, memory
bandwidth is shared), so the least-disturbed sample is the stable one. The two sizes
give ``per_unit`` (the slope) and ``per_call`` (the rest at the small size), exact at
both, from the minimum over every sample of every rank that measured (samples are
taken round-robin over the kernels, so each kernel's are spread over the whole pass).
Every rank gets the same table. Costs are therefore single-core CPU seconds of this
machine. Cost: ``ranks x kernels x 2 sizes x repeats`` samples of >= 2 ms (a few
seconds per rank for the standard set).

Kernels: a compute site's layer registers the kernel that measures its work with
:func:`register_kernel` when it is imported (the core registers ``reduce`` and
``copy``); ``python -m mpicomm.bench costs --json FILE`` imports every layer, measures
them all and writes the table, which ``MPICOMM_VIRTUAL_COSTS=FILE`` then reuses in any
later run, so that every method of a comparison is charged the same.

File format (JSON; format 1, without ``select:kept``, is read too: see
:data:`LATER_OPS`)::

    {"format": "mpicomm-cost-table/2",
     "ops": {"reduce": {"per_call": 2.1e-06, "per_unit": 1.9e-10, "unit": "byte",
                        "source": "measured"},
             "step":   {"per_call": 0.0123, "per_unit": 0.0, "unit": "call",
                        "source": "declared"}},
     "info": {"timer": "thread_time", "repeats": 5, "ranks": 8, "machine": {...}}}
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mpi4py import MPI

__all__ = ["OpCost", "CostTable", "Kernel", "register_kernel", "kernels", "calibrate",
           "measure_calls", "cpu_seconds", "REPEATS",
           "FORMAT", "ENV_COSTS", "load_from_env"]

FORMAT = "mpicomm-cost-table/2"
#: Formats :meth:`CostTable.from_json` reads (format 2 added ``select:kept``).
FORMATS = ("mpicomm-cost-table/1", FORMAT)
#: Ops a table made before they existed may lack: such a table charges them nothing (as
#: it did when it was made), and the run records them with ``source="absent"``.
LATER_OPS = {"select:kept": "kept element", "sort": "element", "encode:log8": "pair",
             "decode:log8": "pair"}
ENV_COSTS = "MPICOMM_VIRTUAL_COSTS"
#: Longest sleep of a rank waiting for its turn (it must not take the CPU from the rank
#: that measures).
TURN_POLL_S = 1e-3
#: Timed samples per kernel and size (see :func:`cpu_seconds`).
REPEATS = 7


@dataclass(frozen=True)
class OpCost:
    """``per_call + per_unit * units`` seconds; ``unit`` names what is counted."""

    per_call: float
    per_unit: float
    unit: str = "element"
    source: str = "measured"

    def __post_init__(self) -> None:
        for name in ("per_call", "per_unit"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"cost {name} must be a finite number >= 0, got {value!r}")

    def seconds(self, units: float) -> float:
        return self.per_call + self.per_unit * units


@dataclass
class CostTable:
    """Seconds per operation (see the module docstring)."""

    ops: dict[str, OpCost] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def cost(self, op: str, units: float = 1.0) -> float:
        entry = self.ops.get(op)
        if entry is None and op in LATER_OPS:
            entry = self.ops.setdefault(op, OpCost(0.0, 0.0, LATER_OPS[op], "absent"))
        if entry is None:
            raise KeyError(
                f"virtual clock: the cost table has no entry for {op!r}. Measure it "
                f"(mpicomm.clock.calibrate() on every rank, or `python -m mpicomm.bench "
                f"costs --json FILE` and {ENV_COSTS}=FILE) or declare it "
                f"(mpicomm.clock.declare({op!r}, seconds))")
        return entry.per_call + entry.per_unit * units

    def declare(self, op: str, per_unit: float, per_call: float = 0.0,
                unit: str = "call") -> None:
        """Set ``op``'s cost by hand (``source="declared"``)."""
        self.ops[op] = OpCost(float(per_call), float(per_unit), unit, "declared")

    def update(self, other: CostTable) -> None:
        self.ops.update(other.ops)
        self.info.update(other.info)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "ops": {k: asdict(v) for k, v in sorted(self.ops.items())},
                "info": self.info}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "cost table") -> CostTable:
        if not isinstance(data, Mapping) or data.get("format") not in FORMATS:
            raise ValueError(f"{source}: not a cost table (expected \"format\": one of "
                             f"{', '.join(FORMATS)})")
        ops = {}
        for name, entry in dict(data.get("ops", {})).items():
            try:
                ops[str(name)] = OpCost(float(entry["per_call"]), float(entry["per_unit"]),
                                        str(entry.get("unit", "element")),
                                        str(entry.get("source", "measured")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{source}: bad entry {name!r}: {exc}") from None
        return cls(ops, dict(data.get("info", {})))

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> CostTable:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ValueError(f"{ENV_COSTS}: cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV_COSTS}: {path} is not JSON: {exc}") from None
        return cls.from_json(data, path)


def load_from_env(env: Mapping[str, str] | None = None) -> CostTable | None:
    """The table named by ``MPICOMM_VIRTUAL_COSTS``, or None when it is unset."""
    path = (os.environ if env is None else env).get(ENV_COSTS, "").strip()
    return CostTable.load(path) if path else None


@dataclass(frozen=True)
class Kernel:
    """How to measure one operation: ``make(n)`` prepares inputs of ``n`` units and
    returns the zero-argument call to time; ``sizes`` are the two sizes of the fit."""

    make: Callable[[int], Callable[[], Any]]
    unit: str
    sizes: tuple[int, int] = (1 << 12, 1 << 20)
    intercept: bool = True


_KERNELS: dict[str, Kernel] = {}


def register_kernel(op: str, make: Callable[[int], Callable[[], Any]], unit: str,
                    sizes: tuple[int, int] = (1 << 12, 1 << 20),
                    intercept: bool = True) -> None:
    """Make :func:`calibrate` measure ``op`` (called by the layer that charges it).
    ``intercept=False``: only the slope is ``op``'s (``per_call`` 0), for a cost that
    adds to another op's call (``make(m)`` then times that call with ``m`` more units)."""
    if not (isinstance(sizes, tuple) and len(sizes) == 2 and 0 < sizes[0] < sizes[1]):
        raise ValueError(f"sizes must be two increasing positive sizes, got {sizes!r}")
    _KERNELS[op] = Kernel(make, unit, sizes, bool(intercept))


def kernels() -> dict[str, Kernel]:
    """The registered kernels (op name -> :class:`Kernel`)."""
    return dict(_KERNELS)


def _core_kernels() -> None:
    import numpy as np

    def add(n: int) -> Callable[[], Any]:
        a = np.ones(n // 4, dtype=np.float32)
        b = np.ones(n // 4, dtype=np.float32)
        return lambda: np.add(a, b, out=a)

    def copy(n: int) -> Callable[[], Any]:
        a = np.ones(n // 4, dtype=np.float32)
        b = np.empty_like(a)
        return lambda: np.copyto(b, a)

    register_kernel("reduce", add, "byte", (1 << 14, 1 << 22))
    register_kernel("copy", copy, "byte", (1 << 14, 1 << 22))


_core_kernels()


#: CPU time one timed sample lasts at least: a short kernel runs in a batch of calls, so
#: the timer's resolution and the per-sample overhead stay well below 1% of a sample.
SAMPLE_S = 2e-3
#: Most calls in one batch (a kernel of a few hundred nanoseconds).
MAX_BATCH = 2000


class _Sampler:
    """One timed call site: ``sample()`` runs a batch of calls lasting at least
    :data:`SAMPLE_S` of this thread's CPU time and keeps the least seconds per call."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        fn()                                    # warm up: allocations, caches, imports
        start = time.thread_time()
        fn()
        once = time.thread_time() - start
        self.fn, self.best = fn, math.inf
        self.batch = max(1, min(MAX_BATCH, math.ceil(SAMPLE_S / max(once, 1e-7))))

    def sample(self) -> None:
        fn, start = self.fn, time.thread_time()
        for _ in range(self.batch):
            fn()
        self.best = min(self.best, (time.thread_time() - start) / self.batch)


def cpu_seconds(calls: Mapping[Any, Callable[[], Any]], repeats: int) -> dict[Any, float]:
    """This thread's CPU seconds per call of each of ``calls``: the minimum over
    ``repeats`` samples, each a batch of calls lasting at least :data:`SAMPLE_S`, taken
    round-robin over the calls (after one warm-up call each).

    The minimum, not the median: what else runs on the machine only ever adds to a
    sample (a preemption's cache and TLB refill, memory bandwidth taken by others), so
    the least-disturbed sample is the one closest to the call's own cost. Round-robin
    spreads each call's samples over the whole measurement, so a burst of someone else's
    work spoils a few samples of every call rather than all samples of one. With torch
    imported it runs on one thread meanwhile."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(1)
    try:
        samplers = {key: _Sampler(fn) for key, fn in calls.items()}
        for _ in range(repeats):
            for sampler in samplers.values():
                sampler.sample()
        return {key: sampler.best for key, sampler in samplers.items()}
    finally:
        if torch is not None and threads is not None:
            torch.set_num_threads(threads)


def _two_point(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """``(per_call, per_unit)`` through ``(n1, t1)`` and ``(n2, t2)``, clamped at 0."""
    per_unit = max(0.0, (t2 - t1) / (n2 - n1))
    return max(0.0, t1 - per_unit * n1), per_unit


def _quiet_barrier(mpi_comm: MPI.Comm) -> None:
    request = mpi_comm.Ibarrier()
    sleep = TURN_POLL_S / 16
    while not request.Test():
        time.sleep(sleep)
        sleep = min(2 * sleep, TURN_POLL_S)


def calibrate(mpi_comm: MPI.Comm | None = None, ops: list[str] | None = None,
              repeats: int = REPEATS, turns: int | None = None) -> CostTable:
    """Measure the registered kernels (``ops``: a subset) with the ranks of ``mpi_comm``
    (an mpi4py communicator, default the world) taking turns; collective, and every rank
    gets the same table (see the module docstring). ``turns``: how many ranks (the
    first ones) measure, default all (the minimum over more samples is steadier; each
    turn adds its measuring time)."""
    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    names = sorted(_KERNELS) if ops is None else list(ops)
    unknown = [n for n in names if n not in _KERNELS]
    if unknown:
        raise ValueError(f"no kernel registered for {unknown}; registered: {sorted(_KERNELS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    chosen = {n: _KERNELS[n] for n in names}

    def local() -> dict[tuple[str, int], float]:
        return cpu_seconds({(op, n): k.make(n) for op, k in chosen.items()
                            for n in k.sizes}, repeats)

    best = _by_turns(mpi_comm, turns, local)
    table = _table(mpi_comm, turns, repeats)
    for op, k in chosen.items():
        (n1, n2) = k.sizes
        per_call, per_unit = _two_point(n1, best[op, n1], n2, best[op, n2])
        table.ops[op] = OpCost(per_call if k.intercept else 0.0, per_unit, k.unit,
                               "measured")
    return table


def measure_calls(calls: Mapping[str, Callable[[], Any]], mpi_comm: MPI.Comm | None = None,
                  repeats: int = REPEATS, turns: int | None = None) -> CostTable:
    """Like :func:`calibrate` for whole operations: each of ``calls`` (a zero-argument
    callable, e.g. a model's forward) is timed as it is, ``per_call`` seconds, unit
    ``call``. Collective; the same table on every rank."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    best = _by_turns(mpi_comm, turns, lambda: cpu_seconds(calls, repeats))
    table = _table(mpi_comm, turns, repeats)
    for op in calls:
        table.ops[op] = OpCost(best[op], 0.0, "call", "measured")
    return table


def _by_turns(mpi_comm: MPI.Comm, turns: int | None,
              local: Callable[[], dict[Any, float]]) -> dict[Any, float]:
    """The first ``turns`` ranks run ``local()`` one after another (the others asleep);
    per key, the minimum over them (every rank gets the same)."""
    size = mpi_comm.Get_size()
    turns = size if turns is None else max(1, min(int(turns), size))
    mine: dict[Any, float] | None = None
    for turn in range(turns):
        if turn == mpi_comm.Get_rank():
            mine = local()
        _quiet_barrier(mpi_comm)
    everyone = [r for r in mpi_comm.allgather(mine) if r is not None]
    return {key: min(r[key] for r in everyone) for key in everyone[0]}


def _table(mpi_comm: MPI.Comm, turns: int | None, repeats: int) -> CostTable:
    size = mpi_comm.Get_size()
    return CostTable(info={
        "timer": "thread_time", "statistic": "min", "sample_s": SAMPLE_S,
        "repeats": repeats, "ranks": size if turns is None else max(1, min(int(turns), size)),
        "machine": {"node": platform.node(), "processor": platform.processor(),
                    "cpus": os.cpu_count()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })
