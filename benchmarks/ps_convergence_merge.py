"""Merge ``bench ps --sections convergence`` results of one setting run as separate jobs
(different ``--seeds``).

Under the virtual clock a run's times are the simulated cluster's, so seeds run as
separate jobs compare exactly as if run in one, provided the jobs share the ranks, the
options (but ``--seeds`` and ``--json``), the platform and the cost table's entries: this script
checks that, puts the rows together in seed order, recomputes the target from every
seed's BSP curve (:func:`mpicomm.bench.straggler.conv_target`: ``bsp:F`` is the lowest
over all the seeds), each row's time to it and the medians
(:func:`~mpicomm.bench.straggler.convergence_summary`), and writes one result the report
renders::

    python benchmarks/ps_convergence_merge.py OUT.json seed0.json seeds12.json
"""

from __future__ import annotations

from typing import Any

from mpicomm.bench.merge import check_mergeable, merge_command, merged_base
from mpicomm.bench.straggler import conv_target, convergence_summary, reach

#: Options that may differ between the merged jobs.
PER_JOB = ("seeds", "json")


def merge(results: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """One result from ``results`` (same suite, ranks, clock, options but ``PER_JOB``)."""
    for path, r in zip(sources, results):
        if r.get("suite") != "ps" or "convergence" not in r:
            raise ValueError(f"{path}: not a bench ps convergence result")
    check_mergeable(results, sources, options="args", per_job=PER_JOB)
    first = results[0]
    rows = [row for r in results for row in r["convergence"]]
    keys = [(row["straggler"], row["seed"], row["mode"]) for row in rows]
    if len(set(keys)) != len(keys):
        raise ValueError("a (straggler, seed, mode) run appears in more than one result")
    rows.sort(key=lambda row: (row["straggler"], row["seed"]))
    target = conv_target(first["args"]["target"], rows)
    reach(rows, target)
    seeds = sorted({row["seed"] for row in rows})
    out = merged_base(results, sources)
    out["args"] = dict(first["args"], seeds=",".join(str(s) for s in seeds))
    out["convergence"] = rows
    out["convergence_summary"] = convergence_summary(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    return merge_command(argv, __doc__.split("\n\n")[0], merge,
                         lambda merged: merged["convergence_summary"])


if __name__ == "__main__":
    raise SystemExit(main())
