"""mpicomm.topology (host layouts, MPICOMM_HOST_SIZES) and the cost model's two link
classes (mpicomm.collectives.cost.HostCosts).

The cost checks compare the round-by-round host model with closed forms written here:
with one rank per host it must be the flat formulas exactly, on one host the flat
formulas with the local link, and on uniform host-major layouts the hierarchical
closed forms.
"""

from __future__ import annotations

import math
import re
import sys
import textwrap

import pytest

import mpicomm
from mpicomm.collectives import cost
from mpicomm.p2p import fold_layout
from mpicomm.strategies import GTopK, HierarchicalGTopK
from mpicomm.topology import ENV_HOST_SIZES, Topology, parse_host_sizes

from .launch import run_job

NET = cost.CostParams(alpha=1e-4, beta=8e-9, gamma=2.5e-10)
LOC = cost.CostParams(alpha=1e-6, beta=1e-10, gamma=2.5e-10)


# ---------------------------------------------------------------------- layouts
def test_layout_from_sizes_and_from_hosts():
    t = Topology.from_sizes((1, 2, 3))
    assert t.hosts == (0, 1, 1, 2, 2, 2) and t.size == 6 and t.num_hosts == 3
    assert t.members == ((0,), (1, 2), (3, 4, 5)) and t.host_sizes == (1, 2, 3)
    assert [t.local_rank(r) for r in range(6)] == [0, 0, 1, 0, 1, 2]
    assert t.lanes == 1 and t.hierarchical and t.consecutive and not t.uniform
    assert t.describe() == "3 hosts of 1+2+3 ranks"
    two_ports = Topology.from_hosts([0, 0, 0, 1, 1, 1], nics=2)
    assert two_ports.describe() == "2 hosts of 3+3 ranks, 2+2 network ports"
    uneven = Topology.from_hosts([0, 0, 1, 1], ports=["a", "b", "c", "c"])
    assert uneven.describe() == "2 hosts of 2+2 ranks, 2+1 network ports"
    rr = Topology.from_hosts(["a", "b", "a", "b"])
    assert rr.hosts == (0, 1, 0, 1) and not rr.consecutive and rr.lanes == 2
    assert rr.restrict([1, 3]).hosts == (0, 0)
    assert not Topology.from_sizes((4,)).hierarchical  # one host
    assert not Topology.from_sizes((1, 1, 1)).hierarchical  # one rank per host
    assert Topology.from_sizes((3, 3)).lanes == 3


@pytest.mark.parametrize("bad", [(), (0, 2), (2, -1), ("2",), (1.5,)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        Topology.from_sizes(bad)


def test_host_numbers_must_be_canonical():
    with pytest.raises(ValueError, match="order of first appearance"):
        Topology((1, 0))
    with pytest.raises(ValueError, match="places 3 ranks"):
        Topology.from_sizes((1, 2)).checked(4)


@pytest.mark.parametrize("text, message", [
    ("2,2", "places 4 ranks on 2 hosts but the job has 5"),
    ("2,x", "comma-separated positive integers"),
    ("2,0,3", "at least one rank"),
    ("", "comma-separated"),
])
def test_host_sizes_variable_errors_name_it(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_host_sizes(text, 5)
    assert ENV_HOST_SIZES in str(info.value)
    assert parse_host_sizes(" 2, 3 ", 5).host_sizes == (2, 3)


_BAD = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    import mpicomm
    try:
        mpicomm.init(abort_on_error=False)
    except ValueError as exc:
        print(f"RANK {MPI.COMM_WORLD.Get_rank()} REFUSED: {exc}", flush=True)
        sys.exit(0)
    print("NO ERROR", flush=True)
""")

_LAYOUT = textwrap.dedent("""
    from mpi4py import MPI
    import mpicomm
    comm = mpicomm.init()
    sub = comm.split(comm.rank % 2)
    row = (comm.rank, comm.node, comm.nodes, comm.local_rank, comm.local_size,
           sub.topology.hosts)
    rows = comm.allgather_object(row)  # one writer: lines of several ranks interleave
    if comm.rank == 0:
        print("\\n".join("LAYOUT " + " ".join(map(str, r)) for r in rows), flush=True)
""")


def test_host_sizes_that_do_not_cover_the_job_fail_on_every_rank():
    result = run_job(3, [sys.executable, "-c", _BAD], timeout=120,
                     **{ENV_HOST_SIZES: "2,2"})
    message = ("REFUSED: MPICOMM_HOST_SIZES='2,2' places 4 ranks on 2 hosts but the job "
               "has 3 ranks")
    refused = set(re.findall(r"RANK (\d) " + re.escape(message), result.output))
    assert result.returncode == 0 and refused == {"0", "1", "2"}, result.output[-2000:]
    assert "NO ERROR" not in result.output


def test_host_sizes_set_the_communicators_layout():
    result = run_job(6, [sys.executable, "-c", _LAYOUT], timeout=120,
                     **{ENV_HOST_SIZES: "1,2,3"})
    assert result.returncode == 0, result.output[-2000:]
    rows = {int(w[1]): w[2:] for w in (ln.split(maxsplit=6) for ln in
                                       result.output.splitlines() if ln.startswith("LAYOUT"))}
    assert [rows[r][:4] for r in range(6)] == [
        ["0", "3", "0", "1"], ["1", "3", "0", "2"], ["1", "3", "1", "2"],
        ["2", "3", "0", "3"], ["2", "3", "1", "3"], ["2", "3", "2", "3"]]
    # the even ranks 0, 2, 4 sit on hosts 0, 1, 2; the odd ones 1, 3, 5 on 1, 2, 2
    assert rows[0][4] == "(0, 1, 2)" and rows[1][4] == "(0, 1, 1)"


# ---------------------------------------------------------------------- cost model
def _singletons(p: int) -> cost.HostCosts:
    return cost.HostCosts(Topology(tuple(range(p))), LOC, NET)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_one_rank_per_host_is_the_flat_model(p):
    hosts, n = _singletons(p), 1e6
    for collective, algorithms in cost.HOST_ALGORITHMS.items():
        for a in algorithms:
            if p == 1:
                continue
            want = cost.FORMULAS[collective][a](n, p, NET)
            if (collective, a) == ("allgather", "bruck"):
                want -= (n + n / p) * NET.gamma  # the rotation copies are no transfer
            got = hosts.flat(collective, a, n).total
            if p != fold_layout(p)[0] and a == "recursive_doubling" \
                    and collective == "allreduce":
                # lock-step rounds: an upper bound of the folded butterfly's critical path
                assert got >= want * (1 - 1e-12), (collective, a)
            else:
                assert got == pytest.approx(want, rel=1e-12), (collective, a)
    k, ib, vb = 1000, 4, 4
    sparse_gtopk = hosts.flat_sparse("gtopk", k, ib, vb).total
    if p == fold_layout(p)[0]:
        assert sparse_gtopk == pytest.approx(cost.gtopk(k, ib + vb, p, NET))
    else:
        assert sparse_gtopk >= cost.gtopk(k, ib + vb, p, NET)
    assert hosts.flat_sparse("allgather", k, ib, vb).total == pytest.approx(
        cost.topk_allgather(k, ib + vb, p, NET))
    assert hosts.flat_sparse("artopk", k, ib, vb).total == pytest.approx(
        cost.artopk_ring(k, ib, vb, p, NET))
    tree = hosts.flat_sparse("artopk", k, ib, vb, "recursive_doubling").total
    if p == fold_layout(p)[0]:
        assert tree == pytest.approx(cost.artopk_tree(k, ib, vb, p, NET))
    else:
        assert tree >= cost.artopk_tree(k, ib, vb, p, NET)


def test_one_host_prices_the_local_link():
    hosts = cost.HostCosts(Topology((0,) * 6), LOC, NET)
    assert hosts.flat("allreduce", "ring", 1e6).total == pytest.approx(
        cost.allreduce_ring(1e6, 6, cost.CostParams(LOC.alpha, LOC.beta, NET.gamma)))


@pytest.mark.parametrize("hosts, per_host", [(8, 4), (16, 2), (2, 2), (3, 2)])
def test_hierarchical_closed_forms(hosts, per_host):
    h, r, n = hosts, per_host, 4e7
    hc = cost.HostCosts(Topology.from_sizes((r,) * h), LOC, NET)
    local = 2 * (r - 1) * (LOC.alpha + n / r * LOC.beta)
    network = 2 * (h - 1) * (NET.alpha + n / h * NET.beta)  # r lanes share each port
    gamma = ((r - 1) / r * n + (h - 1) / h * n / r) * NET.gamma
    assert hc.hierarchical_allreduce(n, "ring").total == pytest.approx(
        local + network + gamma, rel=1e-9)
    # the flat ring crosses each port once per step: the flat (one-segment, lock-step)
    # formula on the network
    p = h * r
    assert hc.flat("allreduce", "ring", n).total == pytest.approx(
        2 * (p - 1) * NET.alpha + (p - 1) / p * n * (2 * NET.beta + NET.gamma))
    # a flat butterfly sends every local rank's message through the port
    k, s = 1e4, 8
    lg_r, lg_h = math.log2(r), math.log2(h)
    if lg_r.is_integer() and lg_h.is_integer():
        want = lg_r * (LOC.alpha + k * s * LOC.beta) + lg_h * (NET.alpha + r * k * s * NET.beta)
        assert hc.flat_sparse("gtopk", k, 4, 4).total == pytest.approx(want)
        lead = hc.hierarchical_sparse("gtopk", n, k, 4, 4, False).comm
        assert lead == pytest.approx(lg_h * (NET.alpha + k * s * NET.beta)
                                     + n * NET.gamma)  # the chain reduces the vector once


def test_hierarchy_gains_at_most_the_bandwidth_bound():
    """At a large vector the hierarchical allreduce gains at most (P-1)H/(P(H-1)) over
    the flat ring (a host-major ring already crosses each port once per step)."""
    for h, r in ((8, 4), (16, 2), (2, 2)):
        hc = cost.HostCosts(Topology.from_sizes((r,) * h), cost.CostParams(0, 0, 0),
                            cost.CostParams(0, 1e-9, 0))
        p, n = h * r, 4e9
        ratio = hc.flat("allreduce", "ring", n).total / hc.hierarchical_allreduce(n).total
        assert ratio == pytest.approx((p - 1) * h / (p * (h - 1)), rel=1e-6)


def test_choose_and_predict_with_hosts():
    topo = Topology.from_sizes((4,) * 8)
    hosts = cost.HostCosts(topo, LOC, NET)
    small = cost.choose("allreduce", 1e3, 32, hosts=hosts)
    assert small == "hierarchical"  # 14 network latencies instead of 62 or 2·5 with r·n
    assert cost.predict("allreduce", "hierarchical", 1e3, 32, hosts=hosts) == \
        hosts.hierarchical_allreduce(1e3).total
    assert cost.predict("allreduce", "mpi", 1e3, 32, hosts=hosts) == min(
        hosts.flat("allreduce", a, 1e3).total for a in cost.HOST_ALGORITHMS["allreduce"])
    with pytest.raises(ValueError, match="without hosts="):
        cost.predict("allreduce", "hierarchical", 1e3, 32)
    with pytest.raises(ValueError, match="places 32 ranks, not p=8"):
        cost.predict("allreduce", "ring", 1e3, 8, hosts=hosts)
    assert cost.choose("allreduce", 1e3, 32) != "hierarchical"


def test_strategies_predict_on_the_layout():
    topo = Topology.from_sizes((4,) * 8)
    compute = cost.ComputeParams()
    flat = GTopK(density=0.001).predict_parts(10**7, 4, 32, NET, compute, topology=topo,
                                              local=LOC)
    hosts = cost.HostCosts(topo, LOC, NET)
    k = 10**4
    assert flat["comm"] == pytest.approx(hosts.flat_sparse("gtopk", k, 4, 4).comm)
    sliced = HierarchicalGTopK(density=0.001, sliced=True).predict_parts(
        10**7, 4, 32, NET, compute, topology=topo, local=LOC)
    assert sliced["comm"] + sliced["compute"] < flat["comm"] + flat["compute"]
    # without a layout the hierarchical strategy is the flat collective over p hosts
    alone = HierarchicalGTopK(density=0.001).predict_parts(10**7, 4, 32, NET, compute,
                                                           topology=Topology(tuple(range(32))))
    assert alone["comm"] == pytest.approx(
        _singletons(32).hierarchical_sparse("gtopk", 4e7, k, 4, 4, False).comm)
    assert mpicomm.strategies.make("hier_gtopk").host_model
