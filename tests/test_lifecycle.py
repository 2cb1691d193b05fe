"""What objects create they release; failures end the job, naming it; no hang at exit.

Serial tests run child processes (one singleton process, or ``mpiexec`` jobs through
``tests/launch.py``), since each proves something about a whole process: that it
survives building and closing thousands of objects (MPICH allows 2048 communicators per
process), that MPI thread support below ``MPI_THREAD_MULTIPLE`` is honoured, that a
``GradientSync`` left by an exception cannot make ``MPI_Finalize`` hang, and that a fatal
message names the job. The multi-rank test checks the handles directly at every rank
count.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import mpicomm
from mpicomm.torch import GossipAveraging, GradientSync, LocalSGD

from .launch import ROOT, clean_env, run_job

# ---------------------------------------------------------------------- leaks
_MANY = textwrap.dedent("""
    import torch, mpicomm
    from mpi4py import MPI
    from mpicomm.torch import GradientSync, GossipAveraging, LocalSGD
    me = mpicomm.Communicator(MPI.COMM_SELF)   # local: Dup/Split cost no messages
    model = torch.nn.Linear(4, 2)
    N = 2100                                   # > MPICH's 2048 communicators per process
    for i in range(N):
        me.dup().free()
        me.split(0).free()
    for i in range(N):
        GradientSync(model, comm=me, broadcast=False).close()
    for i in range(100):
        with GradientSync(model, comm=me) as sync:
            model(torch.ones(1, 4)).sum().backward()
            sync.wait()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(50):   # they create no communicator (see the multi-rank test)
        local = LocalSGD(model, 1, opt, average_momentum=True, comm=me)
        local.average()
        GossipAveraging(model, comm=me).step()
    print("survived", N, flush=True)
""")


def test_building_and_closing_thousands_of_objects_leaks_no_communicator():
    """Before ``free()`` released the communicators that ``dup()``/``split()`` make, this
    died after ~2000 objects with MPICH's "Too many communicators (0/2048 free)"."""
    proc = subprocess.run([sys.executable, "-c", _MANY], cwd=ROOT, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "survived 2100" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.mpi
def test_closed_objects_release_their_mpi_handles(comm):
    from mpi4py import MPI

    def released(c: mpicomm.Communicator) -> bool:
        return all(h == MPI.COMM_NULL for h in (c.mpi, c.p2p, c.ctl, c.local_mpi))

    d = comm.dup()
    s = comm.split(comm.rank % 2)
    d.free()
    s.free()
    assert released(d) and released(s)
    model = torch.nn.Linear(3, 2)
    sync = GradientSync(model, comm=comm)
    model(torch.ones(1, 3)).sum().backward()
    sync.wait()
    sync.close()
    assert released(sync._tcomm)
    assert sync._thread is None or not sync._thread.is_alive()
    # LocalSGD and gossip create no communicator: they work on the one they are given
    local = LocalSGD(model, 1, comm=comm)
    gossip = GossipAveraging(model, comm=comm)
    local.average()
    gossip.step()
    assert local.comm is comm and gossip.comm is comm
    assert not released(comm)


# ---------------------------------------------------------------------- thread level
_SERIALIZED = textwrap.dedent("""
    import mpi4py
    mpi4py.rc.thread_level = "serialized"
    import threading, numpy as np, torch, mpicomm
    from mpi4py import MPI
    from mpicomm.torch import GradientSync
    assert MPI.Query_thread() < MPI.THREAD_MULTIPLE, MPI.Query_thread()
    comm = mpicomm.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    with GradientSync(model, comm=comm, bucket_mb=1e-4) as sync:
        assert not sync.threaded
        assert not any(t.name == "mpicomm-gradsync" for t in threading.enumerate())
        for step in range(3):
            model.zero_grad()
            x = torch.full((2, 6), float(comm.rank + step))
            model(x).square().sum().backward()
            local = [p.grad.clone() for p in model.parameters()]
            assert sync.wait()
            for p, g in zip(model.parameters(), local):
                want = mpicomm.allreduce(g.numpy(), op="avg", comm=comm)
                np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-6)
    print(f"serialized-ok-{comm.rank}", flush=True)
""")


def test_without_thread_multiple_gradientsync_communicates_in_wait():
    """Before: only a warning, and the thread still called MPI concurrently."""
    result = run_job(2, [sys.executable, "-c", _SERIALIZED], timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    assert "serialized-ok-0" in result.output and "serialized-ok-1" in result.output


# ---------------------------------------------------------------------- exit after errors
_STUCK = textwrap.dedent("""
    import time, torch, mpicomm
    from mpicomm.torch import GradientSync
    comm = mpicomm.init(abort_on_error=False)
    model = torch.nn.Linear(4, 2)
    try:
        with GradientSync(model, comm=comm, bucket_mb=1e-6) as sync:
            if comm.rank == 0:   # rank 0's thread enters a collective rank 1 never joins
                model(torch.ones(1, 4)).sum().backward()
                time.sleep(0.5)
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    print("left the with block on rank", comm.rank, flush=True)
""")


def test_exit_after_an_exception_cannot_hang_in_finalize():
    """Before: the thread stayed inside MPI and ``MPI_Finalize`` hung (job never ended)."""
    result = run_job(2, [sys.executable, "-c", _STUCK], timeout=90)
    assert "left the with block on rank 0" in result.output, result.output[-3000:]
    assert "MPI_Finalize cannot hang" in result.output, result.output[-3000:]
    assert result.returncode != 0
    assert result.seconds < 45, result


_CLEAN_EXIT = textwrap.dedent("""
    import torch, mpicomm
    from mpicomm.torch import GradientSync
    comm = mpicomm.init(abort_on_error=False)
    model = torch.nn.Linear(4, 2)
    try:
        with GradientSync(model, comm=comm) as sync:
            raise KeyError("same failure everywhere, before any backward")
    except KeyError:
        pass
    assert not sync._thread.is_alive()
    print(f"clean-{comm.rank}", flush=True)   # one token: two ranks' writes may interleave
""")


def test_exit_after_an_exception_with_an_idle_thread_ends_normally():
    result = run_job(2, [sys.executable, "-c", _CLEAN_EXIT], timeout=90)
    assert result.returncode == 0, result.output[-3000:]
    assert "clean-0" in result.output and "clean-1" in result.output, result.output


# ---------------------------------------------------------------------- job names
_ABORT_JOB = textwrap.dedent("""
    import sys, mpicomm
    from mpicomm.abort import job_scope
    comm = mpicomm.init()
    mode = sys.argv[1]
    # dup() inherits the job name of the communicator it duplicates
    named = comm.dup() if mode != "comm" else mpicomm.Communicator(comm.mpi, job="beta").dup()
    if comm.rank == 1:
        if mode == "abort":
            named.abort("gradients exploded", job="alpha")
        elif mode == "comm":
            named.abort("server lost")
        else:
            with job_scope("gamma"):
                raise RuntimeError("bad batch")
        print("abort returned", flush=True)
    comm.barrier()
    print("never reached", flush=True)
""")


@pytest.mark.parametrize(("mode", "expected"), [
    ("abort", "[mpicomm rank 1/2 job 'alpha'] gradients exploded"),
    ("comm", "[mpicomm rank 1/2 job 'beta'] server lost"),
    ("scope", "[mpicomm rank 1/2 job 'gamma'] uncaught exception"),
])
def test_abort_message_names_the_job(mode, expected):
    result = run_job(2, [sys.executable, "-c", _ABORT_JOB, mode], timeout=60)
    assert result.returncode != 0
    assert expected in result.output, result.output[-3000:]
    assert "abort returned" not in result.output and "never reached" not in result.output
