"""Data-parallel training of a workload with mpicomm, ending with a summary.

Run under MPI (each rank trains on its own disjoint shard of the training set)::

    mpiexec -n 4 python examples/train.py --strategy gtopk --density 0.01
    mpiexec -n 4 python examples/train.py --strategy dense
    mpiexec -n 4 python examples/train.py --local-sgd fixed --period 8
    mpiexec -n 4 python examples/train.py --local-sgd adacomm --tau0 8 --json out.json

Task: a workload of :mod:`mpicomm.workloads` (``--workload``, default ``digits-mlp``:
scikit-learn's bundled ``load_digits``, 1797 8x8 images of handwritten digits, a fixed
stratified 80/20 split, an MLP 64-H-H-10 with ``--hidden`` H; ``mnist1d-cnn``,
``text-lm``, ``cnn-large-synthetic``; ``--option KEY=VALUE`` sets a workload option;
``--epochs``, ``--batch-size``, ``--lr``, ``--momentum`` and ``--weight-decay`` default
to the workload's recipe, :func:`mpicomm.workloads.defaults`, which the benchmarks use).
Every epoch the training set is permuted with a seed shared by all ranks and cut into
``size`` disjoint equal shards, so the ranks never see the same example in one epoch and
all take the same number of steps. The loop is the time-to-accuracy harness
(:mod:`mpicomm.bench.harness`), which also evaluates the test metric after every epoch.

Two ways to synchronize:

* default: :class:`mpicomm.torch.GradientSync` averages the gradients of every step
  during ``backward`` with the chosen strategy (``--strategy``: dense allreduce or a
  compressing one such as gTop-k; ``--density``, ``--bits``, ``--rank``, ``--source`` go
  to the strategies whose constructor takes them, and are refused for the others).
  Accuracy at many ranks (DGC's recipe): ``--schedule`` warms the density up
  (``gtopk``, ``dgc``, ``linear:5``; see :func:`mpicomm.control.parse_schedule`),
  ``--momentum-correction`` moves the momentum into the strategy's error-feedback memory
  (the optimizer then runs without momentum and weight decay is added to the loss),
  ``--clip-norm`` clips each rank's gradient at ``C / sqrt(size)``, ``--warmup-dense``
  makes the warm-up steps dense where that sends fewer bytes. ``--finish 0.01`` ends the
  run denser: density 0.01 for its last tenth (:meth:`mpicomm.control.FinalPhase.for_run`
  over ``--epochs`` epochs; measured with ``--density 0.001`` on the language model at
  8 ranks: docs/compression.md, "A denser end").
* ``--local-sgd fixed|adacomm``: every rank takes local optimizer steps and
  :class:`mpicomm.torch.LocalSGD` averages the *parameters* every ``tau`` steps (fixed
  ``--period``, or chosen by :class:`mpicomm.control.AdaComm` from ``--tau0``; ``auto``
  measures the step and the averaging round first:
  :func:`mpicomm.bench.localsgd.platform_period`). The gradient strategy is not used in
  this mode (parameters are averaged densely).

Rank 0 shows a tqdm bar and prints the summary: test accuracy (the workload's metric)
and loss (the test split is sharded over the ranks and the sums combined), wall time,
the bytes each rank sent through mpicomm's collectives, the bytes a dense allreduce of the
gradients at every step would have sent (measured with the same traffic counters: one
real dense allreduce of the gradient buffers, times the number of steps), the strategy's
settings, and AdaComm's period history. ``--json PATH`` writes the same summary as JSON.

Surviving a dead rank: ``--checkpoint-dir DIR`` (default ``$MPICOMM_CHECKPOINT_DIR``, set
by ``python -m mpicomm run --restarts K --checkpoint-dir DIR``) checkpoints the model,
the optimizer, the synchronization state (error-feedback residuals, AdaComm), the
position in the data and the random generators every ``--checkpoint-every`` steps with
:class:`mpicomm.checkpoint.Checkpointer`, and a restarted run resumes from the newest
complete checkpoint there; ``--save-model PATH`` makes rank 0 write the final model's
``state_dict`` with ``torch.save``, so that a killed and restarted run can be compared
with one that was not (bit for bit, same seed and ranks)::

    python -m mpicomm run -n 4 --restarts 2 --checkpoint-dir ckpt -- \
        python examples/train.py --strategy topk --save-model final.pt

Command-line mistakes (an option the chosen strategy does not take, a value its
constructor rejects, ``--strategy`` together with ``--local-sgd``) end the run before any
training with one ``train.py: error: ...`` line from rank 0 and exit status 2 on every
rank, as argparse does in a single process.
"""

from __future__ import annotations

import time

_START = time.perf_counter()  # before the heavy imports: the wall time includes them

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import mpicomm  # noqa: E402
from mpicomm import strategies  # noqa: E402
from mpicomm.bench.harness import Run, Spec, build, default_threads, train  # noqa: E402
from mpicomm.bench.localsgd import parse_tau0, platform_period  # noqa: E402
from mpicomm.bench.sync import GradientMethod, LocalSGDMethod  # noqa: E402
from mpicomm.bench.train import parse_options  # noqa: E402
from mpicomm.checkpoint import ENV_CHECKPOINT_DIR, Checkpointer, CheckpointError  # noqa: E402
from mpicomm.cli import RankZeroParser  # noqa: E402  (rank 0 prints usage errors)
from mpicomm.control import AdaComm, FinalPhase, parse_schedule  # noqa: E402
from mpicomm.observe.metrics import Metrics  # noqa: E402
from mpicomm.strategies import Dense, Strategy  # noqa: E402
from mpicomm.workloads import Workload  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recipe_options import add_recipe_arguments, fill_recipe  # noqa: E402  (examples/)
from summary_text import print_summary  # noqa: E402  (examples/summary_text.py)

log = logging.getLogger("train")

#: Command-line options handed to a strategy whose constructor has a parameter of that name.
STRATEGY_OPTIONS = ("density", "bits", "rank", "source", "schedule", "momentum_correction",
                    "momentum_masking", "clip_norm", "warmup_dense", "coding")


# ---------------------------------------------------------------------- options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = RankZeroParser(
        prog=os.path.basename(__file__),
        description="Train a workload (default: an MLP on scikit-learn's digits) with "
                    "mpicomm (run under mpiexec; rank 0 prints the summary).")
    ap.add_argument("--workload", default="digits-mlp",
                    help="a workload of python -m mpicomm.bench workloads")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a workload option (repeatable; digits-mlp: --hidden sets hidden)")
    add_recipe_arguments(ap)
    ap.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the weights and of the per-epoch shuffles (shared by ranks)")
    ap.add_argument("--strategy", default=None,
                    help="gradient strategy (mpicomm.strategies.available(): "
                         f"{', '.join(strategies.available())}; default dense); not with "
                         "--local-sgd")
    ap.add_argument("--density", type=float, default=None,
                    help="fraction of gradient entries sent, for sparsifying strategies "
                         "(default: theirs, 0.01)")
    ap.add_argument("--bits", type=int, default=None,
                    help="bits per value, for quantizing strategies (default: theirs)")
    ap.add_argument("--rank", type=int, default=None,
                    help="PowerSGD's low rank (default: the strategy's)")
    ap.add_argument("--coding", choices=("log8", "none"), default=None,
                    help="wire format of Allgather Top-k's and gTop-k's pairs: log8, one "
                         "byte a value on a log scale and varint index gaps, or none, "
                         "int32 indices and the values' own bytes (default: the "
                         "strategy's; topk and gtopk by name: log8 from density 0.003 on)")
    ap.add_argument("--source", default=None,
                    help="AR-Top-k's index source (default: the strategy's)")
    ap.add_argument("--schedule", default=None, metavar="SPEC",
                    help="density warm-up of a compressing strategy, by epochs unless "
                         "@step: gtopk (0.004 for epoch 0), dgc (0.25, 0.0625, 0.015625, "
                         "0.004), linear[:N] (dense to final over N epochs), "
                         "warmup:V1,V2[/N]; default: the strategy's own")
    ap.add_argument("--finish", default=None, metavar="DENSITY[,FRACTION]",
                    help="a denser end (topk, gtopk, artopk, ...): at least DENSITY for the "
                         "last FRACTION of the run's steps (default 0.1), after --schedule "
                         "or the strategy's own warm-up; e.g. 0.01 with --density 0.001")
    ap.add_argument("--momentum-correction", action="store_const", const=True, default=None,
                    help="DGC momentum correction: the strategy keeps the velocity "
                         "(--momentum) in its error-feedback memory, the optimizer runs "
                         "without momentum, weight decay is added to the loss")
    ap.add_argument("--no-momentum-masking", dest="momentum_masking", action="store_const",
                    const=False, default=None,
                    help="with --momentum-correction: keep the velocity where values "
                         "were sent (DGC masks it)")
    ap.add_argument("--clip-norm", type=float, default=None,
                    help="local gradient clipping: each rank clips at CLIP_NORM/sqrt(size)")
    ap.add_argument("--warmup-dense", action="store_const", const=True, default=None,
                    help="with --schedule (topk, gtopk, artopk): warm-up steps at which the "
                         "sparse collective would send more bytes than a dense allreduce "
                         "are dense")
    ap.add_argument("--local-sgd", choices=("none", "fixed", "adacomm"), default="none",
                    help="average parameters every tau local steps instead of gradients "
                         "every step (fixed: --period; adacomm: AdaComm from --tau0)")
    ap.add_argument("--period", type=int, default=8, help="averaging period of --local-sgd fixed")
    ap.add_argument("--tau0", default="32",
                    help="initial period of --local-sgd adacomm (it follows the loss's square "
                         "root), or auto: 32 sqrt(D/Y), Y a measured step, D a round")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: usable cores / ranks on this node)")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="write the summary as JSON here (rank 0)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar on rank 0")
    add_checkpoint_arguments(ap)
    ap.add_argument("--metrics", metavar="PATH", default=None,
                    help="per-step metrics as JSON lines (mpicomm.observe.metrics; rank 0, or one "
                         "file per rank with {rank} in PATH) and their plots as PATH.png "
                         "when matplotlib is installed")
    args = ap.parse_args(argv)
    fill_recipe(ap, args)
    for name in ("hidden", "period"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.tau0 = parse_tau0(args.tau0)
    except ValueError as exc:
        ap.error(str(exc))
    check_checkpoint_arguments(ap, args)
    try:
        args.options = parse_options(args.option)
    except ValueError as exc:
        ap.error(str(exc))
    if args.workload == "digits-mlp":
        args.options.setdefault("hidden", args.hidden)
    if args.local_sgd != "none":
        given = [f"--{opt.replace('_', '-')}"
                 for opt in ("strategy", *STRATEGY_OPTIONS, "finish")
                 if getattr(args, opt) is not None]
        if given:
            ap.error(f"--local-sgd {args.local_sgd} averages parameters densely and takes no "
                     f"{', '.join(given)}")
        args.strategy = "dense"
        return args
    if args.strategy is None:
        args.strategy = "dense"
    if args.strategy not in strategies.available():
        ap.error(f"unknown strategy {args.strategy!r}; available: "
                 f"{', '.join(strategies.available())}")
    try:
        parse_schedule(args.schedule, steps_per_epoch=1)
    except ValueError as exc:
        ap.error(str(exc))
    if args.momentum_correction and not 0.0 < args.momentum < 1.0:
        ap.error("--momentum-correction needs 0 < --momentum < 1")
    # the value handed to the strategy (None: not given, the strategy's default)
    args.momentum_correction = args.momentum if args.momentum_correction else None
    try:  # constructing a strategy validates its options without communicating
        args.finish = parse_finish_option(args.finish)
        build_strategy(args, steps_per_epoch=1)
    except (ValueError, TypeError) as exc:
        ap.error(f"--strategy {args.strategy}: {exc}")
    return args


def parse_finish_option(spec: str | None) -> tuple[float, float] | None:
    """``--finish DENSITY[,FRACTION]`` -> ``(density, fraction)`` (fraction 0.1 when not
    given); ``None`` for ``None``. ``ValueError`` for anything else."""
    if spec is None:
        return None
    density, _, fraction = spec.partition(",")
    try:
        out = (float(density), float(fraction) if fraction else 0.1)
        FinalPhase.for_run(1, *out)   # the same checks as the strategy's
    except ValueError as exc:
        raise ValueError(f"bad --finish {spec!r}: {exc}; expected DENSITY[,FRACTION], "
                         "e.g. 0.01 or 0.01,0.1") from None
    return out


def build_strategy(args: argparse.Namespace, steps_per_epoch: int) -> Strategy:
    """The strategy the options ask for: ``--schedule`` by epochs of ``steps_per_epoch``
    steps, and with ``--finish`` a :class:`~mpicomm.control.FinalPhase` over the run's
    ``--epochs`` x ``steps_per_epoch`` steps around it (or around the schedule the
    strategy's name brings, :func:`mpicomm.strategies.recipe`)."""
    kwargs = strategy_kwargs(args.strategy, args)
    if "schedule" in kwargs:
        kwargs["schedule"] = parse_schedule(kwargs["schedule"],
                                            steps_per_epoch=steps_per_epoch)
    if args.finish is not None:
        if "schedule" not in strategy_options(args.strategy):
            raise ValueError("takes no --finish (it has no density schedule)")
        inner = kwargs["schedule"] if "schedule" in kwargs else \
            strategies.recipe(args.strategy, args.density).get("schedule")
        kwargs["schedule"] = FinalPhase.for_run(args.epochs * steps_per_epoch, *args.finish,
                                                schedule=inner)
    return strategies.make(args.strategy, **kwargs)


def add_checkpoint_arguments(ap: argparse.ArgumentParser) -> None:
    """``--checkpoint-dir``, ``--checkpoint-every`` and ``--save-model`` (also
    examples/train_ps.py)."""
    ap.add_argument("--checkpoint-dir", metavar="DIR",
                    default=os.environ.get(ENV_CHECKPOINT_DIR) or None,
                    help="checkpoint here and resume from the newest complete checkpoint "
                         "(an existing directory; default $MPICOMM_CHECKPOINT_DIR)")
    ap.add_argument("--checkpoint-every", type=int, default=20, metavar="N",
                    help="steps between checkpoints (with --checkpoint-dir)")
    ap.add_argument("--save-model", metavar="PATH", default=None,
                    help="rank 0 writes the final model's state_dict here (torch.save)")


def check_checkpoint_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.checkpoint_every < 1:
        ap.error("--checkpoint-every must be >= 1")
    if args.checkpoint_dir is not None and not os.path.isdir(args.checkpoint_dir):
        ap.error(f"--checkpoint-dir {args.checkpoint_dir!r}: no such directory")


def make_checkpointer(args: argparse.Namespace, comm: mpicomm.Communicator, kv: Any = None,
                      **objects: Any) -> tuple[Checkpointer | None, dict[str, Any] | None]:
    """The run's :class:`Checkpointer` (``None`` without ``--checkpoint-dir``) and the
    position restored from it (``None``: start from scratch). A checkpoint of another
    model or world size ends the run on every rank with one error line and status 2."""
    if args.checkpoint_dir is None:
        return None, None
    try:
        ckpt = Checkpointer(args.checkpoint_dir, comm=comm, every=args.checkpoint_every,
                            kv=kv, **objects)
        restored = ckpt.restore()
    except CheckpointError as exc:  # raised on every rank alike, nothing loaded
        if comm.rank == 0:
            print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr,
                  flush=True)
        sys.exit(2)
    if restored is not None:
        log.info("resumed from %s (step %d)", restored.path, restored.step)
    return ckpt, None if restored is None else restored.position


def save_model(model: torch.nn.Module, args: argparse.Namespace, rank: int) -> None:
    """``--save-model``: rank 0 writes the model's ``state_dict``."""
    if args.save_model and rank == 0:
        torch.save(model.state_dict(), args.save_model)


def strategy_class(name: str) -> type[Strategy] | None:
    """The :class:`Strategy` subclass called ``name`` in :mod:`mpicomm.strategies` or one
    of its modules (``None``: not found; the strategy then gets no options)."""
    places = [strategies] + [m for m in vars(strategies).values() if inspect.ismodule(m)]
    for place in places:
        for obj in vars(place).values():
            if inspect.isclass(obj) and issubclass(obj, Strategy) and obj.name == name:
                return obj
    return None


def strategy_options(name: str) -> set[str]:
    """The options of :data:`STRATEGY_OPTIONS` that strategy ``name``'s constructor takes."""
    cls = strategy_class(name)
    params = inspect.signature(cls).parameters if cls is not None else {}
    return {opt for opt in STRATEGY_OPTIONS if opt in params}


def strategy_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The given options (not ``None``) for strategy ``name``'s constructor.

    ``ValueError`` naming an option the strategy does not take, and the strategies that
    do take it: a forgotten ``--strategy`` must not go unnoticed.
    """
    takes = strategy_options(name)
    given = {opt: getattr(args, opt) for opt in STRATEGY_OPTIONS
             if getattr(args, opt) is not None}
    for opt in sorted(set(given) - takes):
        users = [s for s in strategies.available() if opt in strategy_options(s)]
        raise ValueError(f"takes no --{opt.replace('_', '-')} (strategies that do: "
                         f"{', '.join(users)})")
    if given.get("coding") == "none":
        given["coding"] = None
    return given


def setup_logging(rank: int) -> None:
    """This script logs on rank 0 (its messages are the same on every rank); mpicomm's own
    warnings show on any rank. Every line carries the rank."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mpicomm").setLevel(logging.WARNING)


# ---------------------------------------------------------------------- training
def spec_of(args: argparse.Namespace) -> Spec:
    """The harness's description of this run (a test evaluation after every epoch; the
    synchronized gradient clipped where the workload's recipe says so, ``text-lm``)."""
    return Spec(workload=args.workload, seed=args.seed, batch=args.batch_size,
                options=args.options, epochs=args.epochs, lr=args.lr, momentum=args.momentum,
                weight_decay=args.weight_decay,
                decay_in_loss=bool(getattr(args, "momentum_correction", None)))


def dense_bytes_per_step(model: torch.nn.Module, comm: mpicomm.Communicator) -> int:
    """Bytes this rank sends in one dense allreduce (``Dense``, algorithm ``auto``) of the
    model's gradients, measured with the same traffic counters as the run (collective)."""
    probe = Dense().bind(comm)
    grads = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    probe.aggregate(grads, [f"g{i}" for i in range(len(grads))])
    return probe.stats.sent_bytes


class _NoBar:
    """What a progress bar is asked to do, doing nothing (``--no-progress``, ranks > 0)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, shown: bool) -> Any:
    """A tqdm bar on stderr when ``shown`` (tqdm is imported only then), else a stand-in."""
    if not shown:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="step", file=sys.stderr, mininterval=0.5)


def run_harness(method: Any, w: Workload, args: argparse.Namespace,
                comm: mpicomm.Communicator, metrics: Metrics | None = None,
                checkpoint: Callable[[Any], Any] | None = None) -> Run:
    """Train ``w`` with ``method`` (:mod:`mpicomm.bench.sync`) through the harness, with
    rank 0's progress bar (also examples/train_ps.py); ``metrics`` (else
    ``MPICOMM_METRICS``) gets the harness's step, epoch and evaluation records.
    With ``--checkpoint-dir``: checkpoints of the model, the optimizer and the method's
    state (``checkpoint``: the harness's factory, for the parameter server's)."""
    if checkpoint is None and args.checkpoint_dir is not None:
        def checkpoint(ctx: Any) -> Any:
            return make_checkpointer(args, comm, model=ctx.model, optimizer=ctx.opt,
                                     **method.state_objects())
    spec = spec_of(args)
    spec.metrics = metrics
    bar = progress_bar(args.epochs * w.info.steps_per_epoch,
                       comm.rank == 0 and not args.no_progress)

    def epoch_end(epoch: int, stats: dict[str, float], ctx: Any) -> None:
        bar.set_postfix(epoch=epoch + 1, loss=f"{stats['train_loss']:.3f}",
                        acc=f"{stats['train_acc']:.3f}")

    try:
        return train(spec, method, comm, workload=w, on_step=lambda step, ctx: bar.update(1),
                     on_epoch_end=epoch_end, checkpoint=checkpoint)
    finally:
        bar.close()


@dataclass
class Outcome:
    """What one training run did on this rank."""

    run: Run
    describe: dict[str, Any]
    tau_history: list[int] | None = None
    sync: dict[str, float] | None = None

    @property
    def steps(self) -> int:
        return self.run.steps

    @property
    def sent_bytes(self) -> int:
        return self.run.sent_bytes

    @property
    def history(self) -> list[dict[str, float]]:
        return self.run.history


def train_gradient_sync(w: Workload, args: argparse.Namespace,
                        comm: mpicomm.Communicator) -> Outcome:
    """Average gradients every step with the chosen strategy (GradientSync)."""
    # by epochs, and the run's length: needs the steps each rank takes per epoch
    strategy = build_strategy(args, w.info.steps_per_epoch)
    metrics = Metrics(args.metrics) if args.metrics else None  # else MPICOMM_METRICS
    method = GradientMethod(strategy, label=args.strategy,
                            owns_momentum=bool(args.momentum_correction), metrics=metrics)
    run = run_harness(method, w, args, comm, metrics)
    return Outcome(run, run.extra["describe"], sync=run.extra["sync"])


def train_local_sgd(w: Workload, args: argparse.Namespace,
                    comm: mpicomm.Communicator) -> Outcome:
    """Local optimizer steps; LocalSGD averages the parameters every tau steps."""
    steps_total = args.epochs * w.info.steps_per_epoch
    if args.local_sgd == "adacomm":
        if args.tau0 == "auto":  # from this platform's step and averaging times
            args.tau0, step_s, round_s = platform_period(spec_of(args), comm)
            log.info("AdaComm tau0 = %d: a local step takes %.3g ms, an averaging round "
                     "%.3g ms", args.tau0, step_s * 1e3, round_s * 1e3)
        # ~10 decisions at tau0 (more as it shrinks), >= 2 rounds apart (losses of 2 tau)
        interval = max(2, steps_total // (args.tau0 * 10))
        period: int | AdaComm = AdaComm(args.tau0, interval_rounds=interval)
    else:
        period = args.period
    metrics = Metrics(args.metrics) if args.metrics else None  # else MPICOMM_METRICS
    run = run_harness(LocalSGDMethod(period, metrics=metrics), w, args, comm, metrics)
    describe = {"mode": f"local-sgd {args.local_sgd}", "algorithm": run.extra["algorithm"],
                "rounds": run.extra["rounds"], "final_period": run.extra["final_period"],
                "note": "parameters averaged by dense allreduce; --strategy not used"}
    if "adacomm" in run.extra:
        describe["adacomm"] = run.extra["adacomm"]
    return Outcome(run, describe, tau_history=run.extra.get("tau_history"))


# ---------------------------------------------------------------------- summary
def summarize(outcome: Outcome, dense_step: int, args: argparse.Namespace,
              comm: mpicomm.Communicator) -> dict[str, Any]:
    """The run's summary (collective: gathers every rank's byte count)."""
    sent = comm.allgather_object(outcome.sent_bytes)
    dense = dense_step * outcome.steps
    mean_sent = sum(sent) / len(sent)
    final = outcome.run.final
    return {
        "ranks": comm.size,
        "mode": "gradient-sync" if args.local_sgd == "none" else f"local-sgd {args.local_sgd}",
        "strategy": args.strategy if args.local_sgd == "none" else None,
        "workload": args.workload,
        "describe": outcome.describe,
        "metric": outcome.run.metric,
        "test_metric": final.get(outcome.run.metric),
        "test_accuracy": final.get("accuracy"),
        "test_loss": final["loss"],
        "train_loss": outcome.history[-1]["train_loss"],
        "train_accuracy": outcome.history[-1]["train_acc"],
        "epochs": args.epochs,
        "steps": outcome.steps,
        "wall_s": time.perf_counter() - _START,
        "train_s": outcome.run.seconds,
        "sent_bytes_per_rank": mean_sent,
        "sent_bytes_max_rank": max(sent),
        "dense_bytes_per_rank": dense,
        "dense_bytes_per_step": dense_step,
        "compression": dense / mean_sent if mean_sent else None,
        "tau_history": outcome.tau_history,
        "sync": outcome.sync,
        "history": outcome.history,
        "curve": outcome.run.curve,
        "args": vars(args),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    comm = mpicomm.init()
    setup_logging(comm.rank)
    torch.set_num_threads(args.threads or default_threads(comm))
    try:  # an unknown workload or option, a batch larger than a shard: on every rank
        w = build(spec_of(args), comm)
    except ValueError as exc:
        RankZeroParser(prog=os.path.basename(__file__)).error(str(exc))
    log.info("%d ranks x %d torch thread(s); %s: %d train / %d test examples; %d parameters",
             comm.size, torch.get_num_threads(), w.info.description, w.info.train_examples,
             w.info.eval_examples, w.info.parameters)
    trainer = train_gradient_sync if args.local_sgd == "none" else train_local_sgd
    outcome = trainer(w, args, comm)
    save_model(w.model, args, comm.rank)
    summary = summarize(outcome, dense_bytes_per_step(w.model, comm), args, comm)
    if comm.rank == 0:
        print_summary(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
            print(f"summary           {args.json}", flush=True)
        if args.metrics and "{rank}" not in args.metrics:
            plot_metrics_file(args.metrics)
        elif args.metrics:
            print(f"metrics           {args.metrics} (one file per rank)", flush=True)
    return summary


def plot_metrics_file(path: str) -> None:
    """The panels of ``python -m mpicomm plot`` in ``path`` with ``.png`` in place of its
    suffix, and where they went (skipped without matplotlib)."""
    print(f"metrics           {path}", flush=True)
    try:
        from mpicomm.observe.plot import plot_metrics, png_path
        print(f"plots             {plot_metrics(path, png_path(path))}", flush=True)
    except ImportError as exc:
        log.warning("no plots of %s: %s", path, exc)


if __name__ == "__main__":
    main()
