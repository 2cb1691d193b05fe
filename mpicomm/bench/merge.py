"""Checks and the command line shared by the scripts that merge results of one
comparison run as separate jobs (``benchmarks/adaptive_merge.py``,
``benchmarks/ps_convergence_merge.py``, ``benchmarks/localsgd_merge.py``).

Under the virtual clock a run's times are the simulated cluster's, so runs made one job
at a time compare exactly as if made in one job, provided the jobs share the rank count,
the options (except those naming each job's share of the work, such as ``--only`` or
``--seeds``) and what the clock charges (:func:`charged`). Merging is then a matter of
putting rows together; each script recomputes its own targets.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

__all__ = ["charged", "check_mergeable", "merge_command", "merged_base"]


def charged(clock: Any) -> Any:
    """What decides the times ``clock`` (a result's ``clock`` record) charges: its mode,
    its platform and its cost table's ops, without the ops recorded as ``absent``.

    Left out on purpose: the table's format tag (a format-1 table loaded by the format-2
    loader charges the same), its ``info`` (when and how it was measured), and ops with
    ``source: absent`` (they charge nothing; a table records one the first time a job
    looks it up, so a job that never ran gTop-k's truncation lacks ``select:kept`` where
    another has it). Anything that is not a dict compares as itself."""
    if not isinstance(clock, dict):
        return clock
    costs = clock.get("costs")
    ops = costs.get("ops") if isinstance(costs, dict) else costs
    if isinstance(ops, dict):
        ops = {k: v for k, v in ops.items()
               if not (isinstance(v, dict) and v.get("source") == "absent")}
    return clock.get("mode"), clock.get("platform"), ops


def check_mergeable(results: Sequence[dict[str, Any]], sources: Sequence[str], *,
                    options: str, per_job: Collection[str]) -> None:
    """``ValueError`` naming the file and the difference unless every result has the
    first one's ``ranks``, :func:`charged` clock and ``options`` record (the key that
    holds the command line: ``"options"`` or ``"args"``) except the keys ``per_job``."""
    if not results:
        raise ValueError("nothing to merge")
    first = results[0]
    want = {k: v for k, v in first[options].items() if k not in per_job}
    for path, r in zip(sources, results):
        if r.get("ranks") != first.get("ranks"):
            raise ValueError(f"{path}: ranks differ from {sources[0]}'s")
        if charged(r.get("clock")) != charged(first.get("clock")):
            raise ValueError(f"{path}: clock differs from {sources[0]}'s (mode, platform "
                             "or cost table entries)")
        same = {k: v for k, v in r[options].items() if k not in per_job}
        if same != want:
            diff = sorted(k for k in set(same) | set(want) if same.get(k) != want.get(k))
            raise ValueError(f"{path}: options {diff} differ from {sources[0]}'s")


def merged_base(results: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """What a merged result keeps of its parts: the first one's records, its ``machine``
    with every job's load average (``loadavg_per_job``), the files it came from
    (``merged_from``) and no ``note``; the caller replaces the rows and medians."""
    out = dict(results[0])
    out["machine"] = dict(results[0]["machine"],
                          loadavg_per_job=[r["machine"].get("loadavg") for r in results])
    out["merged_from"] = list(sources)
    out.pop("note", None)
    return out


def merge_command(argv: Sequence[str] | None, description: str,
                  merge: Callable[[list[dict[str, Any]], list[str]], dict[str, Any]],
                  report: Callable[[dict[str, Any]], Iterable[Any]]) -> int:
    """The command line every merge script shares, ``OUT INPUT... [--note TEXT]``: read
    the input results, ``merge(results, paths)``, store ``--note`` as the result's
    ``note``, write OUT (JSON, indent 1) and print each item of ``report(merged)``, a
    dict with its floats rounded to 4 digits, anything else as it is."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("out", help="the merged JSON to write")
    p.add_argument("inputs", nargs="+", help="the results to merge")
    p.add_argument("--note", default=None, help="a sentence stored as the result's note")
    args = p.parse_args(argv)
    results = []
    for path in args.inputs:
        with open(path) as f:
            results.append(json.load(f))
    merged = merge(results, args.inputs)
    if args.note:
        merged["note"] = args.note
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    for item in report(merged):
        if isinstance(item, dict):
            item = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in item.items()}
        print(item)
    return 0
