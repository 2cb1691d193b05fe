r"""Density warm-up schedules for compressing strategies (pure: no MPI).

Top-k with error feedback loses accuracy when it is sparse from the first step: the
early gradients change fast, and with few steps per epoch (many ranks, small data) the
residuals never catch up. The reference implementations therefore *warm up*: they send
more at first and reach the target density after a few epochs. A :class:`Schedule` maps
the step counter ``t`` (0, 1, 2, ... the number of times a buffer was aggregated before)
and the strategy's own (final) density ``ρ`` to the density of that step::

    stepwise  values v_0 .. v_{n-1}, stage length L steps:
              d(t) = max(v_{⌊t/L⌋}, ρ)  for t < n·L,   ρ afterwards
    linear    start s, length L steps:
              d(t) = max(s + (ρ - s)·t/L, ρ)  for t < L,  ρ afterwards
    exp       start s, length L steps (a geometric ramp of the density):
              d(t) = max(s·(ρ/s)^(t/L), ρ)    for t < L,  ρ afterwards

A warm-up is never sparser than the final density (the ``max``): a gTop-k warm-up of
0.004 under a final density of 0.01 runs at 0.01 throughout.

Lengths are in steps or in epochs (``unit="epoch"`` needs ``steps_per_epoch``, e.g. the
number of minibatches each rank takes per epoch). The value depends on ``t`` only, and
every rank aggregates the same buffers in the same order (the
:class:`~mpicomm.torch.GradientSync` contract), so every rank computes the same density
at every step without communicating; the sparse collectives check that the ranks agree on
``k`` and raise, not hang, when they do not.

The references' schedules (gTop-k: Shi et al., ICDCS 2019, arXiv 1901.04359; Tyagi &
Swany, IEEE BigData 2023; Deep Gradient Compression: Lin et al., ICLR 2018,
arXiv 1712.01887):

* :func:`gtopk_warmup`: density 0.004 during epoch 0, then the final density
  (the gTop-k code's ``[0.004, ρ]``, with ρ = 0.001 in the paper);
* :func:`dgc_warmup`: 0.25 → 0.0625 → 0.015625 → 0.004 → final, one stage per epoch
  (Deep Gradient Compression's exponential warm-up; present but disabled in gTop-k's code);
* :func:`linear_warmup`: linear anneal from dense (1.0) to the final density over
  ``length`` epochs (the AR-Top-k code: 1.0 → 0.1 over 5 epochs before its MOO starts);
* :func:`exp_warmup`: the density falls geometrically from ``start`` to the final
  density over ``length`` units (DGC's stages made continuous). Summed over the ramp it
  sends ``(s - ρ)·L / ln(s/ρ)`` density-steps, about ``s·L / ln(s/ρ)``: a third of
  the linear anneal's ``(s + ρ)·L/2`` for s/ρ = 30.
* :class:`BudgetRamp`: the same geometric ramp with its length set by the traffic it
  may send (``budget`` density-steps), so one ramp fits every final density; gTop-k's
  default by name (:data:`mpicomm.strategies.RECIPES`).

:class:`FinalPhase` does the opposite at the other end: a run of known length ends
denser (``finish:0.01,3263``: density 0.01 from step 3 263), which applies the residual
that piles up at a low density.

Quantizing strategies (QSGD, sign, PowerSGD, fp16/bf16) have a fixed wire size rather
than a density: they read a schedule as a byte budget and aggregate *densely* (exact
average, residual flushed) while the scheduled density exceeds the fraction of the dense
bytes that their compressed form sends, and compressed afterwards (see
:meth:`mpicomm.strategies._compressed.CompressedStrategy.dense_step`).

Cost: O(1) per step. Tuning: with error feedback at densities of 0.001-0.01 and few
steps per epoch (digits at 8-16 ranks: 5-10 steps per epoch), a warm-up of 1-4 epochs
is most of what keeps the gap to dense small; DGC's exponential schedule sends about
0.25 + 0.0625 + ... ≈ 0.33 epochs' worth of dense traffic in total, the linear anneal
about half of ``length`` epochs' worth, the gTop-k warm-up 0.004 epochs' worth.
:func:`parse_schedule` reads the command-line form (``"dgc"``, ``"gtopk"``,
``"linear:5"``, ``"exp:1092,0.03@step"``, ``"ramp:0.03,9.311"``,
``"warmup:0.1,0.03@step"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..validate import check_choice, check_int

__all__ = ["Schedule", "BudgetRamp", "FinalPhase", "gtopk_warmup", "dgc_warmup",
           "linear_warmup", "exp_warmup", "parse_schedule", "parse_finish", "KINDS", "UNITS",
           "SPECS"]

KINDS = ("stepwise", "linear", "exp")
UNITS = ("epoch", "step")
#: Names :func:`parse_schedule` accepts (besides ``"none"``).
SPECS = ("gtopk", "dgc", "linear", "exp", "ramp", "warmup")

#: DGC's exponential warm-up densities (before the final density).
DGC_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)
#: gTop-k's first-epoch density.
GTOPK_DENSITY = 0.004


def _density(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Schedule:
    """A density schedule: ``schedule(step, final)`` -> the density of ``step``.

    ``kind="stepwise"``: ``values`` (densities in (0, 1]) held for ``length`` units each;
    ``kind="linear"``: from ``start`` to the final density over ``length`` units;
    ``kind="exp"``: geometrically from ``start`` to the final density over ``length``
    units.
    ``unit`` is ``"epoch"`` (then ``steps_per_epoch`` is required) or ``"step"``.
    Invalid arguments raise ``ValueError`` at construction.
    """

    kind: str
    values: tuple[float, ...] = ()
    length: int = 1
    unit: str = "epoch"
    steps_per_epoch: int | None = None
    start: float = 1.0

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, KINDS)
        check_choice("unit", self.unit, UNITS)
        check_int("length", self.length, 1)
        if self.unit == "epoch":
            if self.steps_per_epoch is None:
                raise ValueError("unit='epoch' needs steps_per_epoch (minibatches per "
                                 "rank per epoch)")
            check_int("steps_per_epoch", self.steps_per_epoch, 1)
        elif self.steps_per_epoch is not None:
            check_int("steps_per_epoch", self.steps_per_epoch, 1)
        if not isinstance(self.values, tuple):
            raise ValueError(f"values must be a tuple of densities, got {self.values!r}")
        for v in self.values:
            _density("every warm-up value", v)
        if self.kind == "stepwise" and not self.values:
            raise ValueError("a stepwise schedule needs at least one warm-up value")
        _density("start", self.start)

    # ------------------------------------------------------------------ values
    @property
    def unit_steps(self) -> int:
        """Steps per unit (1 for ``unit="step"``)."""
        return self.steps_per_epoch if self.unit == "epoch" else 1  # type: ignore[return-value]

    @property
    def warmup_steps(self) -> int:
        """First step from which the density is the final one."""
        stages = len(self.values) if self.kind == "stepwise" else 1
        return stages * self.length * self.unit_steps

    def __call__(self, step: int, final: float) -> float:
        """Density of step ``step`` (>= 0) for a strategy whose own density is ``final``."""
        step = check_int("step", step, 0)
        final = _density("final density", final)
        if step >= self.warmup_steps:
            return final
        if self.kind == "stepwise":
            value = self.values[step // (self.length * self.unit_steps)]
        elif self.kind == "linear":
            value = self.start + (final - self.start) * step / self.warmup_steps
        else:
            value = self.start * (final / self.start) ** (step / self.warmup_steps)
        return max(value, final)

    def densities(self, steps: int, final: float) -> list[float]:
        """``[schedule(t, final) for t in range(steps)]``."""
        return [self(t, final) for t in range(steps)]

    def relative_traffic(self, steps: int, final: float) -> float:
        """Mean of ``density / final`` over the first ``steps`` steps: how many times the
        final density's traffic a sparsifier sends on average (1.0 = no warm-up cost)."""
        if steps < 1:
            return 1.0
        return sum(self.densities(steps, final)) / (steps * final)

    def spec(self) -> str:
        """The :func:`parse_schedule` form of this schedule."""
        if self.kind in ("linear", "exp"):
            head = f"{self.kind}:{self.length}" + \
                (f",{self.start:g}" if self.start != 1.0 else "")
        else:
            head = "warmup:" + ",".join(f"{v:g}" for v in self.values)
            if self.length != 1:
                head += f"/{self.length}"
        return head + ("" if self.unit == "epoch" else "@step")


def gtopk_warmup(steps_per_epoch: int | None = None, *, density: float = GTOPK_DENSITY,
                 length: int = 1, unit: str = "epoch") -> Schedule:
    """gTop-k's warm-up: ``density`` (0.004) for ``length`` units, then the final one."""
    return Schedule("stepwise", (_density("density", density),), length, unit,
                    steps_per_epoch)


def dgc_warmup(steps_per_epoch: int | None = None, *, length: int = 1,
               unit: str = "epoch") -> Schedule:
    """DGC's exponential warm-up 0.25, 0.0625, 0.015625, 0.004 (``length`` units each),
    then the final density."""
    return Schedule("stepwise", DGC_DENSITIES, length, unit, steps_per_epoch)


def linear_warmup(steps_per_epoch: int | None = None, *, length: int = 5,
                  start: float = 1.0, unit: str = "epoch") -> Schedule:
    """Linear anneal from ``start`` (dense) to the final density over ``length`` units."""
    return Schedule("linear", (), length, unit, steps_per_epoch, start)


@dataclass(frozen=True)
class BudgetRamp:
    """A geometric ramp from ``start`` down to the final density ``ρ`` whose traffic is
    fixed: ``budget`` density-steps over the whole ramp, whatever ``ρ``.

    ``d(t) = max(s·(ρ/s)^(t/L), ρ)`` for ``t < L`` and ``ρ`` afterwards, with
    ``L = round(budget·ln(s/ρ) / (s - ρ))`` steps, so that ``Σ_{t<L} d(t) ≈ budget``
    (``ρ·L`` of which the final density would have sent anyway); no ramp for
    ``ρ >= s``. A sparsifier whose bytes per step are ``c·density`` of a dense
    allreduce's (gTop-k at P = 8: c = 24/7; AR-Top-k, ring: c = 3/2) spends about
    ``c·budget`` dense allreduces' bytes on the ramp. Example:
    ``BudgetRamp(0.03, 9.311)`` ramps over 1 092 steps at ρ = 0.001 (about 32 dense
    allreduces' bytes for gTop-k at P = 8, against 3 for the rest of a 2 028-step
    run) and over 511 steps at ρ = 0.01. Cost: O(1) per step; the same on every rank.
    Tuning: the start sets how fast the early, fast-changing gradients are applied;
    the budget, how long the ramp lasts: size it from the whole run's byte target.
    """

    start: float
    budget: float

    def __post_init__(self) -> None:
        _density("start", self.start)
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or \
                not 0.0 < float(self.budget) < float("inf"):
            raise ValueError(f"budget must be a finite number > 0, got {self.budget!r}")

    def steps(self, final: float) -> int:
        """Ramp length ``L`` in steps for the final density ``final`` (0: no ramp)."""
        final = _density("final density", final)
        if final >= self.start:
            return 0
        return max(1, round(self.budget * math.log(self.start / final)
                            / (self.start - final)))

    def __call__(self, step: int, final: float) -> float:
        """Density of step ``step`` (>= 0) for a strategy whose own density is ``final``."""
        step = check_int("step", step, 0)
        length = self.steps(final)
        if step >= length:
            return final
        return max(self.start * (final / self.start) ** (step / length), final)

    def spec(self) -> str:
        """The :func:`parse_schedule` form of this ramp."""
        return f"ramp:{self.start:g},{self.budget:g}"


@dataclass(frozen=True)
class FinalPhase:
    """A denser end for a run of known length: ``schedule`` (or the final density
    ``ρ``) before step ``start``, then at least ``density``::

        d(t) = inner(t, ρ)        for t < start   (ρ without an inner schedule)
        d(t) = max(density, ρ)    for t >= start

    With error feedback at a low density the update lags the gradients: each step changes
    ``k`` entries, so an entry waits in the residual for many steps, and the model at the
    end of a short run is that much behind. A last phase at a higher density applies what
    has piled up. Cost: the final phase's steps at ``density`` instead of ``ρ`` (gTop-k
    at P = 8, about ``24/7·density`` of a dense allreduce's bytes a step); O(1) per step,
    the same on every rank. Tuning: start it about a tenth of the run before the end, at
    the density whose full-run accuracy is the target; the strategy does not know the
    run's length, so ``start`` is a step number (the count of aggregations of a buffer).
    Example: ``FinalPhase(0.01, 3263, BudgetRamp(0.03, 6.2))`` for the last 363 of 3 626
    steps, which :meth:`for_run` spells ``FinalPhase.for_run(3626, 0.01, 0.1,
    BudgetRamp(0.03, 6.2))``.
    """

    density: float
    start: int
    schedule: Any = None

    def __post_init__(self) -> None:
        _density("density", self.density)
        check_int("start", self.start, 0)
        if self.schedule is not None and not callable(self.schedule):
            raise ValueError(f"schedule must be a schedule or None, got {self.schedule!r}")

    @classmethod
    def for_run(cls, steps: int, density: float, fraction: float = 0.1,
                schedule: Any = None) -> FinalPhase:
        """The last ``fraction`` of a run of ``steps`` aggregations at ``density``:
        ``start = steps - max(1, round(fraction·steps))``, ``schedule`` before it.
        ``ValueError`` for ``steps < 1`` or ``fraction`` outside (0, 1]."""
        steps = check_int("steps", steps, 1)
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or \
                not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        return cls(density, steps - max(1, round(fraction * steps)), schedule)

    def __call__(self, step: int, final: float) -> float:
        """Density of step ``step`` (>= 0) for a strategy whose own density is ``final``."""
        step = check_int("step", step, 0)
        final = _density("final density", final)
        if step >= self.start:
            return max(self.density, final)
        return final if self.schedule is None else self.schedule(step, final)

    def spec(self) -> str:
        """The label form: the inner schedule's, then ``finish:DENSITY,START``."""
        inner = getattr(self.schedule, "spec", None)
        head = inner() + "+" if callable(inner) else ""
        return f"{head}finish:{self.density:g},{self.start}"


def parse_finish(spec: str, schedule: Any = None) -> FinalPhase:
    """``"finish:D,S"`` -> :class:`FinalPhase` ``(D, S, schedule)``; ``ValueError`` for
    anything else."""
    name, _, args = spec.strip().partition(":")
    density, comma, start = args.partition(",")
    try:
        if name != "finish" or not comma:
            raise ValueError("expected finish:DENSITY,START_STEP")
        return FinalPhase(float(density), int(start), schedule)
    except ValueError as exc:
        raise ValueError(f"bad final phase {spec!r}: {exc}") from None


def exp_warmup(steps_per_epoch: int | None = None, *, length: int = 5,
               start: float = 1.0, unit: str = "epoch") -> Schedule:
    """Geometric ramp from ``start`` down to the final density over ``length`` units."""
    return Schedule("exp", (), length, unit, steps_per_epoch, start)


def parse_schedule(spec: str | None, steps_per_epoch: int | None = None) -> Schedule | None:
    """A schedule from its command-line form; ``None`` for ``None``/``""``/``"none"``.

    ``NAME[:ARGS][@UNIT]`` with UNIT ``epoch`` (default) or ``step``:

    * ``gtopk[:L]``            0.004 for L units (default 1), then final;
    * ``dgc[:L]``              0.25, 0.0625, 0.015625, 0.004, L units each (default 1);
    * ``linear[:L[,S]]``       S (default 1.0) down to final over L units (default 5);
    * ``exp[:L[,S]]``          S (default 1.0) geometrically down to final over L units
      (default 5);
    * ``warmup:V1,V2,..[/L]``  the given densities, L units each (default 1);
    * ``ramp:S,B``             a :class:`BudgetRamp` from S spending B density-steps
      (its length is in steps, set by the final density; no unit).

    Examples: ``"dgc"``, ``"linear:5"``, ``"gtopk:2"``, ``"warmup:0.1,0.03/2"``,
    ``"dgc:20@step"``. ``ValueError`` for anything else.
    """
    if spec is None or spec.strip().lower() in ("", "none"):
        return None
    if not isinstance(spec, str):
        raise ValueError(f"schedule must be a string, got {spec!r}")
    body, _, unit = spec.strip().partition("@")
    unit = unit or "epoch"
    name, _, args = body.partition(":")
    try:
        if name == "gtopk":
            return gtopk_warmup(steps_per_epoch, length=int(args) if args else 1, unit=unit)
        if name == "dgc":
            return dgc_warmup(steps_per_epoch, length=int(args) if args else 1, unit=unit)
        if name in ("linear", "exp"):
            length, _, start = args.partition(",")
            ramp = linear_warmup if name == "linear" else exp_warmup
            return ramp(steps_per_epoch, length=int(length) if length else 5,
                        start=float(start) if start else 1.0, unit=unit)
        if name == "ramp" and unit == "epoch" and "," in args:
            start, _, budget = args.partition(",")
            return BudgetRamp(float(start), float(budget))
        if name == "warmup" and args:
            values, _, length = args.partition("/")
            return Schedule("stepwise", tuple(float(v) for v in values.split(",")),
                            int(length) if length else 1, unit, steps_per_epoch)
    except ValueError as exc:
        raise ValueError(f"bad schedule {spec!r}: {exc}") from None
    raise ValueError(f"bad schedule {spec!r}: expected none, gtopk[:L], dgc[:L], "
                     "linear[:L[,START]], exp[:L[,START]], ramp:START,BUDGET or "
                     "warmup:V1,V2,..[/L], optionally @step or @epoch")
