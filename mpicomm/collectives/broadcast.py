"""Broadcast: every rank gets a copy of the root's buffer.

``binomial``
    A binomial tree rooted at ``root``: ``⌈lg p⌉`` rounds, each rank receives once from
    its parent and forwards to its children. ⌈lg p⌉(α + nβ). Small messages.
``scatter_allgather``
    Van de Geijn: a binomial scatter of ``p`` chunks followed by a ring allgather.
    (⌈lg p⌉ + p - 1)α + 2(p-1)/p·nβ, so nearly independent of ``p`` in bandwidth.
    Large messages.
``mpi``
    ``MPI_Bcast``.

On non-root ranks ``buf`` only supplies the shape and dtype (its contents are ignored),
as with ``MPI_Bcast``; the result is a new array unless ``out`` is given (``out=buf``
broadcasts in place, like ``torch.distributed.broadcast``).
"""

from __future__ import annotations

from typing import Any

from ..buffers import Buffer
from ..comm import Communicator, resolve
from ..config import ring_segment_bytes
from ..hooks import traced
from ..p2p import Ctx, block_bounds
from . import cost, native
from ._common import TAG_BCAST, check_algorithm, check_root, describe_dense
from ._ring import allgather_pass

__all__ = ["broadcast", "ALGORITHMS"]


def binomial(work: Any, root: int, ctx: Ctx) -> None:
    p = ctx.size
    rel = (ctx.rank - root) % p
    mask = 1
    while mask < p:
        if rel & mask:
            ctx.recv(work, (ctx.rank - mask) % p, TAG_BCAST)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if rel + mask < p:
            ctx.send(work, (ctx.rank + mask) % p, TAG_BCAST)
        mask >>= 1


def scatter_allgather(work: Any, root: int, ctx: Ctx) -> None:
    p = ctx.size
    rel = (ctx.rank - root) % p
    bounds = block_bounds(work.shape[0], p)  # chunk j belongs to relative rank j

    def chunks(first: int, count: int) -> Any:
        return work[bounds[first]:bounds[min(first + count, p)]]

    mask = 1
    while mask < p:
        if rel & mask:
            ctx.recv(chunks(rel, mask), (ctx.rank - mask) % p, TAG_BCAST)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if rel + mask < p:
            ctx.send(chunks(rel + mask, mask), (ctx.rank + mask) % p, TAG_BCAST)
        mask >>= 1
    allgather_pass(work, bounds, rel, ctx, TAG_BCAST)


ALGORITHMS = {"binomial": binomial, "scatter_allgather": scatter_allgather}


@traced("broadcast", describe=describe_dense("broadcast"))
def broadcast(buf: Any, root: int = 0, comm: Communicator | None = None,
              algorithm: str = "auto", out: Any = None) -> Any:
    """Return the ``root`` rank's ``buf`` on every rank.

    ``buf`` must have the same shape and dtype on every rank. ``algorithm``: ``"auto"``,
    ``"binomial"``, ``"scatter_allgather"`` or ``"mpi"``.
    """
    comm = resolve(comm)
    with comm.validating("broadcast") as agreed:
        algorithm = check_algorithm("broadcast", algorithm, (*ALGORITHMS, "mpi"))
        root = check_root(root, comm.size)
        b = Buffer(buf, comm.resources)
        if algorithm == "auto":  # resolved before the ranks compare their calls
            algorithm = cost.choose("broadcast", b.info.nbytes, comm.size,
                                    comm.resources.get("cost_params"))
        seg = ring_segment_bytes()
        agreed.update(shape=b.info.shape, dtype=b.info.dtype, root=root, algorithm=algorithm,
                      segment_bytes=seg)
        b.check_out(out, b.info.shape)
    if b.staged and algorithm == "scatter_allgather" and comm.size > 1 and b.info.numel:
        # Streamed staging: the root needs its whole input for the scatter; every rank
        # uploads each segment of the allgather pass as it arrives (mpicomm.staging).
        pipe = b.stream(b.info.numel, b.info.shape, out,
                        slot="in" if comm.rank == root else "out")
        if comm.rank == root:
            pipe.download_all(b.device_flat())
        scatter_allgather(pipe.host, root, Ctx.of(comm, b.ops, seg, stage=pipe))
        return b.deliver(pipe.host, b.info.shape, out)
    if comm.rank == root:
        work = b.writable_copy(out)
    else:
        work = b.result_array(b.info.numel, out)
    if comm.size > 1 and b.info.numel > 0:
        ctx = Ctx.of(comm, b.ops, seg)
        if algorithm == "mpi":
            native.broadcast(work, root, ctx)
        else:
            ALGORITHMS[algorithm](work, root, ctx)
    return b.deliver(work, b.info.shape, out)
