r"""Local SGD (periodic parameter averaging, "PASGD"), with a fixed period or AdaComm.

Every rank trains its own replica with its own optimizer; every ``tau`` local steps the
replicas are replaced by their average::

    x_i <- x_i - eta * grad f(x_i; own minibatch)          (each local step)
    x_i <- (1/P) * sum_j x_j                                (every tau steps: allreduce)

``tau = 1`` is synchronous SGD: for plain SGD (no momentum, no weight decay differences)
it is mathematically identical to averaging gradients, since
``mean_j(x - eta g_j) = x - eta mean_j(g_j)``.

Cost per averaging round: one allreduce of all averaged tensors fused into one flat
buffer per (dtype, device): about ``2(P-1)/P * n`` bytes per rank with the ring
algorithm, i.e. ``1/tau`` of synchronous SGD's traffic per step, plus (with AdaComm) one
small control message (``allgather`` of two floats) when a decision needs the loss.

Example::

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSGD(model, AdaComm(tau0=16, interval_rounds=10), opt)
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        local.step(loss)          # averages when tau local steps have passed
    local.average()               # leave every rank with the same final model
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Union

import numpy as np
import torch

from ..clock import now as clock_now
from ..clock import sleep as clock_sleep
from ..collectives import ALGORITHMS, allreduce, cost
from ..comm import Communicator, Traffic, resolve
from ..control.adacomm import AdaComm
from ..fusion import Layout, LayoutCache, group, kind_of
from ..observe.metrics import metrics_from, scalar
from ..validate import check_algorithm, check_int
from .replicas import broadcast_module, check_model

__all__ = ["LocalSGD"]

Delay = Union[float, Callable[[int], float]]


class FusedTensors:
    """Tensors of one or more dtypes/devices packed into one flat buffer per group.

    ``pack()`` copies the tensors into the flat buffers, ``unpack()`` copies them back;
    the flat buffers are persistent (``mpicomm.fusion.Layout``) and reused while the
    group's tensors keep their shapes. Grouping is ``mpicomm.fusion.group`` by
    ``(dtype, device)``, without a size cap. The order of tensors (and so the layout) is
    the order given, which must be the same on every rank.
    """

    def __init__(self) -> None:
        self._cache = LayoutCache()
        self.groups: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self._layouts: list[Layout] = []

    def pack(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Group ``tensors`` by (dtype, device), fill one flat buffer per group, return them."""
        tensors = list(tensors)
        plan = group([t.numel() * t.element_size() for t in tensors],
                     [kind_of(t) for t in tensors], None, consecutive=False)
        self.groups, self._layouts = [], []
        for idx in plan:
            ts = [tensors[i] for i in idx]
            layout = self._cache.get(kind_of(ts[0]), ts)
            self.groups.append((ts, layout.pack(ts)))
            self._layouts.append(layout)
        return [flat for _, flat in self.groups]

    def unpack(self) -> None:
        """Copy the flat buffers back into the tensors they were packed from."""
        for (ts, flat), layout in zip(self.groups, self._layouts):
            layout.unpack(ts, flat)

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for _, f in self.groups)


class LocalSGD:
    """Average a model's replicas every ``period`` local steps.

    Call ``step`` once after each ``optimizer.step()``; it counts the local step and,
    when ``period`` steps have passed since the last averaging, replaces the parameters
    (and the floating-point buffers, and optionally the momentum) on every rank by their
    average over the ranks. The constructor broadcasts rank 0's parameters and buffers,
    so all replicas start equal (collective: every rank must construct it).

    What is averaged
    ----------------
    * All parameters (frozen ones too: they are equal anyway, and skipping them would
      make the layout depend on ``requires_grad``).
    * Floating-point buffers (BatchNorm running statistics) when ``average_buffers``
      (default): otherwise each replica keeps statistics of its own data shard only and
      the replicas are not identical after averaging. Integer buffers (BatchNorm's
      ``num_batches_tracked``) are left alone: they count local steps and are already
      equal on all ranks.
    * With ``average_momentum=True`` and an optimizer, the SGD momentum buffers
      (``optimizer.state[p]["momentum_buffer"]``). Momentum stays local by default (as
      in the paper's experiments, as far as is known); averaging it doubles the traffic
      per round but removes the momentum drift between replicas. A parameter that got
      no gradient on some rank has no buffer there: before each round the ranks agree
      (one small max-allreduce of a presence flag per parameter) on which parameters
      have a buffer anywhere, and a rank missing one gets a zero buffer (no momentum
      yet), so every rank reduces the same layout and all end with the same buffers.
      Parameters with a buffer on no rank are skipped. (Ours; the paper does not
      average momentum.)

    All of it goes into one flat buffer per (dtype, device), reduced with
    ``mpicomm.allreduce(op="avg", algorithm=algorithm)``.

    The period
    ----------
    ``period`` is an int >= 1 (fixed) or an ``mpicomm.control.AdaComm``. With
    AdaComm, ``step`` needs the loss of each local step. At the first step, ``F_0``
    is that step's loss averaged over the ranks and ``eta_0`` the learning rate then
    (unless ``period.start()`` was already called). At each averaging round the loss fed
    to the rule is the mean of this rank's losses since the last averaging, averaged
    over the ranks (an ``allgather`` of three floats, so identical on every rank; made
    only when a decision needs it); with ``AdaComm(noise="drift")`` every averaging
    round also measures the replicas' drift, ``(||x_i||^2 - ||xbar||^2) / tau`` on
    this rank (two squared-norm passes over the parameters, before and after; its mean
    over the ranks is ``mean_i ||x_i - xbar||^2 / tau`` exactly), and its mean over the
    interval's rounds travels in the same allgather; the learning rate is
    ``optimizer.param_groups[0]["lr"]`` (so an optimizer is required), sent in the same
    allgather: if it differs between ranks (a scheduler stepped differently), every
    rank raises ``ValueError`` instead of taking different periods and deadlocking. With
    ``interval_s``, the elapsed time is ``clock()`` since construction, agreed as the
    maximum over the ranks, so every rank takes the same decision. The interval length
    is counted in averaging rounds or seconds as configured; a new period takes effect
    from the next local step.

    Benchmarking hook
    -----------------
    ``delay_s`` injects a communication delay: after every averaging round each rank
    sleeps ``delay_s`` seconds (a float), or ``delay_s(round_index)`` seconds (a
    callable, e.g. for a random or growing delay). It emulates a slow network (the
    runtime model's ``D``) on a fast machine; leave it at 0 in real training.

    Parameters
    ----------
    model:
        The ``torch.nn.Module`` replica.
    period:
        Fixed period (int >= 1) or an ``AdaComm`` controller.
    optimizer:
        The local optimizer; needed for AdaComm (learning rate) and momentum averaging.
    average_momentum:
        Also average SGD momentum buffers (default ``False``).
    average_buffers:
        Also average floating-point buffers (default ``True``).
    comm:
        ``mpicomm.Communicator`` (default: the world).
    algorithm:
        Allreduce algorithm: ``"auto"``, ``"ring"``, ``"recursive_doubling"``,
        ``"rabenseifner"`` or ``"mpi"`` (uncounted in ``traffic``).
    delay_s:
        Injected delay per averaging round (see above).
    clock:
        Seconds clock for ``interval_s`` (default ``mpicomm.clock.now``, the wall
        or the virtual clock); tests and benchmarks that exclude evaluation time pass
        their own.
    metrics:
        A ``mpicomm.observe.metrics.Metrics`` (or a path for a new one) that gets one
        record per ``step`` (``tau``, ``rounds``, ``averaged``, bytes, and the ``loss``
        passed to ``step``); default: one writing to ``MPICOMM_METRICS`` when that is
        set, else none (no cost).

    Tuning: with communication time ``D`` per round and ``Y`` per local step, a fixed
    period speeds each step up by ``(1 + D/Y) / (1 + D/(tau Y))``; gains flatten once
    ``tau >> D/Y``, while the replicas' drift (and so the loss floor) grows with ``tau``.
    Start around ``tau = D/Y`` or use AdaComm.
    """

    def __init__(self, model: torch.nn.Module, period: int | AdaComm,
                 optimizer: torch.optim.Optimizer | None = None, *,
                 average_momentum: bool = False, average_buffers: bool = True,
                 comm: Communicator | None = None, algorithm: str = "auto",
                 delay_s: Delay = 0.0, clock: Callable[[], float] = clock_now,
                 metrics: Any = None):
        self.model = check_model(model)
        if isinstance(period, AdaComm):
            self.adacomm: AdaComm | None = period
            self._fixed = period.tau
        else:
            self.adacomm = None
            self._fixed = check_int("period (an int or an AdaComm)", period, 1)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if self.adacomm is not None:
            if optimizer is None:
                raise ValueError("AdaComm needs the optimizer (it reads the learning rate "
                                 "from optimizer.param_groups[0]['lr'])")
            if "lr" not in optimizer.param_groups[0]:
                raise ValueError("optimizer.param_groups[0] has no 'lr'")
        if average_momentum and optimizer is None:
            raise ValueError("average_momentum=True needs the optimizer")
        check_algorithm("allreduce", algorithm, ALGORITHMS["allreduce"])
        if not callable(delay_s):
            if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)):
                raise TypeError(f"delay_s must be seconds or a callable, got "
                                f"{type(delay_s).__name__}")
            if not (delay_s >= 0 and math.isfinite(delay_s)):
                raise ValueError(f"delay_s must be finite and >= 0, got {delay_s}")
        self.optimizer = optimizer
        self.average_momentum = bool(average_momentum)
        self.average_buffers = bool(average_buffers)
        self.comm = resolve(comm)
        self.algorithm = algorithm
        self.delay_s = delay_s
        self.clock = clock
        self.metrics = metrics_from(metrics)
        #: Averaging rounds done (scheduled ones and ``average`` calls).
        self.rounds = 0
        #: Calls to ``step`` (local steps taken).
        self.local_steps = 0
        #: Local steps since the last averaging.
        self.steps_since_average = 0
        #: Bytes this object's averaging moved through mpicomm's own algorithms
        #: (not the initial broadcast; nothing for ``algorithm="mpi"``).
        self.traffic = Traffic()
        self._fused = FusedTensors()
        self._loss_sum: Any = 0.0
        self._loss_count = 0
        self._drift_sum, self._drift_rounds = 0.0, 0  # AdaComm(noise="drift")
        broadcast_module(self.model, 0, self.comm)
        self._start = clock()

    # ------------------------------------------------------------------ state
    @property
    def period(self) -> int:
        """The averaging period in force (AdaComm's current ``tau``, or the fixed one)."""
        return self.adacomm.tau if self.adacomm is not None else self._fixed

    @property
    def bytes_per_round(self) -> int:
        """Bytes of the fused buffers one averaging round reduces (0 before the first)."""
        return self._fused.nbytes

    @property
    def history(self) -> list[Any]:
        """AdaComm's decisions (``mpicomm.control.adacomm.AdaCommDecision``), or []."""
        return list(self.adacomm.history) if self.adacomm is not None else []

    def __repr__(self) -> str:
        return (f"LocalSGD(period={self.period}, rounds={self.rounds}, "
                f"local_steps={self.local_steps}, adacomm={self.adacomm!r})")

    def state_dict(self) -> dict[str, Any]:
        """This rank's schedule state (counters, the loss accumulated since the last
        averaging, the agreed elapsed time, AdaComm's state): with the model's and the
        optimizer's state, what a checkpoint needs to continue exactly here
        (``mpicomm.checkpoint.Checkpointer``). The model itself is not in it."""
        return {"rounds": self.rounds, "local_steps": self.local_steps,
                "steps_since_average": self.steps_since_average,
                "loss_sum": float(self._loss_sum), "loss_count": self._loss_count,
                "elapsed": self.clock() - self._start,
                "sent_bytes": self.traffic.sent_bytes, "recv_bytes": self.traffic.recv_bytes,
                "messages": self.traffic.messages,
                "adacomm": None if self.adacomm is None else self.adacomm.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s output (the clock continues from the saved
        elapsed time); ``ValueError`` if it holds AdaComm state and this object runs a
        fixed period, or the other way round."""
        if (state.get("adacomm") is None) != (self.adacomm is None):
            raise ValueError("LocalSGD.load_state_dict: the state is of a "
                             f"{'fixed-period' if state.get('adacomm') is None else 'AdaComm'} "
                             "run, this LocalSGD is not")
        self.rounds = int(state["rounds"])
        self.local_steps = int(state["local_steps"])
        self.steps_since_average = int(state["steps_since_average"])
        self._loss_sum = float(state["loss_sum"])
        self._loss_count = int(state["loss_count"])
        self._start = self.clock() - float(state["elapsed"])
        self.traffic.sent_bytes = int(state.get("sent_bytes", 0))
        self.traffic.recv_bytes = int(state.get("recv_bytes", 0))
        self.traffic.messages = int(state.get("messages", 0))
        if self.adacomm is not None:
            self.adacomm.load_state_dict(state["adacomm"])

    # ------------------------------------------------------------------ training
    def step(self, loss: Any = None) -> bool:
        """Count one local step; average if the period is reached. Returns whether it did.

        ``loss`` (a float or a scalar tensor, this step's training loss) is required with
        AdaComm; with metrics on (``metrics=`` or ``MPICOMM_METRICS``) it goes into the
        step's record, so that the plots have a loss curve. Collective at averaging steps
        (and, with AdaComm, at the first step, which agrees on ``F_0``).
        """
        averaged = self._step(loss)
        if self.metrics is not None:
            self.metrics.observe(self, **({} if loss is None else {"loss": scalar(loss)}))
        return averaged

    def _step(self, loss: Any) -> bool:
        """``step`` without its metrics record."""
        if loss is not None:
            self._loss_sum = self._loss_sum + (loss.detach() if torch.is_tensor(loss)
                                               else float(loss))
            self._loss_count += 1
        elif self.adacomm is not None:
            raise ValueError("LocalSGD with AdaComm needs step(loss)")
        if self.adacomm is not None and not self.adacomm.started:
            self._start_adacomm()
        self.local_steps += 1
        self.steps_since_average += 1
        if self.steps_since_average < self.period:
            return False
        drift = self.adacomm is not None and self.adacomm.noise == "drift"
        before = self._squared_norm() if drift else 0.0
        self.average()
        if drift:
            self._drift_sum += (before - self._squared_norm()) / self.steps_since_average
            self._drift_rounds += 1
        self.steps_since_average = 0
        if self.adacomm is not None:
            self._adapt()
        self._loss_sum, self._loss_count = 0.0, 0
        return True

    def tensors(self) -> list[torch.Tensor]:
        """What an averaging round reduces, in layout order."""
        out = list(self.model.parameters())
        if self.average_buffers:
            out += [b for b in self.model.buffers() if b.is_floating_point()]
        if self.average_momentum and self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
                    if buf is not None:
                        out.append(buf)
        return out

    def predict_round_s(self) -> float:
        """The cost model's seconds for one averaging round: an allreduce of the bytes of
        ``tensors()`` with the algorithm it picks, on this communicator's calibration."""
        n = sum(t.numel() * t.element_size() for t in self.tensors())
        p, params = self.comm.size, self.comm.resources.get("cost_params")
        return cost.predict("allreduce", cost.choose("allreduce", n, p, params), n, p, params)

    def average(self) -> None:
        """Average now (collective), without changing the schedule or AdaComm's state.

        Used by ``step``; call it directly at the end of training (or before an
        evaluation) to leave every rank with the same model.
        """
        if self.average_momentum:
            self._align_momentum()
        with self.comm.traffic.measure(into=self.traffic):
            for flat in self._fused.pack(self.tensors()):
                allreduce(flat, op="avg", algorithm=self.algorithm, comm=self.comm, out=flat)
        self._fused.unpack()
        delay = self.delay_s(self.rounds) if callable(self.delay_s) else self.delay_s
        if delay > 0:
            clock_sleep(delay)
        self.rounds += 1

    @torch.no_grad()
    def _align_momentum(self) -> None:
        """Give this rank a zero momentum buffer wherever another rank has one (collective:
        one max-allreduce of a flag per parameter), so the fused layout is the same on
        every rank."""
        assert self.optimizer is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not params:
            return
        have = np.array([self.optimizer.state.get(p, {}).get("momentum_buffer") is not None
                         for p in params], dtype=np.uint8)
        anywhere = allreduce(have, op="max", algorithm="mpi", comm=self.comm)
        for p, mine, theirs in zip(params, have, anywhere):
            if theirs and not mine:
                self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format)

    # ------------------------------------------------------------------ AdaComm
    @torch.no_grad()
    def _squared_norm(self) -> float:
        """``||x||^2`` of this replica's parameters, summed in float64."""
        return float(sum(float(p.detach().double().pow(2).sum())
                         for p in self.model.parameters()))

    def _agree(self, lr: float) -> tuple[float, float, float]:
        """(loss averaged over ranks, elapsed = max over ranks, drift per local step
        averaged over ranks and the interval's rounds): identical everywhere.

        The learning rate travels with them; ``ValueError`` on every rank if it differs.
        """
        local = float(self._loss_sum) / max(self._loss_count, 1)
        drift = self._drift_sum / max(self._drift_rounds, 1)
        everyone = self.comm.allgather_object((local, self.clock() - self._start, lr,
                                               drift))
        if len({v[2] for v in everyone}) > 1:
            rates = ", ".join(f"rank {r}: {v[2]!r}" for r, v in enumerate(everyone))
            raise ValueError("LocalSGD with AdaComm: the learning rate differs across ranks "
                             f"({rates}); AdaComm's period depends on it, so every rank "
                             "must use the same learning rate schedule")
        return (sum(v[0] for v in everyone) / len(everyone), max(v[1] for v in everyone),
                max(0.0, sum(v[3] for v in everyone) / len(everyone)))

    def _lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def _start_adacomm(self) -> None:
        """F_0 = the first local step's loss averaged over the ranks (one control message):
        the replicas are identical then, so this is a minibatch estimate of F(x_0) from
        P minibatches, as in the paper."""
        assert self.adacomm is not None
        lr = self._lr()
        loss, elapsed, _ = self._agree(lr)
        self.adacomm.start(loss, lr, elapsed)

    def _adapt(self) -> None:
        ada = self.adacomm
        assert ada is not None
        lr = self._lr()
        decisions = len(ada.history)
        if ada.interval_s is not None:
            loss, elapsed, drift = self._agree(lr)
            ada.observe(loss, lr, elapsed, drift=drift)
        elif ada.due():
            loss, _, drift = self._agree(lr)
            ada.observe(loss, lr, drift=drift)
        else:
            ada.observe()
        if len(ada.history) > decisions:  # an interval ended: its drift is spent
            self._drift_sum, self._drift_rounds = 0.0, 0
