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
allgather Bruck                 ⌈lg p⌉α + (p-1)/p·nβ + (n + n/p)γ     (local rotation copies)
allgather recursive doubling    lg p2·α + (p-1)/p·nβ                     fold: 2α + (n/p + n)β
allgather direct                (p-1)α + (p-1)/p·nβ       (as ring; all messages posted at once)
broadcast binomial              ⌈lg p⌉(α + nβ)
broadcast scatter + allgather   (⌈lg p⌉ + p - 1)α + 2(p-1)/p·nβ
reduce-scatter ring             (p-1)α + (p-1)/p·n(β + γ)
reduce-scatter rec. halving     lg p2·α + (p2-1)/p2·n(β + γ)        fold: 2α + n(β + γ) + n/p·β
reduce-scatter direct           (p-1)α + (p-1)/p·n(β + γ)   (as ring; all messages posted at once)
Top-k via allgather (ring)      (p-1)α + (p-1)·k·s·β
gTop-k (butterfly)              lg p2·(α + k·s·β)                        fold: 2(α + k·s·β)
AR-Top-k (ring)                 bcast of k indices + ring allreduce of k values
AR-Top-k (tree)                 bcast of k indices + recursive-doubling allreduce of k values
PS push + pull (S servers)      2α + 2W(n/S)β + W(n/S)γ   (busiest server port; Table I: S=1)
==============================  ===============================================================

:func:`paper_predict` holds the coarser per-scheme formulas of Tyagi & Swany's Table I
(one entry per synchronization scheme rather than per algorithm), for comparisons with the
paper; the selector uses the per-algorithm formulas above.

Tuning: the defaults in :class:`CostParams` are rough figures for shared memory under
Python; measure them on the target machine before trusting ``algorithm="auto"`` there:
``mpicomm.collectives.calibrate.measure(comm, store=True)`` fits alpha/beta from a
ping-pong and gamma from a numpy add, and puts them where ``auto`` looks
(``python -m mpicomm.bench collectives`` prints the fit).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import Any

from ..validate import check_int

__all__ = ["CostParams", "ComputeParams", "predict", "choose", "FORMULAS", "calibrated",
           "ps_push_pull", "paper_predict", "PAPER_SCHEMES"]


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


@dataclass(frozen=True)
class ComputeParams:
    """Measured local compute rates the strategies' predictions add to alpha/beta/gamma.

    ``select``: seconds per element of a top-k selection over a buffer (O(d));
    ``merge``: seconds per (index, value) pair of one gTop-k merge-and-truncate round
    (a sort of <= 2k pairs); ``scatter``: seconds per element of densifying a sparse
    result (zero fill + scatter-add); ``flop``: seconds per multiply-add of a float32
    matmul (PowerSGD); ``copy``: seconds per byte of a local copy or add (error-feedback
    compensation, fusion, host staging). The defaults are rough single-core CPU figures;
    :func:`mpicomm.strategies.kernel_timing.measure_compute` measures them.
    """

    select: float = 4e-9
    merge: float = 1e-7
    scatter: float = 2e-9
    flop: float = 2e-10
    copy: float = 3e-10

    def __post_init__(self) -> None:
        for name in ("select", "merge", "scatter", "flop", "copy"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


def calibrated(comm: Any) -> tuple[CostParams, ComputeParams]:
    """The communicator's calibrated :class:`CostParams` and :class:`ComputeParams` (set by
    :func:`mpicomm.collectives.calibrate.measure` / :func:`mpicomm.strategies.kernel_timing.
    calibrate` under the keys :data:`mpicomm.comm.CALIBRATION_KEYS`, inherited by
    ``dup``/``split``), or the defaults where none was measured."""
    resources = getattr(comm, "resources", {}) if comm is not None else {}
    return (resources.get("cost_params") or CostParams(),
            resources.get("compute_params") or ComputeParams())


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
    """Bruck works in a rotated scratch buffer: it copies its own block in and the whole
    result back out (n + n/p bytes, charged at the local memory rate gamma). Without that
    term the model would prefer Bruck over ring for every large message from p = 4 on,
    where it is measured 2-3x slower."""
    if p == 1:
        return 0.0
    copies = (n + n / p) * c.gamma
    return math.ceil(_lg(p)) * c.alpha + (p - 1) / p * n * c.beta + copies


def allgather_direct(n: float, p: int, c: CostParams) -> float:
    """Every rank sends its n/p bytes to the p-1 others, all at once. Under the model's
    one-port assumption that serializes exactly like the ring (ties go to the ring); what
    it saves, the ring's chain of dependent steps, shows on a busy or oversubscribed
    node, not in alpha and beta."""
    return allgather_ring(n, p, c)


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


def reduce_scatter_direct(n: float, p: int, c: CostParams) -> float:
    """Each block goes straight to its owner: one-port, the same as the ring (see
    :func:`allgather_direct`)."""
    return reduce_scatter_ring(n, p, c)


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
    """AR-Top-k "tree": binomial broadcast of k indices + recursive-doubling allreduce of
    k values, which is how :func:`mpicomm.sparse.artopk` realises the paper's Tree-AR
    (the paper's binomial reduce + broadcast, 2 lg p rounds, is
    ``paper_predict("artopk_tree", ...)``)."""
    return (broadcast_binomial(k * index_bytes, p, c)
            + allreduce_recursive_doubling(k * value_bytes, p, c))


def ps_push_pull(n: float, workers: int, servers: int, c: CostParams) -> float:
    """One synchronous parameter-server step: every worker pushes ``n`` bytes and pulls
    ``n`` bytes, each key split evenly over ``servers``.

    The bottleneck is a server's port, which receives ``W`` pieces of ``n/S`` bytes and
    sends as many back, and sums the ``W`` pushed pieces:
    ``2 alpha + 2 W (n/S) beta + W (n/S) gamma``. The latency counts once each way (the
    ``W`` messages are in flight together), as in Table I of Tyagi & Swany (their
    ``2 alpha + 2 (N-1) M beta`` with one server and ``N - 1 = W`` workers; their table
    has no gamma). Compare :func:`allreduce_ring` over the ``W`` workers, whose bandwidth
    term ``2 (W-1)/W n beta`` does not grow with ``W``: with ``S = 1`` a PS moves about
    ``W`` times more bytes through its busiest port; with ``S = W`` servers of their own
    bandwidth it matches the ring's term with a constant latency.
    """
    if workers < 1 or servers < 1:
        raise ValueError(f"need workers >= 1 and servers >= 1, got {workers}, {servers}")
    per_port = workers * n / servers
    return 2 * c.alpha + 2 * per_port * c.beta + per_port * c.gamma


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
        "direct": allgather_direct,
    },
    "allgatherv": {"ring": allgather_ring, "direct": allgather_direct},
    "broadcast": {
        "binomial": broadcast_binomial,
        "scatter_allgather": broadcast_scatter_allgather,
    },
    "reduce_scatter": {
        "ring": reduce_scatter_ring,
        "recursive_halving": reduce_scatter_recursive_halving,
        "direct": reduce_scatter_direct,
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
    table = FORMULAS.get(collective)
    if table is None:
        raise ValueError(f"no cost model for collective {collective!r}")
    return min(table, key=lambda name: table[name](nbytes, p, c))


# ---------------------------------------------------------------------- the paper's table
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
