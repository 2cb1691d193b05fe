"""Top-k by a sampled threshold (DGC-style), exact whenever enough entries pass it."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..buffers import to_torch
from ..validate import check_int
from ._rng import generator
from ._tensor import FiniteCheck, flatten, to_native, torch_dtype
from .base import Compressor, Payload
from .topk import SparseCtx, check_density, index_itemsize, k_for, resolve_k, sparse_decompress
from .topk_select import index_dtype_for, topk_among, topk_indices

__all__ = ["SampledTopK", "recall"]


def recall(x: Any, indices: Any, k: int) -> float:
    """Fraction of the exact top-``k`` of ``|x|`` (total order) found in ``indices``."""
    t = to_torch(x).detach().reshape(-1)
    exact = topk_indices(t, k)
    got = to_torch(indices).reshape(-1).to(device=exact.device, dtype=torch.int64)
    return float(torch.isin(exact, got).sum()) / float(k)


class SampledTopK(Compressor):
    """Approximate top-k: estimate the k-th magnitude on a random sample, keep what passes.

    Method (after Deep Gradient Compression's sampled threshold):

    1. draw ``s = max(min_sample, ceil(sample_fraction * numel))`` positions uniformly
       (with replacement) from a generator seeded by ``(seed, name, step)``;
    2. threshold ``t`` = the ``ceil(oversample * density * s)``-th largest sampled
       magnitude, aiming at about ``oversample * k`` survivors;
    3. candidates ``C = {i : |x_i| >= t}``. If ``|C| >= k`` the exact top-k of ``C``
       (total order |x| desc, index asc) is returned: it *is* the exact top-k of ``x``,
       because ``C`` is a top set containing at least k entries;
    4. if ``|C| < k``, up to ``refinements`` more passes redo 1-3 with a sample 4x larger
       and twice the oversampling; if still short, the ``|C| < k`` candidates are sent
       (they are the exact top-|C|).

    So the result has at most k entries, and is the exact top-m of ``x`` for some m <= k:
    recall against exact top-k is ``m / k``. Sizes vary (``fixed_size = False``); wire:
    ``m * (itemsize + 4)`` bytes, at most ``k * (itemsize + 4)`` (what :meth:`wire_bytes`
    reports). Not allreduce-compatible.

    Cost: a top-k over the sample (tiny), one O(numel) compare-and-count pass, and an
    exact top-k over ~``oversample * k`` candidates instead of over ``numel`` entries
    (about 6x faster than :class:`~mpicomm.compress.TopK` in a CPU measurement with 4M
    Student-t float32 elements at density 0.01; GPUs, where ``torch.topk`` with a large
    k is slow, should gain too).

    Tuning: ``sample_fraction`` 0.001-0.01 and ``oversample`` 1.25-2 suit densities of
    0.001-0.01; a larger ``oversample`` makes shortfalls rarer at the price of a larger
    candidate top-k. Deterministic for a given (seed, name, step, device type).
    """

    name = "sampled_topk"
    allreduce_compatible = False
    fixed_size = False

    def __init__(self, density: float, sample_fraction: float = 0.01, *,
                 min_sample: int = 1024, oversample: float = 1.25, refinements: int = 2,
                 seed: int = 0, allow_nonfinite: bool = False) -> None:
        self.density = check_density(density)
        if not isinstance(sample_fraction, (int, float)) or not 0 < sample_fraction <= 1:
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction!r}")
        min_sample = check_int("min_sample", min_sample, 1)
        if not isinstance(oversample, (int, float)) or not oversample >= 1:
            raise ValueError(f"oversample must be >= 1, got {oversample!r}")
        refinements = check_int("refinements", refinements, 0)
        self.sample_fraction = float(sample_fraction)
        self.min_sample = min_sample
        self.oversample = float(oversample)
        self.refinements = refinements
        self.seed = int(seed)
        self.allow_nonfinite = bool(allow_nonfinite)

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        t, meta = flatten(x, name=name, step=step)
        n = meta.numel
        k = resolve_k(n, self.density, None, name)
        finite = None
        if self.allow_nonfinite:
            key = torch.nan_to_num(t, nan=math.inf, posinf=math.inf, neginf=-math.inf)
        else:
            finite = FiniteCheck(t, name, "SampledTopK")
            key = t
        idx = self._select(key, k, name, step)
        if finite is not None:
            finite.verify()  # its flag arrived with the selection's compaction
        arrays = {
            "values": to_native(t[idx], meta.framework),
            "indices": to_native(idx.to(torch_dtype(index_dtype_for(n))), meta.framework),
        }
        return Payload(arrays, SparseCtx(meta, k))

    def _select(self, key: torch.Tensor, k: int, name: str, step: int) -> torch.Tensor:
        n = key.shape[0]
        sample = max(self.min_sample, math.ceil(self.sample_fraction * n))
        if sample >= n:
            return topk_indices(key, k)
        mag = key.abs()
        g = generator(self.seed, name, step, device=key.device)
        oversample = self.oversample
        cand = torch.empty(0, dtype=torch.int64, device=key.device)
        for _ in range(self.refinements + 1):
            s = min(sample, n)
            pos = torch.randint(n, (s,), generator=g, device=key.device)
            ks = min(s, max(1, math.ceil(oversample * k / n * s)))
            threshold = torch.topk(mag[pos], ks, sorted=False).values.min()
            cand = torch.nonzero(mag >= threshold).view(-1)
            if cand.shape[0] >= k:  # sorts only: no second host synchronization
                return topk_among(mag, cand, k)
            sample *= 4
            oversample *= 2
        return cand  # exact top-|cand|, fewer than k entries

    def decompress(self, payload: Payload) -> Any:
        return sparse_decompress(payload.arrays["values"], payload.arrays["indices"],
                                 payload.ctx.meta)

    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        """Upper bound ``k * (itemsize + index bytes)``; the actual size may be smaller."""
        k = min(k_for(numel, self.density), numel)
        return k * (itemsize + index_itemsize(numel))
