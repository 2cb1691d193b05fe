"""Allreduce: every rank ends with the elementwise reduction of all ranks' buffers.

Algorithms (costs in :mod:`mpicomm.collectives.cost`):

``ring``
    Ring reduce-scatter then ring allgather over ``p`` blocks (the "Baidu ring"),
    segmented so each segment is reduced and forwarded as soon as it arrives.
    Bandwidth-optimal: 2(p-1)/p·n bytes per rank. Best for large messages.
``recursive_doubling``
    ``lg p`` rounds; in round j a rank exchanges its whole vector with ``rank XOR 2^j``
    and reduces. Fewest messages, n·lg p bytes: for small messages.
``rabenseifner``
    Recursive-halving reduce-scatter then recursive-doubling allgather: ``2 lg p``
    messages and 2(p-1)/p·n bytes. Large messages on power-of-two rank counts.
``hierarchical``
    Reduce-scatter inside each host, allreduce of each slice across hosts (one lane
    per local rank), allgather inside each host (:mod:`mpicomm.collectives.
    hierarchical`): the communicator's host layout decides (:mod:`mpicomm.topology`).
``mpi``
    The MPI library's ``MPI_Allreduce`` (the baseline).
``auto``
    The algorithm with the smallest predicted time under the communicator's cost
    parameters (on a layout of several hosts with several ranks, the two link classes
    of :func:`mpicomm.collectives.cost.host_costs`, the hierarchical algorithm
    included; ``comm.resources["cost_params"]``, default
    :class:`~mpicomm.collectives.cost.CostParams`; measured ones only after
    :func:`mpicomm.collectives.calibrate.measure` with ``store=True``: calibration is
    never automatic). It is resolved during the argument checks, so checked mode
    catches ranks whose cost parameters pick different algorithms.

Non-power-of-two rank counts fold the first ``2(p - p2)`` ranks pairwise (two extra
messages of n bytes). Every rank gets bit-identical results: each reduction is either
computed once and copied, or computed symmetrically with commutative operations.
``op="avg"`` reduces as a sum and divides by ``p`` at the end (floating dtypes only).
"""

from __future__ import annotations

from typing import Any

from ..buffers import Buffer
from ..comm import Communicator, resolve
from ..config import ring_segment_bytes
from ..hooks import traced
from ..p2p import Ctx, block_bounds, fold_layout, real_rank, virtual_rank
from . import hierarchical, native
from ._common import (
    TAG_ALLREDUCE,
    check_algorithm,
    check_op,
    check_op_dtype,
    choose_auto,
    describe_dense,
)
from ._halving import double, fold_in, fold_out, halve
from ._ring import allgather_pass, reduce_scatter_pass

__all__ = ["allreduce", "ALGORITHMS"]


def ring_read_order(n: int, rank: int, size: int) -> list[tuple[int, int]]:
    """The blocks of an ``n``-element work array in the order :func:`ring` first reads
    them on ``rank`` (its reduce-scatter sends block ``rank``, then reduces ``rank-1``,
    ``rank-2``, ...): the order in which staged data is downloaded."""
    bounds = block_bounds(n, size)
    return [(bounds[j], bounds[j + 1]) for j in ((rank - s) % size for s in range(size))]


def ring(work: Any, op: str, ctx: Ctx) -> None:
    """Ring reduce-scatter, then (``avg``) each rank divides the block it owns, then ring
    allgather. Dividing before the allgather gives the same bits as dividing the whole
    result afterwards (each element is divided once, by its owner) and lets every
    segment be final, hence uploaded when staging, the moment it arrives."""
    bounds = block_bounds(work.shape[0], ctx.size)
    owned = (ctx.rank + 1) % ctx.size
    reduce_scatter_pass(work, bounds, owned, op, ctx, TAG_ALLREDUCE)
    if op == "avg":
        ctx.ops.divide_(work[bounds[owned]:bounds[owned + 1]], ctx.size)
    allgather_pass(work, bounds, owned, ctx, TAG_ALLREDUCE)


def recursive_doubling(work: Any, op: str, ctx: Ctx) -> None:
    p2, rem = fold_layout(ctx.size)
    scratch = ctx.ops.empty_like(work, work.shape[0])
    fold_in(work, op, ctx, rem, scratch)
    v = virtual_rank(ctx.rank, rem)
    if v >= 0:
        mask = 1
        while mask < p2:
            peer = real_rank(v ^ mask, rem)
            ctx.sendrecv(work, peer, scratch, peer, TAG_ALLREDUCE)
            ctx.ops.reduce_(work, scratch, op)
            mask <<= 1
    fold_out(work, ctx, rem)


def rabenseifner(work: Any, op: str, ctx: Ctx) -> None:
    n = work.shape[0]
    p2, rem = fold_layout(ctx.size)
    vbounds = block_bounds(n, p2)
    first_half = vbounds[p2 // 2]
    scratch = ctx.ops.empty_like(work, n if rem else max(first_half, n - first_half))
    fold_in(work, op, ctx, rem, scratch)
    v = virtual_rank(ctx.rank, rem)
    if v >= 0:
        history = halve(work, vbounds, v, p2, rem, op, ctx, scratch, TAG_ALLREDUCE)
        double(work, vbounds, history, ctx, TAG_ALLREDUCE)
    fold_out(work, ctx, rem)


ALGORITHMS = {"ring": ring, "recursive_doubling": recursive_doubling,
              "rabenseifner": rabenseifner}


@traced("allreduce", describe=describe_dense("allreduce"))
def allreduce(buf: Any, op: str = "sum", algorithm: str = "auto",
              comm: Communicator | None = None, out: Any = None) -> Any:
    """Reduce ``buf`` elementwise over all ranks; every rank gets the result.

    Parameters
    ----------
    buf:
        numpy array, torch tensor (CPU/CUDA) or cupy array; any shape, a supported dtype
        (float16, bfloat16, float32, float64, int8..int64).
    op:
        ``"sum"``, ``"avg"`` (floating dtypes), ``"max"`` or ``"min"``.
    algorithm:
        ``"auto"``, ``"ring"``, ``"recursive_doubling"``, ``"rabenseifner"``,
        ``"hierarchical"`` or ``"mpi"``.
    comm:
        :class:`~mpicomm.Communicator` (default: the world).
    out:
        Optional contiguous array of the same kind, dtype, device and shape to write the
        result into; pass ``out=buf`` for an in-place allreduce.

    Returns a new array of ``buf``'s framework, dtype, device and shape (or ``out``).
    Raises ``ValueError``/``TypeError`` on bad arguments before communicating.
    """
    comm = resolve(comm)
    with comm.validating("allreduce") as agreed:
        op = check_op(op)
        algorithm = check_algorithm("allreduce", algorithm,
                                    (*ALGORITHMS, "hierarchical", "mpi"))
        b = Buffer(buf, comm.resources)
        check_op_dtype(op, b.info)
        if algorithm == "auto":  # resolved before the ranks compare their calls
            algorithm = choose_auto("allreduce", b.info.nbytes, comm)
        seg = ring_segment_bytes()
        agreed.update(shape=b.info.shape, dtype=b.info.dtype, op=op, algorithm=algorithm,
                      segment_bytes=seg)
        b.check_out(out, b.info.shape)
    n, p = b.info.numel, comm.size
    if b.staged and algorithm == "ring" and p > 1 and n > 0:
        # Streamed staging: downloads in the ring's read order, uploads as segments
        # become final (mpicomm.staging); the host array is the pool's whole "in" slot.
        pipe = b.stream(n, b.info.shape, out, slot="in")
        pipe.prefetch(b.device_flat(), 0, ring_read_order(n, comm.rank, p))
        ring(pipe.host, op, Ctx.of(comm, b.ops, seg, stage=pipe))
        return b.deliver(pipe.host, b.info.shape, out)
    work = b.writable_copy(out)
    if p > 1 and n > 0:
        ctx = Ctx.of(comm, b.ops, seg)
        if algorithm == "mpi":
            native.allreduce(work, op, ctx, b.info.dtype)
        elif algorithm == "hierarchical":
            hierarchical.allreduce(work, op, comm, b.ops, seg, ALGORITHMS)
        else:
            ALGORITHMS[algorithm](work, op, ctx)
    if op == "avg" and p > 1 and algorithm not in ("ring", "hierarchical"):
        # (the ring and the hierarchical algorithm divide their own blocks)
        b.ops.divide_(work, p)
    return b.deliver(work, b.info.shape, out)
