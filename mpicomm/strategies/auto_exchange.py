r"""One fused bucket of ``strategy="auto"`` through the scheme chosen for it.

:func:`exchange` runs the bucket and returns, besides the averaged tensors, the squared
norms the compression gain is made of: ``||g_e||²`` of this rank's error-fed bucket
(``g_e = g + e``, gradient plus residual) and ``||e_new||²`` of what it keeps back, so
that ``||g_c||² = ||g_e||² - ||e_new||²`` is what it applied (exact for the sparse
schemes, whose residual is the error-fed gradient minus what was sent; for PowerSGD the
residual is relative to the global approximation, an estimate).

Error feedback: one memory shared by every scheme, keyed by bucket name, so a switch
between sparse schemes keeps the residual; a dense step adds and clears it. PowerSGD
keeps its residuals per tensor (its own keys): a switch to or from PowerSGD leaves the
other scheme's residual waiting until that scheme returns (delayed, not lost; ours, the
papers do not switch schemes). The sparse schemes report what they sent
(:attr:`mpicomm.compress.ErrorFeedback.track_sent`), so ``||g_e||²`` costs no extra pass
over the bucket: ``||sent||² + ||residual||²`` (disjoint supports).

With L-GreCo (:mod:`~mpicomm.strategies.lgreco_buckets`): the top-k family sends the
union of per-layer top-k (the residual per segment is that layer's); the QSGD family is
unbiased and keeps no error feedback (at 2-4 bits its residual is as large as the
gradient and error feeding it diverges, as :class:`~mpicomm.strategies.QSGDAllgather` by
default); the PowerSGD family keeps its residual per layer (segments of the bucket's)
and a warm-start Q per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from ..buffers import to_torch
from ..compress import ErrorFeedback, PowerSGD
from ..control.lgreco import LGreco
from ._compressed import adopt_momentum
from .base import Strategy
from .lgreco_buckets import Segment, powersgd_bucket, qsgd_bucket, topk_bucket

__all__ = ["exchange", "error_fed", "squared_norm", "take_momentum", "seed_velocities",
           "FIRST_STEP_MOMENTUM", "MomentumHandover"]


def squared_norm(t: torch.Tensor) -> float:
    """``||t||²``. CPU float32/64 in numpy's single-threaded einsum (the norms of every
    step: torch's intra-op threads compete with the ranks where they share cores, as in
    :func:`~mpicomm.compress.topk_select.topk_masses`; 0.16 ms for 1.1e6 float32, relative error
    1e-6 against float64), else torch in float64."""
    t = t.detach().reshape(-1)
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        a = t.numpy()
        return float(np.einsum("i,i->", a, a))
    t = t.to(torch.float64)
    return float(torch.dot(t, t))


def error_fed(scheme: str, buf: Any, names: Sequence[str], tensors: Sequence[torch.Tensor],
              sub: Optional[Strategy], memory: ErrorFeedback) -> torch.Tensor:
    """This rank's error-fed bucket ``g + residual`` (flat, a new tensor where there is
    a residual), before the exchange; PowerSGD's residuals are its sub-strategy's, per
    tensor."""
    if scheme == "powersgd":
        residuals = getattr(sub, "memory", None)
        fed = torch.cat([t.reshape(-1) + to_torch(residuals.residual(n)).reshape(-1)
                         if residuals is not None and n in residuals else t.reshape(-1)
                         for t, n in zip(tensors, names)])
    else:
        fed = buf.flat.reshape(-1)
        if buf.name in memory:
            fed = fed + to_torch(memory.residual(buf.name)).reshape(-1)
    if memory.momentum:  # what compensate() will form: m·u + g + e
        try:
            u = to_torch(memory.velocity(buf.name)).reshape(-1)
        except KeyError:
            return fed
        fed = fed + memory.momentum * u
    return fed


#: The velocity factor of the memory until :func:`take_momentum` sets the optimizer's:
#: unused by then (the first step's velocity is its gradient, ``u = g``, whatever m).
FIRST_STEP_MOMENTUM = 0.9


def take_momentum(memory: ErrorFeedback, optimizer: Any) -> float:
    """After the first step, move an SGD-like optimizer's momentum m into ``memory``
    (:func:`~mpicomm.strategies._compressed.adopt_momentum`: the optimizer runs without
    momentum from then on) and return m. ``memory`` kept the first step's velocity
    (``u = g``, cleared where a sparse scheme sent: what the optimizer's buffer, the
    mean of the sent ``u``, holds), so the run goes on exactly as momentum SGD on dense
    steps and as DGC on sparse ones. For another optimizer, 0.0: the memory drops its
    velocities and stays plain error feedback."""
    m = adopt_momentum(optimizer)
    if m:
        memory.momentum = m
    else:
        drop_velocities(memory)
    return m


def drop_velocities(memory: ErrorFeedback) -> None:
    """Make ``memory`` plain error feedback: no momentum, no velocities, the residuals
    kept."""
    memory.momentum = 0.0
    _replace_velocities(memory, {})


def _replace_velocities(memory: ErrorFeedback, velocities: dict[str, Any]) -> None:
    """Give ``memory`` these ``velocities`` (by bucket name) and keep its residuals; the
    caller sets ``memory.momentum`` to match."""
    memory.load_state_dict({"residuals": memory.state_dict()["residuals"],
                            "velocities": velocities})


def _family_bucket(family: str, c: torch.Tensor, bucket: str, segments: Sequence[Segment],
                   lgreco: LGreco, memory: ErrorFeedback, comm: Any, step: int,
                   compressors: dict[int, PowerSGD]) -> tuple[torch.Tensor, float]:
    """The bucket with each layer at its own QSGD bits / PowerSGD rank, and the squared
    norm of what was not transmitted (PowerSGD: the error-feedback residual)."""
    values = {layer: int(lgreco.value(layer)) for layer, _, _ in segments}
    if family == "qsgd":
        mean, own = qsgd_bucket(c, segments, values, comm, step,
                                bucket_size=lgreco.bucket_size, seed=lgreco.seed)
        return mean, squared_norm(c - own)
    mean, sent = powersgd_bucket(c, segments, values, comm, step, compressors,
                                 seed=lgreco.seed)
    memory.update(bucket, c, sent)
    return mean, squared_norm(to_torch(memory.residual(bucket)))


def exchange(scheme: str, buf: Any, names: Sequence[str], tensors: Sequence[torch.Tensor],
             sub: Optional[Strategy], memory: ErrorFeedback, comm: Any, step: int, *,
             lgreco: Optional[LGreco] = None, family: Optional[str] = None,
             segments: Sequence[Segment] = (),
             compressors: Optional[dict[int, PowerSGD]] = None,
             accumulate: Optional[Callable[[torch.Tensor], None]] = None
             ) -> tuple[list[torch.Tensor], float, float]:
    """Run bucket ``buf`` (a :class:`~mpicomm.strategies.base.FusedBuffer` of ``tensors``
    named ``names``) through ``scheme``: ``(averaged tensors, ||g_e||², ||e_new||²)``.

    ``sub`` is the strategy that runs ``scheme`` (``None`` for an L-GreCo QSGD/PowerSGD
    family's per-layer scheme); ``memory`` the shared error feedback; ``lgreco``,
    ``family``, ``segments`` and ``compressors`` (per-rank PowerSGD warm starts) the
    per-layer settings where L-GreCo runs; ``accumulate(c)`` receives the error-fed
    bucket where L-GreCo measures it. Collective."""
    if scheme == "powersgd":
        assert sub is not None
        if memory.momentum:  # the velocity (and the shared residual) go through PowerSGD
            c = to_torch(memory.compensate(buf.name, buf.flat)).reshape(-1)
            memory.update(buf.name, c, c)  # velocity kept, unmasked: nothing is dropped
            tensors = [p.reshape(t.shape) for p, t in zip(buf.split(c), tensors)]
        res = sub.memory  # type: ignore[attr-defined]
        e_sq = sum(squared_norm(t) + (squared_norm(to_torch(res.residual(n)))
                                      if res is not None and n in res else 0.0)
                   for t, n in zip(tensors, names))
        out = [to_torch(o) for o in sub.aggregate(list(tensors), list(names))]
        left = sum(squared_norm(to_torch(res.residual(n)))
                   for n in names if res is not None and n in res)
        return [o.reshape(-1) for o in out], e_sq, left
    flat = buf.flat
    if scheme == "dense":
        assert sub is not None
        if memory.momentum:  # u = m·u + g kept unmasked (the heavy ball), residual sent
            flat = memory.compensate(buf.name, flat)
            memory.update(buf.name, flat, flat)
        elif buf.name in memory:
            flat = memory.compensate(buf.name, flat)
            memory.reset(buf.name)
        e_sq, left = squared_norm(flat), 0.0  # gain 1
        averaged = sub.aggregate_flat(flat, buf.name)
    elif family is not None:  # the per-layer QSGD / PowerSGD scheme
        assert lgreco is not None
        c = error_fed(scheme, buf, names, tensors, sub, memory)
        e_sq = squared_norm(c)
        if accumulate is not None:
            accumulate(c)
        averaged, left = _family_bucket(family, c, buf.name, segments, lgreco, memory, comm,
                                        step, compressors if compressors is not None else {})
    else:  # the sparse schemes send entries of g + e and keep the others:
        if lgreco is not None:  # ||g + e||² = ||sent||² + ||residual||²
            c = error_fed(scheme, buf, names, tensors, sub, memory)
            if accumulate is not None:
                accumulate(c)
            densities = {layer: lgreco.density(layer) for layer, _, _ in segments}
            sent, averaged = topk_bucket(scheme, c, segments, densities, comm, step)
            memory.update_sparse(buf.name, c, sent, inplace=False)
        else:  # (the strategy forms g + e itself)
            assert sub is not None
            averaged = sub.aggregate_flat(flat, buf.name)
        left = squared_norm(to_torch(memory.residual(buf.name)))
        e_sq = left + memory.sent_sq(buf.name)
    return [o.reshape(-1) for o in buf.split(averaged)], e_sq, left


class MomentumHandover:
    """``auto``'s momentum correction as a small state machine over the memory.

    ``mode=True``: the memory keeps the first step's velocity
    (:data:`FIRST_STEP_MOMENTUM`) until the first :meth:`step_done` with an optimizer
    moves that optimizer's momentum into it (:func:`take_momentum`). If a bucket is
    aggregated a second time before that (the step ended without
    ``step_done(optimizer)``: the DDP hook without ``optimizer=``, or ``wait`` followed by
    the caller's own ``optimizer.step()``), the optimizer keeps its momentum, and the
    memory drops its velocities and stays plain error feedback, so momentum is never
    applied twice.

    ``mode="after_dense"``: plain error feedback until :attr:`dense_steps` steps in a row
    ran every bucket dense outside an exploration window; at the end of that step the
    optimizer's momentum moves into the memory (:func:`seed_velocities`: each bucket's
    velocity starts from the optimizer's momentum buffers, so the dense run goes on
    exactly as momentum SGD, and a later switch to a sparse scheme runs DGC's
    correction from a warm velocity). A run that starts sparse keeps plain error
    feedback. ``mode=False``: never.

    The state (:meth:`state_dict`) is saved with the strategy's, so a resumed run does
    not hand over a second time. Cost: a set lookup per bucket until the handover.
    """

    #: Dense steps in a row after which ``"after_dense"`` hands over: past the start's
    #: probes and trials, a small fraction of a dense phase.
    dense_steps = 20

    def __init__(self, memory: ErrorFeedback, mode: bool | str) -> None:
        self.memory, self.pending = memory, mode is True
        self.waiting = mode == "after_dense"
        self.dense_run = 0
        self._seen: set[str] = set()
        self._names: dict[str, list[str]] = {}
        if self.pending:
            memory.momentum = FIRST_STEP_MOMENTUM

    def bucket(self, name: str, names: Sequence[str] = ()) -> None:
        """Called before bucket ``name`` (of the tensors ``names``) is exchanged."""
        if self.waiting and name not in self._names:  # a bucket's tensors stay the same
            self._names[name] = list(names)
        if not self.pending:
            return
        if name not in self._seen:
            self._seen.add(name)
            return
        self.pending = False
        drop_velocities(self.memory)

    def step_done(self, optimizer: Any, model: Any = None, schemes: Sequence[str] = (),
                  window: bool = False) -> None:
        """At the end of a step that ran ``schemes`` (``window``: inside an exploration
        window, whose steps are thrown away): take ``optimizer``'s momentum over, once."""
        if self.pending and optimizer is not None:
            self.pending = False
            take_momentum(self.memory, optimizer)
        elif self.waiting and not window:
            dense = bool(schemes) and all(s == "dense" for s in schemes)
            self.dense_run = self.dense_run + 1 if dense else 0
            if self.dense_run >= self.dense_steps and optimizer is not None:
                self.waiting = False
                seed_velocities(self.memory, optimizer, model, self._names)

    def state_dict(self) -> dict[str, Any]:
        return {"adopt_pending": self.pending, "adopt_waiting": self.waiting,
                "dense_run": self.dense_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = bool(state.get("adopt_pending", self.pending))
        self.waiting = bool(state.get("adopt_waiting", self.waiting and not self.pending))
        self.dense_run = int(state.get("dense_run", 0))


def seed_velocities(memory: ErrorFeedback, optimizer: Any, model: Any,
                    names: dict[str, list[str]]) -> float:
    """Move an SGD-like optimizer's momentum m into ``memory`` in the middle of a run
    and return m (0.0 and nothing changed for another optimizer). Each bucket's velocity
    is the concatenation of its parameters' momentum buffers (``names``: bucket ->
    parameter names, resolved through ``model.named_parameters()``); a bucket whose
    buffers cannot all be found (no ``model``: the DDP hook) starts from zero, which
    restarts its momentum once. The residuals are kept."""
    params = dict(model.named_parameters()) if model is not None else {}
    state = getattr(optimizer, "state", {})
    found = {}  # bucket -> its buffers, held here: adopt_momentum drops them from state
    for bucket, members in names.items():
        buffers = [state.get(params[n], {}).get("momentum_buffer") if n in params else None
                   for n in members]
        if members and all(b is not None for b in buffers):
            found[bucket] = buffers
    m = adopt_momentum(optimizer)
    if m:
        memory.momentum = m
        _replace_velocities(memory, {bucket: torch.cat([b.detach().reshape(-1) for b in bufs])
                                     for bucket, bufs in found.items()})
    return m
