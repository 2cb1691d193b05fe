r"""gTop-k: an approximate global top-k of the sum of every rank's sparse vector.

Algorithm (butterfly recursive doubling; Shi et al., "A Distributed Synchronous SGD Algorithm with
Global Top-k Sparsification for Low Bandwidth Networks", ICDCS 2019, arXiv 1901.04359,
in its butterfly form). Each rank holds a sparse set S_r (typically its local top-k of an
error-fed gradient). It first keeps its own top-k of S_r. Then, over ``lg p2`` rounds,
virtual rank ``v`` swaps its current set with virtual rank ``v XOR 2^j`` and both replace
their set by MERGE_TRUNCATE(lower, higher, k): the true sparse union (values *added* at
indices both sets hold, so no index ever appears twice) followed by the top-k of the
union in the library's total order (``|v|`` desc, then index asc). Both partners merge
the same two sets with the lower-ranked operand on the left of every ``+``, so they get
the same bits; after the last round all ranks hold one identical set and no broadcast is
needed. A value's association is fixed by the butterfly: after round j a value is
``(group_lo) + (group_hi)`` of two 2^j-rank groups, identical on every rank and in
:func:`mpicomm.sparse.reference.simulate_gtopk`.

Rank counts that are not a power of two: with ``p2`` the largest power of two <= P and
``rem = P - p2``, ranks ``2r`` (r < rem) first send their set to rank ``2r+1``, which
merges and truncates (fold-in); the butterfly runs over the p2 remaining ranks; rank
``2r+1`` then sends the result back to ``2r`` (fold-out).

What it computes: with at most k pairs per rank and P <= 2, or whenever no truncation
(local or in a merge) ever has to drop anything, the exact top-k of the sum. For P > 2 in
general it is *not* the exact top-k (docs/algorithms.md, gTop-k): an index small in one subtree
can be dropped before the rest of its mass arrives, and a kept value may miss
contributions dropped earlier. The exact version is :func:`mpicomm.sparse.exact_topk`.

Per-rank traffic (s = index bytes + value bytes per pair; index bytes 4, or 8 for an
index space of 2^31 or more; ``m`` = pairs a message holds, ``m <= k``):

* a rank inside the power-of-two group: one message per round, ``lg p2`` messages; the
  odd rank of a folded pair sends one more (the fold-out);
* a folded-out rank (even r < 2 rem): exactly one message (its own truncated set);
* every message holds ``min(k, |set|)`` pairs: k once every set involved has at least k
  entries; fewer when the union of the supports so far is smaller than k.

With every rank holding >= k pairs and every union >= k: ``lg p2 * k * s`` bytes sent per
rank in the group (+ ``k*s`` for fold partners), ``k*s`` for the folded-out ranks.

Cost (critical path): lg p2·(α + k·s·β) + merge compute O(k log k) per round at a power
of two; a non-power of two adds the fold's two messages of k·s bytes and one or two
latencies (the unfolded ranks start the first round at once:
:func:`mpicomm.collectives.cost.gtopk`, :func:`~mpicomm.collectives.cost.folded_butterfly`).
Versus the ring Allgather Top-k, (P-1)(α + k·s·β) and (P-1)·k·s bytes per rank: gTop-k
sends the same at P = 2, 2/3 of it at P = 4, 3/7 at P = 8 and 4/15 at P = 16 (the
busiest rank of a non-power-of-two P sends one message more: 3/4 at P = 5).

Tuning: gTop-k pays off when ``k·s·β`` dominates ``α`` and P is large; for P = 2 it
equals the Allgather Top-k in bytes. Non-powers of two pay two extra message latencies;
prefer power-of-two rank counts. Each round also merges: a sort of <= 2k indices and a
top-k selection on the input's device (about 0.1 µs per pair on one CPU core, e.g.
~0.5 s per round at k = 2.5e6), so on a fast link with large k the merges, not the
bytes, dominate; keep the values on the GPU for large k, and compare with
:func:`mpicomm.sparse.artopk`, whose only per-step compute is the source's selection.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Communicator, resolve
from ..hooks import traced
from ..p2p import (
    Wire,
    fold_layout,
    pack,
    pack_bytes,
    real_rank,
    unpack,
    unpack_bytes,
    virtual_rank,
)
from ._common import (
    TAG_GTOPK_ALIVE,
    TAG_GTOPK_FOLD,
    TAG_GTOPK_ROUND,
    describe_sparse,
    read_topk_args,
    to_caller,
    wire_index_dtype,
)
from .coding import from_wire, to_wire, to_wire_as_read
from .sets import Pairs, members, merge_truncate_tagged, truncate_tagged

__all__ = ["gtopk"]


@traced("gtopk", cat="sparse", describe=describe_sparse("gtopk"))
def gtopk(indices: Any, values: Any, k: int, comm: Communicator | None = None,
          return_dropped: bool = False, *, size: int | None = None,
          allow_nonfinite: bool = False, own_contribution: bool = False,
          coding: str | None = None) -> tuple[Any, ...]:
    """Approximate global top-k of the sum of every rank's sparse (indices, values).

    Parameters
    ----------
    indices, values:
        This rank's sparse vector: 1-D arrays of equal length (numpy, torch CPU/CUDA or
        cupy; same framework and device), integer indices without duplicates, floating
        values (same dtype on every rank). Any order; any count (a rank may hold more or
        fewer than k pairs, or none).
    k:
        Entries kept, same on every rank, ``1 <= k`` (``<= size`` when size is given).
    comm:
        :class:`~mpicomm.Communicator` (default: the world).
    return_dropped:
        Also return a boolean mask over this rank's input pairs (the caller's order):
        True where the pair's index is *not* in the global result, i.e. the local picks
        that go back into the error-feedback residual (error feedback: docs/algorithms.md).
    own_contribution:
        With ``return_dropped``: mark a pair dropped when *this rank's value* did not
        reach the result, even if its index did (through other ranks' values after this
        rank's pair was truncated in a merge on its path, or in the local truncation to
        k). The reference counts such picks as sent although their mass was lost (the
        "small information leak" of A.3); with this flag they go back to the residual.
        Tracked locally, no extra traffic: each own pair carries its position through
        the merges (a gather per merge; the index rule instead searches the result for
        every input pair once, ``O(n log k)``). Exact for every rank of the
        power-of-two group; a folded-out rank (non-power-of-two P) cannot see its
        partner's merges and keeps the index rule. Ours, not the paper's.
    size:
        Length of the dense vector the indices address. Indices must lie in
        ``[0, size)``; it also picks the wire index type (int64 from 2^31 on). When
        omitted, indices must be below 2^31.
    allow_nonfinite:
        Skip the check that values are finite (NaN then ranks as the largest magnitude;
        not with ``coding``).
    coding:
        ``None`` (plain pairs) or ``"log8"``: the butterfly's messages in
        :mod:`mpicomm.sparse.coding`'s format (one byte a value, varint index gaps; about
        2-3 bytes a pair instead of 8). Before each message a rank replaces its set's
        values by what the coding decodes (:func:`~mpicomm.sparse.coding.quantize`), so
        both partners of a round merge the same two decoded sets and still agree bit
        for bit; the result's values are then sums of decoded values, each within the
        coding's 4.4% of what it stands for at every round, and the indices can differ
        from the plain run's where values lie within that error of each other. The
        fold-out of a non-power-of-two P stays plain (the folded-out rank must get the
        same bits). Pair it with an exact reduction of the values at the chosen indices
        where the values matter (:class:`~mpicomm.strategies.GTopK`'s
        ``exact_values``).

    Returns ``(indices, values)`` sorted by index ascending, identical on every rank, in
    the caller's framework and device, with the caller's index and value dtypes (plus
    the dropped mask when asked). The result holds ``min(k, |union of supports|)``
    entries: fewer than k when the ranks' supports together have fewer than k indices.

    Raises ``ValueError``/``TypeError`` before communicating on bad arguments (see
    ``read_pairs`` of the private ``_common``); in checked mode on every rank.
    """
    comm = resolve(comm)
    sp, k, size = read_topk_args(comm, "gtopk", indices, values, k, size, allow_nonfinite,
                                 coding=coding)

    index_dtype = wire_index_dtype(size)
    track = return_dropped and own_contribution
    # each own pair is tagged with its position in sp.idx, so the survivors need no search
    tags = (torch.arange(sp.idx.shape[0], device=sp.idx.device),) if track else ()
    mi, mv, mt = truncate_tagged(sp.idx, sp.val, tags, k)
    idx, val, alive = _butterfly((mi, mv), k, comm, index_dtype, track, coding=coding)
    result = (to_caller(idx, sp.like_idx, dtype=sp.idx_dtype),
              to_caller(val, sp.like_val))
    if not return_dropped:
        return result
    if alive is not None:   # own rule: positions in sp.idx whose value reached the result
        reached = torch.zeros(sp.idx.shape[0], dtype=torch.bool, device=sp.idx.device)
        reached[mt[0][alive]] = True
        dropped = ~sp.in_caller_order(reached)
    else:                   # index rule (or a folded-out rank): the index is in the result
        dropped = ~members(idx, sp.idx_in)
    return (*result, to_caller(dropped, sp.like_val))


def _butterfly(mine: Pairs, k: int, comm: Communicator, index_dtype: torch.dtype,
               track: bool = False, exact_fold: bool = False, coding: str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fold-in, lg p2 butterfly rounds, fold-out; returns the common final set and, with
    ``track``, the positions in ``mine`` (ascending) of this rank's pairs whose value is
    in it (every merge on its path kept them). With ``coding`` the fold-in and the
    rounds send coded sets, and the sender keeps the decoded values of what it sent.

    Tracking carries a position tag per pair through every merge
    (:func:`~mpicomm.sparse.sets.merge_truncate_tagged`): no search, no extra traffic.
    A folded-out rank cannot see its partner's merges and gets ``None``, unless
    ``exact_fold``: then the odd rank of a folded pair tags its partner's pairs too and
    returns the positions of their survivors after the result (one more message of at
    most k positions, tag ``TAG_GTOPK_ALIVE``), so every rank learns exactly which of
    its values reached the result.
    """
    p, r = comm.size, comm.rank
    n = mine[0].shape[0]
    device = mine[0].device

    def untagged(count: int, width: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.full((count,), -1, dtype=torch.int64, device=device)
                     for _ in range(width))

    if p == 1:
        return mine[0], mine[1], (torch.arange(n, device=device) if track else None)
    tags: tuple[torch.Tensor, ...] = (torch.arange(n, device=device),) if track else ()
    value_dtype = mine[1].dtype
    wire = Wire(comm, device)

    def read_set(buf: torch.Tensor) -> Pairs:
        return from_wire(buf, index_dtype, value_dtype, coding, device)

    p2, rem = fold_layout(p)
    folded_pair = r < 2 * rem
    if folded_pair:
        if r % 2 == 0:  # folded out: hand over the set, wait for the answer
            wire.send(to_wire(*mine, index_dtype, coding), r + 1, TAG_GTOPK_FOLD)
            idx, val = unpack(wire.recv(r + 1, TAG_GTOPK_FOLD), index_dtype, value_dtype)
            if not (exact_fold and track):
                return idx, val, None
            got = wire.recv(r + 1, TAG_GTOPK_ALIVE)
            count = got.shape[0] // index_dtype.itemsize
            return idx, val, unpack_bytes(got, [(index_dtype, count)])[0].to(torch.int64)
        theirs = read_set(wire.recv(r - 1, TAG_GTOPK_FOLD))
        count = theirs[0].shape[0]
        if exact_fold and track:  # tag the partner's pairs with their positions as well
            tags = (*tags, *untagged(n, 1))
            theirs_tags = (*untagged(count, 1), torch.arange(count, device=device))
        else:
            theirs_tags = untagged(count, len(tags))
        mi, mv, tags = merge_truncate_tagged(theirs, mine, theirs_tags, tags, k)  # r-1 lower
        mine = (mi, mv)
    v = virtual_rank(r, rem)
    mask = 1
    while mask < p2:
        partner = v ^ mask
        msg, mine = to_wire_as_read(*mine, index_dtype, coding)
        theirs = read_set(wire.exchange(msg, real_rank(partner, rem), TAG_GTOPK_ROUND))
        theirs_tags = untagged(theirs[0].shape[0], len(tags))
        if v < partner:
            mi, mv, tags = merge_truncate_tagged(mine, theirs, tags, theirs_tags, k)
        else:
            mi, mv, tags = merge_truncate_tagged(theirs, mine, theirs_tags, tags, k)
        mine = (mi, mv)
        mask <<= 1
    if folded_pair:  # odd rank of a folded pair: return the result (plain: the same bits)
        wire.send(pack(*mine, index_dtype), r - 1, TAG_GTOPK_FOLD)
        if exact_fold and track:
            survivors = tags[1][tags[1] >= 0].sort().values
            wire.send(pack_bytes([survivors.to(index_dtype)]), r - 1, TAG_GTOPK_ALIVE)
    alive = tags[0][tags[0] >= 0].sort().values if track else None
    return mine[0], mine[1], alive
