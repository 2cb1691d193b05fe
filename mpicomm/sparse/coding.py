r"""A compact wire format for sparse (index, value) pairs: ``"log8"``.

A message of k pairs of a vector of d elements (the indices distinct)::

    header   count k (uint32), scale M = max |v| (float64)            12 bytes
    values   one byte per pair, in index order:                        k bytes
             bit 7 the sign, bits 0-6 a level q: |v| ~ M·2^(-q/8)
             (q = round(-8·log2(|v|/M)), 0 <= q <= 126; q = 127 is zero)
    indices  the gaps between sorted indices (the first index itself),
             each an unsigned LEB128 varint: 7 bits a byte             ~k·⌈log2(d/k)/7⌉

Decoding gives ``v̂ = sign·M·2^(-q/8)``: eight levels per octave, so a relative error of
at most ``2^(1/16) - 1`` (4.4%) for ``|v| >= M·2^(-15.8)``; smaller values decode to 0.
The indices are exact. Per pair that is 1 byte of value plus 1 byte of index for gaps
below 128 (density above about 1/128 of evenly spread picks), 2 up to 16 384: about 2-3
bytes against 8 for int32 indices and float32 values, so a sparse Allgather at density
0.01 sends about 3.5x fewer bytes. The loss is in the values only: pair it with error
feedback and keep ``v - v̂`` in the residual (:func:`quantize`, and
:meth:`~mpicomm.compress.ErrorFeedback.update_sparse`'s ``sent``), so nothing of the
gradient is lost, only delayed, as with the sparsification itself.

Cost: a sort of the k pairs by index to encode, and a few elementwise passes over the
pairs of every message to decode (numpy, on the host; the pairs of a device tensor are
copied to the host and back).

Every rank decodes a message to the same bits: the scale travels as float64 and the
decode is one fixed numpy computation.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import clock
from ..p2p import pack, unpack

__all__ = ["CODINGS", "encode", "decode", "quantize", "coded_bytes", "to_wire",
           "to_wire_as_read", "from_wire"]

#: Wire formats of :func:`encode` (``None``, the plain pairs, is the default elsewhere).
CODINGS = ("log8",)

_HEADER = np.dtype([("count", "<u4"), ("scale", "<f8")])
_LEVELS_PER_OCTAVE = 8
_ZERO = 127
_SIGN = 0x80


def check_coding(coding: str | None, allow_nonfinite: bool = False) -> str | None:
    """``coding`` if it is ``None`` or one of :data:`CODINGS` (and, with ``coding``, the
    values are checked finite: not ``allow_nonfinite``); ``ValueError`` otherwise."""
    if coding is not None and coding not in CODINGS:
        raise ValueError(f"coding must be None or one of {CODINGS}, got {coding!r}")
    if coding is not None and allow_nonfinite:
        raise ValueError(f"coding={coding!r} needs finite values: "
                         "allow_nonfinite=True is for the plain pairs only")
    return coding


def _levels(values: np.ndarray) -> tuple[float, np.ndarray]:
    """The scale M and each value's byte (sign bit and level)."""
    mag = np.abs(values)
    if not np.isfinite(mag).all():
        raise ValueError("the log8 coding needs finite values")
    scale = float(mag.max()) if mag.size else 0.0
    if scale == 0.0:
        return 0.0, np.full(mag.shape, _ZERO, dtype=np.uint8)
    with np.errstate(divide="ignore"):
        q = np.rint(-_LEVELS_PER_OCTAVE * np.log2(mag / scale))
    q = np.minimum(q, _ZERO).astype(np.uint8)          # log2(0) = -inf: zero
    return scale, q | np.where(values < 0, _SIGN, 0).astype(np.uint8)


def _values(scale: float, codes: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Decoded values of ``codes`` under ``scale``, as ``dtype``."""
    q = (codes & ~np.uint8(_SIGN)).astype(np.float64)
    out = scale * np.exp2(-q / _LEVELS_PER_OCTAVE)
    out[q == _ZERO] = 0.0
    out = np.where(codes & _SIGN, -out, out)
    return torch.from_numpy(out).to(dtype)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """The values a receiver of :func:`encode` decodes for ``values`` (same dtype and
    device): what the sender should keep ``values - quantize(values)`` of."""
    scale, codes = _levels(values.detach().cpu().to(torch.float64).numpy())
    return _values(scale, codes, values.dtype).to(values.device)


def _varints(gaps: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 bytes of non-negative integers, back to back."""
    nbytes = np.ones(gaps.shape[0], dtype=np.int64)
    for shift in range(7, 64, 7):
        nbytes += gaps >= (np.uint64(1) << np.uint64(shift))
    starts = np.cumsum(nbytes) - nbytes
    place = np.arange(int(nbytes.sum()), dtype=np.int64) - np.repeat(starts, nbytes)
    out = ((np.repeat(gaps, nbytes) >> (7 * place).astype(np.uint64)) & np.uint64(0x7F))
    out = out.astype(np.uint8)
    out[place < np.repeat(nbytes, nbytes) - 1] |= np.uint8(0x80)
    return out


def _from_varints(buf: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`_varints` for ``count`` integers filling ``buf`` exactly."""
    ends = np.flatnonzero((buf & 0x80) == 0)       # the last byte of each varint
    used = int(ends[-1]) + 1 if ends.shape[0] else 0
    if ends.shape[0] != count or used != buf.shape[0]:
        raise RuntimeError(f"log8 message: {ends.shape[0]} indices for a count of {count} "
                           f"({buf.shape[0]} index bytes)")
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    nbytes = ends - starts + 1
    place = np.arange(buf.shape[0], dtype=np.int64) - np.repeat(starts, nbytes)
    parts = (buf & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
    return np.add.reduceat(parts, starts)


def _encode(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, float,
                                                                  np.ndarray]:
    """The ``"log8"`` message of the pairs, with the scale and the codes of ``values``
    in their given order (what :func:`_values` decodes)."""
    idx = indices.detach().cpu().numpy().astype(np.int64).reshape(-1)
    scale, codes = _levels(values.detach().cpu().to(torch.float64).numpy().reshape(-1))
    order = np.argsort(idx, kind="stable")
    header = np.zeros(1, dtype=_HEADER)
    header["count"], header["scale"] = idx.shape[0], scale
    gaps = np.diff(idx[order], prepend=0).astype(np.uint64)
    msg = np.concatenate([header.view(np.uint8), codes[order], _varints(gaps)])
    return torch.from_numpy(msg), scale, codes


def encode(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One uint8 tensor (on the host) holding the pairs in the ``"log8"`` format."""
    return _encode(indices, values)[0]


def decode(buf: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The (int64 indices, ``dtype`` values) of one :func:`encode` message, sorted by
    index, on the host."""
    raw = buf.detach().cpu().numpy().view(np.uint8)
    size = _HEADER.itemsize
    if raw.shape[0] < size:
        raise RuntimeError(f"log8 message of {raw.shape[0]} bytes, shorter than its header")
    header = raw[:size].copy().view(_HEADER)[0]
    count, scale = int(header["count"]), float(header["scale"])
    if raw.shape[0] < size + count:
        raise RuntimeError(f"log8 message of {raw.shape[0]} bytes for {count} pairs")
    codes = raw[size:size + count]
    idx = np.cumsum(_from_varints(raw[size + count:], count)).astype(np.int64)
    return torch.from_numpy(idx), _values(scale, codes, dtype)


def to_wire(idx: torch.Tensor, val: torch.Tensor, index_dtype: torch.dtype,
            coding: str | None) -> torch.Tensor:
    """The message of a sparse set: plain pairs with ``index_dtype`` indices (on the
    values' device), or ``coding``'s format (on the host; its receiver reads
    :func:`quantize` of the values)."""
    if coding is None:
        return pack(idx, val, index_dtype)
    clock.charge("encode:log8", idx.shape[0])
    return encode(idx, val)


def to_wire_as_read(idx: torch.Tensor, val: torch.Tensor, index_dtype: torch.dtype,
                    coding: str | None
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`to_wire`'s message, and the pairs as its receiver reads them (``val``
    itself when plain, :func:`quantize` of it when coded), from one pass over the
    values: for a sender that merges what it sent as its partner reads it."""
    if coding is None:
        return pack(idx, val, index_dtype), (idx, val)
    clock.charge("encode:log8", idx.shape[0])
    msg, scale, codes = _encode(idx, val)
    return msg, (idx, _values(scale, codes, val.dtype).to(val.device))


def from_wire(buf: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype,
              coding: str | None, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (int64 indices, ``value_dtype`` values) of one :func:`to_wire` message, on
    ``device``."""
    if coding is None:
        idx, val = unpack(buf, index_dtype, value_dtype)
        return idx.to(device), val.to(device)
    idx, val = decode(buf, value_dtype)
    clock.charge("decode:log8", idx.shape[0])
    return idx.to(device), val.to(device)


def coded_bytes(k: int, size: int) -> float:
    """Expected bytes of a message of ``k`` pairs evenly spread over ``size`` elements:
    the header, k value bytes and k varints of the mean gap ``size / k``."""
    if k <= 0:
        return float(_HEADER.itemsize)
    gap = max(1, math.ceil(size / k))
    return _HEADER.itemsize + k * (1 + max(1, math.ceil(gap.bit_length() / 7)))
