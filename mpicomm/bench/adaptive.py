"""Adaptive selector: time-to-accuracy of dense, static (scheme, ratio) and auto; L-GreCo bytes.

Run under MPI with 4+ ranks, e.g.
``mpiexec -n 4 python -m mpicomm.bench adaptive --json adaptive.json``.

* Task: the ``digits-mlp`` workload (:mod:`mpicomm.workloads`: scikit-learn's bundled
  digits, 1437 train / 360 test images, a fresh disjoint shard per rank every epoch), an
  MLP 64-``hidden``-``hidden``-10, SGD with momentum, ``--epochs``, trained through the
  time-to-accuracy harness (:mod:`mpicomm.bench.harness`).
* Network, ``--link``:

  - ``injected`` (default): before each message of mpicomm's own point-to-point layer
    the sender sleeps ``alpha + beta·bytes`` (:func:`mpicomm.emulate.linkdelay.set_link`),
    the alpha-beta time of a slower link on top of shared memory. ``--schedule``
    changes it during the run (``"EPOCH:GBPS:ALPHA_US,..."``, default 0.1 Gbit/s and
    100 us, from epoch 6 on 0.05 Gbit/s and 500 us). Works anywhere, no root.
  - ``virtual``: the virtual clock's network (``--clock virtual --rate R --delay L``,
    :mod:`mpicomm.clock`; a schedule file with ``--virtual-schedule``, keyed by step or
    virtual time): the step charged from the cost table, every message timed by the
    network model, so times do not depend on the machine's load. The default, and the
    only choice, under the virtual clock.
  - ``emulated``: the emulated cluster (``launchers/emulated-cluster``, root):
    tc-shaped rate and the latency :mod:`mpicomm.emulate.linkdelay` injects in mpicomm's own
    point-to-point layer; the bench adds no delay of its own, ``--schedule`` is ignored
    and the emulator's ``--schedule`` file (``step N RATE DELAY`` lines) changes the
    network: rank 0 reports every step of the method in training
    (:func:`mpicomm.emulate.linkdelay.report_step`), counting from 1 for each method, and the
    emulator re-arms its step entries when the count starts again, so every method
    (and every L-GreCo run) meets the same network at the same steps. The bench refuses
    to start in this mode outside the emulator. Measured run::

        launchers/emulated-cluster --hosts 4 --rate 100mbit --delay 1ms \
            --schedule benchmarks/schedule-adaptive.txt -- \
            .venv/bin/python -m mpicomm.bench adaptive --link emulated --seeds 3 \
            --json benchmarks/results/cluster/adaptive-emulated-4.json

  Defaults make communication dominate the step (hidden 1024: 1.1 M parameters, 4.4 MB
  of float32 gradient per step, 6.8 MB sent per rank by the dense ring allreduce with 4
  ranks: 0.54 s at 0.1 Gbit/s, against tens of ms of compute). Dense reaches the
  default target 0.96 in about 2 epochs, top-k at 0.01 with error feedback in about 6:
  at 1 Gbit/s on this 1 M-parameter model the link costs less than that difference
  (there compressed methods lose in time-to-accuracy, though their steps are 2x faster).
* Methods: ``dense``; each static ``scheme@ratio`` of ``--static``; ``auto``
  (:class:`mpicomm.strategies.AutoStrategy` with its defaults: calibrated selector + CR
  controller, a probe at step 0 and probes at the ratio in force later (``--window``:
  steps per ratio of an exploration window, where windows are used); told the run's
  length, ``total_steps``, as a scheduler would be). Each
  run reports the wall time (max over ranks, evaluation
  excluded) until the test accuracy first reaches ``--target``, checked every
  ``--eval-every`` steps (default 1: at 11 steps per epoch a per-epoch check alone moves
  a time-to-accuracy by up to 20%, more than the 10% the target allows), the final
  accuracy, the time per step and the bytes sent per step. ``--seeds N`` runs every
  method N times with different seeds (initial model and batch order) and reports the
  medians (one test image is 0.28 points of accuracy, so whether a run crosses 0.96 a
  few steps earlier or later is partly luck; the per-run numbers are in the JSON).
  ``--stop-at-target`` ends each static method's run at the check that reaches the
  target (a fixed choice's later steps cannot change its time to it; dense and auto run
  to the end, for their final accuracies); ``--max-steps`` ends every run early
  (per-step times on one network). Under the virtual clock, methods run as separate jobs
  (``--only``) with the same cost table (``--costs``) compare exactly:
  ``benchmarks/adaptive_merge.py`` puts their results together.
* L-GreCo, per family of ``--lgreco-families`` (``topk``: ``auto`` at ratio
  ``--lgreco-ratio`` with Allgather Top-k; ``qsgd``: 4 bits, ``powersgd``: rank 4, the
  per-layer schemes of :mod:`mpicomm.strategies.lgreco_buckets`): every layer at the uniform
  setting (L-GreCo never adjusts) against L-GreCo's per-layer settings (DP every 10
  steps, budget = the uniform setting's total error); bytes per step (measured, the
  first 10 steps of both uniform) and the DP's own size vs the uniform size at the same
  total error, averaged over the adjustments.

Targets: auto's time to the target at most 0.85x the best fixed (scheme, ratio) on a
network that changes, at most 1.05x on a constant one; >= 2x faster than dense at
<= 1 Gbit/s; final accuracy within 0.5 points of dense; L-GreCo >= 2x fewer bytes than
uniform at the same total error, and time to the target <= 0.9x uniform's.
Times on a shared machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import clock
from ..comm import Communicator, init
from ..emulate.linkdelay import ENV_RANKS_PER_HOST, report_step, set_link
from ..strategies import AutoConfig, AutoStrategy, Dense, Strategy
from ..strategies.auto_schemes import build
from ..strategies.lgreco_buckets import FAMILY_SCHEMES
from . import _clock
from ._util import UsageError, machine, parse_options, print_table, write_json
from .harness import Spec, default_threads
from .harness import build as harness_build
from .harness import train as run_harness
from .sync import GradientMethod

GBPS = 1.25e8  # bytes per second per Gbit/s
DEFAULT_STATIC = ("allgather_topk@0.01", "gtopk@0.01", "artopk_ring@0.01", "artopk_tree@0.01",
                  "allgather_topk@0.1")
COLUMNS = ("method", "time_to_target_s", "final_acc", "step_ms", "sent_kB_step", "x_dense",
           "overhead_pct", "choices")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="digits-mlp",
                        help="a workload of mpicomm.workloads (digits-mlp: --hidden)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a workload option (repeatable), e.g. train_examples=8000")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.96, help="test accuracy target")
    parser.add_argument("--schedule", default="0:0.1:100,6:0.05:500",
                        help="EPOCH:GBPS:ALPHA_US,... injected link from that epoch on")
    parser.add_argument("--link", choices=("injected", "emulated", "virtual"), default=None,
                        help="default injected (virtual under --clock virtual); "
                        "injected: the bench's own alpha-beta sleep (--schedule); "
                        "virtual: the virtual clock's network; "
                        "emulated: run under launchers/emulated-cluster (tc rate + "
                        "mpicomm.emulate.linkdelay latency, the emulator's --schedule)")
    parser.add_argument("--static", default=",".join(DEFAULT_STATIC),
                        help="comma-separated scheme@ratio static baselines")
    parser.add_argument("--only", default="",
                        help="comma-separated subset of the methods to run (dense, a "
                             "static scheme@ratio, auto; 'lgreco': none of them, the "
                             "L-GreCo comparison only); default all")
    parser.add_argument("--window", type=int, default=1,
                        help="auto: exploration window (steps per candidate ratio)")
    parser.add_argument("--auto-option", action="append", default=[], metavar="KEY=VALUE",
                        help="auto: one AutoConfig option (repeatable; VALUE a number, "
                             "true or false, or numbers with commas for a tuple), e.g. "
                             "gain_weighted=false, weights=0.8,0.2")
    parser.add_argument("--lgreco-ratio", type=float, default=0.01)
    parser.add_argument("--lgreco-families", default="topk,qsgd,powersgd",
                        help="comma-separated L-GreCo families to compare with uniform")
    parser.add_argument("--lgreco-steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=1,
                        help="test accuracy every so many steps (not timed)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per method (batch order seeds 0..N-1); medians reported")
    parser.add_argument("--seed-offset", type=int, default=0,
                        help="first seed (seeds OFFSET..OFFSET+N-1), to add seeds to a "
                             "committed result with benchmarks/adaptive_merge.py")
    parser.add_argument("--stop-at-target", action="store_true",
                        help="each static method ends at the first check that reaches "
                             "--target (its time to it is known by then; the final "
                             "accuracy reported is that check's); dense and auto run to "
                             "the end")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="end every run after so many steps (per-step times on one "
                             "network); default: --epochs")
    _clock.add_arguments(parser, schedule_flag="--virtual-schedule")


def parse_schedule(text: str) -> list[tuple[int, float, float]]:
    out = []
    try:
        for part in text.split(","):
            epoch, gbps, alpha_us = part.split(":")
            out.append((int(epoch), float(gbps), float(alpha_us)))
    except ValueError:
        out = []
    if not out or out[0][0] != 0 or any(g <= 0 or a < 0 for _, g, a in out):
        raise UsageError(f"bad --schedule {text!r}: starts at epoch 0, GBPS > 0, ALPHA >= 0")
    return sorted(out)


def link_at(schedule: list[tuple[int, float, float]], epoch: int) -> tuple[float, float]:
    gbps, alpha_us = [(g, a) for e, g, a in schedule if e <= epoch][-1]
    return alpha_us * 1e-6, 1 / (gbps * GBPS)


def make_strategy(method: str) -> Strategy:
    if method == "dense":
        return Dense()
    if method == "auto":
        raise AssertionError("auto is built by train()")
    scheme, ratio = method.split("@")
    s = build(scheme, float(ratio))
    if s is None:
        raise ValueError(f"scheme {scheme!r} is not applicable")
    return s


def spec(args: argparse.Namespace, seed: int, label: str, epochs: int | None = None,
         max_steps: int | None = None) -> Spec:
    """The harness's run: ``--workload`` (``digits-mlp`` 64-hidden-hidden-10 unless
    ``--option`` says otherwise), SGD with momentum 0.9."""
    from .train import parse_options

    options = parse_options(args.option)
    if args.workload == "digits-mlp":
        options = {"hidden": args.hidden, "layers": 2, **options}
    return Spec(workload=args.workload, seed=seed, batch=args.batch, options=options,
                epochs=args.epochs if epochs is None else epochs, lr=args.lr, momentum=0.9,
                weight_decay=0.0, clip_norm=0.0, eval_every=max(1, args.eval_every),
                target=args.target, label=label, max_steps=max_steps)


def train(method: str, comm: Communicator, args: argparse.Namespace,
          strategy: Strategy | None = None, seed: int = 0, epochs: int | None = None,
          max_steps: int | None = None) -> dict[str, Any]:
    """One run of ``method`` through the time-to-accuracy harness: the time (max over
    ranks, evaluation excluded) until the test accuracy, checked every
    ``args.eval_every`` steps, first reaches ``args.target``; ``seed`` picks the initial
    model and the batch order."""
    schedule = parse_schedule(args.schedule)
    sp = spec(args, seed, method, epochs,
              max_steps if max_steps is not None else args.max_steps)
    w = harness_build(sp, comm)
    # a fixed choice's later steps cannot change its time to the target
    stop_at_target = args.stop_at_target and strategy is None and method not in (
        "auto", "dense")
    if strategy is None:
        strategy = (AutoStrategy(window=args.window,
                                 total_steps=sp.epochs * w.info.steps_per_epoch,
                                 **auto_options(args.auto_option))
                    if method == "auto" else make_strategy(method))
    sync = GradientMethod(strategy, label=method, bucket_mb=64)

    def on_epoch(epoch: int, ctx: Any) -> None:
        if args.link == "injected":  # the strategy is bound to its communicator by now
            set_link(strategy.comm, *link_at(schedule, epoch))

    if args.link == "virtual":  # every method meets the schedule's `step N` entries
        clock.report_step(0)    # from its own step 0 (calibration included)
    if args.link == "emulated":
        # step 0 on the step-0 network: the emulator re-arms its `step N` entries when
        # the reported count goes back (polled every 20 ms; the ranks re-read the delay
        # every 10 ms), so report it before the first step and give it 0.1 s (not
        # timed). Without this, step 0 of every method ran on the previous method's last
        # network (50 Mbit/s, 5 ms), where auto's start-up calibration measured.
        if comm.rank == 0:
            report_step(0)
        time.sleep(0.1)
    def on_eval(point: dict[str, float], ctx: Any) -> None:
        if stop_at_target and ctx.run.time_to_target_s is not None:
            ctx.stop = True  # the same point on every rank: every rank stops here

    r = run_harness(sp, sync, comm, workload=w, on_epoch=on_epoch, on_eval=on_eval)
    sent = float(comm.allreduce_value(r.sent_bytes, "max"))
    row = {"method": method, "seed": seed, "time_to_target_s": r.time_to_target_s,
           "final_acc": r.final_metric(), "seconds": r.seconds, "steps": r.steps,
           "step_ms": 1e3 * r.seconds / max(r.steps, 1),
           "sent_kB_step": sent / max(r.steps, 1) / 1e3, "record": r.record(),
           "stopped_at_target": stop_at_target and r.time_to_target_s is not None}
    if isinstance(strategy, AutoStrategy):
        counts: dict[str, int] = {}
        for rec in strategy.records:
            key = f"{rec.scheme}@{rec.ratio:g}"
            counts[key] = counts.get(key, 0) + 1
        row["choices"] = " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))
        row["cr_history"] = ([(h.step, h.reason, h.ratio) for h in strategy.controller.history]
                             if strategy.controller is not None else [])
        row["timeline"] = timeline(strategy, args, w.info.steps_per_epoch)
        errors = [abs(rec.measured - rec.predicted) / rec.measured for rec in strategy.records
                  if rec.measured > 0]
        row["pred_rel_err_median"] = float(np.median(errors)) if errors else None
        # the controllers' own time (calibration, probes, exploration, L-GreCo): the
        # slowest rank's, against the run's training time
        own = {k: comm.allreduce_value(v, "max") for k, v in strategy.overheads.items()}
        row["overheads"] = own
        row["overhead_pct"] = (100 * sum(own[k] for k in own if k.endswith("_s"))
                               / r.seconds if r.seconds else None)
    return row


def network_at(args: argparse.Namespace, step: int, steps_per_epoch: int
               ) -> tuple[float, float]:
    """``(Gbit/s, one-way ms)`` of the network training step ``step`` (from 0) ran on:
    the virtual platform's schedule, or the injected link's by epoch (``nan`` on the
    emulated cluster, whose network the bench does not see)."""
    platform = clock.platform()
    if args.link == "virtual" and platform is not None:
        rate, delay = platform.conditions(0.0, step)
        return rate * 8 / 1e9, delay * 1e3
    if args.link == "injected":
        alpha, beta = link_at(parse_schedule(args.schedule), step // steps_per_epoch)
        return 1 / (beta * GBPS), alpha * 1e3
    return math.nan, math.nan


def timeline(strategy: AutoStrategy, args: argparse.Namespace, steps_per_epoch: int
             ) -> list[tuple[int, str, float, float, float]]:
    """auto's choice at every step against the network: ``(step, scheme, ratio, Gbit/s,
    one-way ms)``, the scheme of the step's largest bucket (its first record)."""
    out: list[tuple[int, str, float, float, float]] = []
    for rec in strategy.records:
        if out and out[-1][0] == rec.step:
            continue
        out.append((rec.step, rec.scheme, rec.ratio,
                    *network_at(args, rec.step, steps_per_epoch)))
    return out


def ratio_moves(line: list[tuple[int, str, float, float, float]], settle: int = 100
                ) -> list[dict[str, Any]]:
    """For every change of the network in ``timeline``'s steps: the ratio in force just
    before it, the ratio ``settle`` steps after it (or at the next change, if sooner),
    and their ratio (>= 1: the factor the chosen ratio moved by)."""
    out = []
    changes = [i for i in range(1, len(line)) if line[i][3:] != line[i - 1][3:]]
    for n, i in enumerate(changes):
        end = changes[n + 1] - 1 if n + 1 < len(changes) else len(line) - 1
        j = min(i + settle, end)
        before, after = line[i - 1][2], line[j][2]
        out.append({"step": line[i][0], "from_gbit": line[i - 1][3],
                    "to_gbit": line[i][3], "to_delay_ms": line[i][4],
                    "ratio_before": before, "ratio_after": after,
                    "scheme_before": line[i - 1][1], "scheme_after": line[j][1],
                    "factor": max(before, after) / min(before, after)})
    return out


def lgreco_rows(comm: Communicator, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per-layer uniform density (every layer at ``--lgreco-ratio``: the budget's total
    error) against L-GreCo's per-layer densities (total error <= that budget), per family
    and seed of ``--seeds`` / ``--seed-offset``: uniform then L-GreCo on the same seed."""
    rows = []
    seeds = range(args.seed_offset, args.seed_offset + args.seeds)
    per_epoch = harness_build(spec(args, 0, "probe"), comm).info.steps_per_epoch
    epochs = max(1, args.lgreco_steps // per_epoch)
    for family in [f for f in args.lgreco_families.split(",") if f]:
        if family == "topk":
            options: dict[str, Any] = {"ratio": args.lgreco_ratio,
                                       "schemes": ("allgather_topk",)}
        else:
            options = {"lgreco_family": family, "lgreco_default": 4,
                       "schemes": (FAMILY_SCHEMES[family],)}
        for seed in seeds:
            for name, every in (("uniform", 1 << 30), ("lgreco", 10)):
                s = AutoStrategy(lgreco=True, lgreco_every=every, lgreco_acc_steps=5,
                                 **options)
                row = train(f"{family} {name}", comm, args, strategy=s, seed=seed,
                            epochs=epochs, max_steps=args.lgreco_steps)
                row["family"], row["setting"] = family, name
                history = s.lgreco.history if s.lgreco is not None else []
                if history:
                    row["dp_size_vs_uniform"] = float(np.mean(
                        [h["size"] / h["uniform_size"] for h in history]))
                    row["dp_error_vs_budget"] = float(np.max(
                        [h["error"] / h["budget"] for h in history if h["budget"]]))
                rows.append(row)
    return rows


def lgreco_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """L-GreCo's targets from :func:`lgreco_rows`' (uniform, L-GreCo) pairs, per family
    (the ``topk`` keys carry no suffix): bytes per step of uniform over L-GreCo's, the
    DP's size against uniform's, and L-GreCo's time to the target over uniform's; each
    the median over seeds of the per-seed ratio. A run that never reached the target
    counts as infinitely late (L-GreCo's miss: ratio inf; uniform's alone: 0), so with
    one miss in three seeds the median is the larger of the other two ratios; a median
    that is infinite, or a seed where both missed, gives None."""
    per_family: dict[str, dict[str, list[float | None]]] = {}
    for uniform, per_layer in zip(rows[::2], rows[1::2]):
        ratios = per_family.setdefault(uniform["family"], {"bytes": [], "size": [],
                                                             "time": []})
        ratios["bytes"].append(uniform["sent_kB_step"] / per_layer["sent_kB_step"]
                               if per_layer["sent_kB_step"] else None)
        ratios["size"].append(per_layer.get("dp_size_vs_uniform"))
        mine, theirs = per_layer["time_to_target_s"], uniform["time_to_target_s"]
        ratios["time"].append(None if not mine and not theirs else
                              math.inf if not mine else 0.0 if not theirs else mine / theirs)
    summary: dict[str, Any] = {}
    for family, ratios in per_family.items():
        tag = "" if family == "topk" else f"_{family}"
        summary[f"lgreco_bytes_ratio{tag}"] = finite_median(ratios["bytes"])
        summary[f"lgreco_dp_size_vs_uniform{tag}"] = finite_median(ratios["size"])
        summary[f"lgreco_time_to_target_ratio{tag}"] = finite_median(ratios["time"])
    return summary


def finite_median(values: Sequence[float | None]) -> float | None:
    """The median of ``values``, where ``math.inf`` stands for a run that never reached
    the target (so it is None only when half or more missed), or None when there are no
    values or one of them is undefined (None)."""
    if not values or any(v is None for v in values):
        return None
    middle = float(np.median(values))
    return middle if math.isfinite(middle) else None


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's row over its seeds: the median of every number (a run that never
    reached the target counts as infinitely slow, so the median is ``None`` only when
    half or more of the runs missed), the runs themselves under ``"runs"``."""
    if len(runs) == 1:
        return dict(runs[0], runs=runs)
    row: dict[str, Any] = dict(runs[0], runs=runs)
    row.pop("seed", None)
    for key in ("final_acc", "seconds", "step_ms", "sent_kB_step", "pred_rel_err_median",
                "overhead_pct"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            row[key] = float(np.median(values))
    row["time_to_target_s"] = finite_median(
        [r["time_to_target_s"] if r["time_to_target_s"] is not None else math.inf
         for r in runs])
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets from the methods' rows (``median_row``'s; each gets ``x_dense``):
    auto against the best static method's time to the target (<= 0.85x on a network
    that changes, <= 1.05x on a constant one), against dense, its accuracy loss (not
    against a dense run stopped at the target), its overhead and the ratio moves."""
    by_name = {r["method"]: r for r in rows}
    dense, auto = by_name.get("dense"), by_name.get("auto")
    for r in rows:
        r["x_dense"] = (dense["time_to_target_s"] / r["time_to_target_s"]
                        if dense and r["time_to_target_s"] and dense["time_to_target_s"]
                        else None)
        r.setdefault("choices", "")
        r.setdefault("overhead_pct", None)
    static = [r for r in rows if r["method"] not in ("dense", "auto") and
              r["time_to_target_s"]]
    best = min(static, key=lambda r: r["time_to_target_s"]) if static else None
    summary: dict[str, Any] = {
        "auto_vs_best_static": (auto["time_to_target_s"] / best["time_to_target_s"]
                                if auto and best and auto["time_to_target_s"] else None),
        "best_static": best["method"] if best else None,
        "auto_speedup_vs_dense": auto["x_dense"] if auto else None,
        "auto_acc_loss_points": (100 * (dense["final_acc"] - auto["final_acc"])
                                 if auto and dense and not dense.get("stopped_at_target")
                                 else None),
        "auto_overhead_pct": auto["overhead_pct"] if auto else None,
    }
    moves = [ratio_moves(run["timeline"]) for run in auto["runs"]] if auto else []
    # the selector's target: <= 0.85x the best fixed choice on a network that changes,
    # <= 1.05x on a constant one
    summary["auto_vs_best_static_target"] = 0.85 if any(moves) else 1.05
    if any(moves):
        summary["ratio_moves"] = moves[0]
        summary["ratio_move_factor_min"] = float(np.median(
            [min(m["factor"] for m in per_seed) for per_seed in moves if per_seed]))
    return summary


def auto_options(items: list[str]) -> dict[str, Any]:
    """``--auto-option KEY=VALUE`` items as AutoConfig options (``true``/``false``,
    numbers, or comma-separated numbers as a tuple: ``weights=0.8,0.2``), checked by
    :class:`~mpicomm.strategies.AutoConfig`: a usage error for an unknown key or a bad
    value."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif "," in value:
            parts = [parse_options([f"{key}={v}"], "--auto-option")[key]
                     for v in value.split(",")]
            out[key] = tuple(parts)
        else:
            out.update(parse_options([item], "--auto-option"))
    try:
        AutoConfig.from_options(**out)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--auto-option: {exc}") from None
    return out


def run(args: argparse.Namespace) -> int:
    auto_options(args.auto_option)
    if args.seeds < 1 or args.eval_every < 1 or args.seed_offset < 0:
        raise UsageError("--seeds and --eval-every must be >= 1, --seed-offset >= 0")
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError("--max-steps must be >= 1")
    if args.link == "emulated" and not os.environ.get(ENV_RANKS_PER_HOST):
        raise UsageError("--link emulated: run under launchers/emulated-cluster "
                         f"({ENV_RANKS_PER_HOST} is not set)")
    parse_schedule(args.schedule)
    _clock.apply(args)
    virtual = args.clock == "virtual"
    if args.link is None:
        args.link = "virtual" if virtual else "injected"
    if virtual != (args.link == "virtual"):
        raise UsageError("--link virtual goes with --clock virtual (and only with it): "
                         "under the virtual clock the network is the platform's "
                         "(--rate/--delay/--virtual-schedule)")
    comm = init()
    _clock.measure_costs(comm)
    import torch

    torch.set_num_threads(default_threads(comm))  # ranks of a node share its cores
    methods = ["dense", *[m for m in args.static.split(",") if m], "auto"]
    only = [m for m in args.only.split(",") if m]
    if only:
        unknown = sorted(set(only) - set(methods) - {"lgreco"})
        if unknown:
            raise UsageError(f"--only {unknown}: not among the methods {methods}")
        methods = [m for m in methods if m in only]
    seeds = range(args.seed_offset, args.seed_offset + args.seeds)
    runs = [[train(m, comm, args, seed=s) for s in seeds] for m in methods]
    records = [run.pop("record") for per_method in runs for run in per_method]
    rows = [median_row(r) for r in runs]
    summary = summarize(rows)
    lg = lgreco_rows(comm, args)
    for row in lg:
        records.append(row.pop("record"))
    summary.update(lgreco_summary(lg))
    if comm.rank == 0:
        print(f"# adaptive: {comm.size} ranks, {args.workload} {args.option}, "
              f"batch {args.batch}/rank, {args.epochs} epochs, target acc {args.target}, "
              + (f"injected link schedule {args.schedule} (EPOCH:Gbit/s:alpha_us)"
                 if args.link == "injected" else
                 f"virtual clock {_clock.describe().get('platform')}"
                 if args.link == "virtual" else "emulated cluster (launchers/"
                 "emulated-cluster: tc rate + mpicomm.emulate.linkdelay latency)"))
        print_table(rows, COLUMNS)
        print("\n# L-GreCo vs per-layer uniform settings (topk: allgather_topk at ratio "
              f"{args.lgreco_ratio}; qsgd 4 bits; powersgd rank 4); DP error <= budget = "
              "uniform's error (the first 10 steps of both run uniform)")
        print_table(lg, ("method", "seed", "time_to_target_s", "sent_kB_step", "final_acc",
                         "dp_size_vs_uniform", "dp_error_vs_budget"))
        print("\n# targets")
        for k, v in summary.items():
            print(f"{k}: {v}")
        write_json(args.json, {"suite": "adaptive", "machine": machine(), "ranks": comm.size,
                               "options": dict(vars(args)), "clock": _clock.describe(),
                               "rows": rows, "lgreco": lg,
                               "summary": summary, "training_runs": records})
    comm.barrier()
    return 0
