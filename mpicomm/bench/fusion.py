"""The host data path of dense gradient averaging: fresh buffers vs persistent ones.

Run under MPI, e.g. ``mpiexec -n 2 python -m mpicomm.bench fusion --json out.json``.

A "model" of ``--buckets`` buckets, each one weight of ``--bucket-mb`` megabytes and a
small bias (float32), is averaged with :class:`~mpicomm.strategies.Dense` four ways,
interleaved (every repetition times each once, so drifting load hits them alike), each
reported as the median over ``--repeats`` of the slowest rank's time:

* ``fresh``: ``strategy.aggregate`` (a new fused buffer per bucket) and a copy of the
  results back into the gradients: the simplest path;
* ``packed``: ``strategy.aggregate_into`` on separate gradient tensors: persistent fused
  buffers, refilled and copied back in place;
* ``views``: ``strategy.aggregate_into`` on gradients that are views of one flat buffer
  per bucket (what GradientSync now keeps in ``.grad``): no copy at all;
* ``raw``: one in-place allreduce (``op="avg"``) per bucket of the flat buffers, the
  floor.

``x_raw`` is the row's time over ``raw``; the target for GradientSync's
communication is ``<= 1.1``. Memory: ``packed`` and ``views`` hold one persistent copy of
the buckets.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from ..collectives import allreduce
from ..comm import init
from ..strategies import Dense
from ._util import UsageError, machine, median_seconds, print_table, write_json

COLUMNS = ("ranks", "buckets", "bucket_mb", "method", "time_ms", "x_raw")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--buckets", type=int, default=16, help="number of buckets")
    parser.add_argument("--bucket-mb", type=float, default=8.0,
                        help="megabytes per bucket (default 8: 128 MB in all)")
    parser.add_argument("--algorithm", default="auto", help="allreduce algorithm")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per method")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs per method, before timing")


def run(args: argparse.Namespace) -> int:
    if args.buckets < 1 or args.bucket_mb <= 0 or args.repeats < 1 or args.warmup < 0:
        raise UsageError("--buckets, --bucket-mb and --repeats must be positive, "
                         "--warmup >= 0")
    comm = init()
    rows_n = 1024
    cols = max(1, int(args.bucket_mb * 2**20 / 4 / rows_n))
    torch.manual_seed(comm.rank)
    grads = [[torch.randn(rows_n, cols), torch.randn(rows_n)] for _ in range(args.buckets)]
    names = [[f"w{i}", f"b{i}"] for i in range(args.buckets)]
    flats = [torch.cat([t.reshape(-1) for t in g]) for g in grads]
    views = [[f[:rows_n * cols].view(rows_n, cols), f[rows_n * cols:]] for f in flats]
    fresh_s, packed_s, views_s = (Dense(comm.dup(), algorithm=args.algorithm)
                                  for _ in range(3))

    def fresh() -> None:
        for g, n in zip(grads, names):
            for t, avg in zip(g, fresh_s.aggregate(g, n)):
                t.copy_(avg)

    def packed() -> None:
        for g, n in zip(grads, names):
            packed_s.aggregate_into(g, n)

    def in_views() -> None:
        for g, n in zip(views, names):
            views_s.aggregate_into(g, n)

    def raw() -> None:
        for f in flats:
            allreduce(f, op="avg", algorithm=args.algorithm, comm=comm, out=f)

    methods: dict[str, Callable[[], Any]] = {"fresh": fresh, "packed": packed,
                                             "views": in_views, "raw": raw}
    # interleaved: every repetition times each method once, so drifting machine load
    # hits them alike
    runs: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():
        for _ in range(args.warmup):
            fn()
    for _ in range(args.repeats):
        for name, fn in methods.items():
            runs[name].append(median_seconds(fn, comm, 1, 0))
    times = {name: statistics.median(v) for name, v in runs.items()}
    rows = [{"ranks": comm.size, "buckets": args.buckets, "bucket_mb": args.bucket_mb,
             "method": name, "time_ms": round(t * 1e3, 2),
             "x_raw": round(t / times["raw"], 3)} for name, t in times.items()]
    for s in (fresh_s, packed_s, views_s):
        s.comm.free()
    if comm.rank == 0:
        print_table(rows, COLUMNS)
        write_json(args.json, {"suite": "fusion", "machine": machine(), "rows": rows})
    return 0
