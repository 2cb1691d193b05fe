"""Virtual-clock results in the benchmark report, and the seed claims drawn from them.

A suite run with ``--clock virtual`` (:mod:`mpicomm.clock`) records ``clock.mode ==
"virtual"`` and its platform (link rate, one-way delay, hosts) in its JSON: its times are
those of the modelled cluster, compute charged from a cost table, and do not depend on
the machine's load. :func:`network` describes such a run like an emulated cluster's.

:func:`seed_claims` sets the sparse suite's virtual runs against the claims of the seed
papers, per network, rank count, size ``d`` and density, as speed-ups of one aggregation
call (time of the slower method over the faster; above 1 the sparse collective wins):

* ``dense/gTop-k``: the best of mpicomm's own dense allreduces (ring, recursive doubling,
  Rabenseifner) over gTop-k (Shi et al., "A Distributed Synchronous SGD Algorithm with
  Global Top-k Sparsification for Low Bandwidth Networks", ICDCS 2019, arXiv 1901.04359:
  2.7-12x the scaling efficiency of dense S-SGD at 32 workers on 1 Gbit/s Ethernet);
* ``AG/gTop-k``: Allgather Top-k over gTop-k (the same paper: 1.1-1.7x);
* ``AG/AR-Top-k``: Allgather Top-k over AR-Top-k (STAR, ring), which the AR-Top-k design
  expects above 1 as the rank count grows (Tyagi & Swany, IEEE BigData 2023);

each three ways: ``virtual`` (the virtual clock: the network model plus the selections,
merges and reductions charged from the cost table), ``model`` (the alpha-beta cost
model's communication-only prediction at the same rank count, the suite's ``pred_s``),
and ``wall`` (the emulated cluster's wall clock at the same rate and rank count, where
such a run exists; those were measured on an oversubscribed machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

OWN_DENSE = ("dense/ring", "dense/recursive_doubling", "dense/rabenseifner")
RATIOS = (("dense/gTop-k", "dense", "gtopk"), ("AG/gTop-k", "allgather_topk", "gtopk"),
          ("AG/AR-Top-k", "allgather_topk", "artopk_star"))


def is_virtual(r: dict[str, Any]) -> bool:
    return (r.get("clock") or {}).get("mode") == "virtual"


def rate_label(bits_per_s: float) -> str:
    """tc notation: 1e9 -> ``1gbit``, 1e8 -> ``100mbit``."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def network(r: dict[str, Any]) -> dict[str, Any] | None:
    """A virtual run's network in the report's terms (``None`` for other runs)."""
    if not is_virtual(r):
        return None
    p = r["clock"].get("platform") or {}
    sizes = p.get("host_sizes") or []
    return {"kind": "virtual cluster", "hosts": p.get("hosts"),
            "ranks_per_host": max(sizes) if sizes else 1,
            "rate": rate_label(float(p.get("rate_bits", 0.0))),
            "delay_s": float(p.get("delay_s", 0.0))}


def call_ratios(rows: Sequence[dict[str, Any]], key: str
                ) -> dict[tuple[int, float], dict[str, float | None]]:
    """Per ``(d, density)`` of a sparse result: the :data:`RATIOS` from ``key``
    (``seconds`` measured or ``pred_s`` modelled)."""
    times: dict[tuple[int, float], dict[str, float]] = {}
    for row in rows:
        method, value = row["method"].rstrip(" *"), row.get(key)
        if value:
            group = times.setdefault((row["d"], row["density"]), {})
            group[method] = float(value)
            if method in OWN_DENSE:
                group["dense"] = min(group.get("dense", float("inf")), float(value))
    out = {}
    for case, t in sorted(times.items()):
        out[case] = {name: t[a] / t[b] if a in t and b in t else None
                     for name, a, b in RATIOS}
    return out


def seed_claims(results: Sequence[dict[str, Any]],
                wall_network: Any = None) -> list[dict[str, Any]]:
    """One entry per virtual sparse run and case (see the module docstring);
    ``wall_network(r)`` gives a wall-clock result's network dict (the report's)."""
    walls: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        n = wall_network(r) if wall_network is not None else None
        if r["suite"] == "sparse" and not is_virtual(r) and n \
                and n.get("kind") == "emulated cluster":
            walls[(str(n.get("rate")), int(r.get("ranks") or 0))] = r
    entries = []
    for r in results:
        if r["suite"] != "sparse" or not is_virtual(r):
            continue
        n = network(r)
        assert n is not None
        ranks = int(r.get("ranks") or 0)
        virtual, model = call_ratios(r["rows"], "seconds"), call_ratios(r["rows"], "pred_s")
        wall_r = walls.get((n["rate"], ranks))
        wall = call_ratios(wall_r["rows"], "seconds") if wall_r else {}
        for (d, density), v in virtual.items():
            entries.append({"rate": n["rate"], "delay_s": n["delay_s"], "ranks": ranks,
                            "d": d, "density": density, "virtual": v,
                            "model": model.get((d, density), {}),
                            "wall": wall.get((d, density), {}),
                            "wall_loadavg": (wall_r or {}).get("machine", {}).get("loadavg")})
    entries.sort(key=lambda e: (e["rate"], e["ranks"], e["d"], e["density"]))
    return entries


def seed_claims_rows(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries as flat table rows (virtual, model, wall side by side)."""
    rows = []
    for e in entries:
        row: dict[str, Any] = {"network": f"{e['rate']}, {e['delay_s'] * 1e3:g} ms",
                               "ranks": e["ranks"], "d": e["d"], "density": e["density"]}
        for name, _, _ in RATIOS:
            row[f"{name} virtual"] = e["virtual"].get(name)
            row[f"{name} model"] = e["model"].get(name)
            row[f"{name} wall"] = e["wall"].get(name)
        rows.append(row)
    return rows


def seed_claims_section(results: Sequence[dict[str, Any]], wall_network: Any,
                        table: Any) -> str:
    """Markdown: the seed claims from the virtual sparse runs (``table(rows)`` renders)."""
    rows = seed_claims_rows(seed_claims(results, wall_network))
    if not rows:
        return ("No virtual-clock sparse results yet (`make bench-virtual`): the wall-clock "
                "table below is all there is.\n")
    return ("From the sparse suite on a virtual cluster (`--clock virtual`, one rank per "
            "host; `make bench-virtual`): one aggregation call, speed-up of the sparse "
            "collective (time of the slower method / time of the faster; above 1 the "
            "sparse collective wins). `virtual`: the virtual clock (network model plus "
            "the selections, merges and reductions charged from one cost table measured "
            "on this machine's CPU); `model`: the alpha-beta cost model at the same rank "
            "count (communication only: no selection or merge compute, hence far larger "
            "gTop-k gains where those dominate); `wall`: the emulated cluster at the same "
            "rate and rank count, where it was run, on an oversubscribed machine (load "
            "average above the core count: the scheduler's times, for reference only; "
            "see below). "
            "Reference: gTop-k paper (32 GPUs, 1 Gbit/s Ethernet): 2.7-12x the scaling "
            "efficiency of dense S-SGD and 1.1-1.7x that of Allgather Top-k S-SGD; "
            "AR-Top-k (Tyagi & Swany, IEEE BigData 2023): cheaper than Allgather Top-k as "
            "the rank count grows.\n\n"
            + table(rows, limit=200))


#: The report's account of the virtual cluster, after the emulated cluster's.
HOW = ("* **Virtual cluster** (results marked `(virtual)`, `--clock virtual`, "
       "`docs/virtual-clock.md`): no shaping at all. Real data crosses MPI on one machine "
       "while every message is timed by a network model (each host's upload and download "
       "link a serial resource at the configured rate, the configured one-way latency, "
       "shared memory within a host) and compute is charged from a cost table measured "
       "on this machine, so those times are the modelled cluster's whatever the load.\n")
