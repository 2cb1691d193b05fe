"""Several network ports (NICs) per host: the platform's and the topology's port layout,
the virtual clock's links per port, and the two-link cost model that prices them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np
import pytest

import mpicomm
from mpicomm import clock
from mpicomm.collectives import cost
from mpicomm.costtable import CostTable, OpCost
from mpicomm.emulate import vengine
from mpicomm.emulate.vnet import Platform, parse_nics, platform_from_env, port_layout
from mpicomm.topology import Topology, detect

from .launch import ROOT, run_job

TABLE = CostTable({"reduce": OpCost(0.0, 1e-10, "byte"), "copy": OpCost(0.0, 0.0, "byte")})
NET = cost.CostParams(alpha=100e-6, beta=8e-9, gamma=1e-10)
SHM = cost.CostParams(alpha=1e-6, beta=1e-10, gamma=1e-10)


# ---------------------------------------------------------------------- layouts
def test_port_layout_numbers_ports_across_hosts():
    assert port_layout((0, 0, 1, 1, 2), 1) == (0, 0, 1, 1, 2)
    assert port_layout((0, 0, 1, 1, 2), 2) == (0, 1, 2, 3, 4)
    assert port_layout((0, 0, 0, 1, 1, 1), 2) == (0, 1, 0, 2, 3, 2)
    assert port_layout((0, 1, 0, 1), 4) == (0, 1, 2, 3)    # local rank in rank order


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_bad_nic_counts_name_the_variable(text):
    with pytest.raises(ValueError, match="MPICOMM_HOST_NICS"):
        parse_nics(text)
    with pytest.raises(ValueError, match="MPICOMM_HOST_NICS"):
        platform_from_env(4, {"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_HOST_NICS": text})


def test_platform_ports_from_env():
    p = platform_from_env(5, {"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_HOST_SIZES": "2,2,1",
                              "MPICOMM_HOST_NICS": "2"})
    assert p.nics == 2 and p.ports == (0, 1, 2, 3, 4) and p.num_ports == 5
    assert p.describe()["nics_per_host"] == 2
    q = platform_from_env(4, {"MPICOMM_VIRTUAL_RATE": "1gbit",
                              "MPICOMM_VIRTUAL_RANKS_PER_HOST": "2"})
    assert q.nics == 1 and q.ports == q.hosts and q.ranks_on_port(1) == (2, 3)
    with pytest.raises(ValueError, match="nics"):
        Platform(rate=1e6, delay=0.0, hosts=(0, 0), nics=0)


def test_topology_keeps_each_ranks_port():
    t = Topology.from_sizes((3, 3), nics=2)
    assert [t.port(r) for r in range(6)] == [0, 1, 0, 2, 3, 2]
    assert "3+3 ranks, 2+2 network ports" in t.describe()
    # a lane (local rank 1 of every host) keeps the ports it had in the parent
    lane = t.restrict([1, 4])
    assert lane.hosts == (0, 1) and [lane.port(r) for r in range(2)] == [0, 1]
    sub = t.restrict([0, 2, 3])
    assert sub.hosts == (0, 0, 1) and sub.ports == ()      # one port per host again
    assert Topology.from_sizes((2, 2), nics=1) == Topology.from_sizes((2, 2))
    with pytest.raises(ValueError, match="port of its own host"):
        Topology((0, 1), (0, 0))


# ---------------------------------------------------------------------- cost model
@pytest.mark.parametrize("hosts, per_host", [(8, 4), (16, 2), (2, 2), (3, 3)])
def test_one_port_per_rank_lets_the_lanes_share_nothing(hosts, per_host):
    """With a port per rank the hierarchical allreduce of a large vector gains close to
    ``R`` over the flat ring (each lane crosses hosts through its own port), against the
    bandwidth bound ``(P-1)H / (P(H-1))`` with one port per host."""
    n = 4e7
    shared = cost.HostCosts(Topology.from_sizes((per_host,) * hosts), SHM, NET)
    own = cost.HostCosts(Topology.from_sizes((per_host,) * hosts, nics=per_host), SHM, NET)
    p = hosts * per_host
    bound = (p - 1) * hosts / (p * (hosts - 1))
    gain_shared = shared.flat("allreduce", "ring", n).total / \
        shared.hierarchical_allreduce(n).total
    gain_own = own.flat("allreduce", "ring", n).total / own.hierarchical_allreduce(n).total
    assert gain_shared <= bound * 1.01
    # the flat ring is the same either way: one rank of a host crosses per step
    assert own.flat("allreduce", "ring", n).total == pytest.approx(
        shared.flat("allreduce", "ring", n).total)
    assert gain_own == pytest.approx(per_host * gain_shared, rel=0.08)
    assert cost.choose("allreduce", n, p, hosts=own) == "hierarchical"


def test_a_butterfly_no_longer_queues_its_lanes_behind_one_port():
    """Recursive doubling over 4 hosts of 2: with one port per host every network round
    pushes both local ranks' messages through it; with a port each, one."""
    n = 1e6
    shared = cost.HostCosts(Topology.from_sizes((2,) * 4), SHM, NET)
    own = cost.HostCosts(Topology.from_sizes((2,) * 4, nics=2), SHM, NET)
    rounds = 2                                   # lg 4 network rounds, lg 2 local
    saved = rounds * n * NET.beta
    got = shared.flat("allreduce", "recursive_doubling", n).total - \
        own.flat("allreduce", "recursive_doubling", n).total
    assert got == pytest.approx(saved, rel=1e-6)


# ---------------------------------------------------------------------- engine
@pytest.mark.parametrize("nics, second", [(1, (0.101, 0.102)), (2, (0.1, 0.101))])
def test_engine_queues_on_a_shared_port_only(nics, second):
    """Ranks 0 and 1 of host 0 each send 1 000 bytes at 0.1 s to host 1 (1 MB/s): behind
    one port the second waits for the first; with a port each both leave at once."""
    plat = Platform(rate=1e6, delay=1e-3, hosts=(0, 0, 1, 1), nics=nics)
    path = vengine.Engine.new_path()
    eng = vengine.Engine(path, plat, create=True, threads=2, slots=8)
    os.unlink(path)
    try:
        for rank in range(4):
            eng.open_actor(rank, 0, 0.0)
        first = eng.try_post(0, 2, 1, 5, 0, 1000.0, 0.1)
        other = eng.try_post(2, 3, 1, 5, 0, 1000.0, 0.1)     # rank 1's actor
        for aid in (0, 2):
            eng.set_clock(aid, 1.0)
        eng.set_clock(4, 1.0)
        eng.set_clock(6, 1.0)
        eng.advance()
        assert eng.upload(0, first) == pytest.approx((0.1, 0.101))
        assert eng.upload(2, other) == pytest.approx(second)
        assert eng.receiver_resolves(3) is (nics == 2)
    finally:
        eng.close()


# ---------------------------------------------------------------------- whole jobs
@contextlib.contextmanager
def virtual(comm, nics: int, per_host: int = 2):
    """A virtual cluster of hosts of ``per_host`` ranks (the last one smaller where the
    count does not divide) at 1 Gbit/s and 0.1 ms, ``nics`` ports per host, and a
    communicator that knows them."""
    p = comm.size
    sizes = ",".join([str(per_host)] * (p // per_host) + ([str(p % per_host)]
                                                          if p % per_host else []))
    plat = platform_from_env(p, {"MPICOMM_VIRTUAL_RATE": "1gbit",
                                 "MPICOMM_VIRTUAL_DELAY": "100us",
                                 "MPICOMM_HOST_SIZES": sizes,
                                 "MPICOMM_HOST_NICS": str(nics)})
    with clock.session(plat, TABLE):
        mpi = comm.mpi.Dup()
        sub = mpicomm.Communicator(mpi, check=False, owns=True, topology=detect(mpi))
        try:
            yield sub
        finally:
            sub.free()


def _elapsed(comm, fn):
    comm.barrier()
    t0 = clock.now()
    out = fn()
    return comm.allreduce_value(clock.now() - t0, "max"), out


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_hierarchical_allreduce_with_a_port_per_rank(comm):
    """On hosts of two ranks, the virtual clock's times of the flat ring and the
    hierarchical allreduce follow the two-link model with one port per host and with one
    per rank; the hierarchy's lanes no longer share a port, so it is faster with two
    (with a host of one rank there is one lane, and nothing changes), and its result is
    the ring's."""
    n = 250_000
    x = np.arange(n, dtype=np.float32) % 97 + comm.rank
    ref = mpicomm.allreduce(x, algorithm="ring", comm=comm)
    times = {}
    for nics in (1, 2):
        with virtual(comm, nics) as vc:
            assert vc.topology.ports == (() if nics == 1 or comm.size == 1 else
                                         tuple(range(comm.size)))
            model = cost.HostCosts(vc.topology, cost.CostParams(1e-6, 1 / 10e9, 1e-10),
                                   cost.CostParams(100e-6, 8e-9, 1e-10))
            for alg in ("ring", "hierarchical"):
                t, out = _elapsed(vc, lambda alg=alg: mpicomm.allreduce(
                    x, algorithm=alg, comm=vc))
                times[nics, alg] = t
                np.testing.assert_array_equal(out, ref)
                pred = cost.predict("allreduce", alg, 4 * n, comm.size, hosts=model)
                if comm.size == 1:
                    assert t == 0.0
                else:
                    assert t == pytest.approx(pred, rel=0.1), (nics, alg)
    if comm.size >= 4 and comm.size % 2 == 0:
        assert times[2, "hierarchical"] < 0.75 * times[1, "hierarchical"]
    elif comm.size >= 3:   # a host of one rank: one lane, so one port carries it all
        assert times[2, "hierarchical"] == pytest.approx(times[1, "hierarchical"])
    assert times[2, "ring"] == pytest.approx(times[1, "ring"], rel=0.02)


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_two_ports_shared_by_three_ranks_of_a_host(comm):
    """Hosts of three ranks with two ports: local ranks 0 and 2 share port 0, so the
    virtual clock serves that port's messages in virtual-time order among two ranks
    (and their downloads) while local rank 1 has port 1 to itself. The hierarchical
    allreduce follows the two-link model with one port and with two (its two lanes on
    ports of their own); the host-major ring, whose host-boundary ranks both use port
    0, takes the same time either way (the model bounds a folded butterfly from above);
    the results are the ring's."""
    n = 120_000
    x = (np.arange(n, dtype=np.float32) % 89) * (comm.rank + 1)
    ref = mpicomm.allreduce(x, algorithm="ring", comm=comm)
    times = {}
    for nics in (1, 2):
        with virtual(comm, nics, per_host=3) as vc:
            model = cost.HostCosts(vc.topology, cost.CostParams(1e-6, 1 / 10e9, 1e-10),
                                   cost.CostParams(100e-6, 8e-9, 1e-10))
            for alg in ("ring", "recursive_doubling", "hierarchical"):
                t, out = _elapsed(vc, lambda alg=alg: mpicomm.allreduce(x, algorithm=alg,
                                                                          comm=vc))
                times[nics, alg] = t
                np.testing.assert_allclose(out, ref, rtol=1e-6)
                pred = cost.predict("allreduce", alg, 4 * n, comm.size, hosts=model)
                if comm.size == 1:
                    assert t == 0.0
                elif alg == "hierarchical":
                    assert t == pytest.approx(pred, rel=0.1), nics
                elif alg == "recursive_doubling" and comm.size & (comm.size - 1):
                    assert 0.5 * pred < t <= pred * 1.02, nics
    assert times[2, "ring"] == pytest.approx(times[1, "ring"])
    if comm.size >= 4 and comm.size % 3 != 1:   # two lanes on every host
        assert times[2, "hierarchical"] < 0.8 * times[1, "hierarchical"]


# ---------------------------------------------------------------------- the suite
def test_hierarchy_suite_records_the_ports(tmp_path):
    """``--nics-per-host`` reaches the platform, the topology, the results and the
    report's headings."""
    from mpicomm.bench.report_hierarchy import _layout, virtual_label

    out = tmp_path / "hier.json"
    result = run_job(4, [sys.executable, "-m", "mpicomm.bench", "hierarchy", "--sizes",
                         "200000", "--densities", "0.01", "--clock", "virtual", "--rate",
                         "1gbit", "--delay", "100us", "--ranks-per-host", "2",
                         "--nics-per-host", "2", "--costs",
                         str(ROOT / "benchmarks" / "results" / "vclock-costs.json"),
                         "--predict-layouts", "2x2", "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert "2+2 network ports" in result.output
    data = json.loads(out.read_text())
    assert data["nics_per_host"] == 2 and data["clock"]["platform"]["nics_per_host"] == 2
    assert {r["layout"] for r in data["predicted"]} == {"2x2, 2 NICs"}
    rows = {r["method"]: r for r in data["rows"] if r["density"] == 1.0}
    # 2 hosts of 2 with a port each: the lanes' halves cross hosts at once
    assert rows["dense/hierarchical"]["x_flat"] > 1.5
    assert rows["dense/hierarchical"]["time_ms"] == pytest.approx(
        rows["dense/hierarchical"]["pred_ms"], rel=0.1)
    assert _layout(data) == "2x2, 2 NICs" and virtual_label(data).endswith("2 NICs each")


def test_nics_option_needs_the_virtual_clock():
    from mpicomm.bench import _clock
    from mpicomm.bench._util import UsageError

    args = argparse.Namespace(clock="wall", rate=None, delay=None, ranks_per_host=None,
                              nics_per_host="2", virtual_schedule=None, costs=None)
    with pytest.raises(UsageError, match="--nics-per-host"):
        _clock.apply(args)


def test_the_launchers_virtual_cluster_takes_the_nics(tmp_path):
    """``launchers/emulated-cluster --clock virtual --nics-per-host 2`` runs the job on
    hosts of two ranks with a port each: the job's topology and platform say so."""
    from mpicomm.emulate import run

    out = tmp_path / "ports.json"
    script = ("import json, mpicomm; from mpicomm import clock; c = mpicomm.init(); "
              "t = c.topology; "
              f"c.rank == 0 and open({str(out)!r}, 'w').write(json.dumps("
              "[list(t.ports), clock.platform().nics]))")
    status = run.main(["--hosts", "2", "--ranks-per-host", "2", "--clock", "virtual",
                       "--rate", "1gbit", "--nics-per-host", "2", "--timeout", "120", "--",
                       sys.executable, "-c", script])
    assert status == 0
    assert json.loads(out.read_text()) == [[0, 1, 2, 3], 2]
