r"""Hierarchical dense collectives: shared memory inside hosts, the network across them.

On a cluster of ``H`` hosts (:mod:`mpicomm.topology`; ``R_h`` ranks on host ``h``) a
flat collective treats every link alike. The hierarchical ones split the work by link
class. With ``L = min_h R_h`` *lanes* (local rank ``j < L`` of every host carries slice
``j`` of the vector across the network):

**allreduce** (``mpicomm.allreduce(x, algorithm="hierarchical")``), ``n`` elements:

1. reduce-scatter on every host (ring over its ``R_h`` ranks, shared memory): local
   rank ``j < L`` ends with slice ``j`` (``n/L`` elements) of the host's sum; ranks
   ``j >= L`` own no slice (their blocks of the ring are empty);
2. every lane allreduces its slice over the ``H`` hosts (ring, recursive doubling or
   Rabenseifner, whichever :class:`~mpicomm.collectives.cost.HostCosts` predicts
   cheapest for ``L`` lanes sharing each host's port); ``op="avg"`` divides here by
   ``P``;
3. allgather on every host (ring): every rank gets every slice.

Each result element is computed once, by one lane's allreduce (bit-identical across
hosts), and copied from there, so every rank holds the same bits; the sum is associated
differently from the flat ring's, so floats agree with it to rounding, integers exactly.

**allgather** (``algorithm="hierarchical"``), ``m`` elements per rank: allgather on every
host, then lane ``j`` gathers slice ``j`` of every host's block of ``R_h·m`` elements
across hosts (ring over unequal blocks), then an allgather on every host of the lanes'
results, reordered into rank order (hosts need not hold consecutive ranks).

Cost (:meth:`~mpicomm.collectives.cost.HostCosts.hierarchical_allreduce`, uniform hosts
of ``R``, ring across hosts): ``2(R-1)(α_l + n/R·β_l) + 2(H-1)α_n + 2(H-1)/H·nβ_n`` plus
the reductions; the flat ring costs ``2(P-1)α_n + 2(P-1)/P·nβ_n``. The hierarchy saves
``2(P-H)`` network latencies and, in bandwidth, at most the factor ``(P-1)H/(P(H-1))``
(1.11 at 8 hosts of 4, 1.5 at 2 of 2): a host-major flat ring already crosses each
host's port only once per step. Use it where latency counts (small and medium vectors,
many ranks per host), or when ranks are not placed host-major (a flat ring then
crosses the network at every step). ``algorithm="auto"`` weighs it on the
communicator's layout (:func:`mpicomm.collectives.cost.host_costs`).

The sub-communicators (:class:`Hierarchy`: the host's ranks, the lane's ranks) are made
on first use (collective) and kept in ``comm.resources``; ``comm.free()`` frees them.
They share the communicator's traffic counters and emulated link, and every message
goes through :mod:`mpicomm.p2p`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from ..comm import Communicator
from ..emulate.linkdelay import share_link
from ..p2p import Ctx, block_bounds
from ..tags import TAG_HOST, TAG_LANE
from ..topology import Topology
from . import cost
from ._ring import allgather_pass, reduce_scatter_copy_pass, reduce_scatter_pass

__all__ = ["Hierarchy", "hierarchy", "allreduce", "allgather", "lane_bounds",
           "reduce_into_lanes"]

#: Where a communicator keeps its :class:`Hierarchy` (``comm.resources``).
_KEY = "hierarchy"


class Hierarchy:
    """The sub-communicators of a communicator's host layout (collective to build).

    ``local``: the ranks of this host, in rank order. ``lane``: local rank ``j`` of every
    host, in host order, for ``j < lanes`` (``None`` on the ranks beyond the smallest
    host's size). Both count their bytes in the parent's traffic counters, use its
    emulated link and run unchecked (the parent's call was checked).
    """

    def __init__(self, comm: Communicator):
        t = comm.topology
        self.topology = t
        self.lanes = t.lanes
        members = t.members
        mine = list(members[comm.node])
        self.local = _child(comm, comm.mpi.Split(comm.node, key=comm.rank),
                            Topology((0,) * len(mine)), mine)
        j = comm.local_rank
        lane = comm.mpi.Split(j if j < t.lanes else MPI.UNDEFINED, key=comm.node)
        self.lane: Communicator | None = None
        if lane != MPI.COMM_NULL:
            ranks = [m[j] for m in members]
            self.lane = _child(comm, lane, Topology(tuple(range(len(ranks)))), ranks)

    def free(self) -> None:
        """Free the sub-communicators (also done by the parent's ``free()``)."""
        self.local.free()
        if self.lane is not None:
            self.lane.free()


def _child(parent: Communicator, mpi: MPI.Intracomm, topology: Topology,
           ranks: list[int]) -> Communicator:
    child = Communicator(mpi, check=False, owns=True, job=parent.job,
                         wait_poll_s=parent.wait_poll_s, topology=topology)
    child.traffic = parent.traffic
    share_link(parent, child, ranks)
    return child


def hierarchy(comm: Communicator) -> Hierarchy:
    """``comm``'s :class:`Hierarchy`, built on first use (collective over ``comm``)."""
    found = comm.resources.get(_KEY)
    if found is None:
        found = comm.resources[_KEY] = Hierarchy(comm)
    return found


def lane_bounds(n: int, lanes: int, local_size: int) -> list[int]:
    """Ring blocks on a host of ``local_size`` ranks: block ``j`` is lane ``j``'s slice of
    ``n`` elements (near-equal, contiguous) for ``j < lanes``, empty after."""
    return block_bounds(n, lanes) + [n] * (local_size - lanes)


def reduce_into_lanes(src: Any, comm: Communicator, lanes: int, ops: Any,
                      segment_bytes: int) -> tuple[Any, int, int]:
    """The host's sum of ``src`` over its ranks, cut into ``lanes`` slices
    (:func:`lane_bounds`; ``lanes`` at most the smallest host's size): local rank
    ``j < lanes`` gets ``(slice j of the sum, a, b)`` with ``[a, b)`` its range, the
    ranks beyond an empty array and ``a == b``. ``src`` is left alone (a ring
    reduce-scatter inside the host that reduces out of it; collective over ``comm``)."""
    h = hierarchy(comm)
    n, j, size = src.shape[0], comm.local_rank, comm.local_size
    bounds = lane_bounds(n, lanes, size)
    a, b = bounds[j], bounds[j + 1]
    dst = ops.empty_like(src, b - a)
    if size == 1:
        ops.copy_(dst, src[a:b])
    else:
        reduce_scatter_copy_pass(src, dst, bounds, j, "sum",
                                 Ctx.of(h.local, ops, segment_bytes), TAG_HOST)
    return dst, a, b


def allreduce(work: Any, op: str, comm: Communicator, ops: Any, segment_bytes: int,
              algorithms: dict[str, Callable[[Any, str, Ctx], None]]) -> None:
    """Hierarchical allreduce of the flat array ``work`` in place (module docstring);
    ``op="avg"`` divides by ``comm.size``. ``algorithms`` are the flat allreduce
    algorithms a lane may run across hosts (by name)."""
    h = hierarchy(comm)
    n, j, size = work.shape[0], comm.local_rank, comm.local_size
    reduce_op = "sum" if op == "avg" else op
    bounds = lane_bounds(n, h.lanes, size)
    if size > 1:
        reduce_scatter_pass(work, bounds, j, reduce_op, Ctx.of(h.local, ops, segment_bytes),
                            TAG_HOST)
    if h.lane is not None:
        mine = work[bounds[j]:bounds[j + 1]]
        if h.lane.size > 1 and mine.shape[0]:
            nbytes = (bounds[1] - bounds[0]) * ops.itemsize(work)
            inner = cost.host_costs(comm).lane_allreduce_algorithm(nbytes)
            algorithms[inner](mine, reduce_op, Ctx.of(h.lane, ops, segment_bytes))
        if op == "avg":
            ops.divide_(mine, comm.size)
    if size > 1:
        allgather_pass(work, bounds, j, Ctx.of(h.local, ops, segment_bytes), TAG_HOST)


def allgather(res: Any, src: Any, m: int, comm: Communicator, ops: Any,
              segment_bytes: int) -> None:
    """Hierarchical allgather of ``m`` elements per rank into ``res`` (``P·m``, rank
    order), from this rank's ``src`` (module docstring)."""
    h = hierarchy(comm)
    t = comm.topology
    members, lanes = t.members, h.lanes
    host, j, size = comm.node, comm.local_rank, comm.local_size
    own = ops.empty_like(res, size * m)  # this host's blocks, local-rank order
    ops.copy_(own[j * m:(j + 1) * m], src)
    if size > 1:
        allgather_pass(own, [i * m for i in range(size + 1)], j,
                       Ctx.of(h.local, ops, segment_bytes), TAG_HOST)
    # lane-major layout: region l holds slice l of every host's data, in host order
    cuts = [block_bounds(len(mm) * m, lanes) for mm in members]
    starts = [0]
    for ln in range(lanes):
        starts.append(starts[-1] + sum(c[ln + 1] - c[ln] for c in cuts))
    work = ops.empty_like(res, starts[-1])

    def region(ln: int) -> list[int]:  # bounds of every host's piece of lane ln
        out = [starts[ln]]
        for c in cuts:
            out.append(out[-1] + c[ln + 1] - c[ln])
        return out

    if h.lane is not None:
        b = region(j)
        ops.copy_(work[b[host]:b[host + 1]], own[cuts[host][j]:cuts[host][j + 1]])
        if h.lane.size > 1:
            allgather_pass(work, b, host, Ctx.of(h.lane, ops, segment_bytes), TAG_LANE)
    if size > 1:
        allgather_pass(work, starts + [starts[-1]] * (size - lanes), j,
                       Ctx.of(h.local, ops, segment_bytes), TAG_HOST)
    for g, mm in enumerate(members):
        pieces = [work[region(ln)[g]:region(ln)[g + 1]] for ln in range(lanes)]
        data = own if g == host else (pieces[0] if lanes == 1 else ops.concatenate(pieces))
        if t.consecutive:
            ops.copy_(res[mm[0] * m:(mm[-1] + 1) * m], data)
        else:
            for i, r in enumerate(mm):
                ops.copy_(res[r * m:(r + 1) * m], data[i * m:(i + 1) * m])
