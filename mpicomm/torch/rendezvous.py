"""The key-value store that ``torch.distributed`` needs to start a process group, set up
over MPI and exposed to no one else.

``rendezvous_store(comm)`` returns a store that every rank of ``comm`` shares:

* every rank on one node (``comm.nodes == 1``): a ``torch.distributed.FileStore`` in a
  private temporary file (``mkstemp``: a new file of a random name, mode 0600, owned by
  the user) that rank 0 creates and broadcasts over MPI. No socket is opened.
  ``mpicomm.torch.destroy_process_group`` removes the file once every rank has let go of
  its group (``remove_store_file``), also when a ``DistributedDataParallel`` model
  still holds the group's store (that store, destroyed at exit, then finds no file and
  writes none). Left to itself, the store's destructor removes the file when the last
  rank's store goes, but torch's ``FileStore`` counts its finished and its live users
  in two separate updates, so when ranks destroy their stores at the same moment no
  rank may see both counts complete and the file stays. So a group never destroyed, a
  store from ``rendezvous_store`` dropped by every rank at once, or a job ended by
  ``MPI_Abort`` can leave the file under the temporary directory (a few bytes,
  readable by its owner only).
* gloo's own connections (``loopback_devices``, used by
  ``mpicomm.torch.init_process_group``): on one node they listen on the loopback
  interface, unless ``GLOO_SOCKET_IFNAME`` says otherwise.
* ranks on several nodes: a ``torch.distributed.TCPStore`` whose server, on rank 0,
  listens on one socket bound to the address rank 0 announces (what its host name
  resolves to), not on every interface as the store does when it binds itself. The
  other ranks connect to that address, which rank 0 broadcasts over MPI. The store has
  no authentication: anyone who can reach that address and port during the job can read
  and write its keys, as with ``torchrun``'s store.

Cost: one broadcast over MPI, plus the store's own start (a file, or one TCP listener).
Collective over ``comm``; an error on rank 0 (no temporary file, a port that cannot
be bound) is raised on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ..comm import Communicator

__all__ = ["rendezvous_store", "remove_store_file", "loopback_devices", "STORE_PREFIX"]

#: Name prefix of the private files that hold a one-node job's FileStore.
STORE_PREFIX = "mpicomm-store-"


def _announced_host() -> str:
    return socket.gethostbyname(socket.gethostname())


def _file_store(comm: Communicator) -> Any:
    message: str | None = None
    if comm.rank == 0:
        try:
            fd, message = tempfile.mkstemp(prefix=STORE_PREFIX)
            os.close(fd)
        except OSError as exc:
            message = f"error: rank 0 could not create the store's file: {exc}"
    path = comm.bcast_object(message)
    if path.startswith("error: "):
        raise RuntimeError(path[len("error: "):])
    return dist.FileStore(path, comm.size)


def remove_store_file(comm: Communicator, path: str | None) -> None:
    """Remove a one-node store's file (``store.path``; ``None``, for a TCP store, removes
    nothing) once every rank of ``comm`` has destroyed its handle on the store or handed
    it to an object that outlives the call. Collective: a barrier, rank 0 removes the
    file, a barrier; on return the file is gone for every rank. The first barrier
    matters: a rank still inside its store's destructor would otherwise write the file
    anew after the removal. Cost: two barriers."""
    comm.barrier()
    if comm.rank == 0 and path:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    comm.barrier()


def _tcp_store(comm: Communicator, host: str | None, timeout: datetime.timedelta) -> Any:
    store: Any = None
    address: tuple[str, int] | str = ""
    if comm.rank == 0:
        try:
            host = host or _announced_host()
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, 0))
            listener.listen(max(128, comm.size))
            port = listener.getsockname()[1]
            # the store's server takes the socket over (and closes it when destroyed)
            store = dist.TCPStore(host, port, comm.size, is_master=True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=listener.detach())
            address = (host, port)
        except (OSError, RuntimeError) as exc:
            address = f"rank 0 could not start the TCP store: {exc}"
    address = comm.bcast_object(address)
    if isinstance(address, str):
        raise RuntimeError(address)
    if store is None:
        store = dist.TCPStore(address[0], address[1], comm.size, is_master=False,
                              timeout=timeout)
    return store


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name == "lo"), None) or \
        next((name for name in names if name.startswith("lo")), None)


@contextlib.contextmanager
def loopback_devices(comm: Communicator) -> Iterator[None]:
    """While the body creates gloo process groups: when every rank is on one node and
    ``GLOO_SOCKET_IFNAME`` is unset, set it to the loopback interface, so that gloo's
    own connections listen on loopback rather than on the address the host name
    resolves to. Restored afterwards; local."""
    interface = _loopback_interface() if comm.nodes == 1 else None
    if interface is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def rendezvous_store(comm: Communicator, timeout: datetime.timedelta | None = None, *,
                     kind: str = "auto", host: str | None = None) -> Any:
    """A store shared by the ranks of ``comm`` (see the module docstring).

    ``kind``: ``"auto"`` (a file store when every rank is on one node, else TCP),
    ``"file"`` or ``"tcp"``; ``host``: the address a TCP store binds and announces
    (default: what rank 0's host name resolves to). Collective.
    """
    if kind not in ("auto", "file", "tcp"):
        raise ValueError(f"kind must be 'auto', 'file' or 'tcp', got {kind!r}")
    if kind == "auto":
        kind = "file" if comm.nodes == 1 else "tcp"
    if kind == "file":
        return _file_store(comm)
    return _tcp_store(comm, host, timeout or datetime.timedelta(seconds=300))
