"""The report's compression-ratio pages: ``ratios`` results (:mod:`mpicomm.bench.ratios`).

Across every ``ratios`` result file: one table of the medians over seeds per workload,
rank count, strategy label, density and run length (gap to dense of the same seed, worst
seed, dense's whole-run bytes over the strategy's, and whether the bounds of
:data:`~mpicomm.bench.ratios.GAP_BOUND` / :data:`~mpicomm.bench.ratios.BYTES_TARGET`
hold), then ``ratios-notes.md`` from the plots folder when it exists, and per
(workload, rank count) a trade-off plot (median gap against bytes ratio). Per file, three
plots of its first seed (``ratios-<file>-*.png``):

* ``curve``: the metric against the bytes each rank had sent (max over ranks) at every
  evaluation, one line per strategy: accuracy against bytes;
* ``residual``: the L2 norm of the error-feedback memory (mean over ranks) against the
  step, with the norm of the synchronized update dashed;
* ``density``: per layer, the fraction of its entries the synchronized update changed,
  averaged over the run (log scale; dense is 1 wherever a layer has a gradient).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from .ratios import collect, medians, runs_by_file

#: Hand-written remarks on the ratios results, read from the plots folder when present.
NOTES = "ratios-notes.md"


def ratio_results(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r.get("suite") == "ratios"]


def summary_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The medians table over every ``ratios`` file of ``results``."""
    runs = runs_by_file(ratio_results(results))
    metrics = {x["workload"]: x["metric"] for x in runs}
    rows = medians(collect(runs, steps=True), metrics)
    for row in rows:
        row["metric_gap"] = f"{row['metric_gap']:+.2f}"
        row["worst_gap"] = f"{row['worst_gap']:+.2f}"
        row["bytes_vs_dense"] = f"{row['bytes_vs_dense']:.3g}x"
        row["unit"] = "% ppl" if metrics.get(row["workload"]) == "perplexity" else "pp"
    rows.sort(key=lambda w: (w["workload"], w["ranks"], w["density"] or 0.0, w["strategy"],
                             w["steps"]))
    return rows


def _first_seed(r: dict[str, Any]) -> list[dict[str, Any]]:
    runs = r.get("training_runs", [])
    if not runs:
        return []
    seed = min(x["seed"] for x in runs)
    return [x for x in runs if x["seed"] == seed]


def plot_file(r: dict[str, Any], folder: str, stem: str, plt: Any) -> list[str]:
    """The three plots of one ``ratios`` file; returns their file names."""
    runs = _first_seed(r)
    if not runs:
        return []
    made = []
    metric = runs[0]["metric"]
    title = (f"{runs[0]['workload']}, {r.get('ranks')} ranks, density "
             f"{(r.get('args') or {}).get('density')}, seed {runs[0]['seed']}")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for x in runs:
        pts = [p for p in x["curve"] if p.get("bytes")]
        ax.plot([p["bytes"] for p in pts], [p[metric] for p in pts], marker=".",
                label=x["label"])
    ax.set_xscale("log")
    if metric == "perplexity":
        ax.set_yscale("log")
    ax.set_xlabel("bytes sent per rank so far (max over ranks)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    made.append(_save(fig, plt, folder, f"{stem}-curve.png"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, x in enumerate(runs):
        probe = x.get("probe") or {}
        if not probe.get("steps"):
            continue
        color = f"C{i % 10}"
        if any(probe["residual_norm"]):
            ax.plot(probe["steps"], probe["residual_norm"], color=color,
                    label=f"{x['label']} residual")
        ax.plot(probe["steps"], probe["update_norm"], color=color, linestyle="--",
                linewidth=0.8, label=f"{x['label']} update")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("L2 norm")
    ax.set_title(title + ": error-feedback residual (solid), update (dashed)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    made.append(_save(fig, plt, folder, f"{stem}-residual.png"))

    fig, ax = plt.subplots(figsize=(8, 4.2))
    probed = [x for x in runs if (x.get("probe") or {}).get("density")]
    if probed:
        layers = probed[0]["probe"]["layers"]
        width = 0.8 / len(probed)
        for i, x in enumerate(probed):
            windows = x["probe"]["density"]
            mean = [sum(w[j] for w in windows) / len(windows) for j in range(len(layers))]
            ax.bar([j + i * width for j in range(len(layers))],
                   [max(v, 1e-6) for v in mean], width, label=x["label"])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))])
        ax.set_xticklabels([f"{n}\n({s})" for n, s in zip(layers, probed[0]["probe"]["sizes"])],
                           fontsize=6, rotation=30)
        ax.set_yscale("log")
        ax.set_ylabel("fraction of entries updated per step")
        ax.set_title(title + ": per-layer density of the update (run mean)", fontsize=9)
        ax.legend(fontsize=7)
    made.append(_save(fig, plt, folder, f"{stem}-density.png"))
    return made


def plot_tradeoff(rows: Sequence[dict[str, Any]], folder: str, plt: Any) -> list[str]:
    """Per (workload, ranks): every strategy's median gap against its median bytes ratio
    (``ratios-tradeoff-<workload>-<ranks>.png``): the trade-off reached."""
    made = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["ranks"]), []).append(row)
    for (workload, ranks), mine in sorted(groups.items()):
        longest = max((row.get("steps") or 0) for row in mine)
        # each point carries a number and the legend names it: labels written beside the
        # points overlap where several strategies end at the same place
        shown = [row for row in mine if row["bytes_vs_dense"] is not None
                 and row["bytes_vs_dense"] == row["bytes_vs_dense"]]  # NaN: one rank
        shown.sort(key=lambda row: (row["bytes_vs_dense"], row["metric_gap"], row["strategy"]))
        fig, ax = plt.subplots(figsize=(10, max(4.8, 1.2 + 0.12 * len(shown))))
        for number, row in enumerate(shown, 1):
            x, y = row["bytes_vs_dense"], row["metric_gap"]
            label = row["strategy"] + (f"@{row['density']:g}" if row["density"] else "")
            if (row.get("steps") or longest) < longest:
                label += f" ({row['steps']} steps)"
            ax.scatter([x], [y], s=18, label=f"{number}: {label} ({x:.1f}x, {y:+.2f})")
            ax.annotate(str(number), (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        if shown:
            ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        unit = "% of perplexity" if "lm" in workload else "points of accuracy"
        ax.axhline(-0.5 if unit.startswith("points") else -2.0, color="grey", linestyle=":")
        for target in (20, 50):
            ax.axvline(target, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        gaps = [row["metric_gap"] for row in shown]
        if gaps and min(gaps) < -10:
            # linear within 2 of dense, where the bound lies; logarithmic beyond
            ax.set_yscale("symlog", linthresh=2, linscale=1.5)
            ax.set_yticks([t for t in (-50, -20, -10, -5, -2, -1, -0.5, 0, 1, 2, 5)
                           if t >= min(gaps) * 1.2])
            ax.set_yticklabels([f"{t:g}" for t in ax.get_yticks()])
            ax.set_ylim(top=max(gaps) + 0.5)
        ax.set_xlabel("dense's bytes / the strategy's (whole run, all ranks)")
        ax.set_ylabel(f"gap to dense, {unit} (median over seeds)")
        ax.set_title(f"{workload}, {ranks} ranks: bytes saved against the metric lost",
                     fontsize=9)
        made.append(_save(fig, plt, folder, f"ratios-tradeoff-{workload}-{ranks}.png",
                          fit=True))
    return made


def _save(fig: Any, plt: Any, folder: str, name: str, fit: bool = False) -> str:
    """Write the figure as ``folder/name`` and close it (``fit``: grow the image to hold
    what sits outside the axes, such as a legend beside them)."""
    fig.tight_layout()
    fig.savefig(os.path.join(folder, name), dpi=90, bbox_inches="tight" if fit else None)
    plt.close(fig)
    return name


def section(results: Sequence[dict[str, Any]], folder: str, rel: str,
            table: Callable[..., str], pyplot: Callable[[], Any]) -> tuple[str, list[str]]:
    """The report's compression-ratio section and the plots it made (``pyplot()``: the
    pyplot module; tables only when it raises ``ImportError``)."""
    files = ratio_results(results)
    if not files:
        return "", []
    try:
        plt = pyplot()
    except ImportError:
        plt = None
    raw = medians(collect(runs_by_file(files), steps=True))
    rows = summary_rows(results)
    out = ["## Compression ratios against dense, whole runs\n",
           "From `python -m mpicomm.bench ratios` (`make bench-ratios`). Per workload, "
           "rank count, strategy, density and run length (steps): the median over seeds "
           "of the gap to dense of the same seed, from the same job where it ran one "
           "(`pp`: points of accuracy; `% ppl`: percent of dense's perplexity; "
           "negative = worse), the worst seed, and "
           "dense's total bytes over the strategy's (every byte of the run summed over "
           "the ranks, warm-up included). `met`: gap within 0.5 pp / 2% perplexity and, "
           "at densities 0.001 and 0.01, at least 50x / 20x fewer bytes. One row per "
           "run: `benchmarks/results/compression-ratios.json`.\n",
           table(rows, ("workload", "ranks", "strategy", "density", "steps", "seeds",
                        "unit", "metric_gap", "worst_gap", "bytes_vs_dense", "met"),
                 limit=None) + "\n"]
    notes = os.path.join(folder, NOTES)
    if os.path.exists(notes):
        with open(notes) as f:
            out.append(f.read())
    made: list[str] = []
    if plt is not None:
        os.makedirs(folder, exist_ok=True)
        names = plot_tradeoff(raw, folder, plt)
        made.extend(names)
        out.extend(f"![{n}]({rel}/{n})\n" for n in names)
        for r in files:
            stem = "ratios-" + os.path.splitext(os.path.basename(r.get("_path", "run")))[0]
            names = plot_file(r, folder, stem, plt)
            made.extend(names)
            out.extend(f"![{n}]({rel}/{n})\n" for n in names)
    return "\n".join(out), made
