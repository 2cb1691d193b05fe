"""Flat torch views of caller arrays and the way back, shared by every compressor.

Each compressor is written once in torch. :func:`flatten` turns a numpy array, torch
tensor (CPU or CUDA) or cupy array into a 1-D torch tensor that shares memory with it
where possible (never written to), and records a :class:`TensorMeta` with what is
needed to rebuild a result of the caller's shape, dtype, framework and device.
:func:`to_native` sends a torch result back to the caller's framework.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..buffers import FLOAT_DTYPES, from_torch, inspect, to_torch

__all__ = ["TensorMeta", "flatten", "to_native", "restore", "FiniteCheck", "torch_dtype"]


@dataclass(frozen=True)
class TensorMeta:
    """Local facts about a compressed tensor; never sent over the wire."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    framework: str
    device: torch.device
    name: str = ""
    step: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"int32"`` -> ``torch.int32``)."""
    return getattr(torch, name)


def flatten(x: Any, *, name: str = "", step: int = 0,
            floating: bool = True) -> tuple[torch.Tensor, TensorMeta]:
    """``x`` as a detached 1-D torch tensor plus its :class:`TensorMeta`.

    ``TypeError`` (from :func:`mpicomm.buffers.inspect`) for an unsupported framework or
    dtype, and for a non-floating dtype when ``floating`` is true. The tensor may share
    memory with ``x``: callers must not write to it.
    """
    info = inspect(x)
    if floating and info.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"tensor {name!r}: compressors take floating-point data, got {info.dtype}"
        )
    t = to_torch(x).detach()
    meta = TensorMeta(tuple(info.shape), t.dtype, info.framework, t.device, name, step)
    return t.reshape(-1), meta


def to_native(t: torch.Tensor, framework: str) -> Any:
    """Torch tensor ``t`` in ``framework`` (zero-copy where possible), same device."""
    if framework == "torch":
        return t
    if framework == "numpy":
        return from_torch(t, like=_NUMPY_LIKE)
    import cupy

    return from_torch(t, like=cupy.empty(0))


def restore(flat: torch.Tensor, meta: TensorMeta) -> Any:
    """A dense flat result turned back into the caller's shape, dtype and framework."""
    out = flat.to(device=meta.device, dtype=meta.dtype).reshape(meta.shape)
    return to_native(out, meta.framework)


class FiniteCheck:
    """The finiteness check of ``t``, started now and verified later.

    The flag ``isfinite(t).all()`` is computed where ``t`` lives; on a GPU it is copied to
    pinned host memory asynchronously, behind an event. :meth:`verify` waits for that
    copy and raises ``ValueError`` naming the tensor. Compressors start the check first
    and verify it after queuing the rest of their work, so the host reads the flag once,
    at the end (the one host round trip a compressor makes with ``allow_nonfinite``
    off), and the device never idles while the host waits in the middle of the work.
    """

    def __init__(self, t: torch.Tensor, name: str, what: str, key: Any = None):
        self.t, self.name, self.what = t, name, what
        self.key = key  # the caller's label for what was checked (PowerSGD: a stamp)
        self.flag: torch.Tensor | None = None
        self.event: Any = None
        if not t.numel():
            return
        flag = torch.isfinite(t).all()
        if t.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))
            flag = host
        self.flag = flag

    def verify(self) -> None:
        if self.flag is None:
            return
        if self.event is not None:
            self.event.synchronize()
        if not bool(self.flag):
            bad = int((~torch.isfinite(self.t)).sum())
            raise ValueError(
                f"{self.what}: tensor {self.name!r} holds {bad} non-finite value(s) (NaN "
                "or inf); fix the gradient (e.g. loss scaling) or pass allow_nonfinite=True"
            )


_NUMPY_LIKE = np.empty(0)
