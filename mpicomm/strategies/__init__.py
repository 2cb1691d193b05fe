"""Gradient aggregation strategies: error feedback + compressor + collective.

Every strategy implements ``aggregate(tensors, names=None) -> tensors`` (see
:class:`~mpicomm.strategies.base.Strategy`): every rank passes its local gradients and
gets back their average over ranks (or the strategy's compressed estimate of it), same
shapes, dtypes, framework and devices, identical on every rank. :func:`make` builds one
by name, for command lines and configuration files.

===========  =========================  ==================================================
name         class                      per fused buffer (d elements, k kept, s pair bytes)
===========  =========================  ==================================================
dense        :class:`Dense`             allreduce (avg); ≈ 2(P-1)/P·d·itemsize bytes
topk         :class:`TopKAllgather`     EF + top-k + sparse allgather; (P-1)·k·s bytes
gtopk        :class:`GTopK`             EF + top-k + butterfly gTop-k; lg p2·k·s (+fold)
artopk       :class:`ARTopK`            EF + source's top-k indices (bcast) + allreduce
                                        of k values; ≈ children·4k + 2(P-1)/P·k·itemsize
randomk      :class:`RandomKAllreduce`  EF + shared random indices + allreduce of k
                                        values; ≈ 2(P-1)/P·k·itemsize
qsgd         :class:`QSGDAllgather`     QSGD (salt = rank) + allgather of packed
                                        payloads; (P-1)·payload bytes
powersgd     :class:`PowerSGDAllreduce` EF + rank-r factors per matrix: one allreduce of
                                        all P, one of all Q, one dense for the rest
fp16, bf16   :class:`FP16Allreduce`,    cast (after / P), allreduce, cast back;
             :class:`BF16Allreduce`     ≈ 2(P-1)/P·2d bytes
sign         :class:`SignAllgather`     EF + scaled sign per tensor + allgather;
                                        (P-1)·Σ(ceil(d_t/8) + 4) bytes
hier_topk    :class:`HierarchicalTopK`  EF + dense sum inside each host + top-k, then
                                        Allgather Top-k across hosts only (``sliced``:
                                        one lane per local rank); H sets on the network
hier_gtopk   (its subclasses)           the same with gTop-k across hosts
                                        (:class:`HierarchicalGTopK`)
hier_artopk                             the same with AR-Top-k across hosts
                                        (:class:`HierarchicalARTopK`)
auto         :class:`AutoStrategy`      per bucket the cheapest of dense / Allgather
                                        Top-k / gTop-k / AR-Top-k / PowerSGD at an
                                        adaptive ratio, driving the controllers of
                                        :mod:`mpicomm.control` (options:
                                        :class:`AutoConfig`)
===========  =========================  ==================================================

Exact per-rank byte formulas, cost-model entries and tuning advice are in each class's
docstring; ``strategy.stats`` reports the bytes actually moved (from the communicator's
traffic counters) and ``describe()`` / ``state_dict()`` the settings and the state
(residuals, counters, warm starts) to log and checkpoint.

``auto`` runs the pure controllers of :mod:`mpicomm.control` and is split by job:
:mod:`.auto` (the strategy: aggregate, ``step_done``), :mod:`.auto_config` (its
options), :mod:`.auto_schemes` (the schemes and the selector), :mod:`.auto_predict`
(their predicted times per bucket), :mod:`.auto_choice` (kept choices, trials, gains),
:mod:`.auto_ratio` (the ratio in force and the CR controller's inputs),
:mod:`.auto_exchange` (one bucket through its scheme), :mod:`.auto_agree` (agreeing on a
step's measurements), :mod:`.lgreco_buckets` and :mod:`.lgreco_errors` (L-GreCo's
per-layer exchanges and measurements), :mod:`.kernel_timing` (the start-up calibration:
links and compute kernels).
"""

from __future__ import annotations

from typing import Any

from ..control.schedules import BudgetRamp
from .artopk import ARTopK
from .auto import AutoStrategy
from .auto_config import AutoConfig
from .base import Strategy, StrategyStats
from .cast import BF16Allreduce, FP16Allreduce
from .dense import Dense
from .gtopk import GTopK
from .hierarchical import HierarchicalARTopK, HierarchicalGTopK, HierarchicalTopK
from .powersgd import PowerSGDAllreduce
from .qsgd import QSGDAllgather
from .randomk import RandomKAllreduce
from .sign import SignAllgather
from .topk import TopKAllgather

__all__ = [
    "Strategy",
    "StrategyStats",
    "Dense",
    "TopKAllgather",
    "GTopK",
    "ARTopK",
    "RandomKAllreduce",
    "QSGDAllgather",
    "PowerSGDAllreduce",
    "FP16Allreduce",
    "BF16Allreduce",
    "SignAllgather",
    "HierarchicalTopK",
    "HierarchicalGTopK",
    "HierarchicalARTopK",
    "AutoStrategy",
    "AutoConfig",
    "make",
    "available",
    "RECIPES",
    "LOW_DENSITY_RECIPES",
    "recipe",
]

_BY_NAME: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (Dense, TopKAllgather, GTopK, ARTopK, RandomKAllreduce, QSGDAllgather,
                PowerSGDAllreduce, FP16Allreduce, BF16Allreduce, SignAllgather,
                HierarchicalTopK, HierarchicalGTopK, HierarchicalARTopK, AutoStrategy)
}


#: What :func:`make` adds to a name's constructor defaults: the default recipe measured
#: for that name (docs/compression.md, "The sparsifiers' default"), with the changes of
#: :data:`LOW_DENSITY_RECIPES` below their density; a keyword given to :func:`make` wins
#: over it, and the classes themselves keep their plain defaults.
#: Top-k: its pairs in the log8 wire format (``coding="log8"``, one byte a value and
#: varint index gaps, :mod:`mpicomm.sparse.coding`: about 2.3 bytes a pair at density
#: 0.01 against 8) and plain error feedback with the optimizer's momentum
#: (``momentum_correction=0``); on MNIST-1D's CNN (2 028 steps, 3 seeds, medians) at
#: density 0.01 -0.01 points at 46.2x fewer bytes on 8 ranks and +0.07 at 23.1x on 16
#: with the same global batch.
#: gTop-k: plain error feedback with the optimizer's momentum (``momentum_correction=0``),
#: a geometric density ramp from 0.03 down to its density spending 7.48 density-steps
#: (:class:`~mpicomm.control.BudgetRamp`: 411 steps at density 0.01, none from 0.03 on),
#: and the exact mean at the butterfly's indices with the butterfly's pairs in the log8
#: wire format (``exact_values=True``, ``coding="log8"``: about half the plain
#: butterfly's bytes, the exact values included); on MNIST-1D's CNN (2 028 steps, 3
#: seeds, medians) at density 0.01 +0.05 points at 44.3x fewer bytes on 8 ranks and
#: -0.21 at 39.6x on 16 with the same global batch (the plain butterfly's values:
#: -0.04 at 25.0x and -0.17 at 20.1x, and -1.11 on digits).
#: AR-Top-k: plain error feedback with the optimizer's momentum (``momentum_correction=0``),
#: a geometric density ramp from 0.1 spending 23.47 density-steps (1 092 steps at
#: density 0.001, 600 at 0.01), about 35 dense allreduces' bytes (3/2 of one per unit of
#: density, flat in P), and the source with the largest error-fed buffer
#: (``source="largest"``); on MNIST-1D's CNN (3 seeds, medians) at 8 ranks +0.03 points
#: at 55.0x fewer bytes (0.001) and +0.11 at 35.7x (0.01); at 16 ranks with the same
#: global batch -0.44 at 54.8x (0.001) and -0.14 at 35.6x (0.01).
RECIPES: dict[str, dict[str, Any]] = {
    "topk": {"coding": "log8", "momentum_correction": 0.0},
    "gtopk": {"schedule": BudgetRamp(0.03, 7.48), "momentum_correction": 0.0,
              "exact_values": True, "coding": "log8"},
    "artopk": {"schedule": BudgetRamp(0.1, 23.47), "momentum_correction": 0.0,
               "source": "largest"},
}

#: ``{name: (below, changes)}``: what a name's recipe changes for a ``density`` under
#: ``below`` (a strategy built from ``k`` alone takes the recipe of the default density,
#: 0.01).
#: Top-k under density 0.003: the class's plain pairs and its momentum correction taken
#: over from the optimizer (``coding=None``, ``momentum_correction="optimizer"``); on
#: MNIST-1D's CNN at density 0.001 -0.49 points at 125x fewer bytes on 8 ranks and
#: -0.20 at 62.3x on 16, where the coding lost 0.76 points (8 ranks, seed 0) and 1.69
#: and 1.31 (16 ranks, seeds 0 and 1) with the momentum correction.
#: gTop-k under density 0.003: plain pairs (``coding=None``), still with the exact values,
#: and a ramp shortened to 6.2 density-steps (727 steps at density 0.001); on MNIST-1D's
#: CNN at density 0.001 (2 028 steps, 3 seeds, medians) +0.00 points at 60.9x fewer
#: bytes on 8 ranks and -0.06 at 51.2x on 16, where the butterfly's own values gave
#: -0.22 at 68.4x and -0.69 at 54.9x. The coding was measured at density 0.01 only.
LOW_DENSITY_RECIPES: dict[str, tuple[float, dict[str, Any]]] = {
    "topk": (0.003, {"coding": None, "momentum_correction": "optimizer"}),
    "gtopk": (0.003, {"schedule": BudgetRamp(0.03, 6.2), "coding": None}),
}


def recipe(name: str, density: Any = None) -> dict[str, Any]:
    """The keywords :func:`make` adds for ``name`` at ``density`` (:data:`RECIPES`, with
    :data:`LOW_DENSITY_RECIPES`'s changes where ``density`` is a number below their
    bound); empty for a name without a recipe."""
    out = dict(RECIPES.get(name, {}))
    below, changes = LOW_DENSITY_RECIPES.get(name, (0.0, {}))
    if isinstance(density, (int, float)) and not isinstance(density, bool) \
            and density < below:
        out.update(changes)
    return out


def available() -> tuple[str, ...]:
    """Names accepted by :func:`make`."""
    return tuple(sorted(_BY_NAME))


def make(name: str, **kwargs: Any) -> Strategy:
    """Build the strategy called ``name`` with keyword arguments for its constructor, on
    top of the name's default recipe at the given density (:func:`recipe`;
    ``schedule=None`` turns gTop-k's and AR-Top-k's ramps off)."""
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(available())}")
    return cls(**{**recipe(name, kwargs.get("density")), **kwargs})
