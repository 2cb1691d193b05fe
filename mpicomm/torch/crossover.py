"""``TorchJob``: a model + optimizer + data as one job of a Crossover scheduler.

One iteration of a ``TorchJob`` is cut where the Crossover scheduler needs it::

    compute(t):  [apply iteration t-1: optimizer.step()]      (GradientSync jobs)
                 optimizer.zero_grad(); loss_fn(model(x_t), y_t).backward()
                 [optimizer.step()]                            (LocalSGD jobs)
    sync(t):     GradientSync.wait()          -- averaged gradients in .grad
              or LocalSGD.step(loss)          -- averages parameters every tau steps
    finish():    [apply the last iteration]

so the floating-point operations, and their order, are exactly those of the ordinary
loop ``zero_grad; backward; sync.step(optimizer)`` (or ``...; optimizer.step();
local.step(loss)``): the trajectory is bit-identical to running the job alone. Moving
the optimizer step of a GradientSync job to the start of the next compute phase keeps it
under the token (it is compute) and off the sync thread (our choice: the paper's
abstract does not say where the update runs; see ``mpicomm.sched.crossover``).

With GradientSync the buckets start averaging during backward, on GradientSync's own
communication thread; the sync phase waits for the rest. The communicator is the
scheduler's duplicate for this job, so no message of one job can match another's.

Under the virtual clock (:mod:`mpicomm.clock`) a compute phase charges the cost table's
``forward``, ``backward`` and ``optimizer`` (measure them first with
:func:`mpicomm.torch.costs.calibrate_model`; a missing entry is a ``KeyError`` that
says so), and ``delay_s`` advances the virtual time instead of sleeping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .. import clock
from ..comm import Communicator
from ..control.adacomm import AdaComm
from ..sched.job import Job, check_steps
from ..strategies import Strategy
from .gradsync import GradientSync
from .localsgd import LocalSGD
from .strategy_options import build_strategy, keyword_names

__all__ = ["TorchJob"]


class TorchJob(Job):
    """Train ``model`` on ``data`` as one job of a ``mpicomm.sched.CrossoverScheduler``.

    Parameters
    ----------
    name:
        Unique job name (timeline row, error messages).
    model, optimizer:
        The replica on this rank and its optimizer (over ``model``'s parameters).
    data:
        This rank's batches, an iterable of ``(inputs, targets)``; ``steps`` of them are
        used, one per iteration.
    loss_fn:
        ``loss_fn(model(inputs), targets)`` -> scalar loss tensor.
    steps:
        Iterations (default ``len(data)``); the same on every rank.
    strategy:
        Gradient averaging through ``mpicomm.torch.GradientSync``: a
        ``mpicomm.strategies.Strategy``, ``None`` for ``"dense"`` (allreduce), or one of
        the names dense, topk, gtopk, artopk, randomk, qsgd, powersgd, fp16, bf16, sign,
        auto, with its options as further keywords (``strategy="gtopk",
        density=0.05``; the table is in ``help(mpicomm.torch.GradientSync)``). Exclusive
        with ``local_sgd``.
    local_sgd:
        An averaging period (int) or an ``mpicomm.control.AdaComm``: the job uses
        ``mpicomm.torch.LocalSGD`` instead (local optimizer steps, parameters
        averaged in the sync phase every period).
    bucket_mb:
        GradientSync's bucket size.
    delay_s:
        Benchmarking hook: seconds slept at the end of every sync phase, emulating the
        latency of a slower network (as ``LocalSGD(delay_s=...)``); 0 in real training.
    on_step:
        ``on_step(step, job)`` is called under the token once iteration ``step``'s update
        is complete (parameters final for that step), e.g. to record a trajectory.
    **strategy_options:
        Options of the strategy named by ``strategy``. A keyword that neither this class
        nor the strategy takes raises ``TypeError`` at construction.

    ``losses`` holds this rank's loss of every iteration (floats), ``sync_object`` the
    GradientSync or LocalSGD built by ``setup``.
    """

    def __init__(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 data: Iterable[Any], loss_fn: Callable[[Any, Any], torch.Tensor], *,
                 steps: int | None = None, strategy: Strategy | str | None = None,
                 local_sgd: int | AdaComm | None = None, bucket_mb: float = 25.0,
                 delay_s: float = 0.0,
                 on_step: Callable[[int, TorchJob], Any] | None = None,
                 **strategy_options: Any):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"job {name!r}: model must be a torch.nn.Module, got "
                            f"{type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"job {name!r}: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not isinstance(data, Iterable):
            raise TypeError(f"job {name!r}: data must be an iterable of (inputs, targets), "
                            f"got {type(data).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"job {name!r}: loss_fn must be callable")
        if steps is None:
            if not hasattr(data, "__len__"):
                raise ValueError(f"job {name!r}: data has no len(); pass steps")
            steps = len(data)  # type: ignore[arg-type]
        if strategy is not None and local_sgd is not None:
            raise ValueError(f"job {name!r}: give strategy (gradient averaging) or local_sgd "
                             "(parameter averaging), not both")
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) \
                or not (delay_s >= 0 and math.isfinite(delay_s)):
            raise ValueError(f"job {name!r}: delay_s must be finite seconds >= 0, got "
                             f"{delay_s!r}")
        if on_step is not None and not callable(on_step):
            raise TypeError(f"job {name!r}: on_step must be callable or None")
        built: Strategy | None = None
        if local_sgd is None:
            built = build_strategy(strategy, strategy_options, owner=f"TorchJob {name!r}",
                                   owner_options=_OPTIONS)
        elif strategy_options:
            raise TypeError(f"job {name!r}: strategy options "
                            f"{', '.join(map(repr, sorted(strategy_options)))} go with "
                            "strategy (gradient averaging), not with local_sgd")
        super().__init__(name, check_steps(steps))
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.loss_fn = loss_fn
        self.strategy = strategy
        self.strategy_options = dict(strategy_options)
        self._strategy = built  # bound to the job's communicator by setup()
        self.local_sgd = local_sgd
        self.bucket_mb = bucket_mb
        self.delay_s = float(delay_s)
        self.on_step = on_step
        self.losses: list[float] = []
        self.sync_object: GradientSync | LocalSGD | None = None
        self._batches: Iterator[Any] | None = None
        self._loss: torch.Tensor | None = None
        self._apply = False  # a GradientSync step whose averaged gradients await the optimizer
        self._done = -1      # the last iteration whose update is complete

    def describe(self) -> tuple[Any, ...]:
        """What every rank must agree on: name, steps, and how the job synchronizes."""
        how: tuple[Any, ...] = (
            ("local_sgd", repr(self.local_sgd)) if self.local_sgd is not None
            else ("strategy", self.strategy if isinstance(self.strategy, str)
                  else type(self.strategy).__name__))
        if self.strategy_options:  # values that compare across ranks; others by type
            how += (tuple((k, v if isinstance(v, (bool, int, float, str, type(None)))
                           else type(v).__name__)
                          for k, v in sorted(self.strategy_options.items())),)
        return (*super().describe(), how)

    def setup(self, comm: Communicator) -> None:
        """Build the GradientSync or LocalSGD on ``comm`` (collective: both broadcast
        rank 0's weights)."""
        super().setup(comm)
        if self.local_sgd is not None:
            self.sync_object = LocalSGD(self.model, self.local_sgd, self.optimizer, comm=comm)
        else:
            self.sync_object = GradientSync(self.model, self._strategy, self.bucket_mb,
                                            comm=comm)
        self._batches = iter(self.data)

    def compute(self, step: int) -> None:
        """Apply iteration ``step - 1`` (GradientSync), then forward and backward on the
        next batch (and, with LocalSGD, the local optimizer step)."""
        self._complete(step - 1)
        assert self._batches is not None, "setup() was not called"
        try:
            inputs, targets = next(self._batches)
        except StopIteration:
            raise ValueError(f"job {self.name!r}: data ran out after {step} batches "
                             f"(steps={self.steps})") from None
        self.optimizer.zero_grad()
        clock.charge("forward")      # the virtual clock's step (mpicomm.torch.costs)
        loss = self.loss_fn(self.model(inputs), targets)
        loss.backward()
        clock.charge("backward")
        if isinstance(self.sync_object, LocalSGD):
            clock.charge("optimizer")
            self.optimizer.step()
        self._loss = loss.detach()

    def sync(self, step: int) -> None:
        """Wait for the averaged gradients (GradientSync) or count a local step and
        average every period (LocalSGD), on the job's communicator; then ``delay_s``."""
        assert self._loss is not None
        if isinstance(self.sync_object, GradientSync):
            self._apply = self.sync_object.wait()
        else:
            assert self.sync_object is not None
            self.sync_object.step(self._loss)
        self.losses.append(float(self._loss))
        if self.delay_s:
            clock.sleep(self.delay_s)

    def finish(self) -> None:
        """Apply the last iteration's update."""
        self._complete(self.steps - 1)

    def _complete(self, step: int) -> None:
        """Finish iteration ``step``'s update (GradientSync: the optimizer step)."""
        if step < 0 or step <= self._done:
            return
        if self._apply:
            clock.charge("optimizer")
            self.optimizer.step()
            self._apply = False
        self._done = step
        if self.on_step is not None:
            self.on_step(step, self)

    def close(self) -> None:
        """Close the GradientSync (collective: frees its communicator)."""
        if isinstance(self.sync_object, GradientSync):
            self.sync_object.close()


#: The keywords ``TorchJob`` takes itself; any other keyword is a strategy option.
_OPTIONS = keyword_names(TorchJob.__init__, ("name", "model", "optimizer", "data", "loss_fn",
                                             "strategy"))
