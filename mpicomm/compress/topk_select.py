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

Threshold + compaction (:func:`topk_threshold`, torch, any device): the same sample
threshold, then *no* partial selection over the candidates at all: the candidates are
compacted with ``nonzero`` (in index order) and ordered by a stable descending sort of
their magnitudes, whose first k are exactly the top-k under the total order (stability
keeps equal magnitudes in ascending index order). Elementwise passes, one compaction and
sorts of ~1.3k entries: everything a GPU does at memory speed, with a single
device-to-host synchronization (the candidate count), where ``torch.topk`` with a large k
is slow (0.69 ms for 2.5e7 float32 entries on an H100, 1.0 ms for the prefilter above
with its extra synchronizations). When the estimate was too high (fewer than k
candidates) the sample rank is raised 4x and the pass repeated, then the full selection
runs. :func:`topk_indices` uses it for CUDA tensors (and the prefilter above on the
CPU, where ``torch.topk`` over the candidates beats sorting them).

Approximate (:func:`topk_indices_approx`): a smaller margin and no refinement or
fallback, so it costs one pass and one compaction; the result is the exact top-m for
some ``m <= k`` (every entry returned is correct and the recall is ``m / k``; >= 0.95 is
tested). In eager torch ops both variants are bounded by the same few memory passes; a
fused single-pass kernel (Triton/CuPy) is what a 10x speed-up would need.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..validate import check_int
from .base import charge

__all__ = ["topk_indices", "topk_threshold", "topk_indices_approx", "topk_among",
           "topk_masses", "index_dtype_for", "PREFILTER_MIN_K", "SELECT_COST_DENSITY"]

#: Smallest k for which the sample prefilter is tried (below it, a plain partial
#: selection is already cheap).
PREFILTER_MIN_K = 1024

#: ``k / n`` at which the virtual clock's ``select`` cost is measured. A selection of more
#: (gTop-k's truncation of a union of two sets to half of it) also pays ``select:kept``
#: per index kept beyond ``SELECT_COST_DENSITY * n``: the ``O(k log k)`` index sort and
#: the partial selection's larger share (measured on one core: keeping half of 2e4
#: values costs 4x keeping 1% of them).
SELECT_COST_DENSITY = 0.01


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


def _threshold_rank(n: int, k: int, margin: float, sds: float, min_rank: int
                    ) -> tuple[int, int]:
    """``(stride, rank)`` for a strided sample whose ``rank``-th largest magnitude is
    expected to have ``margin * k`` entries of the whole vector at or above it, plus
    ``sds`` standard deviations; the sample is large enough for ``rank >= min_rank``."""
    m = min(n, max(1 << 12, (min_rank * n) // max(k, 1)))
    stride = max(1, n // m)
    size = (n + stride - 1) // stride
    expected = size * k / n
    rank = int(margin * expected + sds * math.sqrt(expected) + 1)
    return stride, max(1, min(rank, size))


def _sample_cut(mag: Any, stride: int, rank: int) -> Any:
    """The ``rank``-th largest of ``mag[::stride]`` as a 0-d tensor (stays on device)."""
    import torch

    sample = mag[::stride]
    return torch.topk(sample, rank, sorted=False).values.min()


def topk_among(mag: Any, candidates: Any, k: int) -> Any:
    """Of ``candidates`` (ascending positions, at least ``k``), the k largest ``mag``
    under the total order, ascending: a stable descending sort keeps ties in index
    order. Torch, any device; no host synchronization (sorts only)."""
    import torch

    order = torch.sort(mag[candidates], descending=True, stable=True).indices[:k]
    return torch.sort(candidates[order]).values


def topk_threshold(x: Any, k: int) -> Any:
    """Exact top-k indices of a 1-D torch tensor by threshold + compaction (see the
    module docstring); same result as :func:`topk_indices`, bit for bit.

    Cost: ``|x|`` (one pass), a top-``r`` over a strided sample of ~``256 n / k``
    entries, one compare + compaction pass, and two sorts of ~``1.3 k`` entries; one
    host synchronization. Retries with a 4x larger sample rank when fewer than k
    entries pass (rare), then falls back to the full selection.
    """
    import torch

    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = x.shape[0]
    trivial = _trivial_torch(x, k)
    if trivial is not None:
        return trivial
    mag = x.abs()
    if 8 * k <= n:
        for widen in (1, 4):
            stride, rank = _threshold_rank(n, k, 1.25 * widen, 4.0, 256)
            candidates = torch.nonzero(mag >= _sample_cut(mag, stride, rank)).view(-1)
            if candidates.shape[0] >= k:
                return topk_among(mag, candidates, k)
    return _select_torch(mag, k)


def topk_indices_approx(x: Any, k: int, *, sample_rank: int = 512) -> Any:
    """Approximate top-k of a 1-D torch tensor: at most ``k`` indices (ascending), the
    exact top-m for some ``m <= k`` under the total order.

    The threshold is the sample quantile expected to pass ``k`` entries plus two
    standard deviations, from a strided sample whose expected rank is ``sample_rank``
    (relative standard error ``1/sqrt(sample_rank)``, 4.4% by default): about 98% of
    calls pass at least k entries and return the exact top-k; the others return the
    exact top-m with ``m/k`` below 1 by a few percent. There is no refinement pass and
    no fallback: one compare + compaction pass and one sort of about ``1.1 k`` entries,
    one host synchronization. Deterministic. Raise ``sample_rank`` for a higher recall
    at the price of a larger sample.
    """
    import torch

    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    sample_rank = check_int("sample_rank", sample_rank, 1)
    n = x.shape[0]
    if k >= n or 8 * k > n:
        return topk_indices(x, k)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    mag = x.abs()
    stride, rank = _threshold_rank(n, k, 1.0, 2.0, sample_rank)
    candidates = torch.nonzero(mag >= _sample_cut(mag, stride, rank)).view(-1)
    if candidates.shape[0] <= k:
        return candidates
    return topk_among(mag, candidates, k)


def index_dtype_for(numel: int) -> str:
    """``"int32"`` when every index fits in 31 bits, else ``"int64"``."""
    return "int32" if numel < 2**31 else "int64"


def topk_indices(x: Any, k: int) -> Any:
    """Indices of the ``k`` largest ``|x|`` of a 1-D numpy array or torch tensor.

    Ties are broken by the smaller index. Returns an int64 array/tensor (on ``x``'s
    device) sorted ascending; ``k >= x.size`` returns every index. ``x`` must be finite
    (NaN has no place in the order); callers validate that. Under the virtual clock a
    selection of ``k < n`` among ``n`` elements charges ``select`` per element and
    ``select:kept`` per index kept beyond ``SELECT_COST_DENSITY * n`` (not inside a
    compressor's ``compress``, which is charged as a whole).
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k < x.shape[0]:
        charge("select", x.shape[0])
        beyond = k - int(SELECT_COST_DENSITY * x.shape[0])
        if beyond > 0:
            charge("select:kept", beyond)
    if isinstance(x, np.ndarray):
        return _topk_numpy(x, k)
    if x.device.type == "cuda":
        return topk_threshold(x, k)
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
    """Positions (ascending) of the k largest of ``mag``, ties to the smaller position:
    the k-th largest value by partition, a mask of what is above it plus the first ties,
    the mask's positions (ascending by construction: no sort). One core, float32: 0.14
    ms for 1e4 of 2e4, 1.9 ms for 1e5 of 2e5."""
    n = mag.shape[0]
    threshold = np.partition(mag, n - k)[n - k]
    keep = mag > threshold
    need = k - int(np.count_nonzero(keep))
    if need > 0:
        keep[np.flatnonzero(mag == threshold)[:need]] = True
    return np.flatnonzero(keep).astype(np.int64, copy=False)


def _trivial_torch(x: Any, k: int) -> Any:
    """The answer when no selection is needed (``k == 0`` or ``k >= n``), else ``None``."""
    import torch

    n = x.shape[0]
    if k >= n:
        return torch.arange(n, dtype=torch.int64, device=x.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    return None


def _topk_torch(x: Any, k: int) -> Any:
    import torch

    n = x.shape[0]
    trivial = _trivial_torch(x, k)
    if trivial is not None:
        return trivial
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
    """Positions (ascending) of the k largest of ``mag``, ties to the smaller position,
    as :func:`_select_numpy` (which CPU float32/64 tensors use: numpy's partition took
    0.14 ms for 1e4 of 2e4 on one core against 0.35 ms for ``torch.topk``)."""
    import torch

    if mag.device.type == "cpu" and mag.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(_select_numpy(mag.detach().numpy(), k))
    threshold = torch.topk(mag, k, sorted=False).values.min()
    keep = mag > threshold
    need = k - int(keep.sum())
    if need > 0:
        keep[torch.nonzero(mag == threshold).view(-1)[:need]] = True
    return torch.nonzero(keep).view(-1)


def topk_masses(x: Any, ks: Any) -> list[float]:
    """``||top-k(x)||²`` (float64) of a 1-D torch tensor for each ``k`` of ``ks`` (``k <=
    0``: 0; ``k >= n``: all of it): one :func:`topk_indices` of the largest ``k``, its
    squares sorted once, prefix sums (one k: no sort). CPU float32/64 in numpy, whose
    selection is single-threaded: with 4 ranks on 2 cores (the emulated cluster) it took
    1-5 ms for 1.1e6 floats against 10-14 ms with torch's intra-op threads competing
    with the ranks."""
    import torch

    n = int(x.shape[0])
    ks = [max(0, min(int(k), n)) for k in ks]
    top = max(ks, default=0)
    if top == 0:
        return [0.0] * len(ks)
    one = all(k in (0, top) for k in ks)
    x = x.detach()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        host = x.numpy()
        picked = host[topk_indices(host, top)].astype(np.float64)
        squares = picked * picked
        if one:
            total = float(squares.sum())
            return [total if k else 0.0 for k in ks]
        prefix = np.cumsum(np.sort(squares)[::-1])
    else:
        picked = x[topk_indices(x, top)].to(torch.float64)
        squares = picked * picked
        if one:
            total = float(squares.sum())
            return [total if k else 0.0 for k in ks]
        prefix = torch.cumsum(torch.sort(squares, descending=True).values, 0).cpu().numpy()
    return [float(prefix[k - 1]) if k else 0.0 for k in ks]
