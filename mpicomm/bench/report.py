"""``python -m mpicomm.bench report``: BENCHMARKS.md and PNG plots from the suites' JSON.

Reads every ``*.json`` that a suite wrote (``{"suite": ..., "machine": ...}``) under the
``--results`` folders (default ``bench-results``; ``make bench`` and ``make
bench-cluster`` write there), and writes

* ``--out`` (default ``BENCHMARKS.md``): the conditions of every run (machine, MPI,
  network kind, rate, delay, hosts x ranks per host, load average), the seed claims
  (from the virtual-clock runs, :mod:`.report_virtual`; then the wall-clock ones, measured
  and the cost model at ``--predict-ranks``), and one table per result file;
* ``--notes`` (default ``benchmarks/notes.md`` when it exists): hand-written remarks
  inserted after the seed-claim table;
* ``--plots`` (default ``benchmarks/`` next to ``--out``): ``collectives-*.png`` (time
  against size per algorithm, measured solid, cost model dashed), ``sparse-scaling.png``
  (dense, Allgather Top-k, gTop-k and AR-Top-k against rank count, one panel per network,
  measured and predicted side by side), ``localsgd-*.png`` (training loss against time:
  time-to-accuracy curves), ``hierarchy-speedups.png`` (hierarchical over flat
  collectives per host layout, against the targets).

``adaptive`` gets its time-to-accuracy table, the L-GreCo comparison and the
selector's targets marked met/missed. ``crossover`` results get a table of the three modes' median
throughput (sequential, co-located, Crossover), the speedups, the measured ``C`` and
``S`` and the bound ``(C+S)/max(C,S)``. ``hierarchy`` results get their rows and the
best hierarchical row's speed-up over the flat baseline against its target. ``accuracy`` files
(``examples/compression_accuracy.py --json``) get a table of test accuracy and bytes per
step per strategy label. Suites it does not know (``ps`` ...) get a generic table of
their ``rows``/``summary``; a file without ``suite`` is skipped with a note, and a file
with a run labelled by a strategy's bare name whose recorded recipe is no longer what the
name builds is refused (:func:`mpicomm.bench.ratios.check_labels`). Needs
matplotlib (``pip install -e ".[bench]"``) for the plots; without it the tables are still
written and the report says the plots were not made.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from . import report_virtual
from .ratios import check_labels, is_rows
from .report_control import adacomm_panel, has_adacomm, has_timeline, plot_adaptive
from .report_hierarchy import (
    hierarchy_section,
    plot_hierarchy,
    virtual_conditions,
    virtual_label,
)
from .report_ratios import section as ratios_section
from .report_recovery import recovery_section
from .report_suites import adaptive_section, crossover_section
from .report_training import plot_name, plot_runs, step_time_table, training_section

SPARSE_METHODS = ("dense", "allgather_topk", "gtopk", "artopk_star")
LABELS = {"dense": "dense allreduce (best own)", "allgather_topk": "Allgather Top-k",
          "gtopk": "gTop-k", "artopk_star": "AR-Top-k (STAR, ring)"}
PAPER = ("gTop-k paper (32 GPUs, 1 Gbit/s Ethernet): 2.7-12x the scaling efficiency of "
         "dense S-SGD and 1.1-1.7x that of Allgather Top-k S-SGD; AR-Top-k "
         "cheaper than Allgather Top-k as the rank count grows")


# ---------------------------------------------------------------------- loading
def load(folders: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    results, notes = [], []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError) as exc:
                notes.append(f"`{path}`: unreadable ({exc})")
                continue
            if isinstance(data, list) and is_rows(data):
                continue  # a ratios rows file: the ratios section recomputes them
            if not isinstance(data, dict) or "suite" not in data:
                notes.append(f"`{path}`: not a suite result (no `suite` field), skipped")
                continue
            data["_path"] = path
            config = data.get("config") or data.get("args") or {}
            check_labels(data.get("training_runs") or [], config.get("density"), path)
            results.append(data)
    return results, notes


def net(r: dict[str, Any]) -> dict[str, Any]:
    return (report_virtual.network(r) or r.get("machine", {}).get("network")
            or {"kind": "shared memory", "hosts": 1})


def net_label(r: dict[str, Any]) -> str:
    if virtual_label(r):
        return virtual_label(r)
    n = net(r)
    if r.get("model_clock"):   # localsgd --clock model: a declared platform
        return r["model_clock"]
    if n.get("kind") not in ("emulated cluster", "virtual cluster"):
        return "shared memory"
    virtual = " (virtual)" if n["kind"] == "virtual cluster" else ""
    return f"{n.get('rate')}, {n.get('delay_s', 0.0) * 1e3:g} ms{virtual}"


def ranks_of(r: dict[str, Any]) -> int:
    return int(r.get("ranks") or r.get("machine", {}).get("ranks") or 0)


# ---------------------------------------------------------------------- tables
def fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.3g}" if abs(v) < 1e5 else f"{v:.3e}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x) for x in v)
    return str(v).replace("|", "\\|")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
          limit: int | None = 60) -> str:
    """A markdown table of ``rows`` (``columns``: every scalar key by default), cut after
    ``limit`` rows with a line saying how many the JSON has beyond (``None``: all)."""
    if not rows:
        return "(no rows)\n"
    limit = len(rows) if limit is None else limit
    if columns is None:
        columns = []
        for r in rows:
            columns.extend(k for k, v in r.items() if k not in columns
                           and not isinstance(v, (dict, list)))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows[:limit]:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    if len(rows) > limit:
        lines.append(f"\n({len(rows) - limit} more rows in the JSON)")
    return "\n".join(lines) + "\n"


def load_note(results: Sequence[dict[str, Any]]) -> str:
    """How busy each machine was: its cores, result files, most ranks and highest 1-minute
    load average, one sentence per machine (results from a lent machine are not mixed with
    this one's)."""
    machines: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        m = r.get("machine", {})
        machines.setdefault((str(m.get("host", "?")), int(m.get("cpus") or 0)), []).append(r)
    notes, any_oversubscribed = [], False
    for (host, cpus), group in sorted(machines.items(), key=lambda kv: -len(kv[1])):
        ranks = max(ranks_of(r) for r in group)
        load = max((r["machine"]["loadavg"][0] for r in group
                    if r.get("machine", {}).get("loadavg")), default=None)
        text = (f"{host}, {cpus or '?'} CPU core(s): {len(group)} result file(s), up to "
                f"{ranks} ranks per run")
        if load is not None:
            text += f", 1-minute load average up to {load:.3g}"
        if cpus and (ranks > cpus or (load is not None and load > cpus)):
            text += " (**oversubscribed**)"
            any_oversubscribed = True
        notes.append(text + ".")
    text = ("The load average column is read when each suite finished. " + " ".join(notes))
    if any_oversubscribed:
        text += (" Where ranks outnumbered cores they waited for CPU time: compute-heavy "
                 "steps (top-k selection, gTop-k's merges) and message latency carry that "
                 "wait, so wall-clock figures from those runs are noisy; results marked "
                 "virtual or model clock do not depend on the load.")
    return text + "\n"


def conditions(results: Sequence[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        m, n = r.get("machine", {}), net(r)
        emulated = n.get("kind") in ("emulated cluster", "virtual cluster")
        rows.append({
            "file": os.path.basename(r["_path"]), "suite": r["suite"], "ranks": ranks_of(r),
            "network": n.get("kind"),
            "hosts x ranks/host": f"{n.get('hosts')} x {n.get('ranks_per_host', ranks_of(r))}"
            if emulated else "1 (one machine)",
            "rate (tc tbf)": n.get("rate") if emulated else "-",
            "delay (injected)": f"{n.get('delay_s', 0) * 1e3:g} ms" if emulated else "-",
            "machine": f"{m.get('host', '?')}, {m.get('cpus', '?')} cpus",
            "load avg (1/5/15 min)": fmt(m.get("loadavg")),
            "MPI": m.get("mpi"),
        })
        rows[-1].update(virtual_conditions(r))
    return table(rows, limit=None)


# ---------------------------------------------------------------------- sparse
def sparse_rows(r: dict[str, Any]) -> dict[tuple[int, float], dict[str, dict[str, Any]]]:
    """{(d, density): {method: row}} with ``dense`` = the faster own dense algorithm."""
    out: dict[tuple[int, float], dict[str, dict[str, Any]]] = {}
    for row in r.get("rows", []):
        key = (row["d"], row["density"])
        method = row["method"].rstrip(" *")
        group = out.setdefault(key, {})
        group[method] = row
        if method in ("dense/ring", "dense/rabenseifner"):
            best = group.get("dense")
            if best is None or row["seconds"] < best["seconds"]:
                group["dense"] = row
    return out


def claims(results: Sequence[dict[str, Any]]) -> str:
    """The seed-claim ratios for every sparse result on an emulated network (and shared
    memory for contrast): measured at its rank count, cost model at the predicted one."""
    rows = []
    for r in sorted((r for r in results if r["suite"] == "sparse"
                     and not report_virtual.is_virtual(r)),
                    key=lambda r: (net_label(r), ranks_of(r))):
        predicted = {(p["d"], p["density"]): p for p in r.get("predicted", [])}
        for (d, density), g in sorted(sparse_rows(r).items()):
            if not all(m in g for m in SPARSE_METHODS):
                continue
            dense, ag, gt, ar = (g[m]["seconds"] for m in SPARSE_METHODS)
            p = predicted.get((d, density), {})
            rows.append({
                "network": net_label(r), "ranks": ranks_of(r), "d": d, "density": density,
                "dense/gTop-k": dense / gt, "AG/gTop-k": ag / gt, "AG/AR-Top-k": ag / ar,
                "model ranks": p.get("ranks"),
                "model dense/gTop-k": 1 / p["gtopk/dense_t"] if p.get("gtopk/dense_t")
                else None,
                "model AG/gTop-k": 1 / p["gtopk/ag_t"] if p.get("gtopk/ag_t") else None,
                "model AG/AR-Top-k": 1 / p["artopk/ag_t"] if p.get("artopk/ag_t") else None,
            })
    if not rows:
        return "No sparse results yet (run `make bench-cluster`).\n"
    return ("Speed-ups of one aggregation call (time of the slower method / time of the "
            "faster; above 1: the sparse collective wins). Measured = median of the "
            "suite's repeats at the run's rank count; model = the alpha-beta cost model "
            "(`mpicomm.collectives.cost`, alpha/beta fitted in the same run) at the "
            "`model ranks` count. For reference, " + PAPER + ".\n\n" + table(rows))


# ---------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_collectives(r: dict[str, Any], path: str) -> None:
    plt = _plt()
    rows = r.get("rows", [])
    names = list(dict.fromkeys(row["collective"] for row in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [row for row in rows if row["collective"] == name]
        for i, alg in enumerate(dict.fromkeys(row["algorithm"] for row in mine)):
            pts = sorted((row["bytes"], row["seconds"], row.get("pred_s")) for row in mine
                         if row["algorithm"] == alg)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=alg)
            pred = [(p[0], p[2]) for p in pts if p[2]]
            if pred:
                ax.plot(*zip(*pred), "--", color=color, alpha=0.7)
        ax.set(xscale="log", yscale="log", xlabel="bytes", ylabel="seconds (median)",
               title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{r['suite']}: {ranks_of(r)} ranks, {net_label(r)}\n"
                 "solid: measured, dashed: cost model", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_sparse(results: Sequence[dict[str, Any]], path: str) -> tuple[int, float] | None:
    """Time against rank count per method, one panel per network, for the (d, density)
    that the most runs share (largest d, then density 0.01 when present)."""
    runs = [r for r in results if r["suite"] == "sparse"]
    if not runs:
        return None
    counts: dict[tuple[int, float], int] = {}
    for r in runs:
        for key in sparse_rows(r):
            counts[key] = counts.get(key, 0) + 1
    key = max(counts, key=lambda k: (counts[k], k[0], -abs(math.log10(k[1]) + 2)))
    plt = _plt()
    labels = sorted({net_label(r) for r in runs}, key=lambda s: (s != "shared memory", s))
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(labels), figsize=(max(6.0, 4.8 * len(labels)), 4.2),
                             squeeze=False, sharey=True)
    for ax, label in zip(axes[0], labels):
        mine = sorted((r for r in runs if net_label(r) == label and key in sparse_rows(r)),
                      key=ranks_of)
        for i, method in enumerate(SPARSE_METHODS):
            pts = [(ranks_of(r), sparse_rows(r)[key][method]) for r in mine
                   if method in sparse_rows(r)[key]]
            if not pts:
                continue
            ax.plot([p for p, _ in pts], [row["seconds"] for _, row in pts], "o-",
                    color=f"C{i}", label=LABELS[method])
            ax.plot([p for p, _ in pts], [row.get("pred_s") for _, row in pts], "x--",
                    color=f"C{i}", alpha=0.7)
        for r in mine[-1:]:  # the model's extrapolation from the largest run
            pred = next((p for p in r.get("predicted", [])
                         if (p["d"], p["density"]) == key), None)
            if pred:
                for i, col in enumerate(("dense_ms", "ag_ms", "gtopk_ms", "artopk_ms")):
                    ax.plot([pred["ranks"]], [pred[col] / 1e3], "s", color=f"C{i}",
                            mfc="none")
        ticks = sorted({ranks_of(r) for r in mine} | {32})
        ax.set(xscale="log", yscale="log", xlabel="ranks", title=label)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("seconds per aggregation")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"sparse aggregation, d={key[0]:.3g}, density={key[1]:g}\nsolid: measured,"
                 " dashed: cost model, hollow squares: model extrapolation", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return key


def plot_localsgd(r: dict[str, Any], path: str) -> None:
    plt = _plt()
    curves = r.get("curves", [])
    schedules = list(dict.fromkeys(c["schedule"] for c in curves))
    rows = 2 if has_adacomm(curves) else 1   # second row: AdaComm's period
    fig, axes = plt.subplots(rows, max(1, len(schedules)), squeeze=False,
                             figsize=(5 * max(1, len(schedules)), 3.8 * rows))
    for ax, schedule in zip(axes[-1] if rows == 2 else (), schedules):
        adacomm_panel(ax, curves, schedule)
    for ax, schedule in zip(axes[0], schedules):
        seeds = sorted({c["seed"] for c in curves if c["schedule"] == schedule})
        methods = list(dict.fromkeys(c["method"] for c in curves))
        for i, method in enumerate(methods):
            for c in curves:
                if (c["schedule"], c["method"], c["seed"]) == (schedule, method, seeds[0]):
                    t, loss = zip(*c["curve"]) if c["curve"] else ((), ())
                    ax.plot(t, loss, color=f"C{i}", label=method)
        ax.set(yscale="log", xlabel="seconds (clock of the run)", ylabel="training loss",
               title=f"{schedule} lr, seed {seeds[0]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"local SGD time to accuracy\n{ranks_of(r)} ranks, {net_label(r)}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------- report
def stem(r: dict[str, Any]) -> str:
    prefix = "virtual-" if report_virtual.is_virtual(r) else ""
    return prefix + os.path.splitext(os.path.basename(r["_path"]))[0]


def links(results: Sequence[dict[str, Any]]) -> str:
    """Configured against measured rate and latency (``mpicomm.emulate.pingpong``)."""
    rows = []
    for r in results:
        if r["suite"] != "pingpong":
            continue
        rate, delay = r.get("configured_rate_bits"), r.get("configured_delay_s", 0.0)
        rows.append({
            "network": net_label(r), "message B": r.get("bytes"),
            "configured Mbit/s": None if rate is None else rate / 1e6,
            "measured Mbit/s": r["bandwidth_bits"] / 1e6,
            "configured delay ms": delay * 1e3, "measured latency ms": r["latency_s"] * 1e3,
            "median latency ms": fmt(1e3 * r["latency_median_s"])
            if "latency_median_s" in r else None,
            "load avg": fmt(r.get("machine", {}).get("loadavg")),
        })
    if not rows:
        return ""
    return ("Ping-pong between two emulated hosts through mpicomm's point-to-point layer "
            "(`python -m mpicomm.emulate.pingpong`): what the network delivered when the "
            "suites ran. Latency = half the fastest round trip of 8-byte messages (the "
            "median where given); bandwidth = message bits / (half the fastest round trip "
            "- latency).\n\n" + table(rows))


def section(r: dict[str, Any]) -> str:
    suite = r["suite"]
    head = (f"### {suite}: {ranks_of(r)} ranks, {net_label(r)} (`{r['_path']}`)\n\n")
    if suite == "sparse":
        cols = ("d", "density", "k", "method", "time_ms", "pred_ms", "sent_B", "pred_B",
                "x_dense", "x_ag")
        return head + table(r.get("rows", []), cols)
    if suite == "collectives":
        return head + table(r.get("summary", []), ("collective", "elems", "best", "time_us",
                                                   "x_mpi", "x_gloo"))
    if suite == "accuracy":
        return head + accuracy(r) + training(r)
    if suite == "adaptive":
        return head + adaptive_section(r, table) + training(r)
    if suite == "crossover":
        return head + crossover_section(r, table)
    if suite == "hierarchy":
        return head + hierarchy_section(r, table)
    if suite == "recovery":
        return head + recovery_section(r, table)
    if suite == "ps":
        return head + "\n".join(f"**{key}**\n\n{generic(r[key])}"
                                 for key in ("summary", "rows", "comm", "straggler",
                                             "accuracy", "pull", "convergence",
                                             "convergence_summary")
                                 if r.get(key))
    body = [f"{key}:\n\n" + generic(r[key]) for key in ("summary", "targets", "rows", "results",
                                                      "comm", "straggler", "accuracy")
            if r.get(key)]
    return head + ("\n".join(body) if body else "(no rows or summary in this result)\n") \
        + training(r)


def training(r: dict[str, Any]) -> str:
    """Runs of the time-to-accuracy harness in ``r`` (:mod:`.report_training`)."""
    text = training_section(r, table, r.get("_training_plot"))
    return "\n" + text if text else ""


def accuracy(r: dict[str, Any]) -> str:
    """``examples/compression_accuracy.py --json``: test accuracy per strategy label
    (median of the seeds, gaps to dense in pp), bytes per rank per step against dense."""
    c = r.get("config", {})
    lr = f"lr {c.get('lr')}" + (f" (x0.1 from epoch {c['lr_decay']})" if c.get("lr_decay")
                                else " (constant)")
    rows = [{"strategy": row["strategy"],
             "seeds": " / ".join(f"{a:.2f}" for a in row["accuracies"]),
             "median %": f"{row['median']:.2f}", "gap pp": f"{row['gap_pp']:+.2f}",
             "worst pp": f"{row['worst_pp']:+.2f}", "kB/step": f"{row['kB_per_step']:.1f}",
             "vs dense": f"{row['x_dense']:.3g}x", "steps": row["steps"]}
            for row in r.get("summary", [])]
    task = (r.get("workload") or {}).get("description", "digits MLP")
    return (f"{task}, density {c.get('density')}, {c.get('epochs')} epochs, batch "
            f"{c.get('batch')}/rank, {lr}, seeds {r.get('seeds')}\n\n" + table(rows))


def generic(value: Any) -> str:
    """A suite's ``summary``/``rows`` of any shape: a list of dicts or one dict as a
    table, anything else as text."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return table(value)
    if isinstance(value, list):
        return "\n".join(f"* {fmt(v)}" for v in value) + "\n"
    return f"{fmt(value)}\n"


def write_report(results: Sequence[dict[str, Any]], notes: Sequence[str], out: str,
                 plots: str, command: str, remarks: str = "") -> list[str]:
    """Write the Markdown report and the plots; returns the plot files written."""
    os.makedirs(plots, exist_ok=True)
    rel = os.path.relpath(plots, os.path.dirname(os.path.abspath(out)) or ".")
    plot_note = ""
    ratios_text, made = ratios_section(results, plots, rel, table, _plt)
    try:
        _plt()
        for r in results:
            if r["suite"] == "collectives":
                name = f"{stem(r)}.png"
                plot_collectives(r, os.path.join(plots, name))
                made.append(name)
            elif r["suite"] == "localsgd" and r.get("curves"):
                name = f"{stem(r)}.png"
                plot_localsgd(r, os.path.join(plots, name))
                made.append(name)
            elif r["suite"] == "adaptive" and has_timeline(r):
                name = f"{stem(r)}-choices.png"
                plot_adaptive(r, os.path.join(plots, name), _plt())
                made.append(name)
        if plot_sparse(results, os.path.join(plots, "sparse-scaling.png")):
            made.append("sparse-scaling.png")
        if plot_hierarchy(results, os.path.join(plots, "hierarchy-speedups.png"), _plt()):
            made.append("hierarchy-speedups.png")
        for r in results:
            if plot_runs(r, os.path.join(plots, plot_name(r)), _plt()):
                r["_training_plot"] = f"{rel}/{plot_name(r)}"
                made.append(plot_name(r))
    except ImportError:
        plot_note = ("\n**No plots**: matplotlib is not installed (`pip install -e "
                     "\".[bench]\"`).\n")
    suites = sorted({r["suite"] for r in results})
    parts = [
        "# Benchmarks\n",
        f"Generated by `{command}` from {len(results)} result file(s) "
        f"(suites: {', '.join(suites) or 'none'}). Regenerate with `make bench-virtual` "
        "(any machine), or on a quiet one `make bench bench-cluster` (ends with this report).\n",
        "## How the network is emulated\n",
        "`make bench` runs on one machine's shared memory. `make bench-cluster` runs the "
        "same suites on `launchers/emulated-cluster`: one Linux network namespace per "
        "host, joined by veth pairs to a bridge in a switch namespace; MPI (MPICH, UCX "
        "over TCP on `eth0`, no shared-memory shortcut between hosts) crosses them.\n\n"
        "* **Kernel-shaped**: the *rate*. A `tc tbf` qdisc on both ends of every host's "
        "link (upload and download) limits it to the configured rate for all traffic: "
        "mpicomm's collectives, the MPI library's own collectives, everything.\n"
        "* **Injected**: the *latency*. This kernel has no `netem`, so mpicomm's own "
        "point-to-point layer (the collectives' `Ctx`, the sparse layer's `Wire`; "
        "`mpicomm/emulate/linkdelay.py`) sleeps the configured one-way delay before a message "
        "leaves for another host (one delay per burst of back-to-back sends).\n"
        "* **Bypasses the injected delay**: the MPI library's own collectives "
        "(`algorithm=\"mpi\"`, `dense/mpi` rows), the communicator's control helpers "
        "(`barrier`, `allreduce_value`, `bcast_object`), gloo, and any code that calls "
        "mpi4py directly. Those see the shaped rate but no added latency, so their rows "
        "understate a real network's latency cost.\n"
        "* The ping-pong check (`tests/test_emulated_cluster.py`, `python -m "
        "mpicomm.emulate.pingpong`) measures the configured rate and delay within 20%.\n"
        + report_virtual.HOW,
        "## Conditions of every result\n",
        load_note(results),
        conditions(results),
        links(results),
        "## Seed claims: gTop-k and AR-Top-k against dense and Allgather Top-k\n",
        report_virtual.seed_claims_section(results, net, table),
        "### The same claims on the wall clock, loaded (superseded by the table above)\n\n"
        "Kept for reference only: these runs put 4-16 ranks on 2 cores beside other jobs "
        "(load averages in the conditions table above), and the ping-pong above shows "
        "what that did to the emulated links (measured latency and rate far from the "
        "configured ones), so their times are the scheduler's, not the algorithms'. The "
        "virtual-clock table above replaces them.\n",
        claims(results),
        remarks,
        ratios_text,
        "## Time per step of the workloads\n\nMedian time of rank 0's training steps "
        "(evaluation excluded) by rank count, from the `train` results "
        "(`python -m mpicomm.bench train`): `wall` with one rank per core on a quiet "
        "machine, `virtual` on the virtual clock (the model's forward, backward and "
        "optimizer step charged from the cost table, communication by the network "
        "model; the Python loop around them is not charged).\n\n"
        + table(step_time_table(results))
        if step_time_table(results) else "",
        "## Plots\n" + plot_note,
    ]
    for name in (n for n in made if not n.startswith("ratios-")):
        parts.append(f"![{name}]({rel}/{name})\n")
    parts.append("## Results by file\n")
    parts.extend(section(r) + (f"\n*Note:* {r['note']}\n" if r.get("note") else "")
                 for r in results if r["suite"] != "pingpong")
    if notes:
        parts.append("## Skipped files\n")
        parts.extend(f"* {n}\n" for n in notes)
    with open(out, "w") as f:
        f.write("\n".join(parts))
    return made


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", action="append", default=None,
                        help="folder of suite JSON files (repeatable; default bench-results)")
    parser.add_argument("--out", default="BENCHMARKS.md", help="Markdown file to write")
    parser.add_argument("--plots", default=None,
                        help="folder for the PNG plots (default: benchmarks/ beside --out)")
    parser.add_argument("--notes", default=None,
                        help="Markdown inserted after the seed-claim table (default: "
                             "notes.md in the plots folder, when it exists)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpicomm.bench report",
                                 description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    folders = args.results or ["bench-results"]
    plots = args.plots or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                       "benchmarks")
    results, notes = load(folders)
    if not results:
        print(f"report: no suite results under {', '.join(folders)} (run make bench)",
              file=sys.stderr)
        return 1
    command = "python -m mpicomm.bench report " + " ".join(
        [f"--results {f}" for f in folders] + [f"--out {args.out}"])
    notes_file = args.notes or os.path.join(plots, "notes.md")
    remarks = ""
    if os.path.exists(notes_file):
        with open(notes_file) as f:
            remarks = f.read()
    elif args.notes:
        print(f"report: --notes {args.notes} does not exist", file=sys.stderr)
        return 1
    made = write_report(results, notes, args.out, plots, command, remarks)
    print(f"wrote {args.out} ({len(results)} results) and {len(made)} plot(s) in {plots}")
    return 0

