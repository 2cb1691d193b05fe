"""Sequential, single-process references for the sparse collectives (pure numpy).

These functions are the *specification* of what :mod:`mpicomm.sparse` computes; the
tests compare the distributed implementations against them bit for bit.

:func:`simulate_gtopk` replays :func:`mpicomm.sparse.gtopk` exactly: the same local
truncation, the same fold of the first ``2*rem`` ranks (``rem = P - p2``, ``p2`` the
largest power of two <= P; the even rank of each pair hands its set to the odd one), the
same butterfly pairing (virtual rank ``v`` meets ``v XOR 2^j`` in round ``j``), the same
operand order in every union (the lower-ranked operand on the left of ``+``) and the same
total order for selection. It is **not** the exact global top-k for P > 2 (see
docs/algorithms.md, gTop-k, and :func:`exact_topk`): a merge can drop an index that would have won
after more contributions were added.

Every set is a pair ``(indices, values)`` of 1-D numpy arrays; indices may come in any
order and are returned ascending as int64. Values keep their dtype (float64 and float32
reproduce the distributed results bit for bit; float16 too).

Cost: no communication; :func:`simulate_gtopk` does the P·lg P merges of all ranks in one
process, O(P·lg P·k log k), and :func:`exact_topk` O(P·k log(P·k)). Use them for tests
and offline studies (e.g. how often gTop-k misses the exact top-k on recorded
gradients), not in a training loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..compress.topk_select import topk_indices
from ..p2p import fold_layout, real_rank, virtual_rank
from ..validate import check_int

__all__ = ["simulate_gtopk", "exact_topk", "scatter_add", "merge_truncate", "truncate",
           "GTopKTrace"]

Pairs = tuple[np.ndarray, np.ndarray]


def _canonical(pairs: Pairs) -> Pairs:
    idx = np.asarray(pairs[0]).astype(np.int64).reshape(-1)
    val = np.asarray(pairs[1]).reshape(-1)
    if idx.shape != val.shape:
        raise ValueError(f"indices {idx.shape} and values {val.shape} differ in shape")
    order = np.argsort(idx, kind="stable")
    idx, val = idx[order], val[order]
    if idx.size > 1 and np.any(idx[1:] == idx[:-1]):
        raise ValueError("duplicate indices in one set")
    return idx, val


def _key(val: np.ndarray) -> np.ndarray:
    key = np.abs(val)
    if key.dtype == np.float16:
        key = key.astype(np.float32)
    key[np.isnan(key)] = np.inf
    return key


def truncate(pairs: Pairs, k: int) -> Pairs:
    """The ``k`` entries with the largest ``|value|`` (ties: smaller index), ascending."""
    idx, val = _canonical(pairs)
    if idx.size <= k:
        return idx, val
    pos = topk_indices(_key(val), k)
    return idx[pos], val[pos]


def union(a: Pairs, b: Pairs) -> Pairs:
    """Indices of both sets once; ``a[i] + b[i]`` (a on the left) where both have ``i``."""
    ai, av = _canonical(a)
    bi, bv = _canonical(b)
    ci = np.concatenate([ai, bi])
    cv = np.concatenate([av, bv])
    order = np.argsort(ci, kind="stable")
    si, sv = ci[order], cv[order]
    if si.size > 1:
        first = np.flatnonzero(si[1:] == si[:-1])
        if first.size:
            sv[first] = sv[first] + sv[first + 1]
            keep = np.ones(si.size, dtype=bool)
            keep[first + 1] = False
            si, sv = si[keep], sv[keep]
    return si, sv


def merge_truncate(a: Pairs, b: Pairs, k: int) -> Pairs:
    """Sparse union of ``a`` and ``b`` (a on the left of every ``+``), then top-k."""
    return truncate(union(a, b), k)


class GTopKTrace:
    """What each rank sent during one gTop-k: ``pairs_sent[r]`` lists the pair count of
    every message rank ``r`` sent, in order (fold-in, rounds, fold-out)."""

    def __init__(self, size: int):
        self.pairs_sent: list[list[int]] = [[] for _ in range(size)]

    def bytes_sent(self, rank: int, pair_bytes: int) -> int:
        return sum(self.pairs_sent[rank]) * pair_bytes

    def messages(self, rank: int) -> int:
        return len(self.pairs_sent[rank])


def _decoded(pairs: Pairs, coding: str | None) -> Pairs:
    """A set as the receiver of its message reads it (the values :func:`quantize
    <mpicomm.sparse.coding.quantize>` gives with ``coding``)."""
    if coding is None:
        return pairs
    import torch

    from .coding import quantize

    return pairs[0], quantize(torch.from_numpy(pairs[1])).numpy()


def simulate_gtopk(per_rank_pairs: Sequence[Pairs], k: int,
                   trace: GTopKTrace | None = None, coding: str | None = None) -> Pairs:
    """The (indices, values) that :func:`mpicomm.sparse.gtopk` returns on every rank.

    ``per_rank_pairs[r]`` is rank r's input. Steps, for P ranks, p2 the largest power of
    two <= P and rem = P - p2:

    1. every rank truncates its set to its own top-k;
    2. fold-in: for r < rem, rank 2r sends its set to rank 2r+1, which keeps
       ``merge_truncate(set_2r, set_2r+1, k)``; virtual rank v is real rank 2v+1 for
       v < rem, else v + rem;
    3. butterfly: for j = 0 .. lg p2 - 1 virtual ranks v and v XOR 2^j exchange sets and
       both keep ``merge_truncate(set_lower, set_higher, k)``;
    4. fold-out: rank 2r+1 sends the final set back to rank 2r.

    With ``coding`` every set sent in steps 2 and 3 is replaced by its decoded values
    before the merge (on both partners of a round); the fold-out is plain.
    If ``trace`` is given, it records how many pairs each rank sent per message.
    """
    p = len(per_rank_pairs)
    if p < 1:
        raise ValueError("need at least one rank")
    k = check_int("k", k, 1)
    sent = trace.pairs_sent if trace is not None else [[] for _ in range(p)]
    sets = [truncate(pr, k) for pr in per_rank_pairs]
    p2, rem = fold_layout(p)
    for r in range(rem):
        sent[2 * r].append(sets[2 * r][0].size)
        sets[2 * r + 1] = merge_truncate(_decoded(sets[2 * r], coding), sets[2 * r + 1], k)
    current = {v: sets[real_rank(v, rem)] for v in range(p2)}
    mask = 1
    while mask < p2:
        nxt = {}
        for v in range(p2):
            partner = v ^ mask
            sent[real_rank(v, rem)].append(current[v][0].size)
            lo, hi = (v, partner) if v < partner else (partner, v)
            nxt[v] = merge_truncate(_decoded(current[lo], coding),
                                    _decoded(current[hi], coding), k)
        current = nxt
        mask <<= 1
    result = current[0]
    for r in range(rem):
        sent[2 * r + 1].append(result[0].size)
    for r in range(p):
        v = virtual_rank(r, rem)
        if v >= 0:  # every virtual rank ends with the same set (checked, not assumed)
            ci, cv = current[v]
            if not (np.array_equal(ci, result[0]) and
                    np.array_equal(cv.view(np.uint8), result[1].view(np.uint8))):
                raise AssertionError("butterfly ranks disagree; this is a bug")
    return result


def exact_topk(per_rank_pairs: Sequence[Pairs], k: int) -> Pairs:
    """Exact global top-k (the authors' "select k from k*P"): sum every rank's values by
    index, in rank order (``((0 + v_0) + v_1) + ...``), over the union of supports, and
    select the top-k of the sums. Fewer than k distinct indices: all of them."""
    sets = [_canonical(pr) for pr in per_rank_pairs]
    dtype = np.result_type(*[s[1].dtype for s in sets]) if sets else np.float64
    support = np.unique(np.concatenate([s[0] for s in sets])) if sets else np.empty(0, np.int64)
    acc = np.zeros(support.size, dtype=dtype)
    for idx, val in sets:
        acc[np.searchsorted(support, idx)] += val
    return truncate((support, acc), k)


def scatter_add(per_rank_pairs: Sequence[Pairs], size: int, op: str = "sum") -> np.ndarray:
    """Dense length-``size`` vector: every rank's values added at its indices, in rank
    order (``"avg"`` divides by the number of ranks)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    sets = [_canonical(pr) for pr in per_rank_pairs]
    dtype: Any = np.result_type(*[s[1].dtype for s in sets])
    dense = np.zeros(size, dtype=dtype)
    for idx, val in sets:
        dense[idx] += val
    if op == "avg":
        dense /= dtype.type(len(sets))
    return dense
