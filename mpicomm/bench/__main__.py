"""``python -m mpicomm.bench <suite> [options]``: run one benchmark suite.

Suites are modules of this package exposing ``add_arguments(parser)`` and ``run(args)``;
run a suite with ``--help`` for its options. ``--list`` prints the suites this
installation has (the Makefile's ``bench`` targets run those). ``report`` is not a
suite: ``python -m mpicomm.bench report`` writes BENCHMARKS.md and plots from the suites'
JSON (:mod:`mpicomm.bench.report`). Nor is ``workloads``: ``python -m mpicomm.bench
workloads [--ranks N] [--json PATH]`` lists the training tasks of
:mod:`mpicomm.workloads` with their sizes (building each, so generating and caching its
data the first time).

Under ``mpiexec`` a bad option (one argparse rejects, or one a suite rejects with
:class:`~mpicomm.abort.UsageError`) ends the job with one ``... error: ...`` line
from rank 0 and exit status 2 on every rank.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys

SUITES = {
    "collectives": "mpicomm.bench.collectives",
    "sparse": "mpicomm.bench.sparse",
    "localsgd": "mpicomm.bench.localsgd",
    "ps": "mpicomm.bench.ps",
    "selection": "mpicomm.bench.topk_select",
    "fusion": "mpicomm.bench.fusion",
    "staging": "mpicomm.bench.staging",
    "crossover": "mpicomm.bench.crossover",
    "adaptive": "mpicomm.bench.adaptive",
    "recovery": "mpicomm.bench.recovery",
    "train": "mpicomm.bench.train",
    "ratios": "mpicomm.bench.ratios",
    "hierarchy": "mpicomm.bench.hierarchy",
    "vclock": "mpicomm.bench.vclock",
    "costs": "mpicomm.bench.costs",
}


def available() -> list[str]:
    """The suites of :data:`SUITES` whose module exists in this installation."""
    names = []
    for name, path in SUITES.items():
        try:
            importlib.util.find_spec(path)
        except ModuleNotFoundError:
            continue
        if importlib.util.find_spec(path) is not None:
            names.append(name)
    return names


def plain_text(doc: str) -> str:
    """A docstring for a terminal: ``:role:`~a.b.C``` as ``C`` (``a.b.C`` without the
    tilde), ````code```` as ``code``, ``x::`` as ``x:``."""
    doc = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"\1", doc)
    doc = re.sub(r":\w+:`([^`]+)`", r"\1", doc)
    doc = re.sub(r"``([^`]+)``", r"\1", doc)
    return re.sub(r"::(\s*\n)", r":\1", doc)


def summary_line(doc: str | None) -> str:
    """The first paragraph of a docstring as one plain line (a suite's entry in
    ``--help``)."""
    first = (doc or "").strip().split("\n\n")[0]
    return plain_text(" ".join(first.split()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        from .report import main as report

        return report(argv[1:])
    if argv[:1] == ["workloads"]:
        from .listing import main as listing

        return listing(argv[1:])
    if argv[:1] == ["--list"]:
        print(" ".join(available()))
        return 0
    from ..cli import RankZeroParser
    from ._util import UsageError

    parser = RankZeroParser(prog="python -m mpicomm.bench", description=plain_text(__doc__),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", required=True)
    modules, parsers = {}, {}
    for name, path in SUITES.items():
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name != path:
                raise
            continue
        modules[name] = module
        sp = sub.add_parser(name, help=summary_line(module.__doc__),
                            description=plain_text((module.__doc__ or "").strip()),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        parsers[name] = sp
        sp.add_argument("--json", default=None, help="write the results to this JSON file")
        module.add_arguments(sp)
    args = parser.parse_args(argv)
    try:
        return int(modules[args.suite].run(args) or 0)
    except UsageError as exc:
        parsers[args.suite].error(str(exc))
        raise  # not reached: error() exits


if __name__ == "__main__":
    sys.exit(main())
