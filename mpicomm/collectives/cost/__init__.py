r"""The alpha-beta-gamma cost of every collective algorithm in mpicomm.

Model (Hockney; Thakur, Rabenseifner & Gropp, IJHPCA 2005): sending one message of
``n`` bytes between two ranks costs ``alpha + n*beta``; reducing ``n`` bytes locally costs
``n*gamma``. ``p`` is the number of ranks, ``lg`` is log2, and for a non-power-of-two
``p`` the algorithms that need a power of two fold the extra ranks in and out, which adds
the terms marked *fold* below (``p2`` is the largest power of two <= p).

Each formula is the critical path of the algorithm as mpicomm runs it, with every rank's
port full duplex (a send and a receive at once), one upload and one download at a time,
and sends that leave when posted. Two consequences the textbook forms miss:

* **Folds** (recursive doubling, gTop-k): the ranks left out of the fold start the first
  exchange at once, so a non-power-of-two ``p`` adds between one and two message times,
  not always two (:func:`folded_butterfly`: ``p = 3`` costs ``2α + 3nβ + 2nγ``).
* **Ring segments**: a ring block larger than ``MPICOMM_RING_SEGMENT_BYTES`` is cut into
  segments that are forwarded as they arrive; once a block spans several segments the
  ring pays the latency about once per pass instead of ``p-1`` times
  (:func:`ring_reduce_scatter_pass`, :func:`ring_allgather_pass`).

Sizes: for allreduce, reduce-scatter and broadcast ``n`` is the size of one rank's
vector; for allgather it is the *total* gathered size (MPICH's convention). The sparse
formulas take ``k`` (entries per rank) and ``s`` (bytes per entry on the wire).

==============================  ===============================================================
algorithm                       time
==============================  ===============================================================
allreduce ring                  2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ  (one segment per block;
                                larger blocks pipeline: down to 2α + 2(p-1)/p·nβ + ...)
allreduce recursive doubling    lg p2·(α + nβ + nγ)            fold: up to 2α + 2nβ + nγ
                                (exactly: :func:`folded_butterfly` with nβ, nγ)
allreduce Rabenseifner          2 lg p2·α + 2(p2-1)/p2·nβ + (p2-1)/p2·nγ  fold: 2α + 2nβ + nγ
allgather ring                  (p-1)α + (p-1)/p·nβ        (one segment per block; see above)
allgather Bruck                 ⌈lg p⌉α + (p-1)/p·nβ + (n + n/p)γ     (local rotation copies)
allgather recursive doubling    lg p2·α + (p-1)/p·nβ                     fold: 2α + (n/p + n)β
allgather direct                (p-1)α + (p-1)/p·nβ       (as ring; all messages posted at once)
broadcast binomial              ⌈lg p⌉(α + nβ)
broadcast scatter + allgather   (⌈lg p⌉ + p - 1)α + 2(p-1)/p·nβ
reduce-scatter ring             (p-1)α + (p-1)/p·n(β + γ)  (one segment per block; see above)
reduce-scatter rec. halving     lg p2·α + (p2-1)/p2·n(β + γ)        fold: 2α + n(β + γ) + n/p·β
reduce-scatter direct           (p-1)α + (p-1)/p·n(β + γ)   (as ring; all messages posted at once)
Top-k via allgather (ring)      (p-1)α + (p-1)·k·s·β
gTop-k (butterfly)              lg p2·(α + k·s·β)              fold: up to 2(α + k·s·β)
                                (exactly: :func:`folded_butterfly` with k·s·β, no γ)
AR-Top-k (ring)                 bcast of k indices + ring allreduce of k values
AR-Top-k (tree)                 bcast of k indices + recursive-doubling allreduce of k values
PS push + pull (S servers)      2α + 2W(n/S)β + W(n/S)γ   (busiest server port; Table I: S=1)
==============================  ===============================================================

The fold terms of Rabenseifner, the recursive-doubling allgather and recursive halving
are the textbook ones, an upper bound of their critical path (their unfolded ranks also
start early).

**Two link classes** (:mod:`mpicomm.collectives.cost.hosts`): on a cluster whose hosts
hold several ranks each, :class:`HostCosts` prices every algorithm round by round with
a ``local`` (shared memory) and a ``network`` alpha-beta, the ranks of a host sharing
its port, and adds the hierarchical algorithms (``H`` hosts of ``R`` ranks, ``L`` lanes
= the smallest host's size, ``l``/``n`` the local and network parameters):

==============================  ===============================================================
allreduce hierarchical          2(R-1)α_l + 2(R-1)/R·nβ_l (RS + AG on the host)
                                + lanes' allreduce of n/L over H hosts, L lanes per port:
                                ring 2(H-1)α_n + 2(H-1)/H·nβ_n; + the reductions' γ
allgather hierarchical          AG on the host + lanes' ring over H hosts + AG of the lanes
hierarchical sparse (leader)    reduce to the leader + {Allgather Top-k, gTop-k, AR-Top-k}
                                over H leaders of k pairs + the result to the host's ranks
hierarchical sparse (sliced)    RS into L lanes + the same over H hosts per lane with k/L
                                pairs, L lanes per port + AG of the lanes' results
==============================  ===============================================================

:func:`paper_predict` holds the coarser per-scheme formulas of Tyagi & Swany's Table I
(one entry per synchronization scheme rather than per algorithm), for comparisons with the
paper; the selector uses the per-algorithm formulas above.

:func:`predict` and :func:`choose` take ``hosts=`` (a :class:`HostCosts`, e.g.
:func:`host_costs` of a communicator) and then price on the layout, with
``"hierarchical"`` among the candidates of allreduce and allgather; without it they use
the flat formulas above (one link class).

Tuning: the defaults in :class:`CostParams` are rough figures for shared memory under
Python; measure them on the target machine before trusting ``algorithm="auto"`` there:
``mpicomm.collectives.calibrate.measure(comm, store=True)`` fits alpha/beta from a
ping-pong and gamma from a numpy add, and puts them where ``auto`` looks
(``python -m mpicomm.bench collectives`` prints the fit).
"""

from __future__ import annotations

from .flat import (
    FORMULAS,
    allgather_bruck,
    allgather_direct,
    allgather_recursive_doubling,
    allgather_ring,
    allreduce_rabenseifner,
    allreduce_recursive_doubling,
    allreduce_ring,
    artopk_ring,
    artopk_tree,
    broadcast_binomial,
    broadcast_scatter_allgather,
    folded_butterfly,
    gtopk,
    ps_push_pull,
    reduce_scatter_direct,
    reduce_scatter_recursive_halving,
    reduce_scatter_ring,
    ring_allgather_pass,
    ring_reduce_scatter_pass,
    topk_allgather,
)
from .hosts import HOST_ALGORITHMS, SPARSE_INNER, HostCosts, Seconds, host_costs
from .paper import PAPER_SCHEMES, paper_predict
from .params import ComputeParams, CostParams, calibrated

__all__ = ["CostParams", "ComputeParams", "predict", "choose", "FORMULAS", "calibrated",
           "ps_push_pull", "paper_predict", "PAPER_SCHEMES", "HostCosts", "Seconds",
           "host_costs", "HOST_ALGORITHMS", "SPARSE_INNER", "HIERARCHICAL",
           "allreduce_ring", "allreduce_recursive_doubling", "allreduce_rabenseifner",
           "allgather_ring", "allgather_bruck", "allgather_direct",
           "allgather_recursive_doubling", "broadcast_binomial",
           "broadcast_scatter_allgather", "reduce_scatter_ring", "reduce_scatter_direct",
           "reduce_scatter_recursive_halving", "topk_allgather", "gtopk", "artopk_ring",
           "artopk_tree", "folded_butterfly", "ring_reduce_scatter_pass", "ring_allgather_pass"]

#: Collectives with a hierarchical algorithm (``algorithm="hierarchical"``).
HIERARCHICAL = ("allreduce", "allgather")


def _on_hosts(collective: str, algorithm: str, nbytes: float, hosts: HostCosts) -> float:
    if algorithm == "hierarchical":
        if collective == "allreduce":
            return hosts.hierarchical_allreduce(nbytes).total
        return hosts.hierarchical_allgather(nbytes).total
    if algorithm in HOST_ALGORITHMS.get(collective, ()):
        return hosts.flat(collective, algorithm, nbytes).total
    # no round model (scatter + allgather broadcast, recursive-halving reduce-scatter):
    # the flat formula on the slower link class
    c = hosts.network if hosts.topology.num_hosts > 1 else hosts.local
    return FORMULAS[collective][algorithm](nbytes, hosts.p, c)


def _candidates(collective: str, hosts: HostCosts | None) -> tuple[str, ...]:
    table = FORMULAS.get(collective)
    if table is None:
        raise ValueError(f"no cost model for collective {collective!r}")
    extra = ("hierarchical",) if hosts is not None and collective in HIERARCHICAL else ()
    return (*table, *extra)


def predict(collective: str, algorithm: str, nbytes: float, p: int,
            params: CostParams | None = None, hosts: HostCosts | None = None) -> float:
    """Predicted seconds for ``algorithm`` of ``collective`` on ``nbytes`` over ``p`` ranks.

    ``algorithm="mpi"`` (the MPI library's own) is predicted as the best of mpicomm's
    algorithms for the same collective: MPI libraries implement the same set and pick
    among them by size. ``hosts``: price on that layout with two link classes
    (:class:`HostCosts`, its ``p`` ranks; ``params`` is then ignored); ``"hierarchical"``
    needs it.
    """
    c = params or CostParams()
    names = _candidates(collective, hosts)
    if hosts is not None and hosts.p != p:
        raise ValueError(f"hosts places {hosts.p} ranks, not p={p}")
    if algorithm == "mpi":
        return min(predict(collective, a, nbytes, p, c, hosts) for a in names
                   if a != "hierarchical")
    if algorithm not in names:
        raise ValueError(f"no cost model for {collective} algorithm {algorithm!r}"
                         + (" without hosts=" if algorithm == "hierarchical" else ""))
    if hosts is not None:
        return 0.0 if p == 1 else _on_hosts(collective, algorithm, nbytes, hosts)
    return FORMULAS[collective][algorithm](nbytes, p, c)


def choose(collective: str, nbytes: float, p: int, params: CostParams | None = None,
           hosts: HostCosts | None = None) -> str:
    """The algorithm with the smallest predicted time (ties: the first listed; the
    hierarchical one, with ``hosts``, last)."""
    names = _candidates(collective, hosts)
    return min(names, key=lambda name: predict(collective, name, nbytes, p, params, hosts))
