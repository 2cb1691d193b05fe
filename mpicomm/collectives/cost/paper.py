"""The coarser per-scheme formulas of Tyagi & Swany's Table I (:func:`paper_predict`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real

from ...validate import check_int

__all__ = ["paper_predict", "PAPER_SCHEMES"]


def _paper_terms(n: int) -> dict[str, Callable[[float, float, float], float]]:
    """``scheme -> f(Mc, alpha, beta)`` of Tyagi & Swany's Table I for ``n`` ranks."""
    lg = math.log2(n)
    return {
        "allreduce_ring": lambda m, a, b: 2 * (n - 1) * a + 2 * (n - 1) / n * m * b,
        "allreduce_tree": lambda m, a, b: 2 * a * lg + 2 * lg * m * b,
        "broadcast": lambda m, a, b: a * lg + lg * m * b,
        "allgather": lambda m, a, b: a * lg + (n - 1) * m * b,
        "ps": lambda m, a, b: 2 * a + 2 * (n - 1) * m * b,
        "allgather_topk": lambda m, a, b: a * lg + 2 * m * b * (n - 1),
        "artopk_ring": lambda m, a, b: a * (2 * (n - 1) + lg) + m * b * (2 * (n - 1) / n + lg),
        "artopk_tree": lambda m, a, b: 3 * a * lg + 3 * m * b * lg,
        "gtopk": lambda m, a, b: a * lg + 2 * m * b * lg,
    }


#: Scheme names :func:`paper_predict` knows.
PAPER_SCHEMES: tuple[str, ...] = tuple(_paper_terms(2))


def _nonnegative(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be finite and {'>' if positive else '>='} 0, "
                         f"got {value}")
    return value


def paper_predict(scheme: str, nbytes: float, ranks: int, alpha: float, beta: float,
                  cr: float = 1.0) -> float:
    r"""Seconds to synchronize a gradient of ``nbytes`` (dense size M) over ``ranks`` by
    the formulas of Tyagi & Swany, "Flexible Communication for Optimal Distributed
    Learning over Unpredictable Networks", IEEE BigData 2023, pp. 925-935, Table I
    and Eq. 4, with ``log`` = log2 as in their code, plus gTop-k's butterfly (Shi et al.,
    "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low
    Bandwidth Networks", ICDCS 2019, arXiv 1901.04359). ``c`` = ``cr`` is the fraction
    of entries kept, ``N`` = ``ranks``:

    =================  ===========================================  ======================
    scheme             seconds                                      source
    =================  ===========================================  ======================
    allreduce_ring     2(N-1)α + 2(N-1)/N·Mcβ                       Table I, Ring-AR
    allreduce_tree     2α·lg N + 2 lg N·Mcβ                         Table I, Tree-AR
    broadcast          α·lg N + lg N·Mcβ                            Table I
    allgather          α·lg N + (N-1)·Mcβ                           Table I
    ps                 2α + 2(N-1)·Mcβ                              Table I, param. server
    allgather_topk     α·lg N + 2Mcβ(N-1)          (values+indices) Eq. (AG)
    artopk_ring        α[2(N-1) + lg N] + Mcβ[2(N-1)/N + lg N]      Eq. 4a
    artopk_tree        3α·lg N + 3Mcβ·lg N                          Eq. 4b
    gtopk              α·lg N + 2Mcβ·lg N          (butterfly)      Shi et al.
    =================  ===========================================  ======================

    These are the *paper's* formulas, for the paper's comparisons (Table VI) and quick
    what-if questions ("which collective at 1 Gbit/s and 8 ranks?"); the selector in the
    training loop uses the finer per-algorithm formulas above as the strategies run them
    (:meth:`mpicomm.strategies.Strategy.predict`: folds for non-powers of two, gamma,
    measured compute). Also :func:`mpicomm.control.predict`.

    ``alpha`` in seconds per message, ``beta`` in seconds per byte; the sparse schemes
    send ``cr·M`` values plus as many index bytes, the dense ones move ``cr·M`` (leave
    ``cr=1``). One rank costs nothing. ``ValueError`` for an unknown scheme or a value out
    of range, ``TypeError`` for a non-number.

    Example: ResNet-50 (M = 4·25,557,032 B), 8 ranks, α = 1 ms, 5 Gbit/s
    (β = 1/(5·1.25e8) s/B), c = 0.1 gives AG 232 ms, AR-Top-k ring 94.7 ms, tree 156.2 ms,
    the paper's Table VI row.
    """
    if not isinstance(scheme, str) or scheme not in PAPER_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(PAPER_SCHEMES)}")
    nbytes = _nonnegative("nbytes", nbytes)
    ranks = check_int("ranks", ranks, 1)
    alpha, beta = _nonnegative("alpha", alpha), _nonnegative("beta", beta)
    cr = _nonnegative("cr", cr, positive=True)
    if cr > 1:
        raise ValueError(f"cr is the fraction of entries kept, in (0, 1]; got {cr}")
    if ranks == 1:
        return 0.0
    return _paper_terms(ranks)[scheme](nbytes * cr, alpha, beta)
