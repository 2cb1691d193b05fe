"""Reduce-scatter: reduce all ranks' buffers and leave block ``r`` on rank ``r``.

The input's first dimension must be divisible by ``p``; rank ``r`` receives rows
``r*n/p:(r+1)*n/p`` of the reduction (shape ``(n/p, *rest)``).

``ring``
    ``p-1`` steps, each reducing one block received from the left neighbour (segmented
    and pipelined). (p-1)α + (p-1)/p·n(β + γ). Bandwidth-optimal for any ``p``.
``recursive_halving``
    ``lg p`` exchanges of halving size. Non-powers of two first fold the first
    ``2(p - p2)`` ranks pairwise (the odd rank of a pair then sends the even rank its
    block at the end). Fewer messages: small and medium messages.
``mpi``
    ``MPI_Reduce_scatter_block``.
"""

from __future__ import annotations

from typing import Any

from ..buffers import Buffer
from ..comm import Communicator, resolve
from . import cost, native
from ._common import (
    TAG_FOLD,
    TAG_REDUCE_SCATTER,
    Ctx,
    check_algorithm,
    check_op,
    check_op_dtype,
    first_real_block,
    fold_layout,
    virtual_rank,
)
from ._halving import fold_in, halve
from ._ring import reduce_scatter_pass

__all__ = ["reduce_scatter", "ALGORITHMS"]


def ring(work: Any, m: int, op: str, ctx: Ctx) -> None:
    bounds = [i * m for i in range(ctx.size + 1)]
    reduce_scatter_pass(work, bounds, ctx.rank, op, ctx, TAG_REDUCE_SCATTER)


def recursive_halving(work: Any, m: int, op: str, ctx: Ctx) -> None:
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


ALGORITHMS = {"ring": ring, "recursive_halving": recursive_halving}


def reduce_scatter(buf: Any, op: str = "sum", algorithm: str = "auto",
                   comm: Communicator | None = None, out: Any = None) -> Any:
    """Reduce ``buf`` over all ranks and return this rank's block of the result.

    ``buf`` has shape ``(p*n, *rest)`` (same on every rank); the result has shape
    ``(n, *rest)`` and holds rows ``rank*n:(rank+1)*n`` of the reduction. ``op``: sum,
    avg (floating dtypes), max, min. ``algorithm``: ``"auto"``, ``"ring"``,
    ``"recursive_halving"`` or ``"mpi"``.
    """
    comm = resolve(comm)
    op = check_op(op)
    algorithm = check_algorithm("reduce_scatter", algorithm, (*ALGORITHMS, "mpi"))
    b = Buffer(buf, comm.resources)
    check_op_dtype(op, b.info)
    shape = b.info.shape
    if not shape or shape[0] % comm.size:
        raise ValueError(
            f"reduce_scatter needs a first dimension divisible by the {comm.size} ranks, "
            f"got shape {shape}"
        )
    out_shape = (shape[0] // comm.size, *shape[1:])
    b.check_out(out, out_shape)
    comm.check_collective("reduce_scatter", shape=shape, dtype=b.info.dtype, op=op,
                          algorithm=algorithm)
    if algorithm == "auto":
        algorithm = cost.choose("reduce_scatter", b.info.nbytes, comm.size,
                                comm.resources.get("cost_params"))
    m = b.info.numel // comm.size
    lo, hi = comm.rank * m, (comm.rank + 1) * m
    res = b.result_array(m, out)
    if comm.size == 1 or m == 0:
        if m:
            b.ops.copy_(res, b.input_view())
    elif algorithm == "mpi":
        ctx = Ctx.of(comm, b.ops)
        native.reduce_scatter(b.input_view(), res, op, ctx, b.info.dtype)
    else:
        ctx = Ctx.of(comm, b.ops)
        work = b.writable_copy()
        ALGORITHMS[algorithm](work, m, op, ctx)
        b.ops.copy_(res, work[lo:hi])
    if op == "avg" and comm.size > 1:
        b.ops.divide_(res, comm.size)
    return b.deliver(res, out_shape, out)
