"""The cost model's parameters: link costs (alpha, beta, gamma) and compute rates."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CostParams", "ComputeParams", "calibrated"]


@dataclass(frozen=True)
class CostParams:
    """Per-message latency ``alpha`` (s), time per byte ``beta`` and ``gamma`` (s/B)."""

    alpha: float = 20e-6
    beta: float = 1 / 4e9
    gamma: float = 1 / 4e9

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


@dataclass(frozen=True)
class ComputeParams:
    """Measured local compute rates the strategies' predictions add to alpha/beta/gamma.

    ``select``: seconds per element of a top-k selection over a buffer (O(d));
    ``merge``: seconds per (index, value) pair of one gTop-k merge-and-truncate round
    (a sort of <= 2k pairs); ``scatter``: seconds per element of densifying a sparse
    result (zero fill + scatter-add); ``flop``: seconds per multiply-add of a float32
    matmul (PowerSGD); ``copy``: seconds per byte of a local copy or add (error-feedback
    compensation, fusion, host staging). The defaults are rough single-core CPU figures;
    :func:`mpicomm.strategies.kernel_timing.measure_compute` measures them.
    """

    select: float = 4e-9
    merge: float = 1e-7
    scatter: float = 2e-9
    flop: float = 2e-10
    copy: float = 3e-10

    def __post_init__(self) -> None:
        for name in ("select", "merge", "scatter", "flop", "copy"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


def calibrated(comm: Any) -> tuple[CostParams, ComputeParams]:
    """The communicator's calibrated :class:`CostParams` and :class:`ComputeParams` (set by
    :func:`mpicomm.collectives.calibrate.measure` / :func:`mpicomm.strategies.kernel_timing.
    calibrate` under the keys :data:`mpicomm.comm.CALIBRATION_KEYS`, inherited by
    ``dup``/``split``), or the defaults where none was measured."""
    resources = getattr(comm, "resources", {}) if comm is not None else {}
    return (resources.get("cost_params") or CostParams(),
            resources.get("compute_params") or ComputeParams())

