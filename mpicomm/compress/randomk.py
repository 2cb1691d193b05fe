"""Random-k sparsification with indices shared by all ranks (allreduce-compatible)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..buffers import to_torch
from ._rng import generator
from ._tensor import TensorMeta, flatten, restore, to_native
from .base import Compressor, Payload
from .topk import check_density, check_k, k_for, resolve_k

__all__ = ["RandomK", "RandomKCtx", "random_indices"]


def random_indices(numel: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``k`` distinct indices drawn uniformly from ``range(numel)``, sorted (int64, CPU).

    For ``k > numel / 8`` a permutation prefix; otherwise the first ``k`` distinct
    values of an i.i.d. uniform stream (cost O(k log k), independent of ``numel``).
    Both give a uniformly random k-subset.
    """
    if k >= numel:
        return torch.arange(numel, dtype=torch.int64)
    if 8 * k > numel:
        return torch.sort(torch.randperm(numel, generator=g)[:k]).values
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.shape[0] < k:
        need = k - chosen.shape[0]
        draw = torch.randint(numel, (need + need // 8 + 16,), generator=g)
        stream = torch.cat([chosen, draw])
        # keep first occurrences in stream order (chosen ones come first and stay)
        uniq, inverse = torch.unique(stream, return_inverse=True)
        first = torch.full((uniq.shape[0],), stream.shape[0], dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(stream.shape[0]), reduce="amin")
        order = torch.sort(first).values
        chosen = stream[order[:k]]
    return torch.sort(chosen).values


@dataclass(frozen=True)
class RandomKCtx:
    """Local context: the tensor's metadata and the (rank-independent) indices."""

    meta: TensorMeta
    indices: torch.Tensor
    k: int


class RandomK(Compressor):
    """Send ``k`` entries at positions drawn from a stream seeded by (seed, name, step).

    Formula: ``C(x) = x * 1[i in S]`` with ``S`` a uniformly random k-subset, the same on
    every rank for the same ``(seed, name, step)`` (drawn on the CPU, so also the same
    for CPU and CUDA ranks). By default the values are **not** rescaled: ``C`` is
    biased (it keeps a fraction k/d of ``x`` in expectation) and is meant to be used with
    error feedback. ``rescale=True`` multiplies the values by ``numel / k``, making
    ``C`` unbiased (``E[C(x)] = x``) at the price of a variance ``(d/k - 1) * |x|^2``;
    use it without error feedback.

    Wire: ``{"values": k elements of the input dtype}`` = ``k * itemsize`` bytes. The
    indices are *not* sent: every rank regenerates them (they are kept in ``ctx`` and
    available from :meth:`indices`). Because all ranks share them, summing the
    ``values`` arrays of all ranks and decompressing gives the sum of the decompressed
    tensors: allreduce-compatible, fixed size.

    Cost: O(k log k) to draw and sort the indices plus a gather of k values.

    Tuning: random-k keeps far less gradient mass than top-k at equal k; prefer it when an
    Allreduce of ``k`` values is much cheaper than an Allgather of top-k pairs (many
    ranks), and use densities around 0.01-0.1 with error feedback.
    """

    name = "randomk"
    allreduce_compatible = True
    fixed_size = True

    def __init__(self, density: Optional[float] = None, k: Optional[int] = None, *,
                 seed: int = 0, rescale: bool = False) -> None:
        if (density is None) == (k is None):
            raise ValueError("give exactly one of density or k")
        self.density = check_density(density) if density is not None else None
        self.k = check_k(k) if k is not None else None
        self.seed = int(seed)
        self.rescale = bool(rescale)

    def k_for(self, numel: int) -> int:
        """k this compressor keeps of a tensor of ``numel`` elements."""
        return self.k if self.k is not None else k_for(numel, self.density)  # type: ignore

    def indices(self, numel: int, *, name: str = "", step: int = 0) -> torch.Tensor:
        """The sorted int64 CPU indices used for ``(name, step)``; equal on all ranks."""
        k = resolve_k(numel, self.density, self.k, name)
        return random_indices(numel, k, generator(self.seed, name, step))

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        t, meta = flatten(x, name=name, step=step)
        idx = self.indices(meta.numel, name=name, step=step).to(t.device)
        values = t[idx]
        if self.rescale:
            values = values * (meta.numel / idx.shape[0])
        return Payload({"values": to_native(values, meta.framework)},
                       RandomKCtx(meta, idx, int(idx.shape[0])))

    def decompress(self, payload: Payload) -> Any:
        ctx: RandomKCtx = payload.ctx
        v = to_torch(payload.arrays["values"]).reshape(-1)
        dense = torch.zeros(ctx.meta.numel, dtype=v.dtype, device=v.device)
        dense[ctx.indices.to(v.device)] = v
        return restore(dense, ctx.meta)

    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        return min(self.k_for(numel), numel) * itemsize

