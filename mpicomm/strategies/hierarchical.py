"""Hierarchical top-k strategies: dense inside hosts, sparse across hosts only."""

from __future__ import annotations

from typing import Any

import torch

from ..collectives import cost
from ..compress.topk import index_itemsize
from ..sparse import hierarchical_topk
from ..sparse.artopk import ALGORITHMS as AR_ALGORITHMS
from ..topology import Topology
from ..validate import check_algorithm
from ._compressed import SparsifyingStrategy, check_flag, k_of, sparsity
from .base import DEFAULT_FUSION_BYTES

__all__ = ["HierarchicalTopK", "HierarchicalGTopK", "HierarchicalARTopK"]

#: Cost parameters under which the host model gives bytes through the busiest port.
_PORT_BYTES = cost.CostParams(alpha=0.0, beta=1.0, gamma=0.0)
_FREE = cost.CostParams(alpha=0.0, beta=0.0, gamma=0.0)


class HierarchicalTopK(SparsifyingStrategy):
    r"""Error-fed top-k aggregated by hosts: Allgather Top-k across hosts ("hier_topk").

    Per fused buffer ``g`` of ``d`` elements, on rank r of host h (``H`` hosts, ``L``
    lanes = the smallest host's size, :mod:`mpicomm.topology`)::

        c_r  = g_r + e_r                       # error feedback (e_r = 0 without it)
        C_h  = Σ_{r on h} c_r                   # dense, inside the host (shared memory)
        L_h  = top-k of |C_h|                   # per lane slice with sliced=True
        (I, V), A_h = inner({(L_h, C_h[L_h])}_h)   # across hosts only
        u    = zeros(d);  u[I] = V / P          # the same on every rank
        e_r  = c_r with A_h zeroed              # A_h: where C_h reached V

    ``inner`` is the class's collective across hosts: the Allgather (this class; every
    host's picks summed, ``A_h = L_h``), gTop-k (:class:`HierarchicalGTopK`, ``A_h`` the
    picks that survived every merge) or AR-Top-k (:class:`HierarchicalARTopK`, source
    host ``(t + b + j) mod H`` for lane j, ``A_h = I``). **Which residual holds what**:
    every rank keeps exactly its own compensated entries whose host sum did not reach
    the update, so ``Σ_r c_r = P·u + Σ_r e_r`` entry by entry (up to the rounding of the
    host sums and of V); no rank's residual holds another rank's mass.
    ``k = max(1, ceil(density·d))`` (or the given ``k``), capped at ``d``; with
    ``density=1`` the update is the exact mean. Semantics and costs:
    :func:`mpicomm.sparse.hierarchical_topk`.

    ``sliced=True``: each lane (local rank ``j < L``) reduces, selects ``k/L`` entries
    of and exchanges its own ``1/L`` slice; otherwise the host's first rank does the
    whole buffer (the *leader* form). ``algorithm`` (AR-Top-k only): the values'
    allreduce across hosts, ``"ring"``, ``"tree"`` or ``"auto"`` (the cost model's).

    Bytes per rank, ``s = 4 + itemsize``: inside the host a ring reduce-scatter of the
    buffer (``(R-1)/R·d·itemsize`` sliced, up to ``d·itemsize`` for the leader chain) and
    an allgather of the result; across hosts what ``inner`` sends for ``k/L`` pairs over
    ``H`` ranks, on each of ``L`` lanes: ``(H-1)·k/L·s`` (Allgather), ``lg H·k/L·s``
    (gTop-k), ``lg H·k/L·4 + 2(H-1)/H·k/L·itemsize`` (AR-Top-k, ring) per lane rank,
    i.e. one host's port carries what one rank sends in the flat collective over ``H``
    ranks.

    ``schedule``, ``momentum_correction`` / ``momentum_masking``, ``clip_norm`` and
    ``warmup_dense``: see :class:`~mpicomm.strategies._compressed.CompressedStrategy`.

    Cost model: :meth:`mpicomm.collectives.cost.HostCosts.hierarchical_sparse`
    (:meth:`predict`), plus the selection of ``d/L`` elements (leader: ``d``), the
    merges of the ``k/L`` pairs and the densify.

    Tuning: pays off where the flat collective's network traffic or its per-rank
    selection dominates, i.e. several ranks per host on a slow network: the network
    carries ``H`` contributions instead of ``P``, and ``sliced`` cuts every rank's
    selection to ``d/L``. The dense reduction inside the host costs about
    ``d·itemsize`` of shared-memory traffic and one add per element. With one rank per
    host it is the flat collective; on one host it is the exact top-k of the sum.
    """

    name = "hier_topk"
    inner = "allgather"
    host_model = True

    def __init__(self, density: float | None = None, k: int | None = None, *,
                 sliced: bool = False, algorithm: str = "auto", error_feedback: bool = True,
                 comm: Any = None, fusion_bytes: int = DEFAULT_FUSION_BYTES,
                 schedule: Any = None, momentum_correction: float = 0.0,
                 momentum_masking: bool = True, clip_norm: float | None = None,
                 warmup_dense: bool = False):
        self.density, self.k = sparsity(density, k)
        self.sliced = check_flag("sliced", sliced)
        self.algorithm = check_algorithm("AR-Top-k", algorithm, AR_ALGORITHMS)
        super().__init__(comm, error_feedback=error_feedback, fusion_bytes=fusion_bytes,
                         schedule=schedule, momentum_correction=momentum_correction,
                         momentum_masking=momentum_masking, clip_norm=clip_norm,
                         warmup_dense=warmup_dense)

    def aggregate_flat(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        own = self._step(name)
        k = self._sparse_k(flat, own)
        if k is None:
            return self._aggregate_dense(name, flat)
        numel = flat.shape[0]
        c = self._compensate(name, flat)
        idx, mean, applied = hierarchical_topk(
            c, k, self.comm, inner=self.inner, sliced=self.sliced,
            step=own + self._slot(name), algorithm=self.algorithm, op="avg")
        if self.memory is not None:
            self.memory.update_sparse(name, c, applied)  # c becomes the residual
        self.stats.extra.setdefault("k", {})[name] = k
        self.stats.extra.setdefault("applied", {})[name] = int(applied.shape[0])
        out = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
        out[idx] = mean
        return out

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), "density": self.density, "k": self.k,
               "sliced": self.sliced, "collective": f"hierarchical({self.inner})",
               "hosts": self.comm.topology.describe()}
        if self.inner == "artopk":
            out["algorithm"] = self.algorithm
        return out

    # ------------------------------------------------------------------ costs
    def _inner_algorithm(self, hosts: cost.HostCosts, k: int, itemsize: int) -> str:
        if self.algorithm != "auto":
            return AR_ALGORITHMS[self.algorithm]
        lanes = hosts.topology.lanes if self.sliced else 1
        return hosts.lane_allreduce_algorithm(k / lanes * itemsize)

    def _sparse_bytes(self, numel: int, k: int, itemsize: int, p: int) -> float:
        """Bytes through the busiest host port (the comm's layout, else one host per
        rank)."""
        topo = self.comm.topology if p == self.comm.size else Topology(tuple(range(p)))
        hosts = cost.HostCosts(topo, _FREE, _PORT_BYTES)
        return self._seconds(numel, k, itemsize, hosts).comm

    def _seconds(self, numel: int, k: int, itemsize: int,
                 hosts: cost.HostCosts) -> cost.Seconds:
        return hosts.hierarchical_sparse(self.inner, numel * itemsize, k,
                                         index_itemsize(numel), itemsize, self.sliced,
                                         self._inner_algorithm(hosts, k, itemsize))

    def _predict_flat(self, numel: int, itemsize: int, p: int, params: cost.CostParams,
                      compute: cost.ComputeParams) -> tuple[float, float]:
        """One host per rank: the flat collective over ``p`` ranks."""
        hosts = cost.HostCosts(Topology(tuple(range(p))), params, params)
        return self._predict_hosts(numel, itemsize, hosts, compute)

    def _predict_hosts(self, numel: int, itemsize: int, hosts: cost.HostCosts,
                       compute: cost.ComputeParams) -> tuple[float, float]:
        """The host phases and the lanes' exchange on the layout; compute: compensation,
        the selection of ``d/L`` elements (leader: ``d``), the merges, the densify."""
        k = k_of(numel, self.density, self.k)
        t = self._seconds(numel, k, itemsize, hosts)
        lanes = hosts.topology.lanes if self.sliced else 1
        h = hosts.topology.num_hosts
        kj = k / lanes
        merges = 0.0
        if self.inner == "gtopk" and h > 1:
            merges = ((h.bit_length() - 1) + (h & (h - 1) != 0)) * 2 * kj * compute.merge
        elif self.inner == "allgather":
            merges = h * kj * compute.scatter
        work = (self._feedback_seconds(numel, itemsize, compute)
                + numel / lanes * compute.select + merges + numel * compute.scatter)
        return t.comm, t.local + work


class HierarchicalGTopK(HierarchicalTopK):
    """:class:`HierarchicalTopK` with gTop-k across hosts ("hier_gtopk"): the lanes'
    butterfly merge-and-truncate over the ``H`` hosts; ``A_h`` = the host's picks whose
    value survived every merge on its path (exact, also for a folded non-power-of-two
    ``H``). Fewest bytes across hosts (``lg H·k/L`` pairs per lane rank); approximate
    like the flat gTop-k, but over ``H`` exact host sums instead of ``P`` rank vectors."""

    name = "hier_gtopk"
    inner = "gtopk"


class HierarchicalARTopK(HierarchicalTopK):
    """:class:`HierarchicalTopK` with AR-Top-k across hosts ("hier_artopk"): lane j's
    source host ``(t + b + j) mod H`` (t the buffer's step, b its slot) selects, the
    indices are broadcast and every host's sums there are allreduced (``algorithm``);
    ``A_h = I`` on every host: all the mass at the chosen indices is applied."""

    name = "hier_artopk"
    inner = "artopk"
