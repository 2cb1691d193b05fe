"""Hierarchical collectives: dense allreduce/allgather, sparse aggregation, strategies,
and the auto choice, on host layouts given to the communicator.

Multi-rank tests run at every rank count of the suite over every layout of
:func:`tests.hier_checks.layouts` (one host, one rank per host, (2,2), uneven hosts,
host counts that are not powers of two); a serial test runs the same checks in a child
job at 6 ranks on (1,2,3), (3,3) and (2,2,2).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicomm
from mpicomm.collectives import cost
from mpicomm.collectives.hierarchical import hierarchy
from mpicomm.strategies import AutoStrategy
from mpicomm.topology import Topology

from . import hier_checks
from .launch import ROOT, run_job


@pytest.fixture(scope="module")
def layered(mpi_size):
    """One checked communicator per layout of this rank count."""
    comms = [hier_checks.communicator(s) for s in hier_checks.layouts(mpi_size)]
    yield comms
    for c in comms:
        c.free()


@pytest.mark.mpi
def test_dense_equals_the_flat_ring(layered):
    for c in layered:
        hier_checks.check_dense(c)


@pytest.mark.mpi
def test_dense_on_hosts_of_any_placement(comm):
    hier_checks.check_allgather_any_placement(comm)


@pytest.mark.mpi
def test_sparse_aggregation_matches_its_reference_and_conserves_mass(layered):
    for c in layered:
        hier_checks.check_sparse(c)


@pytest.mark.mpi
def test_strategies_conserve_mass_and_agree(layered):
    for c in layered:
        hier_checks.check_strategies(c)


def test_six_ranks_with_the_issue_layouts():
    result = run_job(6, [sys.executable, str(ROOT / "tests" / "hier_checks.py")],
                     timeout=600)
    assert result.returncode == 0, result.output[-3000:]
    assert "HIER_CHECKS_OK 6" in result.output and "(1, 2, 3)" in result.output \
        and "(3, 3)" in result.output, result.output[-3000:]


@pytest.mark.mpi
def test_auto_picks_hierarchical_where_the_model_says_so(comm):
    """A slow network and a fast host link: small vectors go hierarchical (fewer network
    latencies) on a layout with several ranks per host, never on a flat one."""
    p = comm.size
    sizes = (p // 2, p - p // 2) if p >= 4 else (p,)
    c = hier_checks.communicator(sizes)
    try:
        c.resources["cost_params"] = cost.CostParams(alpha=1e-3, beta=1e-8, gamma=1e-10)
        c.resources["host_cost_params"] = cost.CostParams(1e-6, 1e-10, 1e-10)
        hosts = cost.host_costs(c)
        x = np.arange(64, dtype=np.int64) * (c.rank + 1)
        want = cost.choose("allreduce", x.nbytes, p, hosts=hosts if
                           c.topology.hierarchical else None)
        assert (want == "hierarchical") == c.topology.hierarchical
        got = mpicomm.allreduce(x, comm=c)  # checked mode compares the ranks' choices
        assert np.array_equal(got, np.arange(64) * p * (p + 1) // 2)
    finally:
        c.free()


@pytest.mark.mpi
def test_selector_offers_hierarchical_schemes_on_layered_hosts(comm):
    p = comm.size
    if p < 4:
        pytest.skip("needs two hosts with two ranks")
    topo = Topology.from_sizes((2,) * (p // 2) + (1,) * (p % 2))
    slow = cost.CostParams(alpha=1e-4, beta=8e-9, gamma=2.5e-10)
    fast = cost.CostParams(alpha=1e-6, beta=1e-10, gamma=2.5e-10)
    from mpicomm.strategies.auto_schemes import HIERARCHICAL_SCHEMES, select

    choice = select([(1_000_000,)], 0.01, 4, p, slow, cost.ComputeParams(),
                    topology=topo, local=fast)
    assert set(HIERARCHICAL_SCHEMES) <= set(choice.candidates)
    flat = select([(1_000_000,)], 0.01, 4, p, slow, cost.ComputeParams())
    assert not set(HIERARCHICAL_SCHEMES) & set(flat.candidates)
    assert min(choice.candidates.values()) == choice.predicted
    # the auto strategy on such a communicator runs whatever it picks, identically
    c = mpicomm.Communicator(comm.mpi.Dup(), topology=topo)
    try:
        s = AutoStrategy(ratio=0.05, calibrate_links=0).bind(c)
        g = torch.from_numpy(hier_checks.rank_vectors(p, 3, 400, "float64")[c.rank])
        out = s.aggregate([g], ["w"])[0]
        hier_checks.same_everywhere(c, out.numpy())
    finally:
        c.free()


@pytest.mark.mpi
def test_sub_communicators_are_released_and_share_traffic(comm):
    c = mpicomm.Communicator(comm.mpi.Dup(), topology=Topology((0,) * comm.size))
    before = c.traffic.snapshot()
    mpicomm.allreduce(np.ones(100), algorithm="hierarchical", comm=c)
    h = hierarchy(c)
    moved = c.traffic - before
    assert (moved.sent_bytes > 0) == (comm.size > 1)  # counted on the parent
    d = c.dup()
    assert d.topology == c.topology
    c.free()
    d.free()
    assert h.local.p2p == MPI.COMM_NULL and h.local.mpi == MPI.COMM_NULL
    assert h.lane is None or h.lane.mpi == MPI.COMM_NULL


@pytest.mark.mpi
def test_a_topology_that_does_not_cover_the_ranks_fails_on_every_rank(comm):
    with pytest.raises(ValueError, match="places"):
        mpicomm.Communicator(comm.mpi, topology=Topology.from_sizes((comm.size + 1,)))
    assert comm.allreduce_value(1) == comm.size  # nobody is stuck


def test_benchmark_suite_writes_its_rows_and_targets(tmp_path):
    out = tmp_path / "hier.json"
    result = run_job(3, [sys.executable, "-m", "mpicomm.bench", "hierarchy", "--sizes",
                         "3000", "--densities", "0.01", "--repeats", "1", "--warmup", "0",
                         "--inner", "gtopk,allgather", "--json", str(out)],
                     timeout=300, MPICOMM_HOST_SIZES="1,2")
    assert result.returncode == 0, result.output[-3000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "hierarchy" and data["host_sizes"] == [1, 2]
    methods = {r["method"] for r in data["rows"]}
    assert methods == {"dense/ring", "dense/hierarchical", "gtopk", "hier_gtopk",
                       "hier_gtopk_sliced", "allgather_topk", "hier_allgather",
                       "hier_allgather_sliced"}
    for r in data["rows"]:
        assert r["seconds"] > 0 and r["sent_B"] > 0 and r["x_flat"] > 0, r
        if r["density"] < 1:
            assert 0 < r["overlap"] <= 1 and r["energy"] > 0, r
    assert {(t["collective"], t["target"]) for t in data["targets"]} == {
        ("dense", 1.5), ("gtopk", 1.3), ("allgather", None)}


@pytest.mark.parametrize("hosts, per_host", [(8, 4), (16, 2), (2, 2)])
def test_cyclic_ring_baseline_prices_every_step_across_the_network(hosts, per_host):
    """The flat ring in cyclic host order sends R blocks through every port per step:
    ``2(P-1)(α + R·n/P·β) + (P-1)/P·n·γ``, ``(P-1)/(H-1)`` times the hierarchy's
    bandwidth term."""
    from mpicomm.bench.hierarchy import cyclic_ring_prediction

    net = cost.CostParams(alpha=1e-4, beta=8e-9, gamma=1e-10)
    local = cost.CostParams(alpha=1e-6, beta=1e-10, gamma=1e-10)
    p, n = hosts * per_host, 4e7
    model = cost.HostCosts(Topology.from_sizes((per_host,) * hosts), local, net)
    want = 2 * (p - 1) * (net.alpha + per_host * n / p * net.beta) + (p - 1) / p * n * net.gamma
    assert cyclic_ring_prediction(n, model) == pytest.approx(want, rel=1e-9)


def test_benchmark_predicts_the_emulated_clusters_links_as_configured(monkeypatch):
    """Under ``launchers/emulated-cluster`` (its ``MPICOMM_EMU_*`` variables) the suite's
    predictions use the configured rate and delay between hosts, not a fitted or
    default link."""
    from mpicomm.bench.hierarchy import model

    comm = mpicomm.Communicator(MPI.COMM_SELF)
    for var in ("MPICOMM_EMU_HOSTS", "MPICOMM_EMU_RATE", "MPICOMM_EMU_DELAY"):
        monkeypatch.delenv(var, raising=False)
    assert model(comm).network == cost.CostParams()
    monkeypatch.setenv("MPICOMM_EMU_HOSTS", "2")
    monkeypatch.setenv("MPICOMM_EMU_RATE", "1gbit")
    monkeypatch.setenv("MPICOMM_EMU_DELAY", "0.0001")
    net = model(comm).network
    assert (net.alpha, net.beta) == (1e-4, 8e-9)
    comm.free()


def test_report_plots_the_hierarchy_results(tmp_path):
    from mpicomm.bench.report import _plt
    from mpicomm.bench.report_hierarchy import plot_hierarchy

    def row(method, density, x_flat, x_cyclic=None):
        return {"d": 1000, "density": density, "method": method, "x_flat": x_flat,
                "x_cyclic": x_cyclic}

    result = {"suite": "hierarchy", "ranks": 8, "host_sizes": [4, 4], "rows": [
        row("dense/ring", 1.0, 1.0, 3.0), row("dense/ring_cyclic", 1.0, 0.33, 1.0),
        row("dense/hierarchical", 1.0, 1.1, 3.3), row("gtopk", 0.01, 1.0),
        row("hier_gtopk", 0.01, 1.2), row("hier_gtopk_sliced", 0.01, 2.5)]}
    path = tmp_path / "h.png"
    assert not plot_hierarchy([{"suite": "sparse"}], str(path), _plt())
    assert plot_hierarchy([result], str(path), _plt()) and path.stat().st_size > 1000
