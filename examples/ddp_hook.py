"""An ordinary PyTorch DDP script running any mpicomm strategy through a DDP comm hook.

The lines marked ``# mpicomm`` are all that differs from a DDP script launched with
``torchrun``: the process group comes from the MPI ranks, and the gradient buckets that
DDP would allreduce go through an mpicomm strategy instead::

    mpiexec -n 4 python examples/ddp_hook.py                          # DDP's own allreduce
    mpiexec -n 4 python examples/ddp_hook.py --strategy dense         # mpicomm allreduce
    mpiexec -n 4 python examples/ddp_hook.py --strategy gtopk --density 0.05
    mpiexec -n 4 python examples/ddp_hook.py --strategy dense,gtopk --density 0.05
    mpiexec -n 4 python examples/ddp_hook.py --strategy gtopk --density 0.05 --momentum-correction

Task: the ``digits-mlp`` workload of :mod:`mpicomm.workloads` (scikit-learn's bundled
digits, no download, a fixed 80/20 split, an MLP), SGD with momentum; each rank trains on
a disjoint shard of every epoch's permutation. Rank 0
prints the test accuracy, and the bytes each rank sent through the hook.

``--momentum-correction`` hands the optimizer to the hook (``optimizer=opt``) and asks
the sparsifiers for DGC's momentum correction (``momentum_correction="optimizer"``; by
name gTop-k and AR-Top-k default to plain error feedback), which takes SGD's momentum
over; the runs then match ``GradientSync`` ones. On these short digits runs plain error
feedback did better (3 ranks, 6 epochs, density 0.05: gTop-k 0.969 without it, 0.944
with it; dense 0.972).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import mpicomm  # mpicomm
import mpicomm.torch  # mpicomm
from mpicomm import workloads

#: Strategies with DGC's momentum correction (``--momentum-correction`` turns it on).
SPARSIFIERS = ("topk", "gtopk", "artopk")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="DDP on the digits with an mpicomm comm hook")
    ap.add_argument("--strategy", default=None,
                    help="mpicomm strategy for the hook, or several separated by commas "
                         "(trained one after the other; default: no hook, DDP's allreduce)")
    ap.add_argument("--density", type=float, default=None,
                    help="fraction of entries a sparsifying strategy sends")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum-correction", action="store_true",
                    help="hand the optimizer to the hook (optimizer=) and ask the "
                         "sparsifiers for DGC's momentum correction: they then keep SGD's "
                         "momentum in their error-feedback memory; without it gTop-k and "
                         "AR-Top-k use plain error feedback and SGD keeps its momentum "
                         "(Top-k still takes it over once it has the optimizer)")
    ap.add_argument("--json", metavar="PATH", default=None, help="summary as JSON (rank 0)")
    return ap.parse_args(argv)


def train(strategy: str | None, args: argparse.Namespace, comm: mpicomm.Communicator
          ) -> dict[str, float | int | str]:
    """One DDP training run; ``strategy=None`` uses DDP's own allreduce (no hook)."""
    task = workloads.get("digits-mlp", rank=comm.rank, size=comm.size, seed=0,
                         batch=args.batch_size)
    model = DistributedDataParallel(task.model)  # broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hook = None
    if strategy is not None:
        options: dict[str, Any] = {} if args.density is None or strategy == "dense" else {
            "density": args.density}
        if args.momentum_correction:
            options["optimizer"] = opt
            if strategy in SPARSIFIERS:  # gTop-k and AR-Top-k by name: plain EF otherwise
                options["momentum_correction"] = "optimizer"
        hook = mpicomm.torch.ddp_comm_hook(strategy, comm, **options)  # mpicomm
        model.register_comm_hook(hook.state, hook)  # mpicomm

    start = time.perf_counter()
    for epoch in range(args.epochs):
        for x, y in task.shard.batches(epoch):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    accuracy = task.evaluate(model.module, None)["accuracy"]
    result = {"strategy": strategy or "ddp", "test_accuracy": accuracy,
              "train_s": time.perf_counter() - start,
              "hook_sent_bytes": hook.state.stats.sent_bytes if hook else 0}
    if hook is not None:
        hook.state.close()  # mpicomm
    return result


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share this machine's cores
    comm = mpicomm.init()  # mpicomm
    mpicomm.torch.init_process_group(comm)  # mpicomm: gloo group, rank and size from MPI
    names = [None] if args.strategy is None else args.strategy.split(",")
    runs = {}
    for name in names:
        r = train(name, args, comm)
        runs[str(r["strategy"])] = r
        if comm.rank == 0:
            print(f"DDP {r['strategy']} on {comm.size} ranks, {args.epochs} epochs: test "
                  f"accuracy {r['test_accuracy']:.4f}, {r['train_s']:.1f} s, hook sent "
                  f"{r['hook_sent_bytes'] / 1e6:.2f} MB per rank", flush=True)
    mpicomm.torch.destroy_process_group(comm)  # mpicomm: after every rank is done
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": comm.size, "epochs": args.epochs, "runs": runs}, f, indent=2)
    return runs


if __name__ == "__main__":
    main()
