"""Straggler models and time-to-target bookkeeping of ``bench ps`` (no MPI here).

:class:`StragglerPause` gives a worker's emulated compute per step: a persistent
straggler (``fixed``) or transient ones (``random``: any worker slow at any step with
probability ``p``, seeded). :func:`conv_target`, :func:`reach` and
:func:`convergence_summary` turn the runs' accuracy curves into the time, and the pushes,
to a target accuracy, and their medians over the seeds; they work on the rows of a saved
result as well, so a result can be re-read at another target.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ._util import UsageError
from ._util import parse_options as parse_items

__all__ = ["STRAGGLER_MODELS", "StragglerPause", "check_sgd", "conv_target", "reach",
           "convergence_summary", "parse_stragglers", "parse_seeds", "parse_target",
           "parse_options"]

STRAGGLER_MODELS = ("fixed", "random")


@dataclasses.dataclass
class StragglerPause:
    """A worker's emulated compute per step, in seconds: ``compute_s``, or
    ``slow_factor * compute_s`` at a slow step. ``model="fixed"``: worker 0 is slow at
    every step (a persistent straggler), the others never. ``model="random"``: every
    worker is slow at each step with probability ``p`` (default ``1/workers``: one slow
    worker per step on average, the fixed model's total slowness spread over everyone),
    independently, drawn from ``numpy.random.default_rng((seed, worker))``, so the
    ``i``-th call gives the same pause in every run with this seed, whatever the mode.
    Mean pause ``(1 + p (slow_factor - 1)) compute_s``; a BSP step waits for the slowest
    worker, so it is slow with probability ``1 - (1 - p)^W``. Each call is one step."""

    model: str
    worker: int
    workers: int
    compute_s: float
    slow_factor: float
    p: float | None = None
    seed: int = 0
    slow_steps: int = 0

    def __post_init__(self) -> None:
        if self.model not in STRAGGLER_MODELS:
            raise UsageError(f"straggler model must be one of {', '.join(STRAGGLER_MODELS)}"
                             f", got {self.model!r}")
        if self.p is None:
            self.p = 1.0 / self.workers
        if not 0.0 <= self.p <= 1.0:
            raise UsageError(f"--straggler-p must be in [0, 1], got {self.p}")
        self._rng = np.random.default_rng((self.seed, self.worker))

    def slow(self) -> bool:
        """Whether the next step is slow (draws it; one call per step)."""
        if self.model == "fixed":
            return self.worker == 0
        return bool(self._rng.random() < self.p)

    def __call__(self) -> float:
        slow = self.slow()
        self.slow_steps += slow
        return self.compute_s * (self.slow_factor if slow else 1.0)

    def __str__(self) -> str:
        what = ("worker 0" if self.model == "fixed"
                else f"each worker with p={self.p:.3g} (seed {self.seed})")
        return (f"{self.model} straggler: {what} computes {self.slow_factor:g}x "
                f"{self.compute_s * 1e3:g} ms")


def parse_stragglers(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = sorted(set(kinds) - set(STRAGGLER_MODELS))
    if bad or not kinds:
        raise UsageError(f"--stragglers: unknown {bad or 'empty list'}; choose from "
                         f"{', '.join(STRAGGLER_MODELS)}")
    return kinds


def conv_target(text: str, rows: list[dict[str, Any]]) -> float:
    """The target accuracy of ``--target``: a number, or ``bsp:F`` (``0 < F <= 1``): the
    lowest over the seeds of the best test accuracy BSP had reached by the fraction ``F``
    of its steps (so every BSP run reaches it, at about ``F`` of its run; BSP's curve in
    steps does not depend on the straggler model)."""
    if not text.startswith("bsp:"):
        return float(text)
    frac = float(text[4:])
    best = []
    for r in rows:
        if r["mode"] == "sync":
            last = max(p[1] for p in r["curve"])
            best.append(max(p[2] for p in r["curve"] if p[1] <= frac * last))
    return min(best)


def reach(rows: list[dict[str, Any]], target: float) -> None:
    """Fill in each row's first curve point at or above ``target``: ``time_to_target_s``,
    ``observer_steps_to_target``, ``pushes_to_target`` (``None`` where never reached)."""
    for r in rows:
        hit = next((p for p in r["curve"] if p[2] >= target), None)
        r["target"] = target
        r["time_to_target_s"] = None if hit is None else hit[0]
        r["observer_steps_to_target"] = None if hit is None else hit[1]
        r["pushes_to_target"] = None if hit is None else hit[3]


def _median(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return float(np.median(got)) if got else None


def convergence_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the seeds per (straggler model, mode) of the time to the target, the
    pushes to it and the push rate; SSP's rows add ``bsp/ssp`` and ``async/ssp`` (the
    ratios of the median times: above 1 where SSP is sooner) and, against async,
    ``pushes_ratio`` (SSP's pushes to target / async's: staleness's cost, below 1 where
    async's staleness costs more) and ``rate_ratio`` (async's push rate / SSP's)."""
    out: list[dict[str, Any]] = []
    for kind in dict.fromkeys(r["straggler"] for r in rows):
        group = []
        for mode in dict.fromkeys(r["mode"] for r in rows if r["straggler"] == kind):
            mine = [r for r in rows if r["straggler"] == kind and r["mode"] == mode]
            group.append({"straggler": kind, "mode": mode, "seeds": len(mine),
                          "reached": sum(r["time_to_target_s"] is not None for r in mine),
                          "time_to_target_s": _median([r["time_to_target_s"] for r in mine]),
                          "pushes_to_target": _median([r["pushes_to_target"] for r in mine]),
                          "pushes_per_s": _median([r["pushes_per_s"] for r in mine]),
                          "best_accuracy": _median([r["best_accuracy"] for r in mine]),
                          "max_staleness": max(r["max_staleness"] for r in mine)})
        by = {g["mode"].split("(")[0]: g for g in group}
        ssp, sync, asy = by.get("ssp"), by.get("sync"), by.get("async")
        if ssp and sync and asy and all(g["time_to_target_s"] for g in (ssp, sync, asy)):
            ssp["bsp/ssp"] = sync["time_to_target_s"] / ssp["time_to_target_s"]
            ssp["async/ssp"] = asy["time_to_target_s"] / ssp["time_to_target_s"]
            ssp["pushes_ratio"] = ssp["pushes_to_target"] / asy["pushes_to_target"]
            ssp["rate_ratio"] = asy["pushes_per_s"] / ssp["pushes_per_s"]
        out += group
    return out


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise UsageError(f"--seeds must be comma-separated integers >= 0, got {text!r}")
    return seeds


def parse_target(text: str) -> None:
    try:
        value = float(text[4:] if text.startswith("bsp:") else text)
    except ValueError:
        value = float("nan")
    if not (0.0 < value <= 1.0 if text.startswith("bsp:") else value == value):
        raise UsageError(f"--target must be an accuracy or bsp:F with 0 < F <= 1, got "
                         f"{text!r}")


def check_sgd(lr: float, momentum: float) -> None:
    """``--conv-lr`` and ``--conv-momentum``: the servers' SGD settings of the
    convergence runs, checked before any rank builds a store."""
    if not (math.isfinite(lr) and lr > 0):
        raise UsageError(f"--conv-lr must be a positive number, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise UsageError(f"--conv-momentum must be in [0, 1), got {momentum}")


def parse_options(text: str) -> dict[str, Any]:
    """``--conv-options k=v,...``: the workload options (numbers) of the convergence
    runs (:func:`mpicomm.bench._util.parse_options` on the comma-separated items)."""
    return parse_items([p.strip() for p in text.split(",") if p.strip()], "--conv-options")
