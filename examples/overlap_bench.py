"""Does GradientSync hide communication behind backward?  Compare, in one run:

* compute:  forward + backward with no communication (``sync.no_sync()``);
* comm:     the same buckets averaged on their own, after backward (what the
            communication thread does: the agreement reduction, ``strategy.aggregate``
            and the write-back), with nothing to overlap;
* step:     forward + backward + ``sync.wait()``, the synchronized step;
* raw:      the floor for comm: one in-place allreduce (``op="avg"``) per bucket of
            persistent flat buffers of the same sizes, nothing else.

``comm_over_raw`` is the communication path's overhead over that floor (fusion copies,
the agreement reduction, the write-back).

Without overlap, step ≈ compute + comm; with perfect overlap, step ≈ max(compute, comm)
plus the last bucket's communication. From the timeline it also reports which share of
the communication thread's busy time lay before backward ended (the last bucket-ready
event), i.e. how much communication ran *concurrently* with backward, whether or not the
machine had the spare cores to make that concurrency pay. The three are measured in turn
within every repetition, so machine noise hits them alike; medians are reported::

    mpiexec -n 2 python examples/overlap_bench.py --layers 8 --width 1024 --bucket-mb 4.1

On a machine with fewer cores than ranks x 2 threads, the communication thread competes
with backward for a core (and MPI's shared-memory progress spins), which limits the gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

import mpicomm
from mpicomm.collectives import allreduce
from mpicomm.observe.timeline import Timeline
from mpicomm.strategies import Dense
from mpicomm.torch import GradientSync


def build(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=False)
    model(x).square().mean().backward()


def comm_alone(model: torch.nn.Module, bucket_names: list[list[str]], strategy: Dense,
               comm: mpicomm.Communicator) -> None:
    """Average every bucket in order on this thread, as the communication thread would
    (agreement reduction, then the strategy in place on the gradients)."""
    params = dict(model.named_parameters())
    for names in bucket_names:
        grads = [params[n].grad for n in names]
        flags = np.zeros(1 + len(grads), dtype=np.uint8)
        flags[0] = not all(bool(torch.isfinite(g).all()) for g in grads)
        allreduce(flags, op="max", algorithm="mpi", comm=comm)
        strategy.aggregate_into(grads, names)


def raw_allreduce(flats: list[torch.Tensor], algorithm: str, comm: mpicomm.Communicator
                  ) -> None:
    """The floor: one in-place allreduce per bucket of persistent flat buffers."""
    for flat in flats:
        allreduce(flat, op="avg", algorithm=algorithm, comm=comm, out=flat)


def overlapped_fraction(events: list[dict]) -> float:
    """Share of the communication thread's busy time that lies before backward's end
    (the last bucket-ready event), from one step's timeline."""
    end = max(e["ts"] for e in events if e["cat"] == "bucket")
    spans = [e for e in events if e["cat"] == "comm"]
    busy = sum(e["dur"] for e in spans)
    before = sum(max(0.0, min(e["ts"] + e["dur"], end) - e["ts"]) for e in spans)
    return before / busy if busy else 0.0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=4.1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--algorithm", default="auto", help="Dense allreduce algorithm")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in seconds (Python's default is 0.005)")
    ap.add_argument("--json", help="write the result here (rank 0)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    comm = mpicomm.init()
    model = build(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    times: dict[str, list[float]] = {"compute": [], "comm": [], "step": [], "raw": []}
    overlapped: list[float] = []
    tl = Timeline()
    with GradientSync(model, Dense(algorithm=args.algorithm), bucket_mb=args.bucket_mb,
                      comm=comm, timeline=tl) as sync:
        side_comm = comm.dup()
        strategy = Dense(side_comm, algorithm=args.algorithm)
        params = dict(model.named_parameters())
        flats = [torch.zeros(sum(params[n].numel() for n in names))
                 for names in sync.buckets]
        for i in range(args.warmup + args.repeats):
            comm.barrier()
            t = time.perf_counter()
            with sync.no_sync():
                backward(model, x)
            compute = time.perf_counter() - t

            side_comm.barrier()
            t = time.perf_counter()
            comm_alone(model, sync.buckets, strategy, side_comm)
            alone = time.perf_counter() - t

            side_comm.barrier()
            t = time.perf_counter()
            raw_allreduce(flats, args.algorithm, side_comm)
            raw = time.perf_counter() - t

            comm.barrier()
            tl.clear()
            t = time.perf_counter()
            backward(model, x)
            sync.wait()
            step = time.perf_counter() - t
            if i >= args.warmup:
                overlapped.append(overlapped_fraction(tl.events()))
                times["compute"].append(compute)
                times["comm"].append(alone)
                times["step"].append(step)
                times["raw"].append(raw)
        side_comm.free()
        # the slowest rank decides a synchronous step: report the max over ranks
        med = {k: comm.allreduce_value(statistics.median(v), "max") for k, v in times.items()}
        result = {
            "ranks": comm.size,
            "model_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            "buckets": len(sync.buckets),
            "bucket_mb": args.bucket_mb,
            "algorithm": args.algorithm,
            "switch_interval_s": sys.getswitchinterval(),
            "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
            "sum_ms": round((med["compute"] + med["comm"]) * 1e3, 2),
            "comm_over_raw": round(med["comm"] / med["raw"], 3),
            "step_over_sum": round(med["step"] / (med["compute"] + med["comm"]), 3),
            "hidden_fraction_of_comm": round(
                (med["compute"] + med["comm"] - med["step"]) / med["comm"], 3),
            "step_below_sum_in_repeats": comm.allreduce_value(sum(
                s < c + m for s, c, m in zip(times["step"], times["compute"], times["comm"])),
                "min"),
            "comm_busy_before_backward_end": round(comm.allreduce_value(
                statistics.median(overlapped), "min"), 3),
            "repeats": args.repeats,
        }
    if comm.rank == 0:
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
