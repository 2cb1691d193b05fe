"""mpicomm: an MPI-native runtime for communication-efficient distributed training.

Start with :func:`init`, which returns a :class:`Communicator`; the collectives take
numpy arrays, torch tensors or cupy arrays and return the same kind of object::

    import mpicomm
    comm = mpicomm.init()
    total = mpicomm.allreduce(grad, op="avg", comm=comm)
"""

import contextlib as _contextlib
import importlib
from typing import Any

from mpi4py import MPI as _MPI

from . import observe as _observe  # noqa: F401  (adds its start-from-environment hook to init)
from ._version import __version__
from .abort import install_abort_handler, install_from_env
from .collectives import allgather, allgatherv, allreduce, broadcast, reduce_scatter
from .comm import Communicator, Roles, Traffic, init, world

__all__ = [
    "__version__",
    "Communicator",
    "Roles",
    "Traffic",
    "init",
    "world",
    "install_abort_handler",
    "allreduce",
    "allgather",
    "allgatherv",
    "broadcast",
    "reduce_scatter",
]

# In a job of several ranks an uncaught exception ends the job with one message even
# before init (a bad argument raised on every rank, a failure on one rank while the
# others wait); MPICOMM_ABORT_ON_ERROR=0 leaves Python's default. An unreadable value is
# reported by init or the first collective, once the package is whole.
if _MPI.COMM_WORLD.Get_size() > 1:
    with _contextlib.suppress(ValueError):
        install_from_env()

# Subpackages that import torch load on first use: ``import mpicomm`` stays light.
_LAZY = ("compress", "sparse", "strategies", "control", "gossip", "sched", "ps", "torch",
         "buffers", "collectives", "emulate", "hooks", "p2p")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names: ``__all__``, the lazily imported subpackages and the submodules
    already imported (not the helpers this module imports for itself)."""
    from types import ModuleType

    loaded = (n for n, v in globals().items() if not n.startswith("_")
              and isinstance(v, ModuleType) and v.__name__.startswith(__name__ + "."))
    return sorted({*__all__, *_LAZY, *loaded})
