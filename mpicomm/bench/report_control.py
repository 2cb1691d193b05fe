"""The controllers' decisions in the benchmark report: AdaComm's period over time.

``adacomm_panel(ax, curves, schedule)`` draws, for every AdaComm variant of a
``localsgd`` result (the ``adacomm`` decisions each curve records: agreed clock, period,
noise estimate), the period in force against the run's clock, first seed, as steps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["adacomm_panel", "has_adacomm", "has_timeline", "plot_adaptive"]


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


def has_timeline(r: dict[str, Any]) -> bool:
    """Whether an ``adaptive`` result carries auto's per-step choices."""
    return any(row.get("timeline") for row in r.get("rows", []))


def plot_adaptive(r: dict[str, Any], path: str, plt: Any) -> None:
    """auto's chosen ratio (log scale, one colour per scheme) and the network's bandwidth
    (right axis) over the steps of the first seed's run."""
    row = next(row for row in r.get("rows", []) if row.get("timeline"))
    line = (row.get("runs") or [row])[0].get("timeline") or row["timeline"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    schemes = list(dict.fromkeys(p[1] for p in line))
    for i, scheme in enumerate(schemes):
        mine = [p for p in line if p[1] == scheme]
        ax.plot([p[0] for p in mine], [p[2] for p in mine], ".", ms=2, color=f"C{i}",
                label=scheme)
    ax.set(yscale="log", xlabel="training step", ylabel="chosen ratio (fraction kept)")
    ax.grid(alpha=0.3)
    # outside the axes, right of the bandwidth's axis: no phase of the run is hidden
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.1, 1.0), markerscale=4)
    net = ax.twinx()
    net.step([p[0] for p in line], [p[3] for p in line], where="post", color="k", lw=1,
             label="Gbit/s")
    net.set(yscale="log", ylabel="network Gbit/s (black)")
    fig.suptitle(f"auto on the changing network: {r.get('ranks')} ranks, seed "
                 f"{(row.get('runs') or [row])[0].get('seed', 0)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
