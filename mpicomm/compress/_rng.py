"""Private, reproducible random streams for compressors (global RNG state untouched).

A stream is named by ``(seed, salt, name, step)``. The tensor name is hashed with
BLAKE2b (stable across processes, unlike Python's salted ``hash()``), so every rank that
compresses the same tensor at the same step with the same seed draws the same numbers;
``salt`` (e.g. the rank) makes ranks draw independently when that is wanted.

Streams on the CPU are identical on every machine for a given torch version; CUDA
generators produce a different (but equally reproducible) stream, so a compressor whose
draws must agree across ranks (RandomK indices, PowerSGD's initial Q) draws on the CPU.
"""

from __future__ import annotations

import hashlib
import struct

import torch

__all__ = ["stream_seed", "generator"]


def stream_seed(seed: int, name: str, step: int, salt: int = 0) -> int:
    """A 63-bit seed derived from ``(seed, salt, name, step)``, stable everywhere."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qqq", int(seed), int(salt), int(step)))
    h.update(name.encode("utf-8"))
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def generator(seed: int, name: str, step: int, salt: int = 0,
              device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded by :func:`stream_seed`."""
    g = torch.Generator(device=device)
    g.manual_seed(stream_seed(seed, name, step, salt))
    return g
