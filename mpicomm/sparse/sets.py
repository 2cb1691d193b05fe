"""Sparse sets and the kernels that combine them (what gTop-k and the selector run).

A *sparse set* is a pair of 1-D torch tensors ``(idx, val)`` on one device with ``idx``
int64, strictly increasing (no duplicates), and ``val`` of a floating dtype: the
canonical form inside :mod:`mpicomm.sparse`.

* :func:`selection_key`: magnitudes to rank by (``|v|``, half types widened exactly,
  NaN as ``+inf`` so that the order stays total and deterministic);
* :func:`truncate`: the ``k`` pairs of largest magnitude (ties: smaller index, the
  library-wide total order of :func:`mpicomm.compress.topk_select.topk_indices`);
  ``O(n)`` selection;
* :func:`union`: indices of both sets once, values added where both have one (one
  stable sort of ``n_a + n_b`` indices: on the CPU, numpy's merge of the two sorted
  runs);
* :func:`merge_truncate`: union then truncate, gTop-k's merge;
* the ``_tagged`` forms carry per-pair tags (e.g. a rank's own pairs' positions) through
  the same permutations, to follow which pairs survive without searching for them;
* :func:`members`: which of some indices a set holds (binary searches).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .. import clock
from ..compress.topk_select import topk_indices

__all__ = ["Pairs", "Tags", "selection_key", "truncate", "truncate_tagged", "union",
           "union_tagged", "merge_truncate", "merge_truncate_tagged", "members"]

Pairs = tuple[torch.Tensor, torch.Tensor]
#: Per-pair int64 tags carried through unions and truncations (-1: no tag).
Tags = tuple[torch.Tensor, ...]


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
    idx, val, _ = truncate_tagged(idx, val, (), k)
    return idx, val


def truncate_tagged(idx: torch.Tensor, val: torch.Tensor, tags: Tags, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, Tags]:
    """:func:`truncate`, with per-pair ``tags`` kept alongside the pairs they belong to."""
    if idx.shape[0] <= k:
        return idx, val, tags
    pos = topk_indices(selection_key(val), k)
    return idx[pos], val[pos], tuple(t[pos] for t in tags)


def union(a: Pairs, b: Pairs) -> Pairs:
    """True sparse union: indices of both sets once, values added where both have one.

    ``a``'s value is the left operand of every addition (``a + b``), so a caller that
    always passes the lower-ranked operand first computes the same bits on every rank
    (IEEE addition is commutative anyway; the fixed order documents the association).
    """
    idx, val, _ = union_tagged(a, b, (), ())
    return idx, val


def union_tagged(a: Pairs, b: Pairs, tags_a: Tags, tags_b: Tags
                 ) -> tuple[torch.Tensor, torch.Tensor, Tags]:
    """:func:`union`, with per-pair tags: ``tags_a[j]`` and ``tags_b[j]`` are int64 tensors
    over ``a``'s and ``b``'s pairs, -1 where a pair has none; an index both sets hold
    keeps the larger tag (at most one side sets a tag: they mark where a pair came from).
    Cost per tag: one gather of ``n_a + n_b`` entries and a maximum at the shared
    indices, about a quarter of the union's own time (one CPU core, 1e4-1e5 pairs a
    side); the virtual clock charges the union alone (``merge``)."""
    if len(tags_a) != len(tags_b):
        raise ValueError(f"union_tagged: {len(tags_a)} tags for a, {len(tags_b)} for b")
    ai, av = a
    bi, bv = b
    clock.charge("merge", ai.shape[0] + bi.shape[0])
    if ai.shape[0] == 0 or bi.shape[0] == 0:
        return (bi, bv, tags_b) if ai.shape[0] == 0 else (ai, av, tags_a)
    cpu_float = (ai.device.type == "cpu" and av.dtype == bv.dtype
                 and av.dtype in (torch.float32, torch.float64)
                 and not (av.requires_grad or bv.requires_grad))
    if not cpu_float:
        si, sv, st = _union_sorted(torch.cat([ai, bi]), torch.cat([av, bv]),
                                   [torch.cat([ta, tb]) for ta, tb in zip(tags_a, tags_b)],
                                   _TORCH)
        return si, sv, tuple(st)
    si, sv, st = _union_sorted(
        np.concatenate([ai.numpy(), bi.numpy()]), np.concatenate([av.numpy(), bv.numpy()]),
        [np.concatenate([ta.numpy(), tb.numpy()]) for ta, tb in zip(tags_a, tags_b)], _NUMPY)
    return torch.from_numpy(si), torch.from_numpy(sv), tuple(map(torch.from_numpy, st))


def _numpy_sort(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` sorted (stable) and the permutation, as ``torch.sort(x, stable=True)``."""
    order = np.argsort(x, kind="stable")
    return x[order], order


#: The few array operations :func:`_union_sorted` needs, for torch tensors (any device)
#: and numpy arrays (CPU float32/64: numpy's stable sort merges the two sorted runs of a
#: union in one pass, and its gathers and masks are cheaper than torch's for 1-D data;
#: a union of 1e4 + 1e4 pairs took 0.15 ms against 0.51 ms in torch on one core, 1e5 +
#: 1e5 2.2 against 5.1 ms, the same bits).
_TORCH = SimpleNamespace(sort=lambda x: torch.sort(x, stable=True),
                         flatnonzero=lambda m: torch.nonzero(m).view(-1),
                         maximum=torch.maximum,
                         trues=lambda x: torch.ones(x.shape[0], dtype=torch.bool,
                                                    device=x.device))
_NUMPY = SimpleNamespace(sort=_numpy_sort,
                         flatnonzero=np.flatnonzero, maximum=np.maximum,
                         trues=lambda x: np.ones(x.shape[0], dtype=bool))


def _union_sorted(ci: Any, cv: Any, ct: list[Any], xp: SimpleNamespace
                  ) -> tuple[Any, Any, list[Any]]:
    """The union of two concatenated sparse sets (indices ``ci``, values ``cv``, tags
    ``ct``): a stable sort by index (equal indices: the first set's entry first), then
    each index held twice added into its first entry (``a + b``) with the larger tag,
    and the second entry dropped."""
    si, order = xp.sort(ci)
    sv = cv[order]
    st = [t[order] for t in ct]
    first = xp.flatnonzero(si[1:] == si[:-1])  # each index occurs at most twice
    if first.shape[0]:
        sv[first] = sv[first] + sv[first + 1]
        for t in st:
            t[first] = xp.maximum(t[first], t[first + 1])
        keep = xp.trues(si)
        keep[first + 1] = False
        si, sv, st = si[keep], sv[keep], [t[keep] for t in st]
    return si, sv, st


def merge_truncate(a: Pairs, b: Pairs, k: int) -> Pairs:
    """Sparse union, then the top-k of it (gTop-k's merge step: Shi et al., "A
    Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low
    Bandwidth Networks", 2019, arXiv:1901.04359)."""
    return truncate(*union(a, b), k)


def merge_truncate_tagged(a: Pairs, b: Pairs, tags_a: Tags, tags_b: Tags, k: int
                          ) -> tuple[torch.Tensor, torch.Tensor, Tags]:
    """:func:`merge_truncate` with per-pair tags (:func:`union_tagged`): a tag survives
    exactly as long as its pair's value does, so tagging a rank's own pairs with their
    positions tracks which of its values reach the result, with no search."""
    idx, val, tags = union_tagged(a, b, tags_a, tags_b)
    return truncate_tagged(idx, val, tags, k)


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
