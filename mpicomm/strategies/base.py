"""The :class:`Strategy` interface: one way to average gradients across ranks.

A strategy = error feedback + compressor + collective. It has one entry point,
``aggregate(tensors, names) -> tensors``: every rank passes its local gradients (same
names, shapes and dtypes on every rank) and gets back the *average* over ranks (or the
strategy's compressed estimate of it), same shapes, dtypes, framework and devices.

Fusion: consecutive tensors of the same dtype and device are concatenated into flat
buffers of at most ``fusion_bytes`` (a tensor larger than that is a buffer of its own),
and each buffer is aggregated as one vector, so many small layers cost one collective.
For sparsifying strategies this means top-k is taken over the whole buffer (the papers'
whole-model selection), not per layer. A buffer's name, the key of its error-feedback
memory, is derived from the names of its tensors, so it is stable across steps as long
as the same tensors are passed in the same order.

Traffic: ``stats`` accumulates the bytes this rank sent and received through mpicomm's
own collectives while aggregating (measured by the communicator's counters), the bytes a
dense exchange of the same tensors would occupy, and the time spent.

Strategies are not thread-safe; give each thread its own (and its own communicator via
:meth:`Strategy.bind`).
"""

from __future__ import annotations

import contextlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import trace
from ..buffers import from_torch, inspect, to_torch
from ..comm import Communicator, resolve
from ..validate import check_int

__all__ = ["Strategy", "StrategyStats", "FusedBuffer", "fuse", "measure", "DEFAULT_FUSION_BYTES"]

DEFAULT_FUSION_BYTES = 64 << 20


@dataclass
class StrategyStats:
    """What a strategy has done so far on this rank."""

    calls: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    dense_bytes: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def compression(self) -> float:
        """Dense bytes divided by bytes actually sent (>1 means savings); 0 before use."""
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else 0.0


@dataclass
class FusedBuffer:
    """Tensors ``indices`` of the input list, concatenated into the 1-D ``flat``."""

    name: str
    indices: list[int]
    flat: Any
    shapes: list[tuple[int, ...]]

    def split(self, flat: Any) -> list[Any]:
        """Cut an aggregated flat vector back into tensors of the original shapes."""
        out, offset = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[offset:offset + n].view(shape))
            offset += n
        return out


def fuse(tensors: Sequence[Any], names: Sequence[str], fusion_bytes: int) -> list[FusedBuffer]:
    """Group consecutive same-dtype, same-device torch tensors into flat buffers."""
    import torch

    groups: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if groups:
            last = tensors[groups[-1][-1]]
            same_kind = last.dtype == t.dtype and last.device == t.device
            if same_kind and size + nbytes <= fusion_bytes:
                groups[-1].append(i)
                size += nbytes
                continue
        groups.append([i])
        size = nbytes
    fused = []
    for idx in groups:
        parts = [tensors[i].detach().reshape(-1) for i in idx]
        flat = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
        name = names[idx[0]] if len(idx) == 1 else f"{names[idx[0]]}..{names[idx[-1]]}"
        fused.append(FusedBuffer(name, idx, flat, [tuple(tensors[i].shape) for i in idx]))
    return fused


@contextlib.contextmanager
def measure(strategy: Strategy, tensors: Sequence[Any]) -> Iterator[None]:
    """Count the traffic, time and dense-equivalent bytes of one aggregation (on success)."""
    start = time.perf_counter()
    with strategy.comm.traffic.measure() as moved, trace.block(
            f"{strategy.name}.aggregate", "strategy", strategy.comm,
            **(trace.describe_strategy(strategy, tensors) if trace.active() else {})):
        yield
    stats = strategy.stats
    stats.calls += 1
    stats.sent_bytes += moved.sent_bytes
    stats.recv_bytes += moved.recv_bytes
    stats.dense_bytes += sum(t.numel() * t.element_size() for t in tensors)
    stats.seconds += time.perf_counter() - start


class Strategy(ABC):
    """Base class: validation, fusion, traffic accounting. Subclasses aggregate one
    flat vector in :meth:`aggregate_flat` (or override :meth:`aggregate` entirely)."""

    name = "strategy"

    def __init__(self, comm: Communicator | None = None, *,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES):
        fusion_bytes = check_int("fusion_bytes", fusion_bytes, 1)
        self._comm = comm
        self.fusion_bytes = fusion_bytes
        self.stats = StrategyStats()

    # -- communicator
    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = resolve(None)
        return self._comm

    def bind(self, comm: Communicator) -> Strategy:
        """Run this strategy's collectives on ``comm`` from now on; returns ``self``."""
        self._comm = resolve(comm)
        return self

    # -- the interface
    def aggregate(self, tensors: Sequence[Any], names: Sequence[str] | None = None) -> list[Any]:
        """Average ``tensors`` over all ranks; returns new tensors of the same kinds.

        ``names`` (default ``"t0", "t1", ...``) key the error-feedback memory; pass the
        parameter names so residuals survive a change in the list's composition.
        """
        tensors, names = self._validate(tensors, names)
        as_torch = [to_torch(t) for t in tensors]
        results: list[Any] = [None] * len(tensors)
        with measure(self, as_torch):
            for buf in fuse(as_torch, names, self.fusion_bytes):
                averaged = self.aggregate_flat(buf.flat, buf.name)
                for i, part in zip(buf.indices, buf.split(averaged)):
                    results[i] = from_torch(part, like=tensors[i])
        return results

    @abstractmethod
    def aggregate_flat(self, flat: Any, name: str) -> Any:
        """Average one flat 1-D torch tensor over the ranks (may reuse ``flat``'s memory)."""

    def describe(self) -> dict[str, Any]:
        """The strategy's settings and choices, for summaries and logs."""
        return {"strategy": self.name}

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint (error-feedback residuals, warm starts)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state to load")

    # -- helpers
    @staticmethod
    def _validate(tensors: Sequence[Any], names: Sequence[str] | None
                  ) -> tuple[list[Any], list[str]]:
        if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
            raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
        tensors = list(tensors)
        for t in tensors:
            inspect(t)  # TypeError for anything that is not a supported array
        if names is None:
            names = [f"t{i}" for i in range(len(tensors))]
        names = list(names)
        if len(names) != len(tensors):
            raise ValueError(f"got {len(tensors)} tensors but {len(names)} names")
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        return tensors, names
