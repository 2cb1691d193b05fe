"""Sparse collectives for top-k gradient compression.

=====================  ================================================================
function               what every rank gets
=====================  ================================================================
:func:`topk_allgather` every rank's (indices, values) scatter-added into a dense vector
                       (ring allgatherv; exact; (P-1)·k·s bytes sent per rank)
:func:`gtopk`          approximate global top-k of the sum by butterfly merge-and-truncate
                       (lg P rounds of <= k pairs; exact for P <= 2)
:func:`artopk`         one source rank's top-k indices (STAR round-robin or VAR norm
                       EWMA) and the mean over ranks of the values there (bcast+allreduce)
:func:`exact_topk`     exact top-k of the sum (allgather all pairs; the reference)
:func:`hierarchical_   dense sum inside each host, then top-k and gTop-k / AR-Top-k /
topk`                  Allgather across hosts only, the result back to the host's ranks
                       (:mod:`mpicomm.sparse.hierarchical`)
=====================  ================================================================

Inputs are numpy arrays, torch tensors (CPU/CUDA) or cupy arrays; results come back in the
same framework and device, sorted by index ascending and identical on every rank. Every
selection uses the library's total order (``|v|`` desc, then index asc).
:mod:`mpicomm.sparse.reference` holds single-process numpy references (the spec),
:mod:`mpicomm.sparse.sets` the kernels on sparse sets (union, truncation, merge).
Costs are in :mod:`mpicomm.collectives.cost` (``topk_allgather``, ``gtopk``,
``artopk_ring``, ``artopk_tree``).
"""

from . import reference, sets
from .allgather import exact_topk, topk_allgather
from .artopk import ARTopKState, artopk
from .gtopk import gtopk
from .hierarchical import hierarchical_topk

__all__ = ["topk_allgather", "gtopk", "artopk", "ARTopKState", "exact_topk",
           "hierarchical_topk", "reference", "sets"]
