"""Dense collectives: mpicomm's algorithms vs the MPI library and torch.distributed gloo.

Run under MPI, e.g. ``mpiexec -n 4 python -m mpicomm.bench collectives --json out.json``.

For each collective and float32 size, every own algorithm, the MPI library's native
collective (``algorithm="mpi"``) and gloo are timed in the same run (median over
repeats of the slowest rank's time; see :func:`mpicomm.bench._util.median_seconds`).
Bandwidths follow the nccl-tests convention:

* ``bytes``: the per-rank buffer for allreduce and broadcast, the *total* gathered
  output for allgather, the total input for reduce_scatter; ``--sizes`` counts elements
  the same way (allgather and reduce_scatter round down to a multiple of ``p``);
* ``algbw = bytes / time``; ``busbw = algbw * 2(p-1)/p`` for allreduce, ``* (p-1)/p``
  for allgather and reduce_scatter, ``* 1`` for broadcast.

``pred`` is the cost model's time (:mod:`mpicomm.collectives.cost`) with alpha, beta and
gamma fitted in the same run (:func:`mpicomm.collectives.calibrate.measure`); ``x_mpi``
and ``x_gloo`` are the row's time divided by the native and gloo times (below 1: faster).
All calls are in place or into preallocated outputs, as gloo's are. The contenders are
timed in interleaved rounds, in a shuffled order (see :func:`interleaved_samples`).
Before timing, each own algorithm's result is checked against the native one.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .. import clock
from .. import collectives as coll
from ..collectives import calibrate, cost
from ..comm import Communicator, init
from . import _clock
from ._util import machine, median_seconds, print_table, write_json

COLLECTIVES = ("allreduce", "allgather", "broadcast", "reduce_scatter")
DEFAULT_SIZES = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
}
COLUMNS = ("collective", "algorithm", "elems", "bytes", "time_us", "algbw_GBs", "busbw_GBs",
           "pred_us", "x_mpi", "x_gloo")


# ---------------------------------------------------------------------- options
def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad --sizes {text!r}: {exc}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("--sizes needs positive element counts")
    return sizes


def _collectives(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in COLLECTIVES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown collectives {unknown}; from {COLLECTIVES}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES),
                        help="comma-separated float32 element counts (default 1e3,...,1e7)")
    parser.add_argument("--collectives", type=_collectives, default=list(COLLECTIVES),
                        help=f"comma-separated subset of {','.join(COLLECTIVES)}")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed runs per row up to 1e6 elements; above: a quarter "
                             "(at least 3)")
    parser.add_argument("--no-gloo", action="store_true",
                        help="skip the torch.distributed gloo baseline (always skipped on "
                             "the virtual clock, which cannot time gloo's traffic)")
    _clock.add_arguments(parser)


def repeats_for(elems: int, base: int) -> tuple[int, int]:
    """``(repeats, warmup)``: fewer timed runs for large messages."""
    if elems <= 1_000_000:
        return base, 2
    return max(3, base // 4), 1


# ---------------------------------------------------------------------- gloo
class Gloo:
    """A torch.distributed gloo group over the same ranks
    (:func:`mpicomm.torch.init_process_group`: a private file store on one node)."""

    def __init__(self, comm: Communicator):
        import torch.distributed as dist

        from ..torch.ddp import init_process_group

        self.dist = dist
        self.comm = comm
        init_process_group(comm, "gloo")

    def call(self, collective: str, t: Any, out: Any) -> Callable[[], Any]:
        d = self.dist
        if collective == "allreduce":
            return lambda: d.all_reduce(t)
        if collective == "allgather":  # all_gather_into_tensor, renamed in newer torch
            gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
            return lambda: gather(out, t)
        if collective == "broadcast":
            return lambda: d.broadcast(t, src=0)
        scatter = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
        return lambda: scatter(out, t)

    def close(self, wait: bool = True) -> None:
        """Destroy the group (:func:`mpicomm.torch.destroy_process_group`; ``wait=False``
        on an error path)."""
        from ..torch.ddp import destroy_process_group

        destroy_process_group(self.comm, wait=wait)


# ---------------------------------------------------------------------- one row
@dataclass
class Case:
    """The buffers of one (collective, size) and how big the model says it is."""

    collective: str
    elems: int  # as reported (nccl-tests convention)
    nbytes: int  # bytes for algbw
    model_bytes: int  # ``n`` of the cost formulas
    x: np.ndarray
    out: np.ndarray | None


def make_case(collective: str, elems: int, p: int) -> Case:
    if collective in ("allgather", "reduce_scatter"):
        elems = max(p, elems - elems % p)
    if collective == "allgather":
        x = np.zeros(elems // p, np.float32)
        return Case(collective, elems, 4 * elems, 4 * elems, x, np.empty(elems, np.float32))
    x = np.zeros(elems, np.float32)
    out = np.empty(elems // p, np.float32) if collective == "reduce_scatter" else None
    return Case(collective, elems, 4 * elems, 4 * elems, x, out)


def own_call(case: Case, algorithm: str, comm: Communicator) -> Callable[[], Any]:
    """The timed call: in place for allreduce/broadcast, into ``out`` otherwise."""
    x, out = case.x, case.out
    if case.collective == "allreduce":
        return lambda: coll.allreduce(x, algorithm=algorithm, comm=comm, out=x)
    if case.collective == "broadcast":
        return lambda: coll.broadcast(x, root=0, algorithm=algorithm, comm=comm, out=x)
    if case.collective == "allgather":
        return lambda: coll.allgather(x, algorithm=algorithm, comm=comm, out=out)
    return lambda: coll.reduce_scatter(x, algorithm=algorithm, comm=comm, out=out)


def verify(case: Case, algorithm: str, comm: Communicator) -> None:
    """Run ``algorithm`` once on rank-dependent data and compare with the native result."""
    fn = getattr(coll, case.collective)
    data = (np.arange(case.x.size, dtype=np.float32) % 17 + comm.rank).astype(np.float32)
    kw = {"root": 0} if case.collective == "broadcast" else {}
    mine = fn(data, algorithm=algorithm, comm=comm, **kw)
    native = fn(data, algorithm="mpi", comm=comm, **kw)
    if not np.array_equal(mine, native):
        raise AssertionError(f"{case.collective}/{algorithm} on {case.elems} elements differs "
                             "from the MPI library's result")


def row(case: Case, algorithm: str, seconds: float, p: int,
        params: cost.CostParams, hosts: cost.HostCosts | None = None) -> dict[str, Any]:
    """One result row; ``hosts`` prices ``"hierarchical"`` on the job's host layout."""
    algbw = case.nbytes / seconds / 1e9
    pred = None
    if algorithm != "gloo":
        pred = cost.predict(case.collective, algorithm, case.model_bytes, p, params,
                            hosts if algorithm == "hierarchical" else None)
    return {"collective": case.collective, "algorithm": algorithm, "elems": case.elems,
            "bytes": case.nbytes, "seconds": seconds, "time_us": seconds * 1e6,
            "algbw_GBs": algbw, "busbw_GBs": algbw * BUS_FACTOR[case.collective](p),
            "pred_s": pred, "pred_us": None if pred is None else pred * 1e6}


def contenders(case: Case, comm: Communicator,
               gloo: Gloo | None) -> dict[str, Callable[[], Any]]:
    """The timed call of every own algorithm, the native collective, and gloo."""
    calls = {a: own_call(case, a, comm) for a in coll.ALGORITHMS[case.collective]}
    if gloo is not None:
        import torch

        out = None if case.out is None else torch.from_numpy(case.out)
        call = gloo.call(case.collective, torch.from_numpy(case.x), out)
        try:
            call()
            calls["gloo"] = call
        except (RuntimeError, NotImplementedError) as exc:  # an op this gloo lacks
            if comm.rank == 0:
                print(f"# gloo {case.collective}: unsupported ({str(exc).splitlines()[0]})")
    return calls


def interleaved_samples(calls: dict[str, Callable[[], Any]], comm: Communicator,
                        repeats: int, warmup: int) -> dict[str, list[float]]:
    """``repeats`` timings of each call, taken in rounds (one of each per round).

    Every sample is one :func:`median_seconds` run (barrier, call, slowest rank). Taking
    them in rounds means a burst of background load hits every contender alike, which
    keeps same-run ratios meaningful on a busy machine; the order within a round is
    shuffled (the same on every rank, seeded by the round) so that no contender always
    runs right after another's aftermath (gloo's TCP threads, say, or cold caches).
    """
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    names = list(calls)
    for round_ in range(repeats):
        random.Random(round_).shuffle(names)
        for name in names:
            samples[name].append(median_seconds(calls[name], comm, repeats=1, warmup=0))
    return samples


def bench_case(case: Case, comm: Communicator, gloo: Gloo | None, repeats: int,
               params: cost.CostParams) -> list[dict[str, Any]]:
    """Time every algorithm of one (collective, size); ratios to native and gloo."""
    reps, warm = repeats_for(case.elems, repeats)
    for algorithm in coll.ALGORITHMS[case.collective]:
        if algorithm != "mpi":
            verify(case, algorithm, comm)
    samples = interleaved_samples(contenders(case, comm, gloo), comm, reps, warm)
    rows = []
    for name, times in samples.items():
        r = row(case, name, statistics.median(times), comm.size, params,
                cost.host_costs(comm, params) if name == "hierarchical" else None)
        r.update(min_s=min(times), repeats=len(times))
        rows.append(r)
    native = next(r["seconds"] for r in rows if r["algorithm"] == "mpi")
    baseline = next((r["seconds"] for r in rows if r["algorithm"] == "gloo"), None)
    for r in rows:
        r["x_mpi"] = r["seconds"] / native
        r["x_gloo"] = None if baseline is None else r["seconds"] / baseline
    return rows


# ---------------------------------------------------------------------- targets
def summarize(rows: Sequence[dict[str, Any]], p: int) -> list[dict[str, Any]]:
    """Per (collective, size): the best own algorithm and the targets it meets.

    Targets (judged from 2 ranks on; one rank communicates nothing): within 1.25x of
    native at >= 1e6 elements (allreduce, allgather); never slower than gloo; at least
    2x faster than gloo up to 1e6 elements.
    """
    out = []
    keys = sorted({(r["collective"], r["elems"]) for r in rows},
                  key=lambda k: (COLLECTIVES.index(k[0]), k[1]))
    for collective, elems in keys:
        group = [r for r in rows if (r["collective"], r["elems"]) == (collective, elems)]
        own = [r for r in group if r["algorithm"] not in ("mpi", "gloo")]
        best = min(own, key=lambda r: r["seconds"])
        entry = {"collective": collective, "elems": elems, "best": best["algorithm"],
                 "time_us": best["time_us"], "x_mpi": best["x_mpi"],
                 "x_gloo": best["x_gloo"]}
        if p > 1:
            entry.update(targets(collective, elems, best))
        out.append(entry)
    return out


def targets(collective: str, elems: int, best: dict[str, Any]) -> dict[str, str]:
    """``met``/``MISSED`` for the targets that apply to one summary entry."""
    verdict = {}
    if collective in ("allreduce", "allgather") and elems >= 1_000_000:
        verdict["mpi_target"] = "met" if best["x_mpi"] <= 1.25 else "MISSED"
    if best["x_gloo"] is not None:
        limit = 0.5 if elems <= 1_000_000 else 1.0
        verdict["gloo_target"] = "met" if best["x_gloo"] <= limit else "MISSED"
    return verdict


# ---------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    _clock.apply(args)
    comm = init()
    _clock.measure_costs(comm)
    p = comm.size
    params = calibrate.measure(comm)
    virtual = clock.started()
    if virtual:         # deterministic: one timing per contender is the timing
        args.repeats = 1
    gloo = None if args.no_gloo or virtual else Gloo(comm)
    rows: list[dict[str, Any]] = []
    try:
        for collective in args.collectives:
            for elems in args.sizes:
                rows.extend(bench_case(make_case(collective, elems, p), comm, gloo,
                                       args.repeats, params))
    except BaseException:
        if gloo is not None:
            gloo.close(wait=False)
        raise
    if gloo is not None:
        gloo.close()
    summary = summarize(rows, p)
    if comm.rank == 0:
        print(f"# {p} ranks; fitted alpha={params.alpha * 1e6:.2f} us, "
              f"beta={params.beta * 1e9:.4f} ns/B, gamma={params.gamma * 1e9:.4f} ns/B")
        print_table(rows, COLUMNS)
        print()
        print_table(summary, ("collective", "elems", "best", "time_us", "x_mpi", "x_gloo",
                              "mpi_target", "gloo_target"))
        write_json(args.json, {"suite": "collectives", "machine": machine(),
                               "clock": _clock.describe(),
                               "cost_params": asdict(params), "ranks": p,
                               "sizes": list(args.sizes), "rows": rows, "summary": summary,
                               "median_of": {str(s): repeats_for(s, args.repeats)[0]
                                             for s in args.sizes}})
    comm.barrier()
    return 0
