"""Fit the cost model's alpha, beta and gamma on the machine the job runs on.

:func:`measure` is collective. Ranks 0 and 1 time a ping-pong over the communicator's
private point-to-point duplicate (the path mpicomm's own algorithms use, Python
overhead included) for a few message sizes and fit ``t(n) = alpha + n*beta`` to the
one-way times; rank 0 times an in-place numpy add for ``gamma``. Rank 0's figures are
broadcast, so every rank gets the same :class:`~mpicomm.collectives.cost.CostParams` and
``algorithm="auto"`` makes the same choice everywhere. The other ranks wait without
spinning (a sleeping poll), so on a machine with fewer cores than ranks they do not steal
the CPU from the two that measure.

With one rank there is no link to measure: alpha and beta keep their defaults.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..comm import Communicator, resolve
from ..linkdelay import link_delay
from .cost import CostParams

__all__ = ["measure", "pingpong", "fit_alpha_beta", "measure_gamma", "DEFAULT_SIZES"]

#: Ping-pong message sizes in bytes: latency-bound to bandwidth-bound.
DEFAULT_SIZES: tuple[int, ...] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
_TAG = 97


def _repeats_for(nbytes: int, repeats: int) -> int:
    """Fewer repeats for large messages (each is slower and less noisy)."""
    return max(3, repeats if nbytes <= 1 << 17 else repeats // 4)


def pingpong(comm: Communicator, nbytes: int, repeats: int = 20, warmup: int = 2) -> float:
    """Median one-way time (s) of an ``nbytes`` message between ranks 0 and 1.

    Ranks 0 and 1 must both call it (others must not); only rank 0's answer is meaningful
    (rank 1 returns 0.0).
    """
    mpi, rank = comm.p2p, comm.rank
    delay = link_delay(comm)  # the emulated cluster's injected latency counts in alpha
    buf = np.zeros(nbytes, dtype=np.uint8)
    msg = [buf, MPI.BYTE]
    times = []
    for i in range(warmup + repeats):
        if rank == 0:
            start = time.perf_counter()
            if delay is not None:
                delay.before_send(1)
            mpi.Send(msg, 1, _TAG)
            if delay is not None:
                delay.after_receive()
            mpi.Recv(msg, 1, _TAG)
            if i >= warmup:
                times.append((time.perf_counter() - start) / 2)
        else:
            if delay is not None:
                delay.after_receive()
            mpi.Recv(msg, 0, _TAG)
            if delay is not None:
                delay.before_send(0)
            mpi.Send(msg, 0, _TAG)
    return statistics.median(times) if times else 0.0


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = alpha + n*beta`` in *relative* error (so the small messages
    fix alpha and the large ones beta), clamped to non-negative values."""
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.size < 2 or np.any(t <= 0):
        raise ValueError("need at least two sizes with positive times to fit alpha and beta")
    rows = np.stack([1 / t, n / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    if beta <= 0:  # noise swamped the slope: fall back to the two largest messages
        order = np.argsort(n)
        big, small = order[-1], order[-2]
        beta = max((t[big] - t[small]) / (n[big] - n[small]), 0.0)
        alpha = t[order[0]] - n[order[0]] * beta
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def measure_gamma(nbytes: int = 1 << 22, repeats: int = 10) -> float:
    """Seconds per byte of an in-place float32 numpy add (the reduction kernel)."""
    count = max(1, nbytes // 4)
    acc = np.zeros(count, dtype=np.float32)
    other = np.ones(count, dtype=np.float32)
    np.add(acc, other, out=acc)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.add(acc, other, out=acc)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (4 * count)


def _wait_quietly(request: MPI.Request, poll: float = 1e-3) -> None:
    """Complete ``request`` while sleeping between polls (leaves the CPU to others)."""
    while not request.Test():
        time.sleep(poll)


def measure(comm: Communicator | None = None, sizes: Sequence[int] = DEFAULT_SIZES,
            repeats: int = 20, store: bool = False) -> CostParams:
    """Measure alpha, beta (ping-pong between ranks 0 and 1) and gamma (numpy add).

    Collective over ``comm``; every rank returns the same :class:`CostParams`. With
    ``store=True`` they are also put in ``comm.resources["cost_params"]``, where
    ``algorithm="auto"`` looks for them. Takes well under a second on shared memory.
    """
    comm = resolve(comm)
    fitted: dict[str, Any] | None = None
    if comm.size > 1 and comm.rank in (0, 1):
        times = [pingpong(comm, int(s), _repeats_for(int(s), repeats)) for s in sizes]
        if comm.rank == 0:
            alpha, beta = fit_alpha_beta(sizes, times)
            fitted = {"alpha": alpha, "beta": beta}
    if comm.rank == 0:
        fitted = dict(fitted or {}, gamma=measure_gamma())
    _wait_quietly(comm.ctl.Ibarrier())
    fitted = comm.bcast_object(fitted, root=0)
    defaults = CostParams()
    params = CostParams(alpha=fitted.get("alpha", defaults.alpha),
                        beta=fitted.get("beta", defaults.beta),
                        gamma=fitted["gamma"])
    if store:
        comm.resources["cost_params"] = params
    return params
