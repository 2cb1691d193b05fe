"""Merge ``bench localsgd`` results of one comparison run as separate jobs (different
``--seed-offset``, ``--seeds`` or ``--schedules``).

On the model or virtual clock a run's times do not depend on the machine's load, so seeds
and schedules run as separate jobs (on separate cores, at once) compare exactly as if run
in one job, provided the jobs share the ranks, the options (but the ones naming each job's
share), the clock and the model clock's step and round times: this script checks that,
puts the runs together in (schedule, seed) order, and recomputes every row, the medians
and the targets with the suite's own functions
(:func:`mpicomm.bench.localsgd.summarize`, :func:`~mpicomm.bench.localsgd.targets`)::

    python benchmarks/localsgd_merge.py OUT.json seed0.json seed1.json seed2.json
"""

from __future__ import annotations

from typing import Any

from mpicomm.bench.localsgd import METHOD_SYNC, Run, summarize, targets
from mpicomm.bench.merge import check_mergeable, merge_command, merged_base

#: Options that may differ between the merged jobs.
PER_JOB = ("seeds", "seed_offset", "schedules", "json")


def runs_of(result: dict[str, Any]) -> list[Run]:
    """The result's runs, rebuilt from its ``curves``, ``rows`` and ``training_runs``
    (all three list the runs in the same order)."""
    by_key = {(row["schedule"], row["seed"], row["method"]): row for row in result["rows"]}
    runs = []
    for c, record in zip(result["curves"], result["training_runs"], strict=True):
        row = by_key[(c["schedule"], c["seed"], c["method"])]
        runs.append(Run(c["method"], c["schedule"], c["seed"],
                        [tuple(p) for p in c["curve"]], row["steps"], row["rounds"],
                        round(row["MB_sent"] * 1e6), list(c["taus"]), c["adacomm"],
                        record))
    return runs


def merge(results: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """One result from ``results`` (same suite, ranks, clock, options but ``PER_JOB``)."""
    for path, r in zip(sources, results):
        if r.get("suite") != "localsgd" or "curves" not in r:
            raise ValueError(f"{path}: not a bench localsgd result")
    check_mergeable(results, sources, options="args", per_job=PER_JOB)
    first = results[0]
    for path, r in zip(sources, results):
        if (r["step_s"], r["delay_s"], r["model_clock"]) != (
                first["step_s"], first["delay_s"], first["model_clock"]):
            raise ValueError(f"{path}: step or round time differs from {sources[0]}'s")
    runs = [run for r in results for run in runs_of(r)]
    keys = [(r.schedule, r.seed, r.method) for r in runs]
    if len(set(keys)) != len(keys):
        raise ValueError("a (schedule, seed, method) run appears in more than one result")
    schedules = list(dict.fromkeys(s for r in results
                                   for s in r["args"]["schedules"].split(",")))
    seeds = sorted({r.seed for r in runs})
    methods = list(dict.fromkeys(row["method"] for row in first["rows"]))
    for schedule in schedules:
        for seed in seeds:
            missing = [m for m in methods if (schedule, seed, m) not in set(keys)]
            if missing:
                raise ValueError(f"schedule {schedule!r}, seed {seed}: no run of {missing}")
    if METHOD_SYNC not in methods:
        raise ValueError(f"the results hold no {METHOD_SYNC} run")
    runs.sort(key=lambda r: (schedules.index(r.schedule), r.seed, methods.index(r.method)))
    rows, summary = summarize(runs, methods, schedules, seeds)
    out = merged_base(results, sources)
    out["args"] = dict(first["args"], seeds=len(seeds), seed_offset=seeds[0],
                       schedules=",".join(schedules), json=None)
    out["rows"] = rows
    out["summary"] = summary
    out["targets"] = targets(summary, schedules,
                             [m for m in methods if m.startswith("adacomm")])
    out["curves"] = [{"method": r.method, "schedule": r.schedule, "seed": r.seed,
                      "curve": r.curve, "taus": sorted(set(r.taus)), "adacomm": r.adacomm}
                     for r in runs]
    out["training_runs"] = [r.record for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    return merge_command(argv, __doc__.split("\n\n")[0], merge,
                         lambda merged: merged["targets"])


if __name__ == "__main__":
    raise SystemExit(main())
