"""``python -m mpicomm.bench workloads``: the training tasks and their sizes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ._util import print_table


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpicomm.bench workloads",
                                 description="List the workloads of mpicomm.workloads with "
                                 "their sizes (builds each; data is generated and cached "
                                 "the first time).")
    ap.add_argument("--ranks", type=int, default=8, help="steps per epoch at this many ranks")
    ap.add_argument("--workload", action="append", default=None,
                    help="only this workload (repeatable)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error("--ranks must be >= 1")
    from .. import workloads

    try:
        rows = workloads.describe(args.ranks, args.workload)
    except workloads.WorkloadError as exc:
        ap.error(str(exc))
    columns = list(dict.fromkeys(c for r in rows for c in r if c not in ("description", "error")))
    print_table(rows, columns)
    for r in rows:
        print(f"{r['workload']}: {r.get('description') or r.get('error')}")
        print(f"    options: {workloads.options(r['workload'])}")
    print(f"cache: {workloads.cache_dir()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
