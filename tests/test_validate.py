"""One validation kit and one traffic meter, used everywhere.

Serial: :mod:`mpicomm.validate` itself; the same mistake (a non-integer where an integer is
needed, an unknown algorithm name) raises the same exception type and wording from every
public entry point; :meth:`Traffic.measure`. Multi-rank: a non-integer on one rank raises
the same type on every rank (checked mode); measured traffic matches the counters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm import strategies
from mpicomm.collectives import ALGORITHMS
from mpicomm.comm import Traffic
from mpicomm.compress import QSGD, PowerSGD, RandomK, SampledTopK, TopK
from mpicomm.compress.topk_select import topk_indices_approx
from mpicomm.control import AdaComm
from mpicomm.gossip import make_topology
from mpicomm.sched.job import check_steps
from mpicomm.sparse.reference import simulate_gtopk
from mpicomm.validate import NotAnIntegerError, check_algorithm, check_choice, check_int


# ---------------------------------------------------------------------- the kit
def test_check_int():
    assert check_int("k", 3, 1) == 3
    assert check_int("k", np.int64(3), 1, 5) == 3 and type(check_int("k", np.int32(2))) is int
    assert check_int("k", torch.tensor(4), 1) == 4
    for bad in (2.5, 3.0, "3", None, True, np.float64(2), np.array([3]), torch.ones(2)):
        with pytest.raises(NotAnIntegerError, match="k must be an integer"):
            check_int("k", bad, 1)
    for value, low, high, text in ((0, 1, None, ">= 1"), (9, 1, 8, r"in \[1, 8\]"),
                                   (5, None, 4, "<= 4")):
        with pytest.raises(ValueError, match=text) as info:
            check_int("k", value, low, high)
        assert not isinstance(info.value, TypeError)
    assert issubclass(NotAnIntegerError, TypeError) and issubclass(NotAnIntegerError, ValueError)


def test_check_choice_and_algorithm():
    assert check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match="mode must be one of a, b; got 'c'"):
        check_choice("mode", "c", ("a", "b"))
    assert check_algorithm("allreduce", "auto", ("ring",)) == "auto"
    with pytest.raises(ValueError, match="choose one of ring$"):
        check_algorithm("allreduce", "auto", ("ring",), auto=False)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 3"):
        check_algorithm("allreduce", 3, ("ring",))


# ---------------------------------------------------------------------- everywhere
NON_INTEGER = [
    ("TopK k", lambda v: TopK(k=v)),
    ("RandomK k", lambda v: RandomK(k=v)),
    ("SampledTopK min_sample", lambda v: SampledTopK(density=0.1, min_sample=v)),
    ("QSGD bits", lambda v: QSGD(bits=v)),
    ("PowerSGD rank", lambda v: PowerSGD(rank=v)),
    ("AdaComm tau0", lambda v: AdaComm(v, interval_rounds=1)),
    ("AdaComm interval_rounds", lambda v: AdaComm(4, interval_rounds=v)),
    ("make_topology size", lambda v: make_topology("ring", v)),
    ("simulate_gtopk k", lambda v: simulate_gtopk([(np.arange(2), np.ones(2))], v)),
    ("topk strategy k", lambda v: strategies.make("topk", k=v)),
    ("qsgd strategy seed", lambda v: strategies.make("qsgd", seed=v)),
    ("randomk strategy seed", lambda v: strategies.make("randomk", seed=v)),
    ("powersgd strategy start_iter", lambda v: strategies.make("powersgd", start_iter=v)),
    ("dense fusion_bytes", lambda v: strategies.make("dense", fusion_bytes=v)),
    ("root", lambda v: mpicomm.broadcast(np.ones(2), root=v)),
    ("split color", lambda v: mpicomm.world().split(v)),
    ("split_roles num_servers", lambda v: mpicomm.world().split_roles(v)),
    ("sched steps", lambda v: check_steps(v)),
    ("approximate top-k sample_rank",
     lambda v: topk_indices_approx(torch.ones(100), 2, sample_rank=v)),
]


@pytest.mark.parametrize(("where", "build"), NON_INTEGER, ids=[n for n, _ in NON_INTEGER])
@pytest.mark.parametrize("value", [2.5, True, "2"])
def test_a_non_integer_raises_the_same_type_everywhere(where, build, value):
    """Before: ``TopK(k=2.5)`` raised ``ValueError`` only and ``AdaComm(2.5)`` ``TypeError``
    only; now both (and every other integer argument) raise ``NotAnIntegerError``."""
    with pytest.raises(NotAnIntegerError, match="must be an integer"):
        build(value)


UNKNOWN_ALGORITHM = [
    ("allreduce", lambda: strategies.make("dense", algorithm="bogus")),
    ("allreduce", lambda: strategies.make("randomk", algorithm="bogus")),
    ("allreduce", lambda: strategies.make("powersgd", algorithm="bogus")),
    ("allreduce", lambda: strategies.make("fp16", algorithm="bogus")),
    ("allreduce", lambda: mpicomm.allreduce(np.ones(2), algorithm="bogus")),
    ("allreduce", lambda: mpicomm.torch.LocalSGD(torch.nn.Linear(2, 2), 1, algorithm="bogus")),
    ("allgather", lambda: strategies.make("qsgd", algorithm="bogus")),
    ("allgather", lambda: strategies.make("sign", algorithm="bogus")),
    ("allgather", lambda: mpicomm.allgather(np.ones(2), algorithm="bogus")),
]


@pytest.mark.parametrize(("collective", "build"), UNKNOWN_ALGORITHM)
def test_an_unknown_algorithm_reads_the_same_everywhere(collective, build):
    """Before: four copies of this check, one of them (Dense) without the choices."""
    names = ", ".join(("auto", *ALGORITHMS[collective]))
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert f"unknown {collective} algorithm 'bogus'; choose one of " in message
    assert all(name in message for name in names.split(", ")), message


# ---------------------------------------------------------------------- traffic
def test_traffic_measure():
    counter, total = Traffic(), Traffic(5, 5, 1)
    with counter.measure(into=total) as moved:
        counter.sent_bytes += 100
        counter.recv_bytes += 40
        counter.messages += 2
    assert moved == Traffic(100, 40, 2) and total == Traffic(105, 45, 3)
    with pytest.raises(RuntimeError), counter.measure() as moved:
        counter.sent_bytes += 7
        raise RuntimeError
    assert moved == Traffic(7, 0, 0)  # those bytes did move


@pytest.mark.mpi
def test_measured_traffic_matches_the_counters(comm):
    x = np.ones(1000, np.float32)
    before = comm.traffic.snapshot()
    with comm.traffic.measure() as moved:
        mpicomm.allreduce(x, algorithm="ring", comm=comm)
    assert moved == comm.traffic - before
    expected = 0 if comm.size == 1 else 2 * (comm.size - 1) * 4 * 1000 // comm.size
    assert abs(moved.sent_bytes - expected) <= 8 * comm.size
    model = torch.nn.Linear(10, 10)
    local = mpicomm.torch.LocalSGD(model, 1, comm=comm, algorithm="ring")
    gossip = mpicomm.torch.GossipAveraging(model, comm=comm)
    with comm.traffic.measure() as both:
        local.average()
        gossip.step()
    assert local.traffic.sent_bytes + gossip.traffic.sent_bytes == both.sent_bytes
    dense = strategies.make("dense", algorithm="ring").bind(comm)
    with comm.traffic.measure() as agg:
        dense.aggregate([torch.ones(100)])
    assert dense.stats.sent_bytes == agg.sent_bytes


@pytest.mark.mpi(min_size=2)
def test_a_non_integer_on_one_rank_raises_the_same_type_on_every_rank(comm):
    root = 0.5 if comm.rank == comm.size - 1 else 0
    with pytest.raises(NotAnIntegerError,
                       match="root must be an integer" if comm.rank == comm.size - 1
                       else f"rank {comm.size - 1} rejected its arguments"):
        mpicomm.broadcast(np.ones(3), root=root, comm=comm)
    assert mpicomm.allreduce(np.ones(1), comm=comm)[0] == comm.size  # still in step
