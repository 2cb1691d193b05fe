"""Exact top-k sparsification."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..buffers import to_torch
from ..validate import check_int
from ._tensor import FiniteCheck, TensorMeta, flatten, restore, to_native, torch_dtype
from .base import Compressor, Payload
from .topk_select import index_dtype_for, topk_indices

__all__ = ["TopK", "SparseCtx", "k_for", "resolve_k", "check_density", "check_k",
           "sparse_decompress", "index_itemsize"]


def k_for(numel: int, density: float) -> int:
    """Elements kept at ``density``: ``max(1, ceil(density * numel))``.

    The one rule used everywhere in mpicomm (compressors, sparse collectives, cost
    model), so every layer agrees on k.
    """
    return max(1, math.ceil(density * numel))


def check_density(density: Any) -> float:
    """``density`` as a float in (0, 1], else ``ValueError``."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    if not 0.0 < float(density) <= 1.0:  # also rejects NaN
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def check_k(k: Any) -> int:
    """``k`` as an int >= 1, else ``ValueError``."""
    return check_int("k", k, 1)


def resolve_k(numel: int, density: Optional[float], k: Optional[int], name: str) -> int:
    """k for a tensor of ``numel`` elements; ``ValueError`` when k > numel."""
    kk = k if k is not None else k_for(numel, density)  # type: ignore[arg-type]
    if kk > numel:
        raise ValueError(f"tensor {name!r}: k={kk} exceeds its {numel} elements")
    return kk


def index_itemsize(numel: int) -> int:
    """Bytes per index on the wire (4 for int32, 8 for int64)."""
    return 4 if index_dtype_for(numel) == "int32" else 8


@dataclass(frozen=True)
class SparseCtx:
    """Local context of a (values, indices) payload."""

    meta: TensorMeta
    k: int


def sparse_decompress(values: Any, indices: Any, meta: TensorMeta) -> Any:
    """Dense tensor with ``values`` at flat ``indices`` and zeros elsewhere.

    Duplicate indices are summed (so gathered payloads of several ranks decompress to
    their sum).
    """
    v = to_torch(values).reshape(-1)
    i = to_torch(indices).reshape(-1).to(device=v.device, dtype=torch.int64)
    dense = torch.zeros(meta.numel, dtype=v.dtype, device=v.device)
    dense.index_add_(0, i, v)
    return restore(dense, meta)


class TopK(Compressor):
    """Keep the ``k`` entries of largest magnitude, ties broken by the smaller index.

    Formula: ``C(x) = x * 1[i in S]`` where ``S`` is the top-k of ``|x|`` under the total
    order (``|x|`` desc, index asc) of :func:`mpicomm.compress.topk_select.topk_indices`, so every
    rank and every framework picks the same set. Give exactly one of ``density``
    (``k = k_for(numel, density) = max(1, ceil(density * numel))``) or ``k``.

    Wire: ``{"values": k elements of the input dtype, "indices": k int32}`` (int64 when
    ``numel >= 2**31``), sorted by index: ``k * (itemsize + 4)`` bytes. Because each rank
    picks its own indices, payloads are **not** allreduce-compatible: aggregate them with
    an Allgather, gTop-k or AR-Top-k. Size depends only on numel (``fixed_size``).

    Cost: O(numel) selection (``torch.topk`` for the threshold, then a pass for ties)
    plus O(k log k) to sort the indices; an extra O(numel) finiteness check.

    Tuning: densities of 0.001-0.01 are typical with error feedback (which is required
    for convergence at such densities; see :class:`~mpicomm.compress.ErrorFeedback`).
    Decompressing a sparse payload is an ``index_add`` into zeros.

    Non-finite inputs raise ``ValueError`` naming the tensor, unless ``allow_nonfinite``
    is set, in which case NaN ranks with +inf above every finite magnitude and is sent.
    """

    name = "topk"
    allreduce_compatible = False
    fixed_size = True

    def __init__(self, density: Optional[float] = None, k: Optional[int] = None,
                 allow_nonfinite: bool = False) -> None:
        if (density is None) == (k is None):
            raise ValueError("give exactly one of density or k")
        self.density = check_density(density) if density is not None else None
        self.k = check_k(k) if k is not None else None
        self.allow_nonfinite = bool(allow_nonfinite)

    def k_for(self, numel: int) -> int:
        """k this compressor keeps of a tensor of ``numel`` elements."""
        return self.k if self.k is not None else k_for(numel, self.density)  # type: ignore

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        t, meta = flatten(x, name=name, step=step)
        k = resolve_k(meta.numel, self.density, self.k, name)
        finite = None
        if self.allow_nonfinite:
            key = torch.nan_to_num(t, nan=math.inf, posinf=math.inf, neginf=-math.inf)
        else:
            finite = FiniteCheck(t, name, "TopK")
            key = t
        idx = topk_indices(key, k)
        if finite is not None:
            finite.verify()  # its flag arrived with the selection's compaction
        values = t[idx]
        indices = idx.to(torch_dtype(index_dtype_for(meta.numel)))
        arrays = {"values": to_native(values, meta.framework),
                  "indices": to_native(indices, meta.framework)}
        return Payload(arrays, SparseCtx(meta, k))

    def decompress(self, payload: Payload) -> Any:
        return sparse_decompress(payload.arrays["values"], payload.arrays["indices"],
                                 payload.ctx.meta)

    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        k = min(self.k_for(numel), numel)
        return k * (itemsize + index_itemsize(numel))
