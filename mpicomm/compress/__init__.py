"""Compressors and error feedback: pure tensor -> payload -> tensor maps, no MPI.

A compressor (:class:`Compressor`) turns a numpy array, torch tensor (CPU/CUDA) or cupy
array into a :class:`Payload` (the arrays to put on the wire, in the input's framework
and device, plus local context) and back, and declares whether its payloads can be
summed by an Allreduce (``allreduce_compatible``) and whether their sizes depend only on
the tensor size (``fixed_size``). It never communicates: strategies pair it with a
collective. :class:`ErrorFeedback` is the separate residual memory keyed by tensor name.

>>> import numpy as np
>>> from mpicomm.compress import make
>>> c = make("topk", density=0.25)
>>> p = c.compress(np.array([0.1, -3.0, 2.0, 0.5]), name="w")
>>> p.arrays["indices"].tolist(), c.decompress(p).tolist()
([1], [0.0, -3.0, 0.0, 0.0])
"""

from __future__ import annotations

from typing import Any, Callable

from .base import Compressor, Payload
from .cast import BF16, FP16, Cast, NoCompression
from .feedback import ErrorFeedback
from .powersgd import PowerSGD
from .qsgd import QSGD
from .randomk import RandomK
from .sampled_topk import SampledTopK, recall
from .sign import SignSGD
from .topk import TopK, k_for

__all__ = [
    "Payload",
    "Compressor",
    "TopK",
    "SampledTopK",
    "RandomK",
    "QSGD",
    "Cast",
    "FP16",
    "BF16",
    "PowerSGD",
    "SignSGD",
    "NoCompression",
    "ErrorFeedback",
    "REGISTRY",
    "make",
    "k_for",
    "recall",
]

#: Compressor classes by their registry name (``Compressor.name``).
REGISTRY: dict[str, Callable[..., Compressor]] = {
    cls.name: cls
    for cls in (TopK, SampledTopK, RandomK, QSGD, FP16, BF16, PowerSGD, SignSGD,
                NoCompression)
}


def _cost_kernels() -> None:
    """Register how to measure each compressor for the virtual clock's cost table
    (:mod:`mpicomm.costtable`): default settings, top-k kinds at density 0.01, a float32
    torch vector of ``n`` elements (PowerSGD on an ``n/256 x 256`` matrix)."""
    from ..costtable import register_kernel

    def kernels_of(name: str) -> None:
        kwargs = {"density": 0.01} if name in ("topk", "sampled_topk", "randomk") else {}

        def tensor(n: int) -> Any:
            import torch

            gen = torch.Generator().manual_seed(0)
            if name == "powersgd":
                return torch.randn(max(1, n // 256), 256, generator=gen)
            return torch.randn(n, generator=gen)

        def compress(n: int) -> Callable[[], Any]:
            c, x = make(name, **kwargs), tensor(n)
            return lambda: c.compress(x, name="calibration")

        def decompress(n: int) -> Callable[[], Any]:
            c, x = make(name, **kwargs), tensor(n)
            payload = c.compress(x, name="calibration")
            return lambda: c.decompress(payload)

        register_kernel(f"compress:{name}", compress, "element", (1 << 14, 1 << 20))
        register_kernel(f"decompress:{name}", decompress, "element", (1 << 14, 1 << 20))

    for name in REGISTRY:
        kernels_of(name)

    def matmul(n: int) -> Callable[[], Any]:   # n multiply-adds: an m x m by m x m product
        import torch

        m = max(1, round(n ** (1 / 3)))
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, m, generator=gen), torch.randn(m, m, generator=gen)
        return lambda: a @ b

    register_kernel("flop", matmul, "multiply-add", (1 << 15, 1 << 24))


def make(name: str, **kwargs: Any) -> Compressor:
    """The compressor called ``name`` (see :data:`REGISTRY`) built with ``kwargs``.

    ``ValueError`` for an unknown name or invalid arguments.
    """
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown compressor {name!r}; choose one of {', '.join(sorted(REGISTRY))}"
        ) from None
    try:
        return cls(**kwargs)
    except TypeError as e:  # unexpected keyword: a configuration error
        raise ValueError(f"bad arguments for compressor {name!r}: {e}") from None


_cost_kernels()
