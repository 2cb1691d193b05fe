"""Shared helpers for the benchmark suites: timing, tables, JSON."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from .. import clock
from ..comm import Communicator
from ..emulate.mpienv import machine  # noqa: F401  (the suites' JSON header)


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
