"""Timed runs on the virtual clock, under ``mpiexec`` at every rank count of the suite
(``@pytest.mark.mpi``) and in child jobs: the virtual times of messages, collectives,
framing, shared links, helper threads, gradient synchronization, the crossover scheduler
and the parameter server against the closed forms of the cost model, the same on every
run and with results bitwise equal to the wall clock's; a wait without progress ends at
the stall limit, and a bad platform is one clear error on every rank.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import math
import random
import sys
import threading
import time
from unittest import mock

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm import clock, vwire
from mpicomm.arrayops import ops_for
from mpicomm.costtable import CostTable, OpCost
from mpicomm.emulate import vnet
from mpicomm.emulate.vnet import Platform, platform_from_env
from mpicomm.p2p import Ctx

from .launch import run_job

# ---------------------------------------------------------------------- under mpiexec

GAMMA = 1e-10
TABLE = CostTable({"reduce": OpCost(0.0, GAMMA, "byte"), "copy": OpCost(0.0, 0.0, "byte"),
                   "select": OpCost(0.0, 0.0), "merge": OpCost(0.0, 0.0, "pair"),
                   "scatter": OpCost(0.0, 0.0)})


def _platform(size: int, **env: str) -> Platform:
    return platform_from_env(size, {"MPICOMM_VIRTUAL_RATE": "1gbit",
                                    "MPICOMM_VIRTUAL_DELAY": "100us", **env})


@contextlib.contextmanager
def virtual(comm, **env: str):
    """A virtual clock for the block and a fresh communicator timed by it (checked mode
    off: its agreement messages are charged like any MPI collective)."""
    with clock.session(_platform(comm.size, **env), TABLE):
        sub = comm.dup()
        sub.check = False
        try:
            yield sub
        finally:
            sub.free()


def _pingpong(ctx, buf, rounds: int) -> None:
    """``rounds`` round trips of ``buf`` between ranks 0 and 1 (others idle)."""
    for _ in range(rounds):
        if ctx.rank == 0:
            ctx.send(buf, 1, 7)
            ctx.recv(buf, 1, 7)
        elif ctx.rank == 1:
            ctx.recv(buf, 0, 7)
            ctx.send(buf, 0, 7)


def _elapsed(comm, fn) -> float:
    comm.barrier()                  # every rank leaves it at the same virtual time
    t0 = clock.now()
    fn()
    return comm.allreduce_value(clock.now() - t0, "max")


def test_stall_limit_from_env():
    assert vnet.stall_seconds_from_env({}) == vwire.STALL_S == 120.0
    assert vnet.stall_seconds_from_env({"MPICOMM_VIRTUAL_STALL_S": " 600 "}) == 600.0
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ValueError, match="MPICOMM_VIRTUAL_STALL_S"):
            vnet.stall_seconds_from_env({"MPICOMM_VIRTUAL_STALL_S": bad})


def test_a_wait_without_progress_ends_after_the_limit_the_env_sets(monkeypatch):
    monkeypatch.setenv("MPICOMM_VIRTUAL_STALL_S", "0.3")
    with clock.session(_platform(1), TABLE):
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="waited 0.3 s for a test's answer"):
            vwire._await(lambda: None, "a test's answer")
        assert time.monotonic() - t0 < 10
    monkeypatch.setenv("MPICOMM_VIRTUAL_STALL_S", "never")
    with pytest.raises(ValueError, match="MPICOMM_VIRTUAL_STALL_S"), \
            clock.session(_platform(1), TABLE):
        pass
    assert clock._virtual is None


@pytest.mark.mpi
def test_virtual_times_match_the_closed_forms(comm):
    from mpicomm.collectives import cost
    from mpicomm.sparse import gtopk

    c = cost.CostParams(alpha=100e-6, beta=8e-9, gamma=GAMMA)
    p, rank = comm.size, comm.rank
    cases = []
    with virtual(comm) as vc:
        if p > 1:
            for nbytes in (8, 1 << 20):
                buf = np.zeros(nbytes, dtype=np.uint8)
                ctx = Ctx.of(vc, ops_for("numpy", False))

                cases.append((f"pingpong-{nbytes}",
                              _elapsed(vc, lambda buf=buf, ctx=ctx: _pingpong(ctx, buf, 3)) / 6,
                              c.alpha + nbytes * c.beta))
        for n in (1000, 250_000, 600_000):   # the largest: ring blocks of 2+ segments
            x = np.arange(n, dtype=np.float32)
            for alg in ("ring", "recursive_doubling"):
                t = _elapsed(vc, lambda x=x, alg=alg: mpicomm.allreduce(
                    x, algorithm=alg, comm=vc))
                cases.append((f"allreduce-{alg}-{n}", t,
                              cost.predict("allreduce", alg, 4 * n, p, c)))
            t = _elapsed(vc, lambda x=x: mpicomm.allgather(x, algorithm="ring", comm=vc))
            cases.append((f"allgather-ring-{n}", t,
                          cost.predict("allgather", "ring", 4 * n * p, p, c)))
        d, k = 1_000_000, 10_000
        gen = torch.Generator().manual_seed(rank)
        idx, val = torch.randperm(d, generator=gen)[:k], torch.randn(k, generator=gen)
        cases.append(("gtopk", _elapsed(vc, lambda: gtopk(idx, val, k, comm=vc, size=d)),
                      cost.gtopk(k, 8, p, c)))
    for name, got, model in cases:
        if model == 0:
            assert got == 0, name
        else:
            assert got == pytest.approx(model, rel=0.05), name


@pytest.mark.mpi
def test_framing_adds_the_headers_between_hosts_and_nothing_within(comm):
    """A ping-pong between hosts takes ``delay + wire_bytes(n) / rate`` each way under the
    ``tcp`` framing; between ranks of one host the framing changes nothing."""
    if comm.size < 2:
        pytest.skip("a ping-pong needs 2 ranks")
    sizes = "2" + ",1" * (comm.size - 2)
    got = {}
    for framing in ("none", "tcp"):
        for layout in (None, sizes):            # ranks 0 and 1 on two hosts, then on one
            env = {"MPICOMM_VIRTUAL_FRAMING": framing}
            if layout:
                env["MPICOMM_HOST_SIZES"] = layout
            with virtual(comm, **env) as vc:
                buf = np.zeros(100_000, dtype=np.uint8)
                ctx = Ctx.of(vc, ops_for("numpy", False))
                got[framing, layout] = _elapsed(
                    vc, lambda ctx=ctx, buf=buf: _pingpong(ctx, buf, 1)) / 2
    wire = 100_000 + 66 * math.ceil(100_000 / 1448)
    assert got["none", None] == pytest.approx(100e-6 + 100_000 / 125e6, rel=1e-9)
    assert got["tcp", None] == pytest.approx(100e-6 + wire / 125e6, rel=1e-9)
    assert got["tcp", sizes] == got["none", sizes] < got["none", None]


def _digest(comm) -> str:
    from mpicomm.sparse import artopk, gtopk, topk_allgather

    rank, h = comm.rank, hashlib.sha256()
    x = (np.arange(10_001, dtype=np.float32) * 0.37 + rank).astype(np.float32)
    for alg in ("ring", "recursive_doubling", "rabenseifner", "mpi"):
        h.update(mpicomm.allreduce(x, algorithm=alg, comm=comm).tobytes())
    for alg in ("ring", "bruck", "recursive_doubling", "direct"):
        h.update(mpicomm.allgather(x[:777], algorithm=alg, comm=comm).tobytes())
    gen = torch.Generator().manual_seed(rank)
    d, k = 50_000, 500
    idx, val = torch.randperm(d, generator=gen)[:k], torch.randn(k, generator=gen)
    gi, gv = gtopk(idx, val, k, comm=comm, size=d)
    h.update(gi.numpy().tobytes() + gv.numpy().tobytes())
    h.update(topk_allgather(idx, val, d, comm=comm).numpy().tobytes())
    ai, av = artopk(torch.randn(d, generator=gen), k, step=1, comm=comm)
    h.update(ai.numpy().tobytes() + av.numpy().tobytes())
    h.update(repr(comm.allreduce_value(float(rank), "sum")).encode())
    return h.hexdigest()


@pytest.mark.mpi
def test_results_bitwise_equal_to_the_wall_clock(comm):
    wall = _digest(comm)
    with virtual(comm) as vc:
        assert _digest(vc) == wall
        assert clock.now() > 0 or comm.size == 1


def _contended(comm) -> list[float]:
    from mpicomm.sparse import gtopk

    rng, rank, times = random.Random(), comm.rank, []
    x = np.arange(50_000, dtype=np.float32)
    for alg in ("ring", "recursive_doubling"):
        time.sleep(rng.random() * 0.01)         # real time differs run to run
        clock.compute(1e-4 * rank)              # ranks reach the collective apart
        mpicomm.allreduce(x, algorithm=alg, comm=comm)
        times.append(clock.now())
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randperm(100_000, generator=gen)[:5000]
    time.sleep(rng.random() * 0.01)
    gtopk(idx, torch.randn(5000, generator=gen), 5000, comm=comm, size=100_000)
    times.append(clock.now())
    return times


@pytest.mark.mpi
def test_shared_links_give_the_same_times_every_run(comm):
    sizes = ",".join(["2"] * (comm.size // 2) + ["1"] * (comm.size % 2))
    runs = []
    for _ in range(2):
        with virtual(comm, MPICOMM_HOST_SIZES=sizes) as vc:
            runs.append(vc.allgather_object(_contended(vc)))
    assert runs[0] == runs[1]
    if comm.size == 4:    # two ranks of one host send across at once: one queues
        with virtual(comm, MPICOMM_VIRTUAL_RANKS_PER_HOST="2") as vc:
            ctx = Ctx.of(vc, ops_for("numpy", False))
            buf = np.zeros(125_000, dtype=np.uint8)          # 1 ms at 1 Gbit/s
            vc.barrier()
            t0 = clock.now()
            if vc.rank < 2:
                ctx.send(buf, vc.rank + 2, 9)
            else:
                ctx.recv(buf, vc.rank - 2, 9)
            got = vc.allgather_object(clock.now() - t0)
            assert got == pytest.approx([1e-3, 2e-3, 1.1e-3, 2.1e-3])


@pytest.mark.mpi
def test_helper_thread_overlaps_the_main_threads_compute(comm):
    x = np.ones(250_000, dtype=np.float32)
    results = []
    for compute in (0.001, 1.0):
        with virtual(comm) as vc:
            helper_comm = vc.dup()
            work: clock.Queue = clock.Queue()
            done: clock.Queue = clock.Queue()

            def helper(work: clock.Queue, done: clock.Queue, helper_comm) -> None:
                while work.get() is not None:
                    mpicomm.allreduce(x, algorithm="ring", comm=helper_comm)
                    done.put(clock.now())

            thread = threading.Thread(target=helper, args=(work, done, helper_comm))
            thread.start()
            vc.barrier()
            t0 = clock.now()
            work.put("go")
            clock.compute(compute)              # the main thread computes meanwhile
            with clock.waiting_for_threads():
                finished = done.get()
            results.append((clock.now() - t0, finished - t0))
            work.put(None)
            thread.join()
            helper_comm.free()
    (after, comm_done), (after_long, comm_long) = results
    if comm.size > 1:
        assert after == pytest.approx(comm_done) and comm_done > 0.001  # waited for it
        assert comm_long == pytest.approx(comm_done)
    assert after_long == pytest.approx(1.0)                           # hidden behind


@pytest.mark.mpi
def test_a_reported_step_sets_the_network_of_every_thread_of_the_rank(comm, tmp_path):
    # the main thread reports the training step; a helper thread (as a gradient
    # synchronization's) sends on the conditions of that step
    schedule = tmp_path / "schedule.txt"
    schedule.write_text("step 5 100mbit 100us\n")
    x = np.ones(250_000, dtype=np.float32)
    times = []
    with virtual(comm, MPICOMM_VIRTUAL_SCHEDULE=str(schedule)) as vc:
        for step in (1, 5, 6):
            clock.report_step(step)
            out: list[float] = []

            def helper(out: list[float] = out) -> None:
                took = _elapsed(vc, lambda: mpicomm.allreduce(x, algorithm="ring", comm=vc))
                out.extend((took, clock.now()))

            thread = threading.Thread(target=helper)
            with clock.waiting_for_threads():
                thread.start()
                thread.join()
            clock.join(out[1])      # the main thread goes on from the helper's end
            times.append(out[0])
    if comm.size > 1:   # 1 Gbit/s before step 5, 100 Mbit/s from it on
        assert times[1] > 5 * times[0] and times[2] == pytest.approx(times[1])


def test_bad_platform_is_one_clear_error_on_every_rank():
    res = run_job(3, [sys.executable, "-c", "import mpicomm; mpicomm.init()"], timeout=120,
                  MPICOMM_CLOCK="virtual", MPICOMM_VIRTUAL_RATE="0")
    assert res.returncode != 0
    assert "MPICOMM_VIRTUAL_RATE='0': a rate must be > 0" in res.output


_READ_FIRST = """
import numpy as np, mpicomm
from mpi4py import MPI
from mpicomm import clock
t0 = clock.now()                      # before any communicator: the origin
rank = mpicomm.world().rank
clock.compute(0.25 if rank == 0 else 0.0)
y = mpicomm.allreduce(np.ones(10**6, dtype=np.float32), algorithm="ring")
rows = MPI.COMM_WORLD.gather((t0, clock.now(), float(y[0])), root=0)
if rank == 0:
    print("T", repr(rows), flush=True)
"""


def test_now_may_come_before_the_first_collective():
    res = run_job(3, [sys.executable, "-c", _READ_FIRST], timeout=180, MPICOMM_CLOCK="virtual",
                  MPICOMM_VIRTUAL_RATE="1gbit", MPICOMM_VIRTUAL_DELAY="1ms")
    assert res.returncode == 0, res.output
    rows = ast.literal_eval(res.output.split("T ", 1)[1].splitlines()[0])
    assert len(rows) == 3
    line = 2 * (2 / 3) * 4e6 * 8 / 1e9      # the ring's 2(P-1)/P·n bytes at 1 Gbit/s
    for t0, t1, value in rows:
        assert t0 == 0.0 and value == 3.0
        # rank 0's compute before the start delays every rank's ring (+ 4 latencies at most)
        assert 0.25 + line <= t1 <= 0.25 + line + 4e-3


@pytest.mark.mpi
def test_gradient_sync_overlap_follows_the_backward_cost(comm):
    from mpicomm.torch import GradientSync

    def elapsed(backward_s: float) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        x = torch.randn(8, 256)
        with virtual(comm) as vc:
            clock.declare("backward", backward_s)
            with GradientSync(model, comm=vc, bucket_mb=0.3) as sync:
                vc.barrier()
                t0 = clock.now()
                model(x).sum().backward()
                sync.wait()
                return vc.allreduce_value(clock.now() - t0, "max")

    alone, hidden = elapsed(0.0), elapsed(1.0)
    if comm.size == 1:
        assert alone == 0.0 and hidden == pytest.approx(1.0)
        return
    # four 257 KB buckets: the first three are averaged during backward, the last after
    one = 0.2e-3 + 2 * (comm.size - 1) / comm.size * 257 * 1024 * 8e-9
    assert alone > 3 * one
    assert 1.0 + 0.8 * one < hidden < 1.0 + 2 * one


@pytest.mark.mpi
def test_calibrate_model_enters_the_step_and_restores_the_model(comm):
    from mpicomm.torch.costs import calibrate_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    with virtual(comm):
        measured = calibrate_model(model, x, y, torch.nn.functional.cross_entropy, opt,
                                   repeats=2)
        table = clock.cost_table()
        for op in ("forward", "backward", "optimizer"):
            assert table.ops[op] == measured.ops[op] and measured.ops[op].unit == "call"
        assert measured.ops["forward"].per_call > 0
        t0 = clock.now()
        clock.charge("forward")
        assert clock.now() - t0 == pytest.approx(measured.ops["forward"].per_call)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not opt.state


@pytest.mark.mpi
def test_crossover_overlaps_one_jobs_sync_with_the_others_compute(comm):
    from mpicomm.sched import CrossoverScheduler
    from mpicomm.torch import TorchJob

    def job(name: str, seed: int, steps: int) -> TorchJob:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 64))
        gen = torch.Generator().manual_seed(seed + comm.rank)
        data = [(torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen))
                for _ in range(steps)]
        return TorchJob(name, model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                        torch.nn.functional.mse_loss, strategy="dense")

    def run(late_start: float = 0.0) -> tuple[float, float, float, list[float]]:
        with virtual(comm) as vc:
            for op in ("forward", "backward", "optimizer"):
                clock.declare(op, 0.01)
            start_thread = clock.start_thread

            def late(target, name, daemon=True):   # the OS runs the sync threads late
                def body() -> None:
                    time.sleep(late_start)
                    target()
                return start_thread(body, name, daemon)

            with mock.patch.object(clock, "start_thread", late), \
                    CrossoverScheduler([job("a", 0, 4), job("b", 1, 4)], comm=vc) as sched:
                stats = sched.run()
            compute = sum(j.compute_seconds for j in stats.jobs.values())
            sync = sum(j.sync_seconds for j in stats.jobs.values())
            losses = [loss for j in sched.jobs for loss in j.losses]
            return stats.seconds, compute, sync, losses

    total, compute, sync, losses = run()
    assert run() == (total, compute, sync, losses)        # repeatable, bit for bit
    # whenever the operating system first runs a thread (here: rank 1's, late)
    assert run(0.3 if comm.rank == 1 else 0.0) == (total, compute, sync, losses)
    assert compute == pytest.approx(2 * 4 * 0.03)         # forward + backward + optimizer
    assert total >= compute - 1e-12
    if comm.size > 1:     # a job's averaging hides behind the other job's compute
        assert sync > 0 and total < compute + sync


@pytest.mark.mpi
def test_a_tested_send_completes_at_its_virtual_time(comm):
    """A loop that tests and drops its sends (the parameter server's) must not see a send
    done before it has left the modelled link, however early MPI delivered it: else the
    clock after a later wait would depend on real timing."""
    from mpi4py import MPI

    from mpicomm.p2p import improbe, isend_bytes, recv_bytes, sent, wait_sends

    if comm.size < 2:
        pytest.skip("needs a receiver")
    n = 1 << 20                           # 8.4 ms on the modelled 1 Gbit/s link
    with virtual(comm) as vc:
        if vc.rank == 0:
            t0 = clock.now()
            req = isend_bytes(vc.p2p, np.ones(n, dtype=np.uint8), 1, 9)
            time.sleep(0.05)              # MPI has delivered it by now, in real time
            assert not sent(req)          # still on the link in virtual time
            wait_sends([req], 0.0)
            assert clock.now() == pytest.approx(t0 + n / 125e6, rel=1e-9)
            clock.compute(1.0)            # later: done, and dropping it moves nothing
            req = isend_bytes(vc.p2p, np.ones(8, dtype=np.uint8), 1, 9)
            clock.compute(1.0)
            t1 = clock.now()
            while not sent(req):
                time.sleep(1e-3)
            assert clock.now() == t1
        elif vc.rank == 1:
            status = MPI.Status()
            for _ in range(2):
                recv_bytes(improbe(vc.p2p, 0, 9, status), status, None, vc.p2p)
        vc.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parameter_server_is_repeatable_on_the_virtual_clock(comm, mode):
    from mpicomm.ps import KVStore

    if comm.size < 2:
        pytest.skip("a parameter server needs a server and a worker")

    def run() -> tuple[list[float], float]:
        with virtual(comm) as vc:
            kv = KVStore(vc, servers=1, mode=mode, lr=0.1)
            if kv.is_server:
                kv.serve()
                values = []
            else:
                kv.init("w", np.zeros(50_000, dtype=np.float32))
                rng = random.Random()
                for step in range(4):
                    time.sleep(rng.random() * 0.01)       # real timing varies run to run
                    clock.compute(1e-3 * (1 + kv.worker_rank))   # a 2x, 3x straggler
                    kv.push("w", np.full(50_000, float(kv.worker_rank + step),
                                         dtype=np.float32))
                    values = kv.pull("w")[:3].tolist()
                kv.close()
            return values, vc.allreduce_value(clock.now(), "max")

    first, again = run(), run()
    assert first == again                 # values and virtual time, bit for bit
    assert first[1] > 0
