"""Shared helpers for the benchmark suites: timing, tables, JSON."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from .. import clock
from ..comm import Communicator


class UsageError(ValueError):
    """A bad command-line value that a suite finds in ``run(args)`` (a combination
    argparse cannot check). ``python -m mpicomm.bench`` turns it into one
    ``prog: error: ...`` line from rank 0 and exit status 2 on every rank, as argparse
    does. Raise it only where every rank finds it: from the arguments (and the rank
    count) alone, before the suite's first communication that not every rank reaches."""


def positive_floats(text: str) -> list[float]:
    """An argparse type: a comma-separated list of positive numbers (``"1e6,2.5e7"``)."""
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: {exc}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def median_seconds(fn: Callable[[], Any], comm: Communicator, repeats: int = 10,
                   warmup: int = 2) -> float:
    """Median over ``repeats`` of the slowest rank's time for ``fn()``.

    Ranks start together (barrier); each run's time is the maximum over ranks, since a
    collective is done only when its last rank is.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        comm.barrier()
        start = clock.now()
        fn()
        times.append(comm.allreduce_value(clock.now() - start, "max"))
    return statistics.median(times)


def machine() -> dict[str, Any]:
    import os

    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "ranks": MPI.COMM_WORLD.Get_size(), "loadavg": list(os.getloadavg()),
            "network": network()}


def network() -> dict[str, Any]:
    """The network the ranks ran on: the emulated cluster's conditions (from the
    ``MPICOMM_EMU_*`` variables ``launchers/emulated-cluster`` sets) or one host's
    shared memory."""
    import os

    hosts = os.environ.get("MPICOMM_EMU_HOSTS")
    if not hosts:
        return {"kind": "shared memory", "hosts": 1}
    return {"kind": "emulated cluster", "hosts": int(hosts),
            "ranks_per_host": int(os.environ.get("MPICOMM_EMU_RANKS_PER_HOST", "1")),
            "rate": os.environ.get("MPICOMM_EMU_RATE", "unshaped"),
            "delay_s": float(os.environ.get("MPICOMM_EMU_DELAY", "0") or 0),
            "schedule": os.environ.get("MPICOMM_EMU_SCHEDULE") or None,
            "rate_by": "kernel (tc tbf on both ends of each host link)",
            "delay_by": "injected in mpicomm's point-to-point layer (Ctx/Wire); "
                        "MPI's own collectives bypass it"}


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print ``rows`` as an aligned text table of ``columns``."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
