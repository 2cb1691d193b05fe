r"""The paper's alpha-beta cost of each synchronization scheme, by name (pure).

Tyagi & Swany, BigData 2023, Table I and Eq. 4 (algorithms.md B.3), with ``log`` = log2 as
in their code, plus gTop-k's butterfly (Shi et al., ICDCS 2019; A.7). ``M`` is the dense
gradient size in bytes, ``c`` the fraction of entries kept (``cr``), ``N`` the ranks:

=================  ===========================================  =========================
scheme             seconds                                      source
=================  ===========================================  =========================
allreduce_ring     2(N-1)α + 2(N-1)/N·Mcβ                       Table I, Ring-AR
allreduce_tree     2α·lg N + 2 lg N·Mcβ                         Table I, Tree-AR
broadcast          α·lg N + lg N·Mcβ                            Table I
allgather          α·lg N + (N-1)·Mcβ                           Table I
ps                 2α + 2(N-1)·Mcβ                              Table I, parameter server
allgather_topk     α·lg N + 2Mcβ(N-1)          (values+indices) Eq. (AG)
artopk_ring        α[2(N-1) + lg N] + Mcβ[2(N-1)/N + lg N]      Eq. 4a
artopk_tree        3α·lg N + 3Mcβ·lg N                          Eq. 4b
gtopk              α·lg N + 2Mcβ·lg N          (butterfly)      A.7, README after 680f392
=================  ===========================================  =========================

These are the *paper's* formulas, for the paper's comparisons (Table VI) and for quick
what-if questions ("which collective at 1 Gbit/s and 8 ranks?"). The selector in the
training loop uses the library's own, finer model of what mpicomm actually runs
(:meth:`mpicomm.strategies.Strategy.predict`: the same alpha-beta terms per algorithm as
implemented, folds for non-powers of two, gamma, and measured compute).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real

from ..validate import check_int

__all__ = ["predict", "SCHEMES"]


def _terms(n: int) -> dict[str, Callable[[float, float, float], float]]:
    """``scheme -> f(Mc, alpha, beta)`` for ``n`` ranks."""
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


#: Scheme names :func:`predict` knows.
SCHEMES: tuple[str, ...] = tuple(_terms(2))


def _number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be finite and {'>' if positive else '>='} 0, "
                         f"got {value}")
    return value


def predict(scheme: str, nbytes: float, ranks: int, alpha: float, beta: float,
            cr: float = 1.0) -> float:
    """Seconds to synchronize a gradient of ``nbytes`` (dense size M) over ``ranks``.

    ``alpha`` in seconds per message, ``beta`` in seconds per byte, ``cr`` the fraction of
    entries kept (the sparse schemes send ``cr·M`` values plus as many index bytes; the
    dense ones move ``cr·M``, so leave ``cr=1``). One rank costs nothing. ``ValueError``
    for an unknown scheme or a value out of range, ``TypeError`` for a non-number.

    Example: ResNet-50 (M = 4·25,557,032 B), 8 ranks, α = 1 ms, 5 Gbit/s
    (β = 1/(5·1.25e8) s/B), c = 0.1 gives AG 232 ms, AR-Top-k ring 94.7 ms, tree 156.2 ms,
    the paper's Table VI row.
    """
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    nbytes = _number("nbytes", nbytes)
    ranks = check_int("ranks", ranks, 1)
    alpha, beta = _number("alpha", alpha), _number("beta", beta)
    cr = _number("cr", cr, positive=True)
    if cr > 1:
        raise ValueError(f"cr is the fraction of entries kept, in (0, 1]; got {cr}")
    if ranks == 1:
        return 0.0
    return _terms(ranks)[scheme](nbytes * cr, alpha, beta)
