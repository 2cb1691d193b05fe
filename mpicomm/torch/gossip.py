"""Decentralized gossip averaging of a model's parameters (see ``mpicomm.gossip``).

Use it for decentralized SGD (D-PSGD): each rank takes a local optimizer step, then
mixes its parameters with its neighbours' instead of an allreduce::

    gossip = GossipAveraging(model, topology="exponential")
    for x, y in loader:
        ...; opt.step()
        gossip.step()
    print(gossip.consensus_distance())   # how far the replicas are from agreeing

One ``step`` costs ``degree`` sends and receives of the parameter bytes per rank
(degree 2 on a ring, ``ceil(lg P)`` on the exponential graph) and no global
synchronization. The replicas only approach their mean (by the mixing matrix's
``sigma_2`` per round); call ``consensus_distance`` to monitor it.
"""

from __future__ import annotations

import math

import torch

from ..comm import Communicator, Traffic, resolve
from ..gossip import Topology, consensus_distance, make_topology, neighbor_average
from .localsgd import FusedTensors
from .replicas import broadcast_module, check_model

__all__ = ["GossipAveraging"]


class GossipAveraging:
    """Mix a model's parameters with its neighbours' on a fixed topology.

    Parameters
    ----------
    model:
        The ``torch.nn.Module`` replica. Only parameters are mixed (floating-point ones);
        buffers stay local.
    topology:
        ``"ring"``, ``"exponential"`` or a ``mpicomm.gossip.Topology`` for
        ``comm.size`` ranks.
    comm:
        ``mpicomm.Communicator`` (default: the world).
    broadcast:
        Start every replica from rank 0's parameters (default ``True``, collective).
    """

    def __init__(self, model: torch.nn.Module, topology: str | Topology = "ring",
                 comm: Communicator | None = None, *, broadcast: bool = True):
        self.model = check_model(model)
        self.comm = resolve(comm)
        if isinstance(topology, Topology):
            if topology.size != self.comm.size:
                raise ValueError(f"topology is for {topology.size} ranks, the communicator "
                                 f"has {self.comm.size}")
            self.topology = topology
        else:
            self.topology = make_topology(topology, self.comm.size)
        #: Gossip rounds done.
        self.rounds = 0
        #: Bytes the gossip rounds moved (exactly ``degree * nbytes`` sent per round).
        self.traffic = Traffic()
        self._fused = FusedTensors()
        if broadcast:
            broadcast_module(self.model, 0, self.comm)

    def _params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.is_floating_point()]

    def step(self) -> None:
        """One gossip round over the parameters (collective)."""
        with self.comm.traffic.measure(into=self.traffic):
            for flat in self._fused.pack(self._params()):
                neighbor_average(flat, self.topology, comm=self.comm, out=flat)
        self._fused.unpack()
        self.rounds += 1

    def consensus_distance(self) -> float:
        """``sqrt(mean over ranks of ||x_i - x_mean||^2)`` of the parameters (collective)."""
        total = 0.0
        for flat in self._fused.pack(self._params()):
            total += consensus_distance(flat, self.comm) ** 2
        return math.sqrt(total)
