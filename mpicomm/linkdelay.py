"""Injected one-way latency between emulated hosts (switched on by the emulated cluster).

The kernel here has no ``netem``, so the emulated cluster (``launchers/emulated-cluster``,
:mod:`mpicomm.emulate`) shapes *bandwidth* with ``tc`` but injects *latency* in mpicomm's
own point-to-point layer: the collectives' :class:`mpicomm.collectives._common.Ctx` and
the sparse layer's :class:`mpicomm.sparse._common.Wire` call :meth:`LinkDelay.before_send`
before handing a message to MPI. When the destination rank lives on another emulated host
the sender first sleeps the current delay ``d``, so the message reaches the wire ``d``
later: a blocking ping-pong of small messages takes ``2 d`` plus the link's own time.

Model, and where it deviates from a wire delay:

* One delay per *burst*: sends posted back to back (several ``Isend`` before the next
  receive, as the direct allgather and the pipelined ring post them) share one sleep, as
  concurrent messages on a real network share the flight time. A receive ends a burst.
* The sender is blocked while it waits (a real NIC would let it compute); mpicomm's
  algorithms wait for their sends right away, so their times are the same.
* **Bypassed**: everything that does not go through Ctx/Wire: the MPI library's own
  collectives (``algorithm="mpi"``, ``MPI_Allreduce``, the communicator's ``ctl``
  helpers such as ``allreduce_value``/``bcast_object``/``barrier``), and user code calling
  mpi4py directly. Those see the shaped bandwidth but no added latency.
* ``time.sleep`` overshoots by tens of microseconds; delays under ~100 us are coarse.

Environment (set by the emulator, read once per communicator):

``MPICOMM_EMU_RANKS_PER_HOST``  R: world rank r lives on emulated host ``r // R``;
``MPICOMM_EMU_DELAY``           initial one-way delay in seconds;
``MPICOMM_EMU_DELAY_FILE``      optional file holding the current delay in seconds,
                                rewritten by the emulator's ``--schedule``; re-read when
                                its modification time changes (checked every 10 ms);
``MPICOMM_EMU_STEP_FILE``       where :func:`report_step` writes the training step.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mpi4py import MPI

__all__ = ["LinkDelay", "link_delay", "hosts_of", "report_step", "ENV_RANKS_PER_HOST", "ENV_DELAY",
           "ENV_DELAY_FILE"]

ENV_RANKS_PER_HOST = "MPICOMM_EMU_RANKS_PER_HOST"
ENV_DELAY = "MPICOMM_EMU_DELAY"
ENV_DELAY_FILE = "MPICOMM_EMU_DELAY_FILE"
ENV_STEP_FILE = "MPICOMM_EMU_STEP_FILE"
_RECHECK = 0.01


def hosts_of(mpi_comm: MPI.Comm, ranks_per_host: int) -> list[int]:
    """Emulated host of every rank of ``mpi_comm`` (from its world rank)."""
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    return [r // ranks_per_host for r in ranks]


class LinkDelay:
    """Sleeps before messages that cross emulated hosts (see the module docstring)."""

    def __init__(self, hosts: list[int], rank: int, delay: float, path: str | None = None):
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.hosts = hosts
        self.host = hosts[rank]
        self.delay = delay
        self.path = path
        self._mtime: float | None = None
        self._checked = 0.0
        self._in_burst = False

    def current(self) -> float:
        """The delay now (follows ``MPICOMM_EMU_DELAY_FILE`` when one is given)."""
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

    def before_send(self, dest: int) -> None:
        """Wait the delay if ``dest`` is on another host and no burst is under way."""
        if self.hosts[dest] == self.host or self._in_burst:
            return
        self._in_burst = True
        d = self.current()
        if d > 0:
            time.sleep(d)

    def after_receive(self) -> None:
        """A receive ends the current burst of sends."""
        self._in_burst = False


def link_delay(comm: Any) -> LinkDelay | None:
    """The injector for an mpicomm Communicator's ``p2p`` traffic, or None when the
    emulator did not switch it on. Built once per communicator (cached in
    ``comm.resources``); each call starts a new burst (one operation = one Ctx/Wire)."""
    rph = os.environ.get(ENV_RANKS_PER_HOST)
    if not rph:
        return None
    ld = comm.resources.get("linkdelay")
    if ld is None:
        per_host = int(rph)
        if per_host < 1:
            raise ValueError(f"{ENV_RANKS_PER_HOST} must be >= 1, got {rph}")
        ld = LinkDelay(hosts_of(comm.p2p, per_host), comm.rank,
                       float(os.environ.get(ENV_DELAY, "0") or 0),
                       os.environ.get(ENV_DELAY_FILE) or None)
        comm.resources["linkdelay"] = ld
    ld.after_receive()
    return ld


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
