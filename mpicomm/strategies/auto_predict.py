r"""Predicted times of ``strategy="auto"``'s schemes on its fused buckets.

:class:`SchemePredictor` answers, for a bucket (its layers as ``segments``) and a ratio,
what each scheme would cost: the uniform schemes through the strategy that runs them
(:func:`~mpicomm.strategies.auto_schemes.build`, then
:meth:`~mpicomm.strategies.Strategy.predict_parts`), the L-GreCo QSGD/PowerSGD families'
per-layer scheme through :func:`~mpicomm.strategies.lgreco_buckets.predict_bucket` at the
settings in force. Every prediction is linear in the link parameters,
``a·alpha + b·beta + work + g·gamma``; :meth:`SchemePredictor.coefficients` keeps
``(a, b, work, g)`` per bucket, scheme, ratio and settings, so the online refinement can
re-predict every step without rebuilding anything. Pure arithmetic: the same on every
rank for the same (agreed) inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ..collectives.cost import ComputeParams, CostParams
from ..control.lgreco import LGreco
from ..topology import Topology
from .auto_choice import SchemeChoices
from .auto_schemes import Choice, build, select
from .base import fused_groups
from .lgreco_buckets import FAMILY_SCHEMES, Segment, predict_bucket
from .lgreco_errors import family_compressor

__all__ = ["SchemePredictor"]

_ALPHA = CostParams(alpha=1.0, beta=0.0, gamma=0.0)
_BETA = CostParams(alpha=0.0, beta=1.0, gamma=0.0)
_GAMMA_ONLY = CostParams(alpha=0.0, beta=0.0, gamma=1.0)


class SchemePredictor:
    """Predictions of ``schemes`` (the selector's candidates) on fused buckets.

    ``approximate`` as the selector's; ``lgreco``/``family`` where L-GreCo sets
    per-layer values (``family`` ``"qsgd"``/``"powersgd"``: the candidates are dense and
    that family's per-layer scheme); ``fusion_bytes`` the buckets' limit.
    """

    def __init__(self, schemes: Sequence[str], *, approximate: bool = True,
                 lgreco: Optional[LGreco] = None, family: Optional[str] = None,
                 fusion_bytes: int):
        self.schemes = tuple(schemes)
        self.approximate = approximate
        self.lgreco, self.family = lgreco, family
        self.fusion_bytes = fusion_bytes
        self._coeffs: dict[tuple[Any, ...], tuple[float, float, float, float]] = {}
        #: The ranks' host layout and the link inside a host (set by the auto strategy
        #: from its communicator): every prediction is priced on it.
        self.topology: Optional[Topology] = None
        self.local: Optional[CostParams] = None

    def layout(self, p: int) -> dict[str, Any]:
        """``topology``/``local`` keywords of the predictions for ``p`` ranks."""
        if self.topology is None or self.topology.size != p:
            return {}
        return {"topology": self.topology, "local": self.local}

    def values(self, segments: Sequence[Segment]) -> list[float]:
        """The L-GreCo settings in force of the layers of ``segments``."""
        assert self.lgreco is not None
        return [self.lgreco.value(layer) for layer, _, _ in segments]

    def parts(self, scheme: str, ratio: float, segments: Sequence[Segment], itemsize: int,
              p: int, params: CostParams, compute: ComputeParams) -> dict[str, float]:
        """``predict_parts`` of ``scheme`` on a bucket of ``segments`` (the per-layer
        family schemes at the layers' current L-GreCo settings)."""
        shapes = [shape for _, _, shape in segments]
        if self.family is not None and scheme == FAMILY_SCHEMES[self.family]:
            assert self.lgreco is not None
            return predict_bucket(self.family, shapes, self.values(segments), itemsize, p,
                                  params, compute, self.lgreco.bucket_size)
        sub = build(scheme, ratio, shapes, fusion_bytes=self.fusion_bytes)
        assert sub is not None, scheme
        return sub.predict_parts(shapes, itemsize, p, params, compute, **self.layout(p))

    def family_choice(self, segments: Sequence[Segment], itemsize: int, p: int,
                      params: CostParams, compute: ComputeParams,
                      scales: Mapping[str, float]) -> Choice:
        """Dense or the family's per-layer scheme at the current settings, the cheaper
        (ties: dense); ``ratio`` of the per-layer scheme = its wire bytes / dense bytes;
        ``scales[scheme]`` multiplies that scheme's modelled compute."""
        assert self.family is not None
        candidates = {}
        for scheme in self.schemes:
            parts = self.parts(scheme, 1.0, segments, itemsize, p, params, compute)
            candidates[scheme] = parts["comm"] + scales.get(scheme, 1.0) * parts["compute"]
        best = min(candidates, key=lambda s: (candidates[s], self.schemes.index(s)))
        return Choice(best, 1.0 if best == "dense" else self.family_ratio(segments),
                      candidates[best], candidates)

    def family_ratio(self, segments: Sequence[Segment]) -> float:
        """Wire bytes of the layers at their settings / their dense bytes (the L-GreCo
        DP's sizes: the compressors' ``wire_bytes``)."""
        lg = self.lgreco
        assert lg is not None
        wire = sum(family_compressor(lg, lg.value(layer)).wire_bytes(n, 4, shape=shape)
                   for layer, n, shape in segments)
        return min(1.0, wire / max(1, 4 * sum(n for _, n, _ in segments)))

    def coefficients(self, bucket: str, segments: Sequence[Segment], scheme: str,
                     ratio: float, itemsize: int, p: int, compute: ComputeParams
                     ) -> tuple[float, float, float, float]:
        """``scheme``'s prediction for ``bucket`` is linear in the link parameters:
        ``a·alpha + b·beta + work + g·gamma``; returns ``(a, b, work, g)``, computed once
        per (bucket, scheme, ratio, per-layer settings, compute kernels) and kept (three
        ``predict_parts`` calls otherwise, every step)."""
        settings = tuple(self.values(segments)) \
            if self.family is not None and scheme == FAMILY_SCHEMES[self.family] else ()
        key = (bucket, tuple(segments), scheme, ratio, settings, compute)
        cached = self._coeffs.get(key)
        if cached is None:
            parts = [self.parts(scheme, ratio, segments, itemsize, p, c, compute)
                     for c in (_ALPHA, _BETA, _GAMMA_ONLY)]
            cached = (parts[0]["comm"], parts[1]["comm"], parts[0]["compute"],
                      parts[2]["comm"])
            self._coeffs[key] = cached
        return cached

    def shapes(self, shapes: list[tuple[int, ...]], ratio: float, itemsize: int, p: int,
               params: CostParams, compute: ComputeParams) -> dict[str, float]:
        """``{"comm", "compute"}`` of tensors of ``shapes`` fused into buckets, each at the
        selector's cheapest scheme at ``ratio`` (the per-layer families: every layer at
        the uniform default)."""
        comm_s = work = 0.0
        for positions in fused_groups(shapes, itemsize, self.fusion_bytes):
            group = [shapes[i] for i in positions]
            if self.family is not None:
                segs = [(f"#{i}", math.prod(s), s) for i, s in enumerate(group)]
                choice = self.family_choice(segs, itemsize, p, params, compute, {})
                parts = self.parts(choice.scheme, choice.ratio, segs, itemsize, p, params,
                                   compute)
                comm_s, work = comm_s + parts["comm"], work + parts["compute"]
                continue
            choice = select(group, ratio, itemsize, p, params, compute,
                            schemes=self.schemes, approximate=self.approximate,
                            **self.layout(p))
            sub = build(choice.scheme, choice.ratio, group, fusion_bytes=self.fusion_bytes)
            assert sub is not None
            parts = sub.predict_parts(group, itemsize, p, params, compute, **self.layout(p))
            comm_s, work = comm_s + parts["comm"], work + parts["compute"]
        return {"comm": comm_s, "compute": work}

    def candidates(self, shapes: Sequence[tuple[int, ...]], ratio: float, itemsize: int,
                   p: int, params: CostParams, compute: ComputeParams, *,
                   schemes: Optional[Sequence[str]] = None,
                   scales: Optional[Mapping[str, float]] = None,
                   gains: Optional[Mapping[str, float]] = None,
                   min_gain: float = 0.0) -> Choice:
        """The selector's choice for one fused bucket of ``shapes`` at ``ratio``
        (:func:`~mpicomm.strategies.auto_schemes.select` among ``schemes``, default
        :attr:`schemes`, with the compute factors ``scales``, the measured ``gains``
        and ``min_gain``, on the ranks' layout): what the running choice and the CR
        controller's time objective both start from."""
        return select(shapes, ratio, itemsize, p, params, compute,
                      schemes=schemes or self.schemes, approximate=self.approximate,
                      fusion_bytes=self.fusion_bytes, compute_scale=scales, gains=gains,
                      min_gain=min_gain, **self.layout(p))

    def run_costs(self, layouts: Mapping[str, tuple[list[tuple[int, ...]], int]],
                  ratio: float, p: int, params: CostParams, compute: ComputeParams,
                  choices: SchemeChoices, **selector: Any) -> dict[str, tuple[str, float,
                                                                             float]]:
        """Per bucket of ``layouts`` (bucket -> (shapes, itemsize)): the scheme that
        would run at ``ratio`` and its exchange time and cost,
        :meth:`SchemeChoices.run_choice` on the selector's candidates (``selector``:
        :meth:`candidates`' keywords) with the efficiencies known
        so far, on the predicted times (``measured=False``): the one rule by which a
        scheme runs, applied to every ratio alike."""
        return {bucket: choices.run_choice(
                    (bucket, ratio),
                    self.candidates(shapes, ratio, itemsize, p, params, compute,
                                    **selector).candidates, measured=False)
                for bucket, (shapes, itemsize) in layouts.items()}
