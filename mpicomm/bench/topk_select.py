"""Top-k selection: torch.topk vs mpicomm's exact and approximate selections, CPU or GPU.

One process (no MPI traffic), e.g. on a GPU machine::

    python -m mpicomm.bench selection --device cuda --json selection.json

For every length d (``--sizes``, float32 Student-t with ``--df`` degrees of freedom, as
gradients are heavy-tailed) and density (``--densities``; k = ceil(density·d)) it times,
median of ``--repeats`` runs (CUDA events on a GPU, ``perf_counter`` on the CPU):

* ``torch.topk``: ``torch.topk(|x|, k, sorted=False)`` (ties broken arbitrarily: not
  mpicomm's order; the baseline);
* ``topk_indices``: :func:`mpicomm.compress.topk_select.topk_indices` (what the
  compressors call: threshold + compaction on CUDA, sample prefilter + partial selection
  on the CPU);
* ``prefilter``: the sample prefilter + ``torch.topk`` over the candidates (the CPU
  path, also timed on the GPU for comparison);
* ``threshold``: :func:`mpicomm.compress.topk_select.topk_threshold` (exact, threshold +
  compaction);
* ``approx``: :func:`mpicomm.compress.topk_select.topk_indices_approx` (recall reported);
* ``TopK.compress``: the whole compressor (selection + gather of the values).

``x_topk`` is torch.topk's time divided by the row's (above 1: faster than torch.topk).
Targets on an H100 at d = 2.5e7: ``threshold`` (exact) x_topk >= 3 and
``approx`` x_topk >= 10 with recall >= 0.95. Every exact row is checked against
``topk_indices`` (``exact`` column).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable

import torch

from ..compress import TopK
from ..compress.topk_select import _topk_torch, topk_indices, topk_indices_approx, topk_threshold
from ._util import UsageError, fractions, machine, positive_floats, print_table, write_json

COLUMNS = ("device", "d", "density", "k", "method", "time_ms", "x_topk", "exact", "recall")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument("--sizes", type=lambda t: [int(v) for v in positive_floats(t)],
                        default=[25_000_000], help="comma-separated lengths (default 2.5e7)")
    parser.add_argument("--densities", type=fractions, default=[0.001, 0.01],
                        help="comma-separated densities (default 0.001,0.01)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per row")
    parser.add_argument("--df", type=float, default=3.0, help="Student-t degrees of freedom")


def _timer(device: torch.device, repeats: int, warmup: int) -> Callable[[Callable[[], Any]],
                                                                         float]:
    def timed(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    return timed


def _methods(x: torch.Tensor, k: int) -> dict[str, Callable[[], Any]]:
    compressor = TopK(k=k)
    return {
        "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
        "topk_indices": lambda: topk_indices(x, k),
        "prefilter": lambda: _topk_torch(x, k),
        "threshold": lambda: topk_threshold(x, k),
        "approx": lambda: topk_indices_approx(x, k),
        "TopK.compress": lambda: compressor.compress(x, name="g"),
    }


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if args.repeats < 1 or args.warmup < 0:
        raise UsageError("--repeats must be >= 1 and --warmup >= 0")
    timed = _timer(device, args.repeats, args.warmup)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for d in args.sizes:
        x = torch.distributions.StudentT(args.df).sample((d,)).to(device)
        for density in args.densities:
            k = max(1, math.ceil(density * d))
            want = topk_indices(x, k)
            methods = _methods(x, k)
            base = timed(methods["torch.topk"])
            for name, fn in methods.items():
                seconds = base if name == "torch.topk" else timed(fn)
                row: dict[str, Any] = {"device": str(device), "d": d, "density": density,
                                       "k": k, "method": name,
                                       "time_ms": round(seconds * 1e3, 3),
                                       "x_topk": round(base / seconds, 2)}
                if name in ("topk_indices", "prefilter", "threshold"):
                    row["exact"] = bool(torch.equal(fn(), want))
                if name == "approx":
                    got = fn()
                    row["recall"] = round(float(torch.isin(want, got).sum()) / k, 4)
                rows.append(row)
    print_table(rows, COLUMNS)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    write_json(args.json, {"suite": "selection", "machine": dict(machine(), gpu=gpu),
                           "device": str(device), "gpu": gpu, "torch": torch.__version__,
                           "rows": rows})
    return 0 if all(r.get("exact", True) for r in rows) else 1
