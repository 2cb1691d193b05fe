"""How a piece of a key goes through a compressor on its way to or from a server.

A key is stored as flat pieces (:mod:`mpicomm.ps.sharding`); a compressor sees each piece
on its own, through a :class:`PieceView`:

* Elementwise compressors (top-k, random-k, QSGD, sign, casts) see the flat piece.
* PowerSGD needs a matrix, and its quality depends on the gradient's low-rank structure,
  which lives in the layer's own ``(rows, prod(shape[1:]))`` layout (the matrix view of
  :func:`mpicomm.compress.powersgd.matrix_shape`). So a piece of a key with >= 2
  dimensions is shown as the block of whole rows that covers it: rows ``start // cols``
  to ``ceil(stop / cols)``, with the elements outside the piece (at most one partial row
  before and one after) set to zero. A piece of whole rows (always the case with one
  server, or when the split falls on row boundaries) is exactly those rows of the layer,
  as the allreduce PowerSGD sees them; padding costs at most ``2 (cols - 1)`` zeros and
  keeps the columns of the layer, where a near-square reshape of the flat piece would
  mix unrelated rows and columns and lose the low rank. Vectors (1-D keys) and small
  blocks go uncompressed, by PowerSGD's own rule (:meth:`PowerSGD.should_compress`).

Only the payload's arrays travel. The receiver needs the compressor's local context
(shape, dtype, k, random-k's indices) to decompress; :class:`Codec` rebuilds it by
compressing zeros of the view's shape under the same name and step, once per name where
the context does not depend on the step (all but random-k), and reshapes the received
arrays (1-D on the wire) to the shapes the compressor made (PowerSGD's ``P``, ``Q``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..buffers import to_torch
from ..compress import Compressor, Payload, PowerSGD

__all__ = ["PieceView", "Codec", "pull_name"]


def pull_name(name: str) -> str:
    """The name the pull compression of piece ``name`` goes by (its compressor state and
    random stream; the same on the server and on every worker)."""
    return f"{name}@pull"


@dataclass(frozen=True)
class PieceView:
    """What a compressor is given for a flat piece of ``numel`` elements: a tensor of
    ``shape`` holding the piece at flat offset ``lead`` and zeros elsewhere."""

    shape: tuple[int, ...]
    lead: int
    numel: int

    def embed(self, flat: torch.Tensor) -> torch.Tensor:
        """The piece laid out as the compressor sees it (a view when nothing is padded)."""
        if self.lead == 0 and math.prod(self.shape) == self.numel:
            return flat.reshape(self.shape)
        out = torch.zeros(math.prod(self.shape), dtype=flat.dtype)
        out[self.lead:self.lead + self.numel] = flat
        return out.reshape(self.shape)

    def extract(self, dense: Any) -> torch.Tensor:
        """The piece's elements of a decompressed tensor of ``shape``, flat."""
        return to_torch(dense).reshape(-1)[self.lead:self.lead + self.numel]


class Codec:
    """One compressor applied to the pieces of a store (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.templates: dict[str, Payload] = {}

    def view(self, key_shape: tuple[int, ...], start: int, stop: int) -> PieceView:
        """The layout of elements ``[start, stop)`` of a key of ``key_shape``."""
        numel = stop - start
        cols = math.prod(key_shape[1:])
        if not isinstance(self.compressor, PowerSGD) or len(key_shape) < 2 or cols == 0:
            return PieceView((numel,), 0, numel)
        first, last = start // cols, -(-stop // cols)
        return PieceView((last - first, cols), start - first * cols, numel)

    def encode(self, view: PieceView, flat: torch.Tensor, name: str, step: int
               ) -> tuple[Payload, torch.Tensor]:
        """Compress a flat piece; returns the payload and what it decodes to (flat), i.e.
        what the receiver will get, for error feedback or a mirrored copy."""
        payload = self.compressor.compress(view.embed(flat), name=name, step=step)
        return payload, view.extract(self.compressor.decompress(payload))

    @staticmethod
    def arrays(payload: Payload) -> list[torch.Tensor]:
        """The payload's arrays in wire order (by role name)."""
        return [to_torch(payload.arrays[k]) for k in sorted(payload.arrays)]

    def decode(self, view: PieceView, arrays: list[torch.Tensor], name: str, step: int,
               dtype: torch.dtype) -> torch.Tensor:
        """The flat piece a received payload stands for (``arrays`` as sent by
        :meth:`arrays`; ``name``, ``step`` and ``dtype`` as the sender compressed)."""
        template = self._template_of(view, name, step, dtype)
        roles = sorted(template.arrays)
        if len(roles) != len(arrays):
            raise RuntimeError(f"compressed piece {name}: {len(arrays)} arrays received, "
                               f"the compressor makes {len(roles)}")
        shaped = {r: a.reshape(-1, *to_torch(template.arrays[r]).shape[1:])
                  for r, a in zip(roles, arrays)}
        return view.extract(self.compressor.decompress(Payload(shaped, template.ctx)))

    def decode_chain(self, view: PieceView, arrays: list[torch.Tensor], name: str, last: int,
                     dtype: torch.dtype) -> list[torch.Tensor]:
        """The flat pieces of consecutive payloads sent in one message (steps ``last - k +
        1 .. last``; ``k`` = ``len(arrays)`` over the arrays per payload), in order."""
        if not arrays:
            return []
        per = len(self._template_of(view, name, last, dtype).arrays)
        if len(arrays) % per:
            raise RuntimeError(f"compressed piece {name}: {len(arrays)} arrays received, "
                               f"not a multiple of the compressor's {per}")
        k = len(arrays) // per
        return [self.decode(view, arrays[i * per:(i + 1) * per], name, last - k + 1 + i, dtype)
                for i in range(k)]

    def _template_of(self, view: PieceView, name: str, step: int, dtype: torch.dtype
                     ) -> Payload:
        template = self.templates.get(name)
        if template is None:
            template = self._template(view, name, step, dtype)
            if _same(template.ctx, self._template(view, name, step + 1, dtype).ctx):
                self.templates[name] = template
        return template

    def _template(self, view: PieceView, name: str, step: int, dtype: torch.dtype
                  ) -> Payload:
        return self.compressor.compress(torch.zeros(view.shape, dtype=dtype), name=name,
                                        step=step)


def _same(a: Any, b: Any) -> bool:
    """Equality of two compressor contexts (dataclasses of metadata and tensors)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a) if f.name != "step")
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)
