r"""Calibrate the cost model on the running job: several links, compute, online refinement.

Three parts, every one ending with numbers that are identical on every rank:

* :func:`~mpicomm.collectives.calibrate.measure_links` (collective; the project's one
  ping-pong helper, re-exported here): up to ``links`` pairs of ranks time a ping-pong
  (rank 0 with peers on *other nodes* first; pairs that share no node at the same time,
  :func:`~mpicomm.collectives.calibrate.link_rounds`; the ranks outside a round wait
  without spinning), and fits ``t(n) = alpha + n·beta`` per link.
  The job's parameters take the *slowest* link's alpha and beta: a collective's critical
  path crosses it.
* :func:`measure_compute` (local): times the kernels the strategies run besides the
  network (top-k selection, a gTop-k merge round, densify, matmul, copy) on this machine:
  :class:`~mpicomm.collectives.cost.ComputeParams`.
* :func:`calibrate` does both (compute on rank 0), broadcasts, and stores the result in
  ``comm.resources`` where :meth:`mpicomm.strategies.Strategy.predict` and ``auto``
  algorithms read it (``dup``/``split`` inherit it).
* :class:`OnlineCalibration`: exponentially weighted least squares on the measured times
  of real collectives (agreed across ranks by a max-allreduce), refining alpha, beta and
  one factor per scheme on its modelled compute (the issue's measured 1.5-4x gap comes
  from compute and overheads the kernels' rates miss) while training, and a drift test:
  when alpha or beta moves by more than ``drift`` (a fraction) from the values of the
  last decision for ``patience`` consecutive refinements in a row (debounce: one
  outlier step on a loaded machine moves the fit but does not re-decide),
  :meth:`OnlineCalibration.refine` says so.

The refinement in detail: observation ``i`` is a collective whose model is
``t_i = a_i·alpha + b_i·beta`` (``a_i`` messages and ``b_i`` bytes on the critical path,
from the strategy's own formula) plus ``w_i`` seconds of modelled compute of scheme
``k_i``, and whose measured time is ``y_i``. Unknowns: ``u = alpha/alpha_0``,
``v = beta/beta_0`` and one ``κ_k`` per scheme. In units of the prior prediction
``s_i = a_i·alpha_0 + b_i·beta_0 + w_i`` each row is
``x_i = (a_i·alpha_0, b_i·beta_0, w_i at k_i)/s_i`` (entries summing to 1) with target
``y_i/s_i``, so every collective weighs the same whatever its size. With weights
``decay^age`` and a ridge ``lam·|θ - 1|²`` (the calibration as a pseudo-observation,
aging like the others) that keeps a direction no recent observation determines near the
calibrated value::

    θ = argmin Σ_i decay^(n-i)·(x_i·θ - y_i/s_i)² + decay^n·lam·|θ - 1|²

This is the EWMA of the sufficient statistics (``decay`` = 1 - EWMA weight). Tuning:
``decay`` 0.8-0.95 (lower follows a changing network faster, noisier); ``drift`` 0.25-0.5
(the paper re-decides on any change of the tc schedule; on a shared host below 0.25 noise
triggers it); ``patience`` 2-5 refinements (ours: a step time on a shared host jumps 3x
for a step or two; a real network change persists).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI

from ..collectives.calibrate import (
    QUIET_POLL_S,
    Link,
    choose_peers,
    link_rounds,
    measure_gamma,
    measure_links,
    slowest,
)
from ..collectives.cost import ComputeParams, CostParams
from ..comm import Communicator, resolve, wait_all

__all__ = ["Link", "choose_peers", "link_rounds", "measure_links", "measure_compute",
           "calibrate", "OnlineCalibration", "DEFAULT_SIZES"]

#: Ping-pong sizes (bytes): latency-bound to bandwidth-bound, kept short for start-up.
DEFAULT_SIZES: tuple[int, ...] = (8, 1 << 12, 1 << 16, 1 << 20)


def _median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compute(numel: int = 1 << 20, density: float = 0.01,
                    repeats: int = 3) -> ComputeParams:
    """Time the strategies' local kernels on this machine (no communication).

    ``select``: :func:`mpicomm.selection.topk_indices` of ``density·numel`` out of
    ``numel`` float32; ``merge``: one :func:`mpicomm.sparse._common.merge_truncate` of two
    k-pair sets, per pair; ``scatter``: zero fill + scatter of k values into ``numel``;
    ``flop``: a float32 matmul; ``copy``: an add of two vectors, per byte.
    """
    from ..selection import topk_indices
    from ..sparse._common import merge_truncate

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    k = max(1, int(density * numel))
    select = _median_time(lambda: topk_indices(x, k), repeats) / numel
    a_idx = torch.randperm(numel, generator=gen)[:k].sort().values
    b_idx = torch.randperm(numel, generator=gen)[:k].sort().values
    a = (a_idx, torch.randn(k, generator=gen))
    b = (b_idx, torch.randn(k, generator=gen))
    merge = _median_time(lambda: merge_truncate(a, b, k), repeats) / (2 * k)
    vals = torch.randn(k, generator=gen)

    def densify() -> None:
        out = torch.zeros(numel)
        out[a_idx] = vals

    scatter = _median_time(densify, repeats) / numel
    n = 256
    m1, m2 = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    flop = _median_time(lambda: m1 @ m2, repeats) / n ** 3
    y = torch.randn(numel, generator=gen)
    copy = _median_time(lambda: x + y, repeats) / (8 * numel)
    return ComputeParams(select=select, merge=merge, scatter=scatter, flop=flop, copy=copy)


def calibrate(comm: Communicator | None = None, links: int = 3,
              sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 8, store: bool = True,
              compute_numel: int = 1 << 20, oneway_bytes: int = 0
              ) -> tuple[CostParams, ComputeParams, list[Link]]:
    """Ping-pong over several links + compute kernels; identical results on every rank.

    ``oneway_bytes``: one large transfer per link on top of the ping-pongs
    (:func:`~mpicomm.collectives.calibrate.measure_links`).

    alpha/beta are the slowest measured link's (the defaults with one rank), gamma and
    the compute rates rank 0's. With ``store`` they go to ``comm.resources`` (keys
    ``cost_params``, ``compute_params``), read by every strategy's ``predict``.
    """
    comm = resolve(comm)
    found = measure_links(comm, links, sizes, repeats, oneway_bytes) if comm.size > 1 else []
    local = None
    if comm.rank == 0:
        local = (measure_gamma(), measure_compute(compute_numel))
    wait_all([comm.ctl.Ibarrier()], QUIET_POLL_S)
    gamma, compute = comm.bcast_object(local, root=0)
    params = slowest(found, gamma)
    if store:
        comm.resources["cost_params"] = params
        comm.resources["compute_params"] = compute
    return params, compute, found


class OnlineCalibration:
    """EWMA least-squares refinement of alpha, beta and per-scheme compute from measured
    collectives, with drift detection (see the module docstring for the estimator).

    Feed :meth:`observe` on every rank with the same model coefficients (they come from
    deterministic formulas) and the measured seconds; :meth:`refine` (collective unless
    ``comm=None``) agrees on the slowest rank's times, updates the fit, and returns True
    when alpha or beta has stayed more than ``drift`` away from the reference for
    ``patience`` refinements in a row, each with its own measured total also more than
    ``drift`` away from the reference model's prediction (then the current estimate becomes the new
    reference; a refinement back inside the band resets the count). ``params`` is the
    current estimate (gamma unchanged);
    :meth:`compute_scale` the factor on a scheme's modelled compute (1 until observed).
    """

    def __init__(self, params: CostParams, *, decay: float = 0.9, drift: float = 0.3,
                 ridge: float = 0.5, patience: int = 3):
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not drift > 0.0:
            raise ValueError(f"drift must be > 0, got {drift!r}")
        if not ridge > 0.0:
            raise ValueError(f"ridge must be > 0, got {ridge!r}")
        self.base = params
        self.params = params
        self.reference = params
        self.decay, self.drift, self.ridge = float(decay), float(drift), float(ridge)
        self.kinds: list[str] = []                 # compute unknowns after (u, v)
        self._gram = self.ridge * np.eye(2)   # the ping-pong fit as a pseudo-observation
        self._rhs = self.ridge * np.ones(2)
        self._theta = np.ones(2)
        self._pending: list[tuple[float, float, float, float, str]] = []
        self.updates = 0
        self.patience = patience
        self._streak = 0   # consecutive refinements outside the drift band

    def compute_scale(self, kind: str) -> float:
        """Fitted factor on the modelled compute of ``kind`` (a scheme name)."""
        if kind not in self.kinds:
            return 1.0
        return float(self._theta[2 + self.kinds.index(kind)])

    def compute_scales(self) -> dict[str, float]:
        return {k: self.compute_scale(k) for k in self.kinds}

    def observe(self, a: float, b: float, seconds: float, work: float = 0.0,
                kind: str = "") -> None:
        """One collective: ``a`` messages and ``b`` bytes on its critical path, ``work``
        seconds of modelled compute of scheme ``kind``, ``seconds`` measured in all."""
        self._pending.append((float(a), float(b), float(seconds), float(work), str(kind)))

    def refine(self, comm: Communicator | None) -> bool:
        """Agree on the pending observations (max over ranks), update, test for drift.

        ``comm=None``: the observations are already agreed (identical on every rank)."""
        if comm is not None and comm.size > 1:
            counts = comm.allgather_object(len(self._pending))
            if len(set(counts)) != 1:
                raise RuntimeError(f"OnlineCalibration: ranks observed different numbers "
                                   f"of collectives: {counts}")
            if self._pending:
                local = np.array([p[2] for p in self._pending])
                agreed = np.empty_like(local)
                comm.ctl.Allreduce(local, agreed, op=MPI.MAX)
                self._pending = [(a, b, float(t), w, k)
                                 for (a, b, _, w, k), t in zip(self._pending, agreed)]
        ref = self.reference
        # the step's own times against the reference model: an outlier step moves the
        # EWMA fit for several steps, but only its own step is outside the band
        expected = sum(a * ref.alpha + b * ref.beta + self.compute_scale(k) * w
                       for a, b, _, w, k in self._pending)
        measured = sum(p[2] for p in self._pending)
        for a, b, seconds, work, kind in self._pending:
            self._update(a, b, seconds, work, kind)
        self._pending = []
        off = expected > 0 and _relative(measured, expected) > self.drift
        moved = off and (_relative(self.params.alpha, ref.alpha) > self.drift
                         or _relative(self.params.beta, ref.beta) > self.drift)
        self._streak = self._streak + 1 if moved else 0
        if self._streak < self.patience:
            return False
        self._streak = 0
        self.reference = self.params
        return True

    def _grow(self, kind: str) -> int:
        if kind not in self.kinds:
            self.kinds.append(kind)
            n = self._gram.shape[0]
            gram = np.zeros((n + 1, n + 1))
            gram[:n, :n] = self._gram
            gram[n, n] = self.ridge
            self._gram = gram
            self._rhs = np.append(self._rhs, self.ridge)
            self._theta = np.append(self._theta, 1.0)
        return 2 + self.kinds.index(kind)

    def _update(self, a: float, b: float, seconds: float, work: float, kind: str) -> None:
        if not seconds > 0:
            return
        col = self._grow(kind) if work > 0 and kind else None
        x = np.zeros(self._gram.shape[0])
        x[0], x[1] = a * self.base.alpha, b * self.base.beta
        if col is not None:
            x[col] = work
        prior = float(x.sum())
        if not prior > 0:
            return
        x /= prior  # the row in units of the prior prediction; target = measured/that
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._rhs = self.decay * self._rhs + x * (seconds / prior)
        lhs = self._gram + 1e-9 * np.trace(self._gram) * np.eye(x.size)
        self._theta = np.maximum(np.linalg.solve(lhs, self._rhs), 1e-3)
        u, v = float(self._theta[0]), float(self._theta[1])
        self.params = CostParams(alpha=u * self.base.alpha, beta=v * self.base.beta,
                                 gamma=self.base.gamma)
        self.updates += 1


def _relative(value: float, ref: float) -> float:
    return abs(value - ref) / ref if ref > 0 else (0.0 if value == 0 else float("inf"))
