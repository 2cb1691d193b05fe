"""What a parameter-server worker knows about a key (:class:`KeyInfo`), and the names of
a key's pieces (:func:`piece_name`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .sharding import Piece

__all__ = ["KeyInfo", "piece_name"]


def piece_name(key: Hashable, index: int) -> str:
    """The name a piece's compressor state and error-feedback residual go by."""
    return f"{key}/{index}"


@dataclass
class KeyInfo:
    """What a worker knows about a key."""

    key: Hashable
    key_id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    framework: str
    device: str
    pieces: tuple[Piece, ...]

    @cached_property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @cached_property
    def numpy_dtype(self) -> np.dtype | None:
        """The key's dtype as numpy's (``None`` for bfloat16, which numpy lacks)."""
        return None if self.dtype == torch.bfloat16 else torch.empty(0, dtype=self.dtype
                                                                     ).numpy().dtype

    def like(self) -> Any:
        """An empty array of the caller's framework, for :func:`from_torch`."""
        if self.framework == "numpy":
            return np.empty(0)
        if self.framework == "cupy":
            import cupy

            return cupy.empty(0)
        return torch.empty(0)
