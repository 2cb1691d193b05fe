"""The compressor interface: a tensor becomes a :class:`Payload` and back, nothing more.

A compressor never communicates (architecture contract). It declares what a strategy may
do with its payloads:

``allreduce_compatible``
    Summing every rank's payload arrays elementwise and decompressing the sum gives the
    sum of the decompressed tensors (all ranks use the same indices/basis). Such payloads
    can go through an Allreduce; the others need an Allgather (or a gather to a server).
``fixed_size``
    Payload array sizes depend only on the input's number of elements, never on its
    values, so receivers can size buffers without first exchanging counts.
``phases``
    1 for a plain compress -> communicate -> decompress. PowerSGD has 2 (its P and Q
    factors are reduced one after the other) and is driven phase by phase by a
    strategy; its single-shot :meth:`compress` serves the one-rank case.

Payload arrays live in the input's framework (numpy, torch or cupy) and on its device,
are 1-D or 2-D, contiguous, and never alias the input (a strategy may reduce into them in
place). ``Payload.ctx`` holds local metadata that never travels.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import clock

__all__ = ["Payload", "Compressor", "charge"]


@dataclass
class Payload:
    """What a compressor produced for one tensor.

    ``arrays``: what goes on the wire, by role (e.g. ``{"values": v, "indices": i}``), in
    the input's framework and on its device. ``ctx``: local metadata (shape, dtype,
    framework, device, name, step, ...), never sent.
    """

    arrays: dict[str, Any]
    ctx: Any

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays, i.e. what this rank puts on the wire for the tensor."""
        return sum(int(a.nbytes) for a in self.arrays.values())


_nesting = threading.local()


def _numel(x: Any) -> int:
    n = getattr(x, "numel", None)
    return int(n()) if callable(n) else int(getattr(x, "size", 0))


def charge(op: str, units: float) -> None:
    """Charge the virtual clock for work a compressor does outside ``compress`` /
    ``decompress`` (PowerSGD's phases, driven by a strategy); nothing when called from
    inside them (their per-element charge covers it)."""
    if getattr(_nesting, "depth", 0) == 0:
        clock.charge(op, units)


def _charged(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a compressor's compress or decompress) charging the virtual clock
    ``KIND:NAME`` per element of the dense tensor, once per outermost call."""

    @functools.wraps(fn)
    def wrapper(self: Compressor, arg: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_nesting, "depth", 0)
        _nesting.depth = depth + 1
        try:
            if depth == 0 and kind == "compress":
                clock.charge(f"compress:{self.name}", _numel(arg))
            out = fn(self, arg, *args, **kwargs)
            if depth == 0 and kind == "decompress":
                clock.charge(f"decompress:{self.name}", _numel(out))
            return out
        finally:
            _nesting.depth = depth

    wrapper._charges_clock = True  # type: ignore[attr-defined]
    return wrapper


class Compressor(ABC):
    """Base class of all compressors (see the module docstring for the capabilities).

    Under the virtual clock (:mod:`mpicomm.clock`) every subclass's ``compress`` and
    ``decompress`` charge ``compress:NAME`` / ``decompress:NAME`` per element of the
    dense tensor from the cost table (a subclass calling its parent's is charged once).
    """

    name: ClassVar[str] = "base"
    allreduce_compatible: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    phases: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for kind in ("compress", "decompress"):
            fn = cls.__dict__.get(kind)
            if fn is not None and not getattr(fn, "_charges_clock", False) \
                    and not getattr(fn, "__isabstractmethod__", False):
                setattr(cls, kind, _charged(kind, fn))

    @abstractmethod
    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        """Map ``x`` (numpy / torch / cupy) to a :class:`Payload`.

        ``name`` keys per-tensor state and random streams; ``step`` selects the random
        stream of stochastic compressors.
        """

    @abstractmethod
    def decompress(self, payload: Payload) -> Any:
        """Dense tensor of the original shape, dtype, framework and device."""

    @abstractmethod
    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        """Bytes one rank puts on the wire for a tensor of ``numel`` elements.

        ``itemsize`` is the input's element size. Exact for fixed-size compressors; for
        variable-size ones, the upper bound (documented per class). ``shape`` is used
        only by compressors whose size depends on more than ``numel`` (PowerSGD).
        """

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"
