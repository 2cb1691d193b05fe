"""Deterministic top-k selection, shared by the compressors and the sparse collectives.

Every top-k in mpicomm uses one total order: larger ``|value|`` first, and among equal
magnitudes the smaller index first. With it, all ranks and the reference simulators
select the same set bit for bit, whatever the framework or device (``torch.topk`` and
``numpy.argpartition`` alone break ties arbitrarily).

Method: find the k-th largest magnitude ``t`` with the framework's partial selection
(O(n)), keep every entry with ``|x| > t`` (there are ``c < k`` of them), then the
``k - c`` smallest indices with ``|x| == t``. Cost O(n) plus O(k log k) for the final
index sort. Results are returned sorted by index ascending, the canonical order of a
sparse vector in mpicomm.

Prefilter (large vectors, ``PREFILTER_MIN_K <= k <= n / 8``): a strided sample of the
magnitudes gives a threshold ``t'`` a little below the expected k-th largest magnitude;
the entries with ``|x| >= t'`` are the *candidates*. If there are at least ``k`` of
them, they contain every entry of the top-k *and* every entry tied with its smallest
member (the k-th largest magnitude is then ``>= t'``), so the exact selection above,
run on the candidates in their original index order, returns exactly the same set as on
the whole vector. If the estimate was too high (fewer than ``k`` candidates), the full
selection runs instead. No randomness is involved, so the result is deterministic
either way; only the speed depends on the data (about 4x faster for 2.5e7 entries on
one CPU core, at densities 1e-4 to 1e-1).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["topk_indices", "index_dtype_for", "PREFILTER_MIN_K"]

#: Smallest k for which the sample prefilter is tried (below it, a plain partial
#: selection is already cheap).
PREFILTER_MIN_K = 1024


def _sample_plan(n: int, k: int) -> tuple[int, int] | None:
    """``(stride, rank)``: sample every ``stride``-th magnitude and take its ``rank``-th
    largest as the candidate threshold; ``None`` when prefiltering would not pay."""
    if k < PREFILTER_MIN_K or 8 * k > n:
        return None
    m = min(n, max(1 << 15, (256 * n) // k))
    stride = max(1, n // m)
    expected = ((n + stride - 1) // stride) * k / n
    # 25% over the expected count plus 4 standard deviations: the threshold lands below
    # the true k-th magnitude with overwhelming probability for any smooth distribution.
    rank = int(1.25 * expected + 4 * math.sqrt(expected) + 8)
    return stride, rank


def index_dtype_for(numel: int) -> str:
    """``"int32"`` when every index fits in 31 bits, else ``"int64"``."""
    return "int32" if numel < 2**31 else "int64"


def topk_indices(x: Any, k: int) -> Any:
    """Indices of the ``k`` largest ``|x|`` of a 1-D numpy array or torch tensor.

    Ties are broken by the smaller index. Returns an int64 array/tensor (on ``x``'s
    device) sorted ascending; ``k >= x.size`` returns every index. ``x`` must be finite
    (NaN has no place in the order); callers validate that.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if isinstance(x, np.ndarray):
        return _topk_numpy(x, k)
    return _topk_torch(x, k)


def _topk_numpy(x: np.ndarray, k: int) -> np.ndarray:
    n = x.shape[0]
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    mag = np.abs(x)
    plan = _sample_plan(n, k)
    if plan is not None:
        stride, rank = plan
        sample = mag[::stride]
        cut = np.partition(sample, sample.shape[0] - rank)[sample.shape[0] - rank]
        candidates = np.flatnonzero(mag >= cut)
        if candidates.shape[0] >= k:
            return candidates[_select_numpy(mag[candidates], k)]
    return _select_numpy(mag, k)


def _select_numpy(mag: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the k largest of ``mag``, ties to the smaller position."""
    n = mag.shape[0]
    threshold = np.partition(mag, n - k)[n - k]
    above = np.flatnonzero(mag > threshold)
    ties = np.flatnonzero(mag == threshold)[: k - above.shape[0]]
    return np.sort(np.concatenate([above, ties])).astype(np.int64, copy=False)


def _topk_torch(x: Any, k: int) -> Any:
    import torch

    n = x.shape[0]
    if k >= n:
        return torch.arange(n, dtype=torch.int64, device=x.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    mag = x.abs()
    plan = _sample_plan(n, k)
    if plan is not None:
        stride, rank = plan
        sample = mag[::stride]
        cut = torch.topk(sample, min(rank, sample.shape[0]), sorted=False).values.min()
        candidates = torch.nonzero(mag >= cut).view(-1)
        if candidates.shape[0] >= k:
            return candidates[_select_torch(mag[candidates], k)]
    return _select_torch(mag, k)


def _select_torch(mag: Any, k: int) -> Any:
    """Positions (ascending) of the k largest of ``mag``, ties to the smaller position."""
    import torch

    threshold = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > threshold).view(-1)
    ties = torch.nonzero(mag == threshold).view(-1)[: k - above.shape[0]]
    return torch.sort(torch.cat([above, ties])).values
