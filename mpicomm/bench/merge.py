"""Checks shared by the scripts that merge results of one comparison run as separate
jobs (``benchmarks/adaptive_merge.py``, ``benchmarks/ps_convergence_merge.py``).

Under the virtual clock a run's times are the simulated cluster's, so runs made one job
at a time compare exactly as if made in one job, provided the jobs share the rank count,
the options (except those naming each job's share of the work, such as ``--only`` or
``--seeds``) and what the clock charges (:func:`charged`). Merging is then a matter of
putting rows together; each script recomputes its own targets.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["charged", "check_mergeable"]


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
