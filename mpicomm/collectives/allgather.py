"""Allgather and allgatherv: every rank gets all ranks' buffers concatenated along axis 0.

Algorithms for :func:`allgather` (equal shapes on every rank):

``ring``
    ``p-1`` steps, each forwarding one block to the right neighbour (segmented and
    pipelined). (p-1)α + (p-1)/p·nβ, n = total bytes. Large messages.
``bruck``
    ``⌈lg p⌉`` steps for any ``p``: in step j a rank sends everything it holds so far to
    ``rank - 2^j`` and receives as much from ``rank + 2^j``, then rotates the result into
    rank order. Few messages: small messages, any rank count.
``recursive_doubling``
    ``lg p`` exchanges with ``rank XOR 2^j`` of aligned, contiguous ranges. Non-powers of
    two fold the first ``2(p - p2)`` ranks pairwise (the pair's two blocks are adjacent,
    so every range stays contiguous), adding two messages.
``direct``
    Every rank posts all ``p-1`` receives and sends its block straight to every other
    rank at once (from the input itself; the copy into its own slot of the result
    overlaps the transfers). Same bytes and message count as the ring but no forwarding chain: one
    synchronization point instead of ``p-1`` dependent steps, which is what pays on one
    node, above all with more ranks than cores (a rank that gets the CPU can move all its
    data instead of waiting for its neighbour's previous step). Across a network, where
    ``p-1`` simultaneous flows share a link, prefer the ring.
``hierarchical``
    Allgather inside each host, each slice of the host's data gathered across hosts by
    its lane, allgather of the lanes' results inside each host
    (:mod:`mpicomm.collectives.hierarchical`; the communicator's host layout decides).
``mpi``
    ``MPI_Allgather``.

:func:`allgatherv` lets every rank contribute a different number of rows; it first
gathers each rank's row count and trailing shape (one small allgather, which also
verifies that trailing shapes and dtypes agree on every rank), then runs a ring over
unequal blocks, the direct exchange, or ``MPI_Allgatherv``.

A 0-d input is treated as one element: the result has shape ``(p,)``.
"""

from __future__ import annotations

import math
from typing import Any

from ..buffers import Buffer
from ..comm import Communicator, resolve
from ..config import ring_segment_bytes
from ..hooks import traced
from ..p2p import Ctx, first_real_block, fold_layout, real_rank, virtual_rank
from . import hierarchical, native
from ._common import TAG_ALLGATHER, TAG_FOLD, check_algorithm, choose_auto, describe_dense
from ._ring import allgather_pass

__all__ = ["allgather", "allgatherv", "ALGORITHMS"]


def ring(res: Any, m: int, ctx: Ctx) -> None:
    bounds = [i * m for i in range(ctx.size + 1)]
    allgather_pass(res, bounds, ctx.rank, ctx, TAG_ALLGATHER)


def bruck(res: Any, m: int, ctx: Ctx) -> None:
    p, r, ops = ctx.size, ctx.rank, ctx.ops
    tmp = ops.empty_like(res, p * m)
    ops.copy_(tmp[:m], res[r * m:(r + 1) * m])
    held, dist = 1, 1
    while dist < p:
        count = min(dist, p - held)
        ctx.sendrecv(tmp[:count * m], (r - dist) % p,
                     tmp[held * m:(held + count) * m], (r + dist) % p, TAG_ALLGATHER)
        held += count
        dist <<= 1
    # tmp holds the blocks of ranks r, r+1, ..., r+p-1 (mod p): rotate into rank order.
    ops.copy_(res[r * m:], tmp[:(p - r) * m])
    if r:
        ops.copy_(res[:r * m], tmp[(p - r) * m:])


def recursive_doubling(res: Any, m: int, ctx: Ctx) -> None:
    p, r = ctx.size, ctx.rank
    p2, rem = fold_layout(p)
    if r < 2 * rem:
        if r % 2 == 0:
            ctx.send(res[r * m:(r + 1) * m], r + 1, TAG_FOLD)
        else:
            ctx.recv(res[(r - 1) * m:r * m], r - 1, TAG_FOLD)
    v = virtual_rank(r, rem)
    if v >= 0:
        mask = 1
        while mask < p2:
            partner = v ^ mask
            mine, theirs = (v // mask) * mask, (partner // mask) * mask
            a0, a1 = first_real_block(mine, rem) * m, first_real_block(mine + mask, rem) * m
            b0, b1 = (first_real_block(theirs, rem) * m,
                      first_real_block(theirs + mask, rem) * m)
            peer = real_rank(partner, rem)
            ctx.sendrecv(res[a0:a1], peer, res[b0:b1], peer, TAG_ALLGATHER)
            mask <<= 1
    if r < 2 * rem:
        if r % 2 == 0:
            ctx.recv(res, r + 1, TAG_FOLD)
        else:
            ctx.send(res, r - 1, TAG_FOLD)


def direct_pass(res: Any, bounds: list[int], ctx: Ctx, src: Any) -> None:
    """Every rank sends its block (``src``, destined for ``bounds[r]:bounds[r+1]``) to
    every other rank directly, and copies it into its own slot of ``res`` while the
    transfers are in flight.

    Receives are posted first; sends go to ``r+1, r+2, ...`` so that at any moment the
    ranks target different destinations. Empty blocks are not sent.
    """
    p, r, ops = ctx.size, ctx.rank, ctx.ops
    requests = []
    for k in range(1, p):
        q = (r - k) % p
        if bounds[q + 1] > bounds[q]:
            requests.append(ctx.irecv(res[bounds[q]:bounds[q + 1]], q, TAG_ALLGATHER))
    if src.shape[0]:
        requests.extend(ctx.isend(src, (r + k) % p, TAG_ALLGATHER) for k in range(1, p))
        own = res[bounds[r]:bounds[r + 1]]
        if ops.data_ptr(own) != ops.data_ptr(src):
            ops.copy_(own, src)
    ctx.waitall(requests)


def direct(res: Any, m: int, ctx: Ctx) -> None:
    """:func:`direct_pass` with this rank's block already in place in ``res``."""
    r = ctx.rank
    direct_pass(res, [i * m for i in range(ctx.size + 1)], ctx, res[r * m:(r + 1) * m])


ALGORITHMS = {"ring": ring, "bruck": bruck, "recursive_doubling": recursive_doubling,
              "direct": direct}


def _streamed_ring(b: Buffer, bounds: list[int], out_shape: tuple[int, ...], out: Any,
                   ctx: Ctx) -> Any:
    """Ring allgather(v) of staged CUDA data: this rank's block is downloaded straight
    into its slot of the pinned result, and every segment is uploaded as it arrives
    (:mod:`mpicomm.staging`); same messages as the host ring."""
    pipe = b.stream(bounds[-1], out_shape, out)
    r = ctx.rank
    pipe.prefetch(b.device_flat(), bounds[r], [(bounds[r], bounds[r + 1])])
    ctx.stage = pipe
    allgather_pass(pipe.host, bounds, r, ctx, TAG_ALLGATHER)
    return b.deliver(pipe.host, out_shape, out)


def _gathered_shape(shape: tuple[int, ...], rows_total: int) -> tuple[int, ...]:
    return (rows_total, *shape[1:])


@traced("allgather", describe=describe_dense("allgather"))
def allgather(buf: Any, algorithm: str = "auto", comm: Communicator | None = None,
              out: Any = None) -> Any:
    """Concatenate every rank's ``buf`` along axis 0, in rank order, on every rank.

    ``buf`` must have the same shape and dtype on every rank (checked mode verifies it;
    use :func:`allgatherv` for different lengths). Shape ``(n, *rest)`` gives
    ``(p*n, *rest)``. ``algorithm``: ``"auto"``, ``"ring"``, ``"bruck"``,
    ``"recursive_doubling"``, ``"direct"``, ``"hierarchical"`` or ``"mpi"``. ``out``:
    optional contiguous destination.
    """
    comm = resolve(comm)
    with comm.validating("allgather") as agreed:
        algorithm = check_algorithm("allgather", algorithm,
                                    (*ALGORITHMS, "hierarchical", "mpi"))
        b = Buffer(buf, comm.resources)
        if algorithm == "auto":  # resolved before the ranks compare their calls
            algorithm = choose_auto("allgather", b.info.nbytes * comm.size, comm)
        seg = ring_segment_bytes()
        agreed.update(shape=b.info.shape, dtype=b.info.dtype, algorithm=algorithm,
                      segment_bytes=seg)
        shape = b.info.shape if b.info.shape else (1,)
        out_shape = _gathered_shape(shape, comm.size * shape[0])
        b.check_out(out, out_shape)
    m, p = b.info.numel, comm.size
    if b.staged and algorithm == "ring" and p > 1 and m > 0:
        return _streamed_ring(b, [i * m for i in range(p + 1)], out_shape, out,
                              Ctx.of(comm, b.ops, seg))
    res = b.result_array(m * p, out)
    src = b.input_view()
    if p > 1 and m > 0 and algorithm == "direct":  # sends from src, copies meanwhile
        direct_pass(res, [i * m for i in range(p + 1)], Ctx.of(comm, b.ops, seg), src)
        return b.deliver(res, out_shape, out)
    if p > 1 and m > 0 and algorithm == "hierarchical":
        hierarchical.allgather(res, src, m, comm, b.ops, seg)
        return b.deliver(res, out_shape, out)
    own = res[comm.rank * m:(comm.rank + 1) * m]
    if m and b.ops.data_ptr(own) != b.ops.data_ptr(src):
        b.ops.copy_(own, src)
    if p > 1 and m > 0:
        ctx = Ctx.of(comm, b.ops, seg)
        if algorithm == "mpi":
            native.allgather(res, ctx)
        else:
            ALGORITHMS[algorithm](res, m, ctx)
    return b.deliver(res, out_shape, out)


@traced("allgatherv", describe=describe_dense("allgatherv"))
def allgatherv(buf: Any, comm: Communicator | None = None, out: Any = None,
               algorithm: str = "auto", return_counts: bool = False) -> Any:
    """Concatenate along axis 0 buffers whose first dimension differs between ranks.

    Trailing dimensions and dtype must agree on every rank; a mismatch raises the same
    ``ValueError`` on every rank (checked whatever the mode, since the row counts are
    exchanged anyway, together with ``MPICOMM_RING_SEGMENT_BYTES``). ``algorithm``:
    ``"auto"`` (always the ring: no cost model for uneven blocks yet), ``"ring"``,
    ``"direct"`` or ``"mpi"``.
    With ``return_counts=True`` returns ``(result, rows_per_rank)``.
    """
    comm = resolve(comm)
    error: Exception | None = None
    try:
        algorithm = check_algorithm("allgatherv", algorithm, ("ring", "direct", "mpi"))
        if algorithm == "auto":
            algorithm = "ring"
        seg = ring_segment_bytes()
        b = Buffer(buf, comm.resources)
        shape = b.info.shape if b.info.shape else (1,)
        mine = (shape[0], shape[1:], b.info.dtype, algorithm, seg)
    except (ValueError, TypeError) as exc:
        error, mine = exc, None
    # The row counts must be exchanged anyway; each rank's verdict on its own arguments
    # travels with them, so a bad argument on one rank raises on every rank.
    everyone = comm.allgather_object((None if error is None else repr(error), mine))
    for rank, (verdict, _) in enumerate(everyone):
        if verdict is not None:
            if error is not None:
                raise error
            raise ValueError(f"allgatherv: rank {rank} rejected its arguments: {verdict}")
    for rank, (_, (_, rest, dtype, algo, their_seg)) in enumerate(everyone):
        if (rest, dtype, algo) != (shape[1:], b.info.dtype, algorithm):
            raise ValueError(
                f"allgatherv: rank {rank} has trailing shape {rest} {dtype} (algorithm "
                f"{algo!r}) but rank {comm.rank} has {shape[1:]} {b.info.dtype} "
                f"(algorithm {algorithm!r}); only the first dimension may differ"
            )
        if their_seg != seg:
            raise ValueError(
                f"allgatherv: MPICOMM_RING_SEGMENT_BYTES is {their_seg} on rank {rank} but "
                f"{seg} on rank {comm.rank}; set it to the same value on every rank")
    rows = [e[1][0] for e in everyone]
    row_numel = math.prod(shape[1:])
    out_shape = _gathered_shape(shape, sum(rows))
    with comm.validating("allgatherv out"):
        b.check_out(out, out_shape)
    counts = [r * row_numel for r in rows]
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    if b.staged and algorithm == "ring" and comm.size > 1 and bounds[-1] > 0:
        result = _streamed_ring(b, bounds, out_shape, out, Ctx.of(comm, b.ops, seg))
        return (result, rows) if return_counts else result
    res = b.result_array(bounds[-1], out)
    src = b.input_view()
    if comm.size > 1 and bounds[-1] > 0 and algorithm == "direct":
        direct_pass(res, bounds, Ctx.of(comm, b.ops, seg), src)
        result = b.deliver(res, out_shape, out)
        return (result, rows) if return_counts else result
    own = res[bounds[comm.rank]:bounds[comm.rank + 1]]
    if counts[comm.rank] and b.ops.data_ptr(own) != b.ops.data_ptr(src):
        b.ops.copy_(own, src)
    if comm.size > 1 and bounds[-1] > 0:
        ctx = Ctx.of(comm, b.ops, seg)
        if algorithm == "mpi":
            native.allgatherv(res, counts, b.info.itemsize, ctx)
        else:
            allgather_pass(res, bounds, comm.rank, ctx, TAG_ALLGATHER)
    result = b.deliver(res, out_shape, out)
    return (result, rows) if return_counts else result

