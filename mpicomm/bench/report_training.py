"""The report's training pages: time-to-accuracy curves and time per step.

Every suite result that holds ``training_runs`` (the records of
:mod:`mpicomm.bench.harness`: ``bench train``, ``adaptive``, ``localsgd``, ``ps``
sections, ``examples/compression_accuracy.py``) gets

* a table per file: method, seed, steps, final metric, time to the run's target, bytes
  sent per step, and the corpus checksum of text workloads;
* a plot per file (``train-<file>.png``): the metric against the training clock and
  against the bytes each rank sent, one line per method (first seed), y on a log scale
  for perplexity and losses;

and across the ``train`` results, a table of the median time per step of each workload by
rank count (the scaling baseline: rank 0's steps after the first five, evaluation
excluded).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from .report_virtual import is_virtual


def steady(step_s: list[float]) -> list[float]:
    """``step_s`` without its first ``min(5, len // 4)`` entries (warm-up: the first steps
    pay for lazy set-up)."""
    return step_s[min(5, len(step_s) // 4):]


#: The suites of :mod:`mpicomm.bench.report` whose own section already tabulates the runs.
OWN_TABLES = ("adaptive", "localsgd", "accuracy")


def runs_of(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [x for x in r.get("training_runs") or [] if x.get("curve")]


def corpus_note(runs: Sequence[dict[str, Any]]) -> str:
    """The text corpus of the runs (file count, bytes, SHA-256), when there is one."""
    seen = {}
    for x in runs:
        corpus = (x.get("info") or {}).get("data", {}).get("corpus")
        if corpus:
            seen[corpus["sha256"]] = corpus
    return "".join(f"Corpus: {len(c['files'])} files of `{c['root']}`, {c['bytes']} bytes, "
                   f"SHA-256 `{c['sha256']}`.\n\n" for c in seen.values())


def runs_table(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for x in runs_of(r):
        final = x["curve"][-1]
        steps = max(x.get("steps") or 0, 1)
        step_s = steady(x.get("step_s") or [])
        rows.append({"method": x["label"], "seed": x["seed"], "workload": x["workload"],
                     "steps": x["steps"], x["metric"]: final.get(x["metric"]),
                     "time_s": x["seconds"], "time_to_target_s": x.get("time_to_target_s"),
                     "step_ms": 1e3 * statistics.median(step_s) if step_s else None,
                     "kB_per_step": x["sent_bytes"] / steps / 1e3})
    return rows


def plot_runs(r: dict[str, Any], path: str, plt: Any) -> bool:
    """Metric against time and against bytes, one line per method (its first seed)."""
    runs = runs_of(r)
    if not runs:
        return False
    first: dict[str, dict[str, Any]] = {}
    for x in runs:
        first.setdefault(x["label"], x)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    metric = runs[0]["metric"]
    for i, (label, x) in enumerate(first.items()):
        key = x["metric"]
        curve = [p for p in x["curve"] if key in p]
        axes[0].plot([p["time_s"] for p in curve], [p[key] for p in curve], color=f"C{i % 10}",
                     label=label)
        axes[1].plot([max(p["bytes"], 1) for p in curve], [p[key] for p in curve],
                     color=f"C{i % 10}", label=label)
    log = metric in ("perplexity", "loss")
    axes[0].set(xlabel="training clock (s, evaluation excluded)", ylabel=metric,
                yscale="log" if log else "linear")
    axes[1].set(xlabel="bytes sent per rank", ylabel=metric, xscale="log",
                yscale="log" if log else "linear")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{r['suite']}: {runs[0]['workload']}, {runs[0]['ranks']} ranks "
                 f"(first seed of each method)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def clock_of(r: dict[str, Any]) -> str:
    """``"virtual"`` or ``"wall"``: the clock a result was timed on."""
    return "virtual" if is_virtual(r) else "wall"


def oversubscribed(r: dict[str, Any]) -> bool:
    """A wall-clock result taken with more runnable processes than cores (1-minute load
    average above the core count, or more ranks than cores): its times measure the
    scheduler, so they are no baseline."""
    m = r.get("machine", {})
    cpus = m.get("cpus") or 1
    load = (m.get("loadavg") or [0.0])[0]
    return clock_of(r) == "wall" and (load > cpus or (m.get("ranks") or 1) > cpus)


def oversubscribed_note(r: dict[str, Any]) -> str:
    """A warning line above the runs of an :func:`oversubscribed` result (else "")."""
    if not oversubscribed(r):
        return ""
    m = r.get("machine", {})
    load = (m.get("loadavg") or [0.0])[0]
    return (f"Wall clock, {m.get('ranks') or 1} ranks on {m.get('cpus') or 1} cores, load "
            f"average {load:.1f} at the start: `time_s`, `time_to_target_s` and `step_ms` "
            "measure the machine's scheduler, not the method; compare the metric and the "
            "bytes only.\n")


def step_time_table(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median time per step (ms) of each workload and method by rank count and clock,
    from the ``train`` results; wall-clock results of an oversubscribed machine are left
    out."""
    cells: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in results:
        if r.get("suite") != "train" or oversubscribed(r):
            continue
        for x in runs_of(r):
            if x.get("step_s"):
                key = (x["workload"], x["label"])
                column = f"{x['ranks']} ranks ms ({clock_of(r)})"
                cells.setdefault(key, {}).setdefault(column, []).append(
                    1e3 * statistics.median(steady(x["step_s"])))
    columns = sorted({c for per in cells.values() for c in per},
                     key=lambda c: (int(c.split()[0]), c))
    rows = []
    for (workload, label), per in sorted(cells.items()):
        row: dict[str, Any] = {"workload": workload, "method": label}
        for c in columns:
            row[c] = statistics.median(per[c]) if c in per else None
        rows.append(row)
    return rows


def training_section(r: dict[str, Any], table: Any, plot_rel: str | None) -> str:
    """The runs of one result file (table, corpus, plot link); empty without runs."""
    runs = runs_of(r)
    if not runs:
        return ""
    out = [corpus_note(runs)]
    if r["suite"] not in OWN_TABLES:
        out.append(oversubscribed_note(r))
        out.append(table(runs_table(r)))
    if plot_rel:
        out.append(f"![time to accuracy]({plot_rel})\n")
    return "\n".join(x for x in out if x)


def plot_name(r: dict[str, Any]) -> str:
    return f"train-{os.path.splitext(os.path.basename(r['_path']))[0]}.png"
