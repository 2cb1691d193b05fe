"""Fit the cost model's alpha, beta and gamma on the machine the job runs on.

The one ping-pong helper of the project (:func:`pingpong`; ``bench collectives``,
:func:`mpicomm.strategies.kernel_timing.calibrate` and
:func:`mpicomm.jobinfo.measure_link` all use it): two ranks exchange messages over the
communicator's private point-to-point duplicate (the path mpicomm's own algorithms use,
Python overhead and the emulated cluster's injected latency included) with the
registered tag :data:`mpicomm.tags.TAG_CALIBRATE`, and ``t(n) = alpha + n*beta`` is
fitted to the one-way times (:func:`fit_alpha_beta`).

* :func:`measure_links` (collective): up to ``links`` pairs ping-pong, rank 0 with
  peers on *other nodes* first (:func:`choose_peers`), in rounds of pairs that share no
  node and run at the same time (:func:`link_rounds`); every rank gets the same list of
  fitted :class:`Link`. The ranks outside a round wait without spinning (a sleeping
  poll), so on a machine with fewer cores than ranks they do not steal the CPU from
  those that measure.
* :func:`measure` (collective): the *slowest* measured link's alpha and beta (a
  collective's critical path crosses it) and rank 0's gamma (numpy add), broadcast, so
  every rank gets the same :class:`~mpicomm.collectives.cost.CostParams` and
  ``algorithm="auto"`` makes the same choice everywhere.

With one rank there is no link to measure: alpha and beta keep their defaults.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import clock
from ..arrayops import ops_for
from ..comm import Communicator, Traffic, resolve
from ..p2p import Ctx
from ..tags import TAG_CALIBRATE
from ..validate import check_int
from .cost import CostParams

#: Longest sleep between tests while ranks wait at a calibration barrier (leaves the CPU
#: to the ranks still measuring).
QUIET_POLL_S = 1e-3

__all__ = ["measure", "measure_links", "pingpong", "fit_alpha_beta", "measure_gamma",
           "choose_peers", "link_rounds", "Link", "DEFAULT_SIZES", "slowest"]

#: Ping-pong message sizes in bytes: latency-bound to bandwidth-bound.
DEFAULT_SIZES: tuple[int, ...] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)


@dataclass(frozen=True)
class Link:
    """The fitted ping-pong of ranks ``a`` and ``b``."""

    a: int
    b: int
    alpha: float
    beta: float


def _repeats_for(nbytes: int, repeats: int) -> int:
    """Fewer repeats for large messages (each is slower and less noisy)."""
    return max(3, repeats if nbytes <= 1 << 17 else repeats // 4)


def pingpong(comm: Communicator, nbytes: int, repeats: int = 20, warmup: int = 2,
             peer: int = 1, reply_bytes: int | None = None, reply_s: float = 0.0,
             origin: int = 0) -> float:
    """Median one-way time (s) of an ``nbytes`` message between ``origin`` and ``peer``.

    ``origin`` (default rank 0) and ``peer`` must both call it (others must not); only
    ``origin``'s answer is meaningful (``peer`` returns 0.0). Disjoint pairs may run at
    the same time. Cost: ``2·(warmup + repeats)`` messages.
    By default ``peer`` echoes the message and the one-way time is half the round trip;
    with ``reply_bytes`` it answers with that many bytes instead, and the one-way time is
    the round trip minus ``reply_s`` (the reply's own one-way time, measured before):
    half the cost for a large message.
    """
    rank = comm.rank
    if peer == origin or not (0 <= peer < comm.size and 0 <= origin < comm.size) or \
            rank not in (origin, peer):
        raise ValueError(f"pingpong: origin {origin} and peer {peer} (of {comm.size}) call "
                         f"it; rank {rank} did")
    # messages of the point-to-point layer (blocking on the wall clock; the emulated
    # link's delay counts in alpha; the virtual clock times them), outside the
    # communicator's traffic counters
    ctx = Ctx.of(comm, ops_for("numpy", False))
    ctx.traffic = Traffic()
    if not ctx.virtual:
        ctx.poll_s = None
    buf = np.zeros(nbytes, dtype=np.uint8)
    echo = reply_bytes is None
    reply = buf if echo else np.zeros(int(reply_bytes), dtype=np.uint8)
    times = []
    for i in range(warmup + repeats):
        if rank == origin:
            start = clock.now()
            ctx.send(buf, peer, TAG_CALIBRATE)
            ctx.recv(reply, peer, TAG_CALIBRATE)
            if i >= warmup:
                elapsed = clock.now() - start
                times.append(elapsed / 2 if echo else max(elapsed - reply_s, 0.0))
        else:
            ctx.recv(buf, origin, TAG_CALIBRATE)
            ctx.send(reply, origin, TAG_CALIBRATE)
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
    """Seconds per byte of an in-place float32 numpy add (the reduction kernel); under
    the virtual clock, the cost table's ``reduce`` rate (what a reduction is charged)."""
    table = clock.cost_table()
    if table is not None:
        return table.cost("reduce", 1) - table.cost("reduce", 0)
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


def choose_peers(nodes: Sequence[int], links: int) -> list[int]:
    """Rank 0's ping-pong partners: one rank on each other node first (lowest rank of the
    node), then further ranks of any node, up to ``links`` (``nodes[r]`` = node of r)."""
    others: list[int] = []
    seen = {nodes[0]}
    for r in range(1, len(nodes)):
        if nodes[r] not in seen:
            seen.add(nodes[r])
            others.append(r)
    rest = [r for r in range(1, len(nodes)) if r not in others]
    return (others + rest)[:max(0, links)]


def _check(links: int, sizes: Sequence[int]) -> None:
    check_int("links", links, 1)
    if len(sizes) < 2 or any(int(s) < 0 for s in sizes):
        raise ValueError("sizes needs at least two non-negative message sizes")


def link_rounds(nodes: Sequence[int], links: int) -> list[list[tuple[int, int]]]:
    """Up to ``links`` ping-pong pairs ``(origin, peer)`` grouped in rounds whose pairs
    share neither a rank nor a node, so that a round's pairs can be measured at the same
    time without competing for a network interface (``nodes[r]`` = node of rank r).

    Candidates in order: rank 0 with its :func:`choose_peers`, then the other pairs of
    ranks on different nodes, then those on one node. Each round takes, greedily in that
    order, every candidate compatible with the round so far. On one node every round
    holds one pair; with one rank per node a round pairs up every rank (the emulated
    cluster's 4 hosts: (0, 1) and (2, 3) in the first round)."""
    p = len(nodes)
    pairs = [(0, q) for q in choose_peers(nodes, p - 1)]
    others = [(a, b) for a in range(1, p) for b in range(a + 1, p)]
    pairs += [ab for ab in others if nodes[ab[0]] != nodes[ab[1]]]
    pairs += [ab for ab in others if nodes[ab[0]] == nodes[ab[1]]]
    rounds: list[list[tuple[int, int]]] = []
    left = max(0, links)
    while pairs and left:
        used: set[int] = set()  # nodes in this round (pairs on distinct nodes: distinct ranks)
        this, rest = [], []
        for a, b in pairs:
            if len(this) < left and used.isdisjoint((nodes[a], nodes[b])):
                this.append((a, b))
                used.update((nodes[a], nodes[b]))
            else:
                rest.append((a, b))
        rounds.append(this)
        pairs, left = rest, left - len(this)
    return rounds


def measure_links(comm: Communicator | None = None, links: int = 3,
                  sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 20,
                  oneway_bytes: int = 0) -> list[Link]:
    """Fit alpha/beta on up to ``links`` links (collective; the same list on every rank,
    in :func:`link_rounds` order; empty with one rank): rank 0's to other nodes first,
    the pairs of a round measured at the same time. Costs about ``Σ sizes·repeats``
    bytes of ping-pong per link: well under a second per round on shared memory.

    ``oneway_bytes`` adds, per link, one transfer of that many bytes answered by a
    message of the smallest size (:func:`pingpong` with ``reply_bytes``; no warm-up, the
    ping-pongs before it opened the connection) as one more point of the fit: the
    cheapest way to see the sustained rate where small messages do not (a traffic
    shaper's burst, e.g. the emulated cluster's 128 KiB ``tbf`` bucket, lets them pass
    at line rate). Cost ``oneway_bytes·beta + 2·alpha`` per link. On a loaded host the
    transfer's round trip minus the small messages' median one-way time can come out at
    0; that point is then left out and the link is fitted from the ping-pongs alone."""
    comm = resolve(comm)
    _check(links, sizes)
    oneway_bytes = check_int("oneway_bytes", oneway_bytes, 0)
    rounds = link_rounds(comm.allgather_object(comm.node), links)
    mine: list[Link] = []
    for pairs in rounds:
        for origin, peer in pairs:
            if comm.rank not in (origin, peer):
                continue
            points = [int(s) for s in sizes]
            times = [pingpong(comm, s, _repeats_for(s, repeats), peer=peer, origin=origin)
                     for s in points]
            if oneway_bytes:
                small = min(range(len(points)), key=points.__getitem__)
                oneway = pingpong(comm, oneway_bytes, 1, warmup=0, peer=peer,
                                  origin=origin, reply_bytes=points[small],
                                  reply_s=times[small])
                if oneway > 0:  # else lost in noise (reply_s, a median, was larger)
                    times.append(oneway)
                    points.append(oneway_bytes)
            if comm.rank == origin:
                alpha, beta = fit_alpha_beta(points, times)
                mine.append(Link(origin, peer, alpha, beta))
        comm.barrier(poll_s=QUIET_POLL_S)
    fitted = {(lk.a, lk.b): lk for found in comm.allgather_object(mine) for lk in found}
    return [fitted[pair] for pairs in rounds for pair in pairs]


def slowest(found: Sequence[Link], gamma: float) -> CostParams:
    """The cost parameters of the slowest measured link (the defaults without one)."""
    defaults = CostParams()
    return CostParams(alpha=max((lk.alpha for lk in found), default=defaults.alpha),
                      beta=max((lk.beta for lk in found), default=defaults.beta),
                      gamma=gamma)


def measure(comm: Communicator | None = None, sizes: Sequence[int] = DEFAULT_SIZES,
            repeats: int = 20, store: bool = False, links: int = 3) -> CostParams:
    """Measure alpha, beta (the slowest of :func:`measure_links`) and gamma (numpy add).

    Collective over ``comm``; every rank returns the same :class:`CostParams`. With
    ``store=True`` they are also put in ``comm.resources["cost_params"]``, where
    ``algorithm="auto"`` looks for them. Takes well under a second per link on shared
    memory.
    """
    comm = resolve(comm)
    _check(links, sizes)
    found = measure_links(comm, links, sizes, repeats) if comm.size > 1 else []
    gamma = measure_gamma() if comm.rank == 0 else None
    comm.barrier(poll_s=QUIET_POLL_S)
    params = slowest(found, comm.bcast_object(gamma, root=0))
    if store:
        comm.resources["cost_params"] = params
    return params
