"""Merge ``bench adaptive`` results of one comparison run as separate jobs (``--only``).

Under the virtual clock every method's times are the simulated cluster's, so methods run
one job at a time (one per ``--only``) compare exactly as if run in one job, provided the
jobs share the workload, ranks, target, platform and cost table: this script checks
that, puts the rows together (dense first, auto last), recomputes the targets
(:func:`mpicomm.bench.adaptive.summarize`) and writes one result the report renders::

    python benchmarks/adaptive_merge.py OUT.json auto.json gtopk.json dense.json

A method may come from several jobs with different seeds (``--seed-offset``): its runs
are joined and its row is their median again. Every method of the result must then have
run the same seeds, so the medians compare like with like.
"""

from __future__ import annotations

from typing import Any

from mpicomm.bench.adaptive import median_row, summarize
from mpicomm.bench.merge import check_mergeable, merge_command

#: Options that may differ between the merged jobs (which methods, where the JSON went,
#: whether a fixed choice stopped at the target).
PER_JOB = ("only", "json", "static", "stop_at_target", "lgreco_families", "auto_option",
           "seeds", "seed_offset", "merged_from")


def join_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method from ``rows`` that may repeat a method with other seeds: its
    runs joined (in seed order) and their median taken again (``median_row``). Raises
    ``ValueError`` when a (method, seed) comes twice or the methods ran different seeds."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        runs.setdefault(row["method"], []).extend(row.get("runs") or [row])
    seeds = {}
    for method, its in runs.items():
        order = [r.get("seed", 0) for r in its]
        if len(set(order)) != len(order):
            raise ValueError(f"a method appears twice: {method} with seeds {order}")
        its.sort(key=lambda r: r.get("seed", 0))
        seeds[method] = sorted(order)
    if len({tuple(s) for s in seeds.values()}) > 1:
        raise ValueError(f"the methods ran different seeds: {seeds}")
    return [median_row(its) for its in runs.values()]


def merge(results: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """One result from ``results`` (same suite, ranks, options but ``PER_JOB``, clock
    as :func:`mpicomm.bench.merge.charged` reads it)."""
    for path, r in zip(sources, results):
        if r.get("suite") != "adaptive":
            raise ValueError(f"{path}: not a bench adaptive result")
    check_mergeable(results, sources, options="options", per_job=PER_JOB)
    first = results[0]
    rows = join_seeds([row for r in results for row in r["rows"]])
    rows.sort(key=lambda row: (row["method"] != "dense", row["method"] == "auto"))
    summary = summarize(rows)
    lgreco = [row for r in results for row in r.get("lgreco", [])]
    for r in results:
        summary.update({k: v for k, v in r["summary"].items() if k.startswith("lgreco_")})
    seeds = [run.get("seed", 0) for run in rows[0]["runs"]] if rows else []
    options = dict(first["options"], only=",".join(row["method"] for row in rows),
                   seeds=len(seeds), seed_offset=min(seeds, default=0),
                   merged_from=[m for path, r in zip(sources, results)
                                for m in r["options"].get("merged_from", [path])])
    return {"suite": "adaptive", "machine": first.get("machine"), "ranks": first["ranks"],
            "options": options, "clock": first.get("clock"), "rows": rows,
            "lgreco": lgreco, "summary": summary,
            "training_runs": [run for r in results for run in r.get("training_runs", [])]}


def main(argv: list[str] | None = None) -> int:
    return merge_command(argv, __doc__.splitlines()[0], merge,
                         lambda merged: [f"{key}: {value}" for key, value
                                         in merged["summary"].items() if key != "ratio_moves"])


if __name__ == "__main__":
    raise SystemExit(main())
