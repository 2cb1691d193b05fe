"""The emulated network link: the one mechanism that slows mpicomm's own messages down.

mpicomm's point-to-point layer (:mod:`mpicomm.p2p`: the collectives' ``Ctx``, the
sparse layer's ``Wire``, the parameter server's byte messages) calls
:meth:`LinkDelay.before_send` before handing a message for another (emulated) host to
MPI and :meth:`LinkDelay.after_receive` when it receives. Before such a message the
sender sleeps

    latency (once per burst)  +  alpha + beta * nbytes (every message)

so a message reaches the wire that much later. Two ways to switch it on:

* **the emulated cluster** (``launchers/emulated-cluster``, :mod:`mpicomm.emulate`):
  ``tc`` shapes the bandwidth, but this kernel has no ``netem``, so the one-way
  ``latency`` is injected here (``alpha = beta = 0``); the ranks of one emulated host
  share it, messages to another host are delayed. A blocking ping-pong of small
  messages then takes ``2 * latency`` plus the link's own time.
* **an alpha-beta link on one machine** (:func:`set_link`; e.g. ``python -m
  mpicomm.bench adaptive``): every rank is its own host and every message costs the
  one-port alpha-beta time ``alpha + beta * nbytes`` of a slower network on top of the
  real transfer, so an operation that sends ``m`` messages of ``B`` bytes in all from
  this rank costs it ``alpha * m + beta * B`` more (:meth:`LinkDelay.cost`).

Model, and where it deviates from a wire:

* ``latency`` once per *burst*: sends posted back to back (several ``Isend`` before the
  next receive, as the direct allgather and the pipelined ring post them) share one
  sleep, as concurrent messages on a real network share the flight time. A receive ends
  a burst. ``alpha`` and ``beta`` are paid by every message (one port: a rank's
  messages leave one after the other).
* The sender is blocked while it waits (a real NIC would let it compute); mpicomm's
  algorithms wait for their sends right away, so their times are the same.
* **Bypassed**: everything that does not go through :mod:`mpicomm.p2p`: the MPI
  library's own collectives (``algorithm="mpi"``, ``MPI_Allreduce``, the communicator's
  ``ctl`` helpers such as ``allreduce_value``/``bcast_object``/``barrier``), pickled
  control messages, and user code calling mpi4py directly. Those see the shaped
  bandwidth but no added time.
* ``time.sleep`` overshoots by tens of microseconds; delays under ~100 us are coarse.

Environment (set by the emulator, read once per communicator):

``MPICOMM_EMU_RANKS_PER_HOST``  R: world rank r lives on emulated host ``r // R``;
``MPICOMM_EMU_DELAY``           initial one-way latency in seconds;
``MPICOMM_EMU_DELAY_FILE``      optional file holding the current latency in seconds,
                                rewritten by the emulator's ``--schedule``; re-read when
                                its modification time changes (checked every 10 ms);
``MPICOMM_EMU_STEP_FILE``       where :func:`report_step` writes the training step.

This module imports only the standard library and mpi4py: the communicator arguments
are duck-typed (``resources``, ``rank``, ``size``, ``p2p``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from mpi4py import MPI

__all__ = ["LinkDelay", "link_delay", "set_link", "share_link", "from_env", "hosts_of",
           "report_step",
           "ENV_RANKS_PER_HOST", "ENV_DELAY", "ENV_DELAY_FILE", "ENV_STEP_FILE"]

ENV_RANKS_PER_HOST = "MPICOMM_EMU_RANKS_PER_HOST"
ENV_DELAY = "MPICOMM_EMU_DELAY"
ENV_DELAY_FILE = "MPICOMM_EMU_DELAY_FILE"
ENV_STEP_FILE = "MPICOMM_EMU_STEP_FILE"
_RECHECK = 0.01
#: Where a communicator keeps its link (``comm.resources``).
_KEY = "linkdelay"


def world_ranks(mpi_comm: MPI.Comm) -> list[int]:
    """World rank of every rank of ``mpi_comm`` (local group arithmetic, no message)."""
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in
                MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)]
    finally:
        group.Free()
        world.Free()


def hosts_of(mpi_comm: MPI.Comm, ranks_per_host: int) -> list[int]:
    """Emulated host of every rank of ``mpi_comm`` (from its world rank)."""
    return [r // ranks_per_host for r in world_ranks(mpi_comm)]


class LinkDelay:
    """Sleeps before messages that cross emulated hosts (see the module docstring).

    ``hosts[r]`` is the emulated host of rank ``r`` of the communicator, ``rank`` this
    rank; ``delay`` is the one-way latency per burst (seconds, following ``path`` when
    given), ``alpha`` (seconds) and ``beta`` (seconds per byte) the per-message cost.
    """

    def __init__(self, hosts: list[int], rank: int, delay: float, path: str | None = None,
                 *, alpha: float = 0.0, beta: float = 0.0):
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got {alpha} and {beta}")
        self.hosts = hosts
        self.host = hosts[rank]
        self.delay = delay
        self.path = path
        self.alpha = float(alpha)
        self.beta = float(beta)
        self._mtime: float | None = None
        self._checked = 0.0
        self._in_burst = False

    def current(self) -> float:
        """The latency now (follows ``MPICOMM_EMU_DELAY_FILE`` when one is given)."""
        if self.path is None:
            return self.delay
        now = time.monotonic()
        if now - self._checked >= _RECHECK:
            self._checked = now
            try:
                mtime = os.stat(self.path).st_mtime_ns
                if mtime != self._mtime:
                    with open(self.path) as f:
                        self.delay = max(0.0, float(f.read().strip() or 0))
                    self._mtime = mtime
            except (OSError, ValueError):
                pass  # mid-rewrite or gone at the end of the run: keep the last value
        return self.delay

    def cost(self, messages: int, nbytes: int) -> float:
        """Seconds ``messages`` messages of ``nbytes`` bytes in all cost beyond the
        latency: ``alpha * messages + beta * nbytes``."""
        return self.alpha * messages + self.beta * nbytes

    def before_send(self, dest: int, nbytes: int = 0) -> None:
        """Wait before a message of ``nbytes`` to ``dest``: nothing on the same host;
        else the latency if no burst is under way, plus ``alpha + beta * nbytes``."""
        if self.hosts[dest] == self.host:
            return
        d = self.cost(1, nbytes)
        if not self._in_burst:
            self._in_burst = True
            d += self.current()
        if d > 0:
            time.sleep(d)

    def after_receive(self) -> None:
        """A receive ends the current burst of sends."""
        self._in_burst = False


def from_env(mpi_comm: MPI.Comm) -> LinkDelay | None:
    """The emulated cluster's link for ``mpi_comm`` from the ``MPICOMM_EMU_*`` variables,
    or ``None`` when the emulator did not switch it on (collective only through
    ``Get_group``, which is local)."""
    rph = os.environ.get(ENV_RANKS_PER_HOST)
    if not rph:
        return None
    per_host = int(rph)
    if per_host < 1:
        raise ValueError(f"{ENV_RANKS_PER_HOST} must be >= 1, got {rph}")
    return LinkDelay(hosts_of(mpi_comm, per_host), mpi_comm.Get_rank(),
                     float(os.environ.get(ENV_DELAY, "0") or 0),
                     os.environ.get(ENV_DELAY_FILE) or None)


def link_delay(comm: Any) -> LinkDelay | None:
    """The link of an mpicomm Communicator's ``p2p`` traffic: the one :func:`set_link`
    gave it, else the emulated cluster's (built once from the environment and cached in
    ``comm.resources``), else ``None``. Each call starts a new burst (one operation =
    one ``Ctx``/``Wire``)."""
    ld = comm.resources.get(_KEY)
    if ld is None:
        if not os.environ.get(ENV_RANKS_PER_HOST):
            return None  # the common case: no emulator, no link
        ld = comm.resources[_KEY] = from_env(comm.p2p)
    ld.after_receive()
    return ld


def set_link(comm: Any, alpha: float | None, beta: float = 0.0) -> LinkDelay | None:
    """Emulate an alpha-beta link under every message of ``comm`` (an mpicomm
    Communicator): every rank its own host, ``alpha`` seconds plus ``beta`` seconds per
    byte before each message (module docstring). ``alpha=None`` removes it (the
    emulated cluster's link, if any, is rebuilt from the environment on next use).
    Local: every rank must set the same link for the times to make sense."""
    if alpha is None:
        comm.resources.pop(_KEY, None)
        return None
    ld = LinkDelay(list(range(comm.size)), comm.rank, 0.0, alpha=alpha, beta=beta)
    comm.resources[_KEY] = ld
    return ld


def share_link(parent: Any, child: Any, ranks: list[int]) -> None:
    """Give ``child`` (a communicator made of ``ranks`` of ``parent``, in its rank order)
    the link ``parent`` uses, restricted to those ranks: the one :func:`set_link` gave
    it keeps applying inside the hierarchical collectives' sub-communicators. Nothing
    when ``parent`` has no link yet (``child`` then builds the emulated cluster's from
    the environment like any communicator)."""
    ld = parent.resources.get(_KEY)
    if ld is None:
        return
    child.resources[_KEY] = LinkDelay([ld.hosts[r] for r in ranks], child.rank, ld.delay,
                                      ld.path, alpha=ld.alpha, beta=ld.beta)


def report_step(step: int) -> None:
    """Tell the emulated cluster which training step the job has reached, for
    ``step N`` entries of its ``--schedule`` (call it on one rank). A no-op outside the
    emulator (``MPICOMM_EMU_STEP_FILE`` unset)."""
    path = os.environ.get(ENV_STEP_FILE)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(int(step)))
    os.replace(tmp, path)
