"""Communicator: topology, splits, roles, checked mode, and the abort-on-error policy."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import mpicomm
from mpicomm.comm import describe_mismatch

from .launch import run_job


# ---------------------------------------------------------------- multi-rank
@pytest.mark.mpi
def test_topology_matches_mpi(comm):
    world = MPI.COMM_WORLD
    assert (comm.rank, comm.size) == (world.Get_rank(), world.Get_size())
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    assert (comm.local_rank, comm.local_size) == (local.Get_rank(), local.Get_size())
    local.Free()
    nodes = comm.allgather_object(comm.node)
    assert comm.nodes == len(set(nodes)) >= 1
    assert 0 <= comm.node < comm.nodes
    # ranks on one node report the same node index
    names = comm.allgather_object(MPI.Get_processor_name())
    for i, j in [(i, j) for i in range(comm.size) for j in range(comm.size)]:
        if names[i] == names[j]:
            assert nodes[i] == nodes[j]


@pytest.mark.mpi
def test_split_by_parity_and_opt_out(comm):
    sub = comm.split(comm.rank % 2)
    assert sub.size == len(range(comm.rank % 2, comm.size, 2))
    assert sub.rank == comm.rank // 2
    total = mpicomm.allreduce(np.array([comm.rank]), comm=sub)
    assert total[0] == sum(range(comm.rank % 2, comm.size, 2))
    sub.free()
    none = comm.split(None if comm.rank == 0 else 0)
    if comm.rank == 0:
        assert none is None
    else:
        assert none.size == comm.size - 1
        none.free()


@pytest.mark.mpi
def test_dup_is_independent(comm):
    other = comm.dup()
    assert (other.rank, other.size) == (comm.rank, comm.size)
    assert other.p2p != comm.p2p
    other.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("placement", ["first", "spread"])
def test_split_roles(comm, placement):
    servers = 1 if comm.size < 4 else 2
    roles = comm.split_roles(servers, placement=placement)
    assert len(roles.servers) == servers
    assert sorted(roles.servers + roles.workers) == list(range(comm.size))
    assert roles.is_server == (comm.rank in roles.servers)
    assert roles.group.size == (servers if roles.is_server else comm.size - servers)
    if placement == "first":
        assert roles.servers == tuple(range(servers))
    roles.group.free()


@pytest.mark.mpi
def test_split_roles_rejects_bad_counts(comm):
    for bad in (0, comm.size, -1):
        with pytest.raises(ValueError, match="num_servers"):
            comm.split_roles(bad)
    with pytest.raises(TypeError):
        comm.split_roles(1.0)
    if comm.size > 1:
        with pytest.raises(ValueError, match="placement"):
            comm.split_roles(1, placement="random")


@pytest.mark.mpi
def test_allreduce_value(comm):
    assert comm.allreduce_value(comm.rank + 1) == comm.size * (comm.size + 1) // 2
    assert comm.allreduce_value(float(comm.rank), "max") == comm.size - 1
    assert comm.allreduce_value(1.0, "avg") == pytest.approx(1.0)
    with pytest.raises(ValueError):
        comm.allreduce_value(1, "prod")


@pytest.mark.mpi(min_size=2)
def test_checked_mode_names_the_mismatch_on_every_rank(comm):
    n = 4 if comm.rank != comm.size - 1 else 5
    with pytest.raises(ValueError, match=rf"shape is \(4,\) on rank 0 but \(5,\) on rank "
                                         rf"{comm.size - 1}"):
        mpicomm.allreduce(np.ones(n, np.float32), comm=comm)
    dtype = np.float32 if comm.rank else np.float64
    with pytest.raises(ValueError, match="dtype"):
        mpicomm.allreduce(np.ones(3, dtype), comm=comm)
    # the communicator stays usable afterwards
    assert mpicomm.allreduce(np.ones(2), comm=comm)[0] == comm.size


@pytest.mark.mpi(min_size=2)
def test_checked_mode_names_different_operations(comm):
    with pytest.raises(ValueError, match="calls"):
        if comm.rank == 0:
            comm.check_collective("allreduce", shape=(1,))
        else:
            comm.check_collective("allgather", shape=(1,))


# ---------------------------------------------------------------- serial
def test_describe_mismatch():
    same = [("allreduce", (("shape", (2,)),))] * 3
    assert describe_mismatch(same) is None
    diff = same[:2] + [("allreduce", (("shape", (3,)),))]
    assert "shape is (2,) on rank 0 but (3,) on rank 2" in describe_mismatch(diff)


def test_resolve_rejects_raw_mpi_comm():
    with pytest.raises(TypeError, match="mpicomm.init"):
        mpicomm.allreduce(np.ones(2), comm=MPI.COMM_SELF)
    with pytest.raises(TypeError):
        mpicomm.allreduce(np.ones(2), comm="world")


_RAISER = textwrap.dedent("""
    import time, numpy as np, mpicomm
    comm = mpicomm.init()
    if comm.rank == 1:
        time.sleep(0.2)
        raise RuntimeError("boom on rank one")
    mpicomm.allreduce(np.ones(4), comm=comm)   # the others wait here forever without abort
    print("never reached")
""")


def test_uncaught_exception_on_one_rank_ends_the_job():
    result = run_job(3, [sys.executable, "-c", _RAISER], timeout=60)
    assert result.returncode != 0
    assert "boom on rank one" in result.output
    assert "[mpicomm rank 1/3]" in result.output
    assert "never reached" not in result.output
    assert result.seconds < 20, result


_THREAD_RAISER = textwrap.dedent("""
    import threading, numpy as np, mpicomm
    comm = mpicomm.init()
    def work():
        if comm.rank == 0:
            raise ValueError("thread failure")
    t = threading.Thread(target=work, name="grad-sync"); t.start(); t.join()
    mpicomm.allreduce(np.ones(4), comm=comm)
    comm.barrier()
    if comm.rank == 0:
        import time; time.sleep(30)
""")


def test_uncaught_exception_in_a_thread_ends_the_job():
    result = run_job(2, [sys.executable, "-c", _THREAD_RAISER], timeout=60)
    assert result.returncode != 0
    assert "thread failure" in result.output and "grad-sync" in result.output
    assert result.seconds < 20, result


_FAILING_SUITE = textwrap.dedent("""
    import numpy as np, pytest, mpicomm

    @pytest.mark.mpi
    def test_one_rank_fails(comm):
        assert comm.rank != 1, "rank one disagrees"

    @pytest.mark.mpi
    def test_collective_after(comm):
        mpicomm.allreduce(np.ones(3), comm=comm)
""")


def test_pytest_plugin_aborts_instead_of_hanging(tmp_path):
    suite = tmp_path / "test_child_suite.py"
    suite.write_text(_FAILING_SUITE)
    result = run_job(3, [sys.executable, "-m", "pytest", "-p", "mpicomm.testing", "--with-mpi",
                         "-p", "no:cacheprovider", "--color=no", "-q", str(suite)], timeout=90)
    assert result.returncode != 0
    assert "rank 1/3" in result.output and "rank one disagrees" in result.output
    assert result.seconds < 45, result


@pytest.mark.mpi(min_size=2)
def test_checked_mode_raises_everywhere_when_one_rank_has_a_bad_argument(comm):
    last = comm.size - 1
    x = np.ones(4, np.float32)
    out = np.empty(5 if comm.rank == last else 4, np.float32)   # only the last rank errs
    with pytest.raises(ValueError, match="out has shape" if comm.rank == last
                       else f"rank {last} rejected its arguments"):
        mpicomm.allreduce(x, comm=comm, out=out)
    bad = [1.0, 2.0] if comm.rank == last else np.ones(2)
    with pytest.raises(TypeError):
        mpicomm.broadcast(bad, comm=comm)
    assert mpicomm.allreduce(np.ones(1), comm=comm)[0] == comm.size   # still in step


@pytest.mark.mpi(min_size=2)
def test_allgatherv_raises_everywhere_even_unchecked():
    plain = mpicomm.Communicator(MPI.COMM_WORLD.Dup(), check=False)
    bad = "not an array" if plain.rank == 0 else np.ones(2)
    with pytest.raises((TypeError, ValueError), match="numpy|rank 0 rejected"):
        mpicomm.allgatherv(bad, comm=plain)
    assert mpicomm.allgatherv(np.ones(plain.rank), comm=plain).shape == (
        plain.size * (plain.size - 1) // 2,)
    plain.free()


def test_configure_logging(monkeypatch):
    import logging

    from mpicomm.comm import configure_logging

    logger = logging.getLogger("mpicomm")
    saved_level, saved_handlers = logger.level, list(logger.handlers)
    try:
        monkeypatch.setenv("MPICOMM_LOG_LEVEL", "debug")
        configure_logging()
        assert logger.level == logging.DEBUG
        assert any("rank" in (h.formatter._fmt if h.formatter else "") for h in logger.handlers)
        with pytest.raises(ValueError, match="MPICOMM_LOG_LEVEL"):
            configure_logging("loud")
    finally:
        logger.setLevel(saved_level)
        logger.handlers[:] = saved_handlers
