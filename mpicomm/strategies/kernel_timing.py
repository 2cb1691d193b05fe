"""Time the strategies' compute kernels, and calibrate a job: links + kernels.

Two parts, both ending with numbers that are identical on every rank:

* :func:`measure_compute` (local, no communication): times the kernels the strategies
  run besides the network (top-k selection, a gTop-k merge round, densify, a matmul for
  PowerSGD, a copy) on this machine: :class:`~mpicomm.collectives.cost.ComputeParams`.
* :func:`calibrate` (collective): the links' alpha and beta
  (:func:`mpicomm.collectives.calibrate.measure_links`: up to ``links`` ping-pong pairs,
  rank 0 with peers on *other nodes* first, node-disjoint pairs at the same time; the
  job takes the *slowest* link's alpha and beta, since a collective's critical path
  crosses it), gamma and the kernels on rank 0, broadcast, and stored in
  ``comm.resources`` under :data:`mpicomm.comm.CALIBRATION_KEYS`, where every strategy's
  :meth:`~mpicomm.strategies.Strategy.predict` and ``algorithm="auto"`` read them
  (``dup``/``split`` inherit them).

While training, :class:`mpicomm.control.OnlineCalibration` refines what this measured
from the times of real steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .. import clock
from ..collectives.calibrate import (
    QUIET_POLL_S,
    Link,
    measure_gamma,
    measure_links,
    slowest,
)
from ..collectives.cost import ComputeParams, CostParams
from ..comm import Communicator, resolve

__all__ = ["measure_compute", "calibrate", "DEFAULT_SIZES"]

#: Ping-pong sizes (bytes): latency-bound to bandwidth-bound, kept short for start-up.
DEFAULT_SIZES: tuple[int, ...] = (8, 1 << 12, 1 << 16, 1 << 20)


def _median_time(fn: Callable[[], object], repeats: int) -> float:
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

    ``select``: :func:`mpicomm.compress.topk_select.topk_indices` of ``density·numel`` out of
    ``numel`` float32; ``merge``: one gTop-k merge-and-truncate of two k-pair sets, per
    pair; ``scatter``: zero fill + scatter of k values into ``numel``; ``flop``: a
    float32 matmul; ``copy``: an add of two vectors, per byte. Cost: ``repeats + 1`` runs
    of each kernel, about 0.1 s for the default ``numel`` on one core.

    Under the virtual clock nothing is timed: the rates are the cost table's (what the
    same work is charged, :mod:`mpicomm.costtable`), so the selector predicts with the
    numbers that time the run; ``merge`` is then the table's ``merge`` plus ``select``
    per pair (a merge-and-truncate round is a union and a selection).
    """
    table = clock.cost_table()
    if table is not None:
        def rate(op: str) -> float:
            return table.cost(op, 1) - table.cost(op, 0)

        return ComputeParams(select=rate("select"), merge=rate("merge") + rate("select"),
                             scatter=rate("scatter"), flop=rate("flop"), copy=rate("copy"))
    from ..compress.topk_select import topk_indices
    from ..sparse.sets import merge_truncate

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
    comm.barrier(poll_s=QUIET_POLL_S)
    gamma, compute = comm.bcast_object(local, root=0)
    params = slowest(found, gamma)
    if store:
        comm.resources["cost_params"] = params
        comm.resources["compute_params"] = compute
    return params, compute, found
