"""Precision casts (float16, bfloat16) and the identity compressor."""

from __future__ import annotations

from typing import Any

import torch

from ..buffers import framework_of, to_torch
from ._tensor import TensorMeta, flatten, restore, to_native
from .base import Compressor, Payload

__all__ = ["Cast", "FP16", "BF16", "NoCompression"]


class Cast(Compressor):
    """Send the tensor in a narrower floating-point dtype; decompress casts back.

    Formula: ``C(x) = round_to_nearest(x)`` in the wire dtype; values beyond its range
    become ±inf (float16: |x| > 65504; bfloat16 has float32's range but 8 significant
    bits). Wire: ``{"values": numel elements of the wire dtype}`` = ``2 * numel`` bytes.
    Elementwise and the same map on every rank: allreduce-compatible (the sum is then
    taken in the wire precision, as NCCL does), fixed size. Cost: one O(n) cast each way.
    """

    name = "cast"
    allreduce_compatible = True
    fixed_size = True
    wire_dtype: torch.dtype = torch.float16

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        t, meta = flatten(x, name=name, step=step)
        return Payload({"values": to_native(t.to(self.wire_dtype, copy=True),
                                            meta.framework)}, meta)

    def decompress(self, payload: Payload) -> Any:
        meta: TensorMeta = payload.ctx
        return restore(to_torch(payload.arrays["values"]).reshape(-1), meta)

    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        return numel * self.wire_dtype.itemsize


class FP16(Cast):
    """IEEE float16 cast (``numel * 2`` bytes); see :class:`Cast`.

    Tuning: safe for gradients when a loss scaler keeps them inside float16's range
    (about 6e-8 .. 65504); otherwise prefer :class:`BF16` (torch tensors only).
    """

    name = "fp16"
    wire_dtype = torch.float16


class BF16(Cast):
    """bfloat16 cast (``numel * 2`` bytes); see :class:`Cast`.

    bfloat16 exists only in torch, so numpy and cupy inputs raise ``TypeError``: their
    payload could not be in the input's framework. Tuning: no loss scaling needed (same
    exponent range as float32), but only ~3 significant decimal digits.
    """

    name = "bf16"
    wire_dtype = torch.bfloat16

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        fw = framework_of(x)
        if fw != "torch":
            raise TypeError(
                f"tensor {name!r}: bfloat16 payloads need torch tensors, got a {fw} array "
                "(use FP16 for numpy/cupy data)"
            )
        return super().compress(x, name=name, step=step)


class NoCompression(Compressor):
    """The identity: sends the tensor as it is (the dense baseline).

    Wire: ``{"values": numel elements of the input dtype}`` = ``numel * itemsize``
    bytes. Allreduce-compatible, fixed size. Accepts any dtype mpicomm supports. With
    ``copy=True`` (default) the payload is a fresh flat copy; ``copy=False`` sends a
    flat view of the input (no cost, but an in-place reduction then writes the input).
    """

    name = "none"
    allreduce_compatible = True
    fixed_size = True

    def __init__(self, copy: bool = True) -> None:
        self.copy = bool(copy)

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        t, meta = flatten(x, name=name, step=step, floating=False)
        if self.copy:
            t = t.clone()
        return Payload({"values": to_native(t, meta.framework)}, meta)

    def decompress(self, payload: Payload) -> Any:
        meta: TensorMeta = payload.ctx
        return restore(to_torch(payload.arrays["values"]).reshape(-1), meta)

    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        return numel * itemsize
