"""The seed claims on the virtual clock: gTop-k against dense and Allgather Top-k, and
AR-Top-k against Allgather Top-k as the ranks grow, next to the cost model's prediction
and, where one exists, the emulated cluster's wall-clock measurement.

``python benchmarks/vclock_claims.py [--results benchmarks/results]`` reads the sparse
suite's JSON of the virtual runs (``virtual/sparse-RATE-P.json``, from
``mpiexec -n P python -m mpicomm.bench sparse --clock virtual --rate RATE ...``) and of
the emulated cluster (``cluster/sparse-RATE-P.json``), and writes
``virtual/seed-claims.json``: per network, ranks, size and density

* ``dense_over_gtopk``: the best dense allreduce's time over gTop-k's (the gTop-k paper
  reports 2.7-12x at 32 workers on 1 GbE, its Table/figure of scaling efficiency);
* ``ag_over_gtopk``: Allgather Top-k's time over gTop-k's (paper: 1.1-1.7x);
* ``artopk_over_ag`` / ``artree_over_ag``: AR-Top-k (ring, tree) over Allgather Top-k
  (seed 000: AR-Top-k wins as the ranks grow);

each as ``virtual`` (the virtual clock, compute charged from the cost table),
``model`` (the cost model's communication-only prediction, the suite's ``pred_ms``)
and ``wall`` (the emulated cluster, where measured).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DENSE = ("dense/ring", "dense/recursive_doubling", "dense/rabenseifner", "dense/mpi")


def _ratios(rows: list[dict], key: str) -> dict[tuple[int, float], dict[str, float]]:
    """Per (d, density): the four ratios from ``key`` (``seconds`` or ``pred_s``)."""
    out: dict[tuple[int, float], dict[str, float]] = {}
    cases = sorted({(r["d"], r["density"]) for r in rows})
    for d, density in cases:
        t = {r["method"].rstrip(" *"): r.get(key) for r in rows
             if r["d"] == d and r["density"] == density}
        dense = min(v for m, v in t.items() if m in DENSE and v)
        g, ag = t.get("gtopk"), t.get("allgather_topk")
        if not (g and ag):
            continue
        out[(d, density)] = {
            "dense_over_gtopk": dense / g, "ag_over_gtopk": ag / g,
            "artopk_over_ag": t["artopk_star"] / ag if t.get("artopk_star") else None,
            "artree_over_ag": (t["artopk_star_tree"] / ag
                               if t.get("artopk_star_tree") else None)}
    return out


def _load(path: Path) -> list[dict] | None:
    if not path.exists():
        return None
    return json.loads(path.read_text())["rows"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    res = Path(args.results)
    entries = []
    for path in sorted((res / "virtual").glob("sparse-*.json")):
        m = re.fullmatch(r"sparse-(\w+)-(\d+)\.json", path.name)
        if not m:
            continue
        rate, p = m.group(1), int(m.group(2))
        rows = json.loads(path.read_text())["rows"]
        virtual, model = _ratios(rows, "seconds"), _ratios(rows, "pred_s")
        wall_rows = _load(res / "cluster" / f"sparse-{rate}-{p}.json")
        wall = _ratios(wall_rows, "seconds") if wall_rows else {}
        for (d, density), v in virtual.items():
            entries.append({"net": rate, "ranks": p, "d": d, "density": density,
                            "virtual": v, "model": model.get((d, density)),
                            "wall": wall.get((d, density))})
    out = res / "virtual" / "seed-claims.json"
    out.write_text(json.dumps({"entries": entries}, indent=1) + "\n")
    for e in entries:
        v, mdl = e["virtual"], e["model"] or {}
        print(f"{e['net']:>6} P={e['ranks']:>2} d={e['d']:.0e} density={e['density']:<6}"
              f" dense/gtopk {v['dense_over_gtopk']:6.2f} (model "
              f"{mdl.get('dense_over_gtopk', float('nan')):6.2f})  ag/gtopk "
              f"{v['ag_over_gtopk']:5.2f} (model {mdl.get('ag_over_gtopk', float('nan')):5.2f})"
              f"  artopk/ag {v['artopk_over_ag'] or float('nan'):5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
