"""The controllers' decisions in the benchmark report: AdaComm's period over time.

``adacomm_panel(ax, curves, schedule)`` draws, for every AdaComm variant of a
``localsgd`` result (the ``adacomm`` decisions each curve records: agreed clock, period,
noise estimate), the period in force against the run's clock, first seed, as steps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["adacomm_panel", "has_adacomm"]


def has_adacomm(curves: list[dict[str, Any]]) -> bool:
    """Whether any curve of a ``localsgd`` result carries AdaComm decisions with times."""
    return any(d.get("elapsed") is not None for c in curves for d in c.get("adacomm", []))


def adacomm_panel(ax: Any, curves: list[dict[str, Any]], schedule: str) -> None:
    """AdaComm's period (log scale) against the clock for ``schedule``'s first seed."""
    mine = [c for c in curves if c["schedule"] == schedule and c.get("adacomm")]
    if not mine:
        return
    seed = min(c["seed"] for c in mine)
    methods = list(dict.fromkeys(c["method"] for c in curves))
    for c in mine:
        if c["seed"] != seed:
            continue
        points = [(d["elapsed"], d["tau"]) for d in c["adacomm"] if d["elapsed"] is not None]
        if c["curve"]:
            points.append((c["curve"][-1][0], points[-1][1]))
        t, tau = zip(*points)
        ax.step(t, tau, where="post", color=f"C{methods.index(c['method'])}",
                label=c["method"])
    ax.set(yscale="log", xlabel="seconds (clock of the run)", ylabel="AdaComm period tau",
           title=f"{schedule} lr, seed {seed}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
