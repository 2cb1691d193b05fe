"""Measure the virtual clock's compute cost table (every registered kernel).

``mpiexec -n P python -m mpicomm.bench costs --json costs.json`` imports every layer that
charges compute (collectives, compressors, the sparse layer), lets the ranks take turns
measuring every kernel (:func:`mpicomm.costtable.calibrate`: thread CPU time at two
sizes, the minimum over ``--repeats`` rounds of samples of every rank that measured) and
writes the table, which ``MPICOMM_VIRTUAL_COSTS=costs.json`` (or a suite's
``--costs``) then reuses, so that every run of a comparison is charged the same.
``--turns N`` lets only the first N ranks measure (faster; each turn takes a few
seconds).
"""

from __future__ import annotations

import argparse

from .. import compress, costtable, sparse  # noqa: F401  (they register their kernels)
from ..comm import init
from ._util import UsageError, machine, print_table


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=costtable.REPEATS,
                    help="timed samples per kernel and size (their minimum counts)")
    ap.add_argument("--turns", type=int, default=None,
                    help="ranks that measure, one after another (default: all)")
    ap.add_argument("--ops", default="", help="only these ops (comma-separated)")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or (args.turns is not None and args.turns < 1):
        raise UsageError("--repeats and --turns must be >= 1")
    ops = [s.strip() for s in args.ops.split(",") if s.strip()] or None
    unknown = [op for op in ops or () if op not in costtable.kernels()]
    if unknown:
        raise UsageError(f"no kernel for {unknown}; known: {sorted(costtable.kernels())}")
    comm = init()
    table = costtable.calibrate(comm.mpi, ops, args.repeats, args.turns)
    table.info["machine"] = machine()
    if comm.rank == 0:
        print_table([{"op": op, "per_call_s": e.per_call, "per_unit_s": e.per_unit,
                      "unit": e.unit} for op, e in sorted(table.ops.items())],
                    ("op", "per_call_s", "per_unit_s", "unit"))
        if args.json:
            table.save(args.json)
    return 0
