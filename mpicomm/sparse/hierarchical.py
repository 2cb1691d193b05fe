r"""Hierarchical sparse aggregation: dense inside hosts, sparse across hosts only.

Top-k aggregation at ``P = H·R`` ranks (``H`` hosts, :mod:`mpicomm.topology`) pays the
network for every rank's picks: a flat gTop-k sends ``R`` sets of ``k`` pairs through
each host's port in every round across hosts, a flat Allgather Top-k ``(P-1)·k`` pairs.
Inside a host the ranks share memory, where a dense reduction is cheap, so
:func:`hierarchical_topk` does, on every rank's dense vector ``x_r``:

1. **reduce on the host** (dense, shared memory): ``X_h = Σ_{r on host h} x_r``, cut
   into ``L`` slices on the host's first ``L`` local ranks (``sliced=True``, ``L`` = the
   lanes, the smallest host's size) or whole on its first rank (``L = 1``, the
   *leader* form); a ring reduce-scatter inside the host;
2. **select**: lane ``j`` keeps ``k_j`` entries of its slice ``X_h^j`` (``k_j``: the
   j-th of ``L`` near-equal parts of ``k``, at least 1, at most the slice's length);
3. **across hosts**, lane ``j`` of every host runs ``inner`` over the ``H`` hosts:

   * ``"gtopk"``: the butterfly merge-and-truncate of :func:`mpicomm.sparse.gtopk`
     (approximate global top-k of ``Σ_h X_h^j``);
   * ``"artopk"``: AR-Top-k: host ``s = (step + j) mod H`` selects, its indices are
     broadcast, every host's ``X_h^j`` at them is summed (``algorithm``: ``"ring"``,
     ``"tree"`` = recursive doubling, ``"auto"`` = the cost model's choice);
   * ``"allgather"``: every host's picks gathered and summed by index (exact for the
     picks);

4. **back to the host's ranks**: the lanes' results (and the host's *applied* indices,
   below) are allgathered inside the host, so every rank returns the same ``(I, V)``.

Returned ``V`` is the **sum over all P ranks** of ``x`` at ``I`` as far as it reached the
result (``op="avg"``: divided by P).

Error feedback: what each rank's vector lost. Host ``h``'s contribution at index ``i``
either reached the result or not: ``A_h`` (returned as ``applied``) holds the indices
where ``X_h[i]`` is part of ``V[i]``: the host's picks that survived every merge on their
path (gTop-k, tracked locally, also through the fold of a non-power-of-two H; no extra
traffic but for one message of the folded pairs), ``I`` itself (AR-Top-k: every host's
value at ``I`` is summed), the host's own picks (Allgather). Every rank ``r`` on host
``h`` then keeps ``e_r = x_r`` with ``A_h`` zeroed: **each rank's residual holds
exactly its own entries whose host sum did not reach the update**, and mass is
conserved, ``Σ_r x_r = V + Σ_r e_r`` entry by entry (up to the rounding of the sums).

Compared with the flat collectives: the host's ranks select once per host (on ``1/L``
of the vector each with ``sliced``), the network carries ``H`` sets instead of ``P``,
and the reduction is exact inside a host, so the result is at least as close to the
top-k of the sum as the flat gTop-k's. Costs:
:meth:`mpicomm.collectives.cost.HostCosts.hierarchical_sparse`.

Tuning: ``sliced=True`` divides the selection (``O(d)``, the dominant compute) and the
merges by ``L`` and lets ``L`` ranks drive the port; the leader form keeps one global
top-k per host (its ``k`` entries are chosen over the whole vector instead of per slice,
which matters when the large entries cluster in a few layers).
"""

from __future__ import annotations

from typing import Any

import torch

from ..arrayops import ops_for
from ..collectives import cost
from ..collectives.allgather import allgatherv
from ..collectives.allreduce import allreduce
from ..collectives.broadcast import broadcast
from ..collectives.hierarchical import hierarchy, reduce_into_lanes
from ..comm import Communicator, resolve
from ..compress.topk_select import topk_indices
from ..config import ring_segment_bytes
from ..cudampi import cuda_aware
from ..hooks import traced
from ..p2p import block_bounds, pack_bytes, unpack_bytes
from ..validate import check_algorithm, check_choice
from ._common import (
    all_finite,
    describe_sparse,
    read_dense_topk_args,
    to_caller,
    wire_index_dtype,
)
from .allgather import gather_sets
from .artopk import star_source
from .gtopk import _butterfly
from .sets import Pairs, selection_key, truncate

__all__ = ["hierarchical_topk", "INNER", "lane_k"]

#: The sparse collectives a lane can run across hosts.
INNER = cost.SPARSE_INNER
_AR = {"ring": "ring", "tree": "recursive_doubling"}


def lane_k(k: int, lanes: int, lengths: list[int]) -> list[int]:
    """Entries each lane keeps: the j-th of ``lanes`` near-equal parts of ``k``, at least
    1 and at most the lane's slice length ``lengths[j]``."""
    kb = block_bounds(k, lanes)
    return [min(max(1, kb[j + 1] - kb[j]), lengths[j]) for j in range(lanes)]


@traced("hierarchical_topk", cat="sparse", describe=describe_sparse("hierarchical_topk"))
def hierarchical_topk(x: Any, k: int, comm: Communicator | None = None, *,
                      inner: str = "gtopk", sliced: bool = False, step: int = 0,
                      algorithm: str = "auto", op: str = "sum",
                      allow_nonfinite: bool = False) -> tuple[Any, Any, Any]:
    """Top-k aggregation of every rank's dense ``x``: dense inside hosts, ``inner``
    across hosts (module docstring).

    Parameters
    ----------
    x:
        This rank's vector (error-fed gradient): numpy, torch CPU/CUDA or cupy, floating,
        any shape (treated flat), the same numel and dtype on every rank.
    k:
        Entries kept, ``1 <= k <= numel`` (split over the lanes with ``sliced``).
    comm:
        :class:`~mpicomm.Communicator` (default: the world); its
        :attr:`~mpicomm.Communicator.topology` gives the hosts.
    inner:
        ``"gtopk"``, ``"artopk"`` or ``"allgather"``: the sparse collective across hosts.
    sliced:
        Every lane (local rank ``j`` < the smallest host's size) reduces, selects and
        exchanges its own slice; ``False``: the host's first rank does it for the whole
        vector.
    step:
        Iteration number (>= 0, same on every rank): AR-Top-k's source host.
    algorithm:
        AR-Top-k's allreduce of the values: ``"ring"``, ``"tree"``, ``"auto"``.
    op:
        ``"sum"`` or ``"avg"`` (divided by the number of ranks).
    allow_nonfinite:
        Skip the check that ``x`` is finite.

    Returns ``(indices, values, applied)`` in ``x``'s framework and device: ``indices``
    sorted ascending (int64), ``values`` (``x``'s dtype) identical on every rank, and
    ``applied``, the indices (sorted, int64) at which this rank's *host* contribution
    is in ``values``: the entries each of its ranks should clear in its residual.
    """
    comm = resolve(comm)
    with comm.validating("hierarchical_topk") as agreed:
        agreed.update(k=k, inner=inner, sliced=sliced, step=step, algorithm=algorithm,
                      op=op)
        xt, numel, k, step = read_dense_topk_args(x, k, step, agreed)
        inner = check_choice("inner", inner, INNER)
        algorithm = check_algorithm("AR-Top-k", algorithm, _AR)
        op = check_choice("op", op, ("sum", "avg"))
        if not isinstance(sliced, bool):
            raise ValueError(f"sliced must be True or False, got {sliced!r}")
        xf = xt.reshape(-1)
        if not allow_nonfinite and not all_finite(xf):
            raise ValueError("x contains NaN or infinity (pass allow_nonfinite=True to allow)")

    device = xf.device
    host = xf if device.type == "cpu" or cuda_aware() else xf.cpu()
    ops = ops_for("torch", host.is_cuda)
    h = hierarchy(comm)
    lanes = h.lanes if sliced else 1
    part, a, b = reduce_into_lanes(host, comm, lanes, ops, ring_segment_bytes())
    index_dtype = wire_index_dtype(numel)
    mine = None
    if comm.local_rank < lanes:
        assert h.lane is not None
        j = comm.local_rank
        kj = lane_k(k, lanes, [hi - lo for lo, hi in _pairs(block_bounds(numel, lanes))])[j]
        mine = _across(inner, part, kj, h.lane, step + j, algorithm, index_dtype)
        mine = (mine[0] + a, mine[1], mine[2] + a)
    idx, val, applied = _share(mine, h.local, host, index_dtype)
    if op == "avg" and comm.size > 1:
        val = val / comm.size
    return (to_caller(idx.to(device), x), to_caller(val.to(device), x),
            to_caller(applied.to(device), x))


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:]))


def _across(inner: str, part: torch.Tensor, k: int, lane: Communicator, step: int,
            algorithm: str, index_dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lane's exchange across hosts of its slice sum ``part`` (indices relative to the
    slice): ``(I, V, applied)`` with ``V`` summed over hosts."""
    if part.shape[0] == 0:
        empty = torch.empty(0, dtype=torch.int64, device=part.device)
        return empty, part[:0], empty
    if inner == "artopk":
        src = star_source(step, lane.size)
        if lane.rank == src:
            ix = topk_indices(selection_key(part), k).sort().values.to(index_dtype)
        else:
            ix = torch.empty(k, dtype=index_dtype, device=part.device)
        if lane.size > 1:
            ix = broadcast(ix, root=src, comm=lane, algorithm="binomial")
        ix = ix.to(torch.int64)
        values = part[ix].contiguous()
        if lane.size > 1:
            if algorithm == "auto":
                hosts = cost.HostCosts(lane.topology, network=cost.calibrated(lane)[0])
                name = hosts.lane_allreduce_algorithm(k * part.element_size())
            else:
                name = _AR[algorithm]
            values = allreduce(values, op="sum", algorithm=name, comm=lane)
        return ix, values, ix
    picks = topk_indices(selection_key(part), k).sort().values
    pairs: Pairs = (picks, part[picks].contiguous())
    if inner == "allgather":
        sets = [pairs] if lane.size == 1 else gather_sets(pairs, lane, index_dtype)
        support = torch.unique(torch.cat([s[0] for s in sets]))
        acc = torch.zeros(support.shape[0], dtype=part.dtype, device=part.device)
        for idx, val in sets:  # host order: the same bits on every host
            acc[torch.searchsorted(support, idx)] += val
        return support, acc, picks
    mine = truncate(*pairs, k)
    idx, val, alive = _butterfly(mine, k, lane, index_dtype, track=True, exact_fold=True)
    assert alive is not None  # exact_fold: every rank learns its survivors
    return idx, val, mine[0][alive]


def _share(mine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
           local: Communicator, like: torch.Tensor, index_dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every lane's ``(I, V, applied)`` to every rank of the host (an allgatherv of
    packed bytes inside the host), concatenated in lane order (ascending indices)."""
    value_dtype = like.dtype
    if mine is None:
        payload = torch.empty(0, dtype=torch.uint8, device=like.device)
    else:
        idx, val, applied = mine
        header = torch.tensor([idx.shape[0], applied.shape[0]], dtype=torch.int64,
                              device=like.device)
        payload = pack_bytes([header, idx.to(index_dtype), val, applied.to(index_dtype)])
    if local.size == 1:
        gathered, rows = payload, [payload.shape[0]]
    else:
        gathered, rows = allgatherv(payload, comm=local, algorithm="ring",
                                    return_counts=True)
    parts: list[list[torch.Tensor]] = [[], [], []]
    start = 0
    for n in rows:
        if n:
            buf = gathered[start:start + n]
            head = unpack_bytes(buf[:16], [(torch.int64, 2)])[0]
            ni, na = int(head[0]), int(head[1])
            _, idx, val, applied = unpack_bytes(
                buf, [(torch.int64, 2), (index_dtype, ni), (value_dtype, ni),
                      (index_dtype, na)])
            for out, t in zip(parts, (idx.to(torch.int64), val, applied.to(torch.int64))):
                out.append(t)
        start += n
    return (torch.cat(parts[0]), torch.cat(parts[1]), torch.cat(parts[2]))
