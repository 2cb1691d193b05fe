"""QSGD: unbiased stochastic uniform quantization per bucket, bit-packed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..buffers import to_torch
from ..validate import check_int
from ._rng import generator
from ._tensor import FiniteCheck, TensorMeta, flatten, restore, to_native
from .base import Compressor, Payload
from .bitpack import pack_bits, packed_nbytes, unpack_bits

__all__ = ["QSGD", "QSGDCtx"]


@dataclass(frozen=True)
class QSGDCtx:
    """Local context of a QSGD payload."""

    meta: TensorMeta
    bits: int
    bucket_size: int


class QSGD(Compressor):
    """Stochastic uniform quantization of each bucket to ``2**bits - 1`` magnitude levels.

    The flat tensor is cut into buckets of ``bucket_size`` elements (the last one may be
    shorter). For a bucket ``v`` with scale ``c = ||v||_2`` (the L2 norm, as in QSGD) and
    ``s = 2**bits - 1``, each entry is sent as a sign and a level

        q_i = floor(|v_i| / c * s + u_i),  u_i ~ U[0, 1) i.i.d.,

    (``q_i`` in ``0..s``) and decoded as ``sign(v_i) * q_i * c / s``. Since
    ``E[floor(a + u)] = a``, decoding is unbiased: ``E[D(C(x))] = x``. The variance per
    bucket is at most ``min(B / s**2, sqrt(B) / s) * ||v||^2`` (B = bucket size), so the
    relative error is about ``sqrt(B) / (2 s)``; ``bits=1`` gives ternary levels
    {-c, 0, c}. Zero buckets decode to zeros.

    Wire, for ``n`` elements and ``nb = ceil(n / bucket_size)`` buckets:

    * ``"levels"``: uint8, each element's ``bits + 1``-bit code (sign bit, then the level)
      packed back to back: ``ceil(n * (bits + 1) / 8)`` bytes;
    * ``"scales"``: float32 per bucket: ``4 * nb`` bytes.

    Total ``ceil(n * (bits + 1) / 8) + 4 * nb`` bytes, independent of the input dtype
    (fixed size). Per-bucket scales differ across ranks: not allreduce-compatible.

    Randomness: a generator seeded by ``(seed, salt, name, step)`` on the tensor's
    device. With the default ``salt=0`` all ranks use the same noise for a given tensor
    and step; strategies that want independent rounding per rank pass ``salt=rank``.
    What is promised across devices is the *distribution*, not the bits: CUDA and CPU
    generators give different streams, so a CUDA tensor is rounded with different noise
    than its CPU copy (each reproducible on its own device), while the scales, the grid
    of levels and unbiasedness are the same (every entry lands on one of the two levels
    around ``|x_i| / c * s``, so the two decodings differ by at most one level ``c / s``).
    Drawing on the device keeps QSGD free of host round trips on the GPU; bitwise
    CPU = GPU agreement would need the noise drawn on the CPU and copied over.

    Cost: O(n) with a few passes (norms, noise, rounding, packing); the bucket norm is
    computed in float32 (float64 for float64 input).

    Tuning: 4-8 bits with buckets of 128-512 keep accuracy with little or no error
    feedback; fewer bits or larger buckets raise the variance (see above), which error
    feedback or a smaller learning rate must absorb.
    """

    name = "qsgd"
    allreduce_compatible = False
    fixed_size = True

    def __init__(self, bits: int = 8, bucket_size: int = 512, seed: int = 0, *,
                 salt: int = 0, allow_nonfinite: bool = False) -> None:
        bits = check_int("bits", bits, 1, 8)
        bucket_size = check_int("bucket_size", bucket_size, 1)
        self.bits = bits
        self.bucket_size = bucket_size
        self.seed = int(seed)
        self.salt = int(salt)
        self.allow_nonfinite = bool(allow_nonfinite)

    @property
    def levels(self) -> int:
        """``s = 2**bits - 1``, the number of nonzero magnitude levels."""
        return 2**self.bits - 1

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> Payload:
        t, meta = flatten(x, name=name, step=step)
        finite = None if self.allow_nonfinite else FiniteCheck(t, name, "QSGD")
        n, b, s = meta.numel, self.bucket_size, self.levels
        work = torch.float64 if t.dtype == torch.float64 else torch.float32
        nb = math.ceil(n / b)
        padded = torch.zeros(nb * b, dtype=work, device=t.device)
        padded[:n] = t
        buckets = padded.view(nb, b)
        scales = torch.linalg.vector_norm(buckets, dim=1).to(torch.float32)
        c = scales.to(work).unsqueeze(1)  # decode uses exactly the scale that is sent
        safe = torch.where(c > 0, c, torch.ones_like(c))
        a = torch.clamp(buckets.abs() / safe * s, max=float(s))
        g = generator(self.seed, name, step, self.salt, device=t.device)
        u = torch.rand(a.shape, generator=g, dtype=work, device=t.device)
        q = torch.clamp(torch.floor(a + u), max=float(s)).to(torch.int32).view(-1)[:n]
        negative = (t < 0).to(torch.int32)
        codes = (negative << self.bits) | q
        arrays = {"levels": to_native(pack_bits(codes, self.bits + 1), meta.framework),
                  "scales": to_native(scales, meta.framework)}
        if finite is not None:
            finite.verify()  # after queuing the work: see FiniteCheck
        return Payload(arrays, QSGDCtx(meta, self.bits, b))

    def decompress(self, payload: Payload) -> Any:
        ctx: QSGDCtx = payload.ctx
        meta, bits = ctx.meta, ctx.bits
        n, b = meta.numel, ctx.bucket_size
        scales = to_torch(payload.arrays["scales"]).reshape(-1)
        work = torch.float64 if meta.dtype == torch.float64 else torch.float32
        codes = unpack_bits(to_torch(payload.arrays["levels"]).reshape(-1), bits + 1, n)
        q = (codes & (2**bits - 1)).to(work)
        sign = 1 - 2 * (codes >> bits).to(work)
        step = (scales.to(work) / (2**bits - 1)).repeat_interleave(b)[:n]
        return restore(sign * q * step, meta)

    def wire_bytes(self, numel: int, itemsize: int = 4, *,
                   shape: tuple[int, ...] | None = None) -> int:
        return packed_nbytes(numel, self.bits + 1) + 4 * math.ceil(numel / self.bucket_size)
