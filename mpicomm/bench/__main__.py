"""``python -m mpicomm.bench <suite> [options]``: run one benchmark suite.

Suites are modules of this package exposing ``add_arguments(parser)`` and ``run(args)``;
run a suite with ``--help`` for its options.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUITES = {
    "collectives": "mpicomm.bench.collectives",
    "sparse": "mpicomm.bench.sparse",
    "localsgd": "mpicomm.bench.localsgd",
    "selection": "mpicomm.bench.selection",
    "fusion": "mpicomm.bench.fusion",
    "crossover": "mpicomm.bench.crossover",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpicomm.bench", description=__doc__)
    sub = parser.add_subparsers(dest="suite", required=True)
    modules = {}
    for name, path in SUITES.items():
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name != path:
                raise
            continue
        modules[name] = module
        sp = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        sp.add_argument("--json", default=None, help="write the results to this JSON file")
        module.add_arguments(sp)
    args = parser.parse_args(argv)
    return int(modules[args.suite].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
