"""Hierarchical collectives against flat ones on a host layout (dense and top-k).

Run under MPI on a layout with several ranks per host, best on the virtual clock (a
simulated cluster: its times do not depend on the machine's load), e.g. 8 hosts of 4::

    mpiexec -n 32 python -m mpicomm.bench hierarchy --clock virtual --rate 1gbit \\
        --delay 100us --ranks-per-host 4 --costs costs.json --json hier-8x4.json

(``--nics-per-host 4``: one network port per rank instead of one per host.)

(``MPICOMM_HOST_SIZES=1,2,3`` for uneven hosts; on the wall clock the layout is what
:mod:`mpicomm.topology` detects.) Each rank draws a heavy-tailed "gradient" of ``d``
float32 (``x_r = sqrt(c)·T_shared + sqrt(1-c)·T_r``, Student-t) and the suite times:

* ``dense/ring`` and ``dense/hierarchical``: ``mpicomm.allreduce(x, algorithm=...)`` of
  the whole vector (plus any ``--dense`` algorithm), and ``dense/ring_cyclic``: the flat
  ring over the same ranks in cyclic host order (ring neighbours on different hosts, as
  after a round-robin placement; column ``x_cyclic``);
* per density (k = ceil(density·d)), one whole aggregation step from the dense vector:
  ``gtopk`` (the flat baseline: the local top-k selection, then
  :func:`mpicomm.sparse.gtopk` over all P ranks), ``hier_gtopk`` and
  ``hier_gtopk_sliced`` (:func:`mpicomm.sparse.hierarchical_topk`, ``inner="gtopk"``,
  leader and sliced form); ``--inner artopk,allgather`` adds the same for AR-Top-k and
  Allgather Top-k (flat: :func:`mpicomm.sparse.artopk`,
  :func:`mpicomm.sparse.topk_allgather`).

Columns: ``time_ms`` (median over ``--repeats`` of the slowest rank; one run on the
virtual clock), ``sent_B`` (the most bytes one rank sent in one call), ``pred_ms`` (the
two-link cost model, :class:`mpicomm.collectives.cost.HostCosts`, communication only;
on the virtual clock from the platform's rate, delay and shared-memory link),
``x_flat`` (the flat baseline's time over the row's: above 1 the hierarchy wins),
``overlap`` (fraction of the exact top-k of ``Σ_r x_r`` among the returned indices) and
``energy`` (``||S[I]||² / ||S[top-k of S]||²`` with ``S = Σ_r x_r``: how much of the
best possible k-sparse update it captured; above 1 where a method returns more than
k indices, as the Allgather's union does). ``targets`` lists the ratios against the
flat ring (dense, target 1.5; ``dense_cyclic`` against the cyclic ring) and the flat
gTop-k (per density, target 1.3).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import torch

from .. import clock
from .. import collectives as coll
from ..collectives import cost
from ..collectives.hierarchical import hierarchy
from ..comm import Communicator, init
from ..compress.topk_select import topk_indices
from ..emulate.linkdelay import share_link
from ..emulate.vnet import ENV_HOST_NICS, parse_nics
from ..sparse import artopk, gtopk, hierarchical_topk, topk_allgather
from ..topology import Topology
from . import _clock
from ._util import UsageError, configured_link, machine, positive_floats, print_table, write_json
from .sparse import gradient

DEFAULT_SIZES = (10_000_000,)
DEFAULT_DENSITIES = (0.001, 0.01)
INNER = ("gtopk", "artopk", "allgather")
FLAT = {"gtopk": "gtopk", "artopk": "artopk_ring", "allgather": "allgather_topk"}
TARGETS = {"dense": 1.5, "gtopk": 1.3}
#: The suite's clock (seconds): wall, or the virtual cluster's (``--clock virtual``).
now: Callable[[], float] = clock.now
COLUMNS = ("d", "density", "k", "method", "time_ms", "pred_ms", "sent_B", "x_flat",
           "x_cyclic", "overlap", "energy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=lambda t: [int(v) for v in positive_floats(t)],
                        default=list(DEFAULT_SIZES), help="dense lengths d (default 1e7)")
    parser.add_argument("--densities", type=positive_floats, default=list(DEFAULT_DENSITIES),
                        help="densities k/d (default 0.001,0.01)")
    parser.add_argument("--inner", default="gtopk",
                        help="comma-separated collectives across hosts: gtopk, artopk, "
                             "allgather (default gtopk)")
    parser.add_argument("--dense", default="",
                        help="further flat dense algorithms to time (rabenseifner, ...)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per row")
    parser.add_argument("--df", type=float, default=3.0, help="Student-t degrees of freedom")
    parser.add_argument("--correlation", type=float, default=0.5,
                        help="variance share of the component common to all ranks (0..1)")
    parser.add_argument("--predict-layouts", default="8x4,16x2",
                        help="HxR layouts for the cost-model-only table (default 8x4,16x2)")
    parser.add_argument("--predict-sizes", type=lambda t: [int(v) for v in positive_floats(t)],
                        default=None, help="dense lengths of that table (default: --sizes)")
    _clock.add_arguments(parser)


def measure(fn: Callable[[], Any], comm: Communicator, repeats: int,
            warmup: int) -> tuple[float, int, Any]:
    """(median seconds of the slowest rank, max over ranks of the bytes one call sent,
    the last call's result)."""
    for _ in range(warmup):
        fn()
    times, sent, result = [], 0, None
    for _ in range(repeats):
        comm.barrier()
        with comm.traffic.measure() as moved:
            start = now()
            result = fn()
            seconds = now() - start
        times.append(comm.allreduce_value(seconds, "max"))
        sent = max(sent, moved.sent_bytes)
    return statistics.median(times), int(comm.allreduce_value(sent, "max")), result


def model(comm: Communicator) -> cost.HostCosts:
    """The two link classes of ``comm``'s layout. On the virtual clock the platform's:
    ``alpha = delay``, ``beta = 1/rate`` between hosts, the shared-memory link inside
    them, ``gamma`` the cost table's reduction per byte; on the emulated cluster its
    configured rate and delay between hosts (:func:`~._util.configured_link`);
    otherwise the calibrated (or default) ones, see
    :func:`mpicomm.collectives.cost.host_costs`."""
    virtual, table = clock.platform(), clock.cost_table()
    if virtual is None:   # on the emulated cluster, its links as configured
        return cost.host_costs(comm, configured_link(cost.calibrated(comm)[0]))
    gamma = cost.CostParams().gamma
    if table is not None and "reduce" in table.ops:
        gamma = table.ops["reduce"].per_unit
    network = cost.CostParams(alpha=virtual.delay, beta=1.0 / virtual.rate, gamma=gamma)
    local = cost.CostParams(alpha=virtual.shm_delay, beta=1.0 / virtual.shm_rate,
                            gamma=gamma)
    return cost.host_costs(comm, network, local=local)


# ---------------------------------------------------------------------- rows
def cyclic_order(comm: Communicator) -> Communicator | None:
    """``comm``'s ranks in cyclic host order (local rank 0 of hosts 0, 1, ..., then local
    rank 1 of every host, ...): a flat ring over it crosses the network at every step,
    as on a cluster whose launcher placed ranks round-robin over the hosts. ``None`` on
    a layout without two link classes (or hosts of different sizes). Collective."""
    t = comm.topology
    if not t.hierarchical or not t.uniform:
        return None
    sub = comm.split(0, key=comm.local_rank * t.num_hosts + comm.node)
    assert sub is not None
    sub.traffic = comm.traffic      # its bytes count in the suite's measurement
    share_link(comm, sub, _cyclic(t))
    return sub


def bench_dense(x: torch.Tensor, comm: Communicator, args: argparse.Namespace,
                hosts: cost.HostCosts, cyclic: Communicator | None = None
                ) -> list[dict[str, Any]]:
    """The flat ring (host-major ranks: the baseline), the flat ring in cyclic order
    (``cyclic``, when given), the hierarchical allreduce and any ``--dense``
    algorithm."""
    xn, d = x.numpy(), x.numel()
    cases: list[tuple[str, str, Communicator]] = [("dense/ring", "ring", comm)]
    if cyclic is not None:
        cases.append(("dense/ring_cyclic", "ring", cyclic))
    cases += [(f"dense/{a}", a, comm) for a in ("hierarchical", *args.dense_algorithms)]
    rows = []
    for method, algorithm, c in cases:
        seconds, sent, _ = measure(
            lambda a=algorithm, c=c: coll.allreduce(xn, algorithm=a, comm=c), comm,
            args.repeats, args.warmup)
        if comm.size == 1:
            pred = 0.0
        elif c is cyclic:
            pred = cyclic_ring_prediction(4 * d, hosts)
        else:
            pred = cost.predict("allreduce", algorithm, 4 * d, comm.size, hosts=hosts)
        rows.append({"d": d, "density": 1.0, "k": d, "method": method,
                     "seconds": seconds, "time_ms": seconds * 1e3, "sent_B": sent,
                     "pred_ms": pred * 1e3})
    base = rows[0]["seconds"]
    for r in rows:
        r["x_flat"] = base / r["seconds"] if r["seconds"] else None
    if cyclic is not None:
        scattered = rows[1]["seconds"]
        for r in rows:
            r["x_cyclic"] = scattered / r["seconds"] if r["seconds"] else None
    return rows


def cyclic_ring_prediction(nbytes: float, hosts: cost.HostCosts) -> float:
    """The two-link model of the flat ring in cyclic host order (:func:`cyclic_order`):
    every step sends a block of ``n/P`` from every rank across the network, ``R`` per
    host port, about ``2(P-1)(α_n + R·n/P·β_n)`` plus the reductions."""
    return hosts.on_group("allreduce", "ring", nbytes, [_cyclic(hosts.topology)]).total


def _cyclic(t: Topology) -> list[int]:
    """The ranks of ``t`` in cyclic host order (:func:`cyclic_order`)."""
    return sorted(range(t.size), key=lambda r: (t.local_rank(r), t.hosts[r]))


def _flat(inner: str, x: torch.Tensor, k: int, comm: Communicator, step: list[int]
          ) -> Callable[[], Any]:
    d = x.numel()

    def run() -> Any:
        idx = topk_indices(x, k)
        if inner == "gtopk":
            return gtopk(idx, x[idx], k, comm=comm, size=d)
        if inner == "allgather":
            return topk_allgather(idx, x[idx], d, comm=comm)
        step[0] += 1
        return artopk(x, k, step[0], comm=comm, algorithm="ring")
    return run


def _hier(inner: str, sliced: bool, x: torch.Tensor, k: int, comm: Communicator,
          step: list[int]) -> Callable[[], Any]:
    def run() -> Any:
        step[0] += 1
        return hierarchical_topk(x, k, comm, inner=inner, sliced=sliced, step=step[0],
                                 algorithm="ring")
    return run


def _predict_sparse(hosts: cost.HostCosts, inner: str, sliced: bool | None, d: int,
                    k: int) -> float:
    if hosts.p == 1:
        return 0.0
    if sliced is None:
        return hosts.flat_sparse(inner, k, 4, 4).total
    return hosts.hierarchical_sparse(inner, 4 * d, k, 4, 4, sliced).total


def returned_indices(result: Any) -> np.ndarray:
    """The indices a call's result carries: ``(indices, values, ...)`` of the sparse
    collectives, or the non-zeros of Allgather Top-k's dense vector."""
    if isinstance(result, tuple):
        return np.asarray(result[0]).astype(np.int64)
    return np.flatnonzero(np.asarray(result))


def quality(idx: np.ndarray, total: np.ndarray, k: int) -> tuple[float, float]:
    """(overlap with the exact top-k of ``total``, captured energy) of the indices
    ``idx``; the energy exceeds 1 where a method returns more than k indices (the
    Allgather's union of every set)."""
    best = np.argpartition(np.abs(total), -k)[-k:] if k < total.size else np.arange(total.size)
    overlap = float(np.isin(best, idx).sum()) / max(1, best.size)
    energy = float(np.sum(total[idx].astype(np.float64) ** 2)
                   / max(np.sum(total[best].astype(np.float64) ** 2), 1e-300))
    return overlap, energy


def bench_sparse(x: torch.Tensor, total: np.ndarray | None, density: float, comm: Communicator,
                 args: argparse.Namespace, hosts: cost.HostCosts) -> list[dict[str, Any]]:
    d = x.numel()
    k = max(1, math.ceil(density * d))
    rows = []
    for inner in args.inner_list:
        cases: list[tuple[str, bool | None, Callable[[], Any]]] = [
            (FLAT[inner], None, _flat(inner, x, k, comm, [0]))]
        for sliced in (False, True):
            name = f"hier_{inner}" + ("_sliced" if sliced else "")
            cases.append((name, sliced, _hier(inner, sliced, x, k, comm, [0])))
        base = None
        for name, sliced, fn in cases:
            seconds, sent, result = measure(fn, comm, args.repeats, args.warmup)
            overlap, energy = quality(returned_indices(result), total, k) \
                if total is not None else (None, None)
            base = seconds if base is None else base
            rows.append({"d": d, "density": density, "k": k, "method": name, "inner": inner,
                         "seconds": seconds, "time_ms": seconds * 1e3, "sent_B": sent,
                         "pred_ms": _predict_sparse(hosts, inner, sliced, d, k) * 1e3,
                         "x_flat": base / seconds if seconds else None,
                         "overlap": overlap, "energy": energy})
    return rows


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The speed-ups of the best hierarchical row over its flat baseline, with the
    targets (dense over the ring: 1.5; gTop-k: 1.3). ``dense`` compares with the flat
    ring over host-major ranks (the best a flat ring can do), ``dense_cyclic`` with
    the flat ring in cyclic host order (a round-robin placement)."""
    out = []
    for d, density in sorted({(r["d"], r["density"]) for r in rows}):
        group = [r for r in rows if (r["d"], r["density"]) == (d, density)]
        kinds = ["dense"] if density == 1.0 else sorted({r["inner"] for r in group})
        for kind in kinds:
            mine = [r for r in group if r["method"].startswith("dense/hierarchical")] \
                if kind == "dense" else [r for r in group if r.get("inner") == kind
                                         and r["method"].startswith("hier_")]
            if not mine:
                continue
            best = max(mine, key=lambda r: r["x_flat"] or 0.0)
            want = TARGETS.get(kind)
            out.append({"d": d, "density": density, "collective": kind,
                        "best": best["method"], "speedup": best["x_flat"],
                        "predicted": _ratio_pred(group, best),
                        "target": want,
                        "met": None if want is None else bool(best["x_flat"] >= want)})
            cyclic = [r for r in group if r["method"] == "dense/ring_cyclic"]
            if kind == "dense" and cyclic and best.get("x_cyclic"):
                pred = cyclic[0]["pred_ms"] / best["pred_ms"] if best["pred_ms"] else None
                out.append({"d": d, "density": density, "collective": "dense_cyclic",
                            "best": best["method"], "speedup": best["x_cyclic"],
                            "predicted": pred, "target": want,
                            "met": bool(best["x_cyclic"] >= want)})
    return out


def _ratio_pred(group: list[dict[str, Any]], best: dict[str, Any]) -> float | None:
    flat = [r for r in group if r.get("x_flat") == 1.0 and r.get("inner") == best.get("inner")]
    if not flat or not best["pred_ms"]:
        return None
    return flat[0]["pred_ms"] / best["pred_ms"]


def _step(strategy: Any, d: int, p: int, topo: Topology, hosts: cost.HostCosts,
          work: cost.ComputeParams) -> float:
    parts = strategy.predict_parts(d, 4, p, hosts.network, work, topology=topo,
                                   local=hosts.local)
    return parts["comm"] + parts["compute"]


def prediction(layouts: list[tuple[int, int]], sizes: list[int], densities: list[float],
               hosts: cost.HostCosts, nics: int = 1) -> list[dict[str, Any]]:
    """Cost-model-only rows (not measured) for ``H`` hosts of ``R`` with ``nics``
    network ports each, with this run's link classes: the dense ring against the
    hierarchical allreduce (communication), and a whole step of the flat gTop-k against
    ``hier_gtopk`` and ``hier_gtopk_sliced`` (communication plus the modelled compute:
    selection, merges, densify, host sums, from
    :func:`mpicomm.strategies.kernel_timing.measure_compute`, i.e. the cost table on the
    virtual clock)."""
    from ..strategies import GTopK, HierarchicalGTopK
    from ..strategies.kernel_timing import measure_compute

    table = clock.cost_table()
    if table is None:
        work = measure_compute()
    else:  # the rates the run is charged; gTop-k's steps use no matrix product (flop)
        def rate(op: str) -> float:
            return table.cost(op, 1) - table.cost(op, 0) if op in table.ops else 0.0

        work = cost.ComputeParams(select=rate("select"), merge=rate("merge") + rate("select"),
                                  scatter=rate("scatter"), flop=0.0, copy=rate("copy"))
    out = []
    for h, r in layouts:
        topo, p = Topology.from_sizes((r,) * h, nics=nics), h * r
        label = f"{h}x{r}" + (f", {nics} NICs" if nics > 1 else "")
        model_ = cost.HostCosts(topo, hosts.local, hosts.network)
        for d in sizes:
            ring = cost.predict("allreduce", "ring", 4 * d, p, hosts=model_)
            hier = cost.predict("allreduce", "hierarchical", 4 * d, p, hosts=model_)
            out.append({"layout": label, "d": d, "density": 1.0, "flat_ms": ring * 1e3,
                        "hier_ms": hier * 1e3, "hier_sliced_ms": None,
                        "x_flat": ring / hier})
            for density in densities:
                flat, leader, sliced = (
                    _step(s, d, p, topo, hosts, work)
                    for s in (GTopK(density=density), HierarchicalGTopK(density=density),
                              HierarchicalGTopK(density=density, sliced=True)))
                out.append({"layout": label, "d": d, "density": density,
                            "flat_ms": flat * 1e3, "hier_ms": leader * 1e3,
                            "hier_sliced_ms": sliced * 1e3,
                            "x_flat": flat / min(leader, sliced)})
    return out


# ---------------------------------------------------------------------- main
def _options(args: argparse.Namespace) -> None:
    args.inner_list = [s.strip() for s in args.inner.split(",") if s.strip()]
    bad = [s for s in args.inner_list if s not in INNER]
    if bad or not args.inner_list:
        raise UsageError(f"--inner: choose from {', '.join(INNER)}, got {args.inner!r}")
    args.dense_algorithms = [s.strip() for s in args.dense.split(",") if s.strip()]
    bad = [s for s in args.dense_algorithms if s not in coll.ALGORITHMS["allreduce"]]
    if bad:
        raise UsageError(f"--dense: unknown allreduce algorithm(s) {', '.join(bad)}")
    try:
        args.layouts = [tuple(int(v) for v in item.lower().split("x"))
                        for item in args.predict_layouts.split(",") if item.strip()]
    except ValueError:
        args.layouts = []
    if any(len(t) != 2 or min(t) < 1 for t in args.layouts):
        raise UsageError(f"--predict-layouts: HxR items such as 8x4,16x2, got "
                         f"{args.predict_layouts!r}")
    if args.repeats < 1 or args.warmup < 0:
        raise UsageError("--repeats must be >= 1 and --warmup >= 0")


def run(args: argparse.Namespace) -> int:
    _options(args)
    _clock.apply(args)
    comm = init()
    _clock.measure_costs(comm)
    if clock.started():  # deterministic: one timed run per row
        args.repeats, args.warmup = 1, 0
    topo: Topology = comm.topology
    cyclic = None
    if comm.size > 1:
        hierarchy(comm)  # the sub-communicators, made once outside the timings
        cyclic = cyclic_order(comm)
    hosts = model(comm)
    rows: list[dict[str, Any]] = []
    for d in args.sizes:
        x = gradient(d, comm.rank, args.df, args.correlation, seed=1234 + d)
        total = coll.allreduce(x.numpy(), algorithm="ring", comm=comm)
        if comm.rank != 0:  # the accuracy columns are rank 0's
            total = None
        rows.extend(bench_dense(x, comm, args, hosts, cyclic))
        for density in args.densities:
            rows.extend(bench_sparse(x, total, density, comm, args, hosts))
        del x, total
    summary = targets(rows)
    if comm.rank == 0:
        nics = parse_nics(os.environ.get(ENV_HOST_NICS))
        predicted = prediction(args.layouts, args.predict_sizes or args.sizes,
                               args.densities, hosts, nics)
        print(f"# {comm.size} ranks on {topo.describe()}; float32, median of "
              f"{args.repeats}; x_flat = flat baseline's time / the row's")
        print_table(rows, COLUMNS)
        print("\n# best hierarchical row against its flat baseline")
        print_table(summary, ("d", "density", "collective", "best", "speedup", "predicted",
                              "target", "met"))
        print("\n# PREDICTED by the cost model (not measured); gTop-k rows: whole step")
        print_table(predicted, ("layout", "d", "density", "flat_ms", "hier_ms",
                                "hier_sliced_ms", "x_flat"))
        options = {k: v for k, v in vars(args).items() if k not in ("func", "layouts")}
        write_json(args.json, {"suite": "hierarchy", "machine": machine(),
                               "ranks": comm.size, "host_sizes": list(topo.host_sizes),
                               "nics_per_host": nics,
                               "clock": _clock.describe(),
                               "cost_params": {"local": asdict(hosts.local),
                                               "network": asdict(hosts.network)},
                               "options": options, "rows": rows, "targets": summary,
                               "predicted": predicted})
    if cyclic is not None:
        cyclic.free()
    comm.barrier()
    return 0
