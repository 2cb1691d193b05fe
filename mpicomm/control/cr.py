r"""Multi-objective choice of the compression ratio (pure: decisions, no MPI).

Tyagi & Swany, "Flexible Communication for Optimal Distributed Learning over
Unpredictable Networks", IEEE BigData 2023, section 3.E, and their reference code's
multi-objective compression step. CR ``c`` = fraction of entries kept. Two objectives per candidate
``c``: the predicted synchronization time ``t_sync(c)`` (the paper: the selector's
cheapest scheme for ``c``, from the calibrated model) and ``1/gain(c)``, where the compression gain
``gain = ||g_c|| / ||g_e||`` (compressed over error-fed gradient, the code's unsquared
form) is measured during *exploration*:

1. **Warm-up** (optional, code only): ``c`` goes linearly from 1 (dense) to the largest
   candidate over ``warmup_steps``.
2. **Exploration**: the caller saves the model (and optimizer, and error-feedback) state
   (action ``"save"``), every candidate runs ``window`` steps (largest first) while the
   mean gain is logged, then the caller restores the state (action ``"restore"``) and the
   MOO solve picks ``c``. ``restore_first=False`` (ours, not the default) keeps the
   steps of the *first* window instead (no save, no restore), going *up* the ratios so
   that its last step (the largest ratio) sends much of what the small ones left in the
   residual. Measured on the adaptive bench it is not better: with windows that still
   ran PowerSGD, 101 steps to 0.96 against 44 with the restore (one seed); with
   sparse-only windows, going up, 31-35 steps against 41-43 but in about the same time
   (3.8-3.9 s against 3.8-4.4 s; three and two seeds): the kept window's gains led to
   ratio 0.033, dearer steps. So the paper's restore stays the default.
   ``probe_first=True`` (ours, not the default here; :class:`mpicomm.strategies.AutoStrategy`'s
   default) replaces the *first* exploration (at the start, or at the end of the
   warm-up) by a *probe*: one step at the middle candidate (0.011 of the defaults: the
   cost of an ordinary step; at 0.1 a step took 2-4x as long on the adaptive bench)
   during which the caller measures Top-k's gain at *every* candidate on that step's own
   error-fed gradients (a local top-k per ratio, no extra step, nothing to restore; the
   gains do not depend on the step's own ratio), passed to :meth:`CRController.observe`
   as ``probe=``; the solve follows at once.
   With ``window=1`` a window measures each ratio on one step anyway (each on the
   gradients of a different step); the probe measures them all on the same one, and the
   window's restored steps (5 at the default candidates: 0.3-0.4 s on the adaptive
   bench, where the best static run reaches its target in about 35 steps) are saved.
   It does not see how error feedback builds up at each ratio over ``window`` steps.
   Explorations triggered later (below) are windows with save and restore, as the
   paper's, unless ``probe_triggered=True`` (ours, not the default here; the adaptive
   strategy's default): then each is a probe as well, on one ordinary step at the ratio
   in force. A window's steps are thrown away by its restore: on the adaptive bench a
   window after the network change cost 6 of 132 steps (5, and one of the strategy's
   lag), their time (one at ratio 0.1, 2-4x an ordinary step) and the
   accuracy those steps would have added at the end.
3. **Triggers**: the smoothed gain (EWMA, ``gain_smoothing``) moving by ``trigger``
   (10%) relative to its value at the end of a ``cooldown`` (steps after the last solve
   during which no exploration starts) starts a new exploration (the
   code smooths the step-to-step relative change instead; that reacts to noise, not to
   a sustained change, at the few hundred steps of a small job); a network change (drift of the
   calibration, :meth:`CRController.network_changed`) re-solves with the known gains.
4. **Solve** over the continuous range ``[min(ratios), max(ratios)]``: both objectives
   are evaluated exactly at ``grid_points`` (64) log-spaced ratios
   (:func:`~mpicomm.control.pareto.ratio_grid`), the Pareto front of those points is
   taken and one is picked by pymoo's ASF with the code's weights ``(0.6 time, 0.4
   gain)`` (:func:`~mpicomm.control.pareto.asf_choice`), or the knee
   (``choice="knee"``). A probe measures the gain at every grid ratio (one sort); a
   window measures it at the candidates and the grid is interpolated in ``log c``
   (:func:`~mpicomm.control.pareto.interpolate_gains`). The code fits both curves and
   runs NSGA-II over the interval instead; the grid is exact where the fit is not, and
   deterministic. ``normalize="ideal"`` (default) normalizes each objective by its best
   value on the front, ``"nadir"`` by ideal and nadir as the code does, which makes the
   pick blind to the network (:mod:`mpicomm.control.pareto`). The time objective is
   whatever ``sync_time(c)`` returns: :class:`mpicomm.strategies.AutoStrategy` passes
   the time of a whole step (the paper's Eq. 6 counts the computation as well) at the
   scheme its own choice rule would run at ``c``, priced as that rule prices it
   (:meth:`~mpicomm.strategies.AutoStrategy.step_time`): the ratio is traded against
   the time of the scheme that then runs, not of the fastest exchange.
   ``grid_points=0`` solves over the candidates only.

Every input (gains, times) must already be identical on every rank (allreduced); then
every rank takes the same decisions. Tuning: ``window`` 10 in the paper (shorter on a
small problem: exploration steps are thrown away); ``trigger`` 0.1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from ..validate import check_int
from .pareto import (
    GRID_POINTS,
    NORMALIZATIONS,
    asf_choice,
    interpolate_gains,
    knee_choice,
    pareto_front,
    ratio_grid,
)

__all__ = ["CRController", "pareto_front", "asf_choice", "knee_choice", "DEFAULT_RATIOS",
           "CRDecision"]

#: The paper's candidates: 0.1 down to 0.001 by about 3x.
DEFAULT_RATIOS: tuple[float, ...] = (0.1, 0.033, 0.011, 0.004, 0.001)


@dataclass(frozen=True)
class CRDecision:
    """One entry of :attr:`CRController.history`."""

    step: int
    reason: str           # "warmup", "probe", "solve", "network", "compute"
    ratio: float
    points: tuple[tuple[float, float, float], ...] = ()   # the front: (c, time, 1/gain)


class CRController:
    """State machine of the adaptive CR (see the module docstring).

    Call :meth:`observe` once per step with the agreed gain of that step; it returns
    ``None``, ``"save"`` (snapshot the training state now, before the next step) or
    ``"restore"`` (restore the snapshot now). :attr:`ratio` is the CR for the next step.
    ``sync_time(c)`` gives the predicted seconds at ``c`` that the time objective
    minimizes (a step's synchronization, or the whole step). ``grid_points``: points of
    the continuous range the solve evaluates (:attr:`grid`; 0: the candidates only);
    ``normalize``: ``"ideal"`` or ``"nadir"`` (:mod:`mpicomm.control.pareto`).
    ``restore_first``: whether the first exploration also saves and restores (the
    paper's loop, the default; ``False`` keeps its steps, see the module docstring).
    ``total_steps``: the training's length when known; no triggered exploration starts
    in its last ``2·window·len(ratios)`` steps (ours: the paper trains for thousands of
    steps and does not say). ``probe_first``: the first exploration is a one-step probe
    (module docstring): :attr:`probing` says when, and the next :meth:`observe` needs
    ``probe=``. ``probe_triggered``: the explorations triggered later are probes too,
    each on one ordinary step at the ratio in force (module docstring).
    """

    def __init__(self, sync_time: Callable[[float], float],
                 ratios: Sequence[float] = DEFAULT_RATIOS, *, weights: tuple[float, float]
                 = (0.6, 0.4), choice: str = "asf", window: int = 10, trigger: float = 0.1,
                 gain_smoothing: float = 0.2,
                 warmup_steps: int = 0, explore: bool = True, cooldown: int = 50,
                 restore_first: bool = True, total_steps: Optional[int] = None,
                 probe_first: bool = False, probe_triggered: bool = False,
                 grid_points: int = GRID_POINTS, normalize: str = "ideal"):
        ratios = sorted({float(c) for c in ratios}, reverse=True)
        if not ratios or any(not 0 < c <= 1 for c in ratios):
            raise ValueError(f"ratios must be in (0, 1], got {ratios}")
        if choice not in ("asf", "knee"):
            raise ValueError(f"choice must be 'asf' or 'knee', got {choice!r}")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
        grid_points = check_int("grid_points", grid_points, 0)
        if grid_points == 1:
            raise ValueError("grid_points must be 0 (the candidates only) or >= 2")
        if len(weights) != 2 or any(w <= 0 for w in weights):
            raise ValueError(f"weights must be two positive numbers, got {weights!r}")
        self.total_steps = None if total_steps is None else \
            check_int("total_steps", total_steps, 1)
        window = check_int("window", window, 1)
        warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        cooldown = check_int("cooldown", cooldown, 0)
        for name, v in (("trigger", trigger), ("gain_smoothing", gain_smoothing)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        self.sync_time = sync_time
        self.ratios = tuple(ratios)
        #: The ratios the solve evaluates (descending): the continuous range on a grid.
        self.grid: tuple[float, ...] = ratio_grid(ratios[-1], ratios[0], grid_points) \
            if grid_points else self.ratios
        self.normalize = normalize
        self.weights = (float(weights[0]), float(weights[1]))
        self.choice, self.window, self.trigger = choice, window, float(trigger)
        self.gain_smoothing = gain_smoothing
        self.cooldown = cooldown
        self._gain_ref = 0.0
        self._solved_at = 0
        self.warmup_steps, self.explore = warmup_steps, explore
        self.step = 0
        self.gains: dict[float, float] = {}
        self.gain: Optional[float] = None          # EWMA of the gain in exploitation
        self.change: float = 0.0                   # its relative change since the solve
        self._exploring: Optional[int] = None      # steps into the current exploration
        self._explore_sums: dict[float, list[float]] = {}
        self.history: list[CRDecision] = []
        self.ratio = 1.0 if warmup_steps else self.ratios[0]
        self._pending_explore = explore and not warmup_steps
        self.restore_first = bool(restore_first)
        self._windows = 0                          # explorations begun so far
        self._rollback = True                      # whether the current one restores
        self._order = self.ratios                  # the current one's ratios, in order
        self.probe_first = bool(probe_first)
        self.probe_triggered = bool(probe_triggered)
        self._probing = False                      # a probe step is running

    @property
    def exploring(self) -> bool:
        """An exploration is under way: a window, or the first step's probe."""
        return self._exploring is not None or self._probing

    @property
    def probe_ratios(self) -> tuple[float, ...]:
        """The ratios a probe measures the gain at: every point of :attr:`grid`."""
        return self.grid

    @property
    def probing(self) -> bool:
        """The step now running is the probe: pass every candidate's gain on it to the
        next :meth:`observe` (``probe_first``)."""
        return self._probing

    def start(self) -> Optional[str]:
        """Call once before the first step: ``"save"`` if exploration starts at once."""
        if self._pending_explore:
            self._pending_explore = False
            return self._begin()
        return None

    def observe(self, gain: float, probe: Optional[dict[float, float]] = None,
                ratio: Optional[float] = None) -> Optional[str]:
        """The agreed gain of a finished step; returns the caller's action.

        ``probe``: after a probe step (:attr:`probing`), Top-k's gain at every candidate
        ratio on that step's gradients (required then, refused otherwise).
        ``ratio``: the ratio that step ran at, for a caller whose gains arrive later
        than the next step starts (default: :attr:`ratio`, the synchronous loop). Then
        a window's ratio moves on once ``window`` steps *at that ratio* were observed
        (a step that ran at one of the window's earlier ratios adds to that ratio's
        mean; one from before the window is ignored), and a step that ran at another
        ratio than the one in force (the steps in flight after a solve) does not move
        the smoothed gain."""
        if not math.isfinite(gain):
            raise ValueError(f"gain must be finite, got {gain}")
        if (probe is not None) != self._probing:
            raise ValueError("observe: probe= is required after a probe step and only "
                             "then" if self._probing else
                             "observe: probe= given but no probe step ran")
        self.step += 1
        if probe is not None:
            missing = [c for c in self.grid if c not in probe]
            if missing or not all(math.isfinite(g) and g >= 0 for g in probe.values()):
                raise ValueError(f"probe must give a finite gain >= 0 for every ratio "
                                 f"of the grid {self.grid}, got {probe!r}")
            self._probing = False
            self.gains = {c: float(probe[c]) for c in self.grid}
            self._solved_at = self.step
            self.gain, self.change = None, 0.0
            self._solve("probe")
            return None
        ran = self.ratio if ratio is None else float(ratio)
        if self._exploring is not None:
            position = self._exploring // self.window
            if ran != self._order[position]:  # a step from before this ratio (late gains)
                if ran in self._order[:position]:
                    self._explore_sums[ran].append(gain)
                return None
            self._explore_sums.setdefault(ran, []).append(gain)
            self._exploring += 1
            position = self._exploring // self.window
            if position < len(self._order):
                self.ratio = self._order[position]
                return None
            self.gains = {c: sum(v) / len(v) for c, v in self._explore_sums.items()}
            self._exploring = None
            self._solved_at = self.step
            self.gain, self.change = None, 0.0
            self._solve("solve")
            return "restore" if self._rollback else None
        if self.step <= self.warmup_steps:
            top = self.ratios[0]
            self.ratio = 1.0 - (1.0 - top) * self.step / self.warmup_steps
            if self.step == self.warmup_steps:
                self.ratio = top
                self.history.append(CRDecision(self.step, "warmup", top))
                if self.explore:
                    return self._begin()
            return None
        if ran != self.ratio:  # late gains of a step at the ratio before the last solve
            return None
        if self.gain is None:  # the reference too, for a cooldown shorter than 2 steps
            self.gain = self._gain_ref = gain
            return None
        self.gain = (1 - self.gain_smoothing) * self.gain + self.gain_smoothing * gain
        if self.step - self._solved_at <= self.cooldown:
            self._gain_ref = self.gain  # the level the trigger compares against
            return None
        ref = self._gain_ref
        self.change = abs(self.gain - ref) / ref if ref > 0 else 0.0
        if self.explore and self.change >= self.trigger and not self._too_late():
            return self._begin()
        return None

    def _too_late(self) -> bool:
        """A triggered window starts only while at least twice its length remains of
        ``total_steps``: its own steps (thrown away by the restore) and as many to use
        what it found. One that starts later, or that training stops inside, leaves the
        model at a small ratio's state for the last steps (measured: a window that
        ended at step 129 of 132 chose 0.001, and the last evaluation read 0.947
        against the other runs' 0.964-0.967)."""
        if self.total_steps is None:
            return False
        return self.step + 2 * self.window * len(self.ratios) > self.total_steps

    def network_changed(self) -> None:
        """The network moved (calibration drift): re-solve with the known gains."""
        self.resolve("network")

    def resolve(self, reason: str) -> None:
        """Solve again with the known gains, because the time objective moved
        (``reason`` names why in :attr:`history`: ``"network"``, ``"compute"``); nothing
        while exploring, warming up or before any gain is known."""
        if self.gains and not self.exploring and self.step >= self.warmup_steps:
            self._solve(reason)

    def _begin(self) -> Optional[str]:
        first = self._windows == 0
        if self.probe_first if first else self.probe_triggered:  # a probe, in place
            self._windows += 1
            self._probing = True
            if first:  # the middle candidate; a triggered probe keeps the ratio in force
                self.ratio = self.ratios[len(self.ratios) // 2]
            return None
        self._exploring = 0
        self._explore_sums = {}
        self._rollback = self._windows > 0 or self.restore_first
        # a kept window goes up: its last step (the largest ratio) sends much of what the
        # small ratios left in the residual, instead of leaving it for later steps
        self._order = self.ratios if self._rollback else self.ratios[::-1]
        self.ratio = self._order[0]
        self._windows += 1
        return "save" if self._rollback else None

    def gains_on_grid(self) -> dict[float, float]:
        """The known gains at every :attr:`grid` ratio (measured there by a probe, else
        interpolated from a window's candidates)."""
        if all(c in self.gains for c in self.grid):
            return {c: self.gains[c] for c in self.grid}
        return interpolate_gains(self.gains, self.grid)

    def _solve(self, reason: str) -> None:
        gains = self.gains_on_grid()
        cands = [c for c in self.grid if gains.get(c, 0.0) > 0]
        if not cands:
            self.ratio = self.ratios[0]
            self.history.append(CRDecision(self.step, reason, self.ratio))
            return
        points = [(self.sync_time(c), 1.0 / gains[c]) for c in cands]
        pick = (asf_choice(points, self.weights, self.normalize) if self.choice == "asf"
                else knee_choice(points, self.normalize))
        self.ratio = cands[pick]
        front = pareto_front(points)
        self.history.append(CRDecision(self.step, reason, self.ratio,
                                       tuple((cands[i], *points[i]) for i in sorted(front))))
