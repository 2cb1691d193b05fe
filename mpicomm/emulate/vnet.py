r"""The virtual network's platform: hosts, links, latency and a schedule of changes.

A *platform* describes the cluster that the virtual clock (:mod:`mpicomm.clock`)
simulates under a plain ``mpiexec`` on one machine:

* ``H`` hosts; world rank ``r`` lives on host ``r // R`` (``R`` ranks per host) or, with
  ``MPICOMM_HOST_SIZES=2,2,1``, on consecutive hosts of the given sizes (uneven hosts);
* every host has one **upload** and one **download** link of ``rate`` bytes/s (full
  duplex, as a NIC on a switch), and messages between hosts take a one-way **latency**
  ``delay`` on top of their transmission; with ``MPICOMM_HOST_NICS=N`` a host has ``N``
  such NICs and its local rank ``j`` sends and receives through NIC ``j mod N`` (``N`` at
  least the ranks per host: one NIC per rank, as on GPU servers with a NIC per GPU);
* ranks of one host exchange through **shared memory** at ``shm_rate`` bytes/s with a
  latency of ``shm_delay`` and use no link;
* a **schedule** (the emulated cluster's ``--schedule`` format,
  :mod:`mpicomm.emulate.schedule`) changes rate and delay at virtual times or training
  steps.

The time of one message of ``n`` bytes from host ``a`` to host ``b`` sent at virtual
time ``t`` under the conditions ``(rate, delay)`` in force at ``t``:

* upload: a serial resource; it starts at ``u0 = max(t, free_up[a])`` and ends at
  ``u1 = u0 + n / rate`` (messages queue behind each other);
* download: the message reaches ``b``'s link from ``u0 + delay`` (cut-through) and
  needs ``n / rate`` of that link's free time; it has fully arrived at
  ``max(end of that, u1 + delay)``.

Without contention that is ``t + delay + n / rate``: the alpha-beta cost with
``alpha = delay`` and ``beta = 1 / rate``. Between ranks of one host:
``t + shm_delay + n / shm_rate``, with no queueing.

**Framing** (optional, off by default): a real link also carries each frame's headers,
and a rate limiter such as tc's counts them against the rate. With a framing of ``p``
payload and ``h`` header bytes per frame, a message of ``n`` bytes between hosts
occupies the links for ``w(n) = n + h·max(1, ceil(n / p))`` bytes, i.e. ``beta`` grows
by ``(p + h) / p`` for large messages. ``tcp`` is TCP/IPv4 over Ethernet at an MTU of
1 500 bytes with TCP timestamps: 1 448 payload bytes and 66 header bytes (Ethernet 14,
IPv4 20, TCP 32) per frame, 4.6% on top of the payload. Use it to compare with the
tc-shaped emulated cluster (its rate counts those headers) or with a real Ethernet
network; leave it off to compare with the plain alpha-beta formula.

This module holds the pure parts (no MPI): the platform and its environment parsing,
the schedule's conditions at a time or step, and the two link disciplines
(:class:`FifoLink` in virtual-time order, :class:`GapLink` for a receiver that learns
of its messages in program order). :mod:`mpicomm.emulate.vengine` resolves the links
across processes.

Environment (read by :func:`platform_from_env`)::

    MPICOMM_VIRTUAL_RATE            link rate per host and direction, tc units
                                    (100mbit, 1gbit, 10gbit)
    MPICOMM_VIRTUAL_DELAY           one-way latency between hosts (1ms, 50us, 0)
    MPICOMM_VIRTUAL_RANKS_PER_HOST  R (default 1); MPICOMM_HOST_SIZES overrides it
    MPICOMM_HOST_SIZES              consecutive ranks per host, e.g. 2,2,1
    MPICOMM_HOST_NICS               network ports (NICs) per host (default 1)
    MPICOMM_VIRTUAL_SCHEDULE        a schedule file (TIME|step N  RATE  DELAY lines)
    MPICOMM_VIRTUAL_SHM_RATE        shared-memory rate (default 80gbit = 10 GB/s)
    MPICOMM_VIRTUAL_SHM_DELAY       shared-memory latency (default 1us)
    MPICOMM_VIRTUAL_FRAMING         none (default), tcp, or PAYLOAD,HEADER bytes per
                                    frame on the links between hosts
    MPICOMM_VIRTUAL_STALL_S         real seconds a waiting rank tolerates no progress
                                    before the job is declared stuck (default 120;
                                    read by :func:`stall_seconds_from_env`)
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .netns import parse_rate
from .schedule import Entry, parse_delay, read_schedule

__all__ = ["Platform", "platform_from_env", "host_layout", "parse_host_sizes", "FifoLink",
           "GapLink", "ENV_HOST_NICS", "parse_nics", "port_layout",
           "ENV_RATE", "ENV_DELAY", "ENV_RANKS_PER_HOST", "ENV_HOST_SIZES", "ENV_SCHEDULE",
           "ENV_SHM_RATE", "ENV_SHM_DELAY", "DEFAULT_SHM_RATE", "DEFAULT_SHM_DELAY",
           "ENV_STALL_S", "DEFAULT_STALL_S", "stall_seconds_from_env", "ENV_FRAMING",
           "FRAMINGS", "parse_framing"]

ENV_RATE = "MPICOMM_VIRTUAL_RATE"
ENV_DELAY = "MPICOMM_VIRTUAL_DELAY"
ENV_RANKS_PER_HOST = "MPICOMM_VIRTUAL_RANKS_PER_HOST"
ENV_HOST_SIZES = "MPICOMM_HOST_SIZES"
ENV_HOST_NICS = "MPICOMM_HOST_NICS"
ENV_SCHEDULE = "MPICOMM_VIRTUAL_SCHEDULE"
ENV_SHM_RATE = "MPICOMM_VIRTUAL_SHM_RATE"
ENV_SHM_DELAY = "MPICOMM_VIRTUAL_SHM_DELAY"
ENV_STALL_S = "MPICOMM_VIRTUAL_STALL_S"
ENV_FRAMING = "MPICOMM_VIRTUAL_FRAMING"

#: Named framings: (payload bytes, header bytes) per frame; ``(0, 0)`` is none.
FRAMINGS: dict[str, tuple[int, int]] = {"none": (0, 0), "tcp": (1448, 66)}

#: Shared memory between ranks of one host: 10 GB/s and 1 us (a memcpy-bound MPI
#: transport on one socket); set MPICOMM_VIRTUAL_SHM_RATE/_DELAY to model another.
DEFAULT_SHM_RATE = "80gbit"
DEFAULT_SHM_DELAY = "1us"
#: Real seconds a rank may wait with no virtual progress before the job is declared
#: stuck (a thread blocked outside mpicomm holds virtual time back).
DEFAULT_STALL_S = 120.0


@dataclass(frozen=True)
class Platform:
    """A virtual cluster (see the module docstring). Rates are in bytes per second."""

    rate: float
    delay: float
    hosts: tuple[int, ...]
    shm_rate: float = parse_rate(DEFAULT_SHM_RATE) / 8
    shm_delay: float = parse_delay(DEFAULT_SHM_DELAY)
    schedule: tuple[Entry, ...] = ()
    #: (payload, header) bytes per frame on the links between hosts; (0, 0): none
    framing: tuple[int, int] = (0, 0)
    #: network ports per host (local rank j uses port j mod nics)
    nics: int = 1
    #: time entries sorted by time, step entries by step (see :meth:`conditions`)
    _times: tuple[float, ...] = field(default=(), repr=False, compare=False)
    _steps: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("rate", "shm_rate"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"virtual platform: {name} must be a finite rate > 0, "
                                 f"got {value}")
        for name in ("delay", "shm_delay"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"virtual platform: {name} must be >= 0, got {value}")
        if not self.hosts:
            raise ValueError("virtual platform: no ranks")
        if isinstance(self.nics, bool) or not isinstance(self.nics, int) or self.nics < 1:
            raise ValueError(f"virtual platform: nics must be an integer >= 1, got "
                             f"{self.nics!r}")
        payload, header = self.framing
        if (payload, header) != (0, 0) and not (payload >= 1 and header >= 0):
            raise ValueError(f"virtual platform: framing needs payload >= 1 and header >= 0 "
                             f"bytes per frame, got {self.framing}")
        times = tuple(e for e in self.schedule if e.kind == "time")
        steps = tuple(e for e in self.schedule if e.kind == "step")
        object.__setattr__(self, "schedule", tuple(sorted(times, key=lambda e: e.at))
                           + tuple(sorted(steps, key=lambda e: e.at)))
        object.__setattr__(self, "_times", tuple(e.at for e in self.schedule
                                                 if e.kind == "time"))
        object.__setattr__(self, "_steps", tuple(e.at for e in self.schedule
                                                 if e.kind == "step"))

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.hosts)

    @property
    def num_hosts(self) -> int:
        return max(self.hosts) + 1

    @cached_property
    def ports(self) -> tuple[int, ...]:
        """The network port (NIC) of every rank, numbered 0.. across hosts
        (:func:`port_layout`); with one NIC per host, the host."""
        return port_layout(self.hosts, self.nics)

    @property
    def num_ports(self) -> int:
        return max(self.ports) + 1

    @cached_property
    def _port_members(self) -> tuple[tuple[int, ...], ...]:
        members: list[list[int]] = [[] for _ in range(max(self.ports) + 1)]
        for r, q in enumerate(self.ports):
            members[q].append(r)
        return tuple(tuple(m) for m in members)

    def ranks_on_port(self, port: int) -> tuple[int, ...]:
        """The ranks that send and receive through ``port``, in rank order (computed
        once: the virtual clock's link resolution asks for them on every pass)."""
        return self._port_members[port]

    def conditions(self, t: float, step: int = -1) -> tuple[float, float]:
        """``(rate, delay)`` in force at virtual time ``t`` once step ``step`` has been
        reported: the last step entry with ``at <= step`` if there is one, else the last
        time entry with ``at <= t``, else the platform's own rate and delay. (A step
        entry overrides time entries from the step on; a job that counts its steps
        again from 0 gets the earlier conditions back.)"""
        n_time = len(self._times)
        if self._steps:
            i = bisect.bisect_right(self._steps, step)
            if i:
                e = self.schedule[n_time + i - 1]
                return e.rate_bits / 8, e.delay
        i = bisect.bisect_right(self._times, t)
        if i:
            e = self.schedule[i - 1]
            return e.rate_bits / 8, e.delay
        return self.rate, self.delay

    def wire_bytes(self, nbytes: float) -> float:
        """Bytes a message of ``nbytes`` occupies on a link between hosts: ``nbytes``
        plus one header per started frame (at least one) under a framing, else
        ``nbytes``. Cost: O(1)."""
        payload, header = self.framing
        if not payload:
            return nbytes
        return nbytes + header * max(1, math.ceil(nbytes / payload))

    def wire_factor(self) -> float:
        """``(payload + header) / payload``: what framing multiplies ``beta`` by for
        large messages (1 without framing)."""
        payload, header = self.framing
        return (payload + header) / payload if payload else 1.0

    def min_delay(self) -> float:
        """The smallest one-way latency between hosts that the schedule can give: the
        lookahead of the conservative synchronisation (no message between hosts
        arrives sooner than this after it is sent)."""
        return min([self.delay] + [e.delay for e in self.schedule])

    def describe(self) -> dict:
        """A JSON-ready description (recorded in results)."""
        sizes = [self.hosts.count(h) for h in range(self.num_hosts)]
        return {
            "rate_bits": self.rate * 8, "delay_s": self.delay, "hosts": self.num_hosts,
            "host_sizes": sizes, "nics_per_host": self.nics,
            "shm_rate_bits": self.shm_rate * 8,
            "shm_delay_s": self.shm_delay,
            "framing": {"payload_bytes": self.framing[0], "header_bytes": self.framing[1]},
            "schedule": [{"kind": e.kind, "at": e.at, "rate_bits": e.rate_bits,
                          "delay_s": e.delay} for e in self.schedule],
        }


def parse_host_sizes(text: str, size: int, name: str = ENV_HOST_SIZES) -> list[int]:
    """The host sizes ``text`` gives (``"2,2,1"``: consecutive ranks per host) for a job
    of ``size`` ranks.

    ``ValueError`` naming ``name`` when ``text`` is not a list of positive integers or
    does not add up to ``size`` (every rank reads the same value, so every rank raises).
    """
    try:
        sizes = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected comma-separated positive integers "
                         "such as 2,2,1 (ranks per host, consecutive ranks)") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"{name}={text!r}: every host needs at least one rank")
    if sum(sizes) != size:
        raise ValueError(f"{name}={text!r} places {sum(sizes)} ranks on {len(sizes)} "
                         f"hosts but the job has {size} ranks; the sizes must add up to "
                         "the number of ranks")
    return sizes


def parse_nics(text: str | None, name: str = ENV_HOST_NICS) -> int:
    """Network ports per host from ``text`` (empty or None: 1); ``ValueError`` naming
    ``name`` unless it is an integer >= 1."""
    text = "" if text is None else str(text).strip()
    if not text:
        return 1
    try:
        nics = int(text)
    except ValueError:
        nics = 0
    if nics < 1:
        raise ValueError(f"{name}={text!r}: expected the number of network ports per host, "
                         "an integer >= 1")
    return nics


def port_layout(hosts: Sequence[int], nics: int) -> tuple[int, ...]:
    """The network port of every rank when each host has ``nics`` ports and its local
    rank ``j`` (its ``j``-th rank in rank order) uses port ``j mod nics``. Ports are
    numbered 0, 1, ... in order of first appearance, so with ``nics = 1`` the port is the
    host. Cost: O(P)."""
    seen: dict[int, int] = {}
    numbers: dict[tuple[int, int], int] = {}
    out = []
    for h in hosts:
        j = seen.get(h, 0)
        seen[h] = j + 1
        out.append(numbers.setdefault((h, j % nics), len(numbers)))
    return tuple(out)


def host_layout(size: int, ranks_per_host: str | int | None = None,
                host_sizes: str | None = None) -> tuple[int, ...]:
    """The host of every one of ``size`` ranks.

    ``host_sizes`` (``"2,2,1"``: consecutive ranks per host, :func:`parse_host_sizes`)
    wins over ``ranks_per_host`` (``R``: rank ``r`` on host ``r // R``; ``size`` must be
    a multiple of ``R``). ``ValueError`` with the reason when the layout does not cover
    the ranks.
    """
    if host_sizes is not None and str(host_sizes).strip():
        sizes = parse_host_sizes(str(host_sizes), size)
        return tuple(h for h, s in enumerate(sizes) for _ in range(s))
    text = "1" if ranks_per_host is None or str(ranks_per_host).strip() == "" \
        else str(ranks_per_host)
    try:
        per_host = int(text)
    except ValueError:
        raise ValueError(f"{ENV_RANKS_PER_HOST}={text!r}: expected an integer >= 1") from None
    if per_host < 1:
        raise ValueError(f"{ENV_RANKS_PER_HOST} must be >= 1, got {per_host}")
    if size % per_host:
        raise ValueError(f"{size} ranks cannot be placed {per_host} per host "
                         f"({ENV_RANKS_PER_HOST}={per_host}); use a multiple of {per_host} "
                         f"ranks or {ENV_HOST_SIZES} for uneven hosts")
    return tuple(r // per_host for r in range(size))


def _rate(name: str, text: str) -> float:
    if str(text).strip() in ("0", "0bit", "0mbit", "0gbit", "0kbit"):
        raise ValueError(f"{name}={text!r}: a rate must be > 0")
    try:
        return parse_rate(text) / 8
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _delay(name: str, text: str) -> float:
    try:
        return parse_delay(text)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def parse_framing(text: str) -> tuple[int, int]:
    """``(payload, header)`` bytes per frame for ``none``, ``tcp`` (:data:`FRAMINGS`) or
    ``PAYLOAD,HEADER`` (e.g. ``8948,66`` for jumbo frames); ``ValueError`` otherwise."""
    key = str(text).strip().lower()
    if key in FRAMINGS:
        return FRAMINGS[key]
    try:
        payload, header = (int(v) for v in key.split(","))
    except ValueError:
        payload = header = -1
    if payload < 1 or header < 0:
        raise ValueError(f"{ENV_FRAMING}={text!r}: expected none, tcp or PAYLOAD,HEADER "
                         "(bytes per frame, PAYLOAD >= 1, HEADER >= 0)")
    return payload, header


def platform_from_env(size: int, env: Mapping[str, str] | None = None) -> Platform:
    """The platform of a job of ``size`` ranks from the ``MPICOMM_VIRTUAL_*`` variables.

    ``MPICOMM_VIRTUAL_RATE`` is required unless the schedule has an entry at time 0
    (which then gives the starting conditions). Every problem raises one ``ValueError``
    naming the variable: an unparsable or zero rate, a bad delay, a layout that does not
    cover the ranks, an unreadable or empty schedule.
    """
    env = os.environ if env is None else env
    schedule: tuple[Entry, ...] = ()
    path = env.get(ENV_SCHEDULE, "").strip()
    if path:
        try:
            schedule = tuple(read_schedule(path))
        except ValueError as exc:
            raise ValueError(f"{ENV_SCHEDULE}: {exc}") from None
        for e in schedule:
            if not e.rate_bits > 0:
                raise ValueError(f"{ENV_SCHEDULE}: {path}:{e.line}: a rate must be > 0")
    rate_text = env.get(ENV_RATE, "").strip()
    start = [e for e in schedule if e.kind == "time" and e.at == 0]
    if rate_text:
        rate = _rate(ENV_RATE, rate_text)
    elif start:
        rate = start[-1].rate_bits / 8
    else:
        raise ValueError(f"virtual clock: set {ENV_RATE} (e.g. 1gbit), or give "
                         f"{ENV_SCHEDULE} an entry at time 0")
    delay_text = env.get(ENV_DELAY, "").strip()
    if delay_text:
        delay = _delay(ENV_DELAY, delay_text)
    else:
        delay = start[-1].delay if start else 0.0
    hosts = host_layout(size, env.get(ENV_RANKS_PER_HOST), env.get(ENV_HOST_SIZES))
    shm_rate = _rate(ENV_SHM_RATE, env.get(ENV_SHM_RATE, "").strip() or DEFAULT_SHM_RATE)
    shm_delay = _delay(ENV_SHM_DELAY, env.get(ENV_SHM_DELAY, "").strip() or DEFAULT_SHM_DELAY)
    framing = parse_framing(env.get(ENV_FRAMING, "").strip() or "none")
    nics = parse_nics(env.get(ENV_HOST_NICS))
    return Platform(rate, delay, hosts, shm_rate, shm_delay, schedule, framing, nics)


def stall_seconds_from_env(env: Mapping[str, str] | None = None) -> float:
    """Real seconds of no progress after which a waiting rank ends a virtual-clock job
    (``MPICOMM_VIRTUAL_STALL_S``, default :data:`DEFAULT_STALL_S`).

    The guard turns a hang (a thread blocked in a raw MPI call never advances its
    virtual time) into an error naming the ranks that hold time back. On a heavily
    oversubscribed machine a rank can go without CPU for a long time while nothing is
    wrong: raise it there (for example 600 for 32 ranks on 2 cores). ``ValueError``
    unless it is a number > 0.
    """
    env = os.environ if env is None else env
    text = env.get(ENV_STALL_S, "").strip()
    if not text:
        return DEFAULT_STALL_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{ENV_STALL_S} must be a number of seconds > 0, got {text!r}")
    return value


class FifoLink:
    """A serial link served in the order messages are offered (which the caller makes
    virtual-time order): a message offered at ``key`` starts at ``max(key, free)``."""

    __slots__ = ("free",)

    def __init__(self, free: float = 0.0):
        self.free = free

    def transmit(self, key: float, seconds: float) -> tuple[float, float]:
        start = max(key, self.free)
        self.free = start + seconds
        return start, self.free


class GapLink:
    """A serial link whose messages are learnt in an order other than their times (a
    receiver completes its receives in program order): each message takes ``seconds``
    of the link's *free* time from ``key`` on, filling gaps that earlier-learnt but
    later-timed messages left (preemptive, work-conserving). The busy time of the link
    is then the same whatever the order the messages are learnt in; only which message
    gets which slice depends on it. ``limit`` bounds the busy intervals kept (the
    oldest are forgotten, as if busy)."""

    __slots__ = ("starts", "ends", "limit")

    def __init__(self, limit: int = 4096):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.limit = limit

    def fill(self, key: float, seconds: float) -> float:
        """Occupy ``seconds`` of free time from ``key`` on; returns when that ends."""
        starts, ends = self.starts, self.ends
        if seconds <= 0:
            return key
        i = bisect.bisect_right(ends, key)   # first interval ending after key
        t, left = key, seconds
        new: list[tuple[float, float]] = []
        while left > 0:
            if i < len(starts) and starts[i] <= t:
                t = max(t, ends[i])
                i += 1
                continue
            gap_end = starts[i] if i < len(starts) else float("inf")
            take = min(left, gap_end - t)
            new.append((t, t + take))
            left -= take
            t += take
        for a, b in new:
            self._insert(a, b)
        return t

    def _insert(self, a: float, b: float) -> None:
        starts, ends = self.starts, self.ends
        i = bisect.bisect_left(ends, a)
        j = i
        while j < len(starts) and starts[j] <= b:
            a, b = min(a, starts[j]), max(b, ends[j])
            j += 1
        starts[i:j] = [a]
        ends[i:j] = [b]
        if len(starts) > self.limit:
            drop = len(starts) - self.limit
            # forget the oldest: merge them into one busy block
            starts[:drop + 1] = [starts[0]]
            ends[:drop + 1] = [ends[drop]]

    def busy(self) -> Sequence[tuple[float, float]]:
        return list(zip(self.starts, self.ends))
