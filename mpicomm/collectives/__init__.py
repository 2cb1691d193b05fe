"""mpicomm's own dense collectives, built on point-to-point MPI.

Every function takes numpy arrays, torch tensors (CPU/CUDA) or cupy arrays, returns the
same kind of object, accepts ``algorithm="mpi"`` for the MPI library's native version,
works for any number of ranks, and gives every rank the same result. Their costs are
in :mod:`mpicomm.collectives.cost`.
"""

from . import cost
from .allgather import allgather, allgatherv
from .allreduce import allreduce
from .broadcast import broadcast
from .reduce_scatter import reduce_scatter

ALGORITHMS = {
    "allreduce": ("ring", "recursive_doubling", "rabenseifner", "hierarchical", "mpi"),
    "allgather": ("ring", "bruck", "recursive_doubling", "direct", "hierarchical", "mpi"),
    "allgatherv": ("ring", "direct", "mpi"),
    "broadcast": ("binomial", "scatter_allgather", "mpi"),
    "reduce_scatter": ("ring", "recursive_halving", "direct", "mpi"),
}

__all__ = ["allreduce", "allgather", "allgatherv", "broadcast", "reduce_scatter", "cost",
           "ALGORITHMS"]
