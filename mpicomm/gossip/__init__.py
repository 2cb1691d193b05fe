"""Gossip: decentralized averaging, where each rank mixes its vector with a few neighbours
instead of joining a global collective (:mod:`.averaging`: topologies, mixing matrices,
one averaging round, the consensus distance). Parameter servers live in
:mod:`mpicomm.ps`."""

from .averaging import (
    TOPOLOGIES,
    Topology,
    consensus_distance,
    make_topology,
    mixing_matrix,
    neighbor_average,
)

__all__ = ["Topology", "TOPOLOGIES", "make_topology", "mixing_matrix", "neighbor_average",
           "consensus_distance"]
