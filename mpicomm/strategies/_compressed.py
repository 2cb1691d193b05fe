"""Machinery shared by the compressing strategies.

* :class:`CompressedStrategy`: a :class:`~mpicomm.strategies.base.Strategy` with an
  optional :class:`~mpicomm.compress.ErrorFeedback` memory keyed by buffer (or tensor)
  name, per-name step counters that are identical on every rank (every rank makes the
  same calls in the same order), a floating-point check of the inputs before anything
  is communicated, and ``state_dict``/``load_state_dict`` for all of it.
* :func:`sparsity`: the ``density`` / ``k`` argument rule of the sparsifying strategies.
* :func:`measure`: the traffic and time accounting of :meth:`Strategy.aggregate`, for
  strategies that override ``aggregate`` instead of ``aggregate_flat``.
* :func:`pack_bytes` / :func:`unpack_bytes`: several payload arrays as one byte vector,
  so that one collective carries them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..buffers import FLOAT_DTYPES, inspect
from ..compress import ErrorFeedback
from ..compress.topk import check_density, check_k, k_for
from ..sparse._common import pack_bytes, unpack_bytes
from ..validate import check_algorithm
from .base import DEFAULT_FUSION_BYTES, Strategy

__all__ = ["CompressedStrategy", "DEFAULT_DENSITY", "sparsity", "k_of",
           "check_allreduce_algorithm", "check_flag", "pack_bytes", "unpack_bytes"]

#: Density used when neither ``density`` nor ``k`` is given.
DEFAULT_DENSITY = 0.01


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


class CompressedStrategy(Strategy):
    """A strategy with error-feedback memory and per-name step counters.

    ``error_feedback=True`` keeps, per buffer name, what compression has not transmitted
    yet and adds it to the next gradient of that name (``memory`` is the
    :class:`~mpicomm.compress.ErrorFeedback`; ``None`` without error feedback).

    Step counters: :meth:`_step` returns how many times a name was aggregated before
    (0, 1, 2, ...), and :meth:`_slot` the order in which names first appeared. Both are
    the same on every rank because every rank aggregates the same names in the same order
    (the :class:`~mpicomm.torch.GradientSync` contract); strategies use them to draw
    shared random indices (RandomK) or to rotate a source rank (AR-Top-k).
    """

    name = "compressed"

    def __init__(self, comm: Any = None, *, error_feedback: bool = True,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES):
        super().__init__(comm, fusion_bytes=fusion_bytes)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.memory: ErrorFeedback | None = ErrorFeedback() if error_feedback else None
        self._steps: dict[str, int] = {}
        self._slots: dict[str, int] = {}

    # ------------------------------------------------------------------ interface
    def aggregate(self, tensors: Sequence[Any], names: Sequence[str] | None = None
                  ) -> list[Any]:
        return super().aggregate(*self._floating_inputs(tensors, names))

    def _floating_inputs(self, tensors: Sequence[Any], names: Sequence[str] | None
                         ) -> tuple[list[Any], list[str]]:
        """:meth:`Strategy._validate`, then ``TypeError`` for non-floating tensors."""
        tensors, names = self._validate(tensors, names)
        check_floating(tensors, names)
        return tensors, names

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, "error_feedback": self.error_feedback}

    def residual(self, name: str) -> Any:
        """The error-feedback residual of buffer/tensor ``name`` (``KeyError`` if none)."""
        if self.memory is None:
            raise KeyError(f"{type(self).__name__} runs without error feedback")
        return self.memory.residual(name)

    def state_dict(self) -> dict[str, Any]:
        """Residuals (copies, by name) and the step counters."""
        residuals = self.memory.state_dict()["residuals"] if self.memory is not None else {}
        return {"residuals": residuals, "steps": dict(self._steps),
                "slots": dict(self._slots)}

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
            self.memory.load_state_dict({"residuals": state["residuals"]})
        self._steps = {str(k): int(v) for k, v in state["steps"].items()}
        self._slots = {str(k): int(v) for k, v in state["slots"].items()}

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

    def _compensate(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x + residual`` (a new tensor) with error feedback, else ``x`` itself."""
        return self.memory.compensate(name, x) if self.memory is not None else x
