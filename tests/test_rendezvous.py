"""The process group's rendezvous opens no socket that others can reach.

Multi-rank (``-m mpi``): the TCP sockets in LISTEN state that this process owns (from
``/proc/net/tcp{,6}`` and ``/proc/self/fd``) are listed before and after
``mpicomm.torch.init_process_group``; on one node the rendezvous adds none, and whatever
the process group adds listens on loopback only. A TCP store asked for explicitly on
127.0.0.1 listens there, not on every interface. Serial: the choice for ranks on several
nodes (a communicator that reports two nodes): a TCP store bound to the address rank 0
announces only, and gloo left to its own interface rule. Linux only (``/proc``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import sys

import pytest
import torch
import torch.distributed as dist

import mpicomm
from mpicomm.torch import process_group, rendezvous
from mpicomm.torch.rendezvous import (
    STORE_PREFIX,
    loopback_devices,
    remove_store_file,
    rendezvous_store,
)

from .launch import run_job

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:   # little-endian 32-bit word
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def own_listeners() -> set[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets in LISTEN state this process holds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:   # 0A: LISTEN
                host, port = local.split(":")
                found.add((_address(host), int(port, 16)))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_own_listeners_sees_a_listening_socket():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in own_listeners()


@pytest.mark.mpi
def test_process_group_on_one_node_listens_on_loopback_only(comm: mpicomm.Communicator):
    if comm.nodes != 1:
        pytest.skip("the ranks are on several nodes")
    before = own_listeners()
    with process_group(comm):
        added = own_listeners() - before
        assert dist.get_world_size() == comm.size
    outside = sorted(a for a in added if not _loopback(a[0]))
    assert outside == [], f"rank {comm.rank} listens on {outside}"


@pytest.mark.mpi
def test_process_group_returns_only_once_every_rank_has_its_group(comm: mpicomm.Communicator,
                                                                  monkeypatch):
    """Rank 0 finishes creating its group 0.3 s late: no rank returns before it, so none
    can destroy its side of a connection that rank 0 is still making."""
    import time

    from mpicomm.torch import ddp

    real = dist.init_process_group
    finished: list[float] = []

    def slow_on_rank0(*args, **kwargs):
        real(*args, **kwargs)
        if comm.rank == 0:
            time.sleep(0.3)
        finished.append(time.time())

    monkeypatch.setattr(ddp.dist, "init_process_group", slow_on_rank0)
    with process_group(comm):
        returned = time.time()
    rank0_finished = comm.bcast_object(finished[0] if comm.rank == 0 else None)
    assert min(comm.allgather_object(returned)) >= rank0_finished


@pytest.mark.mpi
def test_process_group_is_destroyed_only_once_every_rank_has_left_it(
        comm: mpicomm.Communicator, monkeypatch):
    """Rank 0 leaves the block's last gloo operation 0.3 s late: no rank destroys its
    group (closing connections rank 0 may still read from) before it. When the body
    raises, the group is destroyed at once, without waiting for the other ranks."""
    import time

    from mpicomm.torch import ddp

    real = dist.destroy_process_group
    real_barrier = comm.barrier
    events: list[tuple[str, float]] = []

    def record(*args, **kwargs):
        events.append(("destroy", time.time()))
        real(*args, **kwargs)

    def barrier() -> None:
        events.append(("barrier", time.time()))
        real_barrier()

    monkeypatch.setattr(ddp.dist, "destroy_process_group", record)
    monkeypatch.setattr(comm, "barrier", barrier)
    with process_group(comm):
        dist.all_reduce(torch.ones(4))
        if comm.rank == 0:
            time.sleep(0.3)
        left = time.time()
    rank0_left = comm.bcast_object(left if comm.rank == 0 else None)
    destroyed = [t for what, t in events if what == "destroy"]
    assert len(destroyed) == 1 and min(comm.allgather_object(destroyed[0])) >= rank0_left
    assert not dist.is_initialized()

    del events[:]
    with pytest.raises(KeyError, match="body"), process_group(comm):
        events.append(("raise", time.time()))
        raise KeyError("body")
    after = [what for what, _ in events]
    assert after[after.index("raise") + 1:] == ["destroy"]
    assert not dist.is_initialized()


@pytest.mark.mpi
def test_file_store_opens_no_socket_and_is_private(comm: mpicomm.Communicator):
    before = own_listeners()
    store = rendezvous_store(comm, kind="file")
    store.set(f"rank{comm.rank}", str(comm.rank))
    assert store.get(f"rank{(comm.rank + 1) % comm.size}") == \
        str((comm.rank + 1) % comm.size).encode()
    assert own_listeners() - before == set()
    path = comm.bcast_object(store.path)
    assert os.path.basename(path).startswith(STORE_PREFIX)
    assert os.stat(path).st_mode & 0o077 == 0
    comm.barrier()
    del store
    remove_store_file(comm, path)
    assert not os.path.exists(path)


@pytest.mark.mpi
def test_store_file_goes_when_the_last_rank_lets_go(comm: mpicomm.Communicator):
    """The file stays while any rank holds its store and is gone once the last one (here
    the highest rank, after the others) has let go; a ``process_group`` block leaves no
    file either."""
    store = rendezvous_store(comm, kind="file")
    path = store.path
    assert comm.allgather_object(path) == [path] * comm.size
    keeper = comm.size - 1
    if comm.rank != keeper:
        del store
    comm.barrier()
    assert os.path.isfile(path)                   # the keeper still holds its store
    comm.barrier()
    if comm.rank == keeper:
        del store
    comm.barrier()
    assert not os.path.exists(path)
    with process_group(comm):
        path = dist.distributed_c10d._get_default_store().underlying_store.path
    comm.barrier()
    assert not os.path.exists(path)


@pytest.mark.mpi
def test_destroying_the_group_removes_its_file_while_stores_live_on(
        comm: mpicomm.Communicator):
    """Every rank still holds the group's store (as a live DDP model does), so torch's
    own clean-up has not run: ``destroy_process_group`` removes the file all the same,
    and the stores destroyed afterwards do not write it anew."""
    with process_group(comm):
        held = dist.distributed_c10d._get_default_store()
        path = held.underlying_store.path
        assert os.path.isfile(path)
    assert not os.path.exists(path)
    del held
    comm.barrier()
    assert not os.path.exists(path)


_DDP_TO_THE_END = """
import torch, mpicomm, mpicomm.torch
from torch.nn.parallel import DistributedDataParallel as DDP
comm = mpicomm.init()
with mpicomm.torch.process_group(comm):
    model = DDP(torch.nn.Linear(3, 3))      # holds the group's store until exit
    model(torch.ones(2, 3)).sum().backward()
"""


def test_a_ddp_model_alive_at_exit_leaves_no_store_behind(tmp_path):
    res = run_job(3, [sys.executable, "-c", _DDP_TO_THE_END], timeout=120,
                  TMPDIR=str(tmp_path))
    assert res.returncode == 0, res.output
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(STORE_PREFIX)] == []


@pytest.mark.mpi
def test_tcp_store_listens_only_where_it_announces(comm: mpicomm.Communicator):
    before = own_listeners()
    store = rendezvous_store(comm, datetime.timedelta(seconds=60), kind="tcp",
                             host="127.0.0.1")
    store.add("count", 1)
    store.wait(["count"])
    added = own_listeners() - before
    if comm.rank == 0:
        assert added and all(host == "127.0.0.1" for host, _ in added), added
    else:
        assert added == set()
    comm.barrier()
    del store


def test_unknown_kind_is_refused_before_communicating():
    with pytest.raises(ValueError, match="kind must be"):
        rendezvous_store(None, kind="udp")  # type: ignore[arg-type]


class SeveralNodes:
    """A communicator whose ranks say they are on ``nodes`` nodes (the rest is ``comm``'s)."""

    def __init__(self, comm: mpicomm.Communicator, nodes: int) -> None:
        self._comm, self.nodes = comm, nodes

    def __getattr__(self, name: str):
        return getattr(self._comm, name)


def test_across_nodes_the_store_binds_only_the_address_it_announces():
    try:
        announced = rendezvous._announced_host()
    except OSError as exc:
        pytest.skip(f"this host name does not resolve: {exc}")
    comm = SeveralNodes(mpicomm.init(), nodes=2)
    before = own_listeners()
    store = rendezvous_store(comm, datetime.timedelta(seconds=30))   # kind "auto"
    added = own_listeners() - before
    assert type(store).__name__ == "TCPStore"
    assert added and {host for host, _ in added} == {announced}, (announced, added)
    assert not any(ipaddress.ip_address(host).is_unspecified for host, _ in added)
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store


def test_gloo_interface_loopback_on_one_node_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    world = mpicomm.init()
    with loopback_devices(SeveralNodes(world, nodes=1)):
        assert os.environ["GLOO_SOCKET_IFNAME"].startswith("lo")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    with loopback_devices(SeveralNodes(world, nodes=2)):   # gloo's rule: the host name
        assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")        # the user's choice wins
    with loopback_devices(SeveralNodes(world, nodes=1)):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
