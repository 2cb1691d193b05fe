"""The seed claims on the virtual clock: gTop-k against dense and Allgather Top-k, and
AR-Top-k against Allgather Top-k as the ranks grow, next to the cost model's prediction
and, where one exists, the emulated cluster's wall-clock measurement.

``python benchmarks/vclock_claims.py [--results benchmarks/results]`` reads every suite
result under ``--results`` (the sparse suite's virtual runs, from ``mpiexec -n P python
-m mpicomm.bench sparse --clock virtual --rate RATE ...`` or ``make bench-virtual``, and
the emulated cluster's wall-clock runs), and writes ``virtual/seed-claims.json``: per
network, ranks, size and density the ratios ``dense/gTop-k``, ``AG/gTop-k`` and
``AG/AR-Top-k`` as ``virtual``, ``model`` and ``wall``
(:func:`mpicomm.bench.report_virtual.seed_claims` says what each means). ``python -m
mpicomm.bench report`` renders the same table into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from mpicomm.bench import report, report_virtual

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    results, _ = report.load([args.results])
    entries = report_virtual.seed_claims(results, report.net)
    out = Path(args.results) / "virtual" / "seed-claims.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"entries": entries}, indent=1) + "\n")
    for row in report_virtual.seed_claims_rows(entries):
        print("  ".join(f"{k}={report.fmt(v)}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
