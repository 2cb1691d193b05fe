"""Step time of a small VGG-style CNN: compute alone, mpicomm's GradientSync with several
strategies, and PyTorch DDP over gloo, all on the same device and data.

    mpiexec -n 2 python examples/gpu_e2e.py --json e2e-2.json            # on a GPU
    mpiexec -n 2 python examples/gpu_e2e.py --device cpu --width 0.125 --batch 8 \\
        --image 16 --steps 3 --warmup 1                                 # a CPU smoke run

Every rank builds the same network (conv-BN-ReLU blocks with widths 64..512 times
``--width``, max pooling, a linear head; 6.3M parameters at width 1), feeds it one fixed
batch of random images (timing only: nothing is learned), and times ``--steps`` steps
after ``--warmup`` untimed ones. A step is ``zero_grad``, forward, backward and the
optimizer step (SGD with momentum); with GradientSync the averaging overlaps backward
(``sync.step(opt)``), with DDP it is DDP's own bucketed allreduce over gloo. The time of a
step is the slowest rank's (the device is synchronized, then the ranks), reported as the
median in milliseconds. With several ranks on one GPU the ranks share it, so "compute
only" already includes their contention.

The JSON (``--json``, rank 0) is a suite result that ``python -m mpicomm.bench report``
renders as a table: one row per method with ``step_ms``, ``x_compute`` (over compute
only) and ``x_ddp`` (over DDP), and a ``summary`` of the GPU targets: dense at most
0.8x DDP, every compressed strategy faster than dense, the best one within 1.3x of
compute only.
"""

from __future__ import annotations

import argparse
import platform
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mpicomm
from mpicomm.bench._util import machine, median_seconds, print_table, write_json
from mpicomm.torch import GradientSync, process_group

DEFAULT_STRATEGIES = "dense,gtopk,artopk,powersgd"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda: every rank uses its local GPU (rank mod device count)")
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                    help="GradientSync strategies, comma-separated (mpicomm.strategies.make "
                         "names)")
    ap.add_argument("--width", type=float, default=1.0, help="channel width multiplier")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image", type=int, default=32, help="image side in pixels")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps per method")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="GradientSync buckets")
    ap.add_argument("--no-ddp", action="store_true", help="skip DDP over gloo")
    ap.add_argument("--json", default=None, help="write the suite result here (rank 0)")
    args = ap.parse_args(argv)
    if min(args.batch, args.image, args.steps) < 1 or args.warmup < 0 or args.width <= 0:
        ap.error("--batch, --image, --steps and --width must be positive, --warmup >= 0")
    return args


def make_model(width: float, device: torch.device) -> nn.Module:
    """The same weights on every rank (seeded), VGG-like: 7 conv blocks and a head."""
    torch.manual_seed(0)

    def c(n: int) -> int:
        return max(1, round(n * width))

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU()]

    layers = [*block(3, c(64)), *block(c(64), c(128)), nn.MaxPool2d(2),
              *block(c(128), c(256)), nn.MaxPool2d(2), *block(c(256), c(512)),
              *block(c(512), c(512)), nn.MaxPool2d(2), *block(c(512), c(512)),
              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c(512), 10)]
    return nn.Sequential(*layers).to(device)


def median_step_ms(step: Callable[[], None], comm: mpicomm.Communicator,
                   device: torch.device, steps: int, warmup: int) -> float:
    """Median step in ms over ``steps`` (slowest rank per step, after ``warmup``); a CUDA
    step is timed up to the end of its kernels."""
    def settled_step() -> None:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return round(median_seconds(settled_step, comm, repeats=steps, warmup=warmup) * 1e3, 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    comm = mpicomm.init()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
        device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    loss_fn = nn.CrossEntropyLoss()
    timed = lambda step: median_step_ms(step, comm, device, args.steps,  # noqa: E731
                                        args.warmup)

    rows: list[dict[str, Any]] = []
    model = make_model(args.width, device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def local() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    rows.append({"method": "compute only", "step_ms": timed(local)})

    def synced(name: str) -> float:
        m = make_model(args.width, device)
        o = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        with GradientSync(m, strategy=name, comm=comm, bucket_mb=args.bucket_mb) as sync:
            def step() -> None:
                o.zero_grad()
                loss_fn(m(x), y).backward()
                sync.step(o)

            return timed(step)

    for name in [s for s in args.strategies.split(",") if s]:
        rows.append({"method": f"GradientSync {name}", "step_ms": synced(name)})
    if not args.no_ddp:
        with process_group(comm, "gloo"):
            ddp = DistributedDataParallel(make_model(args.width, device),
                                          device_ids=[device] if device.type == "cuda"
                                          else None)
            od = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

            def ddp_step() -> None:
                od.zero_grad()
                loss_fn(ddp(x), y).backward()
                od.step()

            rows.append({"method": "DDP over gloo", "step_ms": timed(ddp_step)})
    return summarize(rows, comm, device, params, args)


def summarize(rows: list[dict[str, Any]], comm: mpicomm.Communicator, device: torch.device,
              params: int, args: argparse.Namespace) -> dict[str, Any]:
    by = {r["method"]: r["step_ms"] for r in rows}
    compute, ddp = by["compute only"], by.get("DDP over gloo")
    for r in rows:
        r["x_compute"] = round(r["step_ms"] / compute, 3)
        if ddp:
            r["x_ddp"] = round(r["step_ms"] / ddp, 3)
    dense = by.get("GradientSync dense")
    compressed = {k: v for k, v in by.items()
                  if k.startswith("GradientSync ") and k != "GradientSync dense"}
    summary: dict[str, Any] = {}
    if dense and ddp:
        summary["dense_over_ddp"] = round(dense / ddp, 3)
        summary["dense_at_most_0.8x_ddp"] = dense <= 0.8 * ddp
    if dense and compressed:
        summary["compressed_faster_than_dense"] = all(v < dense for v in compressed.values())
    if compressed:
        best = min(compressed, key=compressed.__getitem__)
        summary["best_compressed"] = best.removeprefix("GradientSync ")
        summary["best_over_compute"] = round(compressed[best] / compute, 3)
        summary["best_within_1.3x_compute"] = compressed[best] <= 1.3 * compute
    info = machine()
    info["device"] = (torch.cuda.get_device_name(device) if device.type == "cuda"
                      else f"cpu ({platform.processor() or platform.machine()})")
    info["torch"] = torch.__version__
    return {"suite": "gpu_e2e", "machine": info, "ranks": comm.size, "params": params,
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    if mpicomm.init().rank == 0:
        print(f"{result['ranks']} ranks on {result['machine']['device']}, "
              f"{result['params']} parameters, batch {args.batch}")
        print_table(result["rows"], ("method", "step_ms", "x_compute", "x_ddp"))
        print("targets:", result["summary"])
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
