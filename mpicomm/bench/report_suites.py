"""Report sections of the ``adaptive`` and ``crossover`` suites (``bench report``).

Each takes a result dict and the report's table renderer and returns Markdown.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

Table = Callable[..., str]


#: The selector's targets for ``bench adaptive``: summary key -> (test, wording).
ADAPTIVE_TARGETS: dict[str, tuple[Any, str]] = {
    "auto_vs_best_static": (lambda v, target=1.05: v <= target,
                            "auto's time-to-accuracy <= {target}x the best static "
                            "(strategy, ratio)"),
    "auto_overhead_pct": (lambda v: v <= 3.0, "calibration, probes, reference "
                          "selections and exploration <= 3% of auto's run"),
    "ratio_move_factor_min": (lambda v: v >= 2.0, "the chosen ratio moves >= 2x after "
                              "every change of the network (median over seeds)"),
    "auto_speedup_vs_dense": (lambda v: v >= 2.0, "auto >= 2x faster than dense"),
    "auto_acc_loss_points": (lambda v: v <= 0.5, "auto's final accuracy within 0.5 points "
                             "of dense"),
    "lgreco_bytes_ratio": (lambda v: v >= 2.0, "L-GreCo (top-k) >= 2x fewer bytes per "
                           "step than uniform at the same total error"),
    "lgreco_time_to_target_ratio": (lambda v: v <= 0.9, "L-GreCo (top-k) reaches the "
                                    "target in <= 0.9x uniform's time"),
}


def adaptive_section(r: dict[str, Any], table: Table) -> str:
    """``bench adaptive``: time-to-accuracy per method, L-GreCo against uniform, and the
    targets (met or missed) from the run's own ratios."""
    opts = r.get("options", {})
    schedule = (r.get("machine", {}).get("network") or {}).get("schedule")
    model = (f"Digits MLP 64-{opts.get('hidden')}-{opts.get('hidden')}-10"
             if opts.get("workload", "digits-mlp") == "digits-mlp" else
             f"`{opts.get('workload')}` {' '.join(opts.get('option') or [])}")
    network = None
    if opts.get("link") == "virtual":
        network = (f"virtual clock, {r.get('ranks')} ranks, rate {opts.get('rate')} delay "
                   f"{opts.get('delay')}")
        if opts.get("virtual_schedule"):
            network += f", schedule `{os.path.basename(opts['virtual_schedule'])}`"
    out = [f"{model}, "
           f"{opts.get('epochs')} epochs, batch {opts.get('batch')}/rank, target accuracy "
           f"{opts.get('target')}; network: "
           + (network if network else
              f"injected schedule `{opts.get('schedule')}` (EPOCH:Gbit/s:alpha_us)"
              if opts.get("link") != "emulated" else
              f"emulated cluster, schedule `{os.path.basename(schedule or '')}`"
              ) + (f"; medians of {opts['seeds']} runs (batch orders), accuracy checked every "
                   f"{opts.get('eval_every', 1)} step(s), choices of the first run"
                   if opts.get("seeds", 1) > 1 else "") + ".\n",
           table(r.get("rows", []), ("method", "time_to_target_s", "final_acc", "step_ms",
                                     "sent_kB_step", "x_dense", "choices")),
           "L-GreCo against every layer at the uniform setting (bytes per step measured; "
           "DP size / uniform size at the same total error):\n",
           table(r.get("lgreco", []), ("method", "seed", "time_to_target_s", "sent_kB_step",
                                       "final_acc", "dp_size_vs_uniform",
                                       "dp_error_vs_budget"))]
    summary = r.get("summary", {})
    rows = []
    for key, value in summary.items():
        if key == "ratio_moves":
            continue
        test = ADAPTIVE_TARGETS.get(key)
        verdict, wording = "", test[1] if test else ""
        if test is not None:
            bound = summary.get(f"{key}_target")
            met = None if value is None else (test[0](value) if bound is None
                                                  else test[0](value, bound))
            wording = wording.format(target=1.05 if bound is None else bound)
            verdict = "no result" if met is None else ("met" if met else "MISSED")
        rows.append({"measure": key, "value": value, "target": wording,
                     "verdict": verdict})
    out.append(table(rows, ("measure", "value", "target", "verdict")))
    if summary.get("ratio_moves"):
        out.append("auto's ratio around every change of the network (first seed; "
                   "`factor` = the larger over the smaller):\n")
        out.append(table(summary["ratio_moves"], ("step", "from_gbit", "to_gbit",
                                                  "to_delay_ms", "scheme_before",
                                                  "ratio_before", "scheme_after",
                                                  "ratio_after", "factor")))
    return "\n".join(out)


def crossover_section(r: dict[str, Any], table: Table) -> str:
    """Sequential / co-located / Crossover throughput next to the bound, then the repeats."""
    rows, summary, args = r.get("rows", []), r.get("summary", {}), r.get("args", {})

    def median(key: str) -> float | None:
        values = sorted(row[key] for row in rows if isinstance(row.get(key), (int, float)))
        if not values:
            return None
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    poll = r.get("wait_poll_s")
    line = {
        "jobs x steps": f"{args.get('jobs')} x {args.get('steps')}",
        "repeats": len(rows),
        "C ms": summary.get("C_ms"), "S ms": summary.get("S_ms"),
        "injected delay ms": 1e3 * r.get("delay_s", 0.0),
        "wait poll ms": "off" if poll is None else 1e3 * poll,
        "sequential it/s": median("sequential_it_s"),
        "co-located it/s": median("colocated_it_s"),
        "crossover it/s": median("crossover_it_s"),
        "co-located x seq": summary.get("colocated_vs_sequential"),
        "crossover x seq": summary.get("speedup_vs_sequential"),
        "crossover x co-located": summary.get("speedup_vs_colocated"),
        "crossover spinning x seq": summary.get("spin_vs_sequential"),
        "bound (C+S)/max(C,S)": summary.get("bound"),
        "hidden": summary.get("hidden_fraction"),
        "target >= 1.3x": summary.get("target_met"),
        "bit-identical": summary.get("identical_to_sequential"),
    }
    return ("Medians over the repeats (speedups are medians of per-repeat ratios); "
            "C, S: compute and sync time per iteration of a job run alone.\n\n"
            + table([line]) + "\n"
            + table(rows, ("repeat", "C_ms", "S_ms", "Cx_ms", "Sx_ms", "wait_ms",
                           "sequential_s", "colocated_s",
                           "crossover_s", "x_vs_sequential", "x_vs_colocated", "bound",
                           "hidden", "identical")))
