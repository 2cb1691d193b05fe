r"""Top-k through a sparse Allgather, and the exact global top-k built on it.

:func:`topk_allgather` (the "Top-k S-SGD" baseline of gTop-k, Shi et al., arXiv 1901.04359): every
rank packs its (index, value) pairs into one byte buffer (indices int32, or int64 for an
index space of 2^31 or more, then values in their dtype) and a ring
:func:`mpicomm.allgatherv` circulates the buffers, so ranks may hold different numbers
of pairs. Every rank then adds each rank's values at its indices into a dense zero
vector, rank by rank in rank order (within one rank indices are distinct, so each step
is a plain indexed add): the same bits on every rank and on every device. With
``coding="log8"`` the buffers hold :mod:`mpicomm.sparse.coding`'s compact format (one
byte a value, varint index gaps; about 2-3 bytes a pair) and the decoded values are
added instead.

:func:`exact_topk` (the authors' "select k from k×P" reference): the same gather, then
the values are summed by index over the union of supports (rank order) and the exact
top-k of the sums is kept, in the library's total order.

Cost (ring allgatherv, k_r pairs on rank r, s = index bytes + value bytes):
(P-1)·α + Σ_{r'≠r} k_{r'}·s·β received per rank; rank r *sends* every block but its
right neighbour's: Σ_{r' ≠ r+1} k_{r'}·s bytes in P-1 messages (more with the ring's
segmentation, which adds messages but no bytes), i.e. (P-1)·k·s bytes when every rank
has k pairs. One small control allgather of the block sizes precedes it (not counted in
``comm.traffic``). The scatter costs O(d) to zero the dense vector plus O(P·k). See
:func:`mpicomm.collectives.cost.topk_allgather`.

Tuning: bandwidth grows linearly with P (gTop-k grows with lg P, AR-Top-k not at all);
the Allgather is exact and latency-cheap, so it is the right choice for small P or tiny
k. Against a dense ring allreduce it wins in bytes when density < 2v / (P·s)
(1/P for float32 values with int32 indices).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import clock
from ..collectives.allgather import allgatherv
from ..comm import Communicator, resolve
from ..hooks import traced
from ._common import (
    check_int,
    describe_sparse,
    read_pairs,
    read_topk_args,
    to_caller,
    wire_index_dtype,
)
from .coding import check_coding, from_wire, to_wire
from .sets import Pairs, truncate

__all__ = ["topk_allgather", "exact_topk"]


def gather_sets(pairs: Pairs, comm: Communicator, index_dtype: torch.dtype,
                coding: str | None = None) -> list[Pairs]:
    """Every rank's (idx, val) set, in rank order, via one ring allgatherv of bytes
    (plain pairs, or :mod:`~mpicomm.sparse.coding`'s ``coding``, decoded on the values'
    device)."""
    idx, val = pairs
    packed = to_wire(idx, val, index_dtype, coding).to(val.device)
    gathered, rows = allgatherv(packed, comm=comm, algorithm="ring", return_counts=True)
    sets, start = [], 0
    for n in rows:
        sets.append(from_wire(gathered[start:start + n], index_dtype, val.dtype, coding,
                              val.device))
        start += n
    return sets


@traced("topk_allgather", cat="sparse", describe=describe_sparse("topk_allgather"))
def topk_allgather(indices: Any, values: Any, size: int, op: str = "sum",
                   comm: Communicator | None = None, *, allow_nonfinite: bool = False,
                   coding: str | None = None) -> Any:
    """Gather every rank's sparse (indices, values) and scatter-add them into a dense vector.

    Parameters
    ----------
    indices, values:
        This rank's pairs: 1-D arrays of equal length (numpy, torch CPU/CUDA or cupy;
        same framework and device), distinct integer indices in ``[0, size)``, floating
        values (the same dtype on every rank). The count may differ between ranks.
    size:
        Length of the dense result (same on every rank).
    op:
        ``"sum"`` or ``"avg"`` (the sum divided by the number of ranks).
    comm:
        :class:`~mpicomm.Communicator` (default: the world).
    allow_nonfinite:
        Skip the finiteness check of the values (not with ``coding``).
    coding:
        ``None`` (int32/int64 indices and the values' own bytes) or ``"log8"``
        (:mod:`mpicomm.sparse.coding`: one byte per value on a log scale, varint index
        gaps; about 2-3 bytes a pair). The values are then what the coding decodes
        (:func:`mpicomm.sparse.coding.quantize` of each rank's values), exactly.

    Returns a dense 1-D vector of length ``size`` with the values' dtype, in their
    framework and on their device, identical on every rank.
    """
    comm = resolve(comm)
    with comm.validating("topk_allgather") as agreed:
        agreed.update(size=size, op=op, coding=coding)
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        check_coding(coding, allow_nonfinite)
        size = check_int("size", size, 1)
        sp = read_pairs(indices, values, size, allow_nonfinite)
        agreed["dtype"] = str(sp.val.dtype)

    sets = gather_sets((sp.idx, sp.val), comm, wire_index_dtype(size), coding)
    clock.charge("scatter", size)
    dense = torch.zeros(size, dtype=sp.val.dtype, device=sp.device)
    for idx, val in sets:
        dense[idx] += val
    if op == "avg" and comm.size > 1:
        dense /= comm.size
    return to_caller(dense, sp.like_val)


@traced("exact_topk", cat="sparse", describe=describe_sparse("exact_topk"))
def exact_topk(indices: Any, values: Any, k: int, comm: Communicator | None = None, *,
               size: int | None = None, allow_nonfinite: bool = False) -> tuple[Any, Any]:
    """Exact global top-k of the sum of every rank's sparse vector (the reference).

    Gathers all pairs (ring allgatherv), sums the values by index over the union of the
    supports in rank order, and keeps the ``k`` sums with the largest magnitude (ties:
    smaller index). Arguments as for :func:`mpicomm.sparse.gtopk`. Returns ``(indices,
    values)`` sorted by index, identical on every rank, ``min(k, |union|)`` entries.
    """
    comm = resolve(comm)
    sp, k, size = read_topk_args(comm, "exact_topk", indices, values, k, size, allow_nonfinite)

    sets = gather_sets((sp.idx, sp.val), comm, wire_index_dtype(size))
    clock.charge("merge", sum(s[0].shape[0] for s in sets))
    support = torch.unique(torch.cat([s[0] for s in sets]))  # sorted ascending
    acc = torch.zeros(support.shape[0], dtype=sp.val.dtype, device=sp.device)
    for idx, val in sets:
        acc[torch.searchsorted(support, idx)] += val
    idx, val = truncate(support, acc, k)
    return to_caller(idx, sp.like_idx, dtype=sp.idx_dtype), to_caller(val, sp.like_val)
