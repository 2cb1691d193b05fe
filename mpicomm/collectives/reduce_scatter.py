"""Reduce-scatter: reduce all ranks' buffers and leave block ``r`` on rank ``r``.

The input's first dimension must be divisible by ``p``; rank ``r`` receives rows
``r*n/p:(r+1)*n/p`` of the reduction (shape ``(n/p, *rest)``).

``ring``
    ``p-1`` steps, each reducing one block received from the left neighbour (segmented
    and pipelined). (p-1)α + (p-1)/p·n(β + γ). Bandwidth-optimal for any ``p``. It reads
    the input where it is and writes partial sums to two scratch blocks, so unlike the
    halving algorithm it never copies the whole input.
``recursive_halving``
    ``lg p`` exchanges of halving size. Non-powers of two first fold the first
    ``2(p - p2)`` ranks pairwise (the odd rank of a pair then sends the even rank its
    block at the end). Fewer messages: small and medium messages.
``direct``
    Every rank sends each block straight to its owner and reduces what it receives
    (MPICH's "pairwise" idea with all transfers posted at once). Same bytes and message
    count as the ring, one synchronization point instead of ``p-1`` dependent steps:
    the choice on one node, above all with more ranks than cores.
``mpi``
    ``MPI_Reduce_scatter_block``.
"""

from __future__ import annotations

from typing import Any

from ..buffers import Buffer
from ..comm import Communicator, resolve
from ..config import ring_segment_bytes
from ..hooks import traced
from ..p2p import Ctx, first_real_block, fold_layout, virtual_rank
from . import cost, native
from ._common import (
    TAG_FOLD,
    TAG_REDUCE_SCATTER,
    check_algorithm,
    check_op,
    check_op_dtype,
    describe_dense,
)
from ._halving import fold_in, halve
from ._ring import reduce_scatter_copy_pass

__all__ = ["reduce_scatter", "ALGORITHMS"]


def ring(src: Any, res: Any, m: int, op: str, ctx: Ctx) -> None:
    """Reads ``src`` in place (no copy of the input), reduces block ``rank`` into ``res``."""
    bounds = [i * m for i in range(ctx.size + 1)]
    reduce_scatter_copy_pass(src, res, bounds, ctx.rank, op, ctx, TAG_REDUCE_SCATTER)


def recursive_halving(src: Any, res: Any, m: int, op: str, ctx: Ctx) -> None:
    """Halving reduces in place, so it works on a copy of ``src``."""
    work = ctx.ops.empty_like(src, src.shape[0])
    ctx.ops.copy_(work, src)
    _recursive_halving(work, m, op, ctx)
    ctx.ops.copy_(res, work[ctx.rank * m:(ctx.rank + 1) * m])


def _recursive_halving(work: Any, m: int, op: str, ctx: Ctx) -> None:
    p, r = ctx.size, ctx.rank
    p2, rem = fold_layout(p)
    scratch = ctx.ops.empty_like(work, work.shape[0])
    fold_in(work, op, ctx, rem, scratch)
    v = virtual_rank(r, rem)
    if v >= 0:
        vbounds = [first_real_block(i, rem) * m for i in range(p2 + 1)]
        halve(work, vbounds, v, p2, rem, op, ctx, scratch, TAG_REDUCE_SCATTER)
    if r < 2 * rem:  # the pair's odd rank holds both blocks; hand the even one over
        if r % 2:
            ctx.send(work[(r - 1) * m:r * m], r - 1, TAG_FOLD)
        else:
            ctx.recv(work[r * m:(r + 1) * m], r + 1, TAG_FOLD)


def direct(src: Any, res: Any, m: int, op: str, ctx: Ctx) -> None:
    """Every rank sends block ``j`` of its input straight to rank ``j`` and reduces the
    ``p-1`` blocks it receives into its own, in a fixed order (rank r-1, r-2, ...) so the
    result does not depend on arrival times. All transfers are posted at once: no chain
    of dependent steps, at the price of ``(p-1)·m`` elements of receive space."""
    p, r, ops = ctx.size, ctx.rank, ctx.ops
    sources = [(r - k) % p for k in range(1, p)]
    inbox = ops.empty_like(src, (p - 1) * m)
    recvs = [ctx.irecv(inbox[i * m:(i + 1) * m], q, TAG_REDUCE_SCATTER)
             for i, q in enumerate(sources)]
    sends = [ctx.isend(src[q * m:(q + 1) * m], q, TAG_REDUCE_SCATTER)
             for q in ((r + k) % p for k in range(1, p))]
    own = src[r * m:(r + 1) * m]
    for i, req in enumerate(recvs):
        ctx.wait(req)
        ops.combine_(res, own if i == 0 else res, inbox[i * m:(i + 1) * m], op)
    ctx.waitall(sends)


ALGORITHMS = {"ring": ring, "recursive_halving": recursive_halving, "direct": direct}


@traced("reduce_scatter", describe=describe_dense("reduce_scatter"))
def reduce_scatter(buf: Any, op: str = "sum", algorithm: str = "auto",
                   comm: Communicator | None = None, out: Any = None) -> Any:
    """Reduce ``buf`` over all ranks and return this rank's block of the result.

    ``buf`` has shape ``(p*n, *rest)`` (same on every rank); the result has shape
    ``(n, *rest)`` and holds rows ``rank*n:(rank+1)*n`` of the reduction. ``op``: sum,
    avg (floating dtypes), max, min. ``algorithm``: ``"auto"``, ``"ring"``,
    ``"recursive_halving"``, ``"direct"`` or ``"mpi"``.
    """
    comm = resolve(comm)
    with comm.validating("reduce_scatter") as agreed:
        op = check_op(op)
        algorithm = check_algorithm("reduce_scatter", algorithm, (*ALGORITHMS, "mpi"))
        b = Buffer(buf, comm.resources)
        check_op_dtype(op, b.info)
        shape = b.info.shape
        if algorithm == "auto":  # resolved before the ranks compare their calls
            algorithm = cost.choose("reduce_scatter", b.info.nbytes, comm.size,
                                    comm.resources.get("cost_params"))
        seg = ring_segment_bytes()
        agreed.update(shape=shape, dtype=b.info.dtype, op=op, algorithm=algorithm,
                      segment_bytes=seg)
        if not shape or shape[0] % comm.size:
            raise ValueError(
                f"reduce_scatter needs a first dimension divisible by the {comm.size} "
                f"ranks, got shape {shape}"
            )
        out_shape = (shape[0] // comm.size, *shape[1:])
        b.check_out(out, out_shape)
    m = b.info.numel // comm.size
    res = b.result_array(m, out)
    p = comm.size
    if b.staged and algorithm == "ring" and p > 1 and m:
        # Streamed staging: the input's downloads in the ring's read order (block r-1,
        # r-2, ..., r), each segment waited for just before it is read (mpicomm.staging).
        pipe = b.streamed_input([(q * m, (q + 1) * m)
                                 for q in ((comm.rank - 1 - s) % p for s in range(p))])
        ring(pipe.host, res, m, op, Ctx.of(comm, b.ops, seg, stage=pipe))
    elif comm.size == 1 or m == 0:
        if m:
            b.ops.copy_(res, b.input_view())
    elif algorithm == "mpi":
        ctx = Ctx.of(comm, b.ops, seg)
        native.reduce_scatter(b.input_view(), res, op, ctx, b.info.dtype)
    else:
        ALGORITHMS[algorithm](b.input_view(), res, m, op, Ctx.of(comm, b.ops, seg))
    if op == "avg" and comm.size > 1:
        b.ops.divide_(res, comm.size)
    return b.deliver(res, out_shape, out)
