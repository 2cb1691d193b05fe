"""The virtual clock on hosts of several ranks: several lanes share a host's port, so
messages queue on its upload link, and every wait must still be resolved.

A message that queued on its sender's upload arrives long after its send time plus the
latency. A rank waiting for its download must publish that later bound as its floor:
with the send-time bound only, a rank that waits for it (a lane of the sender's host in
a ring, say) keeps a floor below the download's key, the download waits for that floor,
and the job stalls. Here a stall fails within :data:`STALL_S` instead of the clock's
own limit.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

import mpicomm
from mpicomm import clock, vwire
from mpicomm.arrayops import ops_for
from mpicomm.costtable import CostTable, OpCost
from mpicomm.emulate.vnet import platform_from_env
from mpicomm.p2p import Ctx
from mpicomm.topology import Topology

#: Real seconds a test lets the virtual clock wait before it calls the job stuck.
STALL_S = 20.0
TABLE = CostTable({"reduce": OpCost(0.0, 1e-10, "byte"), "copy": OpCost(0.0, 0.0, "byte")})


@contextlib.contextmanager
def virtual(comm, sizes: str):
    """A virtual cluster of hosts ``sizes`` (1 Gbit/s, 0.1 ms) and a communicator that
    knows them."""
    plat = platform_from_env(comm.size, {"MPICOMM_VIRTUAL_RATE": "1gbit",
                                         "MPICOMM_VIRTUAL_DELAY": "100us",
                                         "MPICOMM_HOST_SIZES": sizes})
    with clock.session(plat, TABLE):
        sub = mpicomm.Communicator(comm.mpi.Dup(), check=False, owns=True,
                                   topology=Topology(plat.hosts))
        try:
            yield sub
        finally:
            sub.free()


def _two_per_host(p: int) -> str:
    return ",".join(["2"] * (p // 2) + ["1"] * (p % 2))


@pytest.fixture
def fast_stall(monkeypatch):
    monkeypatch.setattr(vwire, "STALL_S", STALL_S)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_queued_download_is_resolved_while_a_rank_waits_for_its_receiver(comm,
                                                                            fast_stall):
    """Hosts (0, 1), (2, 3): rank 0 sends 100 kB to rank 2, then 1 kB to rank 3, which
    queues 0.8 ms on host 0's upload; rank 1 waits for rank 3's reply. Rank 3 reaches its
    receive late in real time, so its download is resolved while rank 3 waits for it."""
    if comm.size < 4:
        pytest.skip("needs two hosts of two ranks")
    with virtual(comm, _two_per_host(comm.size)) as vc:
        ctx = Ctx.of(vc, ops_for("numpy", False))
        big, small = np.zeros(100_000, np.uint8), np.zeros(1000, np.uint8)
        rank = vc.rank
        if rank == 0:
            sends = [ctx.isend(big, 2, 3), ctx.isend(small, 3, 3)]
            ctx.waitall(sends)
        elif rank == 1:
            ctx.recv(small, 3, 4)
        elif rank == 2:
            ctx.recv(big, 0, 3)
        elif rank == 3:
            time.sleep(0.3)          # real time: everyone else is waiting already
            ctx.recv(small, 0, 3)
            ctx.send(small, 1, 4)
        t = clock.now()
        times = vc.allgather_object(t)
    # 125 B/us: the 1 kB message leaves host 0 in [800, 808] us (behind the 100 kB one)
    # and arrives at 908 us; rank 3's reply leaves by 916 us and reaches rank 1 at 1016
    want = [808e-6, 1016e-6, 900e-6, 916e-6] + [0.0] * (comm.size - 4)
    assert times == pytest.approx(want, abs=1e-9)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_hierarchical_allreduce_with_queued_segments_completes(comm, fast_stall,
                                                               monkeypatch):
    """Two lanes per host send 16 kB segments across at once: they queue on the host's
    upload (several segments per lane). Results equal the ring's, and two runs give the
    same virtual times."""
    if comm.size < 4:
        pytest.skip("needs two hosts of two ranks")
    monkeypatch.setenv("MPICOMM_RING_SEGMENT_BYTES", "16384")
    x = np.arange(100_000, dtype=np.float32) * (comm.rank + 1)
    runs = []
    for _ in range(2):
        with virtual(comm, _two_per_host(comm.size)) as vc:
            vc.barrier()
            t0 = clock.now()
            got = mpicomm.allreduce(x, algorithm="hierarchical", comm=vc)
            runs.append(vc.allgather_object(clock.now() - t0))
            want = mpicomm.allreduce(x, algorithm="ring", comm=vc)
            assert np.array_equal(got, want)
    assert runs[0] == runs[1]
    assert min(runs[0]) > 0


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_senders_waiting_in_mpi_follow_their_queued_uploads(comm, fast_stall):
    """Ranks 0 and 1 (host 0) each send four 1 MB messages to ranks 2 and 3 (host 1)
    at once and wait for them in MPI; the receivers take them one at a time. The eight
    messages queue on host 0's upload (8 ms each at 1 Gbit/s). A waiting sender's floor
    must follow its queued uploads: from the send time alone it stays at 8 ms, below the
    downloads the other receiver waits for, whose receiver then never posts the receive
    that would complete this sender's MPI wait."""
    if comm.size < 4:
        pytest.skip("needs two hosts of two ranks")
    n, count = 1_000_000, 4
    with virtual(comm, _two_per_host(comm.size)) as vc:
        ctx = Ctx.of(vc, ops_for("numpy", False))
        buf = np.zeros(n, np.uint8)
        rank = vc.rank
        if rank < 2:
            ctx.waitall([ctx.isend(buf, rank + 2, 5) for _ in range(count)])
        elif rank < 4:
            for _ in range(count):
                ctx.recv(buf, rank - 2, 5)
        times = vc.allgather_object(clock.now())
    # host 0's upload: rank 0's four messages in [0, 32] ms, rank 1's in [32, 64] ms
    ms = 1e-3
    want = [32 * ms, 64 * ms, 32.1 * ms, 64.1 * ms] + [0.0] * (comm.size - 4)
    assert times == pytest.approx(want, abs=1e-9)
