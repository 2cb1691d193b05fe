r"""Refine the cost model while training: EWMA least squares on measured step times (pure).

:class:`OnlineCalibration` takes the times of real collectives, each with the
coefficients of its model (messages and bytes on its critical path, modelled compute),
and refits alpha, beta and one factor per scheme on its modelled compute (the measured
1.5-4x gap between kernel rates and a whole step comes from compute and overheads the
kernels' rates miss), with a drift test: when alpha or beta moves by more than ``drift``
(a fraction) from the values of the last decision for ``patience`` consecutive
refinements in a row (debounce: one outlier step on a loaded machine moves the fit but
does not re-decide), :meth:`OnlineCalibration.refine` says so. No communication here:
the caller agrees on the times first (every rank then computes the same fit). The
start-up measurement it starts from is :func:`mpicomm.strategies.kernel_timing.calibrate`
(links by :mod:`mpicomm.collectives.calibrate`, compute kernels timed).

The refinement in detail: observation ``i`` is a collective whose model is
``t_i = a_i·alpha + b_i·beta`` (``a_i`` messages and ``b_i`` bytes on the critical path,
from the strategy's own formula) plus ``w_i`` seconds of modelled compute of scheme
``k_i``, and whose measured time is ``y_i``. Unknowns: ``u = alpha/alpha_0``,
``v = beta/beta_0`` and one ``κ_k`` per scheme. In units of the prior prediction
``s_i = a_i·alpha_0 + b_i·beta_0 + w_i`` each row is
``x_i = (a_i·alpha_0, b_i·beta_0, w_i at k_i)/s_i`` (entries summing to 1) with target
``y_i/s_i``, so every collective weighs the same whatever its size. With weights
``decay^age`` and a ridge ``lam·|θ - 1|²`` (the calibration as a pseudo-observation,
aging like the others) that keeps a direction no recent observation determines near the
calibrated value::

    θ = argmin Σ_i decay^(n-i)·(x_i·θ - y_i/s_i)² + decay^n·lam·|θ - 1|²

This is the EWMA of the sufficient statistics (``decay`` = 1 - EWMA weight). Tuning:
``decay`` 0.8-0.95 (lower follows a changing network faster, noisier); ``drift`` 0.25-0.5
(the paper re-decides on any change of the tc schedule; on a shared host below 0.25 noise
triggers it); ``patience`` 2-5 refinements (ours: a step time on a shared host jumps 3x
for a step or two; a real network change persists).
"""

from __future__ import annotations

import numpy as np

from ..collectives.cost import CostParams
from ..validate import check_int

__all__ = ["OnlineCalibration"]


class OnlineCalibration:
    """EWMA least-squares refinement of alpha, beta and per-scheme compute from measured
    collectives, with drift detection (see the module docstring for the estimator).

    Feed :meth:`observe` on every rank with the same model coefficients (they come from
    deterministic formulas) and the same agreed seconds; :meth:`refine` updates the fit
    and returns True when alpha or beta has stayed more than ``drift`` away from the
    reference for ``patience`` refinements in a row, each with its own measured total
    also more than ``drift`` away from the reference model's prediction (then the current
    estimate becomes the new reference; a refinement back inside the band resets the
    count). ``params`` is the current estimate (gamma unchanged); :meth:`compute_scale`
    the factor on a scheme's modelled compute (1 until observed). Cost: one solve of a
    ``(2 + schemes)``-square system per observation.
    """

    def __init__(self, params: CostParams, *, decay: float = 0.9, drift: float = 0.3,
                 ridge: float = 0.5, patience: int = 3):
        patience = check_int("patience", patience, 1)
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not drift > 0.0:
            raise ValueError(f"drift must be > 0, got {drift!r}")
        if not ridge > 0.0:
            raise ValueError(f"ridge must be > 0, got {ridge!r}")
        self.base = params
        self.params = params
        self.reference = params
        self.decay, self.drift, self.ridge = float(decay), float(drift), float(ridge)
        self.kinds: list[str] = []                 # compute unknowns after (u, v)
        self._gram = self.ridge * np.eye(2)   # the ping-pong fit as a pseudo-observation
        self._rhs = self.ridge * np.ones(2)
        self._theta = np.ones(2)
        self._pending: list[tuple[float, float, float, float, str]] = []
        self.updates = 0
        self.patience = patience
        self._streak = 0   # consecutive refinements outside the drift band

    def compute_scale(self, kind: str) -> float:
        """Fitted factor on the modelled compute of ``kind`` (a scheme name)."""
        if kind not in self.kinds:
            return 1.0
        return float(self._theta[2 + self.kinds.index(kind)])

    def compute_scales(self) -> dict[str, float]:
        return {k: self.compute_scale(k) for k in self.kinds}

    def observe(self, a: float, b: float, seconds: float, work: float = 0.0,
                kind: str = "") -> None:
        """One collective: ``a`` messages and ``b`` bytes on its critical path, ``work``
        seconds of modelled compute of scheme ``kind``, ``seconds`` measured in all."""
        self._pending.append((float(a), float(b), float(seconds), float(work), str(kind)))

    def refine(self) -> bool:
        """Update the fit with the pending observations and test for drift.

        The observations must be agreed already (identical on every rank: the same
        coefficients from deterministic formulas, the same measured times), so that
        every rank computes the same fit and the same answer."""
        ref = self.reference
        # the step's own times against the reference model: an outlier step moves the
        # EWMA fit for several steps, but only its own step is outside the band
        expected = sum(a * ref.alpha + b * ref.beta + self.compute_scale(k) * w
                       for a, b, _, w, k in self._pending)
        measured = sum(p[2] for p in self._pending)
        for a, b, seconds, work, kind in self._pending:
            self._update(a, b, seconds, work, kind)
        self._pending = []
        off = expected > 0 and _relative(measured, expected) > self.drift
        moved = off and (_relative(self.params.alpha, ref.alpha) > self.drift
                         or _relative(self.params.beta, ref.beta) > self.drift)
        self._streak = self._streak + 1 if moved else 0
        if self._streak < self.patience:
            return False
        self._streak = 0
        self.reference = self.params
        return True

    def _grow(self, kind: str) -> int:
        if kind not in self.kinds:
            self.kinds.append(kind)
            n = self._gram.shape[0]
            gram = np.zeros((n + 1, n + 1))
            gram[:n, :n] = self._gram
            gram[n, n] = self.ridge
            self._gram = gram
            self._rhs = np.append(self._rhs, self.ridge)
            self._theta = np.append(self._theta, 1.0)
        return 2 + self.kinds.index(kind)

    def _update(self, a: float, b: float, seconds: float, work: float, kind: str) -> None:
        if not seconds > 0:
            return
        col = self._grow(kind) if work > 0 and kind else None
        x = np.zeros(self._gram.shape[0])
        x[0], x[1] = a * self.base.alpha, b * self.base.beta
        if col is not None:
            x[col] = work
        prior = float(x.sum())
        if not prior > 0:
            return
        x /= prior  # the row in units of the prior prediction; target = measured/that
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._rhs = self.decay * self._rhs + x * (seconds / prior)
        lhs = self._gram + 1e-9 * np.trace(self._gram) * np.eye(x.size)
        self._theta = np.maximum(np.linalg.solve(lhs, self._rhs), 1e-3)
        u, v = float(self._theta[0]), float(self._theta[1])
        self.params = CostParams(alpha=u * self.base.alpha, beta=v * self.base.beta,
                                 gamma=self.base.gamma)
        self.updates += 1


def _relative(value: float, ref: float) -> float:
    return abs(value - ref) / ref if ref > 0 else (0.0 if value == 0 else float("inf"))
