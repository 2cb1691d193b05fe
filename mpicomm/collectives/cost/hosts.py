r"""Costs on a cluster of hosts: two link classes, one network port per host (or more).

:class:`HostCosts` prices an algorithm on a host layout (:class:`mpicomm.topology.
Topology`) with two link classes: ``local`` (alpha, beta) between ranks of one host
(shared memory; every pair on its own) and ``network`` (alpha, beta) between hosts,
where **all ranks of a host share one port per direction** unless the topology gives a
host several ports (``MPICOMM_HOST_NICS``: local rank j on port j mod N). An algorithm
is a sequence of *rounds* of concurrent messages; a round costs

* ``alpha_net + B·beta_net`` when any of its messages crosses hosts, with ``B`` the most
  bytes that leave or enter one port in that round (the busiest port on the path);
* otherwise ``max(alpha_loc + n·beta_loc)`` over its messages;

reductions add ``gamma`` (the ``network`` parameters' gamma, the calibrated machine's)
per byte as in the flat formulas. With one rank per host this is the flat model of
:mod:`mpicomm.collectives.cost.flat` where the algorithm runs in lock-step rounds (a
power-of-two butterfly, a ring whose blocks are one segment each) and an upper bound of
it otherwise (the flat formulas follow the critical path: the unfolded ranks of a
butterfly start early, a ring's segments pipeline); with host-major placement a ring still
crosses the network once per host per step (its flat formula holds with the network's
parameters), while a butterfly's rounds whose partners sit on other hosts push every
local rank's message through one port at once:

================================  ==========================================================
flat gTop-k (butterfly), P = H·R  lg R rounds ``α_l + k·s·β_l`` + lg H rounds ``α_n + R·k·s·β_n``
hierarchical allreduce            RS on each host, ``lanes`` concurrent allreduces of
                                  n/lanes over H hosts, AG on each host: about
                                  ``2(R-1)(α_l + n/R·β_l) + 2(H-1)α_n + 2(H-1)/H·n·β_n``
hierarchical gTop-k               reduce to the leader (or RS), butterfly over H hosts of k
                                  pairs ``lg H (α_n + k·s·β_n)``, result to the host's ranks
================================  ==========================================================

Every cost comes back as :class:`Seconds`: ``comm`` (network rounds and the reductions'
gamma, linear in the network's alpha, beta and gamma) and ``local`` (rounds inside
hosts), so that a refit of the network parameters can keep the shared-memory part fixed.

Bounds worth knowing (all terms bandwidth-bound, ``P = H·R`` host-major): a flat ring
moves ``2(P-1)/P·n`` through each host's port, a hierarchical allreduce ``2(H-1)/H·n``;
the ratio ``(P-1)H / (P(H-1))`` is the most the hierarchy can gain on a large dense
vector (1.11 at 8 hosts × 4, 1.03 at 16 × 2, 1.5 at 2 × 2). A butterfly (recursive
doubling, gTop-k) gains up to ``R``: its flat form sends ``R`` messages through every
port in each of its ``lg H`` network rounds. With one port per rank (``N = R``) the flat
ring still crosses hosts through one rank's port per host and step, ``2(P-1)/P·n`` each,
while the hierarchy's lanes carry ``2(H-1)/H·n/R`` through each of the ``R`` ports: up
to ``R`` times faster on a large vector (4 at 8 × 4, 2 at 16 × 2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...config import RING_SEGMENT_BYTES
from ...p2p import block_bounds, fold_layout, real_rank
from ...topology import Topology
from .params import CostParams

__all__ = ["HostCosts", "Seconds", "host_costs", "HOST_ALGORITHMS", "SPARSE_INNER"]

#: A message ``(source, destination, bytes)`` between ranks of one group.
Msg = tuple[int, int, float]
#: One round of concurrent messages, and how many times it repeats.
Rounds = list[tuple[list[Msg], int]]

#: Sparse collectives a hierarchical aggregation can run across hosts.
SPARSE_INNER = ("allgather", "gtopk", "artopk")


@dataclass(frozen=True)
class Seconds:
    """A predicted time split into ``comm`` (network rounds + reductions) and ``local``
    (shared-memory rounds inside hosts)."""

    comm: float = 0.0
    local: float = 0.0

    def __add__(self, other: Seconds) -> Seconds:
        return Seconds(self.comm + other.comm, self.local + other.local)

    def __mul__(self, k: float) -> Seconds:
        return Seconds(self.comm * k, self.local * k)

    @property
    def total(self) -> float:
        return self.comm + self.local


# ---------------------------------------------------------------------- patterns
# Each pattern is a list of rounds over ranks 0..p-1 of one group; _on() maps groups of
# real ranks onto them, running the groups' same-numbered rounds together.
def _ring(p: int, blocks: Sequence[float], reduce: bool) -> Rounds:
    """Ring pass(es) over ``blocks`` (bytes per block, block j final on rank j): rank r
    sends block (r-1-s) mod p at step s (a reduce-scatter; the allgather moves the
    same blocks one step later, so one pattern serves both)."""
    if p == 1:
        return []
    if len(set(blocks)) == 1:
        return [([(r, (r + 1) % p, blocks[0]) for r in range(p)], p - 1)]
    out: Rounds = []
    for s in range(p - 1):
        shift = 1 + s if reduce else s
        out.append(([(r, (r + 1) % p, blocks[(r - shift) % p]) for r in range(p)], 1))
    return out


def _fold(p: int, n: float, back: bool) -> Rounds:
    """The fold of a non-power-of-two ``p``: ranks 2i hand ``n`` bytes to 2i+1 (or, with
    ``back``, receive them from it)."""
    rem = fold_layout(p)[1]
    if not rem or not n:
        return []
    return [([(2 * i + back, 2 * i + 1 - back, n) for i in range(rem)], 1)]


def _xor(p: int, steps: Sequence[tuple[int, float]]) -> Rounds:
    """Exchanges of the power-of-two group: each ``(mask, bytes)`` step pairs virtual
    rank ``v`` with ``v XOR mask``, both ways."""
    p2, rem = fold_layout(p)
    return [([(real_rank(v, rem), real_rank(v ^ mask, rem), n) for v in range(p2)], 1)
            for mask, n in steps]


def _butterfly(p: int, n: float) -> Rounds:
    """Recursive doubling (and gTop-k): fold-in, ``lg p2`` exchanges of ``n``, fold-out."""
    p2 = fold_layout(p)[0]
    masks = [1 << i for i in range(int(math.log2(p2)))]
    return _fold(p, n, False) + _xor(p, [(m, n) for m in masks]) + _fold(p, n, True)


def _binomial(p: int, n: float) -> Rounds:
    """Binomial broadcast from rank 0: in round t the multiples of 2^(L-t) send to
    ``rank + 2^(L-1-t)``."""
    levels = math.ceil(math.log2(p)) if p > 1 else 0
    out: Rounds = []
    for t in range(levels):
        step, span = 1 << (levels - 1 - t), 1 << (levels - t)
        out.append(([(r, r + step, n) for r in range(0, p, span) if r + step < p], 1))
    return out


def _halving(p: int, n: float) -> Rounds:
    """Rabenseifner: fold-in, recursive halving (masks p2/2 .. 1, n/2 .. n/p2 bytes),
    recursive doubling back, fold-out."""
    p2 = fold_layout(p)[0]
    steps = [(p2 >> i, n / (1 << i)) for i in range(1, int(math.log2(p2)) + 1)]
    return (_fold(p, n, False) + _xor(p, steps) + _xor(p, steps[::-1])
            + _fold(p, n, True))


@dataclass(frozen=True)
class HostCosts:
    """Two link classes on a host layout (module docstring). ``topology`` places the
    ranks; ``local`` prices shared memory, ``network`` the hosts' ports (its gamma the
    reductions)."""

    topology: Topology
    local: CostParams = field(default_factory=CostParams)
    network: CostParams = field(default_factory=CostParams)

    @property
    def p(self) -> int:
        return self.topology.size

    # ------------------------------------------------------------------ rounds
    def _round(self, msgs: Iterable[Msg]) -> Seconds:
        hosts = self.topology.hosts
        ports = self.topology.ports or hosts
        up: dict[int, float] = {}
        down: dict[int, float] = {}
        crossing: list[tuple[int, int]] = []
        local = 0.0
        for s, d, n in msgs:
            if n <= 0:
                continue
            if hosts[s] == hosts[d]:
                local = max(local, self.local.alpha + n * self.local.beta)
            else:
                ps, pd = ports[s], ports[d]
                up[ps] = up.get(ps, 0.0) + n
                down[pd] = down.get(pd, 0.0) + n
                crossing.append((ps, pd))
        if crossing:
            busiest = max(max(up[a], down[b]) for a, b in crossing)
            return Seconds(comm=self.network.alpha + busiest * self.network.beta)
        return Seconds(local=local)

    def rounds(self, groups: Sequence[Sequence[int]], patterns: Sequence[Rounds]
               ) -> Seconds:
        """Time of ``patterns[g]`` run by ``groups[g]`` (real ranks; pattern rank i is
        ``groups[g][i]``), all groups at once, round by round."""
        seqs: list[list[list[Msg]]] = []
        for group, pattern in zip(groups, patterns):
            seq: list[list[Msg]] = []
            for msgs, times in pattern:
                mapped = [(group[s], group[d], n) for s, d, n in msgs]
                seq.extend([mapped] * times)  # one object per repeated round
            seqs.append(seq)
        total, last, cost = Seconds(), None, Seconds()
        for i in range(max((len(seq) for seq in seqs), default=0)):
            parts = [seq[i] for seq in seqs if i < len(seq)]
            key = tuple(id(part) for part in parts)
            if key != last:  # a repeated round (a ring's steps) is priced once
                cost, last = self._round([m for part in parts for m in part]), key
            total = total + cost
        return total

    def _gamma(self, nbytes: float) -> Seconds:
        return Seconds(comm=nbytes * self.network.gamma)

    # ------------------------------------------------------------------ flat algorithms
    def flat(self, collective: str, algorithm: str, n: float) -> Seconds:
        """``algorithm`` of ``collective`` over every rank (as the flat code runs it) on
        ``n`` bytes (allgather: the total gathered), on this layout."""
        return self.on_group(collective, algorithm, n, [list(range(self.p))])

    def on_group(self, collective: str, algorithm: str, n: float,
                 groups: Sequence[Sequence[int]]) -> Seconds:
        """``algorithm`` of ``collective`` run by every group of ``groups`` at once
        (each on ``n`` bytes; the groups share the hosts' ports)."""
        g = len(groups[0])
        if g == 1:
            return Seconds()
        pattern, reduced = _pattern(collective, algorithm, n, g)
        return self.rounds(groups, [pattern] * len(groups)) + self._gamma(reduced)

    # ------------------------------------------------------------------ hierarchical
    def _phase_local(self, lane_bytes: Sequence[float], reduce: bool) -> Seconds:
        """A ring over every host's ranks at once with block j = ``lane_bytes[j]`` for
        the first ``lanes`` local ranks and empty blocks after (the reduce-scatter into
        the lanes, or the allgather out of them)."""
        members = self.topology.members
        if len(lane_bytes) == 1:  # one block: a chain, pipelined by ring segments
            n = lane_bytes[0]
            seg = min(n, RING_SEGMENT_BYTES)
            patterns: list[Rounds] = [[([(0, 1, n)], 1), ([(0, 1, seg)], len(m) - 2)]
                                      if len(m) > 1 else [] for m in members]
        else:
            patterns = [_ring(len(m), list(lane_bytes) + [0.0] * (len(m) - len(lane_bytes)),
                              reduce) for m in members]
        return self.rounds(members, patterns)

    def lane_groups(self) -> list[list[int]]:
        """Real ranks of each lane: local rank j of every host, in host order."""
        members = self.topology.members
        return [[m[j] for m in members] for j in range(self.topology.lanes)]

    def hierarchical_allreduce(self, n: float, inner: str | None = None) -> Seconds:
        """Reduce-scatter into the lanes on every host, the lanes' allreduce of n/lanes
        across hosts (``inner``: the algorithm, default the cheapest), allgather."""
        t = self.topology
        lanes = t.lanes
        slices = [float(b - a) for a, b in _pairs(block_bounds(int(n), lanes))]
        sizes = t.host_sizes
        reduced = max(n * (s - 1) / s if s == lanes else n for s in sizes)
        out = self._phase_local(slices, True) + self._gamma(reduced)
        out = out + self.lane_allreduce(max(slices), inner)
        return out + self._phase_local(slices, False)

    def lane_allreduce(self, n: float, inner: str | None = None) -> Seconds:
        """Every lane's allreduce of ``n`` bytes across hosts, all lanes at once."""
        if self.topology.num_hosts == 1:
            return Seconds()
        algorithms = ("ring", "recursive_doubling", "rabenseifner") if inner is None \
            else (inner,)
        groups = self.lane_groups()
        return min((self.on_group("allreduce", a, n, groups) for a in algorithms),
                   key=lambda s: s.total)

    def lane_allreduce_algorithm(self, n: float) -> str:
        """The cheapest allreduce for the lanes' ``n`` bytes (ties: the ring)."""
        groups = self.lane_groups()
        return min(("ring", "recursive_doubling", "rabenseifner"),
                   key=lambda a: self.on_group("allreduce", a, n, groups).total)

    def hierarchical_allgather(self, n: float) -> Seconds:
        """Allgather on every host, lanes' allgather of the host data's slices across
        hosts, allgather of the lanes' results on every host (``n``: total bytes)."""
        t = self.topology
        lanes, p = t.lanes, t.size
        members = t.members
        gather = self.rounds(members, [_ring(len(m), [n / p] * len(m), False)
                                       for m in members])
        per_lane = [sum(len(m) * n / p / lanes for m in members)] * lanes
        groups = self.lane_groups()
        across = Seconds()
        if t.num_hosts > 1:
            blocks = [len(m) * n / p / lanes for m in members]
            across = self.rounds(groups, [_ring(len(members), blocks, False)] * lanes)
        return gather + across + self._phase_local(per_lane, False)

    def hierarchical_sparse(self, inner: str, d_bytes: float, k: float, index_bytes: float,
                            value_bytes: float, sliced: bool,
                            inner_algorithm: str = "ring") -> Seconds:
        """Hierarchical sparse aggregation of a ``d_bytes`` vector keeping ``k`` entries:
        the dense reduction inside hosts (to the leader, or ``sliced`` into the lanes),
        ``inner`` (``"allgather"``, ``"gtopk"``, ``"artopk"`` with ``inner_algorithm``
        for its values) across hosts on every lane, then the result (pairs and this
        host's applied indices) to every rank of the host."""
        t = self.topology
        lanes = t.lanes if sliced else 1
        slices = [d_bytes / lanes] * lanes
        sizes = t.host_sizes
        reduced = max(d_bytes * (s - 1) / s if s == lanes else d_bytes for s in sizes)
        out = self._phase_local(slices, True) + self._gamma(reduced)
        kj = k / lanes
        across, result = self._sparse(inner, self.lane_groups()[:lanes], kj, index_bytes,
                                      value_bytes, inner_algorithm)
        return out + across + self._phase_local([result + kj * index_bytes] * lanes, False)

    def flat_sparse(self, inner: str, k: float, index_bytes: float, value_bytes: float,
                    inner_algorithm: str = "ring") -> Seconds:
        """A flat sparse collective over every rank on this layout, ``k`` pairs per rank:
        ``"allgather"`` (Allgather Top-k's ring), ``"gtopk"`` (the butterfly),
        ``"artopk"`` (binomial broadcast of the indices + ``inner_algorithm``)."""
        return self._sparse(inner, [list(range(self.p))], k, index_bytes, value_bytes,
                            inner_algorithm)[0]

    def _sparse(self, inner: str, groups: Sequence[Sequence[int]], k: float,
                index_bytes: float, value_bytes: float, inner_algorithm: str
                ) -> tuple[Seconds, float]:
        """``inner`` run by every group at once, ``k`` pairs per member; also the bytes
        of the result it leaves on every member."""
        g, s = len(groups[0]), index_bytes + value_bytes
        times = len(groups)
        if inner == "allgather":
            return self.rounds(groups, [_ring(g, [k * s] * g, False)] * times), g * k * s
        if inner == "gtopk":
            return self.rounds(groups, [_butterfly(g, k * s)] * times), k * s
        if inner == "artopk":
            out = self.rounds(groups, [_binomial(g, k * index_bytes)] * times)
            pattern, red = _pattern("allreduce", inner_algorithm, k * value_bytes, g)
            return out + self.rounds(groups, [pattern] * times) + self._gamma(red), k * s
        raise ValueError(f"inner must be one of {SPARSE_INNER}, got {inner!r}")


def _pairs(bounds: Sequence[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:]))


def _pattern(collective: str, algorithm: str, n: float, p: int) -> tuple[Rounds, float]:
    """The rounds of a flat algorithm over ``p`` ranks and the bytes it reduces."""
    p2, rem = fold_layout(p)
    lg2 = int(math.log2(p2))
    if collective == "allreduce":
        if algorithm == "ring":
            ring = _ring(p, [n / p] * p, True)
            return ring + ring, (p - 1) / p * n
        if algorithm == "recursive_doubling":
            return _butterfly(p, n), (lg2 + (1 if rem else 0)) * n
        if algorithm == "rabenseifner":
            return _halving(p, n), (p2 - 1) / p2 * n + (n if rem else 0)
    if collective in ("allgather", "allgatherv"):
        if algorithm in ("ring", "direct"):
            return _ring(p, [n / p] * p, False), 0.0
        if algorithm == "bruck":
            out: Rounds = []
            held, dist = 1, 1
            while dist < p:
                count = min(dist, p - held)
                out.append(([(r, (r - dist) % p, count * n / p) for r in range(p)], 1))
                held, dist = held + count, dist << 1
            return out, 0.0
        if algorithm == "recursive_doubling":  # ranges double; (p-1)/p·n in all
            unit = (p - 1) / p * n / max(p2 - 1, 1)
            steps = [(1 << i, (1 << i) * unit) for i in range(lg2)]
            return _fold(p, n / p, False) + _xor(p, steps) + _fold(p, n, True), 0.0
    if collective == "broadcast" and algorithm == "binomial":
        return _binomial(p, n), 0.0
    if collective == "reduce_scatter" and algorithm in ("ring", "direct"):
        return _ring(p, [n / p] * p, True), (p - 1) / p * n
    raise ValueError(f"no host model for {collective} algorithm {algorithm!r}")


#: Collective -> the algorithms :meth:`HostCosts.flat` prices round by round.
HOST_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "recursive_doubling", "rabenseifner"),
    "allgather": ("ring", "bruck", "recursive_doubling", "direct"),
    "allgatherv": ("ring", "direct"),
    "broadcast": ("binomial",),
    "reduce_scatter": ("ring", "direct"),
}


def host_costs(comm: Any, params: CostParams | None = None,
               topology: Topology | None = None, local: CostParams | None = None
               ) -> HostCosts:
    """The two link classes of ``comm``'s layout: ``network`` = ``params`` or the
    calibrated ``cost_params`` (the slowest link, between hosts when there are several),
    ``local`` = ``local`` or the calibrated ``host_cost_params``, else the network's on
    one host and the shared-memory defaults of :class:`CostParams` on several."""
    resources = getattr(comm, "resources", {}) if comm is not None else {}
    topo = topology if topology is not None else comm.topology
    network = params or resources.get("cost_params") or CostParams()
    if local is None:
        local = resources.get("host_cost_params") or \
            (network if topo.num_hosts == 1 else CostParams())
    return HostCosts(topo, local, network)
