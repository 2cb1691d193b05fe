"""The virtual clock against the closed forms of the cost model (and the wall clock).

Run under MPI, e.g.
``mpiexec -n 8 python -m mpicomm.bench vclock --nets 1gbit:100us,100mbit:1ms --json out``.

Cases, on float32 vectors of ``d`` elements (``--sizes``): ``pingpong`` (one-way time of
``4d`` bytes between ranks 0 and 1), ``allreduce-ring``, ``allreduce-recursive_doubling``,
``allgather-ring`` (``d`` elements in all) and ``gtopk`` (``k = density·d`` pairs per
rank, 8 bytes each). Each is timed once (virtual time is deterministic) as the slowest
rank's time between two barriers, and compared with its closed form in
:mod:`mpicomm.collectives.cost` for the configured network (``alpha`` = the delay,
``beta`` = 1/rate, times the framing's ``(payload + header) / payload`` when
``--framing`` is set, ``gamma`` = the cost table's ``reduce`` rate).

Three ways to run it:

* ``--nets RATE:DELAY,...`` (wall clock in the environment): one virtual cluster per
  network in this job (:func:`mpicomm.clock.session`), rank ``r`` on host ``r``. Every
  case runs twice: ``virtual`` with only ``reduce`` charged (the network model against
  the alpha-beta-gamma formula) and ``full`` with the whole cost table (what compute
  adds: selections and merges of gTop-k, copies).
* under ``MPICOMM_CLOCK=virtual`` (``launchers/emulated-cluster --clock virtual``): the
  environment's platform, full table.
* on the wall clock without ``--nets`` (``launchers/emulated-cluster`` with tc): the
  same calls timed for real (median of ``--repeats``), to set against a virtual run of
  the same command line.

The cost table is ``--costs FILE`` (``python -m mpicomm.bench costs``), else measured
first with every rank taking its turn; it is recorded in the JSON. ``signature`` lists
every virtual time: two runs with the same table give the same list whatever the load.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import clock, costtable
from ..arrayops import ops_for
from ..collectives import allgather, allreduce, cost
from ..comm import Communicator, init
from ..emulate.vnet import (
    ENV_DELAY,
    ENV_FRAMING,
    ENV_RATE,
    Platform,
    parse_framing,
    platform_from_env,
)
from ..p2p import Ctx
from ..sparse import gtopk
from ._util import UsageError, machine, median_seconds, print_table, write_json

COLUMNS = ("net", "case", "elems", "virtual_s", "full_s", "wall_s", "model_s", "ratio")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nets", default="",
                    help="virtual networks RATE:DELAY,... (e.g. 1gbit:100us,100mbit:1ms)")
    ap.add_argument("--sizes", default="1e4,1e6", help="float32 elements per vector")
    ap.add_argument("--density", type=float, default=0.01, help="gTop-k's k / d")
    ap.add_argument("--framing", default="none",
                    help="--nets: headers per frame on the links (none, tcp, PAYLOAD,HEADER)")
    ap.add_argument("--costs", default=None, help="cost table JSON (default: measure)")
    ap.add_argument("--repeats", type=int, default=5, help="wall clock: repeats per case")


def _elapsed(comm: Communicator, fn: Callable[[], Any]) -> float:
    comm.barrier()
    t0 = clock.now()
    fn()
    return comm.allreduce_value(clock.now() - t0, "max")


def cases(comm: Communicator, d: int, density: float
          ) -> list[tuple[str, Callable[[], Any], Callable[[cost.CostParams], float], float]]:
    """``(name, run, model, divisor)``: a run's time divided by ``divisor`` (the
    ping-pong's six one-way trips) is what ``model(params)``, the closed form, gives."""
    p, rank = comm.size, comm.rank
    x = np.arange(d, dtype=np.float32)
    part = np.arange(max(1, d // p), dtype=np.float32)
    k = max(1, int(density * d))
    gen = torch.Generator().manual_seed(rank)
    idx, val = torch.randperm(d, generator=gen)[:k], torch.randn(k, generator=gen)
    ctx = Ctx.of(comm, ops_for("numpy", False))
    out: list = []
    if p > 1:
        buf = np.zeros(4 * d, dtype=np.uint8)

        def pingpong() -> None:
            for _ in range(3):
                if rank == 0:
                    ctx.send(buf, 1, 7)
                    ctx.recv(buf, 1, 7)
                elif rank == 1:
                    ctx.recv(buf, 0, 7)
                    ctx.send(buf, 0, 7)

        out.append(("pingpong", pingpong, lambda c: c.alpha + 4 * d * c.beta, 6.0))
    for alg in ("ring", "recursive_doubling"):
        out.append((f"allreduce-{alg}", lambda alg=alg: allreduce(x, algorithm=alg, comm=comm),
                    lambda c, alg=alg: cost.predict("allreduce", alg, 4 * d, p, c), 1.0))
    out.append(("allgather-ring", lambda: allgather(part, algorithm="ring", comm=comm),
                lambda c: cost.predict("allgather", "ring", 4 * part.shape[0] * p, p, c), 1.0))
    out.append(("gtopk", lambda: gtopk(idx, val, k, comm=comm, size=d),
                lambda c: cost.gtopk(k, 8, p, c), 1.0))
    return out


def _network_only(table: costtable.CostTable) -> costtable.CostTable:
    """``table`` with every op but ``reduce`` free (the network model alone)."""
    free = {op: costtable.OpCost(0.0, 0.0, e.unit, "declared") for op, e in table.ops.items()}
    free["reduce"] = table.ops["reduce"]
    return costtable.CostTable(free, dict(table.info))


def _params(plat: Platform, table: costtable.CostTable) -> cost.CostParams:
    return cost.CostParams(alpha=plat.delay, beta=plat.wire_factor() / plat.rate,
                           gamma=table.ops["reduce"].per_unit)


def _nets(text: str) -> list[tuple[str, str]]:
    nets = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        rate, _, delay = item.partition(":")
        nets.append((rate, delay or "0"))
    return nets


def _virtual_rows(comm: Communicator, plat: Platform, table: costtable.CostTable,
                  net: str, sizes: list[int], density: float, both: bool) -> list[dict]:
    rows = []
    tables = [("virtual_s", _network_only(table))] if both else []
    tables.append(("full_s", table))
    for d in sizes:
        row_of: dict[str, dict] = {}
        for column, tab in tables:
            with clock.session(plat, tab):
                vc = comm.dup()
                vc.check = False
                try:
                    for name, run, model, div in cases(vc, d, density):
                        row = row_of.setdefault(name, {
                            "net": net, "case": name, "elems": d, "ranks": comm.size,
                            "model_s": model(_params(plat, table))})
                        row[column] = _elapsed(vc, run) / div
                finally:
                    vc.free()
        for row in row_of.values():
            got = row.get("virtual_s", row["full_s"])
            row["ratio"] = got / row["model_s"] if row["model_s"] > 0 else math.nan
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"bad --sizes {args.sizes!r}") from None
    if not sizes or min(sizes) < 1 or not 0 < args.density <= 1:
        raise UsageError("--sizes must be positive and --density in (0, 1]")
    nets = _nets(args.nets)
    try:
        parse_framing(args.framing)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if nets and clock.is_virtual():
        raise UsageError("--nets runs its own virtual clusters: leave MPICOMM_CLOCK unset")
    comm = init()
    table = (costtable.CostTable.load(args.costs) if args.costs else None)
    rows: list[dict] = []
    if nets:
        if table is None:
            table = costtable.calibrate(comm.mpi)
        for rate, delay in nets:
            plat = platform_from_env(comm.size, {ENV_RATE: rate, ENV_DELAY: delay,
                                                 ENV_FRAMING: args.framing})
            rows += _virtual_rows(comm, plat, table, f"{rate}:{delay}", sizes,
                                  args.density, both=True)
    elif clock.started():
        plat, table = clock.platform(), clock.cost_table()
        assert plat is not None and table is not None
        net = f"{plat.rate * 8:g}bit/s:{plat.delay:g}s"
        for d in sizes:
            for name, run_case, model, div in cases(comm, d, args.density):
                rows.append({"net": net, "case": name, "elems": d, "ranks": comm.size,
                             "full_s": _elapsed(comm, run_case) / div,
                             "model_s": model(_params(plat, table))})
    else:
        for d in sizes:
            for name, run_case, _, div in cases(comm, d, args.density):
                rows.append({"net": "wall", "case": name, "elems": d, "ranks": comm.size,
                             "wall_s": median_seconds(run_case, comm, args.repeats) / div})
    payload = {"suite": "vclock", "machine": machine(), "clock": clock.describe(),
               "costs": table.to_json() if table is not None else None,
               "signature": [r.get("virtual_s", r.get("full_s")) for r in rows],
               "results": rows}
    if comm.rank == 0:
        print_table(rows, COLUMNS)
        write_json(args.json, payload)
    return 0
