r"""The schemes ``auto`` chooses among, and the selector: per bucket and ratio, the cheapest.

For a bucket (tensor shapes, dtype size) and a CR ``c`` (fraction kept), every
candidate scheme is built as the strategy that would run it and asked for its predicted
time through the one prediction API, :meth:`mpicomm.strategies.Strategy.predict`
(calibrated alpha-beta-gamma of the communicator *plus* the measured compute: selection,
gTop-k merges, densify, PowerSGD matmuls, copies). The cheapest scheme that meets the
accuracy constraints wins; ties go to the order of :data:`SCHEMES`.

==============  ================================================  =====================
scheme          strategy                                          at ratio c
==============  ================================================  =====================
dense           :class:`~mpicomm.strategies.Dense`                (c ignored; c = 1)
allgather_topk  :class:`~mpicomm.strategies.TopKAllgather`        density c
gtopk           :class:`~mpicomm.strategies.GTopK`                density c
artopk_ring     :class:`~mpicomm.strategies.ARTopK` (ring)        density c
artopk_tree     :class:`~mpicomm.strategies.ARTopK` (tree)        density c
powersgd        :class:`~mpicomm.strategies.PowerSGDAllreduce`    rank r: the largest whose
                                                                  factors fit in c of the
                                                                  bucket's matrix bytes
hier_topk       :class:`~mpicomm.strategies.HierarchicalTopK`     density c
hier_gtopk      :class:`~mpicomm.strategies.HierarchicalGTopK`    density c
hier_artopk     :class:`~mpicomm.strategies.HierarchicalARTopK`   density c
*_sliced        the same with ``sliced=True`` (one lane per       density c
                local rank)
==============  ================================================  =====================

The hierarchical schemes are candidates only on a layout of several hosts of which one
has several ranks (``topology``, :attr:`mpicomm.topology.Topology.hierarchical`); there
every scheme is priced with two link classes (``local``, the link inside a host, and
``params``, the network), and ``dense`` weighs the hierarchical allreduce too.

Accuracy constraints: ``approximate=False`` excludes gTop-k and the hierarchical gTop-k
(their result is not the exact top-k of the sum); ``min_gain`` excludes a scheme whose
measured compression gain (EWMA, from the auto strategy) is below it; PowerSGD needs at
least one matrix the rank compresses, and ``c`` >= the smallest rank-1 fraction.
``c = 1`` means dense. Inputs that are identical on every rank give the identical choice
everywhere (pure arithmetic on agreed numbers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..collectives.cost import ComputeParams, CostParams
from ..compress.powersgd import matrix_shape
from ..topology import Topology
from .artopk import ARTopK
from .base import Strategy
from .dense import Dense
from .gtopk import GTopK
from .hierarchical import HierarchicalARTopK, HierarchicalGTopK, HierarchicalTopK
from .powersgd import PowerSGDAllreduce
from .topk import TopKAllgather

__all__ = ["SCHEMES", "HIERARCHICAL_SCHEMES", "Choice", "Record", "build", "powersgd_rank",
           "select"]

#: The hierarchical schemes (candidates on a hierarchical layout only).
HIERARCHICAL_SCHEMES: tuple[str, ...] = ("hier_topk", "hier_gtopk", "hier_artopk",
                                         "hier_topk_sliced", "hier_gtopk_sliced",
                                         "hier_artopk_sliced")
SCHEMES: tuple[str, ...] = ("dense", "allgather_topk", "gtopk", "artopk_ring", "artopk_tree",
                            "powersgd", *HIERARCHICAL_SCHEMES)
_HIERARCHICAL = {"hier_topk": HierarchicalTopK, "hier_gtopk": HierarchicalGTopK,
                 "hier_artopk": HierarchicalARTopK}


@dataclass(frozen=True)
class Choice:
    """The selector's answer for one bucket: ``scheme`` and every candidate's prediction."""

    scheme: str
    ratio: float
    predicted: float
    candidates: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Record:
    """Predicted against measured time of one bucket's aggregation (agreed: the mean
    over ranks), for logs, traces and metrics
    (:attr:`mpicomm.strategies.AutoStrategy.records`)."""

    step: int
    bucket: str
    scheme: str
    ratio: float
    predicted: float
    measured: float
    alpha: float
    beta: float


def powersgd_rank(shapes: Sequence[tuple[int, ...]], ratio: float) -> Optional[int]:
    """The largest rank whose factors take at most ``ratio`` of the bytes of the bucket's
    matrices (``r·Σ(n+m) <= ratio·Σ n·m``), or ``None`` when not even rank 1 fits or the
    bucket holds no matrix."""
    nm = nplusm = 0
    for shape in shapes:
        if len(shape) >= 2:
            n, m = matrix_shape(tuple(shape))
            nm, nplusm = nm + n * m, nplusm + n + m
    if not nplusm:
        return None
    r = math.floor(ratio * nm / nplusm)
    return r if r >= 1 else None


def build(scheme: str, ratio: float, shapes: Sequence[tuple[int, ...]] = (), *,
          comm: Any = None, fusion_bytes: Optional[int] = None) -> Optional[Strategy]:
    """The strategy running ``scheme`` at ``ratio`` (``None``: not applicable here)."""
    extra: dict[str, Any] = {"comm": comm}
    if fusion_bytes is not None:
        extra["fusion_bytes"] = fusion_bytes
    if scheme == "dense":
        return Dense(**extra)
    if scheme in ("allgather_topk", "gtopk", "artopk_ring", "artopk_tree"):
        # plain error feedback: the auto strategy keeps the optimizer as it is
        extra["momentum_correction"] = 0.0
    if scheme == "allgather_topk":
        return TopKAllgather(density=ratio, **extra)
    if scheme == "gtopk":
        return GTopK(density=ratio, **extra)
    if scheme in ("artopk_ring", "artopk_tree"):
        return ARTopK(density=ratio, algorithm=scheme.split("_")[1], **extra)
    if scheme in HIERARCHICAL_SCHEMES:
        base = scheme.removesuffix("_sliced")
        return _HIERARCHICAL[base](density=ratio, sliced=base != scheme, **extra)
    if scheme == "powersgd":
        r = powersgd_rank(shapes, ratio)
        if r is None:
            return None
        s = PowerSGDAllreduce(rank=r, **extra)
        if not any(s.compressor.should_compress(tuple(x)) for x in shapes):
            return None
        return s
    raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")


def select(shapes: Sequence[tuple[int, ...]], ratio: float, itemsize: int, p: int,
           params: CostParams, compute: ComputeParams, *,
           schemes: Sequence[str] = SCHEMES, approximate: bool = True,
           gains: Optional[Mapping[str, float]] = None, min_gain: float = 0.0,
           fusion_bytes: Optional[int] = None,
           compute_scale: Optional[Mapping[str, float]] = None,
           topology: Optional[Topology] = None,
           local: Optional[CostParams] = None) -> Choice:
    """The cheapest admissible scheme for one fused bucket of ``shapes`` at ``ratio``.

    ``compute_scale[scheme]`` multiplies that scheme's modelled compute (the online
    calibration's fitted factor, :meth:`mpicomm.control.OnlineCalibration.compute_scale`).
    ``topology`` (of the ``p`` ranks) and ``local`` (the link inside a host): price on
    the host layout and admit the hierarchical schemes where it is hierarchical; without
    a topology, one host per rank.
    Cost: one :meth:`~mpicomm.strategies.Strategy.predict_parts` per candidate scheme
    (microseconds; no communication).
    """
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or not schemes:
        raise ValueError(f"schemes must be a non-empty subset of {SCHEMES}, got {schemes}")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    shapes = [tuple(s) for s in shapes]
    total = sum(math.prod(s) for s in shapes)
    size = max(total * itemsize, 1)
    candidates: dict[str, float] = {}
    if topology is None:
        topology = Topology(tuple(range(p)))
    layered = topology.hierarchical
    for scheme in schemes:
        if scheme != "dense" and ratio >= 1.0:
            continue
        if "gtopk" in scheme and not approximate:
            continue
        if scheme in HIERARCHICAL_SCHEMES and not layered:
            continue
        if gains and scheme in gains and gains[scheme] < min_gain:
            continue
        strategy = build(scheme, ratio, shapes,
                         fusion_bytes=fusion_bytes if fusion_bytes else 2 * size)
        if strategy is None:
            continue
        parts = strategy.predict_parts(shapes, itemsize, p, params, compute,
                                       topology=topology, local=local)
        kappa = (compute_scale or {}).get(scheme, 1.0)
        candidates[scheme] = parts["comm"] + kappa * parts["compute"]
    if not candidates:  # nothing compressed is admissible: dense always is
        candidates["dense"] = build("dense", 1.0, fusion_bytes=2 * size).predict(  # type: ignore
            shapes, itemsize, p, params, compute, topology=topology, local=local)
    best = min(candidates, key=lambda s: (candidates[s], SCHEMES.index(s)))
    return Choice(best, 1.0 if best == "dense" else ratio, candidates[best], candidates)
