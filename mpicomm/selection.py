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
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["topk_indices", "index_dtype_for"]


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
    threshold = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > threshold).view(-1)
    ties = torch.nonzero(mag == threshold).view(-1)[: k - above.shape[0]]
    return torch.sort(torch.cat([above, ties])).values
