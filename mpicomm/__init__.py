"""mpicomm: an MPI-native runtime for communication-efficient distributed training.

Start with :func:`init`, which returns a :class:`Communicator`; the collectives take
numpy arrays, torch tensors or cupy arrays and return the same kind of object::

    import mpicomm
    comm = mpicomm.init()
    total = mpicomm.allreduce(grad, op="avg", comm=comm)
"""

from ._version import __version__
from .collectives import allgather, allgatherv, allreduce, broadcast, reduce_scatter
from .comm import Communicator, Roles, init, install_abort_handler, world

__all__ = [
    "__version__",
    "Communicator",
    "Roles",
    "init",
    "world",
    "install_abort_handler",
    "allreduce",
    "allgather",
    "allgatherv",
    "broadcast",
    "reduce_scatter",
]
