r"""Which ranks share a host: the host layout behind the two link classes of a cluster.

A cluster has two kinds of links: ranks of one host exchange through shared memory
(fast, and each pair on its own), ranks of different hosts through the network, where
all ranks of a host share the host's port, or, with ``MPICOMM_HOST_NICS=N``, local rank
``j`` uses port ``j mod N`` of its host (GPU servers with one NIC per GPU: ``N`` = the
ranks per host). Hierarchical collectives
(:mod:`mpicomm.collectives.hierarchical`, :mod:`mpicomm.sparse.hierarchical`) and the
cost model (:class:`mpicomm.collectives.cost.HostCosts`) need to know which ranks share
a host; this module is the one place that answers.

Where the layout comes from, first match wins:

1. ``MPICOMM_HOST_SIZES`` (``2,2,1``): consecutive world ranks per host, i.e. ranks 0-1
   on host 0, 2-3 on host 1, 4 on host 2. Hosts may differ in size. Set it for tests,
   for the virtual clock's platform and in the emulated cluster (whose
   ``--ranks-per-host`` sets it for the job). It must cover the world exactly; anything
   else raises one ``ValueError`` naming the variable on every rank, before any message.
2. under the virtual clock (:mod:`mpicomm.clock`, ``MPICOMM_CLOCK=virtual``), the
   virtual cluster's hosts (``MPICOMM_VIRTUAL_RANKS_PER_HOST``: rank r on host r // R);
3. MPI's shared-memory split (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``): the ranks
   that can share memory form a host, wherever the launcher placed them.

A :class:`Topology` is the host of every rank of one communicator: hosts are numbered
0, 1, ... in the order of their lowest rank, a host's *local ranks* are its ranks in
rank order. The communicator keeps its own (:attr:`mpicomm.Communicator.topology`; its
``node``, ``nodes``, ``local_rank`` and ``local_size`` are read from it), which
``Communicator(..., topology=Topology.from_sizes((1, 2, 3)))`` replaces for what-if
runs and tests.

*Lanes*: the hierarchical algorithms cut a vector into ``lanes = min host size`` slices
and let local rank ``j < lanes`` of every host carry slice ``j`` across the network, so
all lanes of a host run at once and share its port. Hosts of different sizes are
allowed: their ranks beyond the smallest host's size help within the host only.

Cost of detection: with ``MPICOMM_HOST_SIZES`` or the virtual clock nothing is
communicated (world ranks are translated locally); otherwise one shared-memory split
and one allgather of an integer, once per communicator.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from mpi4py import MPI

from . import clock
from .emulate.linkdelay import world_ranks
from .emulate.vnet import ENV_HOST_NICS, ENV_HOST_SIZES, parse_nics, port_layout
from .emulate.vnet import parse_host_sizes as host_sizes
from .validate import check_int

__all__ = ["Topology", "detect", "world_layout", "parse_host_sizes", "ENV_HOST_SIZES",
           "ENV_HOST_NICS"]


@dataclass(frozen=True)
class Topology:
    """The host of every rank of a communicator (``hosts[r]``, hosts numbered 0..H-1 in
    the order of their lowest rank).

    Build one with :meth:`from_sizes` (consecutive ranks per host), :meth:`from_hosts`
    (any placement) or :func:`detect`. ``ValueError`` for an empty layout or host
    numbers that are not ``0..H-1`` in order of first appearance. ``ports[r]``: rank
    r's network port (NIC), numbered across hosts; empty: one port per host.
    """

    hosts: tuple[int, ...]
    ports: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("a topology needs at least one rank")
        seen = 0
        for h in self.hosts:
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= seen:
                raise ValueError(f"hosts must be numbered 0, 1, ... in order of first "
                                 f"appearance, got {self.hosts}")
            seen = max(seen, h + 1)
        if self.ports:
            owner: dict[int, int] = {}
            if len(self.ports) != len(self.hosts) or any(
                    owner.setdefault(q, h) != h for q, h in zip(self.ports, self.hosts)):
                raise ValueError(f"ports must give every rank a port of its own host, got "
                                 f"ports {self.ports} for hosts {self.hosts}")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_sizes(cls, sizes: Sequence[int], nics: int = 1) -> Topology:
        """Consecutive ranks per host: ``(2, 2, 1)`` puts ranks 0-1, 2-3 and 4 together;
        ``nics`` network ports per host (local rank j on port j mod nics)."""
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
            raise ValueError(f"host sizes must be a non-empty sequence of integers, "
                             f"got {sizes!r}")
        sizes = [check_int("host size", s, 1) for s in sizes]
        return cls.from_hosts([h for h, s in enumerate(sizes) for _ in range(s)], nics)

    @classmethod
    def from_hosts(cls, hosts: Sequence[object], nics: int = 1,
                   ports: Sequence[object] | None = None) -> Topology:
        """Any placement: ``hosts[r]`` is a label of rank r's host (names, node ids);
        ranks with equal labels share a host. Labels are renumbered 0, 1, ... in order
        of first appearance. Ports: ``ports[r]`` labels rank r's port if given, else each
        host has ``nics`` (:func:`mpicomm.emulate.vnet.port_layout`)."""
        numbers: dict[object, int] = {}
        layout = tuple(numbers.setdefault(h, len(numbers)) for h in hosts)
        check_int("network ports per host", nics, 1)
        if ports is not None:
            labels: dict[object, int] = {}
            numbered = tuple(labels.setdefault(q, len(labels)) for q in ports)
        else:
            numbered = port_layout(layout, nics)
        # one port per host (the ports numbered as the hosts) is stored as ()
        return cls(layout, () if numbered == layout else numbered)

    def restrict(self, ranks: Sequence[int]) -> Topology:
        """The layout of a communicator made of ``ranks`` of this one (in that order);
        every rank keeps its port."""
        return Topology.from_hosts([self.hosts[r] for r in ranks],
                                   ports=[self.port(r) for r in ranks] if self.ports else None)

    def checked(self, size: int) -> Topology:
        """``self``, after checking that it places exactly ``size`` ranks (``ValueError``
        otherwise: a host list that does not cover the communicator)."""
        if len(self.hosts) != size:
            raise ValueError(f"the topology places {len(self.hosts)} ranks "
                             f"(host sizes {list(self.host_sizes)}) but the communicator "
                             f"has {size}")
        return self

    # ------------------------------------------------------------------ reading
    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.hosts)

    @property
    def num_hosts(self) -> int:
        """Number of hosts ``H``."""
        return max(self.hosts) + 1

    @cached_property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """``members[h]``: the ranks of host ``h`` in rank order (its local ranks)."""
        out: list[list[int]] = [[] for _ in range(self.num_hosts)]
        for r, h in enumerate(self.hosts):
            out[h].append(r)
        return tuple(tuple(m) for m in out)

    @property
    def host_sizes(self) -> tuple[int, ...]:
        """Ranks per host, by host."""
        return tuple(len(m) for m in self.members)

    def port(self, rank: int) -> int:
        """The network port (NIC) ``rank`` sends and receives through; the host's only
        port unless ``ports`` gives several per host."""
        return self.ports[rank] if self.ports else self.hosts[rank]

    def local_rank(self, rank: int) -> int:
        """Position of ``rank`` among the ranks of its host."""
        return self.members[self.hosts[rank]].index(rank)

    @property
    def lanes(self) -> int:
        """Slices a hierarchical collective carries across the network at once: the
        smallest host's size (every host has that many local ranks to carry them)."""
        return min(self.host_sizes)

    @property
    def uniform(self) -> bool:
        """Every host has the same number of ranks."""
        return len(set(self.host_sizes)) == 1

    @property
    def consecutive(self) -> bool:
        """Every host's ranks are consecutive (host-major placement)."""
        return all(m[-1] - m[0] + 1 == len(m) for m in self.members)

    @property
    def hierarchical(self) -> bool:
        """Two link classes occur: several hosts, and at least one with several ranks.
        Only then does a hierarchical collective differ from a flat one."""
        return 1 < self.num_hosts < self.size

    def describe(self) -> str:
        """``"3 hosts of 1+2+3 ranks"``; with several ports on a host, their count per
        host (``"2 hosts of 3+3 ranks, 2+2 network ports"``)."""
        sizes = "+".join(str(s) for s in self.host_sizes)
        per_host = "+".join(str(len({self.port(r) for r in m})) for m in self.members)
        ports = f", {per_host} network ports" if self.ports else ""
        return f"{self.num_hosts} host{'s' if self.num_hosts > 1 else ''} of {sizes} " \
               f"rank{'s' if self.size > 1 else ''}{ports}"


def parse_host_sizes(text: str, size: int, name: str = ENV_HOST_SIZES) -> Topology:
    """The layout ``text`` (``"2,2,1"``: consecutive ranks per host) for ``size`` ranks.

    ``ValueError`` naming ``name`` when it is not a list of positive integers or does
    not add up to ``size`` (:func:`mpicomm.emulate.vnet.parse_host_sizes`, which the
    virtual clock's platform reads the same variable with).
    """
    return Topology.from_sizes(host_sizes(text, size, name))


def world_layout() -> Topology | None:
    """The world's layout from ``MPICOMM_HOST_SIZES`` (and ``MPICOMM_HOST_NICS``), or
    ``None`` when it is unset. Local (reads the environment and the world's size)."""
    text = os.environ.get(ENV_HOST_SIZES, "").strip()
    if not text:
        return None
    layout = parse_host_sizes(text, MPI.COMM_WORLD.Get_size())
    return Topology.from_hosts(layout.hosts, parse_nics(os.environ.get(ENV_HOST_NICS)))


def detect(mpi_comm: MPI.Intracomm) -> Topology:
    """The host layout of ``mpi_comm`` (collective unless ``MPICOMM_HOST_SIZES`` is set
    or the virtual clock runs).

    ``MPICOMM_HOST_SIZES`` gives the world's hosts, restricted to ``mpi_comm``'s ranks;
    else the virtual clock's platform; otherwise MPI's shared-memory split decides.
    ``ValueError`` on every rank, before any communication, when the variable does not
    cover the world.
    """
    layout = world_layout()
    if layout is not None:
        return layout.restrict(world_ranks(mpi_comm))
    virtual = clock.platform()
    if virtual is not None:  # the simulated cluster's hosts and ports
        world = world_ranks(mpi_comm)
        return Topology.from_hosts([virtual.hosts[w] for w in world],
                                   ports=[virtual.ports[w] for w in world])
    if mpi_comm.Get_size() == 1:
        return Topology((0,))
    rank = mpi_comm.Get_rank()
    nics = parse_nics(os.environ.get(ENV_HOST_NICS))
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        lowest = local.allreduce(rank, op=MPI.MIN)
    finally:
        local.Free()
    return Topology.from_hosts(mpi_comm.allgather(lowest), nics)
