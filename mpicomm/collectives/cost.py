r"""The alpha-beta-gamma cost of every collective algorithm in mpicomm.

Model (Hockney; Thakur, Rabenseifner & Gropp, IJHPCA 2005): sending one message of
``n`` bytes between two ranks costs ``alpha + n*beta``; reducing ``n`` bytes locally costs
``n*gamma``. ``p`` is the number of ranks, ``lg`` is log2, and for a non-power-of-two
``p`` the algorithms that need a power of two fold the extra ranks in and out, which adds
the terms marked *fold* below (``p2`` is the largest power of two <= p).

Sizes: for allreduce, reduce-scatter and broadcast ``n`` is the size of one rank's
vector; for allgather it is the *total* gathered size (MPICH's convention). The sparse
formulas take ``k`` (entries per rank) and ``s`` (bytes per entry on the wire).

==============================  ===============================================================
algorithm                       time
==============================  ===============================================================
allreduce ring                  2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ
allreduce recursive doubling    lg p2·(α + nβ + nγ)                      fold: 2α + 2nβ + nγ
allreduce Rabenseifner          2 lg p2·α + 2(p2-1)/p2·nβ + (p2-1)/p2·nγ  fold: 2α + 2nβ + nγ
allgather ring                  (p-1)α + (p-1)/p·nβ
allgather Bruck                 ⌈lg p⌉α + (p-1)/p·nβ
allgather recursive doubling    lg p2·α + (p-1)/p·nβ                     fold: 2α + (n/p + n)β
broadcast binomial              ⌈lg p⌉(α + nβ)
broadcast scatter + allgather   (⌈lg p⌉ + p - 1)α + 2(p-1)/p·nβ
reduce-scatter ring             (p-1)α + (p-1)/p·n(β + γ)
reduce-scatter rec. halving     lg p2·α + (p2-1)/p2·n(β + γ)        fold: 2α + n(β + γ) + n/p·β
Top-k via allgather (ring)      (p-1)α + (p-1)·k·s·β
gTop-k (butterfly)              lg p2·(α + k·s·β)                        fold: 2(α + k·s·β)
AR-Top-k (ring)                 bcast of k indices + ring allreduce of k values
AR-Top-k (tree)                 bcast of k indices + binomial reduce + bcast of k values
==============================  ===============================================================

Tuning: the defaults in :class:`CostParams` are rough figures for shared memory under
Python; measure ``alpha``/``beta`` on the target machine (``python -m mpicomm.bench
collectives`` fits them from ping-pong) before trusting ``algorithm="auto"`` there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CostParams", "predict", "choose", "FORMULAS", "paper"]


@dataclass(frozen=True)
class CostParams:
    """Per-message latency ``alpha`` (s), time per byte ``beta`` and ``gamma`` (s/B)."""

    alpha: float = 20e-6
    beta: float = 1 / 4e9
    gamma: float = 1 / 4e9

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


def _lg(p: int) -> float:
    return math.log2(p) if p > 1 else 0.0


def _p2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _fold(p: int) -> int:
    """1 when p is not a power of two (the fold steps run), else 0."""
    return int(p != _p2(p))


# ---------------------------------------------------------------------- dense
def allreduce_ring(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    f = (p - 1) / p
    return 2 * (p - 1) * c.alpha + 2 * f * n * c.beta + f * n * c.gamma


def allreduce_recursive_doubling(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    rounds = _lg(_p2(p))
    fold = _fold(p) * (2 * c.alpha + 2 * n * c.beta + n * c.gamma)
    return rounds * (c.alpha + n * c.beta + n * c.gamma) + fold


def allreduce_rabenseifner(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    p2 = _p2(p)
    f = (p2 - 1) / p2
    fold = _fold(p) * (2 * c.alpha + 2 * n * c.beta + n * c.gamma)
    return 2 * _lg(p2) * c.alpha + 2 * f * n * c.beta + f * n * c.gamma + fold


def allgather_ring(n: float, p: int, c: CostParams) -> float:
    return (p - 1) * c.alpha + (p - 1) / p * n * c.beta


def allgather_bruck(n: float, p: int, c: CostParams) -> float:
    return math.ceil(_lg(p)) * c.alpha + (p - 1) / p * n * c.beta


def allgather_recursive_doubling(n: float, p: int, c: CostParams) -> float:
    fold = _fold(p) * (2 * c.alpha + (n / p + n) * c.beta)
    return _lg(_p2(p)) * c.alpha + (p - 1) / p * n * c.beta + fold


def broadcast_binomial(n: float, p: int, c: CostParams) -> float:
    return math.ceil(_lg(p)) * (c.alpha + n * c.beta)


def broadcast_scatter_allgather(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    return (math.ceil(_lg(p)) + p - 1) * c.alpha + 2 * (p - 1) / p * n * c.beta


def reduce_scatter_ring(n: float, p: int, c: CostParams) -> float:
    return (p - 1) * c.alpha + (p - 1) / p * n * (c.beta + c.gamma)


def reduce_scatter_recursive_halving(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    p2 = _p2(p)
    fold = _fold(p) * (2 * c.alpha + n * (c.beta + c.gamma) + n / p * c.beta)
    return _lg(p2) * c.alpha + (p2 - 1) / p2 * n * (c.beta + c.gamma) + fold


# ---------------------------------------------------------------------- sparse
def topk_allgather(k: float, s: float, p: int, c: CostParams) -> float:
    """Every rank's k (index, value) pairs gathered by a ring: (p-1)α + (p-1)·k·s·β."""
    return (p - 1) * c.alpha + (p - 1) * k * s * c.beta


def gtopk(k: float, s: float, p: int, c: CostParams) -> float:
    """Butterfly gTop-k: lg p2 rounds of k pairs, plus the fold-in/fold-out step."""
    if p == 1:
        return 0.0
    return (_lg(_p2(p)) + 2 * _fold(p)) * (c.alpha + k * s * c.beta)


def artopk_ring(k: float, index_bytes: float, value_bytes: float, p: int,
                c: CostParams) -> float:
    """AR-Top-k: binomial broadcast of k indices + ring allreduce of k values."""
    return (broadcast_binomial(k * index_bytes, p, c)
            + allreduce_ring(k * value_bytes, p, c))


def artopk_tree(k: float, index_bytes: float, value_bytes: float, p: int,
                c: CostParams) -> float:
    """AR-Top-k: broadcast of k indices, then a binomial reduce + broadcast of k values."""
    n, rounds = k * value_bytes, math.ceil(_lg(p))
    tree_allreduce = 2 * rounds * (c.alpha + n * c.beta) + rounds * n * c.gamma
    return broadcast_binomial(k * index_bytes, p, c) + tree_allreduce


FORMULAS: dict[str, dict[str, Callable[[float, int, CostParams], float]]] = {
    "allreduce": {
        "ring": allreduce_ring,
        "recursive_doubling": allreduce_recursive_doubling,
        "rabenseifner": allreduce_rabenseifner,
    },
    "allgather": {
        "ring": allgather_ring,
        "bruck": allgather_bruck,
        "recursive_doubling": allgather_recursive_doubling,
    },
    "allgatherv": {"ring": allgather_ring},
    "broadcast": {
        "binomial": broadcast_binomial,
        "scatter_allgather": broadcast_scatter_allgather,
    },
    "reduce_scatter": {
        "ring": reduce_scatter_ring,
        "recursive_halving": reduce_scatter_recursive_halving,
    },
}


def predict(collective: str, algorithm: str, nbytes: float, p: int,
            params: CostParams | None = None) -> float:
    """Predicted seconds for ``algorithm`` of ``collective`` on ``nbytes`` over ``p`` ranks.

    ``algorithm="mpi"`` (the MPI library's own) is predicted as the best of mpicomm's
    algorithms for the same collective: MPI libraries implement the same set and pick
    among them by size.
    """
    c = params or CostParams()
    table = FORMULAS.get(collective)
    if table is None:
        raise ValueError(f"no cost model for collective {collective!r}")
    if algorithm == "mpi":
        return min(f(nbytes, p, c) for f in table.values())
    if algorithm not in table:
        raise ValueError(f"no cost model for {collective} algorithm {algorithm!r}")
    return table[algorithm](nbytes, p, c)


def choose(collective: str, nbytes: float, p: int, params: CostParams | None = None) -> str:
    """The algorithm with the smallest predicted time (ties: the first listed)."""
    c = params or CostParams()
    table = FORMULAS[collective]
    return min(table, key=lambda name: table[name](nbytes, p, c))


class paper:  # noqa: N801 - a namespace, not a class of objects
    """Table I of Tyagi & Swany (IEEE BigData 2023), with ``log`` = log2 as in their code.

    ``M`` is the gradient size in bytes, ``c`` the fraction of entries kept, ``n`` the
    number of workers. Used to check the model against the paper's Table VI.
    """

    @staticmethod
    def allgather_topk(M: float, c: float, n: int, alpha: float, beta: float) -> float:
        return alpha * math.log2(n) + 2 * M * c * beta * (n - 1)

    @staticmethod
    def artopk_ring(M: float, c: float, n: int, alpha: float, beta: float) -> float:
        lg = math.log2(n)
        return alpha * (2 * (n - 1) + lg) + M * c * beta * (2 * (n - 1) / n + lg)

    @staticmethod
    def artopk_tree(M: float, c: float, n: int, alpha: float, beta: float) -> float:
        lg = math.log2(n)
        return 3 * alpha * lg + 3 * M * c * beta * lg
