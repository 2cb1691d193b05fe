"""The time-to-accuracy harness: one training loop for every benchmark and example.

``train(spec, sync, comm)`` trains a workload of :mod:`mpicomm.workloads` with one way of
synchronizing (:mod:`mpicomm.bench.sync`: a gradient strategy through
:class:`~mpicomm.torch.GradientSync`, :class:`~mpicomm.torch.LocalSGD` with a fixed period
or AdaComm, or a :class:`~mpicomm.ps.KVStore` parameter server) and returns a
:class:`Run`: the metric every ``eval_every`` steps against the training clock and against
the bytes sent, this rank's time and bytes of every step, and the decisions of adaptive
methods (the auto strategy's scheme and ratio, AdaComm's period, a schedule's density).

The clock: :func:`now` is the harness's only time source. It starts when every rank has
set up the method (after a barrier) and excludes evaluation: at an evaluation point every
rank stops its clock; the time so far and the bytes sent so far (``bytes``) are the
maxima over the ranks (a synchronous step is done when its last rank is); the model is
evaluated (every rank evaluates a slice, :meth:`Workload.evaluate`) and the clock
restarts after a barrier. ``spec.clock`` replaces it (the local SGD benchmark's runtime
model). :func:`now` is :func:`mpicomm.clock.now`: wall seconds, or under the virtual clock
(``MPICOMM_CLOCK=virtual``, a suite's ``--clock virtual``) this rank's virtual time.

Compute under the virtual clock: a run first enters its model's step in the cost table
(:func:`step_costs`: ``forward``, ``backward`` and ``optimizer`` measured once per model
and batch in this process by :func:`mpicomm.torch.costs.calibrate_model`, ranks taking
turns, unless all three were declared by the caller with :func:`mpicomm.clock.declare`);
every step then charges ``forward`` before the loss, ``backward`` after it and the method
charges ``optimizer`` before a local optimizer step (a parameter server's workers run
none). Communication is timed by the network model. So a run's times, and every ratio
between runs charged from the same table, do not depend on the machine's load.

Stopping: after ``epochs`` epochs, ``max_steps`` steps, or at the first evaluation at
which the clock has passed ``budget_s``; an evaluation always closes the run. A target
(``spec.target``) is reached at the first evaluation whose metric is at least as good
(in the workload's direction).

Metrics: with ``spec.metrics`` (a :class:`mpicomm.observe.metrics.Metrics`), the method's
own, or else ``MPICOMM_METRICS`` set, the same object records every step (the method's
record, with the step's training ``loss`` noted first), every epoch (``kind="epoch"``:
the running training ``loss`` and ``accuracy`` over all ranks, with ``epoch_stats``) and
every evaluation (``kind="eval"``: the workload's held-out numbers, e.g. ``accuracy``
and ``loss``, with ``train_step`` and ``epoch``), so that ``python -m mpicomm plot``
draws every panel.

Cost: two small allgathers per evaluation (clock and bytes, the metric sums) plus the
evaluation itself, one per epoch (the running training loss and accuracy, unless
``epoch_stats`` is off); nothing per step beyond the method's own communication (per-step
times and bytes are this rank's, kept in memory: 16 bytes a step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .. import clock, workloads
from ..comm import Communicator
from ..costtable import OpCost
from ..observe.metrics import metrics_from
from .report_training import steady

#: The one clock of the harness (seconds, monotonic): wall or virtual.
now: Callable[[], float] = clock.now

#: The compute of one training step, charged under the virtual clock.
STEP_OPS = ("forward", "backward", "optimizer")


class TrainClock:
    """:func:`now` seconds since creation, minus the paused stretches (evaluations)."""

    def __init__(self) -> None:
        self._start, self._paused_total, self._paused_at = now(), 0.0, None

    def now(self) -> float:
        end = self._paused_at if self._paused_at is not None else now()
        return end - self._start - self._paused_total

    def pause(self) -> None:
        self._paused_at = now()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += now() - self._paused_at
            self._paused_at = None


@dataclass
class Spec:
    """What to train and how long (``None``: the workload's recipe, ``info.defaults``)."""

    workload: str = "digits-mlp"
    seed: int = 0
    batch: int | None = None
    options: dict[str, Any] = field(default_factory=dict)   # workload options
    epochs: int | None = None          # None with budget_s: until the budget is spent
    max_steps: int | None = None
    budget_s: float | None = None      # training-clock budget, checked at evaluations
    eval_every: int | None = 0         # steps between evaluations; 0: every epoch's end,
    #                                    None: only at the end of the run
    epoch_stats: bool = True           # running loss/accuracy per epoch (one allgather)
    eval_split: str = "test"           # "train": the training set (local SGD's loss)
    target: float | None = None        # metric value that counts as reached
    target_key: str | None = None      # evaluation key of the target (default: metric)
    lr: float | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    decay_in_loss: bool = False        # weight decay as wd/2 ||w||^2 in the loss
    lr_decay_epoch: int = 0            # lr x 0.1 from this epoch on (0: never)
    clip_norm: float | None = None     # clip the synchronized gradient (gradient sync)
    label: str = ""                    # the method's name in results
    eval_at_start: bool = False        # a curve point before the first step
    clock: Any = None                  # object with now/pause/resume; None: TrainClock
    metrics: Any = None                # mpicomm.observe.metrics.Metrics (None: the method's,
                                       # else MPICOMM_METRICS): loss, accuracy, each step
    report_steps: bool = True          # rank 0 reports steps to the emulated cluster


@dataclass
class Run:
    """One training run as this rank saw it (times at evaluations: max over ranks)."""

    label: str
    workload: str
    seed: int
    ranks: int
    metric: str
    direction: str
    info: dict[str, Any]
    config: dict[str, Any]
    curve: list[dict[str, float]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)  # per epoch
    steps: int = 0
    epochs: int = 0
    seconds: float = 0.0
    sent_bytes: int = 0
    sent_bytes_max_rank: int = 0
    sent_bytes_total: int = 0          # summed over the ranks: the run's whole traffic
    time_to_target_s: float | None = None
    steps_to_target: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, float]:
        return self.curve[-1] if self.curve else {}

    def steady_step_s(self) -> list[float]:
        """The per-step times without the warm-up (the first 5 steps, or the first
        quarter of a shorter run): first steps pay for lazy set-up."""
        return steady(self.step_s)

    def final_metric(self, key: str | None = None) -> float:
        return float(self.final.get(key or self.metric, math.nan))

    def time_to(self, target: float, key: str | None = None,
                direction: str | None = None) -> float | None:
        """The first clock value whose ``key`` (default: the metric) reached ``target``."""
        key, way = key or self.metric, direction or self.direction
        for p in self.curve:
            if (p[key] >= target) if way == "max" else (p[key] <= target):
                return p["time_s"]
        return None

    def record(self) -> dict[str, Any]:
        """The run as JSON (the format ``python -m mpicomm.bench report`` plots)."""
        return asdict(self)


def make_optimizer(params: Any, lr: float, momentum: float, weight_decay: float
                   ) -> torch.optim.Optimizer:
    """``torch.optim.SGD``; the first step of any optimizer imports ``torch._dynamo``
    (seconds of CPU per rank), done here once on a dummy parameter, outside any timing."""
    _warm_optimizer()
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


_WARM = False


def default_threads(comm: Communicator) -> int:
    """Torch threads per rank: the usable cores of this process divided by the ranks on
    this node (at least 1), so that the ranks of one node do not oversubscribe it."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // comm.local_size)


def _warm_optimizer() -> None:
    global _WARM
    if not _WARM:
        p = torch.nn.Parameter(torch.zeros(1))
        p.grad = torch.zeros(1)
        torch.optim.SGD([p], lr=0.1).step()
        _WARM = True


def build(spec: Spec, comm: Communicator) -> workloads.Workload:
    """The spec's workload for this rank (:class:`~mpicomm.workloads.WorkloadError` on bad
    input, identically on every rank)."""
    return workloads.get(spec.workload, rank=comm.rank, size=comm.size, seed=spec.seed,
                         batch=spec.batch, **spec.options)


def _reached(value: float, target: float, key: str, w: Any) -> bool:
    """``value`` of evaluation key ``key`` is at least as good as ``target`` (the metric
    improves in the workload's direction, a loss downwards, anything else upwards)."""
    way = w.info.direction if key == w.info.metric else ("min" if key == "loss" else "max")
    return value >= target if way == "max" else value <= target


def train(spec: Spec, sync: Any, comm: Communicator, *, workload: Any = None,
          on_epoch: Callable[[int, Any], None] | None = None,
          on_epoch_end: Callable[[int, dict[str, float], Any], None] | None = None,
          on_eval: Callable[[dict[str, float], Any], None] | None = None,
          on_step: Callable[[int, Any], None] | None = None,
          checkpoint: Callable[[Any], tuple[Any, dict[str, Any] | None]] | None = None
          ) -> Run:
    """Train ``spec`` with ``sync`` (a :mod:`mpicomm.bench.sync` method) on ``comm``.

    Hooks (``context`` has ``opt``, ``model``, ``workload``, ``sync``, ``run`` and
    ``stop``; set ``context.stop = True`` to end the run at the next evaluation):
    ``on_epoch(epoch, context)`` before an epoch; ``on_epoch_end(epoch, stats, context)``
    after it, with ``stats`` the epoch's running training loss and accuracy over all ranks
    (``{"epoch", "train_loss", "train_acc"}``, also kept in ``run.history``);
    ``on_step(step, context)`` after each step (from 1; setting ``context.stop`` there ends
    the run after that step, on this rank: every rank must stop at the same step unless
    ``epoch_stats`` is off and only the final evaluation is collective);
    ``on_eval(point, context)`` after each evaluation. Every rank must call it with the
    same arguments. Metrics: see the module docstring.

    ``checkpoint(context)``, called once the method has started: ``(checkpointer,
    position)``, a :class:`mpicomm.checkpoint.Checkpointer` (or ``None``) and the position
    it restored (or ``None``). The run then skips the steps done before that position,
    continues with the epoch's running sums and history as saved, and offers a checkpoint
    after every step (``maybe_save``: every ``every`` steps); the checkpointer is closed
    at the end.
    """
    w = workload if workload is not None else build(spec, comm)
    d = w.info.defaults
    lr, momentum, wd = optimizer_settings(spec, w)
    clip = spec.clip_norm if spec.clip_norm is not None else d.get("clip_norm")
    epochs = spec.epochs if spec.epochs is not None else (
        None if spec.budget_s is not None else int(d["epochs"]))
    model = w.model
    if clock.started():
        step_costs(spec, w, comm, lr, 0.0 if sync.owns_momentum else momentum, wd)
    opt = sync.optimizer(model, lr, momentum, 0.0 if spec.decay_in_loss else wd)
    metrics = spec.metrics if spec.metrics is not None else getattr(sync, "metrics", None)
    metrics = metrics_from(metrics)  # else MPICOMM_METRICS, else None
    if metrics is not None and getattr(sync, "metrics", None) is None:
        sync.metrics = metrics       # before start: the method records every step into it
    config = {k: v for k, v in asdict(spec).items() if k not in ("clock", "metrics")}
    config.update(lr=lr, momentum=momentum, weight_decay=wd, clip_norm=clip, epochs=epochs,
                  sync=sync.describe_setup())
    run = Run(spec.label or sync.label, w.name, spec.seed, comm.size, w.info.metric,
              w.info.direction, w.info.as_dict(), config)
    key = spec.target_key or w.info.metric
    ctx = _Context(opt=opt, model=model, workload=w, sync=sync, run=run)
    every = spec.eval_every  # None: at the end only
    timer: Any = spec.clock
    sync.start(model, opt, comm, clip_norm=clip,
               clock=lambda: timer.now() if timer is not None else 0.0)
    if timer is None:  # started together, after the method's set-up
        comm.barrier()
        timer = TrainClock()
    if hasattr(timer, "attach"):
        timer.attach(sync)
    last_eval, steps, epoch = 0, 0, 0
    last_bytes = sync.sent_bytes()
    ckpt, position = checkpoint(ctx) if checkpoint is not None else (None, None)
    if position is not None:
        steps, epoch = int(position["step"]), int(position["epoch"])
        run.history = list(position["history"])

    def evaluate() -> bool:
        """One curve point; True when the run must end (budget spent or stop set)."""
        nonlocal last_eval
        timer.pause()
        if not sync.can_evaluate():
            sync.make_consistent()
        everyone = comm.allgather_object((timer.now(), int(sync.sent_bytes())))
        elapsed = float(max(t for t, _ in everyone))
        point = {"step": steps, "epoch": epoch, "time_s": elapsed,
                 "bytes": max(b for _, b in everyone)}
        point.update(w.evaluate(model, comm, spec.eval_split))
        run.curve.append(point)
        if metrics is not None:
            held_out = {k: v for k, v in point.items()
                        if k not in ("step", "epoch", "time_s", "bytes")}
            metrics.record("eval", train_step=steps, epoch=epoch, **held_out)
        last_eval = steps
        if spec.target is not None and run.time_to_target_s is None and key in point \
                and _reached(point[key], spec.target, key, w):
            run.time_to_target_s, run.steps_to_target = elapsed, steps
        if on_eval is not None:
            on_eval(point, ctx)
        comm.barrier()
        timer.resume()
        return ctx.stop or (spec.budget_s is not None and elapsed >= spec.budget_s)

    done = spec.eval_at_start and evaluate()
    try:
        while not done and (epochs is None or epoch < epochs):
            if spec.lr_decay_epoch and epoch == spec.lr_decay_epoch:
                for group in opt.param_groups:
                    group["lr"] = lr * 0.1
            if on_epoch is not None:
                on_epoch(epoch, ctx)
            loss_sum = hit_sum = count_sum = 0.0
            skip = 0
            if position is not None:  # resumed: this epoch's steps before the checkpoint
                loss_sum, hit_sum, count_sum = position["sums"]
                skip, position = int(position["in_epoch"]), None
            for in_epoch, batch in enumerate(w.shard.batches(epoch), 1):
                if in_epoch <= skip:
                    continue
                t0 = now()
                opt.zero_grad()
                clock.charge("forward")      # virtual clock: the step's compute
                loss, hits, count = w.loss(model, batch)
                if spec.decay_in_loss and wd:
                    (loss + 0.5 * wd * sum(p.pow(2).sum() for p in model.parameters())
                     ).backward()
                else:
                    loss.backward()
                clock.charge("backward")     # after it: when backward ends
                value = float(loss.detach())
                if metrics is not None:   # into the record the method writes
                    metrics.note(loss=value)
                sync.update(loss)
                run.step_s.append(now() - t0)
                loss_sum += value * count
                hit_sum += hits
                count_sum += count
                sent = sync.sent_bytes()
                run.step_bytes.append(int(sent - last_bytes))
                last_bytes = sent
                steps += 1
                decision = sync.decision()
                if decision and (not run.decisions or
                                 {k: v for k, v in run.decisions[-1].items() if k != "step"}
                                 != decision):
                    run.decisions.append({"step": steps, **decision})
                if spec.report_steps and (comm.rank == 0 or clock.started()):
                    clock.report_step(steps)  # a schedule's `step N` entries
                if on_step is not None:
                    on_step(steps, ctx)
                if ckpt is not None:
                    ckpt.maybe_save(steps, {"step": steps, "epoch": epoch,
                                            "in_epoch": in_epoch, "history": run.history,
                                            "sums": [loss_sum, hit_sum, count_sum]})
                if ctx.stop or (spec.max_steps is not None and steps >= spec.max_steps):
                    done = True
                    break
                if every and steps - last_eval >= every and sync.can_evaluate() \
                        and evaluate():
                    done = True
                    break
            if spec.epoch_stats:
                timer.pause()
                total = comm.allgather_object((loss_sum, hit_sum, count_sum))
                n = sum(t[2] for t in total) or 1.0
                stats = {"epoch": epoch + 1, "train_loss": sum(t[0] for t in total) / n,
                         "train_acc": sum(t[1] for t in total) / n}
                run.history.append(stats)
                if metrics is not None:
                    metrics.record("epoch", epoch=epoch + 1, loss=stats["train_loss"],
                                   accuracy=stats["train_acc"])
                if on_epoch_end is not None:
                    on_epoch_end(epoch, stats, ctx)
                timer.resume()
            epoch += 1
            if every == 0 and not done:
                done = evaluate()
        if last_eval != steps or not run.curve:
            evaluate()
    finally:
        if ckpt is not None:
            ckpt.close()
        sync.finish()
    run.steps, run.epochs = steps, epoch
    run.seconds = run.curve[-1]["time_s"]
    run.sent_bytes = int(sync.sent_bytes())
    run.sent_bytes_max_rank = int(comm.allreduce_value(run.sent_bytes, "max"))
    run.sent_bytes_total = int(comm.allreduce_value(run.sent_bytes, "sum"))
    run.extra.update(sync.summary())
    return run


class _StepLoss(torch.nn.Module):
    """A workload's training loss as a module (``calibrate_model`` measures
    ``loss_fn(module(inputs), target)``): ``forward(batch)`` is the batch's loss."""

    def __init__(self, w: workloads.Workload, decay: float) -> None:
        super().__init__()
        self.w, self.decay, self.net = w, decay, w.model

    def forward(self, batch: Any) -> torch.Tensor:
        loss = self.w.loss(self.net, batch)[0]
        if self.decay:
            loss = loss + 0.5 * self.decay * sum(p.pow(2).sum() for p in self.net.parameters())
        return loss


#: Step costs measured in this process, by (workload, options, batch, optimizer).
_MEASURED: dict[tuple[Any, ...], dict[str, OpCost]] = {}


def optimizer_settings(spec: Spec, w: workloads.Workload) -> tuple[float, float, float]:
    """``(lr, momentum, weight_decay)`` of a run: ``spec``'s, where it leaves one to the
    workload's recipe (``None``) that of ``w.info.defaults``."""
    d = w.info.defaults
    return (d["lr"] if spec.lr is None else spec.lr,
            d["momentum"] if spec.momentum is None else spec.momentum,
            d["weight_decay"] if spec.weight_decay is None else spec.weight_decay)


def step_costs(spec: Spec, w: workloads.Workload, comm: Communicator, lr: float,
               momentum: float, weight_decay: float) -> float:
    """Enter ``w``'s training step in the virtual clock's cost table and return its
    compute seconds (``forward + backward + optimizer``); collective over ``comm``.
    ``weight_decay`` is the recipe's (in the loss with ``spec.decay_in_loss``).

    Measured once per (workload, options, batch, optimizer settings) in this process with
    :func:`mpicomm.torch.costs.calibrate_model` (every rank of ``comm`` in turn, minima;
    on the first batch of epoch 0, the model's state restored afterwards), then reused, so
    every run of a benchmark on the same model is charged alike. Entries the caller
    declared (``mpicomm.clock.declare("forward", ...)``, all three) are kept: that is how
    a GPU's step from a published profile is modelled. Cost:
    ``6 * comm.size`` forward+backward passes the first time, nothing after.
    """
    table = clock.cost_table()
    if table is None:
        raise RuntimeError("step_costs needs the virtual clock (mpicomm.clock.started())")
    if all(op in table.ops and table.ops[op].source == "declared" for op in STEP_OPS):
        return sum(table.cost(op) for op in STEP_OPS)
    key = (w.name, repr(sorted(spec.options.items())), w.info.batch, spec.decay_in_loss,
           lr, momentum, weight_decay)
    if key not in _MEASURED:
        from ..torch.costs import calibrate_model

        batch = next(iter(w.shard.batches(0)))
        step = _StepLoss(w, weight_decay if spec.decay_in_loss else 0.0)
        opt = make_optimizer(step.parameters(), lr, momentum,
                             0.0 if spec.decay_in_loss else weight_decay)
        measured = calibrate_model(step, batch, None, lambda loss, _: loss, opt, comm,
                                   turns=None)
        _MEASURED[key] = {op: measured.ops[op] for op in STEP_OPS}
    table.ops.update(_MEASURED[key])
    return sum(table.cost(op) for op in STEP_OPS)


@dataclass
class _Context:
    opt: Any
    model: Any
    workload: Any
    sync: Any
    run: Run
    stop: bool = False
