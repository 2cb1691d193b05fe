r"""Decentralized (gossip) averaging: each rank mixes its vector with a few neighbours.

One round replaces every rank's vector ``x_i`` by

.. math::  x_i \leftarrow \frac{1}{m+1}\Big(x_i + \sum_{j \in N_{in}(i)} x_j\Big)

where ``N_in(i)`` are the ``m`` ranks that send to ``i``. Stacked over ranks this is
``X <- W X`` with a *mixing matrix* ``W`` (see :func:`mixing_matrix`). Both topologies
here are circulant graphs (rank ``i`` sends to ``i + o`` and receives from ``i - o`` for
each offset ``o``) with uniform weights, so ``W`` is **doubly stochastic**: rows sum to 1
(each rank takes a convex combination) and columns sum to 1 (the mean over ranks is
preserved exactly in exact arithmetic). Its second-largest singular value ``sigma_2 < 1``
for a connected graph, so the consensus distance ``||X - mean||`` shrinks by at least
that factor every round.

Topologies
----------
``ring``
    Neighbours ``i - 1`` and ``i + 1`` (mod P), weights 1/3. Degenerate cases: P = 1 has
    no neighbour (weight 1, a no-op); P = 2 has the single neighbour ``1 - i`` (weights
    1/2: exact average in one round). ``sigma_2 = (1 + 2 cos(2 pi / P)) / 3``: consensus
    slows as ``1 - O(1/P^2)`` per round on large rings.
``exponential``
    Send to ``i + 2^k``, receive from ``i - 2^k`` for ``k < ceil(lg P)``; ``m =
    ceil(lg P)`` neighbours (distinct since ``2^k < P``), weights ``1/(m+1)``. The
    one-peer-per-power-of-two graph of SGP/D-PSGD papers: ``O(lg P)`` degree and a
    spectral gap that does not vanish with P, so consensus is fast at any scale.

Cost of one round (alpha-beta-gamma, ``n`` bytes per rank): ``m`` sends and ``m``
receives of ``n`` bytes posted together, about ``m(alpha + n beta) + m n gamma`` when a
rank's link serializes its messages; ``m = 2`` (ring) or ``ceil(lg P)`` (exponential).
Bytes sent per rank per round: exactly ``m * n`` (counted in ``comm.traffic``). Compare
with a ring allreduce's ``2(P-1)/P * n``: gossip sends about as much as an allreduce on a
ring but needs no global synchronization, and it does *not* produce the exact average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..buffers import Buffer
from ..collectives import allreduce
from ..comm import Communicator, resolve
from ..p2p import Ctx
from ..tags import TAG_GOSSIP
from ..validate import check_int

__all__ = ["Topology", "TOPOLOGIES", "make_topology", "mixing_matrix", "neighbor_average",
           "consensus_distance"]


TOPOLOGIES = ("ring", "exponential")


@dataclass(frozen=True)
class Topology:
    """A circulant communication graph over ``size`` ranks with uniform weights.

    Rank ``i`` sends to ``(i + o) % size`` and receives from ``(i - o) % size`` for every
    ``o`` in ``offsets`` (distinct, in ``1..size-1``). Every rank weights itself and each
    in-neighbour by ``1 / (degree + 1)``.
    """

    name: str
    size: int
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if len(set(self.offsets)) != len(self.offsets) or any(
                not 0 < o < self.size for o in self.offsets):
            raise ValueError(f"offsets must be distinct and in [1, {self.size - 1}], "
                             f"got {self.offsets}")

    @property
    def degree(self) -> int:
        """``m``: neighbours each rank receives from (and sends to)."""
        return len(self.offsets)

    @property
    def weight(self) -> float:
        """The weight of every term of the mix, ``1 / (m + 1)``."""
        return 1.0 / (self.degree + 1)

    def send_to(self, rank: int) -> list[int]:
        return [(rank + o) % self.size for o in self.offsets]

    def recv_from(self, rank: int) -> list[int]:
        return [(rank - o) % self.size for o in self.offsets]


def make_topology(name: str, size: int) -> Topology:
    """The ``"ring"`` or ``"exponential"`` topology over ``size`` ranks."""
    size = check_int("size", size, 1)
    if name == "ring":
        offsets = tuple(sorted({1 % size, (size - 1) % size} - {0}))
    elif name == "exponential":
        offsets = tuple(1 << k for k in range(math.ceil(math.log2(size))))
    else:
        raise ValueError(f"unknown topology {name!r}; choose one of {', '.join(TOPOLOGIES)}")
    return Topology(name, size, offsets)


def _resolve_topology(topology: str | Topology, size: int) -> Topology:
    if isinstance(topology, Topology):
        if topology.size != size:
            raise ValueError(f"topology is for {topology.size} ranks, the communicator has "
                             f"{size}")
        return topology
    if isinstance(topology, str):
        return make_topology(topology, size)
    raise TypeError(f"topology must be a name or a Topology, got {type(topology).__name__}")


def mixing_matrix(topology: str | Topology, size: int | None = None) -> np.ndarray:
    """The ``P x P`` matrix ``W`` with ``x_new = W @ x`` (row ``i`` = rank ``i``'s mix).

    ``size`` is needed only when ``topology`` is a name.
    """
    if isinstance(topology, str):
        if size is None:
            raise ValueError("pass size with a topology name")
        topology = make_topology(topology, size)
    p, w = topology.size, topology.weight
    mat = np.zeros((p, p))
    for i in range(p):
        mat[i, i] += w
        for j in topology.recv_from(i):
            mat[i, j] += w
    return mat


def neighbor_average(buf: Any, topology: str | Topology = "ring",
                     comm: Communicator | None = None, out: Any = None) -> Any:
    """One gossip round: ``buf`` mixed with the in-neighbours' buffers.

    ``buf`` is a numpy array, torch tensor or cupy array of a floating dtype, the same
    shape and dtype on every rank. Collective over ``comm`` (every rank must call it with
    the same topology). Returns a new array of ``buf``'s kind, or ``out`` (``out=buf`` for
    in place). Uses the counted point-to-point helpers, so ``comm.traffic`` grows by
    ``degree * buf.nbytes`` sent and received per call.
    """
    comm = resolve(comm)
    with comm.validating("neighbor_average") as agreed:
        topo = _resolve_topology(topology, comm.size)
        b = Buffer(buf, comm.resources)
        agreed.update(shape=b.info.shape, dtype=b.info.dtype, topology=topo.name,
                      offsets=topo.offsets)
        if not b.info.is_float:
            raise TypeError(f"neighbor_average needs a floating dtype, got {b.info.dtype}")
        b.check_out(out, b.info.shape)
    work = b.writable_copy(out)
    n, m = b.info.numel, topo.degree
    if m and n:
        ctx = Ctx.of(comm, b.ops)
        inbox = b.empty(m * n)
        parts = [inbox[k * n:(k + 1) * n] for k in range(m)]
        requests = [ctx.irecv(part, src, TAG_GOSSIP)
                    for part, src in zip(parts, topo.recv_from(comm.rank))]
        requests += [ctx.isend(work, dst, TAG_GOSSIP) for dst in topo.send_to(comm.rank)]
        ctx.waitall(requests)
        for part in parts:
            b.ops.reduce_(work, part, "sum")
        b.ops.divide_(work, m + 1)
    return b.deliver(work, b.info.shape, out)


def consensus_distance(buf: Any, comm: Communicator | None = None) -> float:
    """``sqrt(mean_i ||x_i - mean_j x_j||^2)`` over the ranks (collective).

    0 when all ranks hold the same vector. Costs one allreduce of the buffer plus one
    scalar allreduce; for monitoring, not for every step.
    """
    comm = resolve(comm)
    b = Buffer(buf, comm.resources)
    if not b.info.is_float:
        raise TypeError(f"consensus_distance needs a floating dtype, got {b.info.dtype}")
    mean = allreduce(buf, op="avg", comm=comm)
    local = _squared_distance(buf, mean)
    return math.sqrt(max(comm.allreduce_value(local, "avg"), 0.0))


def _squared_distance(a: Any, b: Any) -> float:
    diff = a - b
    if hasattr(diff, "detach"):  # torch
        diff = diff.detach().double()
        return float((diff * diff).sum())
    diff = diff.astype(np.float64, copy=False) if isinstance(diff, np.ndarray) else diff
    return float((diff * diff).sum())
