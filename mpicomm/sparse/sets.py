"""Sparse sets and the kernels that combine them (what gTop-k and the selector run).

A *sparse set* is a pair of 1-D torch tensors ``(idx, val)`` on one device with ``idx``
int64, strictly increasing (no duplicates), and ``val`` of a floating dtype: the
canonical form inside :mod:`mpicomm.sparse`.

* :func:`selection_key`: magnitudes to rank by (``|v|``, half types widened exactly,
  NaN as ``+inf`` so that the order stays total and deterministic);
* :func:`truncate`: the ``k`` pairs of largest magnitude (ties: smaller index, the
  library-wide total order of :func:`mpicomm.compress.topk_select.topk_indices`);
  ``O(n)`` selection;
* :func:`union`: indices of both sets once, values added where both have one (one sort
  of ``n_a + n_b`` indices);
* :func:`merge_truncate`: union then truncate, gTop-k's merge;
* :func:`members`: which of some indices a set holds (binary searches).
"""

from __future__ import annotations

import torch

from .. import clock
from ..compress.topk_select import topk_indices

__all__ = ["Pairs", "selection_key", "truncate", "union", "merge_truncate", "members"]

Pairs = tuple[torch.Tensor, torch.Tensor]


def selection_key(val: torch.Tensor) -> torch.Tensor:
    """Magnitudes to rank by: ``|v|`` (half types widened exactly), NaN as ``+inf``."""
    key = val.abs()
    if key.dtype in (torch.float16, torch.bfloat16):
        key = key.float()
    # a sum of non-negative numbers is NaN exactly when one of them is NaN
    if key.numel() and bool(torch.isnan(key.sum())):
        key = torch.where(torch.isnan(key), torch.full_like(key, float("inf")), key)
    return key


def truncate(idx: torch.Tensor, val: torch.Tensor, k: int) -> Pairs:
    """The ``k`` pairs of a sparse set with the largest ``|value|`` (ties: smaller index)."""
    if idx.shape[0] <= k:
        return idx, val
    pos = topk_indices(selection_key(val), k)
    return idx[pos], val[pos]


def union(a: Pairs, b: Pairs) -> Pairs:
    """True sparse union: indices of both sets once, values added where both have one.

    ``a``'s value is the left operand of every addition (``a + b``), so a caller that
    always passes the lower-ranked operand first computes the same bits on every rank
    (IEEE addition is commutative anyway; the fixed order documents the association).
    """
    ai, av = a
    bi, bv = b
    clock.charge("merge", ai.shape[0] + bi.shape[0])
    if ai.shape[0] == 0 or bi.shape[0] == 0:
        return (bi, bv) if ai.shape[0] == 0 else (ai, av)
    ci = torch.cat([ai, bi])
    cv = torch.cat([av, bv])
    si, order = torch.sort(ci, stable=True)  # equal indices: a's entry first
    sv = cv[order]
    first = torch.nonzero(si[1:] == si[:-1]).view(-1)  # each index occurs at most twice
    if first.shape[0]:
        sv[first] = sv[first] + sv[first + 1]
        keep = torch.ones(si.shape[0], dtype=torch.bool, device=si.device)
        keep[first + 1] = False
        si, sv = si[keep], sv[keep]
    return si, sv


def merge_truncate(a: Pairs, b: Pairs, k: int) -> Pairs:
    """Sparse union, then the top-k of it (gTop-k's merge step: Shi et al., "A
    Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low
    Bandwidth Networks", 2019, arXiv:1901.04359)."""
    return truncate(*union(a, b), k)


def members(idx: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Boolean mask over ``query`` (int64, any order): True where the index is in ``idx``
    (a sparse set's indices: int64, strictly increasing).

    Cost: one binary search per query entry, ``O(|query|·log|idx|)``; ``torch.isin``
    sorts both inputs instead (measured on one CPU core at 1e5 indices each: 3.6 ms
    against 10.3 ms). Same result as ``torch.isin(query, idx)``."""
    if idx.shape[0] == 0:
        return torch.zeros(query.shape, dtype=torch.bool, device=query.device)
    pos = torch.searchsorted(idx, query).clamp_(max=idx.shape[0] - 1)
    return idx[pos] == query
