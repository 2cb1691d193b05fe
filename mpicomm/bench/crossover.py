"""Crossover scheduling: aggregate throughput of two jobs, sequential vs co-located vs Crossover.

Run under MPI, e.g. ``mpiexec -n 2 python -m mpicomm.bench crossover --json out.json``.

Setup (every choice is an option):

* Jobs: ``--jobs`` (2) identical :class:`~mpicomm.torch.TorchJob` s: an MLP
  64-``hidden``x``layers``-10 on scikit-learn's bundled digits (standardized, sharded
  round-robin over the ranks), SGD lr 0.05 momentum 0.9, ``--batch`` samples per rank,
  gradients averaged by :class:`~mpicomm.torch.GradientSync` with ``--strategy``
  (dense allreduce), ``--steps`` iterations each. ``--sync localsgd`` averages the
  parameters with :class:`~mpicomm.torch.LocalSGD` (period 1) instead, so that all the
  communication happens in the sync phase (GradientSync starts it during backward);
  ``--gate-ms`` turns on the scheduler's arrival gate (``gate_poll_s``).
* Communication, on the emulated cluster (``launchers/emulated-cluster``, one rank per
  host): the real allreduce over the shaped links is the sync phase, no injected delay
  (``--delay-ms auto`` means 0 there); pick the link rate so that ``S ~ C`` (the suite
  prints the rate that would make them equal for the model size: ``bytes per rank per
  allreduce x 8 / C``). On shared memory every sync phase sleeps an injected delay
  ``D`` after the real allreduce (``TorchJob(delay_s=D)``), modelling a slower network's
  latency: on one host, MPI's shared-memory copies compete with the other job's compute
  for the same cores, so only waiting can be hidden (see :mod:`mpicomm.sched.crossover`);
  ``--delay-ms auto`` sets ``D`` so that the sync phase ``S`` (real allreduce + D) equals
  the compute phase ``C``, both measured first in a job run alone.
* Waiting: ``--wait-poll-ms`` (default ``auto``: 1 ms when the ranks span several
  hosts, off on one) sets the jobs' communicators' ``wait_poll_s`` in the co-located and
  Crossover modes: mpicomm's collectives then test their requests and sleep in between
  instead of spinning in MPI, leaving the core to the job that computes. The sequential
  mode always blocks in MPI (the fastest way for a job alone).
* Modes, each from freshly built, identical jobs: ``sequential`` (each job alone, one
  after the other, the jobs' ideal exclusive time), ``colocated`` (all jobs at once on
  the same ranks, each in its own thread, no token: plain co-location without a
  scheduler), ``crossover`` (:class:`~mpicomm.sched.CrossoverScheduler`). The order of
  the modes rotates between repeats. A mode's time is the slowest rank's wall clock
  for the training loops (set-up excluded); throughput = all jobs' iterations / time.
* Bounds, from ``C``, ``S`` = the median per-iteration compute and sync times in the
  sequential runs, printed next to the measured speedup: ``bound = (C + S) / max(C, S)``
  (compute and network each serve one job at a time) and
  ``token_bound = n(C + S) / max(nC, C + S)`` (only compute is exclusive; syncs of
  different jobs may overlap each other, as injected delays do). They agree when
  ``S <= C``.
* Where the time goes under the scheduler (per iteration, mean over ranks): ``Cx_ms`` the
  compute phase (above ``C_ms``: the other job's synchronization, MPI's spinning or
  copies, slows compute down), ``Sx_ms`` the sync phase (above ``S_ms``: the jobs'
  syncs share the link, or the ranks drift apart so a sync waits for a late peer),
  ``wait_ms`` the token's wait for a sync (the part not hidden). A round of the ``n``
  jobs takes about ``n (Cx + wait)``. ``<mode>_cpu_ms``: CPU time of the rank's process
  (all threads) per iteration; waits that spin in MPI show up there.
* Check: the crossover run's final parameters are bit-identical to the sequential
  run's (``identical``), i.e. the scheduler changed no job's mathematics.

Virtual clock (``--clock virtual --rate ... --delay ...``): the jobs' forward, backward
and optimizer step are measured into the cost table first (ranks taking turns,
:func:`mpicomm.torch.costs.calibrate_model`) and charged; the syncs are timed by the
network model (``--delay-ms auto`` is 0). The ``colocated`` mode is not run there: each
thread has its own virtual processor, so co-location without the token would show no
contention for the cores at all.

Target: crossover >= 1.3x the sequential throughput (the paper reports about
1.2x on ImageNet), approaching the bound. Timings on a shared, oversubscribed machine are
noisy: use the medians over ``--repeats`` and re-run on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import time
from typing import Any

import numpy as np

from .. import clock
from ..comm import Communicator, init
from . import _clock
from ._util import UsageError, machine, print_table, write_json

MODES = ("sequential", "colocated", "crossover")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _clock.add_arguments(parser)
    parser.add_argument("--jobs", type=int, default=2, help="identical jobs sharing the ranks")
    parser.add_argument("--steps", type=int, default=40, help="iterations per job")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every mode (median)")
    parser.add_argument("--batch", type=int, default=1024, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--strategy", default="dense", help="GradientSync strategy")
    parser.add_argument("--delay-ms", default="auto",
                        help="injected delay per sync phase in ms, or 'auto' (S = C)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--sync", choices=("gradsync", "localsgd"), default="gradsync",
                        help="gradsync: GradientSync(--strategy), averaging during backward; "
                             "localsgd: LocalSGD with period 1, averaging in the sync phase")
    parser.add_argument("--gate-ms", type=float, default=None,
                        help="CrossoverScheduler(gate_poll_s=...) in ms (default off)")
    parser.add_argument("--suggest-rate", type=int, default=None, metavar="HOSTS",
                        help="print the tc rate (e.g. 240mbit) for launchers/emulated-cluster "
                             "at which the sync's wire time is 0.8 C on HOSTS hosts of one "
                             "rank each (C measured here, alone), then exit")
    parser.add_argument("--compare-spin", action="store_true",
                        help="add a mode 'crossover_spin': the scheduler with "
                             "wait_poll_s=None (waits spin in MPI), to compare in one run")
    parser.add_argument("--wait-poll-ms", default="auto",
                        help="wait_poll_s of the jobs' communicators in ms (co-located and "
                             "crossover modes): 'auto' (1 ms across hosts, off on one), "
                             "'off', or a number")


# ---------------------------------------------------------------------- jobs
def load_shard(comm: Any) -> Any:
    """This rank's examples of the ``digits-mlp`` workload (``x``, ``y``: its shard of
    epoch 0); the jobs draw their minibatches from it."""
    from types import SimpleNamespace

    from .. import workloads

    w = workloads.get("digits-mlp", rank=comm.rank, size=comm.size, batch=1)
    idx = w.shard.indices(0)
    return SimpleNamespace(x=w.shard.inputs[idx], y=w.shard.targets[idx])


def make_job(name: str, seed: int, shard: Any, args: argparse.Namespace, delay_s: float,
             rank: int) -> Any:
    import torch

    from ..torch import TorchJob
    from ..workloads.digits import mlp

    model = mlp([64] + [args.hidden] * args.layers + [10], seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(1000 * seed + rank)
    data = []
    for _ in range(args.steps):
        idx = torch.from_numpy(rng.integers(0, len(shard.y), args.batch))
        data.append((shard.x[idx], shard.y[idx]))
    how: dict[str, Any] = ({"local_sgd": 1} if args.sync == "localsgd"
                           else {"strategy": args.strategy})
    return TorchJob(name, model, opt, data, torch.nn.functional.cross_entropy,
                    delay_s=delay_s, **how)


def make_jobs(shard: Any, args: argparse.Namespace, delay_s: float, rank: int) -> list[Any]:
    return [make_job(f"job{i}", i, shard, args, delay_s, rank) for i in range(args.jobs)]


def digest(job: Any) -> str:
    h = hashlib.sha256()
    for p in job.model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def loop(job: Any, times: dict[str, list[float]] | None = None) -> None:
    """The job's iterations run by themselves (no token): compute, then sync."""
    for step in range(job.steps):
        t0 = clock.now()
        job.compute(step)
        t1 = clock.now()
        job.sync(step)
        if times is not None:
            times["compute"].append(t1 - t0)
            times["sync"].append(clock.now() - t1)
    job.finish()


def slowest(comm: Communicator, seconds: float) -> float:
    return float(comm.allreduce_value(seconds, "max"))


def run_sequential(jobs: list[Any], comm: Communicator) -> tuple[float, float, float]:
    """(seconds, compute s/iteration, sync s/iteration; medians, slowest rank): each job
    alone, in turn."""
    total: float = 0.0
    times: dict[str, list[float]] = {"compute": [], "sync": []}
    for job in jobs:
        job_comm = comm.dup()
        try:
            job.setup(job_comm)
            comm.barrier()
            start = clock.now()
            loop(job, times)
            total += slowest(comm, clock.now() - start)
            job.close()
        finally:
            job_comm.free()
    return (total, slowest(comm, statistics.median(times["compute"])),
            slowest(comm, statistics.median(times["sync"])))


def run_colocated(jobs: list[Any], comm: Communicator,
                  wait_poll_s: float | None = None) -> float:
    """All jobs at once, one thread each, no token (plain co-location)."""
    comms = [comm.dup() for _ in jobs]
    for c in comms:
        c.wait_poll_s = wait_poll_s
    errors: list[BaseException] = []

    def body(job: Any) -> None:
        try:
            loop(job)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    try:
        for job, job_comm in zip(jobs, comms):
            job.setup(job_comm)
        comm.barrier()
        start = clock.now()
        threads = [clock.start_thread(functools.partial(body, j), name=f"colocated-{j.name}",
                                      daemon=False) for j in jobs]
        for t in threads:
            t.join()
        seconds = slowest(comm, clock.now() - start)
        if errors:
            raise errors[0]
        for job in jobs:
            job.close()
    finally:
        for c in comms:
            c.free()
    return seconds


def run_crossover(jobs: list[Any], comm: Communicator, gate_poll_s: float | None = None,
                  wait_poll_s: float | None = None
                  ) -> tuple[float, float, float, float, float]:
    """(seconds, share of the sync time hidden, compute, sync and token-wait s/iteration,
    the last three averaged over the ranks) under the CrossoverScheduler: compute phases
    slower than alone mean the jobs contend for the cores, sync phases slower than alone
    that they contend for the link or that the ranks drift apart."""
    from ..sched import CrossoverScheduler

    with CrossoverScheduler(jobs, comm=comm, gate_poll_s=gate_poll_s,
                            wait_poll_s=wait_poll_s) as sched:
        comm.barrier()
        start = clock.now()
        stats = sched.run()
        seconds = slowest(comm, clock.now() - start)
    wait = sum(j.wait_seconds for j in stats.jobs.values())
    sync = sum(j.sync_seconds for j in stats.jobs.values())
    hidden = 1.0 - wait / sync if sync > 0 else 1.0
    steps = max(stats.steps, 1)
    compute = sum(j.compute_seconds for j in stats.jobs.values()) / steps
    def mean(x: float) -> float:
        return float(comm.allreduce_value(x, "avg"))

    return (seconds, float(comm.allreduce_value(hidden, "min")), mean(compute),
            mean(sync / steps), mean(wait / steps))


def bound(c: float, s: float) -> float:
    """Ideal speedup when compute and network each serve one job at a time:
    n(C+S) / (n max(C, S)) = (C+S) / max(C, S), for any number of jobs n."""
    return (c + s) / max(c, s)


def resolve_wait_poll(text: str, comm: Communicator) -> float | None:
    """``--wait-poll-ms`` as seconds (the scheduler's ``"auto"`` rule) or None."""
    from ..sched.crossover import auto_wait_poll_s

    if text == "auto":
        return auto_wait_poll_s(comm)
    if text == "off":
        return None
    return float(text) / 1e3


def sync_bytes(job: Any, p: int) -> float:
    """Bytes one rank sends per dense ring allreduce of the job's gradients."""
    n = sum(q.numel() * q.element_size() for q in job.model.parameters())
    return 2 * (p - 1) / p * n


def suggest_rate(hosts: int, shard: Any, args: argparse.Namespace,
                 comm: Communicator) -> str:
    """The link rate (tc units) at which a job's ring allreduce over ``hosts`` ranks takes
    0.8 of its compute time ``C`` on the wire: the compute and the network nearly
    balanced, with some slack for jitter (the bound (C+S)/max(C,S) is then about 1.8).

    ``C`` is measured here with one job alone; with more emulated hosts than usable
    cores the ranks share cores, so it is scaled by ``hosts / cores``."""
    job = make_job("calibrate", 99, shard, args, 0.0, comm.rank)
    _, c, _ = run_sequential([job], comm)
    cores = len(os.sched_getaffinity(0))
    c *= max(1.0, hosts / cores)
    bits = sync_bytes(job, hosts) * 8
    return f"{max(1, round(bits / (0.8 * c) / 1e6))}mbit"


def token_bound(n: int, c: float, s: float) -> float:
    """Ideal speedup of n identical jobs when only compute is exclusive (the token) and
    syncs may overlap each other: a round of iterations takes max(nC, C + S)."""
    return n * (c + s) / max(n * c, c + s)


# ---------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    import torch

    if args.jobs < 2 or args.steps < 1 or args.repeats < 1:
        raise UsageError(f"needs --jobs >= 2, --steps >= 1 and --repeats >= 1 (got "
                         f"{args.jobs}, {args.steps}, {args.repeats})")
    if args.wait_poll_ms not in ("auto", "off"):
        try:
            ok = 0 < float(args.wait_poll_ms) < 1000
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(f"--wait-poll-ms must be auto, off or milliseconds in (0, 1000), "
                             f"got {args.wait_poll_ms!r}")
    from ..strategies import available

    if args.sync == "gradsync" and args.strategy not in available():
        raise UsageError(f"unknown --strategy {args.strategy!r}; available: "
                         f"{', '.join(available())}")
    if args.suggest_rate is not None and args.suggest_rate < 2:
        raise UsageError(f"--suggest-rate needs >= 2 hosts, got {args.suggest_rate}")
    torch.set_num_threads(args.threads)
    _clock.apply(args)
    comm = init()
    _clock.measure_costs(comm)
    shard = load_shard(comm)
    virtual = clock.started()
    if virtual:     # the jobs' step in the cost table (identical models: one measurement)
        args.repeats = 1          # and virtual times do not vary run to run
        from ..torch.costs import calibrate_model

        probe = make_job("costs", 98, shard, args, 0.0, comm.rank)
        x, y = probe.data[0]
        calibrate_model(probe.model, x, y, torch.nn.functional.cross_entropy,
                        probe.optimizer, comm, turns=None)
    if args.suggest_rate is not None:
        rate = suggest_rate(args.suggest_rate, shard, args, comm)
        if comm.rank == 0:
            print(rate)
        return 0
    n = args.jobs
    wait_poll_s = resolve_wait_poll(args.wait_poll_ms, comm)
    network = machine()["network"]
    if virtual:
        plat = clock.platform()
        assert plat is not None
        network = {"kind": "virtual cluster", "hosts": plat.num_hosts,
                   "rate": f"{plat.rate * 8 / 1e6:g}mbit, delay {plat.delay * 1e3:g} ms"}

    # calibration: one job alone, no injected delay
    calibration = make_job("calibrate", 99, shard, args, 0.0, comm.rank)
    _, c0, s0 = run_sequential([calibration], comm)
    if args.delay_ms != "auto":
        delay_s = float(args.delay_ms) / 1e3
    elif network["kind"] == "emulated cluster" or virtual:
        delay_s = 0.0  # the shaped links are the communication
    else:
        delay_s = max(0.0, c0 - s0)
    if comm.rank == 0:
        nbytes = sync_bytes(calibration, comm.size)
        print(f"# crossover: {comm.size} ranks on {network['kind']} "
              f"({network.get('hosts')} host(s), rate {network.get('rate', '-')}), {n} jobs "
              f"x {args.steps} steps, MLP 64-{args.hidden}x{args.layers}-10, batch "
              f"{args.batch}/rank, strategy "
              f"{args.strategy if args.sync == 'gradsync' else 'local SGD, period 1'}, "
              f"torch threads {args.threads}, gate {args.gate_ms} ms, wait poll "
              f"{'off' if wait_poll_s is None else f'{wait_poll_s * 1e3:g} ms'}")
        print(f"# alone, no delay: compute C = {c0 * 1e3:.2f} ms, real sync = "
              f"{s0 * 1e3:.2f} ms per iteration; injected delay D = {delay_s * 1e3:.2f} ms "
              f"per sync phase; {nbytes / 1e6:.2f} MB sent per rank per ring allreduce, "
              f"S = C at a link rate of about {nbytes * 8 / c0 / 1e6:.0f} Mbit/s",
              flush=True)

    rows, reference, spun = [], None, None
    modes = MODES + (("crossover_spin",) if args.compare_spin else ())
    if virtual:
        modes = tuple(m for m in modes if m != "colocated")
    for rep in range(args.repeats):
        row: dict[str, Any] = {"repeat": rep}
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            jobs = make_jobs(shard, args, delay_s, comm.rank)
            cpu0 = time.process_time()
            if mode == "sequential":
                row["sequential_s"], row["C_ms"], row["S_ms"] = run_sequential(jobs, comm)
                row["C_ms"] *= 1e3
                row["S_ms"] *= 1e3
                reference = [digest(j) for j in jobs]
            elif mode == "colocated":
                row["colocated_s"] = run_colocated(jobs, comm, wait_poll_s)
            elif mode == "crossover_spin":
                gate = None if args.gate_ms is None else args.gate_ms / 1e3
                row["crossover_spin_s"], *_ = run_crossover(jobs, comm, gate, None)
                spun = [digest(j) for j in jobs]
            else:
                gate = None if args.gate_ms is None else args.gate_ms / 1e3
                (row["crossover_s"], row["hidden"], cx, sx,
                 wx) = run_crossover(jobs, comm, gate, wait_poll_s)
                row["Cx_ms"], row["Sx_ms"], row["wait_ms"] = cx * 1e3, sx * 1e3, wx * 1e3
                final = [digest(j) for j in jobs]
            # CPU time of the whole process per iteration (set-up included, slowest rank):
            # spinning waits show up here
            row[f"{mode}_cpu_ms"] = slowest(comm, time.process_time() - cpu0) / (
                n * args.steps) * 1e3
        same = final == reference and (spun is None or spun == reference)
        row["identical"] = bool(comm.allreduce_value(int(same), "min"))
        steps = n * args.steps
        for mode in modes:
            row[f"{mode}_it_s"] = steps / row[f"{mode}_s"]
        if args.compare_spin:  # the same scheduler, waits spinning in MPI
            row["spin_vs_sequential"] = row["sequential_s"] / row["crossover_spin_s"]
        row["x_vs_sequential"] = row["sequential_s"] / row["crossover_s"]
        if "colocated_s" in row:
            row["x_vs_colocated"] = row["colocated_s"] / row["crossover_s"]
            row["colocated_vs_sequential"] = row["sequential_s"] / row["colocated_s"]
        row["bound"] = bound(row["C_ms"], row["S_ms"])
        row["token_bound"] = token_bound(n, row["C_ms"], row["S_ms"])
        rows.append(row)
        if comm.rank == 0:
            colocated = (f"{row['colocated_s']:.3f} s" if "colocated_s" in row
                         else "not run")
            print(f"#   repeat {rep}: sequential {row['sequential_s']:.3f} s, colocated "
                  f"{colocated}, crossover {row['crossover_s']:.3f} s "
                  f"({row['x_vs_sequential']:.2f}x, bound {row['bound']:.2f}x)", flush=True)

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
           if isinstance(rows[0][k], float)}
    summary = {
        "speedup_vs_sequential": med["x_vs_sequential"],
        "speedup_vs_colocated": med.get("x_vs_colocated"),
        "colocated_vs_sequential": med.get("colocated_vs_sequential"),
        "bound": med["bound"], "token_bound": med["token_bound"],
        "C_ms": med["C_ms"], "S_ms": med["S_ms"], "crossover_C_ms": med["Cx_ms"],
        "crossover_S_ms": med["Sx_ms"], "crossover_wait_ms": med["wait_ms"],
        "cpu_ms_per_iteration": {m: med[f"{m}_cpu_ms"] for m in modes},
        "hidden_fraction": med["hidden"],
        "identical_to_sequential": all(r["identical"] for r in rows),
        "spin_vs_sequential": med.get("spin_vs_sequential"),
        "target_met": med["x_vs_sequential"] >= 1.3,
    }
    if comm.rank == 0:
        print_table(rows, ["repeat", "C_ms", "S_ms", "Cx_ms", "Sx_ms", "wait_ms",
                           "sequential_cpu_ms", "crossover_cpu_ms", "sequential_s",
                           "colocated_s",
                           "crossover_s", "x_vs_sequential", "x_vs_colocated", "bound",
                           "token_bound", "hidden", "identical"]
                    + (["crossover_spin_s", "spin_vs_sequential"] if args.compare_spin
                       else []))
        print()
        print(f"# median: crossover {summary['speedup_vs_sequential']:.2f}x sequential "
              f"(bound (C+S)/max(C,S) = {summary['bound']:.2f}x, token bound "
              f"{summary['token_bound']:.2f}x; target >= 1.3x: "
              f"{'met' if summary['target_met'] else 'NOT met'}), "
              + (f"{summary['speedup_vs_colocated']:.2f}x co-location without the scheduler "
                 f"(co-location: {summary['colocated_vs_sequential']:.2f}x sequential); "
                 if summary["speedup_vs_colocated"] is not None else "") +
              f"{summary['hidden_fraction']:.0%} of the sync time hidden; trajectories "
              f"identical to sequential: {summary['identical_to_sequential']}")
        if args.compare_spin:
            print(f"# the scheduler with waits spinning in MPI (wait_poll_s=None): "
                  f"{summary['spin_vs_sequential']:.2f}x sequential")
        write_json(args.json, {
            "suite": "crossover", "machine": machine(), "args": vars(args),
            "clock": _clock.describe(),
            "calibration": {"C_s": c0, "real_sync_s": s0,
                            "sync_bytes_per_rank": sync_bytes(calibration, comm.size)},
            "delay_s": delay_s,
            "delay_kind": ("virtual clock: the network model" if virtual
                           else "sleep after the real allreduce in every sync phase"),
            "wait_poll_s": wait_poll_s,
            "rows": rows, "summary": summary,
        })
    return 0
