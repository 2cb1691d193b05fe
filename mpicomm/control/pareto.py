r"""Two-objective choice over a continuous range: exact Pareto front on a grid, ASF pick.

The compression-ratio controller (:class:`mpicomm.control.CRController`) minimizes two
objectives of the ratio ``c`` (fraction of entries kept) over the continuous interval
``[c_low, c_high]``: the predicted time of a training step ``T(c)`` and the inverse
compression gain ``1/gain(c)`` (Tyagi & Swany, "Flexible Communication for Optimal
Distributed Learning over Unpredictable Networks", IEEE BigData 2023, section 3.E).
Their reference code fits both curves and runs NSGA-II (pymoo) over the interval; here
the objectives are evaluated *exactly* at every point of a log-spaced grid
(:func:`ratio_grid`, 64 points by default: 7.6% apart from 0.001 to 0.1, finer than the
spread of NSGA-II's 40-individual population after 40 generations), the non-dominated
points are taken (:func:`pareto_front`) and one is picked by an achievement scalarizing
function (:func:`asf`, :func:`asf_choice`).

ASF, as pymoo defines it (``pymoo.decomposition.asf.ASF``)::

    ASF(f; z, w) = max_i (f_i - z_i) / w_i          (z: the utopian point)

so a *larger* ``w_i`` makes objective ``i`` count *less*. The reference code calls it
with ``1 / weights`` for the weights ``(0.6 time, 0.4 gain)``, i.e. it minimizes
``max_i weight_i·(f_i - z_i)``: time counts more. :func:`asf_choice` takes those
importance weights and calls :func:`asf` with their inverse, the same way.

Normalization before the ASF (``normalize``):

* ``"nadir"`` (the reference code): ``f^ = (f - ideal) / (nadir - ideal)`` over the
  front. It is invariant to any *affine* change of an objective: adding the latency
  terms or the forward/backward time to ``T(c)``, or scaling the bandwidth term, leaves
  ``f^`` unchanged, so with the same scheme at every ``c`` the pick does not move when
  the network does (only a change of the cheapest scheme along ``c`` bends the curve).
  That is why, on a network that slowed 2x and grew 5x in latency, the reference rule
  kept the same ratio.
* ``"ideal"`` (default): the relative excess over the best achievable value,
  ``f^ = f / ideal - 1`` (pymoo's ASF with ``z = ideal`` and weights scaled by the
  ideal). Scaling an objective leaves it unchanged, adding a constant does not: when
  the forward and backward pass dominate the step, ``T(c)`` is nearly flat and the pick
  moves to large ratios (more gain for little time); when the network dominates it moves
  to small ones. This is the behaviour the controller is for.

Cost: ``O(n²)`` for the front of ``n`` points (n = 64: microseconds), plus the ``n``
evaluations of the objectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["pareto_front", "asf", "asf_choice", "knee_choice", "ratio_grid",
           "interpolate_gains", "NORMALIZATIONS", "GRID_POINTS"]

#: Normalizations of the objectives before the ASF (module docstring).
NORMALIZATIONS: tuple[str, ...] = ("ideal", "nadir")
#: Default number of grid points of the continuous range.
GRID_POINTS = 64


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points (both objectives minimized), by first value."""
    front = []
    for i, (a, b) in enumerate(points):
        dominated = any((c <= a and d <= b) and (c < a or d < b)
                        for j, (c, d) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], points[i][1], i))


def asf(f: Sequence[float], weights: Sequence[float],
        utopian: Sequence[float] | None = None) -> float:
    """pymoo's achievement scalarizing function: ``max_i (f_i - z_i) / w_i`` with ``z``
    the utopian point (default 0). A larger ``w_i`` makes objective ``i`` count less."""
    z = utopian if utopian is not None else [0.0] * len(f)
    if not (len(f) == len(weights) == len(z)) or any(w <= 0 for w in weights):
        raise ValueError(f"asf: f, weights and utopian need one value per objective and "
                         f"weights > 0, got {f!r}, {weights!r}, {z!r}")
    return max((fi - zi) / wi for fi, zi, wi in zip(f, z, weights))


def _normalized(points: Sequence[tuple[float, float]], front: list[int], normalize: str
                ) -> dict[int, tuple[float, float]]:
    lo = [min(points[i][d] for i in front) for d in (0, 1)]
    hi = [max(points[i][d] for i in front) for d in (0, 1)]
    out = {}
    for i in front:
        if normalize == "nadir":
            out[i] = tuple((points[i][d] - lo[d]) / (hi[d] - lo[d]) if hi[d] > lo[d]
                           else 0.0 for d in (0, 1))
        else:
            out[i] = tuple(points[i][d] / lo[d] - 1.0 if lo[d] > 0 else
                           (points[i][d] - lo[d]) for d in (0, 1))
    return out  # type: ignore[return-value]


def asf_choice(points: Sequence[tuple[float, float]], weights: tuple[float, float] = (0.6, 0.4),
               normalize: str = "ideal") -> int:
    """The front point of least :func:`asf` ``(f^; 0, 1/weights)``: ``weights`` are
    importances (a larger weight makes that objective count more), passed to pymoo's
    definition inverted as the reference code does; ``f^`` normalized by ``normalize``
    (module docstring). Ties: the lower index."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    front = pareto_front(points)
    norm = _normalized(points, front, normalize)
    inverse = (1.0 / weights[0], 1.0 / weights[1])
    return min(front, key=lambda i: (asf(norm[i], inverse), i))


def knee_choice(points: Sequence[tuple[float, float]], normalize: str = "nadir") -> int:
    """The front point farthest from the line through the front's two extremes."""
    front = pareto_front(points)
    if len(front) <= 2:
        return asf_choice(points, normalize=normalize)
    norm = _normalized(points, front, normalize)
    (x0, y0), (x1, y1) = norm[front[0]], norm[front[-1]]
    length = math.hypot(x1 - x0, y1 - y0) or 1.0

    def distance(i: int) -> float:
        x, y = norm[i]
        return abs((y1 - y0) * x - (x1 - x0) * y + x1 * y0 - y1 * x0) / length

    return max(front, key=lambda i: (distance(i), -i))


def ratio_grid(low: float, high: float, points: int = GRID_POINTS) -> tuple[float, ...]:
    """``points`` ratios spaced evenly in ``log c`` from ``high`` down to ``low`` (both
    included, rounded to 4 significant digits so that every rank keys them alike)."""
    if not 0 < low <= high <= 1:
        raise ValueError(f"ratio_grid: need 0 < low <= high <= 1, got {low!r}, {high!r}")
    if points < 2 or low == high:
        return (float(high),)
    step = math.log(high / low) / (points - 1)
    grid = [float(f"{high * math.exp(-i * step):.4g}") for i in range(points)]
    return tuple(sorted(set(grid), reverse=True))


def interpolate_gains(measured: dict[float, float], grid: Sequence[float]
                      ) -> dict[float, float]:
    """Gains at every ``grid`` ratio from gains measured at a few ratios: linear in
    ``log c`` between neighbours, held constant beyond the measured range (an
    exploration window measures the paper's five candidates; the solve needs the
    continuum). Measured ratios with a gain <= 0 are ignored."""
    known = sorted((c, g) for c, g in measured.items() if g > 0)
    if not known:
        return {}
    out = {}
    for c in grid:
        if c <= known[0][0]:
            out[c] = known[0][1]
        elif c >= known[-1][0]:
            out[c] = known[-1][1]
        else:
            for (c0, g0), (c1, g1) in zip(known, known[1:]):
                if c0 <= c <= c1:
                    t = math.log(c / c0) / math.log(c1 / c0)
                    out[c] = g0 + t * (g1 - g0)
                    break
    return out
