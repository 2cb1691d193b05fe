"""Crossover scheduler: token, jobs, bit-identical trajectories, trace properties, errors.

Multi-rank tests (``@pytest.mark.mpi``) run at every rank count of ``make test`` (1..5);
the trajectory and trace checks hold at any size. Serial tests cover the token, argument
checks, single-process failures and, through a child ``mpiexec`` job, a failure on one
rank of three.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm.sched import CrossoverError, CrossoverScheduler, FunctionJob, Job, Token
from mpicomm.strategies import make
from mpicomm.torch import GradientSync, LocalSGD, TorchJob

from .launch import run_job

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_kernels():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def mlp(seed: int, width: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 3))


def batches(seed: int, rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]


loss_fn = torch.nn.functional.cross_entropy

# (name, width, steps, how): different sizes, step counts and synchronization methods
SPECS = [("dense", 32, 5, {"strategy": "dense"}),
         ("topk", 48, 2, {"strategy": "topk"}),
         ("local", 16, 4, {"local_sgd": 2})]


def run_alone(comm, name: str, width: int, steps: int, how: dict[str, Any]) -> list[str]:
    """The ordinary training loop of one job on its own communicator: the reference."""
    seed = len(name)
    model = mlp(seed, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trajectory = []
    job_comm = comm.dup()
    try:
        if "local_sgd" in how:
            local = LocalSGD(model, how["local_sgd"], opt, comm=job_comm)
            for x, y in batches(seed, comm.rank, steps):
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                local.step(loss)
                trajectory.append(digest(model))
        else:
            with GradientSync(model, make(how["strategy"]), comm=job_comm) as sync:
                for x, y in batches(seed, comm.rank, steps):
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()
                    sync.step(opt)
                    trajectory.append(digest(model))
    finally:
        job_comm.free()
    return trajectory


def torch_job(comm, name: str, width: int, steps: int, how: dict[str, Any],
              trajectory: list[str]) -> TorchJob:
    seed = len(name)
    model = mlp(seed, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kwargs = dict(how)
    if "strategy" in kwargs:
        kwargs["strategy"] = make(kwargs["strategy"])
    return TorchJob(name, model, opt, batches(seed, comm.rank, steps), loss_fn,
                    on_step=lambda step, job: trajectory.append(digest(job.model)), **kwargs)


def quadratic_job(name: str, rank: int, steps: int, compute_s: float = 0.0,
                  sync_s: float = 0.0) -> tuple[FunctionJob, list[bytes]]:
    """Least squares by synchronous SGD as a pair of callables; records w after each step."""
    rng = np.random.default_rng(rank)
    a, b = rng.standard_normal((16, 4)), rng.standard_normal(16)
    w, g = np.zeros(4), np.zeros(4)
    trajectory: list[bytes] = []

    def apply() -> None:
        w[:] -= 0.05 * g
        trajectory.append(w.tobytes())

    def compute(step: int) -> None:
        if step:
            apply()
        g[:] = a.T @ (a @ w - b) / len(b)
        if compute_s:
            time.sleep(compute_s)

    def sync(step: int, comm) -> None:
        mpicomm.allreduce(g, op="avg", comm=comm, out=g)
        if sync_s:
            time.sleep(sync_s)

    return FunctionJob(name, compute, sync, steps, finish=apply), trajectory


def quadratic_alone(comm, rank: int, steps: int) -> list[bytes]:
    job, trajectory = quadratic_job("alone", rank, steps)
    job_comm = comm.dup()
    job.setup(job_comm)
    for step in range(steps):
        job.compute(step)
        job.sync(step)
    job.finish()
    job_comm.free()
    return trajectory


def spans(events: list[dict[str, Any]], pid: int, tid: str, name: str) -> list[tuple]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid
                  and e["name"] == name)


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


# ====================================================================== multi-rank
@pytest.mark.mpi
def test_every_job_is_bit_identical_to_running_it_alone(comm):
    references = {name: run_alone(comm, name, w, s, how) for name, w, s, how in SPECS}
    fn_reference = quadratic_alone(comm, comm.rank, 6)
    trajectories: dict[str, list[str]] = {name: [] for name, *_ in SPECS}
    jobs: list[Job] = [torch_job(comm, name, w, s, how, trajectories[name])
                       for name, w, s, how in SPECS]
    fn_job, fn_trajectory = quadratic_job("numpy", comm.rank, 6, sync_s=0.002)
    jobs.insert(1, fn_job)
    with CrossoverScheduler(jobs, comm=comm) as sched:
        stats = sched.run()
    for name, _, steps, _ in SPECS:
        assert len(trajectories[name]) == steps, name
        assert trajectories[name] == references[name], name
        assert stats.jobs[name].steps == steps
    assert fn_trajectory == fn_reference and len(fn_trajectory) == 6
    # synchronous data parallelism: every rank holds the same gradient-averaged model
    for job in jobs:
        if isinstance(job, TorchJob) and job.local_sgd is None:
            assert len(set(comm.allgather_object(digest(job.model)))) == 1, job.name
    assert len(set(comm.allgather_object(fn_trajectory[-1]))) == 1
    # the short job left early; the others kept running after it
    finished = {n: s.finished_at for n, s in stats.jobs.items()}
    assert finished["topk"] < finished["dense"]


@pytest.mark.mpi
def test_trace_shows_one_compute_at_a_time_and_sync_behind_compute(comm):
    a, _ = quadratic_job("A", comm.rank, 5, compute_s=0.015, sync_s=0.03)
    b, _ = quadratic_job("B", comm.rank, 4, compute_s=0.015, sync_s=0.03)
    with CrossoverScheduler([a, b], comm=comm, timeline=True) as sched:
        stats = sched.run()
        events = sched.timeline.gather(comm)
    if comm.rank != 0:
        return
    with tempfile.TemporaryDirectory() as tmp:  # a valid Chrome trace file
        saved = json.loads(sched.timeline.save(f"{tmp}/trace.json", events).read_text())
    assert len(saved["traceEvents"]) == len(events) + comm.size  # + process names
    for pid in range(comm.size):  # one row per job on every rank
        assert {"job A", "job B"} <= {e["tid"] for e in events if e["pid"] == pid}
        comp = {j: spans(events, pid, f"job {j}", "compute") + spans(events, pid, f"job {j}",
                                                                    "finish") for j in "AB"}
        sync = {j: spans(events, pid, f"job {j}", "sync") for j in "AB"}
        assert len(sync["A"]) == 5 and len(sync["B"]) == 4
        # the token: no compute phase of A overlaps one of B on the same rank
        assert not any(overlaps(x, y) for x in comp["A"] for y in comp["B"]), pid
        # crossover: A's communication runs while B computes, and the other way round
        assert any(overlaps(s, c) for s in sync["A"] for c in comp["B"]), pid
        assert any(overlaps(s, c) for s in sync["B"] for c in comp["A"]), pid
        # synchronous SGD: a job's sync ends before its next compute phase starts
        for j in "AB":
            for (_, end), (start, _) in zip(sync[j], comp[j][1:]):
                assert end <= start + 1.0, (pid, j)  # 1 us of clock rounding
    # most of the sync time was hidden (each sync is 2x one compute phase of the other)
    assert stats.jobs["A"].wait_seconds < stats.jobs["A"].sync_seconds


@pytest.mark.mpi
def test_gated_sync_phases_give_the_same_trajectories(comm):
    reference = quadratic_alone(comm, comm.rank, 4)
    a, traj_a = quadratic_job("a", comm.rank, 4)
    b, traj_b = quadratic_job("b", comm.rank, 4, compute_s=0.002)
    with CrossoverScheduler([a, b], comm=comm, gate_poll_s=1e-4) as sched:
        sched.run()
    assert traj_a == traj_b == reference


@pytest.mark.mpi
def test_sleep_polling_waits_give_the_same_trajectories_and_still_overlap(comm):
    from mpicomm.sched.crossover import NETWORK_WAIT_POLL_S

    specs = [SPECS[0], SPECS[2]]  # GradientSync (its own thread communicator) and LocalSGD
    references = {name: run_alone(comm, name, w, s, how) for name, w, s, how in specs}
    fn_reference = quadratic_alone(comm, comm.rank, 5)
    trajectories: dict[str, list[str]] = {name: [] for name, *_ in specs}
    jobs: list[Job] = [torch_job(comm, name, w, s, how, trajectories[name])
                       for name, w, s, how in specs]
    fn_job, fn_trajectory = quadratic_job("numpy", comm.rank, 5, compute_s=0.01, sync_s=0.02)
    jobs.append(fn_job)
    with CrossoverScheduler(jobs, comm=comm, timeline=True, wait_poll_s=1e-4) as sched:
        assert sched.wait_poll_s == 1e-4
        for job in jobs:  # set before setup: what the jobs build on it inherits it
            assert job.comm.wait_poll_s == 1e-4, job.name
        assert jobs[0].sync_object._tcomm.wait_poll_s == 1e-4
        sched.run()
        events = sched.timeline.gather(comm)
    for name, *_ in specs:
        assert trajectories[name] == references[name], name
    assert fn_trajectory == fn_reference
    if comm.rank == 0:
        for pid in range(comm.size):  # the numpy job's sync hides behind the others' compute
            others = [c for j in ("dense", "local") for c in spans(events, pid, f"job {j}",
                                                                   "compute")]
            assert any(overlaps(s, c) for s in spans(events, pid, "job numpy", "sync")
                       for c in others), pid
    # "auto": sleep-polling only when the ranks span several nodes (a network)
    a, _ = quadratic_job("a", comm.rank, 1)
    b, _ = quadratic_job("b", comm.rank, 1)
    with CrossoverScheduler([a, b], comm=comm) as sched:
        want = NETWORK_WAIT_POLL_S if comm.nodes > 1 else None
        assert sched.wait_poll_s == want and a.comm.wait_poll_s == want
        sched.run()


@pytest.mark.mpi(min_size=2)
def test_different_job_lists_raise_on_every_rank(comm):
    steps = 3 if comm.rank == comm.size - 1 else 2
    a, _ = quadratic_job("a", comm.rank, 2)
    b, _ = quadratic_job("b", comm.rank, steps)
    with pytest.raises(ValueError, match="same jobs"):
        CrossoverScheduler([a, b], comm=comm)
    c, _ = quadratic_job("c", comm.rank, 2)
    bad: list[Any] = [a, c] if comm.rank else [a, "not a job"]
    with pytest.raises(TypeError, match="Job"):
        CrossoverScheduler(bad, comm=comm)


# ====================================================================== serial
def test_token_cycles_in_order_and_jobs_leave():
    token = Token(["a", "b", "c"])
    seen = []
    for _ in range(4):
        name = token.turn
        token.acquire(name)
        seen.append(name)
        token.pass_on()
    assert seen == ["a", "b", "c", "a"]
    assert token.turn == "b"
    with pytest.raises(RuntimeError, match="'c' wants the token but it is 'b'"):
        token.acquire("c")
    token.acquire("b")
    with pytest.raises(RuntimeError, match="while 'b' holds it"):
        token.acquire("b")
    token.leave()
    assert token.order == ["a", "c"] and token.turn == "c"
    token.acquire("c")
    token.leave()
    assert token.turn == "a"
    token.acquire("a")
    token.leave()
    assert token.turn is None
    with pytest.raises(RuntimeError, match="not held"):
        token.pass_on()


def test_arguments_are_checked():
    a, _ = quadratic_job("a", 0, 2)
    with pytest.raises(ValueError, match="at least 2 jobs"):
        CrossoverScheduler([a])
    with pytest.raises(ValueError, match="unique"):
        CrossoverScheduler([a, quadratic_job("a", 0, 1)[0]])
    with pytest.raises(TypeError, match="Job"):
        CrossoverScheduler([a, lambda step: None])
    with pytest.raises(ValueError, match="gate_poll_s"):
        CrossoverScheduler([a, quadratic_job("b", 0, 1)[0]], gate_poll_s=0)
    with pytest.raises(ValueError, match="wait_poll_s"):
        CrossoverScheduler([a, quadratic_job("b", 0, 1)[0]], wait_poll_s=2.0)
    with pytest.raises(TypeError, match="wait_poll_s"):
        CrossoverScheduler([a, quadratic_job("b", 0, 1)[0]], wait_poll_s="network")
    with pytest.raises(TypeError, match="timeline"):
        CrossoverScheduler([a, quadratic_job("b", 0, 1)[0]], timeline="yes")
    with pytest.raises(TypeError, match="callable"):
        FunctionJob("f", None, lambda s, c: None, 3)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        FunctionJob("f", print, print, -1)
    with pytest.raises(ValueError, match="non-empty name"):
        FunctionJob("", print, print, 1)
    model = mlp(0, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not both"):
        TorchJob("t", model, opt, [], loss_fn, strategy="dense", local_sgd=2)
    with pytest.raises(ValueError, match="pass steps"):
        TorchJob("t", model, opt, iter([]), loss_fn)
    with pytest.raises(ValueError, match="delay_s"):
        TorchJob("t", model, opt, [], loss_fn, delay_s=-1.0)
    with pytest.raises(TypeError, match="optimizer"):
        TorchJob("t", model, model, [], loss_fn)


@pytest.mark.parametrize("phase", ["compute", "sync"])
def test_an_error_ends_the_run_and_names_the_job(phase):
    steady, _ = quadratic_job("steady", 0, 50, sync_s=0.005)
    stopped = threading.Event()

    def compute(step):
        if phase == "compute" and step == 2:
            raise ValueError("bad batch")

    def sync(step, comm):
        if phase == "sync" and step == 2:
            raise ValueError("bad batch")

    broken = FunctionJob("broken", compute, sync, 10, finish=stopped.set)
    before = threading.active_count()
    sched = CrossoverScheduler([steady, broken])
    pattern = f"job 'broken' failed in its {phase} phase at step 2.*ValueError: bad batch"
    with pytest.raises(CrossoverError, match=pattern) as info, sched:
        sched.run()
    assert info.value.job == "broken"
    assert isinstance(info.value.__cause__, ValueError)
    assert sched.stats.jobs["steady"].steps < 10  # the whole run ended, not only the job
    assert not stopped.is_set()
    assert threading.active_count() == before  # sync threads ended
    with pytest.raises(RuntimeError, match="closed"):
        sched.run()


def test_torch_job_data_running_out_is_an_error():
    model = mlp(0, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    short = TorchJob("short", model, opt, iter(batches(0, 0, 2)), loss_fn, steps=3)
    other, _ = quadratic_job("other", 0, 3)
    with CrossoverScheduler([short, other]) as sched, \
            pytest.raises(CrossoverError, match="'short'.*data ran out after 2 batches"):
        sched.run()


_CHILD = textwrap.dedent("""
    import time, numpy as np, mpicomm
    from mpicomm.sched import CrossoverScheduler, FunctionJob
    comm = mpicomm.init()
    def job(name, fail_rank):
        g = np.ones(1000)
        def compute(step):
            time.sleep(0.005)
        def sync(step, c):
            if comm.rank == fail_rank and step == 3:
                raise RuntimeError("sync exploded")
            mpicomm.allreduce(g, comm=c, out=g)
        return FunctionJob(name, compute, sync, 1000)
    CrossoverScheduler([job("steady", -1), job("broken", 1)], comm=comm).run()
    print("never reached", flush=True)
""")


def test_an_error_on_one_rank_ends_the_multi_rank_run():
    result = run_job(3, [sys.executable, "-c", _CHILD], timeout=90)
    assert result.returncode != 0, result.output
    assert "crossover job 'broken' failed in its sync phase at step 3 on rank 1/3" \
        in result.output, result.output
    assert "sync exploded" in result.output
    assert "never reached" not in result.output
    assert result.seconds < 45, result


def test_example_trains_two_jobs_and_writes_a_trace(tmp_path):
    trace = tmp_path / "trace.json"
    result = run_job(2, [sys.executable, "examples/crossover.py", "--steps", "40",
                         "--trace", str(trace)], timeout=150)
    assert result.returncode == 0, result.output
    for name in ("wide", "narrow"):
        line = next(ln for ln in result.output.splitlines() if ln.startswith(f"job {name}:"))
        assert float(line.split("test accuracy ")[1].split(",")[0]) > 0.5, line
    rows = {(e["pid"], e.get("tid")) for e in json.loads(trace.read_text())["traceEvents"]
            if e["ph"] == "X"}
    assert {(r, f"job {n}") for r in (0, 1) for n in ("wide", "narrow")} <= rows


def test_a_sync_phase_that_never_returns_cannot_hang_a_failed_run():
    release = threading.Event()

    def stuck(step, comm):
        release.wait(30)

    def compute(step):
        if step == 1:
            raise ValueError("broke while the other job was stuck")

    # broken computes step 0, stuck computes step 0 and never ends its sync, broken fails
    sched = CrossoverScheduler([FunctionJob("broken", compute, lambda s, c: None, 3),
                                FunctionJob("stuck", lambda s: None, stuck, 3)])
    start = time.perf_counter()
    with pytest.raises(CrossoverError, match="'broken'"), sched:
        sched.run()
    assert time.perf_counter() - start < 15
    release.set()


def test_benchmark_runs_every_mode_and_reports_the_bound(tmp_path):
    out = tmp_path / "crossover.json"
    result = run_job(2, [sys.executable, "-m", "mpicomm.bench", "crossover", "--steps", "3",
                         "--repeats", "1", "--batch", "16", "--hidden", "16",
                         "--wait-poll-ms", "0.5", "--compare-spin", "--json", str(out)],
                     timeout=150)
    assert result.returncode == 0, result.output
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["identical_to_sequential"] is True  # the scheduler changed no math
    assert 1.0 <= summary["bound"] <= 2.0
    (row,) = report["rows"]
    for mode in ("sequential", "colocated", "crossover", "crossover_spin"):
        assert row[f"{mode}_s"] > 0 and row[f"{mode}_it_s"] == pytest.approx(6 / row[f"{mode}_s"])
        assert row[f"{mode}_cpu_ms"] > 0
    assert summary["spin_vs_sequential"] == pytest.approx(row["sequential_s"]
                                                          / row["crossover_spin_s"])
    assert row["Cx_ms"] > 0 and row["Sx_ms"] > 0 and row["wait_ms"] >= 0
    assert report["wait_poll_s"] == 5e-4 and report["machine"]["network"]["hosts"] == 1
    assert "bound (C+S)/max(C,S)" in result.output and "wait poll 0.5 ms" in result.output


def test_jobs_of_any_length_run_in_cyclic_order():
    log: list[str] = []

    def job(name: str, steps: int) -> FunctionJob:
        return FunctionJob(name, lambda s: log.append(f"{name}{s}"),
                           lambda s, c: log.append(f"{name}{s}s"), steps,
                           finish=lambda: log.append(f"{name}."))

    with CrossoverScheduler([job("a", 3), job("b", 0), job("c", 1)]) as sched:
        stats = sched.run()
    computes = [e for e in log if not e.endswith("s")]
    assert computes == ["a0", "b.", "c0", "a1", "c.", "a2", "a."]
    for name, steps in (("a", 3), ("c", 1)):  # every sync ends before the next phase
        mine = [e for e in log if e.startswith(name)]
        assert mine == [x for s in range(steps) for x in (f"{name}{s}", f"{name}{s}s")] + [
            f"{name}."]
    assert [stats.jobs[n].steps for n in "abc"] == [3, 0, 1]


def test_benchmark_suggests_the_rate_that_balances_sync_and_compute(monkeypatch):
    import argparse

    from mpicomm.bench import crossover as bench
    from mpicomm.bench.crossover import load_shard

    comm = mpicomm.init()
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--steps", "3", "--hidden", "16", "--layers", "1",
                              "--batch", "8"])
    monkeypatch.setattr(bench, "run_sequential", lambda jobs, c: (1.0, 0.010, 0.0))
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    shard = load_shard(comm)
    job = bench.make_job("x", 99, shard, args, 0.0, comm.rank)
    params = sum(p.numel() for p in job.model.parameters())
    # 2 hosts: a ring allreduce sends the whole float32 gradient once, at 0.8 C = 8 ms
    assert bench.sync_bytes(job, 2) == 4 * params
    assert bench.suggest_rate(2, shard, args, comm) == f"{round(32 * params / 8e-3 / 1e6)}mbit"
    # 4 hosts on 2 cores: 1.5x the bytes, compute twice as slow
    want = round(1.5 * 32 * params / 16e-3 / 1e6)
    assert bench.suggest_rate(4, shard, args, comm) == f"{max(1, want)}mbit"
