r"""The ratio ramp of ``strategy="auto"``: a large fall of the ratio is spread over steps.

When the ratio a bucket runs at falls by more than ``factor`` at once (dense, ratio 1,
to a sparse scheme at 0.01 when the network slows down; or a re-solve from 0.1 to 0.01),
every coordinate's error-feedback residual starts to build up at the same step. Deep
gradient compression (Lin et al., "Deep Gradient Compression", 2018, arXiv 1712.01887)
warms up its sparsity geometrically at the start of training; this applies the same
warm-up to every large fall. Measured on mnist1d-cnn (8 ranks, momentum 0.9, from a
dense model at 0.96 test accuracy), it removes the accuracy dip that can follow such
a switch only together with DGC's momentum correction (with plain error feedback it
delays it by about the ramp's length), and with the correction auto's own switches
showed no dip, so :class:`~mpicomm.strategies.AutoConfig` leaves it off by default
(``ramp_steps=0``; the numbers are there).

:class:`RatioRamp` gives, per bucket, the ratio to run at: on such a fall from ``r0``
(the ratio the bucket last ran at, capped at ``start``) to ``r1``, the ``j``-th of
``steps`` steps runs at ``r0^(1-j/steps) · r1^(j/steps)``; the target may move during
the ramp (one more than ``factor`` below the ramp's target starts a new ramp from the
ratio in force; a smaller move only changes the target the ramp goes on towards; a
target at or above the ratio in force ends it). Pure bookkeeping: the same on every
rank for the same (agreed) targets.

Cost: the ramp's steps send more than the target's (``Σ_j r_j ≈ steps·(r0 - r1) /
ln(r0/r1)`` ratios' worth of pairs against ``steps·r1``), which on a slow link is why
its start is capped: from 1 to 0.01 over 100 steps sends 21.5 full gradients' worth of
pairs, from 0.1 to 0.01 3.9.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .auto_schemes import Choice

__all__ = ["RatioRamp"]


@dataclass
class _Ramp:
    start: float
    target: float
    done: int = 0  # steps of the ramp run so far


class RatioRamp:
    """Per-bucket ramps: :meth:`ratio` once per step with the bucket's target ratio.

    ``steps``: the ramp's length (0: none, every target runs at once); ``factor``: the
    fall (previous ratio / target) beyond which a ramp starts; ``start``: the highest
    ratio a ramp starts from (a fall from dense, ratio 1, ramps from ``start``).
    """

    def __init__(self, steps: int, factor: float, start: float = 1.0):
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps!r}")
        if not factor > 1.0:
            raise ValueError(f"factor must be > 1, got {factor!r}")
        if not 0.0 < start <= 1.0:
            raise ValueError(f"start must be in (0, 1], got {start!r}")
        self.steps, self.factor, self.start = int(steps), float(factor), float(start)
        self._last: dict[str, float] = {}
        self._ramps: dict[str, _Ramp] = {}

    def active(self, bucket: str) -> bool:
        """Whether ``bucket`` is being ramped down."""
        return bucket in self._ramps

    def ratio(self, bucket: str, target: float) -> float:
        """The ratio ``bucket`` runs at this step for ``target`` (1 for dense): the
        target, or the next step of a ramp down to it. The first call of a bucket runs
        its target."""
        last = self._last.get(bucket)
        ramp = self._ramps.pop(bucket, None)
        if last is None or self.steps == 0 or target >= last:
            ramp = None
        elif ramp is None or target * self.factor < ramp.target:  # a (new) large fall
            ramp = _Ramp(min(last, self.start), target) \
                if target * self.factor < last else None
        else:  # the target moved a little: the ramp goes on towards it
            ramp.target = target
        run = target
        if ramp is not None:
            ramp.done += 1
            j = ramp.done / self.steps
            run = max(target, ramp.start ** (1.0 - j) * target ** j)
            if ramp.done < self.steps and run > target:
                self._ramps[bucket] = ramp
            else:
                run = target
        self._last[bucket] = run
        return run

    def apply(self, bucket: str, choice: Choice, eligible: bool) -> tuple[Choice, bool]:
        """``choice`` at the ratio :meth:`ratio` gives for its own (where ``eligible``:
        a kept choice's step, not a trial's or an exploration window's, which leave the
        ramp alone); ``(choice, whether it runs above its ratio)``."""
        if not eligible:
            return choice, False
        run = self.ratio(bucket, choice.ratio)
        return Choice(choice.scheme, run, choice.predicted, choice.candidates), \
            run != choice.ratio

    def last(self, bucket: str) -> Optional[float]:
        """The ratio ``bucket`` last ran at (``None`` before its first step)."""
        return self._last.get(bucket)
