r"""The options of ``strategy="auto"``: :class:`AutoConfig`, validated once.

:class:`~mpicomm.strategies.AutoStrategy` takes them as keyword arguments
(``strategies.make("auto", ratio=0.01, lgreco=True)``) or as one
``config=AutoConfig(...)`` (keywords given as well override its fields). An unknown
keyword is one ``TypeError`` naming it (and the closest known option); a bad value one
``ValueError`` (``TypeError`` for a value of the wrong type), both raised at
construction, before any communication.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional

from ..control.cr import DEFAULT_RATIOS
from ..control.lgreco import DEFAULT_FACTORS, FAMILIES
from ..control.pareto import GRID_POINTS, NORMALIZATIONS
from ..validate import check_int
from .auto_schemes import SCHEMES
from .base import DEFAULT_FUSION_BYTES
from .lgreco_buckets import FAMILY_SCHEMES

__all__ = ["AutoConfig", "strategy_signature"]


@dataclass(frozen=True)
class AutoConfig:
    """Every option of :class:`~mpicomm.strategies.AutoStrategy` (frozen; checked once,
    in ``__post_init__``; sequences are stored as tuples).

    Options
    -------
    ratios:
        CR candidates (fractions kept) of the controller (default the paper's {0.1, 0.033,
        0.011, 0.004, 0.001}).
    ratio:
        A fixed CR instead of the controller (1.0 = always dense).
    schemes:
        The schemes the selector may pick (default all of
        :data:`~mpicomm.strategies.auto_schemes.SCHEMES`).
    approximate, min_gain:
        Accuracy constraints of the selector
        (:func:`~mpicomm.strategies.auto_schemes.select`): no gTop-k with
        ``approximate=False``; no scheme whose measured compression gain
        (:attr:`AutoStrategy.scheme_gains`, EWMA over the steps it ran, agreed) is below
        ``min_gain`` — the buckets are re-decided as soon as a running scheme's gain falls
        below it. Not applied to the per-layer QSGD/PowerSGD families.
    weights, choice, window, trigger, warmup_steps, explore, cooldown, restore_first,
    total_steps, probe_first, probe_triggered, grid_points, normalize:
        The CR controller's (:class:`mpicomm.control.CRController`). The ratio is solved
        over the continuous range ``[min(ratios), max(ratios)]``, exactly on
        ``grid_points`` log-spaced ratios (64; 0: the candidates only), objectives the
        step time at the scheme the choice would run at each ratio, as the choice
        prices it (:meth:`AutoStrategy.step_time`: with ``gain_weighted``, seconds of a
        whole step per unit of Top-k progress) and the inverse Top-k gain, picked by
        pymoo's ASF on the Pareto front with ``weights`` (time, gain) after
        ``normalize`` (``"ideal"``: relative to each objective's best value, so the
        pick follows the network;
        ``"nadir"``: the reference code's, blind to it; :mod:`mpicomm.control.pareto`).
        A probe measures the gain at every grid ratio on one step. The first exploration
        starts with the first step, a one-step probe by default (``probe_first``: Top-k's
        gain at every candidate ratio on step 0's error-fed gradients, measured locally
        beside the step's own exchange at the middle ratio; ours, see
        :mod:`mpicomm.control.cr`: on the adaptive bench it saved the 0.3-0.4 s of a 5-step
        window that is thrown away, about 10% of the best static run's time to the target);
        the explorations triggered later are probes too by default (``probe_triggered``, at
        the ratio in force: nothing thrown away), with ``probe_triggered=False`` the paper's
        windows, which save and restore (``restore_first=False`` keeps the first window's
        steps, going up the ratios: see :mod:`mpicomm.control.cr`); with ``total_steps``
        (the training's length, when known) no exploration starts in the last
        ``2·window·len(ratios)`` steps. An exploration step runs the cheapest *sparse*
        scheme at its ratio, never dense or PowerSGD (PowerSGD at ratios 0.1 and 0.033 cost
        up to 0.6 s a step in the window), and the controller is fed Top-k's gain at the
        ratio whatever scheme ran (:mod:`~mpicomm.strategies.auto`). Its choices are not
        kept for later steps.
    switch_margin:
        Hysteresis of a re-decision: the running scheme stays unless another is predicted
        (or measured) cheaper by more than this fraction (noise on a shared host otherwise
        flips schemes, each switch costing a cold start).
    trial_margin, trial_steps:
        Choice by measurement where the model does not separate the schemes: every scheme
        whose cost (its measured time once it has run ``trial_steps`` steps at this bucket
        and ratio, else its prediction) is within ``trial_margin`` of the cheapest is
        *tried* for ``trial_steps`` real training steps (no rollback: every candidate is a
        valid aggregation at the same ratio), and the bucket then runs the scheme with the
        lowest measured time (min over its last ``max(trial_steps, MEASURED_TIMES)`` agreed
        times, :data:`~mpicomm.strategies.auto_choice.MEASURED_TIMES`). A prediction that
        separates the schemes clearly (one candidate within the margin) is used without
        trials. ``trial_steps=0`` chooses by prediction only. Trials run outside CR
        exploration windows; a (debounced) network drift forgets the measurements and tries
        again. Default 1: on the adaptive bench every trial step of an approximate scheme
        (AR-Top-k, gTop-k, PowerSGD at efficiency 0.3-0.7) costs progress, and 2 put about 9
        of the first 12 steps on trials. Ours, not the papers'.
    gain_weighted:
        ``False`` (default): compare schemes by the step's time alone (the "cheapest that
        meets ``min_gain``" rule, per step). ``True``: compare schemes (in the choice by
        measurement and :meth:`~mpicomm.strategies.auto_choice.SchemeChoices.outrun`) by
        the step's seconds per unit of Top-k progress, ``(t + share) / efficiency``
        (:meth:`~mpicomm.strategies.auto_choice.SchemeChoices.costs`): ``t`` the bucket's
        exchange, ``share`` its part of :attr:`AutoStrategy.step_other` (the forward,
        backward and optimizer time every step pays), ``efficiency`` the scheme's mass kept
        relative to exact Top-k's at that ratio (:attr:`AutoStrategy.efficiency`, squared
        like the paper's gain; dense and an unmeasured scheme 1). The idea: the number of
        steps to an accuracy grows as a scheme applies less of the error-fed gradient per
        step. Measured on the adaptive bench (digits, 4 ranks, ratio 0.011): AR-Top-k's
        exchange took about half Allgather Top-k's (20 against 38 ms) at efficiency 0.5-0.7,
        and its static run needed 1.4-2x the steps to 0.96; gTop-k's efficiency was 0.6-0.8.
        Without the share the faster exchange looked cheaper per unit of progress (20/0.6 <
        38), with it (50/0.6 > 68) it does not. Efficiencies are measured only while a
        scheme runs (in trials and while kept), so an approximate scheme chosen early
        (efficiency 0.8 in the first steps, when the ranks' gradients agree) gives way
        within a few steps as its efficiency falls
        (:data:`~mpicomm.strategies.auto_choice.EFFICIENCY_DECAY`). Ours. Why time alone
        is the default: on MNIST-1D's CNN at 8 ranks (virtual clock, a network that drops
        from 10 Gbit/s to 100 Mbit/s and rises to 1 Gbit/s, momentum correction on), the
        mass-kept proxy rated gTop-k at 0.029-0.1 below Allgather Top-k and kept the
        latter at about 100 ms a step on the slow link, 86.7 s to 97.5% test accuracy;
        time alone ran gTop-k at about 50 ms a step and got there in 28.6 s, while the
        fixed gTop-k at 0.1 reached 97.5% at the same step as Allgather Top-k at 0.01.
        The proxy measures how much of Top-k's mass a step keeps, not how many steps an
        accuracy takes.
    momentum_correction:
        Where DGC's momentum correction and masking (Lin et al., arXiv 1712.01887;
        :class:`~mpicomm.compress.ErrorFeedback` with ``momentum=m``) take the place of
        the optimizer's momentum. With it, every rank keeps a velocity ``u = m·u + g`` per
        bucket in the error-feedback memory; a sparse scheme sends entries of
        ``u + residual`` and clears the velocity where it sent; a dense step (and
        PowerSGD) sends all of it and keeps the velocity (then ``mean_r u_r`` is the
        optimizer's heavy-ball buffer: the same run as momentum SGD). It needs an
        SGD-like optimizer passed to ``step_done`` (one momentum m, no dampening, no
        Nesterov: :func:`~mpicomm.strategies._compressed.adopt_momentum`); with another,
        the memory stays plain error feedback.

        ``"after_dense"`` (default): plain error feedback with the optimizer's momentum
        until 20 steps in a row ran dense; then the optimizer's momentum buffers become
        the memory's velocities (nothing changes on dense steps) and every later sparse
        step is corrected. ``True``: from the first step. ``False``: never. The
        correction pays after a dense start: plain error feedback lost up to 26 points
        of test accuracy for 100-200 steps after a switch from dense to a small ratio
        (mnist1d-cnn, 8 ranks, gTop-k at 0.01 from a dense model at 0.96; with the
        correction, no dip), and on a network that starts fast and then drops the
        corrected run reached 0.975 in 28.6 s against 33.8 s. It hurts from a cold sparse
        start: on a constant 1 Gbit/s network the run corrected from the first step was
        at 0.67 test accuracy after 400 steps against 0.80 and never reached 0.975 in
        2 028 steps, where the plain one did at step 1 200. ``"after_dense"`` corrects
        only after a dense phase, and from a sparse start is the same run as ``False``.
        Not with ``lgreco`` (its paths keep plain error feedback). Cost: one copy of the
        gradients' size at the hand-over.
    ramp_steps, ramp_factor, ramp_start:
        The ratio ramp (:mod:`~mpicomm.strategies.auto_ramp`): when the ratio a bucket's
        kept choice runs at falls by more than ``ramp_factor`` at once (from dense,
        ratio 1, to a sparse scheme; or a re-solve to a much smaller ratio), it is
        brought down geometrically over ``ramp_steps`` steps, starting from the ratio
        it ran at, at most ``ramp_start``. Trial steps and exploration windows run at
        their own ratio; a ramp step's time and gain are not counted for its target
        ratio. Off by default (``ramp_steps=0``), measured on mnist1d-cnn (8 ranks, from
        a dense model at 0.96 test accuracy, replayed in one process): with plain error
        feedback a 100-step ramp from 1 only delays the dip (gTop-k at 0.01: 0.70 at
        once, 0.73 50 steps later with the ramp; Allgather Top-k at 0.023: 0.845
        either way, 75 steps later); with ``momentum_correction`` gTop-k at 0.01 still
        fell to 0.89 (175 steps after the switch) and the ramp kept it at 0.96-0.97,
        but auto itself, momentum-corrected, switched to Allgather Top-k at 0.036 with
        no dip at all (0.958, 0.964, 0.970 at steps 700, 750, 800), so a ramp there
        would only have cost its large first ratios on the slow link that caused the
        switch (from 1 to 0.01 over 100 steps: 21.5 full gradients' worth of pairs,
        about +5 s for gTop-k at 100 Mbit/s). Ours (DGC's warm-up of the sparsity at
        the start of training, applied to every large fall).
    drift_patience:
        Debounce of re-decisions: a drift of alpha/beta
        (:class:`mpicomm.control.OnlineCalibration`'s ``patience``) or of a compute factor
        must persist for this many agreed steps in a row before the buckets are re-decided
        (a single slow step on a shared host does not re-decide). Default 5: on the emulated
        cluster (4 ranks on 2 cores) 3 re-decided 4 times in the first 35 steps with nothing
        changed (the fit settling from the short calibration, and load noise), each
        re-running the trials; with 5, once or never in two runs, and the bench's network
        change at step 66 (2x the time per byte, 5x the latency) was flagged at step 70.
        ``drift=0.5`` missed that change altogether: it moves a whole compressed step's time
        by only about 40%.
    calibrate_links:
        Ping-pong links of the start-up calibration; ``0`` keeps the communicator's
        calibration (or the defaults) without measuring. It is short on purpose: per link,
        ping-pongs of 8 B and 4 KiB (3 repeats after 2 warm-ups: alpha) and one 512 KiB
        transfer answered by 8 B (beta), about ``22·alpha + 512 KiB·beta`` per round of
        links (pairs on different nodes run at the same time,
        :func:`~mpicomm.collectives.calibrate.link_rounds`; the default 2 links are one
        round where there are 4 or more nodes: 0.09 s on the emulated cluster's 4 hosts at
        100 Mbit/s and 1 ms, compute kernels included, against 0.2 s for 3 links one after
        another and 0.76 s for ping-pongs up to 256 KiB, which saw only half the rate behind
        its 128 KiB ``tbf`` burst). The online refinement corrects what it misses from the
        first real collectives; beta must be right to within a few times from the start, or
        a dense step looks cheap (measured: 32 KiB ping-pongs alone gave beta 100x too
        small, and a 1.1 s dense step).
    drift, decay:
        :class:`mpicomm.control.OnlineCalibration`'s drift fraction and EWMA decay.
    lgreco, lgreco_every, lgreco_acc_steps, lgreco_factors:
        Per-layer settings (:class:`mpicomm.control.LGreco`), re-solved every so many steps
        from candidates around the uniform default (top-k and PowerSGD: ``factors ×
        default``, ``(1.0,)`` = per-layer uniform, the baseline at the same total error;
        QSGD: ``default + {-2..2}`` bits).
    lgreco_family, lgreco_default:
        What L-GreCo sets per layer: ``"topk"`` densities (default: ``ratio``, else the
        largest of ``ratios``), ``"qsgd"`` bits (default 4) or ``"powersgd"`` ranks (default
        4). With ``"qsgd"``/``"powersgd"`` the selector chooses between dense and the
        per-layer scheme (``"lgreco_qsgd"``/``"lgreco_powersgd"``,
        :mod:`~mpicomm.strategies.lgreco_buckets`; ``schemes=("lgreco_qsgd",)`` forces it),
        and ``ratio``/``ratios`` and the CR controller are not used (the bits/ranks are the
        compression).
    history:
        How many :class:`~mpicomm.strategies.auto_schemes.Record` entries
        :attr:`AutoStrategy.records` keeps.
    fusion_bytes:
        The fusion limit of the buckets (:class:`~mpicomm.strategies.Strategy`).
    """

    # the selector
    ratios: Sequence[float] = DEFAULT_RATIOS
    ratio: Optional[float] = None
    schemes: Sequence[str] = SCHEMES
    approximate: bool = True
    min_gain: float = 0.0
    # choice by measurement
    switch_margin: float = 0.1
    trial_margin: float = 0.5
    trial_steps: int = 1
    gain_weighted: bool = False
    drift_patience: int = 5
    momentum_correction: bool | str = "after_dense"
    ramp_steps: int = 0
    ramp_factor: float = 4.0
    ramp_start: float = 1.0
    # the CR controller
    weights: tuple[float, float] = (0.6, 0.4)
    choice: str = "asf"
    window: int = 10
    trigger: float = 0.1
    warmup_steps: int = 0
    explore: bool = True
    cooldown: int = 50
    restore_first: bool = True
    total_steps: Optional[int] = None
    probe_first: bool = True
    probe_triggered: bool = True
    grid_points: int = GRID_POINTS
    normalize: str = "ideal"
    # calibration
    calibrate_links: int = 2
    drift: float = 0.3
    decay: float = 0.9
    # L-GreCo
    lgreco: bool = False
    lgreco_every: int = 50
    lgreco_acc_steps: int = 5
    lgreco_factors: Sequence[float] = DEFAULT_FACTORS
    lgreco_family: str = "topk"
    lgreco_default: Optional[float] = None
    # bookkeeping
    history: int = 10_000
    fusion_bytes: int = DEFAULT_FUSION_BYTES

    @classmethod
    def from_options(cls, base: Optional[AutoConfig] = None, **options: Any) -> AutoConfig:
        """``base`` (default: the defaults) with ``options`` replacing its fields;
        ``TypeError`` naming every unknown option."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [name for name in options if name not in known]
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"unknown option(s) of strategy 'auto': {', '.join(hints)}; "
                            f"known: {', '.join(known)}")
        return dataclasses.replace(base, **options) if base is not None else cls(**options)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        check_int("trial_steps", self.trial_steps, 0)
        check_int("drift_patience", self.drift_patience, 1)
        check_int("ramp_steps", self.ramp_steps, 0)
        if not (isinstance(self.momentum_correction, bool)
                or self.momentum_correction == "after_dense"):
            raise ValueError("momentum_correction must be True, False or 'after_dense', "
                             f"got {self.momentum_correction!r}")
        if _number("ramp_factor", self.ramp_factor) <= 1.0:
            raise ValueError(f"ramp_factor must be > 1, got {self.ramp_factor!r}")
        if not 0.0 < _number("ramp_start", self.ramp_start) <= 1.0:
            raise ValueError(f"ramp_start must be in (0, 1], got {self.ramp_start!r}")
        _number("trial_margin", self.trial_margin, low=0.0)
        if self.lgreco_family not in FAMILIES:
            raise ValueError(f"lgreco_family must be one of {FAMILIES}, "
                             f"got {self.lgreco_family!r}")
        if isinstance(self.schemes, str):
            raise TypeError(f"schemes must be a sequence of scheme names, "
                            f"got {self.schemes!r}")
        put("schemes", tuple(self.schemes))
        own = self.own_scheme
        allowed = SCHEMES + ((own,) if own else ())
        if not self.schemes or any(s not in allowed for s in self.schemes):
            raise ValueError(f"schemes must be a non-empty subset of {allowed}, "
                             f"got {self.schemes}")
        if self.ratio is not None and not (isinstance(self.ratio, Real)
                                           and not isinstance(self.ratio, bool)
                                           and 0 < self.ratio <= 1):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio!r}")
        check_int("calibrate_links", self.calibrate_links, 0)
        put("ratios", tuple(self.ratios))
        if not self.ratios or any(not (isinstance(c, Real) and 0 < c <= 1)
                                  for c in self.ratios):
            raise ValueError(f"ratios must be in (0, 1], got {self.ratios}")
        _number("min_gain", self.min_gain)
        _number("switch_margin", self.switch_margin, low=0.0)
        put("weights", tuple(self.weights))
        if len(self.weights) != 2 or any(not (isinstance(w, Real) and w > 0)
                                         for w in self.weights):
            raise ValueError(f"weights must be two positive numbers, got {self.weights!r}")
        if self.choice not in ("asf", "knee"):
            raise ValueError(f"choice must be 'asf' or 'knee', got {self.choice!r}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, "
                             f"got {self.normalize!r}")
        check_int("grid_points", self.grid_points, 0)
        if self.grid_points == 1:
            raise ValueError("grid_points must be 0 (the candidates only) or >= 2")
        check_int("window", self.window, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("cooldown", self.cooldown, 0)
        if self.total_steps is not None:
            check_int("total_steps", self.total_steps, 1)
        if not (isinstance(self.trigger, Real) and 0 < self.trigger <= 1):
            raise ValueError(f"trigger must be in (0, 1], got {self.trigger!r}")
        if not (isinstance(self.decay, Real) and 0.0 < self.decay < 1.0):
            raise ValueError(f"decay must be in (0, 1), got {self.decay!r}")
        if not (isinstance(self.drift, Real) and self.drift > 0.0):
            raise ValueError(f"drift must be > 0, got {self.drift!r}")
        check_int("lgreco_every", self.lgreco_every, 1)
        check_int("lgreco_acc_steps", self.lgreco_acc_steps, 1,
                  self.lgreco_every if self.lgreco else None)
        put("lgreco_factors", tuple(self.lgreco_factors))
        if not self.lgreco_factors or any(not (isinstance(f, Real) and f > 0)
                                          for f in self.lgreco_factors):
            raise ValueError(f"lgreco_factors must be positive, got {self.lgreco_factors}")
        check_int("history", self.history, 0)
        check_int("fusion_bytes", self.fusion_bytes, 1)

    @property
    def own_scheme(self) -> Optional[str]:
        """The per-layer scheme of an L-GreCo QSGD/PowerSGD family
        (``"lgreco_qsgd"``/``"lgreco_powersgd"``), else ``None``."""
        if self.lgreco and self.lgreco_family != "topk":
            return FAMILY_SCHEMES[self.lgreco_family]
        return None

    @property
    def family(self) -> Optional[str]:
        """``"qsgd"``/``"powersgd"`` when L-GreCo runs that family, else ``None``."""
        return self.lgreco_family if self.own_scheme else None

    def selectable(self) -> tuple[str, ...]:
        """The schemes the selector chooses among: the L-GreCo QSGD/PowerSGD families
        choose between dense and their per-layer scheme (``schemes=(own,)`` forces the
        per-layer scheme), L-GreCo top-k among the schemes that send per-layer top-k
        (no gTop-k, no PowerSGD, no hierarchical scheme), otherwise ``schemes``."""
        own = self.own_scheme
        if own:
            return (own,) if own in self.schemes and "dense" not in self.schemes \
                else ("dense", own)
        if self.lgreco:
            return tuple(s for s in self.schemes if s not in ("gtopk", "powersgd")
                         and not s.startswith("hier_")) or \
                ("dense",)
        return tuple(self.schemes)

    def lgreco_uniform(self) -> float:
        """L-GreCo's uniform default: ``lgreco_default``, else 4 bits/ranks for the
        QSGD/PowerSGD families and ``ratio`` (else the largest of ``ratios``) for
        top-k."""
        if self.lgreco_default is not None:
            return self.lgreco_default
        if self.family:
            return 4
        return min(self.ratio if self.ratio is not None else max(self.ratios), 1.0)

    def cr_options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`mpicomm.control.CRController`."""
        return {"weights": self.weights, "choice": self.choice, "window": self.window,
                "trigger": self.trigger, "warmup_steps": self.warmup_steps,
                "explore": self.explore, "cooldown": self.cooldown,
                "restore_first": self.restore_first, "total_steps": self.total_steps,
                "probe_first": self.probe_first, "probe_triggered": self.probe_triggered,
                "grid_points": self.grid_points, "normalize": self.normalize}


def _number(name: str, value: Any, low: Optional[float] = None) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be a number >= {low:g}, got {value!r}")
    return float(value)


def strategy_signature() -> inspect.Signature:
    """``(self, comm=None, *, config=None, <every AutoConfig field with its default>)``:
    the auto strategy's constructor as ``help()`` shows it and as wrappers that list a
    strategy's options read it."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("comm", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                default=None),
              inspect.Parameter("config", keyword, default=None)]
    params += [inspect.Parameter(f.name, keyword, default=f.default)
               for f in dataclasses.fields(AutoConfig)]
    return inspect.Signature(params)
