"""The :class:`Strategy` interface: one way to average gradients across ranks.

A strategy = error feedback + compressor + collective. It has one entry point,
``aggregate(tensors, names) -> tensors``: every rank passes its local gradients (same
names, shapes and dtypes on every rank) and gets back the *average* over ranks (or the
strategy's compressed estimate of it), same shapes, dtypes, framework and devices.

Fusion: consecutive tensors of the same dtype and device are concatenated into flat
buffers of at most ``fusion_bytes`` (a tensor larger than that is a buffer of its own;
grouping by :func:`mpicomm.fusion.group`), and each buffer is aggregated as one vector,
so many small layers cost one collective.
For sparsifying strategies this means top-k is taken over the whole buffer (the papers'
whole-model selection), not per layer. A buffer's name, the key of its error-feedback
memory, is derived from the names of its tensors, so it is stable across steps as long
as the same tensors are passed in the same order.

In place: :meth:`Strategy.aggregate_into` writes the averages into the given tensors
(what :class:`~mpicomm.torch.GradientSync` uses for ``.grad``). Its fusion buffers are
*persistent* (:class:`mpicomm.fusion.LayoutCache`, one per strategy): filled in place at
every call, aggregated in place where the strategy allows (dense allreduce does), and
copied back into the tensors; a buffer of a single contiguous tensor, or of tensors that
already lie back to back in one storage (GradientSync's gradients), is that memory
itself, with no copy at all. No fresh buffer is allocated per step, which on the host saves about
as much time as the reduction itself for large buffers (page faults of fresh memory; see
:mod:`mpicomm.fusion`), at the price of one persistent copy of the fused tensors.
:meth:`Strategy.aggregate` keeps returning fresh tensors that never alias a persistent
buffer.

Traffic: ``stats`` accumulates the bytes this rank sent and received through mpicomm's
own collectives while aggregating (measured by the communicator's counters), the bytes a
dense exchange of the same tensors would occupy, and the time spent.

Prediction: :meth:`Strategy.predict` is the one cost-model entry point of every
strategy: seconds to aggregate tensors of given shapes (fused like :meth:`aggregate`),
communication (alpha-beta-gamma, :mod:`mpicomm.collectives.cost`) plus measured local
compute (:class:`~mpicomm.collectives.cost.ComputeParams`), both read by default from the
communicator's calibration (:func:`~mpicomm.collectives.cost.calibrated`).

Strategies are not thread-safe; give each thread its own (and its own communicator via
:meth:`Strategy.bind`).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from .. import clock, hooks
from ..buffers import from_torch, inspect, to_torch
from ..collectives.cost import ComputeParams, CostParams, calibrated
from ..comm import Communicator, Traffic, resolve
from ..fusion import Layout, LayoutCache, group, kind_of
from ..validate import check_int

__all__ = ["Strategy", "StrategyStats", "FusedBuffer", "fuse", "buffer_name", "measure",
           "DEFAULT_FUSION_BYTES", "fused_sizes", "fused_groups", "describe_strategy", "Shapes"]

#: What :meth:`Strategy.predict` takes: one flat buffer's element count, or tensor shapes.
Shapes = Union[int, Sequence[Union[int, tuple[int, ...]]]]

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

    def add_call(self, moved: Traffic, tensors: Sequence[Any], seconds: float) -> None:
        """Account one aggregation of ``tensors`` that moved ``moved`` in ``seconds``."""
        self.calls += 1
        self.sent_bytes += moved.sent_bytes
        self.recv_bytes += moved.recv_bytes
        self.dense_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.seconds += seconds


@dataclass
class FusedBuffer:
    """Tensors ``indices`` of the input list, concatenated into the 1-D ``flat``."""

    name: str
    indices: list[int]
    flat: Any
    shapes: list[tuple[int, ...]]

    def split(self, flat: Any) -> list[Any]:
        """Cut an aggregated flat vector back into tensors of the original shapes."""
        return Layout(self.shapes, flat.dtype, flat.device).views(flat)


def buffer_name(names: Sequence[str]) -> str:
    """The name of a fused buffer (its error-feedback key): the tensor's own name, or
    ``"first..last"``."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def fuse(tensors: Sequence[Any], names: Sequence[str], fusion_bytes: int,
         cache: LayoutCache | None = None) -> list[FusedBuffer]:
    """Group consecutive same-dtype, same-device torch tensors into flat buffers.

    Without ``cache`` every buffer is fresh memory (a clone for a single tensor). With a
    :class:`~mpicomm.fusion.LayoutCache` the buffers are the cache's persistent ones,
    refilled in place, and a buffer of one contiguous tensor, or of tensors that already
    lie back to back in one storage, is a view of that memory (so aggregating it in
    place writes the tensors, with no copy).
    """
    import torch

    plan = group([t.numel() * t.element_size() for t in tensors],
                 [kind_of(t) for t in tensors], fusion_bytes, consecutive=True)
    fused = []
    for idx in plan:
        parts = [tensors[i] for i in idx]
        name = buffer_name([names[i] for i in idx])
        shapes = [tuple(t.shape) for t in parts]
        if cache is None:
            flats = [t.detach().reshape(-1) for t in parts]
            flat = flats[0].clone() if len(flats) == 1 else torch.cat(flats)
        elif _adjacent(parts):  # already one flat range (e.g. GradientSync's grads)
            first = parts[0].detach()
            flat = torch.as_strided(first, (sum(t.numel() for t in parts),), (1,),
                                    first.storage_offset())
        else:
            flat = cache.get(name, parts).pack(parts)
        fused.append(FusedBuffer(name, idx, flat, shapes))
    return fused


def _adjacent(parts: Sequence[Any]) -> bool:
    """Whether contiguous ``parts`` lie back to back in one storage, in order (then their
    fused buffer is a view of that memory and needs no copy)."""
    if not all(t.is_contiguous() for t in parts):
        return False
    if len(parts) == 1:
        return True
    storage = parts[0].untyped_storage().data_ptr()
    end = parts[0].data_ptr() + parts[0].numel() * parts[0].element_size()
    for t in parts[1:]:
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != end:
            return False
        end += t.numel() * t.element_size()
    return True


def fused_groups(shapes: Sequence[tuple[int, ...]], itemsize: int, fusion_bytes: int
                 ) -> list[list[int]]:
    """Positions in ``shapes`` of the tensors of each flat buffer :func:`fuse` makes of
    same-dtype tensors (the model of fusion :meth:`Strategy.predict` uses)."""
    return group([math.prod(s) * itemsize for s in shapes], None, fusion_bytes,
                 consecutive=True)


def fused_sizes(shapes: Sequence[tuple[int, ...]], itemsize: int, fusion_bytes: int
                ) -> list[int]:
    """Element counts of the flat buffers of :func:`fused_groups`."""
    return [sum(math.prod(shapes[i]) for i in g)
            for g in fused_groups(shapes, itemsize, fusion_bytes)]


def describe_strategy(strategy: Strategy, tensors: Sequence[Any]) -> dict[str, Any]:
    """Span args of a strategy's aggregation: its scalar settings and the tensor count."""
    return {**{k: v for k, v in strategy.describe().items()
               if isinstance(v, (int, float, str))}, "tensors": len(tensors)}


@contextlib.contextmanager
def measure(strategy: Strategy, tensors: Sequence[Any]) -> Iterator[None]:
    """Count the traffic, time and dense-equivalent bytes of one aggregation (on success);
    the time on :func:`mpicomm.clock.now`."""
    start = clock.now()
    comm = strategy.comm
    with comm.traffic.measure() as moved, hooks.block(
            f"{strategy.name}.aggregate", "strategy", comm,
            **(describe_strategy(strategy, tensors) if hooks.recording() else {})):
        yield
    strategy.stats.add_call(moved, tensors, clock.now() - start)


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
        self.buffers = LayoutCache()  # persistent fusion buffers of aggregate_into

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
        tensors, names = self._inputs(tensors, names)
        as_torch = [to_torch(t) for t in tensors]
        results: list[Any] = [None] * len(tensors)
        with measure(self, as_torch):
            for buf in fuse(as_torch, names, self.fusion_bytes):
                averaged = self.aggregate_flat(buf.flat, buf.name)
                for i, part in zip(buf.indices, buf.split(averaged)):
                    results[i] = from_torch(part, like=tensors[i])
        return results

    def aggregate_into(self, tensors: Sequence[Any], names: Sequence[str] | None = None
                       ) -> None:
        """Like :meth:`aggregate`, but the averages overwrite ``tensors`` (torch tensors).

        Uses the strategy's persistent fusion buffers (module docstring): no allocation
        per call for the fusion itself. Same results, bit for bit, as :meth:`aggregate`.
        A strategy that overrides :meth:`aggregate` with its own pipeline gets a correct
        fallback: :meth:`aggregate`, then a copy into ``tensors``.
        """
        import torch

        if isinstance(tensors, (list, tuple)) and not all(
                isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("aggregate_into writes its results into torch tensors; use "
                            "aggregate() for numpy or cupy arrays")
        if type(self).aggregate is not Strategy.aggregate:  # a pipeline of its own
            results = self.aggregate(tensors, names)
            with torch.no_grad():
                for t, r in zip(tensors, results):
                    t.copy_(r)
            return
        tensors, names = self._inputs(tensors, names)
        with measure(self, tensors):
            for buf in fuse(tensors, names, self.fusion_bytes, cache=self.buffers):
                averaged = self.aggregate_flat(buf.flat, buf.name)
                targets = [tensors[i] for i in buf.indices]
                with torch.no_grad():
                    if len(targets) == 1:
                        if averaged.data_ptr() != targets[0].data_ptr():
                            targets[0].copy_(averaged.view(targets[0].shape))
                    else:
                        self.buffers.get(buf.name, targets).unpack(targets, averaged)

    @abstractmethod
    def aggregate_flat(self, flat: Any, name: str) -> Any:
        """Average one flat 1-D torch tensor over the ranks (may reuse ``flat``'s memory)."""

    def describe(self) -> dict[str, Any]:
        """The strategy's settings and choices, for summaries and logs."""
        return {"strategy": self.name}

    def step_done(self, model: Any = None, optimizer: Any = None) -> None:
        """Called once per training step after ``optimizer.step()`` (by
        :meth:`mpicomm.torch.GradientSync.step`; call it yourself in a loop of your own),
        on every rank: a safe point where no backward runs. Adaptive strategies make
        their decisions here; the default does nothing."""
        return None

    # -- prediction (one API for every strategy)
    def predict(self, shapes: Shapes, itemsize: int = 4, p: int | None = None,
                params: CostParams | None = None,
                compute: ComputeParams | None = None) -> float:
        """Modelled seconds of one :meth:`aggregate` call: communication + local compute.

        ``shapes``: an int (one flat buffer of that many elements, e.g. a fused bucket)
        or the tensors' shapes (fused as :meth:`aggregate` fuses them); ``itemsize`` the
        gradient dtype's bytes; ``p`` the rank count (default the communicator's);
        ``params``/``compute`` default to the communicator's calibration. See
        :meth:`predict_parts` for the split.
        """
        parts = self.predict_parts(shapes, itemsize, p, params, compute)
        return parts["comm"] + parts["compute"]

    def predict_parts(self, shapes: Shapes, itemsize: int = 4, p: int | None = None,
                      params: CostParams | None = None,
                      compute: ComputeParams | None = None) -> dict[str, float]:
        """``{"comm": s, "compute": s}`` of :meth:`predict` (summed over fused buffers)."""
        itemsize = check_int("itemsize", itemsize, 1)
        p = check_int("p", self.comm.size if p is None else p, 1)
        if params is None or compute is None:
            cal_params, cal_compute = calibrated(self._comm if self._comm is not None
                                                 else self.comm)
            params, compute = params or cal_params, compute or cal_compute
        return self._predict_shapes(_as_shapes(shapes), itemsize, p, params, compute)

    def _predict_shapes(self, shapes: list[tuple[int, ...]], itemsize: int, p: int,
                        params: CostParams, compute: ComputeParams) -> dict[str, float]:
        """Fuse ``shapes`` and sum :meth:`_predict_flat` over the buffers (override for
        strategies that do not fuse, e.g. PowerSGD)."""
        comm_s = compute_s = 0.0
        for numel in fused_sizes(shapes, itemsize, self.fusion_bytes):
            c, w = self._predict_flat(numel, itemsize, p, params, compute)
            comm_s, compute_s = comm_s + c, compute_s + w
        return {"comm": comm_s, "compute": compute_s}

    def _predict_flat(self, numel: int, itemsize: int, p: int, params: CostParams,
                      compute: ComputeParams) -> tuple[float, float]:
        """(communication, compute) seconds for one flat buffer; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} has no cost model")

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint (error-feedback residuals, warm starts)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state to load")

    # -- helpers
    def _inputs(self, tensors: Sequence[Any], names: Sequence[str] | None
                ) -> tuple[list[Any], list[str]]:
        """Validated inputs of :meth:`aggregate`/:meth:`aggregate_into` (``ValueError`` /
        ``TypeError`` before any communication); subclasses add their own checks."""
        return self._validate(tensors, names)

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


def _as_shapes(shapes: Shapes) -> list[tuple[int, ...]]:
    if isinstance(shapes, bool):
        raise TypeError("shapes must be an int or a sequence of shapes, got a bool")
    if isinstance(shapes, int):
        shapes = [shapes]
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence):
        raise TypeError(f"shapes must be an int or a sequence of shapes, got "
                        f"{type(shapes).__name__}")
    out = []
    for s in shapes:
        shape = (s,) if isinstance(s, int) and not isinstance(s, bool) else tuple(s)
        out.append(tuple(check_int(f"dimension of shape {s!r}", n, 0) for n in shape))
    return out
