"""The benchmark report's parts for host layouts (:mod:`mpicomm.bench.report`): the
``hierarchy`` suite's section, and the simulated cluster of a virtual-clock result in
the conditions table and the headings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def hierarchy_section(r: dict[str, Any], table: Callable[..., str]) -> str:
    """The hierarchy suite: its rows, then the best hierarchical row against its flat
    baseline with the target marked met or missed."""
    sizes = r.get("host_sizes") or []
    layout = (f"{len(sizes)} hosts of {'+'.join(str(s) for s in sizes)} ranks; "
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
    return (f"virtual clock, {plat['rate_bits'] / 1e9:g} Gbit/s, "
            f"{plat['delay_s'] * 1e3:g} ms, {plat['hosts']} hosts")


def virtual_conditions(r: dict[str, Any]) -> dict[str, Any]:
    """The conditions-table cells of a virtual-clock result (the simulated cluster, not
    this machine's network); ``{}`` for other results."""
    plat = _platform(r)
    if not plat:
        return {}
    sizes = plat.get("host_sizes") or []
    layout = " + ".join(str(x) for x in sizes) if len(set(sizes)) > 1 else \
        f"{len(sizes)} x {sizes[0] if sizes else '?'}"
    return {"network": "virtual clock", "hosts x ranks/host": layout,
            "rate (tc tbf)": f"{plat['rate_bits'] / 1e9:g}gbit (model)",
            "delay (injected)": f"{plat['delay_s'] * 1e3:g} ms (model)"}
