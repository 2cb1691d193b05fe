"""The suites' ``--clock`` options: time a suite on the wall clock or a virtual cluster.

``--clock virtual --rate 1gbit --delay 100us [--ranks-per-host R] [--nics-per-host N]
[--schedule FILE] [--costs FILE]`` under a plain ``mpiexec -n P`` makes the suite's ranks a virtual
cluster of ``P/R`` hosts (:mod:`mpicomm.clock`): every time it reports is that
cluster's, whatever else runs on the machine. The options only fill in the
``MPICOMM_CLOCK``/``MPICOMM_VIRTUAL_*`` variables before the clock starts, so a job
started by ``launchers/emulated-cluster --clock virtual`` (which sets them) needs none
of them. Without ``--costs`` (or ``MPICOMM_VIRTUAL_COSTS``) the compute cost table is
measured first, every rank taking a turn; every result records the clock, the platform
and the table (:func:`mpicomm.clock.describe`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .. import clock, costtable
from ..emulate import vnet
from ._util import UsageError

__all__ = ["add_arguments", "apply", "measure_costs", "describe"]


def add_arguments(ap: argparse.ArgumentParser, extra: tuple[str, ...] = (),
                  help_extra: str = "", schedule_flag: str = "--schedule") -> None:
    """The options; ``extra`` are further ``--clock`` choices of the suite's own (they
    count as the wall clock here); ``schedule_flag``: the schedule file's option name
    (for a suite whose ``--schedule`` means something else); its value is
    ``args.virtual_schedule`` either way."""
    g = ap.add_argument_group("clock")
    g.add_argument("--clock", choices=("wall", "virtual", *extra), default=None,
                   help="wall, or virtual: the times of a simulated cluster (default: "
                        "MPICOMM_CLOCK, else wall)" + help_extra)
    g.add_argument("--rate", default=None, help="virtual: link rate per host (1gbit)")
    g.add_argument("--delay", default=None, help="virtual: one-way latency (100us)")
    g.add_argument("--ranks-per-host", default=None, help="virtual: ranks per host")
    g.add_argument("--nics-per-host", default=None,
                   help="virtual: network ports per host (default 1; the ranks per host "
                        "for one NIC per rank)")
    g.add_argument(schedule_flag, default=None, dest="virtual_schedule",
                   help="virtual: a schedule file")
    g.add_argument("--costs", default=None,
                   help="virtual: the compute cost table (default: measured first)")


def apply(args: argparse.Namespace) -> None:
    """Before the world communicator exists: turn ``--clock virtual`` and its platform
    options into the environment the clock starts from (same on every rank)."""
    want = args.clock or clock.mode()
    if args.clock is None:
        args.clock = want
    given = {vnet.ENV_RATE: args.rate, vnet.ENV_DELAY: args.delay,
             vnet.ENV_RANKS_PER_HOST: args.ranks_per_host,
             vnet.ENV_HOST_NICS: args.nics_per_host,
             vnet.ENV_SCHEDULE: args.virtual_schedule,
             costtable.ENV_COSTS: args.costs}
    if want != "virtual":
        if any(v is not None for v in given.values()):
            raise UsageError("--rate/--delay/--ranks-per-host/--nics-per-host/--schedule/"
                             "--costs need --clock virtual")
        return
    if clock.started():
        return
    for name, value in given.items():
        if value is not None:
            os.environ[name] = str(value)
    if not os.environ.get(vnet.ENV_RATE) and not os.environ.get(vnet.ENV_SCHEDULE):
        raise UsageError("--clock virtual needs --rate (or MPICOMM_VIRTUAL_RATE)")
    os.environ[clock.ENV_CLOCK] = "virtual"
    clock.reset_mode()


def measure_costs(comm: Any) -> None:
    """Under the virtual clock without a given table: measure every registered kernel
    with every rank taking a turn (replacing the start-up measurement of rank 0)."""
    if clock.started() and not os.environ.get(costtable.ENV_COSTS):
        clock.calibrate(mpi_comm=comm.mpi)


def describe() -> dict[str, Any]:
    return clock.describe()
