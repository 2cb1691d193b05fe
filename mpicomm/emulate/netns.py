"""Hosts as Linux network namespaces joined by ``tc``-shaped veth links to a bridge.

Layout of one run (``P`` = the emulator's process id, so concurrent runs never collide)::

    netns mpcemu<P>-sw    bridge br0, one veth end per host (egress shaped: host download)
    netns mpcemu<P>-h<i>  lo + eth0 = 10.77.<i // 250>.<i % 250 + 1>/16
                          (egress shaped: host upload)

A host with several network ports (``emulated-cluster --nics-per-host``) is several such
namespaces, one per port (:mod:`mpicomm.emulate.run`); here each is a "host" of its own.

Nothing is created in the caller's namespace except, for a moment, the veth pairs
(``me<P>a<i>``/``me<P>b<i>``) before they are moved into their namespaces, so the
traffic of a run stays inside the namespaces it created. :meth:`Cluster.teardown`
deletes the namespaces (which deletes the veths in them), kills whatever still runs in
them, and removes a leftover veth of an interrupted set-up; it is idempotent and is
called on every exit path of :mod:`mpicomm.emulate.run`.

Shaping: a ``tbf`` qdisc on both ends of each host's link (upload and download), rate
``RATE``, bucket :func:`burst_bytes` (1 ms at the rate, at least 128 KiB so that
offloaded 64 KiB segments pass whole), queue allowance 50 ms. The bucket lets a burst
of that many bytes through at the veth's speed: a message shorter than it, sent after
an idle moment, crosses faster than ``RATE`` (an 80 KB message at 100 Mbit/s: about
1 ms instead of 6.4 ms). ``Cluster(..., burst=BYTES)`` (``emulated-cluster --burst``)
sets a smaller bucket, down to :data:`MIN_BURST` (``tbf`` splits offloaded segments
larger than the bucket), for a link that serialises every byte at ``RATE`` as a real
NIC does and as the virtual clock's network model assumes. ``Cluster(..., queue=S)``
(``emulated-cluster --queue``) sets the queue allowance. It matters when both
directions of a link are busy at once (an allgather or allreduce between two hosts):
each host's acknowledgements of the data it receives wait behind the data it sends,
which holds back the other side's TCP window. With 50 ms of queue a 2 MB exchange at
100 Mbit/s took 195-199 ms, with 5 ms (the target of Linux's default ``fq_codel``)
179-182 ms, against 168 ms of line time; a one-way transfer is the same with either.
``Cluster(..., ack_priority=True)`` (``emulated-cluster --ack-priority``) shapes with
``htb`` instead and sends small packets (acknowledgements) ahead of the data queue
(:meth:`Cluster._shape_ack_first`), so a long queue no longer holds back the other side's
window. ``tc qdisc change`` (``tc class change``) updates the rate while a job runs. This
kernel has no ``netem``, so latency is not added here (see
:mod:`mpicomm.emulate.linkdelay`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Cluster", "NetnsUnavailable", "parse_rate", "burst_bytes", "probe", "PREFIX",
           "leftover_namespaces", "remove_stale", "QUEUE_S"]

PREFIX = "mpcemu"
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
#: tbf's queue allowance (its ``latency``) in seconds: how long a packet may wait.
QUEUE_S = 0.05
#: Smallest data queue of the acknowledgement-first shaping, bytes: two 64 KiB segments.
MIN_DATA_QUEUE = 2 * 65536
#: Guaranteed share of the rate for the small-packet class of the acknowledgement-first
#: shaping; either class may borrow up to the whole rate.
ACK_SHARE = 0.05


class NetnsUnavailable(RuntimeError):
    """Namespaces, veth or tc cannot be used here (not root, no iproute2, no permission)."""


def parse_rate(text: str) -> float:
    """``"100mbit"``, ``"1gbit"``, ``"25gbit"``, ``"500kbit"`` -> bits per second
    (``tc``'s units; ``...bps`` suffixes are bytes per second). ``ValueError`` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"bad rate {text!r}: give a number and one of "
                         f"{', '.join(_RATE_UNITS)} (e.g. 100mbit, 1gbit)")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if bits < 8e3:
        raise ValueError(f"rate {text!r} is below 8kbit")
    return bits


#: Smallest ``--burst``: two full Ethernet frames (a bucket below one frame drops it).
MIN_BURST = 2 * 1514


def burst_bytes(rate_bits: float, burst: int | None = None) -> int:
    """Token bucket size: ``burst`` when given (checked against :data:`MIN_BURST`), else
    1 ms worth of the rate, at least 128 KiB."""
    if burst is not None:
        if not isinstance(burst, int) or isinstance(burst, bool) or burst < MIN_BURST:
            raise ValueError(f"burst must be an integer >= {MIN_BURST} bytes, got {burst!r}")
        return burst
    return max(128 * 1024, int(rate_bits / 8 * 1e-3))


def _tc_time(seconds: float) -> str:
    return f"{round(seconds * 1e6)}us"


def _tc_rate(rate_bits: float) -> str:
    return f"{int(rate_bits)}bit"


def _ip_tool() -> str:
    ip = shutil.which("ip")
    if ip is None or shutil.which("tc") is None:
        raise NetnsUnavailable(
            "iproute2 (ip, tc) is not installed; as root: apt-get update && "
            "apt-get install -y iproute2")
    return ip


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def probe() -> str | None:
    """``None`` when namespaces + veth + tbf work here, else the reason they do not."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc)"
    try:
        ip = _ip_tool()
    except NetnsUnavailable as exc:
        return str(exc)
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run([ip, "netns", "add", name])
    except NetnsUnavailable as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run([ip, "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate",
              "100mbit", "burst", "131072", "latency", _tc_time(QUEUE_S)])
    except NetnsUnavailable as exc:
        return f"veth/tbf unavailable: {exc}"
    finally:
        _run([ip, "netns", "del", name], check=False)
    return None


def leftover_namespaces(owner: int) -> list[str]:
    """Namespaces of the run started by process ``owner`` that still exist."""
    ip = shutil.which("ip")
    if ip is None:
        return []
    out = _run([ip, "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}{owner}-")]


def remove_stale() -> list[str]:
    """Delete the namespaces (and run folders) of emulator runs whose process is gone:
    what a ``kill -9`` of the launcher leaves behind. Runs of live processes are never
    touched. Returns the names removed."""
    import glob
    import tempfile

    ip = shutil.which("ip")
    if ip is None:
        return []
    out = _run([ip, "netns", "list"], check=False).stdout
    removed = []
    for line in out.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            for pid in _run([ip, "netns", "pids", m.group(1)], check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run([ip, "netns", "del", m.group(1)], check=False)
            removed.append(m.group(1))
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}*-sw-*")):
        m = re.match(rf"{PREFIX}(\d+)-", os.path.basename(folder))
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            shutil.rmtree(folder, ignore_errors=True)
    return removed


@dataclass
class Cluster:
    """``hosts`` namespaces on one bridge, each link shaped to ``rate_bits``."""

    hosts: int
    rate_bits: float | None
    burst: int | None = None
    queue: float = QUEUE_S
    #: Shape with ``htb`` and send small packets (pure acknowledgements) ahead of data
    #: instead of one ``tbf`` queue; see :meth:`_shape_ack_first`.
    ack_priority: bool = False
    owner: int = field(default_factory=os.getpid)
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.hosts > 1000:
            raise ValueError(f"--hosts must be in [1, 1000], got {self.hosts}")
        burst_bytes(1e8, self.burst)            # a bad burst fails before any set-up
        self.check_queue(self.queue)
        self.ip = _ip_tool()

    @staticmethod
    def check_queue(seconds: float) -> None:
        """``ValueError`` unless a queue allowance of ``seconds`` is in [1 us, 10 s]."""
        if not 1e-6 <= seconds <= 10:
            raise ValueError(f"--queue must be between 1us and 10s, got {seconds:g} s")

    # names
    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.owner}-sw"

    def host(self, i: int) -> str:
        return f"{PREFIX}{self.owner}-h{i}"

    def address(self, i: int) -> str:
        return f"10.77.{i // 250}.{i % 250 + 1}"

    def _veth(self, i: int, end: str) -> str:
        return f"me{self.owner}{end}{i}"

    # set-up
    def _netns(self, name: str) -> None:
        _run([self.ip, "netns", "add", name])
        self.created.append(name)
        _run([self.ip, "-n", name, "link", "set", "lo", "up"])

    def setup(self) -> None:
        """Create the namespaces, links and qdiscs; on failure undo what was made."""
        try:
            self._netns(self.switch)
            ip_sw = [self.ip, "-n", self.switch]
            _run([*ip_sw, "link", "add", "br0", "type", "bridge"])
            _run([*ip_sw, "link", "set", "br0", "up"])
            for i in range(self.hosts):
                self._netns(self.host(i))
                a, b = self._veth(i, "a"), self._veth(i, "b")
                _run([self.ip, "link", "add", a, "type", "veth", "peer", "name", b])
                _run([self.ip, "link", "set", a, "netns", self.host(i)])
                _run([self.ip, "link", "set", b, "netns", self.switch])
                ip_h = [self.ip, "-n", self.host(i)]
                _run([*ip_h, "link", "set", a, "name", "eth0"])
                _run([*ip_h, "addr", "add", f"{self.address(i)}/16", "dev", "eth0"])
                _run([*ip_h, "link", "set", "eth0", "up"])
                _run([*ip_sw, "link", "set", b, "master", "br0"])
                _run([*ip_sw, "link", "set", b, "up"])
                if self.rate_bits is not None:
                    for ns, dev in self.links(i):
                        self._shape("add", ns, dev, self.rate_bits)
        except BaseException:
            self.teardown()
            raise

    def links(self, i: int) -> list[tuple[str, str]]:
        """(namespace, device) of both shaped ends of host ``i``'s link."""
        return [(self.host(i), "eth0"), (self.switch, self._veth(i, "b"))]

    def _shape(self, verb: str, ns: str, dev: str, rate_bits: float) -> None:
        """Shape one end of a link (``verb``: ``add``, or ``change`` for a new rate)."""
        if self.ack_priority:
            self._shape_ack_first(verb, ns, dev, rate_bits)
        else:
            self._tbf(verb, ns, dev, rate_bits)

    def _tbf(self, verb: str, ns: str, dev: str, rate_bits: float) -> None:
        _run(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf",
              "rate", _tc_rate(rate_bits), "burst", str(burst_bytes(rate_bits, self.burst)),
              "latency", _tc_time(self.queue)])

    def queue_bytes(self, rate_bits: float) -> int:
        """The data queue of :meth:`_shape_ack_first` in bytes: ``queue`` at the rate, at
        least :data:`MIN_DATA_QUEUE` (two offloaded 64 KiB segments, which a shorter
        byte queue would drop every time)."""
        return max(MIN_DATA_QUEUE, int(self.queue * rate_bits / 8))

    def _shape_ack_first(self, verb: str, ns: str, dev: str, rate_bits: float) -> None:
        """``htb`` at ``rate_bits`` with two classes that share it: packets of fewer than
        128 IP bytes (acknowledgements, small control messages; an ``u32`` filter on the
        IP total length) go first, everything else waits in a byte FIFO of
        :meth:`queue_bytes`. A host's own acknowledgements then never queue behind the
        data it sends, as with Linux's default ``fq_codel``, which keeps each flow in
        its own queue (not available on this kernel). With one ``tbf`` queue, an
        exchange in both directions at once delays each side's acknowledgements by the
        queue's length, which throttles the other side's TCP window; a short queue
        avoids that but drops bursts. Measured at 100 Mbit/s, 4 hosts, 20 ms queue,
        eager sends: two rounds of 40 MB each way (partners r XOR 1, then r XOR 2) 1.06x
        the line time, against 1.36x with one ``tbf`` queue of 20 ms; 80 KB each way
        1.03x, against 1.67x with ``tbf`` and 5 ms."""
        tc = ["tc", "-n", ns]
        if verb == "add":
            _run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                  "default", "20"])
        burst = str(burst_bytes(rate_bits, self.burst))
        for classid, parent, share, prio in (("1:1", "1:", 1.0, None),
                                             ("1:10", "1:1", ACK_SHARE, "0"),
                                             ("1:20", "1:1", 1 - ACK_SHARE, "1")):
            cmd = [*tc, "class", verb, "dev", dev, "parent", parent, "classid", classid,
                   "htb", "rate", _tc_rate(rate_bits * share), "ceil", _tc_rate(rate_bits),
                   "burst", burst, "cburst", burst, "quantum", "1514"]
            _run(cmd + (["prio", prio] if prio is not None else []))
        limit = ["bfifo", "limit", str(self.queue_bytes(rate_bits))]
        if verb == "add":
            _run([*tc, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:",
                  "pfifo", "limit", "1000"])
            _run([*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:",
                  *limit])
            _run([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                  "prio", "1", "u32", "match", "u16", "0x0000", "0xff80", "at", "2",
                  "flowid", "1:10"])
        else:
            _run([*tc, "qdisc", "change", "dev", dev, "parent", "1:20", "handle", "20:",
                  *limit])

    def set_rate(self, rate_bits: float) -> None:
        """Change every link's rate now (``tc qdisc change``; adds the qdisc when the run
        started unshaped)."""
        verb = "add" if self.rate_bits is None else "change"
        for i in range(self.hosts):
            for ns, dev in self.links(i):
                self._shape(verb, ns, dev, rate_bits)
        self.rate_bits = rate_bits

    # teardown
    def teardown(self) -> None:
        """Kill what still runs in the namespaces, delete them and stray veths."""
        for name in list(self.created):
            pids = _run([self.ip, "netns", "pids", name], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for name in reversed(self.created):
            _run([self.ip, "netns", "del", name], check=False)
        self.created.clear()
        for i in range(self.hosts):
            a = self._veth(i, "a")
            if _run([self.ip, "link", "show", a], check=False).returncode == 0:
                _run([self.ip, "link", "del", a], check=False)
