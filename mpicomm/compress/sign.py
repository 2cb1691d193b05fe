"""Scaled sign compression (EF-SignSGD), one bit per element."""

from __future__ import annotations

from typing import Any

import torch

from ..buffers import to_torch
from ._tensor import FiniteCheck, TensorMeta, flatten, restore, to_native
from .base import Compressor, Payload
from .bitpack import pack_bits, packed_nbytes, unpack_bits

__all__ = ["SignSGD"]


class SignSGD(Compressor):
    """Send one sign bit per element and one scale: ``C(x) = (||x||_1 / d) * sign(x)``.

    This is the scaled sign of EF-SignSGD (Karimireddy et al., 2019): the scale
    ``||x||_1 / d`` (d = numel) makes ``C`` a contraction, so that with error feedback
    it converges like SGD, which plain signSGD does not. ``scale=False`` sends 1.0 as
    the scale (plain ``sign(x)``; for majority-vote style schemes). Zeros are sent as
    ``+``.

    Wire: ``{"signs": uint8, ceil(d / 8) bytes, bit 1 = negative, most significant bit
    first (numpy.packbits order); "scale": one float32}`` = ``ceil(d / 8) + 4`` bytes for
    any input dtype. Fixed size. Not allreduce-compatible (summing bit-packed signs is
    meaningless; aggregate with an Allgather, or vote).

    Cost: one O(d) pass for the L1 norm, one to pack the bits. The scale is computed in
    float32 (float64 for float64 input).

    Tuning: compresses 32x (float32), independent of the gradient. Always pair with
    error feedback. The scale is per tensor, so compress layer by layer rather than a
    fused bucket of many layers, where one large layer would set the scale of all.
    """

    name = "sign"
    allreduce_compatible = False
    fixed_size = True

    def __init__(self, scale: bool = True, *, allow_nonfinite: bool = False) -> None:
        self.scale = bool(scale)
        self.allow_nonfinite = bool(allow_nonfinite)

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        t, meta = flatten(x, name=name, step=step)
        finite = None if self.allow_nonfinite else FiniteCheck(t, name, "SignSGD")
        work = torch.float64 if t.dtype == torch.float64 else torch.float32
        n = meta.numel
        if self.scale and n:
            scale = (torch.linalg.vector_norm(t.to(work), ord=1) / n).to(torch.float32)
        else:
            scale = torch.tensor(1.0, dtype=torch.float32, device=t.device)
        signs = pack_bits((t < 0).to(torch.uint8), 1)
        arrays = {"signs": to_native(signs, meta.framework),
                  "scale": to_native(scale.reshape(1), meta.framework)}
        if finite is not None:
            finite.verify()  # after queuing the work: see FiniteCheck
        return Payload(arrays, meta)

    def decompress(self, payload: Payload) -> Any:
        meta: TensorMeta = payload.ctx
        work = torch.float64 if meta.dtype == torch.float64 else torch.float32
        negative = unpack_bits(to_torch(payload.arrays["signs"]).reshape(-1), 1, meta.numel)
        scale = to_torch(payload.arrays["scale"]).reshape(-1)[0].to(work)
        return restore((1 - 2 * negative.to(work)) * scale, meta)

    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        return packed_nbytes(numel, 1) + 4
