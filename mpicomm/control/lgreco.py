r"""L-GreCo: per-layer compression parameters under a total-error budget (pure).

Alimohammadi, Markov, Frantar & Alistarh, "L-GreCo: Layerwise-Adaptive Gradient
Compression for Efficient and Accurate Deep Learning", MLSys 2024 (arXiv 2210.17357).
For layers ``l = 1..L`` with candidate settings ``j`` of size ``size[l][j]`` (bytes or
elements on the wire) and error ``err[l][j] = ||A_l - C_j(A_l)||`` (Frobenius, not
squared, on a gradient accumulated over recent steps), choose one candidate per layer::

    minimize Σ_l size[l][c_l]   subject to   Σ_l err[l][c_l] <= E_max

with ``E_max`` = the total error of the uniform default (the paper's alpha_budget = 1).

:func:`lgreco_solve` is the paper's knapsack dynamic program over *discretized* error,
discretized as in the authors' reference code: the budget is cut into ``B`` (default
10,000) units of ``E_max / B``; each error becomes ``ceil(err / unit)`` units (a layer
costs at least 1 unit; a non-finite error or one above the budget is infeasible);
``DP[l][b]`` is the least size of layers ``1..l`` using exactly ``b`` units; the answer is
the best ``DP[L][b]`` over ``b <= B``, traced back through a parent table. Rounding *up*
makes every returned assignment truly feasible (Σ err <= E_max); the price is that an
assignment whose rounded units exceed ``B`` (at most ``L`` units of slack, the uniform
default among them in rare cases) is not seen. Where the reference takes ``e_1 < b`` for
the first layer we use ``<=`` (the same DP as for the other layers).
Cost: O(L·|C|·B) time, vectorized over b; O(L·B) memory.

:class:`LGreco` is the controller around it: the family and its uniform default, the
candidate settings, when to accumulate and when to solve (``every``, ``acc_steps``), and
:meth:`LGreco.decide`: given each layer's measured sizes and errors at the candidates, the
per-layer settings (the uniform default wherever the DP's answer would be larger, so the
total size never exceeds it). Three families (``family=``):

* ``"topk"``: densities ``default·factors`` within (0, 1] (``factors`` default
  ``{1/4, 1/2, 1, 2, 4}``); size ``2·k`` wire words (value + index), error the exact
  top-k tail ``sqrt(Σ_{i>k} |A|²_(i))`` (the analogue of the reference's SVD tail for
  PowerSGD ranks; exact, hence non-increasing in k). Top-k is our instantiation; the
  public L-GreCo code implements only PowerSGD ranks.
* ``"qsgd"``: bits ``default + {-2, -1, 0, 1, 2}`` within [1, 8].
* ``"powersgd"``: ranks ``round(default·factors)`` (>= 1).

Measuring the sizes and errors (with the project's compressors, on rank 0's accumulated
gradients) and broadcasting the decision is the strategies' side:
:class:`mpicomm.strategies.lgreco_errors.LayerErrors`; the per-layer exchanges inside a
fused bucket are :mod:`mpicomm.strategies.lgreco_buckets`. Tuning: ``every`` 50-500
steps (a solve costs one compression per layer and candidate on rank 0), ``acc_steps``
a few steps (the accumulated gradient is what the errors are measured on).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..validate import check_int

__all__ = ["lgreco_solve", "LGreco", "DEFAULT_FACTORS", "FAMILIES", "QSGD_OFFSETS"]

#: Candidate densities, as multiples of the uniform default.
DEFAULT_FACTORS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
#: Candidate QSGD bits, as offsets from the uniform default (clipped to [1, 8]).
QSGD_OFFSETS: tuple[int, ...] = (-2, -1, 0, 1, 2)
#: The compression families L-GreCo chooses a per-layer parameter for.
FAMILIES: tuple[str, ...] = ("topk", "qsgd", "powersgd")


def lgreco_solve(sizes: Sequence[Sequence[float]], errors: Sequence[Sequence[float]],
                 budget: float, buckets: int = 10_000) -> list[int]:
    """One candidate index per layer: least total size with total error <= ``budget``.

    ``sizes[l][j]`` and ``errors[l][j]`` for layer l, candidate j (non-negative; errors
    may be ``inf``/``nan`` for unusable candidates). ``ValueError`` when the shapes
    differ, a value is negative, or no assignment fits the discretized budget.

    Discretization: ``budget`` is cut into ``buckets`` units; an error costs
    ``max(1, ceil(err / (budget / buckets)))`` units and the DP is exact over those
    integers (optimal among assignments whose rounded units sum to <= ``buckets``).
    Rounding up keeps the true total error <= ``budget``; an assignment within the budget
    but over it after rounding (at most one unit of slack per layer) is not found. Ties
    in size go to fewer error units, then to lower candidate indices.
    """
    if len(sizes) != len(errors):
        raise ValueError(f"sizes has {len(sizes)} layers but errors has {len(errors)}")
    buckets = check_int("buckets", buckets, 1)
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a finite number > 0, got {budget!r}")
    if not sizes:
        return []
    layers = []
    for l, (s, e) in enumerate(zip(sizes, errors)):
        s = np.asarray(s, dtype=np.float64)
        e = np.asarray(e, dtype=np.float64)
        if s.ndim != 1 or s.shape != e.shape or s.size == 0:
            raise ValueError(f"layer {l}: sizes and errors must be equal, non-empty lists")
        if np.any(s < 0) or np.any(~np.isfinite(s)) or np.any(e < 0):
            raise ValueError(f"layer {l}: sizes must be finite >= 0 and errors >= 0")
        unit = budget / buckets
        with np.errstate(invalid="ignore", over="ignore"):
            units = np.ceil(e / unit)
        ok = np.isfinite(units) & (units <= buckets)
        layers.append((s, np.where(ok, np.maximum(units, 1), -1).astype(np.int64)))
    width = buckets + 1
    inf = np.inf
    dp = np.full(width, inf)
    dp[0] = 0.0
    parents = np.zeros((len(layers), width), dtype=np.int64)
    for l, (s, units) in enumerate(layers):
        new = np.full(width, inf)
        choice = np.full(width, -1, dtype=np.int64)
        for j in range(s.size):  # ties: the lowest candidate index wins
            u = int(units[j])
            if u < 0:
                continue
            cand = np.full(width, inf)
            cand[u:] = dp[:width - u] + s[j]
            better = cand < new
            new[better] = cand[better]
            choice[better] = j
        dp = new
        parents[l] = choice
    if not np.isfinite(dp).any():
        raise ValueError("no assignment meets the error budget (after discretization)")
    b = int(np.argmin(dp))  # least size; ties: fewest error units
    picks = [0] * len(layers)
    for l in range(len(layers) - 1, -1, -1):
        j = int(parents[l][b])
        picks[l] = j
        b -= int(layers[l][1][j])
    return picks


class LGreco:
    """Per-layer compression parameters (top-k density, QSGD bits or PowerSGD rank).

    ``default`` is the uniform setting (a density in (0, 1] for ``"topk"``, bits in
    [1, 8] for ``"qsgd"``, a rank >= 1 for ``"powersgd"``); ``every`` the steps between
    adjustments; ``acc_steps`` how many steps before an adjustment the gradients are
    accumulated (:meth:`accumulating`); ``factors`` the candidate multiples of the
    default (top-k, PowerSGD; QSGD takes :data:`QSGD_OFFSETS`); ``buckets`` the DP's
    error units; ``bucket_size`` and ``seed`` the settings of the compressors the errors
    are measured with (QSGD's bucket, PowerSGD's and QSGD's random streams).
    :meth:`value` (alias :meth:`density`) gives a layer's setting (the default until the
    first decision); :meth:`decide` solves, :meth:`apply` takes a decision (the same on
    every rank: one rank decides, the others receive it).
    """

    def __init__(self, default: float, *, every: int = 50, acc_steps: int = 5,
                 factors: Sequence[float] = DEFAULT_FACTORS, buckets: int = 10_000,
                 family: str = "topk", bucket_size: int = 512, seed: int = 0):
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        if family == "topk" and not (isinstance(default, (int, float))
                                     and not isinstance(default, bool)
                                     and 0 < default <= 1):
            raise ValueError(f"default density must be in (0, 1], got {default!r}")
        if family == "qsgd":
            check_int("default bits", default, 1, 8)
        if family == "powersgd":
            check_int("default rank", default, 1)
        every = check_int("every", every, 1)
        acc_steps = check_int("acc_steps", acc_steps, 1, every)
        buckets = check_int("buckets", buckets, 1)
        if not factors or any(f <= 0 for f in factors):
            raise ValueError("factors must be positive")
        check_int("bucket_size", bucket_size, 1)
        check_int("seed", seed, 0)
        self.family = family
        self.default = float(default) if family == "topk" else int(default)
        self.every, self.acc_steps, self.buckets = every, acc_steps, buckets
        self.bucket_size, self.seed = bucket_size, seed
        self.factors = tuple(sorted(set(float(f) for f in factors)))
        #: The per-layer settings in force (a layer not listed runs at the default).
        self.values: dict[str, float] = {}
        #: Every decision taken (:meth:`decide`'s dicts), oldest first.
        self.history: list[dict[str, Any]] = []

    @property
    def densities(self) -> dict[str, float]:
        """The per-layer settings (named for the top-k family; any family's values)."""
        return self.values

    def value(self, layer: str) -> float:
        return self.values.get(layer, self.default)

    density = value

    def rebase(self, default: float) -> None:
        """Move the uniform default (the top-k family: to the ratio a compression-ratio
        controller chose). The per-layer settings in force are scaled by the same factor
        (clipped to (0, 1]) until the next :meth:`decide` re-solves around the new
        default, so the total size follows the controller at once."""
        if self.family != "topk":
            raise ValueError("rebase: only the top-k family follows a ratio")
        if not (isinstance(default, (int, float)) and not isinstance(default, bool)
                and 0 < default <= 1):
            raise ValueError(f"default density must be in (0, 1], got {default!r}")
        scale = float(default) / self.default
        self.values = {k: min(1.0, v * scale) for k, v in self.values.items()}
        self.default = float(default)

    def candidates(self) -> list[float]:
        """The candidate settings, ascending (the default among them)."""
        if self.family == "topk":
            return sorted({min(1.0, self.default * f) for f in self.factors})
        if self.family == "qsgd":
            return sorted({min(8, max(1, int(self.default) + d)) for d in QSGD_OFFSETS})
        return sorted({max(1, round(self.default * f)) for f in self.factors})

    def accumulating(self, step: int) -> bool:
        """Whether step ``step`` (0-based) feeds the accumulator (the last ``acc_steps``
        before an adjustment)."""
        return (step % self.every) >= self.every - self.acc_steps

    def due(self, step: int) -> bool:
        """Whether the settings are re-solved after step ``step`` (0-based)."""
        return (step + 1) % self.every == 0

    def decide(self, layers: Sequence[str], sizes: Sequence[Sequence[float]],
               errors: Sequence[Sequence[float]]) -> dict[str, Any]:
        """The per-layer settings from each layer's ``sizes[l][j]`` and ``errors[l][j]``
        at :meth:`candidates` ``j``: :func:`lgreco_solve` under the budget of the uniform
        default's total error, kept only where its total size is at most the uniform
        default's (else, and where no assignment fits after discretization, the uniform
        default). Returns ``{"densities": {layer: setting}, "size", "uniform_size",
        "error", "budget", "family"}``."""
        cands = self.candidates()
        uniform = cands.index(min(cands, key=lambda c: abs(c - self.default)))
        if not layers:
            return {"densities": {}, "size": 0.0, "uniform_size": 0.0, "error": 0.0,
                    "budget": 0.0, "family": self.family}
        budget = sum(e[uniform] for e in errors)
        uniform_size = sum(s[uniform] for s in sizes)
        picks = [uniform] * len(layers)
        if budget > 0:
            try:
                found = lgreco_solve(sizes, errors, budget, self.buckets)
                if sum(s[j] for s, j in zip(sizes, found)) <= uniform_size:
                    picks = found
            except ValueError:
                pass  # uniform stays (its rounded units exceeded the budget)
        return {"densities": {n: cands[j] for n, j in zip(layers, picks)},
                "size": float(sum(s[j] for s, j in zip(sizes, picks))),
                "uniform_size": float(uniform_size),
                "error": float(sum(e[j] for e, j in zip(errors, picks))),
                "budget": float(budget), "family": self.family}

    def apply(self, decision: dict[str, Any]) -> dict[str, float]:
        """Put a decision of :meth:`decide` in force; returns the per-layer settings."""
        self.values = dict(decision["densities"])
        self.history.append(decision)
        return self.values
