"""Dense bit packing of small integer codes into bytes, in torch (CPU or CUDA).

``pack_bits(codes, width)`` writes each code's ``width`` low bits, most significant bit
first, back to back, into ``ceil(len(codes) * width / 8)`` bytes (the last byte padded
with zeros); for ``width == 1`` this is the layout of ``numpy.packbits``. Cost: O(n *
width) byte operations and ``n * width`` bytes of scratch.
"""

from __future__ import annotations

import torch

__all__ = ["packed_nbytes", "pack_bits", "unpack_bits"]


def packed_nbytes(count: int, width: int) -> int:
    """Bytes that :func:`pack_bits` produces for ``count`` codes of ``width`` bits."""
    return (count * width + 7) // 8


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack the ``width`` low bits of each entry of the 1-D integer tensor ``codes``."""
    if not 1 <= width <= 16:
        raise ValueError(f"width must be in [1, 16], got {width}")
    n = codes.shape[0]
    nbytes = packed_nbytes(n, width)
    bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=codes.device)
    grid = bits[: n * width].view(n, width)
    c = codes.to(torch.int32)
    for j in range(width):  # column j holds bit (width - 1 - j)
        grid[:, j] = torch.bitwise_and(c >> (width - 1 - j), 1).to(torch.uint8)
    octets = bits.view(nbytes, 8)
    out = octets[:, 0] << 7
    for i in range(1, 8):
        out |= octets[:, i] << (7 - i)
    return out


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` codes (int32) from ``packed`` bytes."""
    if not 1 <= width <= 16:
        raise ValueError(f"width must be in [1, 16], got {width}")
    if packed.shape[0] < packed_nbytes(count, width):
        raise ValueError(
            f"{packed.shape[0]} bytes cannot hold {count} codes of {width} bits"
        )
    p = packed.to(torch.uint8)
    bits = torch.empty(p.shape[0], 8, dtype=torch.uint8, device=p.device)
    for i in range(8):
        bits[:, i] = torch.bitwise_and(p >> (7 - i), 1)
    grid = bits.view(-1)[: count * width].view(count, width).to(torch.int32)
    codes = grid[:, 0].clone()
    for j in range(1, width):
        codes = (codes << 1) | grid[:, j]
    return codes
