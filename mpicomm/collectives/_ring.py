"""Ring passes over contiguous blocks, segmented so that transfers pipeline.

Both passes move block ``j`` of a flat work array (elements ``bounds[j]:bounds[j+1]``)
one hop to the right per step. Each block is cut into segments of at most
``segment_bytes``; a segment is forwarded (or reduced and forwarded) as soon as it
arrives, so a step's tail is still in flight while the next step's head is already being
sent, and the reduction of one segment overlaps the transfer of the next. Blocks may have
different sizes (allgatherv) and may be empty.

Cost per pass: (p-1) steps of one block each, i.e. (p-1)α + (p-1)/p·nβ for equal blocks
(+ (p-1)/p·nγ for the reducing pass); segmentation adds no bytes, only messages.
Staged CUDA data (:mod:`mpicomm.staging`): each segment's download is waited for right
before the pass first reads it (``ctx.need``), and each segment is uploaded as soon as it
is final (``ctx.final``: the own block, then every segment of the allgather pass as it
arrives), so the copies overlap the communication of the other segments.

Tuning: ``MPICOMM_RING_SEGMENT_BYTES`` (default 1 MiB; see :mod:`mpicomm.config`, read
by each collective's argument checks and passed down, so every rank of a call uses the
value checked mode compared). Smaller segments pipeline more but cost a Python round
trip (~10 µs) each.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..p2p import Ctx


def _segments(bounds: list[int], block: int, seg: int) -> list[tuple[int, int]]:
    lo, hi = bounds[block], bounds[block + 1]
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


def _segment_elems(work: Any, ctx: Ctx, segment_bytes: int | None) -> int:
    nbytes = ctx.segment_bytes if segment_bytes is None else segment_bytes
    return max(1, nbytes // ctx.ops.itemsize(work))


def reduce_scatter_pass(work: Any, bounds: list[int], final_block: int, op: str, ctx: Ctx,
                        tag: int, segment_bytes: int | None = None) -> None:
    """After this pass, block ``final_block`` of ``work`` holds the reduction over all ranks.

    Every rank must pass the same ``bounds``, and ``final_block`` values that form a
    permutation in ring order (rank r's final block is one more than rank r-1's). At step
    ``s`` a rank sends block ``final_block-1-s`` and reduces block ``final_block-2-s``.
    Other blocks are left partially reduced.
    """
    p, ops = ctx.size, ctx.ops
    right, left = (ctx.rank + 1) % p, (ctx.rank - 1) % p
    seg = _segment_elems(work, ctx, segment_bytes)
    largest = max(bounds[j + 1] - bounds[j] for j in range(p))
    scratch = ops.empty_like(work, largest)
    sends = []
    for a, b in _segments(bounds, (final_block - 1) % p, seg):
        ctx.need(a, b)
        sends.append(ctx.isend(work[a:b], right, tag))
    for step in range(p - 1):
        block = (final_block - 2 - step) % p
        base = bounds[block]
        segs = _segments(bounds, block, seg)
        recvs = [ctx.irecv(scratch[a - base:b - base], left, tag) for a, b in segs]
        for (a, b), req in zip(segs, recvs):
            ctx.need(a, b)
            ctx.wait(req)
            ops.reduce_(work[a:b], scratch[a - base:b - base], op)
            if step < p - 2:
                sends.append(ctx.isend(work[a:b], right, tag))
    ctx.waitall(sends)


def reduce_scatter_copy_pass(src: Any, dst: Any, bounds: list[int], final_block: int,
                             op: str, ctx: Ctx, tag: int,
                             segment_bytes: int | None = None) -> None:
    """:func:`reduce_scatter_pass` that reads ``src`` without writing it and leaves the
    reduction of block ``final_block`` in ``dst`` (``len(dst)`` = that block's size).

    The partial sums it forwards live in two scratch blocks used alternately (a block's
    sends must finish before it is reused two steps later), so the caller needs no copy
    of the whole input: the reduction of a received segment is computed straight from
    ``src`` into the scratch block or, at the last step, into ``dst``. Same messages,
    bytes and reduction order as :func:`reduce_scatter_pass`.
    """
    p, ops = ctx.size, ctx.ops
    right, left = (ctx.rank + 1) % p, (ctx.rank - 1) % p
    seg = _segment_elems(src, ctx, segment_bytes)
    largest = max(bounds[j + 1] - bounds[j] for j in range(p))
    received = ops.empty_like(src, largest)
    partial = [ops.empty_like(src, largest), ops.empty_like(src, largest)]
    in_flight: list[list[MPI.Request]] = [[], []]
    sends = []
    for a, b in _segments(bounds, (final_block - 1) % p, seg):
        ctx.need(a, b)
        sends.append(ctx.isend(src[a:b], right, tag))
    for step in range(p - 1):
        block = (final_block - 2 - step) % p
        base = bounds[block]
        last = step == p - 2
        if last:
            target = dst
        else:
            target = partial[step % 2]
            ctx.waitall(in_flight[step % 2])
            in_flight[step % 2] = []
        segs = _segments(bounds, block, seg)
        recvs = [ctx.irecv(received[a - base:b - base], left, tag) for a, b in segs]
        for (a, b), req in zip(segs, recvs):
            ctx.need(a, b)
            ctx.wait(req)
            out = target[a - base:b - base]
            ops.combine_(out, src[a:b], received[a - base:b - base], op)
            if not last:
                in_flight[step % 2].append(ctx.isend(out, right, tag))
    ctx.waitall(sends + in_flight[0] + in_flight[1])


def allgather_pass(work: Any, bounds: list[int], own_block: int, ctx: Ctx, tag: int,
                   segment_bytes: int | None = None, right: int | None = None,
                   left: int | None = None) -> None:
    """Circulate every rank's block so that all of ``work`` is filled on every rank.

    On entry block ``own_block`` holds this rank's data; the right neighbour's own block
    must be ``own_block + 1`` (mod p). ``right``/``left`` default to rank±1; broadcast's
    scatter-allgather passes its relative-rank neighbours.
    """
    p = ctx.size
    right = (ctx.rank + 1) % p if right is None else right
    left = (ctx.rank - 1) % p if left is None else left
    seg = _segment_elems(work, ctx, segment_bytes)
    sends = []
    for a, b in _segments(bounds, own_block, seg):
        ctx.need(a, b)
        sends.append(ctx.isend(work[a:b], right, tag))
        ctx.final(a, b)
    for step in range(p - 1):
        block = (own_block - 1 - step) % p
        segs = _segments(bounds, block, seg)
        recvs = [ctx.irecv(work[a:b], left, tag) for a, b in segs]
        for (a, b), req in zip(segs, recvs):
            ctx.wait(req)
            ctx.final(a, b)
            if step < p - 2:
                sends.append(ctx.isend(work[a:b], right, tag))
    ctx.waitall(sends)
