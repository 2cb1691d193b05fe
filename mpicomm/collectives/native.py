"""The MPI library's own collectives (``algorithm="mpi"``), the baseline for ours.

MPI has no portable 16-bit float type, so float16 and bfloat16 reductions use a
user-defined MPI operation over 16-bit words that reinterprets them (numpy for float16,
torch for bfloat16). Those operations run on host memory only; device buffers of those
dtypes need one of mpicomm's own algorithms. The created operations are cached for the
life of the process, like the MPI world itself.

Under the virtual clock (:mod:`mpicomm.clock`) each call is charged as a synchronising
collective (:func:`mpicomm.vwire.collective`): every rank leaves at the latest entry time
plus the cost model's prediction for ``algorithm="mpi"`` (the best of mpicomm's own
algorithms for the size, :func:`mpicomm.collectives.cost.predict`) with the network's
alpha and beta and the cost table's ``reduce`` rate as gamma. It does not queue on the
network model's links.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import clock, vwire
from ..comm import wait_all
from ..p2p import Ctx
from . import cost

_MPI_TYPES = {
    "float32": MPI.FLOAT,
    "float64": MPI.DOUBLE,
    "int8": MPI.INT8_T,
    "uint8": MPI.UINT8_T,
    "int16": MPI.INT16_T,
    "int32": MPI.INT32_T,
    "int64": MPI.INT64_T,
    "float16": MPI.UINT16_T,
    "bfloat16": MPI.UINT16_T,
}
_BUILTIN_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_HALF_OPS: dict[tuple[str, str], MPI.Op] = {}


def _half_op(dtype: str, op: str) -> MPI.Op:
    key = (dtype, "sum" if op == "avg" else op)
    found = _HALF_OPS.get(key)
    if found is not None:
        return found
    if dtype == "float16":
        ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[key[1]]

        def reduce_half(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            acc = np.frombuffer(inoutbuf, dtype=np.float16)
            ufunc(acc, np.frombuffer(inbuf, dtype=np.float16), out=acc)
    else:
        import torch

        def reduce_half(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            if not len(memoryview(inoutbuf)):  # Open MPI may call ops with count 0;
                return                         # torch.frombuffer rejects empty buffers
            acc = torch.frombuffer(inoutbuf, dtype=torch.bfloat16)
            other = torch.frombuffer(inbuf, dtype=torch.bfloat16)
            if key[1] == "sum":
                acc.add_(other)
            elif key[1] == "max":
                torch.maximum(acc, other, out=acc)
            else:
                torch.minimum(acc, other, out=acc)

    created = MPI.Op.Create(reduce_half, commute=True)
    _HALF_OPS[key] = created
    return created


def mpi_type(dtype: str) -> MPI.Datatype:
    return _MPI_TYPES[dtype]


def mpi_op(dtype: str, op: str, on_device: bool) -> MPI.Op:
    if dtype in ("float16", "bfloat16"):
        if on_device:
            raise TypeError(
                f"the MPI library cannot reduce {dtype} device buffers; "
                "use one of mpicomm's own algorithms (e.g. algorithm='ring')"
            )
        return _half_op(dtype, op)
    return _BUILTIN_OPS[op]


def _run(ctx: Ctx, blocking: Any, nonblocking: Any, collective: str, nbytes: float) -> None:
    """Run one MPI collective: blocking, or started nonblocking and polled when the
    context has ``poll_s``; under the virtual clock, charged as the module docstring
    says."""
    if ctx.virtual:
        def model(alpha: float, beta: float, p: int) -> float:
            table = clock.cost_table()
            reduce = table.ops.get("reduce") if table is not None else None
            gamma = reduce.per_unit if reduce is not None else 0.0
            return cost.predict(collective, "mpi", nbytes, p,
                                cost.CostParams(alpha, beta, gamma))

        vwire.collective(ctx.mpi, lambda: wait_all([nonblocking()], ctx.poll_s), model)
    elif ctx.poll_s is None:
        blocking()
    else:
        ctx.wait(nonblocking())


def allreduce(work: Any, op: str, ctx: Ctx, dtype: str) -> None:
    """In-place ``MPI_Allreduce`` of the flat work array (``MPI_Iallreduce`` + polling
    when the context has ``poll_s``; likewise below)."""
    args = (MPI.IN_PLACE, [work, mpi_type(dtype)], mpi_op(dtype, op, ctx.ops.device))
    _run(ctx, lambda: ctx.mpi.Allreduce(*args), lambda: ctx.mpi.Iallreduce(*args),
         "allreduce", work.shape[0] * ctx.ops.itemsize(work))


def allgather(res: Any, ctx: Ctx) -> None:
    """In-place ``MPI_Allgather`` of equal blocks (this rank's block already in ``res``)."""
    msg = ctx.ops.msg(res)
    _run(ctx, lambda: ctx.mpi.Allgather(MPI.IN_PLACE, msg),
         lambda: ctx.mpi.Iallgather(MPI.IN_PLACE, msg), "allgather",
         res.shape[0] * ctx.ops.itemsize(res))


def allgatherv(res: Any, counts: list[int], itemsize: int, ctx: Ctx) -> None:
    """In-place ``MPI_Allgatherv`` with per-rank element ``counts``."""
    byte_counts = [c * itemsize for c in counts]
    displs = [sum(byte_counts[:i]) for i in range(len(byte_counts))]
    message = [res, byte_counts, displs, MPI.BYTE]
    _run(ctx, lambda: ctx.mpi.Allgatherv(MPI.IN_PLACE, message),
         lambda: ctx.mpi.Iallgatherv(MPI.IN_PLACE, message), "allgatherv", sum(byte_counts))


def broadcast(work: Any, root: int, ctx: Ctx) -> None:
    msg = ctx.ops.msg(work)
    _run(ctx, lambda: ctx.mpi.Bcast(msg, root=root), lambda: ctx.mpi.Ibcast(msg, root=root),
         "broadcast", work.shape[0] * ctx.ops.itemsize(work))


def reduce_scatter(send: Any, recv: Any, op: str, ctx: Ctx, dtype: str) -> None:
    """``MPI_Reduce_scatter_block``: rank r receives reduced block r."""
    args = ([send, mpi_type(dtype)], [recv, mpi_type(dtype)],
            mpi_op(dtype, op, ctx.ops.device))
    _run(ctx, lambda: ctx.mpi.Reduce_scatter_block(*args),
         lambda: ctx.mpi.Ireduce_scatter_block(*args), "reduce_scatter",
         send.shape[0] * ctx.ops.itemsize(send))
