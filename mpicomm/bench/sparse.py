"""Sparse aggregation: dense allreduce vs Allgather Top-k, gTop-k and AR-Top-k (STAR).

Run under MPI, e.g. ``mpiexec -n 4 python -m mpicomm.bench sparse --json out.json``.

For every dense length d (``--sizes``, float32) and density (``--densities``; k =
max(1, ceil(density·d))) each rank draws a heavy-tailed "gradient"
``x_r = sqrt(c)·T_shared + sqrt(1-c)·T_r`` (Student-t, ``--df`` degrees of freedom;
``--correlation`` c of a component shared by all ranks, as real gradients are correlated
across workers) and the suite times, in one run (median over ``--repeats`` of the slowest
rank, :func:`mpicomm.bench._util.median_seconds`):

* ``compress``: the local top-k selection (:func:`mpicomm.compress.topk_select.topk_indices`) and
  the gather of its values; no communication;
* ``dense/ring``, ``dense/rabenseifner`` (mpicomm's own) and ``dense/mpi``
  (``MPI_Allreduce``) of the whole vector (timed once per d, repeated in each density's
  rows);
* ``allgather_topk``: :func:`mpicomm.sparse.topk_allgather` of the local top-k pairs
  (ring allgatherv + dense scatter-add);
* ``gtopk``: :func:`mpicomm.sparse.gtopk` of the same pairs (``overlap`` = fraction of
  its indices that the exact top-k of the sum also selects);
* ``artopk_star``: :func:`mpicomm.sparse.artopk` (``source="star"``, ring allreduce)
  given the source's precomputed top-k (``source_indices``), so the selection is not
  counted twice; ``artopk_star_tree``: the same with ``algorithm="tree"`` (recursive
  doubling), the latency-lean variant for small k.

Sparse rows time the collective given the local top-k; add ``compress`` for the whole
step. ``sent_B`` is the largest number of bytes any rank sent in one call
(``comm.traffic``; not available for ``mpi``); ``pred_B``/``pred_ms`` are the cost
model's per-rank bytes and time (:mod:`mpicomm.collectives.cost`) with alpha/beta/gamma
fitted in the same run (a ping-pong; on a busy machine the fit can be far off: fix them
with ``--alpha-us``/``--beta-ns``). A final table predicts the same rows at
``--predict-ranks`` (default 8) from the cost model alone: labelled as a prediction, not
a measurement.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import torch

from .. import clock
from .. import collectives as coll
from ..collectives import cost
from ..comm import Communicator, init
from ..compress.topk_select import topk_indices
from ..sparse import artopk, exact_topk, gtopk, topk_allgather
from . import _clock
from ._util import fractions, machine, median_seconds, positive_floats, print_table, write_json

DEFAULT_SIZES = (1_000_000, 10_000_000, 25_000_000)
DEFAULT_DENSITIES = (0.1, 0.01, 0.001)
DENSE = ("ring", "rabenseifner", "mpi")
COLUMNS = ("d", "density", "k", "method", "time_ms", "sent_B", "pred_ms", "pred_B",
           "x_dense", "x_ag")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=lambda t: [int(v) for v in positive_floats(t)],
                        default=list(DEFAULT_SIZES),
                        help="comma-separated dense lengths d (default 1e6,1e7,2.5e7)")
    parser.add_argument("--densities", type=fractions, default=list(DEFAULT_DENSITIES),
                        help="comma-separated densities k/d (default 0.1,0.01,0.001)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per row")
    parser.add_argument("--df", type=float, default=3.0, help="Student-t degrees of freedom")
    parser.add_argument("--correlation", type=float, default=0.5,
                        help="variance share of the component common to all ranks (0..1)")
    parser.add_argument("--predict-ranks", type=int, default=8,
                        help="rank count of the cost-model-only prediction table")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="use the default CostParams instead of fitting them")
    parser.add_argument("--alpha-us", type=float, default=None,
                        help="fix alpha (microseconds) instead of fitting it")
    parser.add_argument("--beta-ns", type=float, default=None,
                        help="fix beta (nanoseconds per byte) instead of fitting it")
    _clock.add_arguments(parser)


# ---------------------------------------------------------------------- model
def k_for(d: int, density: float) -> int:
    return max(1, math.ceil(density * d))


def predicted(method: str, d: int, k: int, p: int, c: cost.CostParams) -> tuple[float, float]:
    """(seconds, max bytes sent by one rank) the cost model gives for one call.

    Seconds: the communication part of the strategy's own prediction
    (:meth:`mpicomm.strategies.Strategy.predict_parts`, the one cost-model API), as the
    rows time the collective given the local top-k."""
    from ..strategies import ARTopK, Dense, GTopK, TopKAllgather

    p2 = 1 << (p.bit_length() - 1)
    lg2, fold = p2.bit_length() - 1, int(p != p2)
    s = 8  # int32 index + float32 value
    if p == 1:
        return 0.0, 0.0
    model = {
        "dense/ring": (Dense(algorithm="ring"), 2 * (p - 1) / p * 4 * d),
        # fold-in (non-power-of-two): the paired rank sends its whole vector once more
        "dense/rabenseifner": (Dense(algorithm="rabenseifner"),
                               2 * (p2 - 1) / p2 * 4 * d + fold * 4 * d),
        "dense/mpi": (Dense(algorithm="mpi"), 2 * (p - 1) / p * 4 * d),
        "allgather_topk": (TopKAllgather(k=k), (p - 1) * k * s),
        "gtopk": (GTopK(k=k), (lg2 + fold) * k * s),
        "artopk_star": (ARTopK(k=k), math.ceil(math.log2(p)) * 4 * k
                        + 2 * (p - 1) / p * 4 * k),
        "artopk_star_tree": (ARTopK(k=k, algorithm="tree"),
                             math.ceil(math.log2(p)) * 4 * k + (lg2 + fold) * 4 * k),
    }
    if method not in model:
        return 0.0, 0.0  # compress: no communication
    strategy, nbytes = model[method]
    return strategy.predict_parts(d, 4, p, c, cost.ComputeParams())["comm"], nbytes


# ---------------------------------------------------------------------- inputs
def gradient(d: int, rank: int, df: float, correlation: float, seed: int,
             chunk: int = 1 << 20) -> torch.Tensor:
    """This rank's float32 vector: ``sqrt(c)·shared + sqrt(1-c)·own`` of Student-t draws
    (``df``), ``shared`` the same on every rank. Drawn ``chunk`` elements at a time (a
    few MB of float64 at once, so that many ranks on one machine fit in memory); the
    values do not depend on ``chunk``."""
    shared_rng = np.random.default_rng(seed)
    own_rng = np.random.default_rng(seed + 1 + rank)
    a, b = math.sqrt(correlation), math.sqrt(1 - correlation)
    x = np.empty(d, dtype=np.float32)
    for lo in range(0, d, chunk):
        n = min(chunk, d - lo)
        x[lo:lo + n] = a * shared_rng.standard_t(df, n) + b * own_rng.standard_t(df, n)
    return torch.from_numpy(x)


# ---------------------------------------------------------------------- one case
def measure(fn: Callable[[], Any], comm: Communicator, repeats: int,
            warmup: int) -> tuple[float, int]:
    """(median seconds, max over ranks of the bytes one call sent)."""
    with comm.traffic.measure() as moved:
        fn()
    sent = moved.sent_bytes
    seconds = median_seconds(fn, comm, repeats, max(0, warmup - 1))
    return seconds, int(comm.allreduce_value(sent, "max"))


def bench_dense(x: torch.Tensor, comm: Communicator,
                args: argparse.Namespace) -> dict[str, tuple[float, int | None]]:
    """Dense allreduce of the whole vector (independent of the density: timed once)."""
    xn = x.numpy()
    timed: dict[str, tuple[float, int | None]] = {}
    for algorithm in DENSE:
        seconds, sent = measure(lambda a=algorithm: coll.allreduce(xn, algorithm=a, comm=comm),
                                comm, args.repeats, args.warmup)
        timed[f"dense/{algorithm}"] = (seconds, None if algorithm == "mpi" else sent)
    return timed


def bench_case(d: int, density: float, x: torch.Tensor, comm: Communicator,
               args: argparse.Namespace, params: cost.CostParams,
               dense: dict[str, tuple[float, int | None]]) -> list[dict[str, Any]]:
    p, k = comm.size, k_for(d, density)
    idx = topk_indices(x, k)
    vals = x[idx]
    timed: dict[str, tuple[float, int | None]] = {}
    timed["compress"] = (median_seconds(lambda: x[topk_indices(x, k)], comm, args.repeats,
                                        args.warmup), 0)
    timed.update(dense)
    timed["allgather_topk"] = measure(lambda: topk_allgather(idx, vals, d, comm=comm),
                                      comm, args.repeats, args.warmup)
    timed["gtopk"] = measure(lambda: gtopk(idx, vals, k, comm=comm, size=d), comm,
                             args.repeats, args.warmup)
    for name, algorithm in (("artopk_star", "ring"), ("artopk_star_tree", "tree")):
        step = [0]

        def star(a: str = algorithm, step: list[int] = step) -> Any:
            step[0] += 1
            return artopk(x, k, step[0], comm=comm, algorithm=a, source_indices=idx)

        timed[name] = measure(star, comm, args.repeats, args.warmup)
    gi, _ = gtopk(idx, vals, k, comm=comm, size=d)
    ei, _ = exact_topk(idx, vals, k, comm=comm, size=d)
    overlap = float(np.isin(gi.numpy(), ei.numpy()).sum()) / max(1, ei.shape[0])

    best = min(("dense/ring", "dense/rabenseifner"), key=lambda m: timed[m][0])
    rows = []
    for method, (seconds, sent) in timed.items():
        pred_s, pred_b = predicted(method, d, k, p, params)
        rows.append({
            "d": d, "density": density, "k": k, "ranks": p,
            "method": method + (" *" if method == best else ""),
            "seconds": seconds, "time_ms": seconds * 1e3, "sent_B": sent,
            "pred_s": pred_s, "pred_ms": pred_s * 1e3, "pred_B": pred_b,
            "x_dense": seconds / timed[best][0],
            "x_ag": seconds / timed["allgather_topk"][0],
        })
        if method == "gtopk":
            rows[-1]["overlap"] = overlap
    return rows


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (d, density): the seed claims' ratios, measured (time and bytes)."""
    out = []
    for d, density in sorted({(r["d"], r["density"]) for r in rows}):
        g = {r["method"].rstrip(" *"): r for r in rows
             if (r["d"], r["density"]) == (d, density)}
        dense = min((g["dense/ring"], g["dense/rabenseifner"]), key=lambda r: r["seconds"])
        ag, gt, ar = g["allgather_topk"], g["gtopk"], g["artopk_star"]
        tree = g["artopk_star_tree"]

        def ratio(a: Any, b: Any) -> float | None:
            return None if not b else a / b

        out.append({
            "d": d, "density": density,
            "gtopk/ag_t": ratio(gt["seconds"], ag["seconds"]),
            "gtopk/ag_B": ratio(gt["sent_B"], ag["sent_B"]),
            "gtopk/dense_t": ratio(gt["seconds"], dense["seconds"]),
            "gtopk/dense_B": ratio(gt["sent_B"], dense["sent_B"]),
            "artopk/ag_t": ratio(ar["seconds"], ag["seconds"]),
            "artopk/ag_B": ratio(ar["sent_B"], ag["sent_B"]),
            "artree/ag_t": ratio(tree["seconds"], ag["seconds"]),
            "gtopk_overlap": gt.get("overlap"),
        })
    return out


def prediction(sizes: list[int], densities: list[float], p: int,
               params: cost.CostParams) -> list[dict[str, Any]]:
    """Cost-model-only rows at ``p`` ranks (no measurement)."""
    out = []
    for d in sizes:
        for density in densities:
            k = k_for(d, density)
            model = {m: predicted(m, d, k, p, params)
                     for m in ("dense/ring", "allgather_topk", "gtopk", "artopk_star",
                               "artopk_star_tree")}
            ag_s, ag_b = model["allgather_topk"]
            dn_s, dn_b = model["dense/ring"]
            gt_s, gt_b = model["gtopk"]
            ar_s, ar_b = model["artopk_star"]
            tr_s, _ = model["artopk_star_tree"]
            out.append({"ranks": p, "d": d, "density": density, "k": k,
                        "dense_ms": dn_s * 1e3, "ag_ms": ag_s * 1e3, "gtopk_ms": gt_s * 1e3,
                        "artopk_ms": ar_s * 1e3,
                        "gtopk/ag_t": gt_s / ag_s, "gtopk/ag_B": gt_b / ag_b,
                        "gtopk/dense_t": gt_s / dn_s, "gtopk/dense_B": gt_b / dn_b,
                        "artopk/ag_t": ar_s / ag_s, "artopk/ag_B": ar_b / ag_b,
                        "artree/ag_t": tr_s / ag_s})
    return out


# ---------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    _clock.apply(args)
    comm = init()
    _clock.measure_costs(comm)
    if clock.started():     # deterministic: one timed run per row
        args.repeats, args.warmup = 1, 0
    if args.no_calibrate:
        params = cost.CostParams()
    else:
        from ..collectives import calibrate

        params = calibrate.measure(comm)
    if args.alpha_us is not None or args.beta_ns is not None:
        params = cost.CostParams(
            alpha=params.alpha if args.alpha_us is None else args.alpha_us * 1e-6,
            beta=params.beta if args.beta_ns is None else args.beta_ns * 1e-9,
            gamma=params.gamma)
    rows: list[dict[str, Any]] = []
    for d in args.sizes:
        x = gradient(d, comm.rank, args.df, args.correlation, seed=1234 + d)
        dense = bench_dense(x, comm, args)
        for density in args.densities:
            rows.extend(bench_case(d, density, x, comm, args, params, dense))
        del x
    summary = targets(rows)
    predict = prediction(args.sizes, args.densities, args.predict_ranks, params)
    if comm.rank == 0:
        print(f"# {comm.size} ranks, float32, Student-t df={args.df}, correlation="
              f"{args.correlation}; median of {args.repeats}; fitted alpha="
              f"{params.alpha * 1e6:.2f} us, beta={params.beta * 1e9:.4f} ns/B; "
              "* = best own dense algorithm")
        print_table(rows, COLUMNS)
        print("\n# measured ratios (t: median time, B: max bytes sent by a rank)")
        print_table(summary, ("d", "density", "gtopk/ag_t", "gtopk/ag_B", "gtopk/dense_t",
                              "gtopk/dense_B", "artopk/ag_t", "artopk/ag_B",
                              "artree/ag_t", "gtopk_overlap"))
        print(f"\n# PREDICTED by the cost model at {args.predict_ranks} ranks "
              "(same fitted alpha/beta; not a measurement)")
        print_table(predict, ("ranks", "d", "density", "k", "dense_ms", "ag_ms", "gtopk_ms",
                              "artopk_ms", "gtopk/ag_t", "gtopk/ag_B", "gtopk/dense_t",
                              "gtopk/dense_B", "artopk/ag_t", "artopk/ag_B",
                              "artree/ag_t"))
        write_json(args.json, {"suite": "sparse", "machine": machine(), "ranks": comm.size,
                               "clock": _clock.describe(),
                               "cost_params": asdict(params), "options": dict(vars(args)),
                               "rows": rows, "measured_ratios": summary,
                               "predicted": predict})
    comm.barrier()
    return 0
