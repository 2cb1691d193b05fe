"""How the time-to-accuracy harness (:mod:`mpicomm.bench.harness`) keeps the replicas in
step: one class per method, all with the same small interface.

* :class:`GradientMethod`: every step's gradients averaged by a strategy through
  :class:`~mpicomm.torch.GradientSync` (dense, compressed, ``auto``); optional clipping of
  the averaged gradient (global norm) before the optimizer step.
* :class:`LocalSGDMethod`: local optimizer steps, parameters averaged every ``tau`` steps
  (:class:`~mpicomm.torch.LocalSGD`, fixed period or :class:`~mpicomm.control.AdaComm`).
  The replicas agree only right after an averaging round, so the harness evaluates there
  (or averages first, at the end of a run).
* :class:`PSMethod`: workers push gradients to a :class:`~mpicomm.ps.KVStore` and pull
  parameters (:class:`~mpicomm.torch.PSOptimizer`); the servers run the optimizer. Before
  an evaluation every worker pulls and takes worker 0's copy (in async modes the workers'
  copies differ).

Interface used by the harness: ``optimizer(model, lr, momentum, weight_decay)``,
``start(model, opt, comm, clip_norm=, clock=)``, ``update(loss)`` (after ``backward``),
``sent_bytes()`` (this rank, since ``start``), ``decision()`` (a small dict or ``None``),
``can_evaluate()``, ``make_consistent()``, ``finish()``, ``summary()``,
``describe_setup()`` and the attributes ``label``, ``owns_momentum`` and ``metrics`` (a
:class:`~mpicomm.observe.metrics.Metrics` or ``None``: the method writes one record per
step into it; the harness sets it before ``start`` when metrics are on and the method
has none, and notes each step's loss into it first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import clock
from ..strategies import Strategy
from . import harness
from .harness import make_optimizer


class GradientMethod:
    """Average gradients every step with ``strategy`` (:class:`GradientSync`).

    ``owns_momentum``: the strategy keeps the velocity (DGC's momentum correction), so the
    optimizer runs without momentum. ``bucket_mb``/``metrics`` go to GradientSync.
    """

    def __init__(self, strategy: Strategy, *, label: str | None = None,
                 owns_momentum: bool = False, bucket_mb: float | None = None,
                 metrics: Any = None) -> None:
        self.strategy, self.owns_momentum = strategy, owns_momentum
        self.label = label or strategy.name
        self.bucket_mb, self.metrics = bucket_mb, metrics
        self.gs: Any = None
        self._before: Any = None
        self._steps = 0

    def optimizer(self, model: torch.nn.Module, lr: float, momentum: float,
                  weight_decay: float) -> torch.optim.Optimizer:
        return make_optimizer(model.parameters(), lr, 0.0 if self.owns_momentum else momentum,
                              weight_decay)

    def start(self, model: torch.nn.Module, opt: Any, comm: Any, *,
              clip_norm: float | None = None, clock: Callable[[], float] | None = None
              ) -> None:
        from ..torch import GradientSync

        kw: dict[str, Any] = {"comm": comm, "metrics": self.metrics}
        if self.bucket_mb is not None:
            kw["bucket_mb"] = self.bucket_mb
        self.gs = GradientSync(model, strategy=self.strategy, **kw)
        self.model, self.opt, self.clip_norm = model, opt, clip_norm
        self.strategy = self.gs.strategy
        self._before = self.strategy.comm.traffic.snapshot()

    @property
    def comm(self) -> Any:
        """The strategy's communicator (its traffic counters, its resources)."""
        return self.strategy.comm

    def update(self, loss: torch.Tensor) -> None:
        if self.gs.wait():
            if self.clip_norm:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
            clock.charge("optimizer")  # virtual clock (harness.step_costs)
            self.opt.step()
            self.strategy.step_done(self.model, self.opt)  # adaptive strategies decide here
        self._steps += 1

    def sent_bytes(self) -> int:
        if self.gs is None:
            return 0
        return (self.strategy.comm.traffic - self._before).sent_bytes

    def decision(self) -> dict[str, Any] | None:
        records = getattr(self.strategy, "records", None)
        if records:
            r = records[-1]
            return {"scheme": r.scheme, "ratio": float(r.ratio)}
        schedule = getattr(self.strategy, "schedule", None)
        density = getattr(self.strategy, "density", None)
        if schedule is not None and density is not None:
            return {"density": float(schedule(self._steps - 1, density))}
        return None

    def can_evaluate(self) -> bool:
        return True

    def make_consistent(self) -> None:
        pass

    def finish(self) -> None:
        if self.gs is not None:
            self.gs.close()

    def summary(self) -> dict[str, Any]:
        s = self.gs.stats
        out = {"describe": self.strategy.describe(),
               "sync": {"steps": s.steps, "comm_s": s.comm_seconds,
                        "wait_s": s.wait_seconds}}
        overheads = getattr(self.strategy, "overheads", None)
        if overheads is not None:  # the auto strategy's controllers (this rank)
            out["overheads"] = dict(overheads)
        return out

    def describe_setup(self) -> dict[str, Any]:
        return {"method": "gradient", "strategy": self.label,
                "owns_momentum": self.owns_momentum}

    def state_objects(self) -> dict[str, Any]:
        """What a checkpoint saves besides the model and optimizer (after :meth:`start`):
        GradientSync (error-feedback residuals, warm starts, controllers)."""
        return {"sync": self.gs}


class LocalSGDMethod:
    """Local steps; :class:`LocalSGD` averages parameters every ``period`` steps (an int,
    or an :class:`~mpicomm.control.AdaComm`). ``delay_s``: injected seconds per round."""

    owns_momentum = False

    def __init__(self, period: Any, *, label: str | None = None, algorithm: str = "auto",
                 delay_s: float = 0.0, metrics: Any = None) -> None:
        self.period, self.algorithm, self.delay_s = period, algorithm, delay_s
        self.label = label or (f"tau={period}" if isinstance(period, int) else "adacomm")
        self.metrics = metrics
        self.local: Any = None
        self.averaged = False

    def optimizer(self, model: torch.nn.Module, lr: float, momentum: float,
                  weight_decay: float) -> torch.optim.Optimizer:
        return make_optimizer(model.parameters(), lr, momentum, weight_decay)

    def start(self, model: torch.nn.Module, opt: Any, comm: Any, *,
              clip_norm: float | None = None, clock: Callable[[], float] | None = None
              ) -> None:
        from ..torch import LocalSGD

        self.local = LocalSGD(model, self.period, opt, comm=comm, algorithm=self.algorithm,
                              delay_s=self.delay_s, metrics=self.metrics,
                              **({"clock": clock} if clock else {}))
        self.opt, self.clip_norm, self.model = opt, clip_norm, model
        self.averaged = True  # LocalSGD starts every rank from rank 0's parameters

    def update(self, loss: torch.Tensor) -> None:
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        clock.charge("optimizer")  # virtual clock (harness.step_costs)
        self.opt.step()
        self.averaged = bool(self.local.step(loss))  # a metrics record with the loss

    def sent_bytes(self) -> int:
        return self.local.traffic.sent_bytes if self.local is not None else 0

    def decision(self) -> dict[str, Any] | None:
        return {"tau": int(self.local.period)}

    def can_evaluate(self) -> bool:
        return self.averaged

    def make_consistent(self) -> None:
        self.local.average()
        self.averaged = True

    def finish(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        local = self.local
        out: dict[str, Any] = {"rounds": local.rounds, "local_steps": local.local_steps,
                               "final_period": local.period, "algorithm": local.algorithm}
        if local.adacomm is not None:
            out["adacomm"] = repr(local.adacomm)
            out["tau_history"] = [d.tau for d in local.history]
        return out

    def describe_setup(self) -> dict[str, Any]:
        return {"method": "local-sgd", "period": self.label, "algorithm": self.algorithm,
                "delay_s": self.delay_s}

    def state_objects(self) -> dict[str, Any]:
        """What a checkpoint saves besides the model and optimizer (after :meth:`start`):
        LocalSGD (its period schedule, AdaComm)."""
        return {"sync": self.local}


class PSMethod:
    """Push gradients to, and pull parameters from, ``kv`` (a worker's
    :class:`~mpicomm.ps.KVStore`); the servers own lr, momentum and weight decay.
    ``slow_factor`` > 1 makes this worker a straggler: after each step's computation it
    sleeps ``slow_factor - 1`` times that computation's duration; ``sleep_s`` adds a fixed
    emulated compute time per step (before the push), ``pause`` one drawn anew each step
    (a callable returning seconds: a straggler that comes and goes). All go through
    :func:`mpicomm.clock.sleep`: slept on the wall clock, charged on the virtual one.
    ``metrics``: a record per step (:meth:`mpicomm.observe.metrics.Metrics.observe` of
    the store)."""

    owns_momentum = True

    def __init__(self, kv: Any, *, label: str | None = None, slow_factor: float = 1.0,
                 sleep_s: float = 0.0, pause: Callable[[], float] | None = None,
                 metrics: Any = None) -> None:
        self.kv, self.slow_factor, self.sleep_s, self.pause = kv, slow_factor, sleep_s, pause
        self.metrics = metrics
        self.label = label or f"ps-{kv.mode}"
        self.opt: Any = None
        self._t0 = harness.now()

    def optimizer(self, model: torch.nn.Module, lr: float, momentum: float,
                  weight_decay: float) -> Any:
        from ..torch import PSOptimizer

        self.opt = PSOptimizer(model, self.kv)
        zero = self.opt.zero_grad

        def zero_grad() -> None:  # the straggler's compute time starts here
            self._t0 = harness.now()
            zero()

        self.opt.zero_grad = zero_grad
        return self.opt

    def start(self, model: torch.nn.Module, opt: Any, comm: Any, *,
              clip_norm: float | None = None, clock: Callable[[], float] | None = None
              ) -> None:
        self.model, self.comm = model, comm

    def update(self, loss: torch.Tensor) -> None:
        if self.slow_factor > 1:   # virtual clock: charged, not slept
            clock.sleep((self.slow_factor - 1) * (harness.now() - self._t0))
        if self.sleep_s:
            clock.sleep(self.sleep_s)
        if self.pause is not None:
            clock.sleep(self.pause())
        self.opt.step()
        if self.metrics is not None:  # bytes pushed and pulled, staleness, the loss noted
            self.metrics.observe(self.kv)

    def sent_bytes(self) -> int:
        return int(self.kv.stats()["bytes_pushed"])

    def decision(self) -> dict[str, Any] | None:
        return None

    def can_evaluate(self) -> bool:
        return False

    def make_consistent(self) -> None:
        """Every push is in: pull, then worker 0's copy everywhere."""
        self.comm.barrier()
        self.opt.pull()
        for p in self.model.parameters():
            p.data.copy_(torch.from_numpy(self.comm.bcast_object(p.data.numpy())))

    def finish(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {"worker_stats": self.kv.stats()}

    def describe_setup(self) -> dict[str, Any]:
        return {"method": "parameter-server", "mode": self.kv.mode,
                "slow_factor": self.slow_factor, "sleep_s": self.sleep_s,
                "pause": None if self.pause is None else str(self.pause)}

    def state_objects(self) -> dict[str, Any]:
        """Nothing besides the model: the store is checkpointed through ``kv=``."""
        return {}
