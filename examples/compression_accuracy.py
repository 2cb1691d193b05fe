"""Does compressed aggregation keep accuracy?  Dense vs Top-k / gTop-k / AR-Top-k.

A real small task: scikit-learn's bundled handwritten digits (``load_digits``, 1797 8x8
images, 10 classes), standardized with the training split's statistics, a fixed
stratified 75/25 train/test split, the training set sharded by rank. A 64-256-256-10
ReLU MLP (85,002 parameters, so density 0.01 keeps 851 of them per step) is trained by
SGD with momentum under :class:`mpicomm.torch.GradientSync` with each strategy, named by
a label (:func:`recipe`): ``dense`` (ring allreduce, the reference) or
``BASE[+MOD...]`` with BASE ``topk`` / ``gtopk`` / ``artopk`` (STAR, ring) at
``--density`` and modifiers ``ef`` (error feedback, the default) / ``noef``, ``mc``
(DGC momentum correction with masking; the optimizer then has no momentum), ``mcnomask``,
``clip``, ``own`` (gTop-k's ``own_contribution``), ``wd`` (``warmup_dense``) and a
warm-up ``gtopkwu`` / ``dgc`` / ``linear`` / ``linear2`` or any
:func:`mpicomm.control.parse_schedule` form such as ``linear:8,0.25`` or ``dgc:2`` (by
epochs, :mod:`mpicomm.control.schedules`).

Every strategy sees the same initial weights, the same shards and the same batch order
(all seeded), and the same number of epochs; ``--lr-decay E`` multiplies the learning
rate by 0.1 from epoch E on, for every strategy (dense included). The whole model is one
bucket, so top-k is taken over the whole model (the papers' setting). Printed: test
accuracy per seed and the median over seeds, the median gap to dense and the worst
seed's gap in percentage points, the final training loss, the bytes each rank sent per
step (from the strategies' traffic counters) against dense, and the steps of each run::

    mpiexec -n 4 python examples/compression_accuracy.py            # 3 seeds
    mpiexec -n 8 python examples/compression_accuracy.py --lr-decay 9 \
        --strategies topk+ef gtopk+ef+own+dgc artopk+ef+dgc --json out.json
    mpiexec -n 16 python examples/compression_accuracy.py --lr 0.1 --lr-decay 9 \
        --density 0.001 --strategies topk+ef+dgc:2+wd gtopk+ef+own+linear:8,0.25+wd \
        artopk+ef+linear:7+wd

Measured at 8 ranks (2 shared cores, oversubscribed; accuracy does not depend on speed),
12 epochs = 120 steps, density 0.01, seeds 0-2, median test accuracy: with a constant lr,
dense 97.78%, AR-Top-k+EF 94.00% (seed 2: 85.33%), AR-Top-k with momentum correction
95.56% (seed 2: 94.00%); with ``--lr-decay 9``, dense 97.33%, Top-k+EF 96.89%,
AR-Top-k+EF 97.11%, AR-Top-k+EF+dgc 97.11% (19x fewer bytes than dense), Top-k+EF+dgc
97.33%, gTop-k+EF 96.00%, gTop-k+EF+dgc 96.44%. Momentum correction stops the late
oscillation but trains slower in so few steps (masking clears the velocity of the
coordinates sent most often). At 16 ranks (5 steps per epoch, 60 steps) every strategy
needs lr 0.1 (dense too: 97.11%) and a longer, gradual warm-up: ``topk+ef+dgc:2+wd``,
``gtopk+ef+own+linear:8,0.25+wd`` and ``artopk+ef+linear:7+wd`` are within 0.9 pp of
dense at densities 0.01 and 0.001 for 2.1-2.7x fewer bytes. The README's "Accuracy at
scale" section has the 4/8/16 rank tables. At 4 ranks (12 epochs, constant lr, seeds
0-2): dense 97.33%, gTop-k+EF 97.56%, AR-Top-k+EF 97.78%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

import mpicomm
from mpicomm.bench._util import machine
from mpicomm.control import parse_schedule
from mpicomm.strategies import ARTopK, Dense, GTopK, Strategy, TopKAllgather
from mpicomm.torch import GradientSync

#: Base strategies a label can start with.
BASES = {"topk": TopKAllgather, "gtopk": GTopK, "artopk": ARTopK}
#: Schedules a label can name (``mpicomm.control.parse_schedule`` forms).
SCHEDULES = {"gtopkwu": "gtopk", "dgc": "dgc", "linear": "linear:5", "linear2": "linear:2"}
#: Label modifiers besides the schedules.
FLAGS = ("ef", "noef", "mc", "mcnomask", "clip", "own", "wd")

#: The labels run by default (with and without error feedback). The accuracy-at-scale
#: recipes are opt-in labels, e.g. ``topk+ef+dgc gtopk+ef+own+dgc artopk+ef+dgc
#: artopk+mc`` (README, "Accuracy at scale").
DEFAULT_LABELS = ["dense", "gtopk+ef", "artopk+ef", "gtopk-noef", "artopk-noef"]


@dataclass(frozen=True)
class Recipe:
    """What a label means: a strategy and the optimizer momentum to pair it with."""

    strategy: Strategy
    momentum: float


def recipe(label: str, cfg: Config, steps_per_epoch: int) -> Recipe:
    """Build the strategy a label names.

    ``dense``, or ``BASE[+MOD...]`` / ``BASE-noef`` with BASE in ``topk``, ``gtopk``,
    ``artopk`` and modifiers ``ef`` (error feedback; the default), ``noef`` (without it),
    ``mc`` (DGC momentum correction with momentum factor masking in the error-feedback
    memory, the optimizer then runs without momentum), ``mcnomask`` (momentum correction
    without masking), ``clip`` (local gradient clipping at ``cfg.clip_norm / sqrt(P)``),
    ``own`` (gTop-k only: ``own_contribution=True``, picks whose value was truncated on
    the way go back to the residual) and
    one warm-up schedule: ``gtopkwu`` (0.004 for epoch 0), ``dgc`` (0.25, 0.0625,
    0.015625, 0.004, one epoch each), ``linear`` / ``linear2`` (dense to final over 5 / 2
    epochs) or any :func:`mpicomm.control.parse_schedule` form (``linear:8``, ``dgc:2``,
    ``warmup:0.25,0.0625/3``, ``dgc:10@step``; by epochs unless ``@step``), and ``wd``
    (``warmup_dense=True``: warm-up steps at which the sparse collective would send more
    than a dense allreduce are dense). ``ValueError`` for anything else.
    """
    if label == "dense":
        return Recipe(Dense(algorithm="ring"), cfg.momentum)
    base, *mods = label.replace("-noef", "+noef").split("+")
    specs = [SCHEDULES.get(m, m) for m in mods if m not in FLAGS]
    if base not in BASES or len(specs) > 1 or \
            any(not _is_schedule(m, steps_per_epoch) for m in specs):
        raise ValueError(f"unknown strategy label {label!r}: dense or BASE[+MOD..] with BASE "
                         f"in {sorted(BASES)} and MOD in {sorted([*FLAGS, *SCHEDULES])} or "
                         "one mpicomm.control.parse_schedule form (e.g. linear:8, dgc:2, "
                         "warmup:0.25,0.0625/3)")
    mc = "mc" in mods or "mcnomask" in mods
    kwargs: dict[str, Any] = {
        "density": cfg.density,
        "error_feedback": "noef" not in mods,
        "schedule": parse_schedule(specs[0], steps_per_epoch) if specs else None,
        "warmup_dense": "wd" in mods,
        "momentum_correction": cfg.momentum if mc else 0.0,
        "momentum_masking": "mcnomask" not in mods,
        "clip_norm": cfg.clip_norm if "clip" in mods else None,
    }
    if "own" in mods:
        if base != "gtopk":
            raise ValueError(f"{label!r}: the 'own' modifier is for gtopk only")
        kwargs["own_contribution"] = True
    return Recipe(BASES[base](**kwargs), 0.0 if mc else cfg.momentum)


def _is_schedule(spec: str, steps_per_epoch: int) -> bool:
    try:
        return parse_schedule(spec, steps_per_epoch) is not None
    except ValueError:
        return False


@dataclass(frozen=True)
class Config:
    epochs: int = 12
    lr: float = 0.05
    momentum: float = 0.9
    batch: int = 16          # per rank
    density: float = 0.01
    hidden: int = 256
    clip_norm: float = 1.0   # global threshold of the "clip" modifier (per rank / sqrt(P))
    lr_decay: int = 0        # from this epoch on lr x 0.1 (0: constant lr), every strategy


@dataclass
class Result:
    strategy: str
    seed: int
    accuracy: float          # test accuracy in percent
    train_loss: float        # cross-entropy on the full training set at the end
    sent_bytes_per_step: float  # mean over ranks
    steps: int
    seconds: float


def load_digits_split(comm: mpicomm.Communicator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardized (train statistics) digits, fixed stratified 75/25 split, float32.

    With ``comm``, rank 0 loads and broadcasts the arrays (importing scikit-learn costs
    each rank more CPU time than the small broadcast).
    """
    if comm is not None and comm.size > 1:
        arrays = load_digits_split() if comm.rank == 0 else None
        return tuple(comm.bcast_object(arrays))  # type: ignore[return-value]
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0,
                                              stratify=y)
    scaler = StandardScaler().fit(x_tr)
    as_x = lambda a: torch.from_numpy(scaler.transform(a).astype(np.float32))  # noqa: E731
    as_y = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def make_model(seed: int, hidden: int = 256) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


class MomentumSGD:
    """``torch.optim.SGD(params, lr, momentum)`` (no dampening, no Nesterov, no weight
    decay): ``b = momentum·b + g`` (``b = g`` at the first step), ``w -= lr·b``.

    Written out because constructing a ``torch.optim`` optimizer imports
    ``torch._dynamo``, about 2.5 s of CPU per rank, which dominates this example's start-up
    on an oversubscribed machine.
    """

    def __init__(self, params: list[torch.nn.Parameter], lr: float, momentum: float):
        self.params, self.lr, self.momentum = params, lr, momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            b = self.buffers[i]
            if b is None:
                b = self.buffers[i] = p.grad.detach().clone()
            else:
                b.mul_(self.momentum).add_(p.grad)
            p.add_(b, alpha=-self.lr)


def train(label: str, seed: int, cfg: Config, data: tuple[torch.Tensor, ...],
          comm: mpicomm.Communicator) -> Result:
    """Train with strategy ``label`` from seed ``seed``; every rank returns the same
    accuracy and loss (the replicas stay identical)."""
    x_tr, y_tr, x_te, y_te = data
    p, r = comm.size, comm.rank
    shard = torch.arange(r, x_tr.shape[0], p)  # rank r's fixed shard
    steps_per_epoch = (x_tr.shape[0] // p) // cfg.batch  # equal on every rank
    model = make_model(seed, cfg.hidden)
    chosen = recipe(label, cfg, steps_per_epoch)
    strategy = chosen.strategy
    opt = MomentumSGD(list(model.parameters()), cfg.lr, chosen.momentum)
    order = torch.Generator().manual_seed(seed * 1009 + r)  # same batches for every label
    loss_fn = torch.nn.functional.cross_entropy
    start = time.perf_counter()
    with GradientSync(model, strategy=strategy, comm=comm) as sync:
        for epoch in range(cfg.epochs):
            if cfg.lr_decay and epoch == cfg.lr_decay:
                opt.lr = cfg.lr * 0.1  # the references' step decay, for every strategy
            perm = shard[torch.randperm(shard.shape[0], generator=order)]
            for s in range(steps_per_epoch):
                idx = perm[s * cfg.batch:(s + 1) * cfg.batch]
                opt.zero_grad()
                loss_fn(model(x_tr[idx]), y_tr[idx]).backward()
                sync.step(opt)  # wait for the averaged gradients, then opt.step()
        steps = sync.stats.steps
        sent = strategy.stats.sent_bytes
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = 100.0 * float((model(x_te).argmax(1) == y_te).float().mean())
        train_loss = float(loss_fn(model(x_tr), y_tr))
    sent_mean = comm.allreduce_value(sent / max(steps, 1), op="avg")
    return Result(label, seed, accuracy, train_loss, sent_mean, steps, seconds)


def run(labels: list[str], seeds: list[int], cfg: Config, comm: mpicomm.Communicator,
        log: Callable[[str], None] | None = None) -> list[Result]:
    """Every label x seed, in a fixed order (the same on every rank)."""
    data = load_digits_split(comm)
    results = []
    for seed in seeds:
        for label in labels:
            res = train(label, seed, cfg, data, comm)
            results.append(res)
            if log is not None:
                log(f"seed {seed} {label:<18} acc {res.accuracy:6.2f}%  loss "
                    f"{res.train_loss:.4f}  {res.sent_bytes_per_step / 1e3:8.1f} kB/step  "
                    f"{res.steps} steps  {res.seconds:5.1f} s")
    return results


def summarize(results: list[Result], seeds: list[int], labels: list[str]
              ) -> list[dict[str, Any]]:
    """One row per label: accuracy per seed, median, gap of the median to dense and the
    worst seed's gap (pp, NaN without a dense run), median final training loss, median
    kB each rank sent per step, dense's bytes / that, and the steps of the run."""
    by = {(res.strategy, res.seed): res for res in results}
    nan = float("nan")
    has_dense = "dense" in labels
    dense_bytes = statistics.median(by["dense", s].sent_bytes_per_step
                                    for s in seeds) if has_dense else nan
    dense_acc = statistics.median(by["dense", s].accuracy for s in seeds) if has_dense else nan
    rows = []
    for label in labels:
        accs = [by[label, s].accuracy for s in seeds]
        med = statistics.median(accs)
        sent = statistics.median(by[label, s].sent_bytes_per_step for s in seeds)
        rows.append({
            "strategy": label, "accuracies": accs, "median": med, "gap_pp": med - dense_acc,
            "worst_pp": min(a - by["dense", s].accuracy for a, s in zip(accs, seeds))
            if has_dense else nan,
            "loss": statistics.median(by[label, s].train_loss for s in seeds),
            "kB_per_step": sent / 1e3,
            "x_dense": dense_bytes / sent if sent else float("inf"),
            "steps": by[label, seeds[0]].steps,
        })
    return rows


def table(results: list[Result], seeds: list[int], labels: list[str]) -> str:
    """:func:`summarize` as a text table."""
    head = (f"{'strategy':<18} " + " ".join(f"{'seed ' + str(s):>8}" for s in seeds)
            + f" {'median':>8} {'gap pp':>7} {'worst':>7} {'loss':>7} {'kB/step':>9}"
              f" {'vs dense':>9} {'steps':>6}")
    lines = [head, "-" * len(head)]
    for row in summarize(results, seeds, labels):
        lines.append(f"{row['strategy']:<18} " + " ".join(f"{a:8.2f}" for a in row["accuracies"])
                     + f" {row['median']:8.2f} {row['gap_pp']:+7.2f} {row['worst_pp']:+7.2f}"
                     f" {row['loss']:7.4f} {row['kB_per_step']:9.1f} {row['x_dense']:8.1f}x"
                     f" {row['steps']:6d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    parser.add_argument("--lr", type=float, default=Config.lr)
    parser.add_argument("--batch", type=int, default=Config.batch, help="per rank")
    parser.add_argument("--density", type=float, default=Config.density)
    parser.add_argument("--lr-decay", type=int, default=0, metavar="EPOCH",
                        help="multiply lr by 0.1 from this epoch on (0: constant)")
    parser.add_argument("--clip-norm", type=float, default=Config.clip_norm,
                        help="global clipping threshold of the 'clip' modifier")
    parser.add_argument("--strategies", nargs="+", default=DEFAULT_LABELS,
                        help="labels: dense, or BASE[+MOD..] (see recipe()); default: "
                             + " ".join(DEFAULT_LABELS))
    parser.add_argument("--no-dense", action="store_true",
                        help="do not add the dense reference run (no gaps in the table)")
    parser.add_argument("--json", help="also write the results here (rank 0)")
    args = parser.parse_args(argv)
    labels = args.strategies
    if "dense" not in labels and not args.no_dense:
        labels = ["dense", *labels]
    torch.set_num_threads(1)
    comm = mpicomm.init()
    cfg = Config(epochs=args.epochs, lr=args.lr, batch=args.batch, density=args.density,
                 clip_norm=args.clip_norm, lr_decay=args.lr_decay)
    for label in labels:
        recipe(label, cfg, 1)  # ValueError for an unknown label, before any training
    say = (lambda msg: print(msg, flush=True)) if comm.rank == 0 else None
    if say:
        say(f"digits, MLP 64-{cfg.hidden}-{cfg.hidden}-10, {comm.size} ranks, {cfg.epochs} "
            f"epochs, batch {cfg.batch}/rank, lr {cfg.lr}"
            + (f" (x0.1 from epoch {cfg.lr_decay})" if cfg.lr_decay else "")
            + f", momentum {cfg.momentum}, density {cfg.density}")
    start = time.perf_counter()
    results = run(labels, args.seeds, cfg, comm, log=say)
    if comm.rank == 0:
        print()
        print(table(results, args.seeds, labels))
        print(f"\ntotal {time.perf_counter() - start:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"suite": "accuracy", "machine": machine(), "config": asdict(cfg),
                           "ranks": comm.size, "seeds": args.seeds,
                           "summary": summarize(results, args.seeds, labels),
                           "results": [asdict(res) for res in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
