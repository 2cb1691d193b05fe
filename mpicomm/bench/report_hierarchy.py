"""The benchmark report's parts for host layouts (:mod:`mpicomm.bench.report`): the
``hierarchy`` suite's section and plot (``hierarchy-speedups.png``), and the simulated
cluster of a virtual-clock result in the conditions table and the headings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def hierarchy_section(r: dict[str, Any], table: Callable[..., str]) -> str:
    """The hierarchy suite: its rows, then the best hierarchical row against its flat
    baseline with the target marked met or missed."""
    sizes, nics = r.get("host_sizes") or [], r.get("nics_per_host") or 1
    layout = (f"{len(sizes)} hosts of {'+'.join(str(s) for s in sizes)} ranks"
              + (f", {nics} network ports (NICs) per host" if nics > 1 else "") + "; "
              if sizes else "")
    rows = table(r.get("rows", []), ("d", "density", "k", "method", "time_ms", "pred_ms",
                                     "sent_B", "x_flat", "x_cyclic", "overlap",
                                     "energy"))
    verdicts = [dict(t, verdict="-" if t.get("met") is None else
                     ("met" if t["met"] else "missed")) for t in r.get("targets", [])]
    return (f"{layout}x_flat: the flat baseline's time over the row's; pred_ms: the "
            "two-link cost model (communication only).\n\n" + rows + "\n"
            + table(verdicts, ("d", "density", "collective", "best", "speedup",
                               "predicted", "target", "verdict"))
            + ("\n**Predicted by the cost model, not measured** (same links and cost "
               "table; gTop-k rows: whole steps):\n\n" + table(r["predicted"], (
                   "layout", "d", "density", "flat_ms", "hier_ms", "hier_sliced_ms",
                   "x_flat")) if r.get("predicted") else ""))


def _platform(r: dict[str, Any]) -> dict[str, Any] | None:
    return (r.get("clock") or {}).get("platform")


def virtual_label(r: dict[str, Any]) -> str:
    """``"virtual clock, 1 Gbit/s, 0.1 ms, 8 hosts"`` for a virtual-clock result, else
    ``""``."""
    plat = _platform(r)
    if not plat:
        return ""
    nics = plat.get("nics_per_host") or 1
    return (f"virtual clock, {plat['rate_bits'] / 1e9:g} Gbit/s, "
            f"{plat['delay_s'] * 1e3:g} ms, {plat['hosts']} hosts"
            + (f", {nics} NICs each" if nics > 1 else ""))


def virtual_conditions(r: dict[str, Any]) -> dict[str, Any]:
    """The conditions-table cells of a virtual-clock result (the simulated cluster, not
    this machine's network); ``{}`` for other results."""
    plat = _platform(r)
    if not plat:
        return {}
    sizes = plat.get("host_sizes") or []
    layout = " + ".join(str(x) for x in sizes) if len(set(sizes)) > 1 else \
        f"{len(sizes)} x {sizes[0] if sizes else '?'}"
    if (plat.get("nics_per_host") or 1) > 1:
        layout += f" ({plat['nics_per_host']} NICs per host)"
    return {"network": "virtual clock", "hosts x ranks/host": layout,
            "rate (tc tbf)": f"{plat['rate_bits'] / 1e9:g}gbit (model)",
            "delay (injected)": f"{plat['delay_s'] * 1e3:g} ms (model)"}


def _layout(r: dict[str, Any]) -> str:
    """``"8x4"`` (hosts x ranks per host, or the sizes of uneven hosts), with ``", 4
    NICs"`` where a host has several network ports."""
    sizes = r.get("host_sizes") or []
    nics = r.get("nics_per_host") or 1
    ports = f", {nics} NICs" if nics > 1 else ""
    if sizes and len(set(sizes)) == 1:
        return f"{len(sizes)}x{sizes[0]}{ports}"
    return ("+".join(str(s) for s in sizes) or "?") + ports


#: (panel, method, speed-up column, label) of the bars of the hierarchy plot.
_BARS = (("dense", "dense/hierarchical", "x_flat", "hierarchical / host-major ring"),
         ("dense", "dense/hierarchical", "x_cyclic", "hierarchical / cyclic ring"),
         ("gtopk", "hier_gtopk", "x_flat", "hier_gtopk / flat gTop-k"),
         ("gtopk", "hier_gtopk_sliced", "x_flat", "hier_gtopk_sliced / flat gTop-k"))


def plot_hierarchy(results: Sequence[dict[str, Any]], path: str, plt: Any) -> bool:
    """Speed-ups of the hierarchical collectives over their flat baselines, one group of
    bars per measured run (layout, d; gTop-k per density), the targets as dashed lines
    (1.5 dense, 1.3 gTop-k); False when there is no ``hierarchy`` result."""
    runs = sorted((r for r in results if r["suite"] == "hierarchy"),
                  key=lambda r: (r.get("ranks", 0), _layout(r)))
    if not runs:
        return False
    groups: dict[str, list[tuple[str, dict[str, float]]]] = {"dense": [], "gtopk": []}
    for r in runs:
        for d, density in sorted({(row["d"], row["density"]) for row in r["rows"]}):
            mine = {row["method"]: row for row in r["rows"]
                    if (row["d"], row["density"]) == (d, density)}
            panel = "dense" if density == 1.0 else "gtopk"
            layout = _layout(r).replace(", ", "\n")
            label = f"{layout}\nd={d:.0e}".replace("e+0", "e") + (
                "" if panel == "dense" else f"\n{density:g}")
            bars = {name: mine[method][col] for p, method, col, name in _BARS
                    if p == panel and mine.get(method, {}).get(col)}
            if bars:
                groups[panel].append((label, bars))
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.6), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 2]})
    for ax, (panel, target) in zip(axes[0], (("dense", 1.5), ("gtopk", 1.3))):
        names = [n for p, _, _, n in _BARS if p == panel]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs = [g for g, (_, bars) in enumerate(groups[panel]) if name in bars]
            ax.bar([x + (i - (len(names) - 1) / 2) * width for x in xs],
                   [groups[panel][x][1][name] for x in xs], width, label=name,
                   color=f"C{i + (0 if panel == 'dense' else 2)}")
        ax.axhline(target, color="k", ls="--", lw=1)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(groups[panel])), [lbl for lbl, _ in groups[panel]],
                      fontsize=6)
        ax.set(ylabel="speed-up (flat time / hierarchical time)",
               title=f"{'dense allreduce' if panel == 'dense' else 'gTop-k step'} "
                     f"(target {target:g}x, dashed)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("hierarchical collectives against flat ones (hosts x ranks per host; "
                 "virtual clock where the result says so)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
