"""Parameter server: push+pull time vs the alpha-beta model and ring allreduce; async and
SSP against sync with a straggler; compressed against dense push on digits.

Run under MPI, e.g. ``mpiexec -n 5 python -m mpicomm.bench ps`` (S servers = the last
ranks, W = N - S workers, for every S in ``--servers`` below N).

1. **Communication** (``--sections comm``): every worker pushes and pulls one key of
   ``n`` bytes (float32, split over the S servers and cut into ``pieces`` of
   ``MPICOMM_PS_CHUNK_BYTES``), sync mode with ``lr = 0``; median over ``--repeats`` of
   the slowest worker's time for one pipelined :meth:`~mpicomm.ps.KVStore.push_pull`
   (``ps_ms``) and for ``push`` then ``pull`` (``ps_separate_ms``). Next to it, in the same
   run: the prediction ``2 alpha + 2 W (n/S) beta + W (n/S) gamma``
   (:func:`mpicomm.collectives.cost.ps_push_pull`, alpha/beta/gamma fitted by
   :func:`mpicomm.collectives.calibrate.measure` at the start) and mpicomm's ring
   allreduce of the same ``n`` bytes over the W workers (measured and predicted), and
   the alpha-beta bound of the pattern, ``bound_ms = 2 alpha + 2 max(W/S, 1) n beta``
   (every server link carries ``W`` pieces of ``n/S`` bytes each way, every worker link
   ``n``; no compute), with ``ps/bound``. Target: ``ps/bound <= 1.5`` at 1-16 MB. On the
   emulated cluster with a shaped rate the rows also hold ``link_bound_ms``, the same
   bound for the link as configured (alpha = its one-way delay, beta = 8 / rate:
   :func:`~._util.configured_link`), and ``ps/link_bound``, which the target then reads.
   Alpha and beta are those of the measured link (:func:`calibrate.measure`: a ping-pong
   of 8 B to 4 MiB between two ranks, blocking sends from preallocated buffers; on one
   host the shared-memory link), the same as the ring's prediction uses; they are in
   each row (``alpha_us``, ``link_GBps``). Also in each row, measured in the same run
   right after the store: ``pingpong_ms``, a plain ping-pong (:func:`calibrate.pingpong`,
   median round trip) of ``max(W/S, 1) n`` bytes between worker 0 and server 0, the
   pattern's link time without the model's fit, and ``ps/pingpong``.
2. **Straggler** (``straggler``): ``digits-mlp`` (MLP 64-64-10) through the
   time-to-accuracy harness, plain SGD on 1 server; each step a worker computes a real
   minibatch gradient and then sleeps ``--compute-ms`` (worker 0: ``--slow-factor`` times
   as long; under ``--clock virtual`` the step and that time are charged instead, and
   the servers take the workers' messages in virtual-time order, so async and SSP are
   repeatable). Sync runs ``--steps`` steps per worker; async and
   SSP (``--staleness``) run until the server has applied as many pushes in total
   (``W * steps``). Throughput = pushes applied / W / wall time (sync steps per second);
   final loss = training-set cross-entropy of the final model. Target: async >= 2x
   sync's throughput, final loss within 10% of sync's. SSP is bounded by the straggler
   (the fast workers may lead by ``s`` steps only), so it lands near sync with a
   persistent straggler; it helps when slowness moves between workers.
   ``--stragglers`` picks the straggler models (:class:`StragglerPause`): ``fixed``
   (worker 0 slow at every step) and ``random`` (every worker slow at any one step with
   probability ``--straggler-p``, default ``1/W``: one slow worker per step on average,
   the same total slowness as ``fixed``; drawn from ``(seed, worker)``, so a step's
   slowness is the same in BSP, async and SSP). Transient slowdowns (a slow step here and
   there, which a staleness bound can absorb) are the case the bounded-staleness papers
   argue for (Cipar et al., "Solving the Straggler Problem with Bounded Staleness",
   HotOS 2013; Ho et al., below).
3. **Accuracy** (``accuracy``): the examples' recipe (``digits-mlp``: MLP 64-128-128-10,
   SGD lr 0.05, momentum 0.9, weight decay 1e-3 on the server, batch 32 per worker) for
   ``--epochs`` epochs in sync mode, dense push against top-k 0.01 with error feedback,
   PowerSGD rank 4 push (per worker, error feedback) and a dense push with QSGD-compressed
   pulls (deltas to the servers' mirror). Target: top-k test accuracy within 1 point of
   dense (the target's); the other rows are reported with their gap and bytes.
5. **Time to a target** (``convergence``, not in the default sections): BSP, async and
   SSP (``--staleness``) with the stragglers of section 2 on ``--conv-workload`` (any
   workload of :mod:`mpicomm.workloads` with an accuracy, built and trained by the one
   harness; ``digits-mlp`` defaults to MLP 64-64-10; ``--conv-options k=v,...`` sets
   the workload's options), the same total of pushes each (``W * --conv-steps``). Every
   ``--conv-eval`` of its steps the last worker (not the fixed straggler) evaluates the
   model it has pulled on the test set, locally (no barrier, so the modes keep their
   pace; under the virtual clock the evaluation costs no time). ``--target``: an
   accuracy, or ``bsp:F``, the lowest over the seeds of the best accuracy BSP reached by
   the fraction ``F`` of its steps (BSP's curve in steps is the same for every straggler
   model). The servers run SGD with ``--conv-lr`` and ``--conv-momentum`` (default 0.1
   and none): stale pushes act like extra momentum (Mitliagkas et al., "Asynchrony
   begets momentum, with an application to deep learning", 2016, arXiv:1605.09774), so
   the explicit momentum changes what staleness costs each mode.
   ``time_to_target_s``: the first point at or above the target;
   ``pushes_to_target``: the pushes the server had applied by then (the statistical cost:
   staleness raises it) and ``pushes_per_s`` (the step-rate gain), so that
   ``time = pushes / rate`` splits a difference between modes into the two. Every
   straggler model of ``--stragglers`` and seed of ``--seeds`` (initial model, batch
   order and the random straggler's draws); ``slow_share``: the share of pushes that
   came from slow steps; ``convergence_summary``: the medians over the seeds (of those
   that reached the target) per straggler model and mode, with SSP's ratios
   (:func:`~mpicomm.bench.straggler.convergence_summary`). The claim of Ho et al. (NIPS 2013, "More
   Effective Distributed ML via a Stale Synchronous Parallel Parameter Server"): SSP
   reaches it sooner than both BSP and async.
4. **Compressed pulls** (``pull``): every worker pushes a random gradient of one key of
   ``--pull-bytes`` bytes (float32) and pulls it through ``--pull-compressors``, sync
   mode, ``--repeats`` steps after a warm-up step; per step: the pull encodings the
   servers made (at most one per version and piece: ``S`` per step, whatever ``W``) and
   the servers' CPU time (process time of :meth:`~mpicomm.ps.KVStore.serve`, which
   sleeps while idle, so it is the work done, not the wait), against dense pulls.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np

from .. import clock
from ..comm import Communicator, init
from . import _clock
from ._util import UsageError, configured_link, machine, median_seconds, print_table, write_json
from .harness import default_threads
from .straggler import (
    StragglerPause,
    check_sgd,
    conv_target,
    convergence_summary,
    parse_options,
    parse_seeds,
    parse_stragglers,
    parse_target,
    reach,
)

SECTIONS = ("comm", "straggler", "accuracy", "pull", "convergence")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sections", default=",".join(SECTIONS[:4]),
                        help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--servers", default="1,2", help="server counts to measure")
    parser.add_argument("--sizes", default="65536,1048576,4194304",
                        help="bytes per key for the communication section")
    parser.add_argument("--repeats", type=int, default=15, help="timed push+pull steps")
    parser.add_argument("--steps", type=int, default=60, help="straggler: sync steps")
    parser.add_argument("--compute-ms", type=float, default=10.0,
                        help="straggler: emulated compute per step of a normal worker")
    parser.add_argument("--slow-factor", type=float, default=3.0,
                        help="straggler: worker 0 computes this many times longer")
    parser.add_argument("--staleness", type=int, default=2, help="straggler: SSP bound")
    parser.add_argument("--stragglers", default="fixed",
                        help="straggler/convergence: comma-separated straggler models, "
                             "fixed (worker 0 always slow) and/or random (each worker "
                             "slow at each step with probability --straggler-p)")
    parser.add_argument("--straggler-p", type=float, default=None,
                        help="random straggler: probability that a worker is slow at a "
                             "step (default 1/W: one slow worker per step on average)")
    parser.add_argument("--epochs", type=int, default=30, help="accuracy: epochs")
    parser.add_argument("--pull-bytes", type=int, default=1 << 20, help="pull: bytes per key")
    parser.add_argument("--pull-compressors", default="qsgd,topk",
                        help="pull: compressors to measure (and dense pulls)")
    parser.add_argument("--conv-workload", default="digits-mlp",
                        help="convergence: digits-mlp or mnist1d-cnn")
    parser.add_argument("--conv-steps", type=int, default=300,
                        help="convergence: pushes per worker (total W times this)")
    parser.add_argument("--conv-eval", type=int, default=5,
                        help="convergence: the observer evaluates every this many steps")
    parser.add_argument("--target", default="0.9",
                        help="convergence: test accuracy to reach, or bsp:F: the accuracy "
                             "BSP reaches at the fraction F of its steps (lowest over the "
                             "seeds)")
    parser.add_argument("--conv-lr", type=float, default=0.1,
                        help="convergence: the servers' SGD learning rate")
    parser.add_argument("--conv-momentum", type=float, default=0.0,
                        help="convergence: the servers' SGD momentum, in [0, 1)")
    parser.add_argument("--conv-options", default="",
                        help="convergence: workload options, e.g. channels=32 (k=v,...)")
    parser.add_argument("--seeds", default="0",
                        help="convergence: comma-separated run seeds (medians over them)")
    _clock.add_arguments(parser)


# ---------------------------------------------------------------------- helpers
def _store(comm: Communicator, servers: int, **kw: Any) -> tuple[Any, Communicator | None]:
    from ..ps import KVStore

    kv = KVStore(comm, servers=servers, **kw)
    return kv, comm.split(0 if kv.is_worker else None)


def _straggler_store(comm: Communicator, mode: str, args: argparse.Namespace,
                     model: str = "fixed", seed: int = 0, lr: float = 0.1,
                     momentum: float = 0.0
                     ) -> tuple[Any, Communicator | None, StragglerPause | None]:
    """A one-server store in ``mode`` (SSP bounded by ``--staleness``; the servers' SGD
    with ``lr`` and ``momentum``) and this rank's pause per step (:class:`StragglerPause`
    of ``model`` with ``--compute-ms``, ``--slow-factor``, ``--straggler-p``; ``None`` on
    the server)."""
    kw = {"staleness": args.staleness} if mode == "ssp" else {}
    kv, wc = _store(comm, 1, mode=mode, lr=lr, momentum=momentum, **kw)
    if wc is None:
        return kv, wc, None
    return kv, wc, StragglerPause(model, wc.rank, wc.size, args.compute_ms / 1e3,
                                  args.slow_factor, args.straggler_p, seed)


def _finish(kv: Any, wc: Communicator | None) -> None:
    if kv.is_server:
        kv.serve()
    else:
        kv.close()
    if wc is not None:
        wc.free()


# ---------------------------------------------------------------------- 1. communication
def bench_comm(args: argparse.Namespace, comm: Communicator) -> list[dict[str, Any]]:
    from .. import allreduce
    from ..collectives import calibrate
    from ..collectives.cost import allreduce_ring, ps_push_pull

    params = calibrate.measure(comm)
    links = dataclasses.replace(params, gamma=0.0)   # the alpha-beta bound: no compute
    configured = configured_link(params)
    rows = []
    for servers in [int(s) for s in args.servers.split(",")]:
        if not 1 <= servers < comm.size:
            continue
        workers = comm.size - servers
        for nbytes in [int(s) for s in args.sizes.split(",")]:
            kv, wc = _store(comm, servers, mode="sync", lr=0.0)
            if kv.is_worker:
                assert wc is not None
                g = np.ones(nbytes // 4, dtype=np.float32)
                kv.init("g", g)

                def step(kv: Any = kv, g: np.ndarray = g) -> None:
                    kv.push_pull("g", g, out=g)

                def separate(kv: Any = kv, g: np.ndarray = g) -> None:
                    kv.push("g", g)
                    kv.pull("g", out=g)

                def ring(g: np.ndarray = g, wc: Communicator = wc) -> None:
                    allreduce(g, op="sum", algorithm="ring", comm=wc)

                ps_s = median_seconds(step, wc, repeats=args.repeats)
                sep_s = median_seconds(separate, wc, repeats=args.repeats)
                ar_s = median_seconds(ring, wc, repeats=args.repeats)
                bound = ps_push_pull(nbytes, workers, servers, links)
                rows.append({"servers": servers, "workers": workers, "bytes": nbytes,
                             "pieces": len(kv._worker.info("g").pieces),
                             "ps_ms": ps_s * 1e3, "ps_separate_ms": sep_s * 1e3,
                             "ps_pred_ms": ps_push_pull(nbytes, workers, servers, params) * 1e3,
                             "bound_ms": bound * 1e3, "ps/bound": ps_s / bound,
                             "ring_ms": ar_s * 1e3,
                             "ring_pred_ms": allreduce_ring(nbytes, workers, params) * 1e3,
                             "ps/ring": ps_s / ar_s if ar_s else float("nan")})
                if configured is not None:
                    lb = ps_push_pull(nbytes, workers, servers, configured)
                    rows[-1].update({"link_bound_ms": lb * 1e3, "ps/link_bound": ps_s / lb})
            _finish(kv, wc)
            link = int(max(workers / servers, 1.0) * nbytes)
            if comm.rank in (0, workers):
                rt = 2 * calibrate.pingpong(comm, link, repeats=args.repeats, peer=workers)
                if comm.rank == 0:
                    rows[-1].update({"pingpong_ms": rt * 1e3,
                                     "ps/pingpong": rows[-1]["ps_ms"] / 1e3 / rt,
                                     "alpha_us": params.alpha * 1e6,
                                     "link_GBps": 1 / params.beta / 1e9})
            comm.barrier()
    rows = comm.bcast_object(rows, root=0)
    if comm.rank == 0:
        print(f"\n== push+pull per step vs prediction and ring allreduce over the workers "
              f"(alpha {params.alpha * 1e6:.1f} us, beta {1 / params.beta / 1e9:.2f} GB/s, "
              f"gamma {1 / params.gamma / 1e9:.2f} GB/s)")
        print_table(rows, ["servers", "workers", "bytes", "pieces", "ps_ms", "ps_separate_ms",
                           "ps_pred_ms", "bound_ms",
                           "ps/bound", "pingpong_ms", "ps/pingpong", "ring_ms", "ring_pred_ms",
                           "ps/ring"])
        key = "ps/link_bound" if configured is not None else "ps/bound"
        if configured is not None:
            print_table(rows, ["servers", "workers", "bytes", "ps_ms", "link_bound_ms", key])
        worst = max((r[key] for r in rows), default=float("nan"))
        print(f"target push+pull within 1.5x of the alpha-beta bound"
              f"{' of the configured link' if configured is not None else ''}: "
              f"{'met' if worst <= 1.5 else 'NOT met'} (worst {worst:.2f}x)")
    return rows


# ---------------------------------------------------------------------- 4. compressed pulls
def _compressor(name: str | None) -> Any:
    """A compressor by name, sparsifiers at density 0.01 (``None``: dense)."""
    from ..compress import make

    if name is None:
        return None
    return make(name, density=0.01) if name in ("topk", "randomk") else make(name)


def bench_pull(args: argparse.Namespace, comm: Communicator) -> list[dict[str, Any]]:
    rows = []
    steps = args.repeats + 1
    for servers in [int(s) for s in args.servers.split(",")]:
        if not 1 <= servers < comm.size:
            continue
        for name in [None, *[c.strip() for c in args.pull_compressors.split(",") if c]]:
            kv, wc = _store(comm, servers, mode="sync", lr=0.01,
                            pull_compressor=_compressor(name))
            wait = 0.0
            if kv.is_worker:
                rng = np.random.default_rng(kv.worker_rank)
                kv.init("w", np.zeros(args.pull_bytes // 4, dtype=np.float32))
                for i in range(steps):
                    g = rng.standard_normal(args.pull_bytes // 4).astype(np.float32)
                    t0 = time.perf_counter()
                    kv.push("w", g)
                    kv.pull("w")
                    wait += (time.perf_counter() - t0) if i else 0.0
            _finish(kv, wc)
            stats = comm.allgather_object((kv.is_server, kv.stats(), wait))
            served = [st for is_server, st, _ in stats if is_server]
            pulled = [st for is_server, st, _ in stats if not is_server]
            rows.append({
                "servers": servers, "workers": comm.size - servers, "pull": name or "dense",
                "bytes": args.pull_bytes, "steps": steps,
                "encodings_per_step": sum(st.get("pull_encodings", 0) for st in served) / steps
                if name else 0.0,
                "server_cpu_ms_per_step": max(st["cpu_s"] for st in served) * 1e3 / steps,
                "worker_ms_per_step": max(w for s, _, w in stats if not s) * 1e3 / args.repeats,
                "pulled_B_per_worker_step": max(st["bytes_pulled"] for st in pulled) / steps})
    if comm.rank == 0:
        print("\n== compressed pulls: encodings and server CPU per step (sync)")
        print_table(rows, ["servers", "workers", "pull", "bytes", "encodings_per_step",
                           "server_cpu_ms_per_step", "worker_ms_per_step",
                           "pulled_B_per_worker_step"])
    return rows


# ---------------------------------------------------------------------- 2. straggler
def bench_straggler(args: argparse.Namespace, comm: Communicator) -> list[dict[str, Any]]:
    from .harness import Spec, now, train
    from .sync import PSMethod

    rows = []
    for kind in parse_stragglers(args.stragglers):
        group = []
        for mode in ("sync", "async", "ssp"):
            kv, wc, pause = _straggler_store(comm, mode, args, kind)
            if kv.is_worker:
                assert wc is not None
                target = kv.workers * args.steps
                spec = Spec(workload="digits-mlp", options={"hidden": 64, "layers": 1},
                            batch=32, epochs=None, budget_s=float("inf"), eval_every=None,
                            epoch_stats=False, eval_split="train", label=mode)

                def enough(step: int, ctx: Any, kv: Any = kv, mode: str = mode,
                           target: int = target) -> None:
                    ctx.stop = (step >= args.steps if mode == "sync"
                                else kv.stats()["server_pushes"] >= target)

                wc.barrier()
                start = now()
                r = train(spec, PSMethod(kv, pause=pause), wc, on_step=enough)
                stats = kv.stats()
                wall = wc.allreduce_value(now() - start, "max")
                pushes = wc.allreduce_value(r.steps, "sum")
                staleness = wc.allreduce_value(stats["max_staleness"], "max")
                group.append({"straggler": kind,
                              "mode": mode if mode != "ssp" else f"ssp(s={args.staleness})",
                              "workers": kv.workers, "pushes": pushes, "wall_s": wall,
                              "steps_per_s": pushes / kv.workers / wall,
                              "final_loss": r.final_metric("loss"),
                              "max_staleness": staleness})
            _finish(kv, wc)
        group = comm.bcast_object(group, root=0)
        for r in group:
            r["speedup"] = r["steps_per_s"] / group[0]["steps_per_s"]
            r["loss/sync"] = r["final_loss"] / group[0]["final_loss"]
        rows += group
    if comm.rank == 0 and rows:
        print(f"\n== straggler: a slow step computes {args.slow_factor:g}x longer "
              f"({args.compute_ms:g} ms vs {args.compute_ms * args.slow_factor:g} ms per step)")
        print_table(rows, ["straggler", "mode", "workers", "pushes", "wall_s", "steps_per_s",
                           "speedup", "final_loss", "loss/sync", "max_staleness"])
        for a in rows[1::3]:
            ok = a["speedup"] >= 2.0 and a["loss/sync"] <= 1.10
            print(f"{a['straggler']}: target async >= 2x sync steps/s and final loss within "
                  f"10%: {'met' if ok else 'NOT met'} ({a['speedup']:.2f}x, "
                  f"{a['loss/sync']:.3f})")
    return rows


# ---------------------------------------------------------------------- 5. convergence
def _conv_run(args: argparse.Namespace, comm: Communicator, mode: str, kind: str, seed: int,
              options: dict[str, Any]) -> dict[str, Any] | None:
    """One run of the time-to-target section; the row on the workers, None on the
    server."""
    from .harness import Spec, now, train
    from .sync import PSMethod

    kv, wc, pause = _straggler_store(comm, mode, args, kind, seed, lr=args.conv_lr,
                                     momentum=args.conv_momentum)
    row = None
    if kv.is_worker:
        assert wc is not None and pause is not None
        observer = wc.size - 1
        total = kv.workers * args.conv_steps
        spec = Spec(workload=args.conv_workload, options=options, seed=seed, batch=32,
                    epochs=None, budget_s=float("inf"), eval_every=None,
                    epoch_stats=False, label=mode)
        curve: list[tuple[float, int, float, int]] = []
        t0 = [0.0]

        def on_step(step: int, ctx: Any) -> None:
            assert wc is not None
            if wc.rank == observer and step % args.conv_eval == 0:
                point = ctx.workload.evaluate(ctx.model, None, "test")
                curve.append((now() - t0[0], step, point["accuracy"],
                              kv.stats()["server_pushes"]))
            ctx.stop = (step >= args.conv_steps if mode == "sync"
                        else kv.stats()["server_pushes"] >= total)

        wc.barrier()
        t0[0] = now()
        r = train(spec, PSMethod(kv, pause=pause), wc, on_step=on_step)
        wall = wc.allreduce_value(now() - t0[0], "max")
        pushes = wc.allreduce_value(r.steps, "sum")
        slow = wc.allreduce_value(pause.slow_steps, "sum")
        curve = wc.bcast_object(curve, root=observer)
        row = {"straggler": kind, "seed": seed,
               "mode": mode if mode != "ssp" else f"ssp(s={args.staleness})",
               "workload": args.conv_workload, "workers": kv.workers,
               "pushes_per_s": pushes / wall, "slow_share": slow / pushes,
               "best_accuracy": max((a for _, _, a, _ in curve), default=None),
               "final_accuracy": r.final_metric("accuracy"), "wall_s": wall,
               "max_staleness": wc.allreduce_value(kv.stats()["max_staleness"], "max"),
               "curve": [list(p) for p in curve]}
    _finish(kv, wc)
    return row


def bench_convergence(args: argparse.Namespace, comm: Communicator
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time to ``--target`` test accuracy of BSP, async and SSP (module docstring, 5):
    the rows (every straggler model, seed and mode) and their summary."""
    options = ({"hidden": 64, "layers": 1} if args.conv_workload == "digits-mlp" else {})
    options.update(parse_options(args.conv_options))
    rows = []
    for kind in parse_stragglers(args.stragglers):
        for seed in parse_seeds(args.seeds):
            for mode in ("sync", "async", "ssp"):
                row = _conv_run(args, comm, mode, kind, seed, options)
                rows.append(comm.bcast_object(row, root=0))
    target = conv_target(args.target, rows)
    reach(rows, target)
    summary = convergence_summary(rows)
    if comm.rank == 0 and rows:
        print(f"\n== time to {target:.4g} test accuracy (--target {args.target}), "
              f"{args.conv_workload} {options}, a slow step {args.slow_factor:g}x longer")
        print_table(rows, ["straggler", "seed", "mode", "time_to_target_s",
                           "pushes_to_target", "pushes_per_s", "slow_share", "best_accuracy",
                           "final_accuracy", "wall_s", "max_staleness"])
        print("\n-- medians over the seeds")
        print_table(summary, ["straggler", "mode", "reached", "time_to_target_s",
                              "pushes_to_target", "pushes_per_s", "best_accuracy",
                              "bsp/ssp", "async/ssp", "pushes_ratio", "rate_ratio"])
    return rows, summary


# ---------------------------------------------------------------------- 3. accuracy
def bench_accuracy(args: argparse.Namespace, comm: Communicator) -> list[dict[str, Any]]:
    from ..compress import QSGD, PowerSGD, TopK
    from .harness import Spec, train
    from .sync import PSMethod

    rows = []
    for name, compressor, pull in (("dense", None, None),
                                   ("topk 0.01 + EF", TopK(density=0.01), None),
                                   ("powersgd r4 + EF", PowerSGD(rank=4), None),
                                   ("dense, qsgd pull", None, QSGD())):
        kv, wc = _store(comm, 1, mode="sync", lr=0.05, momentum=0.9, weight_decay=1e-3,
                        compressor=compressor, pull_compressor=pull)
        if kv.is_worker:
            assert wc is not None
            spec = Spec(workload="digits-mlp", options={"hidden": 128}, batch=32,
                        epochs=args.epochs, eval_every=None, label=name)
            r = train(spec, PSMethod(kv), wc)
            stats = kv.stats()
            rows.append({"push": name, "workers": kv.workers, "epochs": args.epochs,
                         "test_acc": r.final_metric(), "bytes_pushed": stats["bytes_pushed"],
                         "bytes_pulled": stats["bytes_pulled"], "train_s": r.seconds})
        _finish(kv, wc)
    rows = comm.bcast_object(rows, root=0)
    if comm.rank == 0 and rows:
        print("\n== compressed push vs dense push (sync, 1 server)")
        for r in rows:
            r["points_below_dense"] = (rows[0]["test_acc"] - r["test_acc"]) * 100
        print_table(rows, ["push", "workers", "epochs", "test_acc", "points_below_dense",
                           "bytes_pushed", "bytes_pulled", "train_s"])
        gap = rows[1]["points_below_dense"]
        print(f"target top-k within 1 point of dense: {'met' if gap <= 1 else 'NOT met'} "
              f"({gap:+.2f} points below dense)")
    return rows


def run(args: argparse.Namespace) -> int:
    _clock.apply(args)
    comm = init()
    _clock.measure_costs(comm)
    import torch

    torch.set_num_threads(default_threads(comm))  # ranks of a node share its cores
    if comm.size < 2:
        if comm.rank == 0:
            print("bench ps needs >= 2 ranks (servers + workers); run under mpiexec -n 5")
        return 1
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise UsageError(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    parse_stragglers(args.stragglers)
    parse_seeds(args.seeds)
    parse_options(args.conv_options)
    parse_target(args.target)
    if args.straggler_p is not None and not 0.0 <= args.straggler_p <= 1.0:
        raise UsageError(f"--straggler-p must be in [0, 1], got {args.straggler_p}")
    check_sgd(args.conv_lr, args.conv_momentum)

    out: dict[str, Any] = {"suite": "ps", "machine": machine(), "ranks": comm.size,
                           "args": vars(args), "clock": _clock.describe()}

    t0 = time.perf_counter()
    if "comm" in sections:
        out["comm"] = bench_comm(args, comm)
    if "straggler" in sections:
        out["straggler"] = bench_straggler(args, comm)
    if "accuracy" in sections:
        out["accuracy"] = bench_accuracy(args, comm)
    if "pull" in sections:
        out["pull"] = bench_pull(args, comm)
    if "convergence" in sections:
        out["convergence"], out["convergence_summary"] = bench_convergence(args, comm)
    if comm.rank == 0:
        note = ("times are the virtual cluster's, independent of the load" if clock.started()
                else "timings on a shared machine are noisy, ratios from one run are the "
                "figures to compare")
        print(f"\n(bench ps took {time.perf_counter() - t0:.0f} s of real time; {note})")
        write_json(args.json, out)
    return 0
