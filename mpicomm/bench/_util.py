"""Shared helpers for the benchmark suites: timing, tables, JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from .. import clock
from ..abort import UsageError  # noqa: F401  (the suites raise it; see mpicomm.abort)
from ..collectives.cost import CostParams
from ..comm import Communicator
from ..emulate.mpienv import machine  # noqa: F401  (the suites' JSON header)


def parse_options(items: list[str], flag: str = "--option") -> dict[str, Any]:
    """Workload options given as ``KEY=VALUE`` items (numbers); ``flag`` names the
    command-line option in the error."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            out[key] = float(value) if any(c in value for c in ".e") else int(value)
        except ValueError:
            raise UsageError(f"{flag} {item!r}: VALUE must be a number") from None
    return out


def positive_floats(text: str) -> list[float]:
    """An argparse type: a comma-separated list of positive numbers (``"1e6,2.5e7"``)."""
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: {exc}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def fractions(text: str) -> list[float]:
    """An argparse type: a comma-separated list of fractions in (0, 1] (densities)."""
    values = positive_floats(text)
    if max(values) > 1:
        raise argparse.ArgumentTypeError(f"values must be in (0, 1], got {max(values):g}")
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
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def configured_link(params: CostParams) -> CostParams | None:
    """On the emulated cluster with a shaped rate: ``params`` with the configured link
    (alpha = the one-way delay, beta = 8 / rate, no compute), else ``None``. The fit of
    :func:`calibrate.measure` reads a ``tc`` link as faster than its rate when the
    token bucket lets its messages of up to a few MiB through in bursts, so the bound
    of the link as configured is the one to judge by there."""
    from ..emulate.mpienv import network
    from ..emulate.netns import parse_rate

    net = network()
    if net["kind"] != "emulated cluster" or net["rate"] == "unshaped":
        return None
    return dataclasses.replace(params, alpha=net["delay_s"], beta=8.0 / parse_rate(net["rate"]),
                               gamma=0.0)
