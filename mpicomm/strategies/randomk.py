"""Random-k with shared indices: an allreduce of k values, no indices on the wire."""

from __future__ import annotations

from typing import Any

import torch

from ..collectives import allreduce, cost
from ..compress import RandomK
from ..validate import check_int
from ._compressed import CompressedStrategy, check_allreduce_algorithm, k_of, sparsity
from .base import DEFAULT_FUSION_BYTES

__all__ = ["RandomKAllreduce"]


class RandomKAllreduce(CompressedStrategy):
    r"""Error-fed random-k sparsification reduced by an allreduce ("randomk").

    Per fused buffer ``g`` of ``d`` elements on rank r, at the buffer's t-th aggregation::

        c_r = g_r + e_r                       # error feedback (e_r = 0 without it)
        I   = RandomK indices of (seed, buffer name, t): a uniform k-subset, drawn on the
              CPU from a private stream, identical on every rank (never sent)
        u   = zeros(d);  u[I] = (1/P) Σ_r c_r[I]     # allreduce (avg) of k values
        e_r = c_r with I zeroed

    Mass is conserved exactly: ``Σ_r c_r = P·u + Σ_r e_r``. The values are not rescaled
    (biased, for use with error feedback). ``k = max(1, ceil(density·d))`` (or the given
    ``k``), capped at ``d``; neither given means ``density=0.01``. With ``density=1`` it
    is the exact mean.

    Bytes sent per rank: one allreduce of k values of the input dtype; with the default
    ``algorithm="ring"`` rank r sends ``(2k - |B_{r+1}| - |B_{r+2}|)·itemsize`` (B_j the
    j-th, mod P, of P near-equal blocks of k), ≈ 2(P-1)/P·k·itemsize.

    ``schedule`` (a density warm-up, :mod:`mpicomm.control.schedules`),
    ``momentum_correction`` / ``momentum_masking`` (DGC's momentum correction in the
    error-feedback memory: then use an optimizer without momentum) and ``clip_norm``
    (local clipping at ``clip_norm / sqrt(P)``): see
    :class:`~mpicomm.strategies._compressed.CompressedStrategy`.

    Cost model: :func:`mpicomm.collectives.cost.allreduce_ring` ``(k·itemsize, P)`` =
    2(P-1)α + 2(P-1)/P·k·itemsize·β (:meth:`predict`; other algorithms via
    :func:`mpicomm.collectives.cost.predict`), plus O(k log k) to draw the indices.

    Tuning: the cheapest sparse exchange in bytes (values only, bandwidth flat in P),
    but random-k keeps far less gradient mass than top-k at equal k: use densities of
    0.01-0.1, always with error feedback. Each coordinate is sent about once every
    ``1/density`` steps and then carries everything accumulated since, so with momentum
    the effective step on it is about ``lr / density`` times larger: at density 0.01 with
    SGD momentum 0.9 the digits MLP of ``examples/train.py`` (lr 0.05) oscillates and can
    diverge, while density 0.1, or a 10x smaller lr, trains. ``algorithm="auto"`` lets
    the cost model pick recursive doubling for tiny k.
    """

    name = "randomk"

    def __init__(self, density: float | None = None, k: int | None = None, *,
                 seed: int = 0, error_feedback: bool = True, algorithm: str = "ring",
                 comm: Any = None, fusion_bytes: int = DEFAULT_FUSION_BYTES,
                 schedule: Any = None, momentum_correction: float = 0.0,
                 momentum_masking: bool = True, clip_norm: float | None = None,):
        self.density, self.k = sparsity(density, k)
        seed = check_int("seed", seed)
        self.seed = seed
        self.algorithm = check_allreduce_algorithm(algorithm)
        super().__init__(comm, error_feedback=error_feedback, fusion_bytes=fusion_bytes,
                         schedule=schedule,
                         momentum_correction=momentum_correction,
                         momentum_masking=momentum_masking, clip_norm=clip_norm)

    def indices(self, name: str, numel: int, step: int) -> torch.Tensor:
        """The (CPU, int64, sorted) indices used for buffer ``name`` at its ``step``."""
        k = self._k(numel, step, self.density, self.k)
        return RandomK(k=k, seed=self.seed).indices(numel, name=name, step=step)

    def aggregate_flat(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        step = self._step(name)
        numel = flat.shape[0]
        c = self._compensate(name, flat)
        k = self._k(numel, step, self.density, self.k)
        payload = RandomK(k=k, seed=self.seed).compress(
            c, name=name, step=step)
        idx = payload.ctx.indices.to(flat.device)
        mean = allreduce(payload.arrays["values"], op="avg", algorithm=self.algorithm,
                         comm=self.comm)
        if self.memory is not None:
            self.memory.update_sparse(name, c, idx)
        self.stats.extra.setdefault("k", {})[name] = int(idx.shape[0])
        out = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
        out[idx] = mean
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "density": self.density, "k": self.k,
                "seed": self.seed, "compressor": "randomk",
                "collective": f"allreduce({self.algorithm})"}

    def _predict_flat(self, numel: int, itemsize: int, p: int, params: cost.CostParams,
                      compute: cost.ComputeParams) -> tuple[float, float]:
        """Allreduce of k values; compute: compensation, index draw, densify."""
        k = k_of(numel, self.density, self.k)
        algorithm = "mpi" if self.algorithm == "auto" else self.algorithm
        work = (self._feedback_seconds(numel, itemsize, compute) + k * compute.merge / 8
                + numel * compute.scatter)
        return cost.predict("allreduce", algorithm, k * itemsize, p, params), work
