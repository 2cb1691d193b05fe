"""examples/train.py in parameter-server mode: the same workload, loop and summary.

The last ``--servers`` ranks become parameter servers (they hold the model and apply SGD
with momentum and weight decay on their shards); the other ranks are workers that train
on disjoint shards of the data, push gradients and pull parameters through
:class:`mpicomm.torch.PSOptimizer`::

    mpiexec -n 5 python examples/train_ps.py --servers 1 --mode ssp --staleness 2
    mpiexec -n 5 python examples/train_ps.py --servers 2 --mode sync
    mpiexec -n 4 python examples/train_ps.py --servers 1 --mode async --slow-worker 0
    mpiexec -n 3 python examples/train_ps.py --servers 1 --compressor topk --density 0.01
    mpiexec -n 3 python examples/train_ps.py --servers 1 --compressor powersgd --rank 4 \
        --pull-compressor qsgd

``--slow-worker R --slow-factor F`` makes worker ``R`` a straggler: after each step's
computation it sleeps ``F - 1`` times that computation's duration. Worker 0 prints the
summary of examples/train.py (the data set is sharded over the workers only), with each
worker's pushed and pulled bytes against a dense ring allreduce over the workers (which
sends and receives as many bytes as it reduces), plus the servers' counters (staleness,
updates, idle time).

``--checkpoint-dir DIR`` (default ``$MPICOMM_CHECKPOINT_DIR``), ``--checkpoint-every N``
and ``--save-model PATH`` work as in examples/train.py; worker 0 also checkpoints the
servers' shards, optimizer state and per-worker sequence numbers
(:meth:`mpicomm.ps.KVStore.snapshot`), so that after ``python -m mpicomm run --restarts
K`` every push is applied exactly once::

    python -m mpicomm run -n 4 --servers 1 --restarts 2 --checkpoint-dir ckpt -- \
        python examples/train_ps.py --mode sync --save-model final.pt
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from mpicomm.bench.harness import build  # noqa: E402
from mpicomm.bench.sync import PSMethod  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import summary_text  # noqa: E402  (examples/summary_text.py)
import train as peer  # noqa: E402  (examples/train.py: data, model, loop)
from recipe_options import add_recipe_arguments, fill_recipe  # noqa: E402  (examples/)

import mpicomm  # noqa: E402
from mpicomm import workloads  # noqa: E402
from mpicomm.cli import ps_servers  # noqa: E402
from mpicomm.compress import REGISTRY, make  # noqa: E402
from mpicomm.ps import MODES, KVStore  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = peer.RankZeroParser(
        prog=os.path.basename(__file__),
        description="Train an MLP on scikit-learn's digits through mpicomm's parameter "
                    "server (run under mpiexec; worker 0 prints the summary).")
    ap.add_argument("--servers", type=int, default=ps_servers(1),
                    help="server ranks, the last ones (default: python -m mpicomm run "
                         "--servers S, else 1)")
    ap.add_argument("--mode", choices=MODES, default="sync", help="consistency model")
    ap.add_argument("--staleness", type=int, default=0, help="SSP bound (with --mode ssp)")
    ap.add_argument("--compressor", default=None, choices=sorted(REGISTRY),
                    help="compress pushes (error feedback on the worker)")
    ap.add_argument("--pull-compressor", default=None, choices=sorted(REGISTRY),
                    help="compress pulls (deltas to each worker's copy, kept by the servers)")
    ap.add_argument("--density", type=float, default=0.01, help="for topk/randomk")
    ap.add_argument("--rank", type=int, default=4, help="for powersgd")
    ap.add_argument("--slow-worker", type=int, default=None, help="make this worker slow")
    ap.add_argument("--slow-factor", type=float, default=3.0,
                    help="the slow worker's step takes this many times as long")
    ap.add_argument("--workload", default="digits-mlp",
                    help="a workload of python -m mpicomm.bench workloads")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a workload option (repeatable)")
    add_recipe_arguments(ap)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", default=None)
    ap.add_argument("--no-progress", action="store_true")
    peer.add_checkpoint_arguments(ap)
    args = ap.parse_args(argv)
    fill_recipe(ap, args)
    if args.hidden < 1:
        ap.error("--hidden must be >= 1")
    if args.rank < 1:
        ap.error("--rank must be >= 1")
    if args.slow_factor < 1:
        ap.error("--slow-factor must be >= 1")
    peer.check_checkpoint_arguments(ap, args)
    try:
        args.options = peer.parse_options(args.option)
    except ValueError as exc:
        ap.error(str(exc))
    if args.workload == "digits-mlp":
        args.options.setdefault("hidden", args.hidden)
    # what examples/train.py's summary reads, with this script's meaning: gradients
    # every step (no local SGD)
    args.local_sgd = "none"
    args.strategy = f"ps-{args.mode}"
    return args


def make_compressor(name: str | None, args: argparse.Namespace) -> Any:
    if name is None:
        return None
    if name in ("topk", "randomk", "sampled_topk"):
        return make(name, density=args.density)
    if name == "powersgd":
        return make(name, rank=args.rank)
    return make(name)


def traffic_summary(worker_stats: list[dict[str, Any]], summary: dict[str, Any]
                    ) -> dict[str, Any]:
    """Every worker's pushed and pulled bytes against a dense ring allreduce over the
    workers, which sends and receives ``2(W-1)/W·d·itemsize`` bytes each per step (what
    ``summary["dense_bytes_per_rank"]`` holds for the whole run)."""
    pushed = [s["bytes_pushed"] for s in worker_stats]
    pulled = [s["bytes_pulled"] for s in worker_stats]
    total = [a + b for a, b in zip(pushed, pulled)]
    mean = sum(total) / len(total)
    dense = summary["dense_bytes_per_rank"]
    mb = summary_text.megabytes
    return {
        "pushed_bytes_per_worker": sum(pushed) / len(pushed),
        "pulled_bytes_per_worker": sum(pulled) / len(pulled),
        "sent_bytes_per_rank": mean,       # pushed + pulled, per worker
        "sent_bytes_max_rank": max(total),
        "compression": 2 * dense / mean if mean else None,
        "traffic": [
            f"per worker        pushed {mb(sum(pushed) / len(pushed))} + pulled "
            f"{mb(sum(pulled) / len(pulled))} = {mb(mean)} (max worker {mb(max(total))})",
            f"dense allreduce   sends {mb(dense)} and receives {mb(dense)} per worker for the "
            f"same steps ({mb(2 * dense)}): {summary_text.compare_bytes(mean, 2 * dense)}",
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    comm = mpicomm.init()
    peer.setup_logging(comm.rank)
    if not 1 <= args.servers < comm.size:
        peer.RankZeroParser(prog=os.path.basename(__file__)).error(
            f"--servers {args.servers} needs at least {max(args.servers, 1) + 1} ranks "
            f"(one worker at least), got {comm.size}; e.g. mpiexec -n 3 python "
            "examples/train_ps.py")
    try:  # the workers' shards, checked on every rank before the servers start
        workloads.get(args.workload, rank=0, size=max(1, comm.size - args.servers),
                      seed=args.seed, batch=args.batch_size, **args.options)
    except ValueError as exc:
        peer.RankZeroParser(prog=os.path.basename(__file__)).error(str(exc))
    kv = KVStore(comm, servers=args.servers, mode=args.mode, staleness=args.staleness,
                 optimizer="sgd", lr=args.lr, momentum=args.momentum,
                 weight_decay=args.weight_decay,
                 compressor=make_compressor(args.compressor, args),
                 pull_compressor=make_compressor(args.pull_compressor, args))
    workers = comm.split(0 if kv.is_worker else None)
    torch.set_num_threads(args.threads or peer.default_threads(comm))
    summary = None
    if kv.is_server:
        ckpt, _ = peer.make_checkpointer(args, comm, kv=kv)  # restores the shards
        kv.serve()
        if ckpt is not None:
            ckpt.close()
    else:
        w = build(peer.spec_of(args), workers)
        # restored before the harness builds the PSOptimizer, which adopts the keys
        resumed = peer.make_checkpointer(args, comm, kv=kv, model=w.model)
        slow = args.slow_worker is not None and args.slow_worker == kv.worker_rank
        method = PSMethod(kv, slow_factor=args.slow_factor if slow else 1.0)
        run = peer.run_harness(method, w, args, workers,
                               checkpoint=None if resumed[0] is None else lambda ctx: resumed)
        stats = kv.stats()
        method.opt.close()
        peer.save_model(w.model, args, workers.rank)
        describe = {"mode": args.mode, "staleness": args.staleness, "servers": args.servers,
                    "workers": kv.workers, "compressor": args.compressor,
                    "pull_compressor": args.pull_compressor,
                    "slow_worker": args.slow_worker, "worker_stats": stats}
        outcome = peer.Outcome(run, describe)
        summary = peer.summarize(outcome, peer.dense_bytes_per_step(w.model, workers), args,
                                 workers)
        summary["mode"] = f"parameter server ({args.mode})"
        summary["wall_s"] = time.perf_counter() - _START
        summary.update(traffic_summary(workers.allgather_object(stats), summary))
    server_stats = comm.allgather_object(kv.stats() if kv.is_server else None)
    if summary is not None:
        summary["server_stats"] = [s for s in server_stats if s is not None]
        summary["script"] = "examples/train_ps.py"
        summary["ranks"] = comm.size
        summary["roles"] = (f"{kv.workers} worker{'s' if kv.workers > 1 else ''}, "
                            f"{args.servers} server{'s' if args.servers > 1 else ''}")
        if comm.rank == 0:
            summary_text.print_summary(summary)
            servers = summary["server_stats"]
            print(f"servers           {len(servers)}: max staleness "
                  f"{max(s['max_staleness'] for s in servers)}, updates "
                  f"{[s['updates'] for s in servers]}, idle "
                  f"{[round(s['idle_s'], 1) for s in servers]} s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=2)
                print(f"summary           {args.json}", flush=True)
    if workers is not None:
        workers.free()
    return summary


if __name__ == "__main__":
    main()
