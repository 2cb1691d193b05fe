"""The :class:`KVStore` front end: one object per rank, a server or a worker."""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

from ..abort import install_abort_handler
from ..comm import Communicator, resolve
from ..compress import Compressor, make
from ..config import env_flag, env_int
from ..emulate.linkdelay import link_delay
from ..validate import check_choice, check_int
from . import wire
from .optim import OPTIMIZERS, ShardOptimizer
from .server import Server
from .sharding import DEFAULT_CHUNK_BYTES
from .worker import Worker

__all__ = ["KVStore", "MODES"]

MODES = ("sync", "async", "ssp")


class KVStore:
    r"""A sharded key-value store of parameters: servers apply updates, workers push/pull.

    Built on every rank of ``comm`` (collective). The last ``servers`` ranks are servers
    (they call :meth:`serve`, which returns once every worker has called :meth:`close`);
    the others are workers, numbered ``worker_rank = 0..W-1`` in rank order.

    Workers ``init`` every key (same keys, shapes and dtypes on every worker, in the same
    order; worker 0's value is the initial one), then per step ``push(key, grad)`` and
    ``pull(key)``. Servers apply ``optimizer`` (``"sgd"``: ``torch.optim.SGD`` with
    ``momentum``/``weight_decay``; ``"adam"``: ``torch.optim.Adam`` with ``weight_decay``)
    to their shards.

    Modes (see :mod:`mpicomm.ps.server` for the exact rules):

    ``"sync"`` (BSP)
        One update per step once all ``W`` pushes are in: ``p <- p - lr * mean_w g_w``
        for plain SGD, i.e. exactly synchronous allreduce-averaged SGD. A pull waits for
        the update of the worker's last push.
    ``"async"`` (ASP, Hogwild-style server)
        Each push applied on arrival, scaled by ``1/W`` (one push from every worker equals
        one sync step for plain SGD); a pull returns the current value at once.
    ``"ssp"`` with ``staleness=s`` (Ho et al., NIPS 2013)
        Applied as async, but a worker's pull after its push of step ``t`` waits until
        every worker has pushed step ``t - s``: nobody runs more than ``s`` steps ahead.
        ``s = 0`` keeps the workers in lock-step like sync (a pull sees every push of its
        step, and possibly some of the next: SSP bounds staleness from below only); a
        large ``s`` is async.

    ``compressor``: any :class:`mpicomm.compress.Compressor` (or its registry name),
    applied to each pushed piece after error feedback, which the worker keeps
    (``g_c = g + e``, send ``C(g_c)``, ``e <- g_c - D(C(g_c))``); the server decompresses
    each push and applies it like a dense one (sync: the mean of the ``W`` decoded pushes;
    async/SSP: each scaled by ``1/W``). Pieces are flat; how a compressor sees them is in
    :mod:`mpicomm.ps.codec`.

    PowerSGD (``compressor="powersgd"`` or ``PowerSGD(rank=r)``) in a parameter server:
    each worker compresses its own piece of a gradient independently, as one rank of the
    single-rank PowerSGD: ``M = G + E`` viewed as the block of the layer's rows that
    covers the piece, ``P = M Q`` with ``Q`` the worker's previous ``Q`` for that piece
    (warm start), ``P^ = orthonormalize(P)``, ``Q <- M^T P^``; it sends ``P`` (n x r) and
    ``Q`` (m x r), ``(n + m) r`` floats instead of ``n m``, and keeps ``E = M - P^ Q^T``.
    The server decodes each push as ``orthonormalize(P) Q^T``. Deviation from the
    allreduce PowerSGD (:class:`~mpicomm.strategies.PowerSGDAllreduce`, Vogels et al.):
    there ``P`` and ``Q`` are summed over the ranks between the two half-steps, so every
    rank projects onto one shared basis and the mean of the approximations is computed
    once; a parameter server decodes each push on its own, so the ``W`` approximations
    have ``W`` different bases (no aggregation of ``P`` across workers), which costs the
    server ``W`` small products per step and gives each worker its own warm start. Each
    worker's ``Q`` per piece is checkpointed with its residuals.

    ``pull_compressor`` (same kinds; default ``None``: dense pulls): the server keeps, per
    piece, a mirror of what the workers hold; at most once per version it compresses
    ``delta = value - mirror`` and adds the decoded delta to the mirror, and a pull sends
    the deltas the worker has not had yet, which the worker adds to its copy, so what a
    worker holds is always exactly the server's mirror (what was not sent is in the next
    delta: error feedback without a residual; :mod:`mpicomm.ps.server`). The first pull
    of a piece is the whole mirror. Cost: one mirror per shard on each server, and the
    compression work once per version of a piece, however many workers pull it. The
    mirrors are not checkpointed: after :meth:`restore` the first pull is a
    full-precision one. Tuning: a worker computes its gradient on a lagging copy
    of the parameters, which acts like staleness (a rank-``r`` PowerSGD pull needs about
    ``n / r`` pulls to deliver a full-rank change of an ``n``-row block; meanwhile the
    server keeps applying gradients of the old copy and may overshoot): prefer accurate
    pull compressors (``fp16``, ``qsgd``, PowerSGD with a larger rank) and lower the
    learning rate when the loss oscillates.

    Cost model (alpha-beta): a dense push + pull of ``M`` bytes by each of ``W`` workers
    through one server port takes about ``2 alpha + 2 W M beta`` per step (Table I of
    Tyagi & Swany gives ``2 alpha + 2 (N-1) M beta`` with N ranks); with the ``M`` bytes
    split over ``S`` servers each port carries ``2 W M / S``. A ring allreduce moves
    ``2 (W-1)/W M`` per rank. So PS wins when servers bring their own bandwidth
    (``S`` comparable to ``W``), loses on a flat network with ``S = 1``
    (:func:`mpicomm.collectives.cost.ps_push_pull`). Tuning: ``S ~ W`` for bandwidth-bound
    models; ``ssp`` with ``s = 1..4`` when one worker straggles (the others keep going,
    staleness stays bounded); ``async`` for the most throughput at unbounded staleness.

    ``chunk_bytes`` (default ``MPICOMM_PS_CHUNK_BYTES``, else 2 MiB where the ranks
    span several hosts and 0 on one host, where nothing overlaps; 0: off): pieces
    of dense keys larger than this are cut into chunks, each its own piece on the same
    server (:mod:`mpicomm.ps.sharding`), so that :meth:`push_pull` pipelines: a server
    receives, sums and updates chunk ``i + 1`` while its reply of chunk ``i`` goes out,
    about ``n (beta + gamma) + k o + (n/k) beta`` for ``k`` chunks of an ``n``-byte piece
    instead of ``2 n beta + n gamma`` (``o``: tens of microseconds of fixed cost per
    chunk). Tuning: keep chunks well above ``o / beta`` (about 256 KiB on shared memory)
    and, over TCP, in the megabytes (512 KiB chunks made a 4-16 MB push + pull 2.3x
    slower than 2 MiB ones on a shaped 1 Gbit/s link); raise it (or 0) for many small
    keys on a high-latency network. Not with a
    compressor (``ValueError``; the default is then 0). Checkpoints do not depend on it.

    Faults: an uncaught exception on any rank ends the whole job (``MPI_Abort``) with the
    rank's traceback; a server that fails aborts with ``parameter server failed`` and its
    rank. Every push carries a per-(worker, key) sequence number: duplicates are skipped,
    gaps stop the job; :meth:`checkpoint` saves the numbers with the shards, so after
    :meth:`restore` no update is lost or applied twice.
    """

    def __init__(self, comm: Communicator | None = None, *, servers: int, mode: str = "sync",
                 staleness: int = 0, optimizer: str = "sgd", lr: float = 0.1,
                 momentum: float = 0.0, weight_decay: float = 0.0,
                 compressor: Compressor | str | None = None,
                 pull_compressor: Compressor | str | None = None,
                 chunk_bytes: int | None = None) -> None:
        comm = resolve(comm)
        with comm.validating("ps.KVStore") as agreed:
            servers = check_int("servers", servers, 1)
            if servers >= comm.size:
                raise ValueError(
                    f"servers must be in [1, size - 1] = [1, {comm.size - 1}] so that at least "
                    f"one worker remains (a parameter server needs >= 2 ranks), got {servers}")
            mode = check_choice("mode", mode, MODES)
            staleness = check_int("staleness", staleness, 0)
            if staleness and mode != "ssp":
                raise ValueError(f"staleness={staleness} needs mode='ssp' (got {mode!r})")
            check_choice("optimizer", optimizer, OPTIMIZERS)
            opt = ShardOptimizer(optimizer, lr, momentum, weight_decay)
            compressor = _compressor("compressor", compressor)
            pull_compressor = _compressor("pull_compressor", pull_compressor)
            chunk_bytes = _chunk_bytes(chunk_bytes, compressor is not None or
                                       pull_compressor is not None, comm.nodes)
            agreed.update(servers=servers, mode=mode, staleness=staleness, **opt.describe(),
                          compressor=repr(compressor), pull_compressor=repr(pull_compressor),
                          chunk_bytes=chunk_bytes)
        if env_flag("MPICOMM_ABORT_ON_ERROR", True):
            install_abort_handler()
        wire.set_host_ranks(comm.local_size)   # the waits' spin window (wire.Backoff)
        self.servers = servers
        self.workers = comm.size - servers
        self.mode = mode
        self.staleness = staleness
        self.is_server = comm.rank >= self.workers
        self.is_worker = not self.is_server
        self.worker_rank: int | None = comm.rank if self.is_worker else None
        self._comm = comm.dup()
        self._group = self._comm.split(0 if self.is_worker else 1)
        self._closed = False
        self._server: Server | None = None
        self._worker: Worker | None = None
        if self.is_server:
            self._server = Server(self._comm, self.workers, mode, staleness, opt,
                                  compressor, pull_compressor, split_replies=comm.nodes == 1)
        else:
            assert self._group is not None
            self._worker = Worker(self._comm.p2p, self._group, self.workers, servers, mode,
                                  opt.describe(), compressor, link_delay(self._comm),
                                  pull_compressor, chunk_bytes)

    def __repr__(self) -> str:
        role = "server" if self.is_server else f"worker {self.worker_rank}"
        return (f"KVStore({role}, servers={self.servers}, workers={self.workers}, "
                f"mode={self.mode!r}, staleness={self.staleness})")

    # ------------------------------------------------------------------ roles
    def _as_worker(self, what: str) -> Worker:
        if self._worker is None:
            raise RuntimeError(f"KVStore.{what} is a worker call; this rank is a server "
                               "(call serve())")
        if self._closed:
            raise RuntimeError(f"KVStore.{what} after close()")
        return self._worker

    def serve(self) -> None:
        """Servers: answer the workers until every one has closed, then release."""
        if self._server is None:
            raise RuntimeError("KVStore.serve is a server call; this rank is a worker")
        if self._closed:
            raise RuntimeError("KVStore.serve after the store was released")
        try:
            self._server.serve()
        finally:
            self._release()

    # ------------------------------------------------------------------ worker calls
    def init(self, key: Hashable, value: Any) -> None:
        """Register ``key`` with worker 0's ``value`` (collective over the workers)."""
        self._as_worker("init").init_many([(key, value)])

    def push(self, key: Hashable, grad: Any) -> None:
        """Send ``grad`` (the key's shape and dtype) for ``key``. A dense push is sent
        from ``grad`` itself (no copy) and returns once the servers hold it, so ``grad``
        may change right after; a compressed push returns at once."""
        self._as_worker("push").push(key, grad)

    def pull(self, key: Hashable, out: Any = None) -> Any:
        """The current value of ``key`` as the consistency mode allows (``out=``: in place)."""
        return self._as_worker("pull").pull(key, out)

    def push_pull(self, key: Hashable, grad: Any, out: Any = None) -> Any:
        """``push(key, grad)`` then ``pull(key, out)``, the same values and consistency,
        pipelined over the key's chunks (``chunk_bytes``): each chunk's push also asks
        for its pull, so a server answers chunk ``i`` while chunk ``i + 1`` arrives.
        ``out`` may be ``grad`` itself. Returns once every chunk is back (and ``grad``
        may change)."""
        return self._as_worker("push_pull").push_pull(key, grad, out)

    def close(self) -> None:
        """Workers: tell the servers this worker is done and release. Idempotent; on a
        server it only releases (after :meth:`serve`)."""
        if self._closed:
            return
        if self._worker is not None:
            self._worker.close()
        self._release()

    def checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save every shard, optimizer state and counter to ``path`` (collective over the
        workers; call it between steps, after the pulls). Worker 0 writes the file."""
        self._as_worker("checkpoint").checkpoint(path)

    def snapshot(self) -> dict[str, Any] | None:
        """What :meth:`checkpoint` writes, as a dict on worker 0 (``None`` on the other
        workers; collective over the workers, between steps): for a caller that writes it
        itself, e.g. in the background (:class:`mpicomm.checkpoint.Checkpointer`, with
        :func:`mpicomm.ps.checkpoint.serialize`). The dict holds copies: training may go
        on while it is written."""
        return self._as_worker("snapshot").snapshot()

    def restore(self, path: str | os.PathLike[str] | dict[str, Any]) -> None:
        """Load ``path`` into this new store, instead of ``init`` (collective over the
        workers; servers must be serving). Same number of workers and the same optimizer
        kind as when saved. Worker 0 may pass the loaded dict instead of a path (what
        :meth:`snapshot` returned, or ``torch.load`` of a checkpoint file)."""
        self._as_worker("restore").restore(path)

    def check_checkpoint(self, data: dict[str, Any]) -> None:
        """``ValueError`` if :meth:`restore` would refuse ``data`` (a loaded checkpoint):
        another number of workers, another optimizer kind, compressor state this store's
        compressor cannot take, or a damaged layout. Local (no message), so that a caller
        can refuse a checkpoint before the servers start serving."""
        self._as_worker("check_checkpoint").check_checkpoint(data)

    def stats(self) -> dict[str, Any]:
        """This rank's counters: ``max_staleness``, ``pushes``, ``pulls``, ``bytes_pushed``,
        ``bytes_pulled`` (whole messages, headers included; compressed payloads with a
        compressor / pull compressor); servers add ``updates``
        (optimizer steps), ``duplicates`` (pushes skipped as already applied),
        ``idle_s`` (time asleep waiting for messages), ``cpu_s`` and ``wall_s`` (process
        CPU time and wall time of :meth:`serve`), ``pull_encodings`` (compressions of
        pull deltas: at most one per version and piece); workers add ``server_pushes`` (pushes the
        servers had applied at the last pull), ``staleness`` (the largest staleness served by
        the last pull) and ``wait_s`` (time spent in pulls)."""
        part = self._server if self._server is not None else self._worker
        assert part is not None
        return dict(part.stats)

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._group is not None:
            self._group.free()
        self._comm.free()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunk_bytes(value: int | None, compressed: bool, hosts: int) -> int:
    """The chunk size in bytes: ``value``, else ``MPICOMM_PS_CHUNK_BYTES``, else
    ``DEFAULT_CHUNK_BYTES`` where the ranks span several ``hosts`` and 0 (no chunks) on
    one host: through shared memory the transfer is a copy by the same cores that would
    update, so there is nothing to overlap and every chunk only adds its fixed cost
    (measured slower at 1-16 MB on a 2-core host). 0 for a store with a compressor,
    which must not ask for any."""
    if value is not None:
        value = check_int("chunk_bytes", value, 0)
        if value and compressed:
            raise ValueError(f"chunk_bytes={value} needs a dense store (no compressor or "
                             "pull_compressor): a compressor sees whole pieces")
        return value
    default = DEFAULT_CHUNK_BYTES if hosts > 1 else 0
    return 0 if compressed else env_int("MPICOMM_PS_CHUNK_BYTES", default, 0)


def _compressor(what: str, value: Compressor | str | None) -> Compressor | None:
    """``value`` as a compressor: an instance, a registry name (built with its defaults),
    or None; ``TypeError`` for anything else, ``ValueError`` for an unknown name."""
    if isinstance(value, str):
        return make(value)
    if value is not None and not isinstance(value, Compressor):
        raise TypeError(f"{what} must be an mpicomm.compress.Compressor, its name, or None; "
                        f"got {type(value).__name__}")
    return value
