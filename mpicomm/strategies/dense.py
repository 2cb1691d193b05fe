"""Dense averaging: an allreduce of the fused gradients, no compression."""

from __future__ import annotations

from typing import Any

from ..collectives import allreduce, cost
from ..collectives.cost import ComputeParams, CostParams
from ..comm import Communicator
from .base import DEFAULT_FUSION_BYTES, Strategy

__all__ = ["Dense"]


class Dense(Strategy):
    """Average by allreduce (``op="avg"``) of each fused buffer.

    Bytes per rank for ring allreduce: 2(p-1)/p · n · itemsize sent and received.
    ``algorithm`` is any allreduce algorithm (``"auto"``, ``"ring"``,
    ``"recursive_doubling"``, ``"rabenseifner"``, ``"hierarchical"``, ``"mpi"``); the
    traffic counters see mpicomm's own algorithms only, so ``"mpi"`` reports zero
    bytes. On a layout of several hosts with several ranks ``"auto"`` weighs the
    hierarchical allreduce (:mod:`mpicomm.collectives.hierarchical`) and the
    prediction prices every algorithm with two link classes.
    """

    name = "dense"

    def __init__(self, comm: Communicator | None = None, *, algorithm: str = "auto",
                 fusion_bytes: int = DEFAULT_FUSION_BYTES):
        from ._compressed import check_allreduce_algorithm

        algorithm = check_allreduce_algorithm(algorithm)
        super().__init__(comm, fusion_bytes=fusion_bytes)
        self.algorithm = algorithm

    def aggregate_flat(self, flat: Any, name: str) -> Any:
        return allreduce(flat, op="avg", algorithm=self.algorithm, comm=self.comm, out=flat)

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, "algorithm": self.algorithm}

    def _predict_flat(self, numel: int, itemsize: int, p: int, params: CostParams,
                      compute: ComputeParams) -> tuple[float, float]:
        """The allreduce (gamma covers its reduction); ``auto``: the best algorithm."""
        algorithm = "mpi" if self.algorithm == "auto" else self.algorithm
        if algorithm == "hierarchical":  # one host per rank: the lanes' allreduce
            algorithm = "mpi"
        return cost.predict("allreduce", algorithm, numel * itemsize, p, params), 0.0

    def _predict_hosts(self, numel: int, itemsize: int, hosts: cost.HostCosts,
                       compute: ComputeParams) -> tuple[float, float]:
        """The algorithm (``auto``: the cheapest, hierarchical included; ``mpi``: the
        cheapest flat one) on the host layout; its shared-memory rounds as compute."""
        n = numel * itemsize
        if hosts.p == 1:
            return 0.0, 0.0
        names = {"auto": (*cost.HOST_ALGORITHMS["allreduce"], "hierarchical"),
                 "mpi": cost.HOST_ALGORITHMS["allreduce"]}.get(self.algorithm,
                                                              (self.algorithm,))
        t = min((hosts.hierarchical_allreduce(n) if a == "hierarchical"
                 else hosts.flat("allreduce", a, n) for a in names), key=lambda s: s.total)
        return t.comm, t.local
