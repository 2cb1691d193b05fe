r"""AdaComm: choose the local-SGD averaging period from the training loss.

Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best Error-Runtime
Trade-off in Local-Update SGD" (SysML 2019, arXiv 1810.08313).

This module is **pure**: it holds the decision rule and its state and never
communicates. The caller (:class:`mpicomm.torch.LocalSGD`, or your own loop) feeds it
values that are already identical on every rank, so every rank computes the same period.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional

from ..hooks import traced
from ..validate import check_int

__all__ = ["AdaComm", "AdaCommDecision", "adacomm_period", "initial_period"]


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def adacomm_period(tau0: int, loss: float, loss0: float, lr: float, lr0: float, *,
                   lr_exponent: float = 1.0, f_inf: float = 0.0, tau_min: int = 1,
                   tau_max: Optional[int] = None) -> tuple[int, float]:
    r"""The AdaComm rule, as a function: ``(tau, unclamped)``.

    .. math::
        \tau = \mathrm{clamp}\Big(\Big\lceil \tau_0\sqrt{(\eta_0/\eta)^{p}\,
               (F - F_{inf})/(F_0 - F_{inf})}\Big\rceil,\ \tau_{min},\ \tau_{max}\Big)

    ``unclamped`` is the value inside the ceiling (for logging and tests). A loss at or
    below ``f_inf`` gives a ratio of 0, hence ``tau_min``. Arguments are not validated
    here; :class:`AdaComm` does that.
    """
    ratio = max(loss - f_inf, 0.0) / (loss0 - f_inf)
    raw = tau0 * math.sqrt((lr0 / lr) ** lr_exponent * ratio)
    tau = max(tau_min, 1, math.ceil(raw))
    if tau_max is not None:
        tau = min(tau, tau_max)
    return tau, raw


def initial_period(step_s: float, round_s: float, reference: float = 32.0) -> int:
    r"""A starting period ``tau0`` for a network: ``reference`` scaled by the error
    bound's dependence on the cost of an averaging round.

    .. math::
        \tau_0 = \max\Big(1, \Big\lceil \tau_{ref} \sqrt{D / Y} \Big\rceil\Big)

    ``step_s`` is ``Y``, one local step; ``round_s`` is ``D``, one averaging round (an
    allreduce of the parameters: time one, or take
    :func:`mpicomm.collectives.cost.predict` for a declared network). Costs nothing to
    evaluate.

    Why: the bound behind :class:`AdaComm`,
    ``2 (F_0 - F_inf)/(eta T) (Y + D/tau) + eta^2 L^2 sigma^2 (tau - 1)`` over a
    wall-clock budget ``T``, is smallest at
    ``tau* = sqrt(2 (F_0 - F_inf) D / (eta^3 L^2 sigma^2 T))``: with the model, the data
    and the learning rate fixed, the best period grows with the square root of ``D``.
    ``L`` and ``sigma^2`` are unknown, so the period is tuned once, as ``reference`` for
    a link on which a round costs one local step (``D = Y``), and carried to other
    networks by that square root: 32 gives 33 at ``D = 1.06 Y`` and 104 at
    ``D = 10.5 Y``. A network ten times slower starts ``sqrt(10)`` = 3.2x higher, not
    10x: the drift term that limits the period does not depend on the network.

    Tuning: pick ``reference`` with a short grid search on any one network (16, 32, 64;
    the largest whose early loss per second keeps up with the smaller ones) and divide
    it by ``sqrt(D/Y)`` of that network.
    """
    step_s = _check_real("step_s", step_s)
    round_s = _check_real("round_s", round_s)
    reference = _check_real("reference", reference)
    if step_s <= 0 or round_s < 0:
        raise ValueError(f"need step_s > 0 and round_s >= 0, got {step_s} and {round_s}")
    if reference < 1:
        raise ValueError(f"reference must be >= 1, got {reference}")
    return max(1, math.ceil(reference * math.sqrt(round_s / step_s) - 1e-9))


@dataclass(frozen=True)
class AdaCommDecision:
    """One entry of :attr:`AdaComm.history`.

    ``round`` is the number of averaging rounds observed when the decision was made
    (0 for the start), ``elapsed`` the agreed clock value passed in (``None`` for
    round-based intervals), ``loss``/``lr`` the inputs, ``raw`` the value before the
    ceiling and the clamp, ``tau`` the period in force from then on, ``noise`` the
    gradient-noise estimate ``sigma^2`` used (``noise="drift"``; ``None`` otherwise).
    """

    round: int
    elapsed: Optional[float]
    loss: float
    lr: float
    raw: float
    tau: int
    noise: Optional[float] = None


class AdaComm:
    r"""Adaptive averaging period for local SGD (PASGD), decided per interval.

    The rule
    --------
    Training is cut into intervals. At the start of interval ``l`` the period is set to

    .. math::
        \tau_l = \Big\lceil \tau_0 \sqrt{(\eta_0/\eta_l)^{p}\,
                 \frac{F_l - F_{inf}}{F_0 - F_{inf}}} \Big\rceil
        \quad\text{clamped to } [\tau_{min}, \tau_{max}],\ \tau_l \ge 1,

    and kept for the whole interval. ``F_l`` is the training loss averaged over the ranks
    (the caller passes the already-averaged value), ``F_0``/``eta_0`` the loss and
    learning rate given to :meth:`start`, ``eta_l`` the current learning rate and
    ``p = lr_exponent``.

    Why (the paper's argument): the error-runtime bound of periodic averaging has a
    term that falls with ``tau`` (communication is amortized over ``tau`` steps) and one
    that grows with it (local models drift apart, ``~ eta^2 L^2 sigma^2 (tau - 1)``).
    Minimizing it gives ``tau* ~ sqrt((F - F_inf) / eta^3)``. Early on the loss is high
    and the drift penalty small compared with the progress bought by running fast, so
    *start by communicating rarely*; as the loss falls the drift term dominates, so
    *communicate more often*. When the learning rate drops the drift term shrinks, so
    ``tau`` *jumps up* and then shrinks again as the loss keeps falling.

    The exponent ``p``: the bound scales the period by ``(eta_0/eta_l)^{3/2}``, i.e.
    ``p = 3`` inside the root; both public re-implementations (PaddlePaddle's adaptive
    local SGD and the PaddleFleetX example) use the first power, which is the default
    here (``lr_exponent=1.0``); ``3`` follows the bound and ``0`` gives the basic
    fixed-learning-rate rule.

    Tuning
    ------
    * ``tau0``: the period to start with; pick it with a short grid search (a few hundred
      steps per candidate, e.g. 4, 8, 16, 32) taking the largest value whose early loss
      curve (per unit of *wall-clock*) still keeps up with the smaller ones. The paper
      used about 20 for VGG-16 on CIFAR-10. It should be at most where the speedup
      ``(1 + D/Y)/(1 + D/(tau Y))`` flattens (``D`` = time of one averaging round,
      ``Y`` = one local step); beyond that a larger period only adds drift.
      :func:`initial_period` carries a period tuned on one network to another (the
      bound's ``sqrt(D)``): a slow link needs a much larger start than a fast one.
    * The interval: long enough that ``F_l`` is a fair estimate and ``tau`` does not
      flap, short enough to follow the loss, typically 10-20 decisions per training run.
      ``interval_rounds`` (every N averaging rounds) is deterministic and needs no clock
      agreement; ``interval_s`` (wall-clock, the paper's ``T0``) matches the paper but
      requires the caller to pass an ``elapsed`` that is identical on all ranks, e.g. the
      maximum over ranks of their local clocks.
    * ``tau_min``/``tau_max``: clamps (PaddlePaddle clamps to ``[1, 16]``). ``tau >= 1``
      always holds.
    * ``f_inf``: a lower bound of the loss (0 for cross-entropy and squared losses).
    * ``noise``: ``"constant"`` (the paper's rule, above) or ``"drift"``. The bound
      behind the rule is ``tau* ~ sqrt((F - F_inf) / (eta^3 sigma^2))`` with the
      gradient noise ``sigma^2`` taken as a constant. On models that can fit their
      training data (most deep networks) the noise falls with the loss late in
      training; if ``sigma^2 ~ F`` the two cancel and the best period stays constant,
      while the constant-noise rule keeps shrinking ``tau`` with ``sqrt(F)`` and ends
      almost synchronous (a 200x fall of the loss gives a 14x smaller period). The
      noise need not fall in proportion (on MNIST-1D it rose early, then fell more
      slowly than the loss), so ``"drift"`` measures it instead:
      the caller passes ``drift``, the replicas' mean squared distance from their
      average per local step (``mean_i ||x_i - xbar||^2 / tau`` at an averaging round,
      averaged over the interval's rounds), and

      .. math::
          \sigma^2_l = \mathrm{drift}_l / \eta_l^2, \qquad
          \tau_l = \Big\lceil \tau_0 \sqrt{(\eta_0/\eta_l)^{p}\,
                   \frac{F_l - F_{inf}}{F_0 - F_{inf}}\,
                   \frac{\sigma^2_1}{\sigma^2_l}} \Big\rceil,

      ``sigma^2_1`` the first interval's estimate (so the first decision is the
      paper's). Cost: the caller's two squared-norm passes over the parameters per
      averaging round (before and after it) and one more float in the interval's
      agreement; :class:`mpicomm.torch.LocalSGD` does both.

    Use
    ---
    Call :meth:`start` once with the initial (averaged) loss and learning rate, then
    :meth:`observe` after every averaging round; it returns the period to use next.
    :meth:`due` tells whether the next :meth:`observe` will be an interval boundary, so
    the caller can skip computing the averaged loss at other rounds.

    Parameters
    ----------
    tau0:
        Initial period (int >= 1) within ``[tau_min, tau_max]``.
    interval_s, interval_rounds:
        The interval length, in seconds of the caller's agreed clock or in averaging
        rounds. Exactly one must be given.
    lr_exponent:
        ``p`` above, >= 0 (default 1).
    tau_min, tau_max:
        Bounds on the period (``tau_max=None``: unbounded).
    f_inf:
        Lower bound of the loss used in the ratio; ``F_0`` must exceed it.
    noise:
        ``"constant"`` (default: the paper's rule) or ``"drift"`` (the measured
        gradient noise scales the rule; :meth:`observe` then needs ``drift``).
    """

    NOISE_MODES = ("constant", "drift")

    def __init__(self, tau0: int, interval_s: Optional[float] = None,
                 interval_rounds: Optional[int] = None, lr_exponent: float = 1.0,
                 tau_min: int = 1, tau_max: Optional[int] = None, f_inf: float = 0.0,
                 noise: str = "constant"):
        self.tau0 = check_int("tau0", tau0, 1)
        if noise not in self.NOISE_MODES:
            raise ValueError(f"noise must be one of {self.NOISE_MODES}, got {noise!r}")
        self.noise = noise
        self.noise_ref: Optional[float] = None  # sigma^2 of the first measured interval
        if (interval_s is None) == (interval_rounds is None):
            raise ValueError("give exactly one of interval_s (seconds) and interval_rounds "
                             f"(averaging rounds); got interval_s={interval_s!r}, "
                             f"interval_rounds={interval_rounds!r}")
        if interval_s is not None:
            interval_s = _check_real("interval_s", interval_s)
            if interval_s <= 0:
                raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if interval_rounds is not None:
            interval_rounds = check_int("interval_rounds", interval_rounds, 1)
        self.interval_s: Optional[float] = interval_s
        self.interval_rounds: Optional[int] = interval_rounds
        self.lr_exponent = _check_real("lr_exponent", lr_exponent)
        if self.lr_exponent < 0:
            raise ValueError(f"lr_exponent must be >= 0, got {self.lr_exponent}")
        self.tau_min = check_int("tau_min", tau_min, 1)
        if tau_max is not None:
            tau_max = check_int("tau_max", tau_max, 1)
            if tau_max < self.tau_min:
                raise ValueError(f"tau_max ({tau_max}) must be >= tau_min ({self.tau_min})")
        self.tau_max: Optional[int] = tau_max
        if tau0 < self.tau_min or (tau_max is not None and tau0 > tau_max):
            raise ValueError(f"tau0 ({tau0}) must lie in [tau_min, tau_max] = "
                             f"[{self.tau_min}, {tau_max}]")
        self.f_inf = _check_real("f_inf", f_inf)
        self.tau: int = tau0
        self.loss0: Optional[float] = None
        self.lr0: Optional[float] = None
        self.rounds: int = 0
        self.history: list[AdaCommDecision] = []
        self._interval_rounds = 0
        self._interval_start: Optional[float] = None

    def __repr__(self) -> str:
        interval = (f"interval_s={self.interval_s}" if self.interval_s is not None
                    else f"interval_rounds={self.interval_rounds}")
        return (f"AdaComm(tau0={self.tau0}, {interval}, lr_exponent={self.lr_exponent}, "
                f"tau_min={self.tau_min}, tau_max={self.tau_max}, f_inf={self.f_inf}, "
                f"noise={self.noise!r}, tau={self.tau})")

    @property
    def started(self) -> bool:
        return self.loss0 is not None

    # ------------------------------------------------------------------ the rule
    def _check_loss_lr(self, loss: object, lr: object) -> tuple[float, float]:
        loss = _check_real("loss", loss)
        lr = _check_real("lr", lr)
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        return loss, lr

    def period_for(self, loss: float, lr: float, noise: Optional[float] = None) -> int:
        """The period the rule gives for ``loss``, ``lr`` and (``noise="drift"``) the
        noise estimate ``noise`` = ``sigma^2`` (no state change)."""
        if self.loss0 is None or self.lr0 is None:
            raise RuntimeError("AdaComm.start() must be called before period_for()")
        loss, lr = self._check_loss_lr(loss, lr)
        return self._rule(loss, lr, noise)[0]

    def _rule(self, loss: float, lr: float,
              noise: Optional[float] = None) -> tuple[int, float]:
        """The paper's rule; with a noise estimate and a reference, the loss ratio is
        scaled by ``noise_ref / noise`` (folded into the loss handed to the formula)."""
        assert self.loss0 is not None and self.lr0 is not None
        if noise is not None and self.noise_ref is not None and noise > 0:
            loss = self.f_inf + (loss - self.f_inf) * self.noise_ref / noise
        return adacomm_period(self.tau0, loss, self.loss0, lr, self.lr0,
                              lr_exponent=self.lr_exponent, f_inf=self.f_inf,
                              tau_min=self.tau_min, tau_max=self.tau_max)

    # ------------------------------------------------------------------ the state
    def start(self, loss: float, lr: float, elapsed: Optional[float] = None) -> int:
        """Record ``F_0`` and ``eta_0`` and open the first interval; returns ``tau0``.

        ``loss`` must exceed ``f_inf``. With ``interval_s``, ``elapsed`` is the agreed
        clock value at this moment (default 0).
        """
        if self.started:
            raise RuntimeError("AdaComm.start() was already called")
        loss, lr = self._check_loss_lr(loss, lr)
        if loss <= self.f_inf:
            raise ValueError(f"the initial loss F0={loss} must be > f_inf={self.f_inf}")
        if elapsed is not None:
            elapsed = _check_real("elapsed", elapsed)
        elif self.interval_s is not None:
            elapsed = 0.0
        self.loss0, self.lr0 = loss, lr
        self.tau = self.tau0
        self._interval_start = elapsed
        self._interval_rounds = 0
        self.history.append(AdaCommDecision(self.rounds, elapsed, loss, lr,
                                            float(self.tau0), self.tau0))
        return self.tau

    def due(self, elapsed: Optional[float] = None) -> bool:
        """Whether the next :meth:`observe` (with this ``elapsed``) ends an interval."""
        if not self.started:
            raise RuntimeError("AdaComm.start() must be called first")
        if self.interval_rounds is not None:
            return self._interval_rounds + 1 >= self.interval_rounds
        if elapsed is None:
            raise ValueError("interval_s needs the agreed elapsed time")
        elapsed = _check_real("elapsed", elapsed)
        assert self._interval_start is not None and self.interval_s is not None
        return elapsed - self._interval_start >= self.interval_s

    def state_dict(self) -> dict[str, Any]:
        """What :meth:`load_state_dict` needs to continue exactly here (plain numbers and
        lists: a checkpoint reads it without unpickling code). The settings (``tau0``,
        the interval, the clamps) are the constructor's, not part of the state."""
        return {"tau": self.tau, "loss0": self.loss0, "lr0": self.lr0, "rounds": self.rounds,
                "interval_rounds_done": self._interval_rounds,
                "interval_start": self._interval_start,
                "history": [dataclasses.asdict(d) for d in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ValueError`` if a field is missing).
        With ``interval_s``, the saved ``interval_start`` is on the saving run's agreed
        clock: pass elapsed times continuing that clock afterwards."""
        missing = {"tau", "loss0", "lr0", "rounds", "interval_rounds_done",
                   "interval_start", "history"} - set(state)
        if missing:
            raise ValueError(f"AdaComm.load_state_dict: missing {sorted(missing)}")
        self.tau = check_int("tau", state["tau"], 1)
        self.loss0 = None if state["loss0"] is None else float(state["loss0"])
        self.lr0 = None if state["lr0"] is None else float(state["lr0"])
        self.rounds = int(state["rounds"])
        self._interval_rounds = int(state["interval_rounds_done"])
        start = state["interval_start"]
        self._interval_start = None if start is None else float(start)
        self.history = [AdaCommDecision(**d) for d in state["history"]]

    @traced("adacomm.observe", cat="control", outcome=lambda tau: {"tau": tau})
    def observe(self, loss: Optional[float] = None, lr: Optional[float] = None,
                elapsed: Optional[float] = None, drift: Optional[float] = None) -> int:
        """Count one averaging round; at an interval boundary, re-decide ``tau``.

        ``loss`` (averaged over ranks) and ``lr`` are needed only at a boundary (see
        :meth:`due`); with ``interval_s``, ``elapsed`` (agreed over ranks) is needed
        every time; with ``noise="drift"``, ``drift`` (agreed over ranks: the replicas'
        mean squared distance from their average per local step, over the interval) at
        a boundary. Returns the period to use from now on.
        """
        boundary = self.due(elapsed)
        self.rounds += 1
        self._interval_rounds += 1
        if not boundary:
            return self.tau
        if loss is None or lr is None:
            raise ValueError("this round ends an interval: pass the averaged loss and lr")
        loss, lr = self._check_loss_lr(loss, lr)
        noise = None
        if self.noise == "drift":
            if drift is None:
                raise ValueError("AdaComm(noise='drift') needs drift at an interval's end")
            drift = _check_real("drift", drift)
            if drift < 0:
                raise ValueError(f"drift must be >= 0, got {drift}")
            noise = drift / lr ** 2 if drift > 0 else None  # 0: replicas never moved
            if noise is not None and self.noise_ref is None:
                self.noise_ref = noise
        self.tau, raw = self._rule(loss, lr, noise)
        agreed = None if elapsed is None else float(elapsed)
        self.history.append(AdaCommDecision(self.rounds, agreed, loss, lr, raw, self.tau,
                                            noise))
        self._interval_rounds = 0
        self._interval_start = agreed
        return self.tau
