"""Train a workload to time-to-accuracy: baselines and single configurations.

Run under MPI, e.g. the dense baselines (8 ranks, 3 seeds)::

    mpiexec -n 8 python -m mpicomm.bench train --workload mnist1d-cnn --seeds 3 \
        --eval-every 100 --json mnist1d-cnn-dense-8.json
    mpiexec -n 8 python -m mpicomm.bench train --workload text-lm --seeds 3 \
        --eval-every 250 --json text-lm-dense-8.json

and the time per step (no evaluation until the end; repeat at 1, 2, 4, 8 ranks)::

    mpiexec -n 4 python -m mpicomm.bench train --workload cnn-large-synthetic --steps 60 \
        --json step-cnn-large-synthetic-4.json

Every ``--strategy`` label (:mod:`mpicomm.bench.recipes`: ``dense``,
``topk+ef+dgc:2+wd``, ``gtopk@0.01``, ``auto``, ``powersgd``, ...) and every
``--local-sgd`` period (an integer or ``adacomm``) is trained for every seed ``0..N-1``
through the time-to-accuracy harness (:mod:`mpicomm.bench.harness`) on the workload of
:mod:`mpicomm.workloads` (``--option KEY=VALUE`` sets its options; ``python -m
mpicomm.bench workloads`` lists them). Defaults (batch, epochs, lr, momentum, weight
decay, clipping) are the workload's recipe.

JSON: ``training_runs`` (one record per run: the curve of the metric against the
training clock and the bytes sent, this rank's time and bytes per step, the decisions of
adaptive methods, the workload's facts including the text corpus' file list and
checksum) and ``summary``: per method, the medians over seeds of the final metric, steps,
time per step (rank 0's steps, evaluation excluded), bytes per step and time to
``--target``. ``python -m mpicomm.bench report`` draws the curves.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import torch

from ..comm import init
from . import _clock
from ._util import UsageError, machine, parse_options, print_table, write_json
from .harness import Run, Spec, default_threads, train
from .recipes import label_strategy
from .sync import GradientMethod, LocalSGDMethod


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="digits-mlp",
                        help="a name of python -m mpicomm.bench workloads")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a workload option (repeatable), e.g. train_examples=4000")
    parser.add_argument("--strategy", action="append", default=None, metavar="LABEL",
                        help="strategy label (repeatable; default dense)")
    parser.add_argument("--local-sgd", action="append", default=[], metavar="TAU",
                        help="local SGD with a fixed period TAU or 'adacomm' (repeatable)")
    parser.add_argument("--tau0", type=int, default=32, help="AdaComm's initial period")
    parser.add_argument("--density", type=float, default=0.01,
                        help="density of the BASE[+MOD] labels")
    parser.add_argument("--seeds", type=int, default=1, help="runs per method: seeds 0..N-1")
    parser.add_argument("--seed-offset", type=int, default=0,
                        help="first seed (seeds OFFSET..OFFSET+N-1)")
    parser.add_argument("--batch", type=int, default=None, help="per rank (default: recipe)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every N steps (0: at the end of every epoch)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--momentum", type=float, default=None)
    parser.add_argument("--weight-decay", type=float, default=None)
    parser.add_argument("--clip-norm", type=float, default=None,
                        help="clip the averaged gradient (default: the recipe's)")
    parser.add_argument("--lr-decay", type=int, default=0, metavar="EPOCH",
                        help="lr x 0.1 from this epoch on (0: constant)")
    parser.add_argument("--target", type=float, default=None,
                        help="metric value for time-to-target")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (0: usable cores / ranks per node)")
    parser.add_argument("--no-step-times", action="store_true",
                        help="leave the per-step times and bytes out of the JSON")
    _clock.add_arguments(parser)


def methods(args: argparse.Namespace, info: Any) -> list[Any]:
    """Fresh synchronization methods for one seed (strategies keep state); ``info``: the
    workload's facts (steps per epoch for schedules by epochs, the recipe's momentum for
    momentum correction)."""
    from ..control import AdaComm

    out: list[Any] = []
    for label in args.strategy or ([] if args.local_sgd else ["dense"]):
        momentum = info.defaults["momentum"] if args.momentum is None else args.momentum
        r = label_strategy(label, density=args.density, momentum=momentum,
                           steps_per_epoch=info.steps_per_epoch)
        out.append(GradientMethod(r.strategy, label=label, owns_momentum=r.owns_momentum))
    for tau in args.local_sgd:
        period: Any = AdaComm(args.tau0) if tau == "adacomm" else int(tau)
        out.append(LocalSGDMethod(period, label=f"local-sgd {tau}"))
    return out


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return float(statistics.median(values)) if values else None


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for label in dict.fromkeys(r.label for r in runs):
        mine = [r for r in runs if r.label == label]
        times = [r.time_to_target_s if r.time_to_target_s is not None else math.inf
                 for r in mine]
        t = statistics.median(times) if mine[0].config.get("target") is not None else None
        rows.append({
            "method": label, "seeds": len(mine), "metric": mine[0].metric,
            "final": median([r.final_metric() for r in mine]),
            "final_loss": median([r.final_metric("loss") for r in mine]),
            "steps": median([r.steps for r in mine]),
            "step_ms": 1e3 * (median([median(r.steady_step_s()) for r in mine
                                      if r.step_s]) or 0.0),
            "seconds": median([r.seconds for r in mine]),
            "kB_per_step": median([r.sent_bytes / max(r.steps, 1) / 1e3 for r in mine]),
            "time_to_target_s": t if t is not None and math.isfinite(t) else None,
        })
    return rows


def run(args: argparse.Namespace) -> int:
    from .. import workloads

    if args.seeds < 1 or args.eval_every < 0 or args.seed_offset < 0:
        raise UsageError("--seeds must be >= 1, --seed-offset and --eval-every >= 0")
    if args.tau0 < 1 or any(t != "adacomm" and (not t.isdigit() or int(t) < 1)
                            for t in args.local_sgd):
        raise UsageError("--local-sgd takes a period >= 1 or 'adacomm'; --tau0 >= 1")
    options = parse_options(args.option)
    _clock.apply(args)
    comm = init()
    _clock.measure_costs(comm)
    torch.set_num_threads(args.threads or default_threads(comm))
    try:
        probe = workloads.get(args.workload, rank=comm.rank, size=comm.size, seed=0,
                              batch=args.batch, **options)
        methods(args, probe.info)  # a bad label fails here, on every rank
    except ValueError as exc:  # WorkloadError or a bad strategy label
        raise UsageError(str(exc)) from None
    runs: list[Run] = []
    for seed in range(args.seed_offset, args.seed_offset + args.seeds):
        for method in methods(args, probe.info):
            spec = Spec(workload=args.workload, seed=seed, batch=args.batch, options=options,
                        epochs=args.epochs, max_steps=args.steps, eval_every=args.eval_every,
                        target=args.target, lr=args.lr, momentum=args.momentum,
                        weight_decay=args.weight_decay, clip_norm=args.clip_norm,
                        lr_decay_epoch=args.lr_decay, label=method.label)
            r = train(spec, method, comm)
            runs.append(r)
            if comm.rank == 0:
                print(f"# {r.label} seed {seed}: {r.steps} steps, {r.metric} "
                      f"{r.final_metric():.4g}, {r.seconds:.1f} s", flush=True)
    rows = summarize(runs)
    if comm.rank == 0:
        info = probe.info
        print(f"# train: {args.workload} ({info.description}; {info.parameters} parameters), "
              f"{comm.size} ranks, batch {info.batch}/rank, {info.steps_per_epoch} "
              f"steps/epoch")
        print_table(rows, ["method", "seeds", "metric", "final", "final_loss", "steps",
                           "step_ms", "kB_per_step", "time_to_target_s"])
        records = [r.record() for r in runs]
        if args.no_step_times:
            for rec in records:
                rec["step_s"], rec["step_bytes"] = [], []
        write_json(args.json, {"suite": "train", "machine": machine(), "ranks": comm.size,
                               "clock": _clock.describe(),
                               "workload": info.as_dict(), "args": vars(args),
                               "summary": rows, "training_runs": records})
    comm.barrier()
    return 0
