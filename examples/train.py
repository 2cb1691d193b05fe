"""Data-parallel training of an MLP on real data with mpicomm, ending with a summary.

Run under MPI (each rank trains on its own disjoint shard of the training set)::

    mpiexec -n 4 python examples/train.py --strategy gtopk --density 0.01
    mpiexec -n 4 python examples/train.py --strategy dense
    mpiexec -n 4 python examples/train.py --local-sgd fixed --period 8
    mpiexec -n 4 python examples/train.py --local-sgd adacomm --tau0 8 --json out.json

Task: scikit-learn's bundled ``load_digits`` (1797 8x8 images of handwritten digits, 10
classes; ships with the package, nothing is downloaded), a fixed stratified 80/20
train/test split, features standardized with the training split's statistics, and an
MLP 64-H-H-10. Every epoch the training set is permuted with a seed shared by all ranks
and cut into ``size`` disjoint equal shards, so the ranks never see the same example in
one epoch and all take the same number of steps.

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
  makes the warm-up steps dense where that sends fewer bytes.
* ``--local-sgd fixed|adacomm``: every rank takes local optimizer steps and
  :class:`mpicomm.torch.LocalSGD` averages the *parameters* every ``tau`` steps (fixed
  ``--period``, or chosen by :class:`mpicomm.control.AdaComm` from ``--tau0``). The
  gradient strategy is not used in this mode (parameters are averaged densely).

Rank 0 shows a tqdm bar and prints the summary: test accuracy and loss (the test split is
sharded over the ranks and the sums allreduced), wall time, the bytes each rank sent
through mpicomm's collectives, the bytes a dense allreduce of the gradients at every
step would have sent (measured with the same traffic counters: one real dense allreduce
of the gradient buffers, times the number of steps), the strategy's settings, and
AdaComm's period history. ``--json PATH`` writes the same summary as JSON.

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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import mpicomm  # noqa: E402
from mpicomm import strategies  # noqa: E402
from mpicomm.checkpoint import ENV_CHECKPOINT_DIR, Checkpointer, CheckpointError  # noqa: E402
from mpicomm.cli import RankZeroParser  # noqa: E402  (rank 0 prints usage errors)
from mpicomm.control import AdaComm, parse_schedule  # noqa: E402
from mpicomm.emulate.linkdelay import report_step  # noqa: E402
from mpicomm.observe.metrics import Metrics  # noqa: E402
from mpicomm.strategies import Dense, Strategy  # noqa: E402
from mpicomm.torch import GradientSync, LocalSGD  # noqa: E402

log = logging.getLogger("train")

#: Command-line options handed to a strategy whose constructor has a parameter of that name.
STRATEGY_OPTIONS = ("density", "bits", "rank", "source", "schedule", "momentum_correction",
                    "momentum_masking", "clip_norm", "warmup_dense")


# ---------------------------------------------------------------------- options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = RankZeroParser(
        prog=os.path.basename(__file__),
        description="Train an MLP on scikit-learn's digits with mpicomm "
                    "(run under mpiexec; rank 0 prints the summary).")
    ap.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    ap.add_argument("--batch-size", type=int, default=32, help="minibatch size per rank")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    ap.add_argument("--weight-decay", type=float, default=1e-3,
                    help="SGD weight decay")
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
    ap.add_argument("--source", default=None,
                    help="AR-Top-k's index source (default: the strategy's)")
    ap.add_argument("--schedule", default=None, metavar="SPEC",
                    help="density warm-up of a compressing strategy, by epochs unless "
                         "@step: gtopk (0.004 for epoch 0), dgc (0.25, 0.0625, 0.015625, "
                         "0.004), linear[:N] (dense to final over N epochs), "
                         "warmup:V1,V2[/N]; default none")
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
    ap.add_argument("--tau0", type=int, default=32,
                    help="initial period of --local-sgd adacomm (large: the training loss "
                         "falls ~300x here, and the period follows its square root)")
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
    for name in ("epochs", "batch_size", "hidden", "period", "tau0"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    check_checkpoint_arguments(ap, args)
    if args.local_sgd != "none":
        given = [f"--{opt.replace('_', '-')}" for opt in ("strategy", *STRATEGY_OPTIONS)
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
        kwargs = strategy_kwargs(args.strategy, args)
        if "schedule" in kwargs:
            kwargs["schedule"] = parse_schedule(kwargs["schedule"], steps_per_epoch=1)
        strategies.make(args.strategy, **kwargs)
    except (ValueError, TypeError) as exc:
        ap.error(f"--strategy {args.strategy}: {exc}")
    return args


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
    return given


def default_threads(comm: mpicomm.Communicator) -> int:
    """Usable cores of this process divided by the ranks on this node (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // comm.local_size)


def setup_logging(rank: int) -> None:
    """This script logs on rank 0 (its messages are the same on every rank); mpicomm's own
    warnings show on any rank. Every line carries the rank."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mpicomm").setLevel(logging.WARNING)


# ---------------------------------------------------------------------- data and model
@dataclass
class Digits:
    """The whole train and test splits (every rank holds them; shards are index sets)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_data(test_fraction: float = 0.2) -> Digits:
    """scikit-learn's bundled digits: fixed stratified split, standardized by the train split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=0,
                                              stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std[std == 0] = 1.0  # constant border pixels

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.tensor((a - mean) / std, dtype=torch.float32)

    return Digits(tensor(x_tr), torch.tensor(y_tr), tensor(x_te), torch.tensor(y_te))


def epoch_shard(n: int, epoch: int, seed: int, comm: mpicomm.Communicator) -> torch.Tensor:
    """This rank's training indices for ``epoch``: a block of a permutation shared by all
    ranks, so shards are disjoint and equal in size (the last ``n % size`` examples of
    each permutation are left out for that epoch)."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    per_rank = n // comm.size
    return torch.from_numpy(perm[comm.rank * per_rank:(comm.rank + 1) * per_rank])


def build_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10))


# ---------------------------------------------------------------------- metrics
def global_mean(comm: mpicomm.Communicator, loss_sum: float, correct: float,
                count: float) -> tuple[float, float]:
    """(mean loss, accuracy) over all ranks' examples: one allreduce of three sums."""
    total = mpicomm.allreduce(np.array([loss_sum, correct, count], dtype=np.float64),
                              op="sum", comm=comm)
    return float(total[0] / total[2]), float(total[1] / total[2])


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
             comm: mpicomm.Communicator) -> tuple[float, float]:
    """Loss and accuracy on (x, y), each rank evaluating every ``size``-th example."""
    xs, ys = x[comm.rank::comm.size], y[comm.rank::comm.size]
    out = model(xs)
    loss = torch.nn.functional.cross_entropy(out, ys, reduction="sum")
    return global_mean(comm, float(loss), float((out.argmax(1) == ys).sum()), len(ys))


def dense_bytes_per_step(model: torch.nn.Module, comm: mpicomm.Communicator) -> int:
    """Bytes this rank sends in one dense allreduce (``Dense``, algorithm ``auto``) of the
    model's gradients, measured with the same traffic counters as the run (collective)."""
    probe = Dense().bind(comm)
    grads = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    probe.aggregate(grads, [f"g{i}" for i in range(len(grads))])
    return probe.stats.sent_bytes


# ---------------------------------------------------------------------- training
@dataclass
class Outcome:
    """What one training run did on this rank."""

    steps: int
    sent_bytes: int
    describe: dict[str, Any]
    history: list[dict[str, float]]
    tau_history: list[int] | None = None
    sync: dict[str, float] | None = None


def run_epochs(model: torch.nn.Module, opt: torch.optim.Optimizer, data: Digits,
               args: argparse.Namespace, comm: mpicomm.Communicator,
               update: Callable[[torch.Tensor], Any], metrics: Metrics | None = None,
               **saved: Any) -> tuple[int, list[dict[str, float]]]:
    """:func:`train_loop` with this script's arguments, checkpointing ``saved`` (objects
    with ``state_dict``) with ``--checkpoint-dir``."""
    ckpt, position = make_checkpointer(args, comm, model=model, optimizer=opt, **saved)
    try:
        return train_loop(model, opt, data, comm, update, epochs=args.epochs,
                          batch_size=args.batch_size, seed=args.seed,
                          decay_in_loss=args.weight_decay if args.momentum_correction else 0.0,
                          progress=not args.no_progress, metrics=metrics, checkpoint=ckpt,
                          position=position)
    finally:
        if ckpt is not None:
            ckpt.close()


def train_loop(model: torch.nn.Module, opt: Any, data: Digits, comm: mpicomm.Communicator,
               update: Callable[[torch.Tensor], Any], *, epochs: int, batch_size: int,
               seed: int = 0, decay_in_loss: float = 0.0, progress: bool = True,
               metrics: Metrics | None = None, checkpoint: Checkpointer | None = None,
               position: dict[str, Any] | None = None) -> tuple[int, list[dict[str, float]]]:
    """The training loop of every mode (also examples/train_ps.py); ``update(loss)``,
    called after ``backward``, synchronizes and steps the optimizer as the mode does
    (``opt`` only needs ``zero_grad``). ``decay_in_loss``: weight decay added to the loss
    as ``wd/2 ||w||^2`` (with momentum correction). ``checkpoint``: saved after every
    step (it saves every ``every`` steps) with the position in the data; ``position``:
    the one a checkpoint restored (the steps already done are skipped). Returns the
    number of steps and the per-epoch training metrics (averaged over all ranks of
    ``comm``)."""
    per_rank = len(data.y_train) // comm.size
    steps_per_epoch = -(-per_rank // batch_size)
    done = position["step"] if position else 0
    bar = tqdm(total=epochs * steps_per_epoch, initial=done, unit="step", file=sys.stderr,
               disable=comm.rank != 0 or not progress, mininterval=0.5)
    steps = done
    history = list(position["history"]) if position else []
    for epoch in range(len(history), epochs):
        idx = epoch_shard(len(data.y_train), epoch, seed, comm)
        loss_sum, correct = (position["loss_sum"], position["correct"]) if position \
            else (0.0, 0.0)
        position = None
        for start in range(0, len(idx), batch_size):
            if epoch * steps_per_epoch + start // batch_size < done:
                continue  # done before the checkpoint this run resumed from
            batch = idx[start:start + batch_size]
            x, y = data.x_train[batch], data.y_train[batch]
            opt.zero_grad()
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            if decay_in_loss:  # weight decay folded into the gradient
                decay = sum(p.pow(2).sum() for p in model.parameters())
                (loss + 0.5 * decay_in_loss * decay).backward()
            else:
                loss.backward()
            if metrics is not None:
                metrics.note(loss=loss.item())
            update(loss)
            loss_sum += loss.item() * len(batch)
            correct += float((out.argmax(1) == y).sum())
            steps += 1
            if comm.rank == 0:
                report_step(steps)  # emulated cluster's `step N` schedule entries; else no-op
            bar.update(1)
            if checkpoint is not None:
                checkpoint.maybe_save(steps, {"step": steps, "loss_sum": loss_sum,
                                              "correct": correct, "history": history})
        train_loss, train_acc = global_mean(comm, loss_sum, correct, len(idx))
        history.append({"epoch": epoch + 1, "train_loss": train_loss, "train_acc": train_acc})
        if metrics is not None:
            metrics.record("epoch", epoch=epoch + 1, loss=train_loss, accuracy=train_acc)
        bar.set_postfix(epoch=epoch + 1, loss=f"{train_loss:.3f}", acc=f"{train_acc:.3f}")
    bar.close()
    return steps, history


def train_gradient_sync(model: torch.nn.Module, opt: torch.optim.Optimizer, data: Digits,
                        args: argparse.Namespace, comm: mpicomm.Communicator) -> Outcome:
    """Average gradients every step with the chosen strategy (GradientSync)."""
    kwargs = strategy_kwargs(args.strategy, args)
    if "schedule" in kwargs:  # by epochs: needs the steps each rank takes per epoch
        per_rank = len(data.y_train) // comm.size
        kwargs["schedule"] = parse_schedule(kwargs["schedule"],
                                            steps_per_epoch=-(-per_rank // args.batch_size))
    strategy = strategies.make(args.strategy, **kwargs)
    metrics = Metrics(args.metrics) if args.metrics else None
    with GradientSync(model, strategy, comm=comm, metrics=metrics) as sync:
        steps, history = run_epochs(model, opt, data, args, comm,
                                    lambda loss: sync.step(opt),  # wait, then opt.step()
                                    metrics, sync=sync)
        stats = sync.stats
        return Outcome(steps, stats.strategy.sent_bytes, sync.strategy.describe(), history,
                       sync={"steps": stats.steps, "comm_s": stats.comm_seconds,
                             "wait_s": stats.wait_seconds})


def train_local_sgd(model: torch.nn.Module, opt: torch.optim.Optimizer, data: Digits,
                    args: argparse.Namespace, comm: mpicomm.Communicator) -> Outcome:
    """Local optimizer steps; LocalSGD averages the parameters every tau steps."""
    steps_total = args.epochs * -(-(len(data.y_train) // comm.size) // args.batch_size)
    if args.local_sgd == "adacomm":
        # about ten decisions if the period stayed at tau0 (more as it shrinks), at least
        # two averaging rounds apart so that each sees a loss averaged over 2 tau steps
        interval = max(2, steps_total // (args.tau0 * 10))
        period: int | AdaComm = AdaComm(args.tau0, interval_rounds=interval)
    else:
        period = args.period
    local = LocalSGD(model, period, opt, comm=comm)
    metrics = Metrics(args.metrics) if args.metrics else None

    def update(loss: torch.Tensor) -> None:
        opt.step()  # a local step
        local.step(loss)  # averages the parameters when the period is reached
        if metrics is not None:
            metrics.observe(local)  # tau, rounds, bytes of this step

    steps, history = run_epochs(model, opt, data, args, comm, update, metrics, sync=local)
    local.average()  # every rank ends with the same (averaged) model
    describe = {"mode": f"local-sgd {args.local_sgd}", "algorithm": local.algorithm,
                "rounds": local.rounds, "final_period": local.period,
                "note": "parameters averaged by dense allreduce; --strategy not used"}
    if local.adacomm is not None:
        describe["adacomm"] = repr(local.adacomm)
    taus = [d.tau for d in local.history] if local.adacomm is not None else None
    return Outcome(steps, local.traffic.sent_bytes, describe, history, tau_history=taus)


# ---------------------------------------------------------------------- summary
def summarize(outcome: Outcome, test: tuple[float, float], dense_step: int,
              train_s: float, args: argparse.Namespace,
              comm: mpicomm.Communicator) -> dict[str, Any]:
    """The run's summary (collective: gathers every rank's byte count)."""
    sent = comm.allgather_object(outcome.sent_bytes)
    dense = dense_step * outcome.steps
    mean_sent = sum(sent) / len(sent)
    return {
        "ranks": comm.size,
        "mode": "gradient-sync" if args.local_sgd == "none" else f"local-sgd {args.local_sgd}",
        "strategy": args.strategy if args.local_sgd == "none" else None,
        "describe": outcome.describe,
        "test_accuracy": test[1],
        "test_loss": test[0],
        "train_loss": outcome.history[-1]["train_loss"],
        "train_accuracy": outcome.history[-1]["train_acc"],
        "epochs": args.epochs,
        "steps": outcome.steps,
        "wall_s": time.perf_counter() - _START,
        "train_s": train_s,
        "sent_bytes_per_rank": mean_sent,
        "sent_bytes_max_rank": max(sent),
        "dense_bytes_per_rank": dense,
        "dense_bytes_per_step": dense_step,
        "compression": dense / mean_sent if mean_sent else None,
        "tau_history": outcome.tau_history,
        "sync": outcome.sync,
        "history": outcome.history,
        "args": vars(args),
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


def format_taus(taus: list[int], head: int = 12, tail: int = 4) -> str:
    """AdaComm's periods as ``32 -> 27 -> 3 (x4) -> ...``: repeats folded, middle elided."""
    runs: list[list[int]] = []
    for t in taus:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    parts = [f"{t} (x{n})" if n > 1 else str(t) for t, n in runs]
    if len(parts) > head + tail:
        parts = parts[:head] + [f"... {len(parts) - head - tail} more ..."] + parts[-tail:]
    return " -> ".join(parts) + f"   ({len(taus)} decisions)"


def print_summary(s: dict[str, Any]) -> None:
    ratio = f"{s['compression']:.1f}x less" if s["compression"] else "n/a"
    lines = [
        f"== mpicomm examples/train.py: {s['ranks']} ranks, {s['mode']}, "
        f"{s['epochs']} epochs, {s['steps']} steps",
        f"settings          {json.dumps(s['describe'])}",
        f"test accuracy     {s['test_accuracy']:.4f}   test loss {s['test_loss']:.4f}",
        f"train accuracy    {s['train_accuracy']:.4f}   train loss {s['train_loss']:.4f}",
        f"wall time         {s['wall_s']:.1f} s (training {s['train_s']:.1f} s; "
        "imports and set-up included)",
        f"sent per rank     {_mb(s['sent_bytes_per_rank'])} (max rank "
        f"{_mb(s['sent_bytes_max_rank'])})",
        f"dense allreduce   {_mb(s['dense_bytes_per_rank'])} per rank for the same steps "
        f"({_mb(s['dense_bytes_per_step'])} per step): {ratio}",
    ]
    if s["tau_history"] is not None:
        lines.append(f"AdaComm tau       {format_taus(s['tau_history'])}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    comm = mpicomm.init()
    setup_logging(comm.rank)
    torch.set_num_threads(args.threads or default_threads(comm))
    # rank 0 reads the data set and broadcasts it: one scikit-learn import instead of one
    # per rank (the ranks share the cores)
    data = comm.bcast_object(load_data() if comm.rank == 0 else None)
    model = build_model(args.hidden, args.seed)
    if args.momentum_correction:  # the strategy owns the velocity; decay is in the loss
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay)
    log.info("%d ranks x %d torch thread(s); %d train / %d test examples; %d parameters",
             comm.size, torch.get_num_threads(), len(data.y_train), len(data.y_test),
             sum(p.numel() for p in model.parameters()))
    comm.barrier()
    start = time.perf_counter()
    trainer = train_gradient_sync if args.local_sgd == "none" else train_local_sgd
    outcome = trainer(model, opt, data, args, comm)
    train_s = comm.allreduce_value(time.perf_counter() - start, "max")
    test = evaluate(model, data.x_test, data.y_test, comm)
    save_model(model, args, comm.rank)
    summary = summarize(outcome, test, dense_bytes_per_step(model, comm), train_s, args, comm)
    if comm.rank == 0:
        print_summary(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        if args.metrics and "{rank}" not in args.metrics:
            plot_metrics_file(args.metrics)
    return summary


def plot_metrics_file(path: str) -> None:
    """``path``.png: the panels of ``python -m mpicomm plot`` (skipped without matplotlib)."""
    try:
        from mpicomm.observe.plot import plot_metrics
        log.info("metrics plots: %s", plot_metrics(path, path + ".png"))
    except ImportError as exc:
        log.warning("no plots of %s: %s", path, exc)


if __name__ == "__main__":
    main()
