"""Machinery shared by the compressing strategies.

* :class:`CompressedStrategy`: a :class:`~mpicomm.strategies.base.Strategy` with an
  optional :class:`~mpicomm.compress.ErrorFeedback` memory keyed by buffer (or tensor)
  name, per-name step counters that are identical on every rank (every rank makes the
  same calls in the same order), a floating-point check of the inputs before anything
  is communicated, and ``state_dict``/``load_state_dict`` for all of it.
* :class:`SparsifyingStrategy`: the compressing strategies that send ``k`` entries
  through a sparse collective (their bytes per rank decide ``warmup_dense``).
* :func:`sparsity`: the ``density`` / ``k`` argument rule of the sparsifying strategies.
* :func:`measure`: the traffic and time accounting of :meth:`Strategy.aggregate`, for
  strategies that override ``aggregate`` instead of ``aggregate_flat``.
* :func:`pack_bytes` / :func:`unpack_bytes`: several payload arrays as one byte vector,
  so that one collective carries them.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from ..buffers import FLOAT_DTYPES, inspect
from ..collectives import cost
from ..compress import ErrorFeedback
from ..compress.topk import check_density, check_k, index_itemsize, k_for
from ..p2p import pack_bytes, unpack_bytes
from ..sparse.coding import coded_bytes
from ..validate import check_algorithm, check_int
from .base import DEFAULT_FUSION_BYTES, Strategy

__all__ = ["CompressedStrategy", "SparsifyingStrategy", "DEFAULT_DENSITY", "ADOPT",
           "adopt_momentum", "sparsity", "k_of",
           "check_allreduce_algorithm", "check_flag", "check_schedule", "check_clip_norm",
           "pack_bytes", "unpack_bytes"]

#: Cost parameters under which a cost formula gives bytes per rank on the critical path.
BYTES = cost.CostParams(alpha=0.0, beta=1.0, gamma=0.0)

#: Density used when neither ``density`` nor ``k`` is given.
DEFAULT_DENSITY = 0.01

#: ``momentum_correction`` value that takes over the optimizer's momentum at the first
#: :meth:`CompressedStrategy.step_done` (the sparsifiers' default).
ADOPT = "optimizer"


def adopt_momentum(optimizer: Any) -> float:
    """Move the momentum of an SGD-like optimizer out of it: when every parameter group
    has the same ``momentum`` m with 0 < m < 1, no ``dampening`` and no ``nesterov``, set
    it to 0 in every group, drop the momentum buffers and return m; otherwise change
    nothing and return 0.0."""
    groups = getattr(optimizer, "param_groups", None) or []
    ms = {g.get("momentum") for g in groups}
    if len(ms) != 1 or any(g.get("dampening", 0) or g.get("nesterov", False)
                           for g in groups):
        return 0.0
    m = ms.pop()
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 < m < 1.0:
        return 0.0
    for g in groups:
        g["momentum"] = 0.0
        for p in g["params"]:
            getattr(optimizer, "state", {}).get(p, {}).pop("momentum_buffer", None)
    return float(m)


def sparsity(density: Any, k: Any) -> tuple[float | None, int | None]:
    """Validated ``(density, k)``: at most one may be given; neither means 1% density.

    ``ValueError`` for both given, ``density`` outside (0, 1] or ``k < 1``.
    """
    if density is not None and k is not None:
        raise ValueError(f"give density or k, not both (got density={density!r}, k={k!r})")
    if density is None and k is None:
        density = DEFAULT_DENSITY
    return (check_density(density) if density is not None else None,
            check_k(k) if k is not None else None)


def k_of(numel: int, density: float | None, k: int | None) -> int:
    """Entries kept of a buffer of ``numel`` elements: ``k`` (or ``max(1, ceil(density *
    numel))``), at most ``numel`` (a buffer smaller than ``k`` is sent whole)."""
    kk = k if k is not None else k_for(numel, density)  # type: ignore[arg-type]
    return max(1, min(kk, numel))


def pair_bytes(coding: str | None, numel: int, k: int, itemsize: int
               ) -> tuple[float, float]:
    """(index, value) bytes of one pair of a k-of-``numel`` message on the wire: the
    index type's and ``itemsize``, or with ``coding`` the expected varint and header
    share of evenly spread picks and one value byte (:func:`~mpicomm.sparse.coding.
    coded_bytes`)."""
    if coding is None:
        return float(index_itemsize(numel)), float(itemsize)
    return coded_bytes(k, numel) / max(k, 1) - 1.0, 1.0


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool; ``ValueError`` for anything but True/False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_allreduce_algorithm(algorithm: Any) -> str:
    """An allreduce algorithm name of :func:`mpicomm.allreduce` (or ``"auto"``)."""
    from ..collectives import ALGORITHMS

    return check_algorithm("allreduce", algorithm, ALGORITHMS["allreduce"])


def check_floating(tensors: Sequence[Any], names: Sequence[str]) -> None:
    """``TypeError`` naming the first tensor whose dtype is not floating-point."""
    for t, n in zip(tensors, names):
        dtype = inspect(t).dtype
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"tensor {n!r}: compressed aggregation needs floating-point "
                            f"gradients, got {dtype}")


def check_schedule(schedule: Any) -> Any:
    """``schedule``: ``None`` or a callable ``(step, final_density) -> density`` such as a
    :class:`mpicomm.control.Schedule` (``TypeError`` otherwise)."""
    if schedule is not None and not callable(schedule):
        raise TypeError(f"schedule must be a mpicomm.control.Schedule (or a callable "
                        f"(step, final) -> density) or None, got {type(schedule).__name__}"
                        " (parse strings with mpicomm.control.parse_schedule)")
    return schedule


def check_clip_norm(clip_norm: Any) -> float | None:
    """``clip_norm``: ``None`` or a finite number > 0 (``ValueError`` otherwise)."""
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or \
            not math.isfinite(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be a finite number > 0 or None, got {clip_norm!r}")
    return float(clip_norm)


class CompressedStrategy(Strategy):
    """A strategy with error-feedback memory and per-name step counters.

    ``error_feedback=True`` keeps, per buffer name, what compression has not transmitted
    yet and adds it to the next gradient of that name (``memory`` is the
    :class:`~mpicomm.compress.ErrorFeedback`; ``None`` without error feedback).

    Options for accuracy at scale (Lin, Han, Mao, Wang & Dally, "Deep Gradient
    Compression", ICLR 2018, arXiv 1712.01887; each off by default here; Top-k, gTop-k
    and AR-Top-k default to ``momentum_correction="optimizer"``):

    * ``schedule``: a density warm-up (:class:`mpicomm.control.Schedule`, e.g.
      ``dgc_warmup(steps_per_epoch)``) evaluated at each buffer's step counter, so every
      rank uses the same density at the same step. Sparsifiers use the scheduled density
      for k (:meth:`_k`); quantizers aggregate densely while it exceeds their own wire
      fraction (:meth:`dense_step`).
    * ``warmup_dense=True`` (sparsifiers; ours, not the papers'): a warm-up step whose
      sparse collective at the scheduled k would send more bytes per rank (critical
      path, :meth:`_sparse_bytes`) than a dense ring allreduce of the buffer
      (``2(P-1)/P·d·itemsize``) aggregates densely instead: the exact mean of the
      compensated buffer, the residual flushed (:meth:`_aggregate_dense`, as the
      quantizers do). For float32 at P = 16 that is above density 1/16 for Top-k's
      Allgather, 0.23 for gTop-k and 0.32 for AR-Top-k (ring; its index broadcast
      counts lg P times on the critical path). The update is the same as a sparse step
      at density 1 and close to one at such densities, for fewer bytes; a linear anneal
      from dense then costs about what its dense stretch costs.
    * ``flush_every=H`` (sparsifiers; the error reset of Xie, Zheng, Koyejo, Gupta, Li &
      Lin, "CSER: Communication-efficient SGD with Error Reset", NeurIPS 2020, arXiv
      2007.13221): every H-th step of a buffer (steps H-1, 2H-1, ...) aggregates
      densely, the exact mean of the compensated buffers, and flushes the residual
      (:meth:`_aggregate_dense`). Every entry is then applied at least every H steps,
      whatever the density: without it a run of T steps updates an entry of a large
      layer about T·density times (global top-k over a fused buffer favours the small
      layers). Cost: one dense ring allreduce per H steps, ``2(P-1)/P·d·itemsize``
      bytes each, so a whole run sends ``1/H`` of dense's bytes on top of the sparse
      collective's: the byte ratio against dense is ``1 / (1/R + 1/H)`` for a sparse
      ratio R (H = 100 caps it at 100x). Tuning: a flush applies up to H steps of
      residual at once, and early in training, while the residual grows far above the
      update (with momentum correction it holds velocity), that jump can undo what was
      learned: gTop-k at density 0.001 on MNIST-1D's CNN (8 ranks, 2 028 steps) with
      H = 100 applied updates of norm 110 and 750 at its first two flushes (sparse
      steps: about 4), its residual rose to 850 after them, and it ended 0.9 points
      below the same run without flushes (75x fewer bytes than dense instead of 291x).
      Off by default; use an H short enough that the residual stays near the update's
      norm, within the byte budget.
    * ``momentum_correction=m`` (0 < m < 1): the error-feedback memory keeps the
      velocity (``ErrorFeedback(momentum=m, masking=momentum_masking)``: ``u = m·u + g``
      is accumulated *before* compression, and with ``momentum_masking`` cleared where
      values were sent). The optimizer must then run **without momentum** (plain SGD at
      the same lr; fold weight decay into the loss). Needs ``error_feedback=True``.
      ``momentum_correction="optimizer"`` (the sparsifiers' default) does that move
      itself: at the first :meth:`step_done` (which
      :meth:`mpicomm.torch.GradientSync.step` calls after ``optimizer.step()``) it takes
      the momentum m of an SGD-like optimizer (:func:`adopt_momentum`: one m in every
      group, no dampening, no Nesterov), sets the optimizer's momentum to 0 and keeps
      the velocity itself from then on (seeded with the residual, which after one step
      with masking is what the velocity would hold: the same run as with
      ``momentum_correction=m`` and an optimizer without momentum from the start); with
      any other optimizer, or a loop that never calls ``step_done``, it stays plain
      error feedback. Without error feedback it is ignored.
    * ``clip_norm=C``: local gradient clipping before error feedback, each rank scaling
      its buffer to L2 norm at most ``C / sqrt(P)`` (the sum of P independent gradients
      has about sqrt(P) times the norm of one, so C is the threshold one would use for
      the averaged gradient). Applied per fused buffer (per tensor for strategies that
      aggregate tensor by tensor): the whole model when it fits one buffer.

    Step counters: :meth:`_step` returns how many times a name was aggregated before
    (0, 1, 2, ...), and :meth:`_slot` the order in which names first appeared. Both are
    the same on every rank because every rank aggregates the same names in the same order
    (the :class:`~mpicomm.torch.GradientSync` contract); strategies use them to draw
    shared random indices (RandomK) or to rotate a source rank (AR-Top-k).
    """

    name = "compressed"

    def __init__(self, comm: Any = None, *, error_feedback: bool = True,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, schedule: Any = None,
                 momentum_correction: float | str = 0.0, momentum_masking: bool = True,
                 clip_norm: float | None = None, warmup_dense: bool = False,
                 flush_every: int | None = None):
        super().__init__(comm, fusion_bytes=fusion_bytes)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.flush_every = None if flush_every is None else \
            check_int("flush_every", flush_every, low=1)
        if isinstance(momentum_correction, str) and momentum_correction != ADOPT:
            raise ValueError(f"momentum_correction must be a number in [0, 1) or "
                             f"{ADOPT!r}, got {momentum_correction!r}")
        #: Take the optimizer's momentum at the next step_done (``"optimizer"``).
        self.adopt_pending = momentum_correction == ADOPT and self.error_feedback
        self.warmup_dense = check_flag("warmup_dense", warmup_dense)
        self.schedule = check_schedule(schedule)
        self.clip_norm = check_clip_norm(clip_norm)
        self.momentum_masking = check_flag("momentum_masking", momentum_masking)
        memory = ErrorFeedback(0.0 if momentum_correction == ADOPT else momentum_correction,
                               momentum_masking)  # validates them
        self.momentum_correction: float | str = ADOPT if self.adopt_pending \
            else memory.momentum
        if self.momentum_correction and not self.error_feedback:
            raise ValueError("momentum_correction needs error_feedback=True (the velocity "
                             "lives in the error-feedback memory)")
        self.memory: ErrorFeedback | None = memory if error_feedback else None
        self._steps: dict[str, int] = {}
        self._slots: dict[str, int] = {}

    # ------------------------------------------------------------------ interface
    def _inputs(self, tensors: Sequence[Any], names: Sequence[str] | None
                ) -> tuple[list[Any], list[str]]:
        return self._floating_inputs(tensors, names)

    def _floating_inputs(self, tensors: Sequence[Any], names: Sequence[str] | None
                         ) -> tuple[list[Any], list[str]]:
        """:meth:`Strategy._validate`, then ``TypeError`` for non-floating tensors."""
        tensors, names = self._validate(tensors, names)
        check_floating(tensors, names)
        return tensors, names

    def selects_locally(self, name: str) -> bool:
        """Whether this rank's next aggregation of bucket ``name`` selects the top-k of
        its own error-fed bucket (at the strategy's ``density``/``k``, when the step runs
        sparse) and records that selection's squared mass in
        ``stats.extra["selected_sq"][name]``: a caller that needs ``||top-k(g + e)||²``
        (``strategy="auto"``'s compression gain) then reads it instead of selecting a
        second time. ``False`` here; the strategies that select per rank say so."""
        return False

    def _record_selected(self, name: str, values: torch.Tensor) -> None:
        """Keep ``||values||²`` (the k values this rank selected) for :meth:`selects_locally`'s
        readers: one pass over k entries."""
        v = values.detach().reshape(-1).to(torch.float64)
        self.stats.extra.setdefault("selected_sq", {})[name] = float(torch.dot(v, v))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": self.name, "error_feedback": self.error_feedback}
        if self.schedule is not None:
            spec = getattr(self.schedule, "spec", None)
            out["schedule"] = spec() if callable(spec) else repr(self.schedule)
        if self.momentum_correction:
            out["momentum_correction"] = self.momentum_correction
            out["momentum_masking"] = self.momentum_masking
        if self.clip_norm is not None:
            out["clip_norm"] = self.clip_norm
        if self.warmup_dense:
            out["warmup_dense"] = True
        if self.flush_every is not None:
            out["flush_every"] = self.flush_every
        return out

    def residual(self, name: str) -> Any:
        """The error-feedback residual of buffer/tensor ``name`` (``KeyError`` if none)."""
        if self.memory is None:
            raise KeyError(f"{type(self).__name__} runs without error feedback")
        return self.memory.residual(name)

    def state_dict(self) -> dict[str, Any]:
        """Residuals (copies, by name) and the step counters."""
        memory = self.memory.state_dict() if self.memory is not None else {}
        state = {"residuals": memory.get("residuals", {}), "steps": dict(self._steps),
                 "slots": dict(self._slots)}
        if "velocities" in memory:
            state["velocities"] = memory["velocities"]
        if self.memory is not None:   # the adopted momentum travels with the velocities
            state["momentum"] = float(self.memory.momentum)
            state["adopt_pending"] = self.adopt_pending
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ValueError`` for foreign state)."""
        missing = {"residuals", "steps", "slots"} - set(state)
        if missing:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing "
                             f"{sorted(missing)}")
        if self.memory is None:
            if state["residuals"]:
                raise ValueError(f"{type(self).__name__} runs without error feedback but "
                                 "the state holds residuals")
        else:
            if self.adopt_pending and "momentum" in state:
                # saved after (or before) momentum_correction="optimizer" took the
                # optimizer's momentum over; the optimizer's own state holds 0 then
                self.adopt_pending = bool(state.get("adopt_pending", False))
                if not self.adopt_pending:
                    self.memory.momentum = float(state["momentum"])
                    self.momentum_correction = self.memory.momentum
            self.memory.load_state_dict({"residuals": state["residuals"],
                                         "velocities": state.get("velocities", {})})
        self._steps = {str(k): int(v) for k, v in state["steps"].items()}
        self._slots = {str(k): int(v) for k, v in state["slots"].items()}

    def step_done(self, model: Any = None, optimizer: Any = None) -> None:
        """With ``momentum_correction="optimizer"``, the first call with an optimizer
        moves its momentum into the error-feedback memory (:func:`adopt_momentum`); every
        rank calls it at the same step, so the ranks stay identical."""
        if self.adopt_pending and optimizer is not None:
            self.adopt_pending = False
            m = adopt_momentum(optimizer)
            if m and self.memory is not None:
                # the velocity so far: with masking, after one step it equals the
                # residual (both are the first gradient with the sent entries cleared),
                # so the run continues exactly as if corrected from the start
                state = self.memory.state_dict()
                self.memory.momentum = m
                self.memory.load_state_dict({"residuals": state["residuals"],
                                             "velocities": state["residuals"]})
                self.momentum_correction = m
            else:
                self.momentum_correction = 0.0
        super().step_done(model, optimizer)

    # ------------------------------------------------------------------ helpers
    def _step(self, name: str) -> int:
        """Times ``name`` was aggregated before this call (and count this one)."""
        if name not in self._slots:
            self._slots[name] = len(self._slots)
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return step

    def _slot(self, name: str) -> int:
        return self._slots[name]

    def _feedback_seconds(self, numel: int, itemsize: int, compute: Any) -> float:
        """Modelled time of the error-feedback add (0 without error feedback)."""
        return numel * itemsize * compute.copy if self.memory is not None else 0.0

    def _compensate(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x + residual`` (a new tensor) with error feedback, else ``x`` itself; with
        ``clip_norm``, ``x`` is first clipped to norm ``clip_norm / sqrt(P)`` (a scaled
        copy), and with momentum correction the memory returns ``residual + velocity``."""
        if self.clip_norm is not None:
            x = self._clip(x)
        return self.memory.compensate(name, x) if self.memory is not None else x

    def _clip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` scaled to L2 norm at most ``clip_norm / sqrt(P)`` (a new tensor if so)."""
        limit = self.clip_norm / math.sqrt(self.comm.size)  # type: ignore[operator]
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        if norm > limit:
            x = x * (limit / norm)
            self.stats.extra["clipped"] = self.stats.extra.get("clipped", 0) + 1
        return x

    def _final_density(self, numel: int, density: float | None, k: int | None) -> float:
        return density if density is not None else min(1.0, k / numel)  # type: ignore

    def _k(self, numel: int, step: int, density: float | None, k: int | None) -> int:
        """Entries kept of a ``numel``-element buffer at its step ``step``: :func:`k_of`
        at the scheduled density while the schedule is above the final density, else at
        the strategy's own ``density`` / ``k``. The same on every rank."""
        if self.schedule is not None:
            final = self._final_density(numel, density, k)
            scheduled = float(self.schedule(step, final))
            if scheduled > final:
                return k_of(numel, scheduled, None)
        return k_of(numel, density, k)

    def dense_step(self, step: int, fraction: float) -> bool:
        """For quantizers: aggregate densely at ``step``? True while the schedule's
        density (with ``fraction`` = the strategy's wire bytes / dense bytes as the final
        density) is above ``fraction``; always False without a schedule."""
        if self.schedule is None:
            return False
        fraction = min(max(fraction, 1e-12), 1.0)
        return float(self.schedule(step, fraction)) > fraction

    def _aggregate_dense(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """A dense step (a quantizer's warm-up, a sparsifier's ``warmup_dense`` or
        ``flush_every`` step): the exact mean of the compensated buffer (ring allreduce);
        the residual is flushed (velocity kept)."""
        from ..collectives import allreduce

        c = self._compensate(name, flat)
        if self.memory is not None:
            self.memory.update(name, c, c)
        self.stats.extra["dense_steps"] = self.stats.extra.get("dense_steps", 0) + 1
        return allreduce(c.contiguous(), op="avg", algorithm="ring", comm=self.comm)


class SparsifyingStrategy(CompressedStrategy):
    """A compressing strategy that sends ``k`` (index, value) entries of each buffer
    through a sparse collective (Top-k Allgather, gTop-k, AR-Top-k): subclasses give that
    collective's bytes per rank (:meth:`_sparse_bytes`), which ``warmup_dense``
    compares with a dense allreduce (:meth:`sparse_dearer`)."""

    @abstractmethod
    def _sparse_bytes(self, numel: int, k: int, itemsize: int, p: int) -> float:
        """Bytes per rank (critical path) of this strategy's sparse collective with ``k``
        entries of a ``numel``-element buffer."""

    density: float | None
    k: int | None

    def _sparse_k(self, flat: torch.Tensor, step: int) -> int | None:
        """Entries to send of ``flat`` at its step ``step`` (:meth:`_k` at the strategy's
        ``density`` / ``k``), or ``None`` when that step goes dense instead
        (:meth:`sparse_dearer`) or flushes the residual (``flush_every``). The same on
        every rank."""
        if self.flush_every is not None and (step + 1) % self.flush_every == 0:
            return None
        numel = flat.shape[0]
        k = self._k(numel, step, self.density, self.k)
        if self.sparse_dearer(numel, k, flat.element_size(), k_of(numel, self.density, self.k)):
            return None
        return k

    def sparse_dearer(self, numel: int, k: int, itemsize: int, final_k: int) -> bool:
        """With ``warmup_dense``: is ``k`` a warm-up value (> ``final_k``) at which the
        sparse collective sends more bytes than a dense ring allreduce of the buffer?
        The same on every rank (it depends on the step's ``k`` and P only)."""
        p = self.comm.size
        if not self.warmup_dense or k <= final_k or p == 1:
            return False
        return self._sparse_bytes(numel, k, itemsize, p) > \
            cost.allreduce_ring(numel * itemsize, p, BYTES)
