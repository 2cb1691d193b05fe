"""Drop-in for PyTorch DDP: a ``torch.distributed`` process group from the MPI ranks, and
a DDP communication hook that aggregates each gradient bucket with any mpicomm strategy.

An existing ``DistributedDataParallel`` script changes in two places::

    comm = mpicomm.init()
    mpicomm.torch.init_process_group(comm)            # gloo, rank/size from MPI
    model = DistributedDataParallel(net)
    hook = mpicomm.torch.ddp_comm_hook("gtopk", density=0.01, comm=comm)
    model.register_comm_hook(hook.state, hook)         # or (None, hook)
    ...                                                 # the training loop, unchanged
    hook.state.close()

What runs where
---------------
DDP still does what it always does: it broadcasts rank 0's parameters when the model is
wrapped (over gloo), groups gradients into buckets during backward, and launches the
buckets strictly in index order, calling the hook once per bucket with a
``GradBucket`` whose ``buffer()`` is the bucket's flat local gradient (not yet divided
by the number of ranks: DDP leaves the averaging to the hook). The hook hands the buffer to a
background thread that runs ``strategy.aggregate`` on a private duplicate of the mpicomm
communicator (so it never interleaves with the training loop's own MPI traffic) and
returns a ``torch.futures.Future`` that the thread completes with the averaged buffer;
DDP waits on it at the end of backward and writes it into ``param.grad``. Buckets are
therefore aggregated while backward is still computing earlier layers, as with DDP's own
allreduce. ``overlap=False`` aggregates on the calling thread instead (simpler to debug;
no MPI_THREAD_MULTIPLE needed).

Error feedback of compressing strategies is keyed by ``"ddp/b<index>/<numel>"``: DDP
rebuilds its buckets once, after the first iteration, so the residual of that first
step is kept under the old key and dropped (a one-step loss of residual, harmless in
practice); afterwards buckets are stable and the memory carries from step to step.

CUDA buckets: the hook records an event on the autograd stream and the thread waits for
it before the strategy reads the buffer, and synchronizes its own stream before handing
the result to DDP (as ``mpicomm.torch.GradientSync`` does).

Cost: the strategy's own (see ``mpicomm.strategies``) per bucket, plus one queue
hand-off (~10 µs). DDP's ``bucket_cap_mb`` (default 25) is the fusion size: a sparsifier
selects top-k per bucket. The process group's own traffic is only DDP's set-up
broadcast (and ``broadcast_buffers`` for models with buffers, e.g. BatchNorm).
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import hooks
from ..comm import Communicator, resolve
from ..strategies import Strategy
from .rendezvous import loopback_devices, release_store, rendezvous_store
from .strategy_options import build_strategy

__all__ = ["init_process_group", "process_group", "MpicommHookState", "mpicomm_hook",
           "ddp_comm_hook"]


# ---------------------------------------------------------------------- process group
def init_process_group(comm: Communicator | None = None, backend: str = "gloo", *,
                       timeout_s: float = 300.0) -> None:
    """Start ``torch.distributed``'s default process group over the ranks of ``comm``.

    Rank ``r`` of ``comm`` (default: the world) becomes rank ``r`` of the process group.
    The rendezvous goes through ``mpicomm.torch.rendezvous.rendezvous_store``: on one
    node a file store in a private temporary directory (no socket is opened), across
    nodes a TCP store that listens only on the address rank 0 announces over MPI; on one
    node gloo's own connections listen on loopback (unless ``GLOO_SOCKET_IFNAME`` is
    set). So no
    ``MASTER_ADDR``/``MASTER_PORT``/``torchrun`` is needed. Collective. Raises
    ``RuntimeError`` on every rank when a default group already exists, and
    ``ValueError`` for an unknown backend. ``backend="nccl"`` works the same way on GPUs.
    Release with ``torch.distributed.destroy_process_group()`` (or use
    ``process_group``).
    """
    comm = resolve(comm)
    error: Exception | None = None
    if dist.is_initialized():
        error = RuntimeError("torch.distributed's default process group already exists")
    elif backend not in ("gloo", "nccl", "mpi"):
        error = ValueError(f"backend must be 'gloo', 'nccl' or 'mpi', got {backend!r}")
    elif not timeout_s > 0:
        error = ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    failed = comm.allreduce_value(error is not None, op="max")
    if failed:
        raise error or RuntimeError("init_process_group failed on another rank")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = rendezvous_store(comm, timeout)
    with loopback_devices(comm):
        dist.init_process_group(backend, store=store, rank=comm.rank, world_size=comm.size,
                                timeout=timeout)


@contextlib.contextmanager
def process_group(comm: Communicator | None = None, backend: str = "gloo",
                  **kwargs: Any) -> Iterator[None]:
    """``init_process_group`` for the body of a ``with`` block, destroyed on exit (and its
    store's directory removed)."""
    comm = resolve(comm)
    init_process_group(comm, backend, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()
        release_store()


# ---------------------------------------------------------------------- the hook
_HOOK_OPTIONS = ("comm", "overlap")  # the hook's own keywords; the rest go to the strategy


class MpicommHookState:
    """The state of ``mpicomm_hook``: a strategy, its communicator and its thread.

    Construction is collective over ``comm`` (it duplicates the communicator). Every rank
    must register the hook on the same DDP model configuration (same buckets).

    Parameters
    ----------
    strategy:
        A ``mpicomm.strategies.Strategy``, ``None`` for ``"dense"`` (allreduce), or one
        of the names dense, topk, gtopk, artopk, randomk, qsgd, powersgd, fp16, bf16,
        sign, hier_topk, hier_gtopk, hier_artopk, auto; then ``**options`` go to its
        constructor (``"gtopk", density=0.01``; the table of options is in
        ``help(mpicomm.torch.GradientSync)``). A keyword that neither this class nor the
        strategy takes raises ``TypeError`` before any communication.
    comm:
        The ``mpicomm.Communicator`` over the DDP ranks (default: the world); its
        ranks must be the process group's, in the same order.
    overlap:
        Aggregate on a background thread (default) so communication overlaps backward.
    """

    def __init__(self, strategy: Strategy | str | None = None,
                 comm: Communicator | None = None, *, overlap: bool = True,
                 **options: Any):
        strategy = build_strategy(strategy, options, owner="MpicommHookState",
                                  owner_options=_HOOK_OPTIONS)
        self.comm = resolve(comm)
        if dist.is_initialized() and dist.get_world_size() != self.comm.size:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but the "
                             f"communicator {self.comm.size}")
        self.overlap = bool(overlap)
        self._hcomm = self.comm.dup()
        self.strategy = strategy.bind(self._hcomm)
        self.buckets = 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.overlap:
            self._thread = threading.Thread(target=self._run, name="mpicomm-ddp-hook",
                                            daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return (f"MpicommHookState(strategy={self.strategy.name!r}, ranks={self.comm.size}, "
                f"overlap={self.overlap}, buckets={self.buckets}"
                f"{', closed' if self._closed else ''})")

    @property
    def stats(self) -> Any:
        """The strategy's ``mpicomm.strategies.StrategyStats`` (bytes, time)."""
        return self.strategy.stats

    def submit(self, index: int, grad: torch.Tensor) -> torch.futures.Future:
        """Aggregate one bucket's flat gradient; a future of the averaged tensor."""
        if self._closed:
            raise RuntimeError("this MpicommHookState is closed")
        fut: torch.futures.Future = torch.futures.Future()
        ready = None
        if grad.is_cuda:  # the hook thread must not read before autograd's stream wrote
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(grad.device))
        if self._thread is None:
            self._complete(index, grad, ready, fut)
        else:
            self._queue.put((index, grad, ready, fut))
        return fut

    def _complete(self, index: int, grad: torch.Tensor, ready: Any,
                  fut: torch.futures.Future) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            with hooks.block(f"ddp bucket {index}", "bucket", None, bucket=index,
                             bytes=grad.numel() * grad.element_size()):
                (out,) = self.strategy.aggregate([grad], [f"ddp/b{index}/{grad.numel()}"])
            if out.is_cuda:  # finished on this thread's stream before DDP reads it
                torch.cuda.current_stream(out.device).synchronize()
            self.buckets += 1
        except BaseException as exc:  # handed to DDP, which raises it in backward
            fut.set_exception(exc)
            return
        fut.set_result(out)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._complete(*item)

    def close(self) -> None:
        """Stop the thread and free the private communicator (collective). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        self._hcomm.free()

    def __enter__(self) -> MpicommHookState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mpicomm_hook(state: MpicommHookState, bucket):  # noqa: ANN001, ANN201
    """DDP communication hook: average ``bucket`` with ``state``'s mpicomm strategy.

    ``bucket`` is DDP's ``torch.distributed.GradBucket``; the return value is a
    ``torch.futures.Future[torch.Tensor]`` (not annotated: DDP compares annotations with
    its own classes, and this module's are strings).

    Register with ``ddp_model.register_comm_hook(state, mpicomm_hook)``. Returns the
    future DDP expects, completed with the bucket's average over ranks (for compressing
    strategies, the strategy's estimate of it).
    """
    return state.submit(bucket.index(), bucket.buffer())


def ddp_comm_hook(strategy: Strategy | str | None = None, comm: Communicator | None = None,
                  *, overlap: bool = True, **options: Any) -> Any:
    """A ready-made hook for ``ddp_model.register_comm_hook(hook.state, hook)``.

    Builds a ``MpicommHookState`` (collective; arguments as there) and returns a
    hook function with that state attached as ``hook.state``; the hook ignores the
    ``state`` DDP passes back, so ``register_comm_hook(None, hook)`` works too. Call
    ``hook.state.close()`` when training ends.

    ``strategy`` is one of dense, topk, gtopk, artopk, randomk, qsgd, powersgd, fp16,
    bf16, sign, hier_topk, hier_gtopk, hier_artopk, auto (its options as further
    keywords: ``ddp_comm_hook("gtopk", comm, density=0.01)``), a
    ``mpicomm.strategies.Strategy`` instance, or ``None`` for dense allreduce. A keyword
    that neither the hook (``comm``, ``overlap``) nor the strategy takes raises
    ``TypeError`` before any communication.
    """
    strategy = build_strategy(strategy, options, owner="ddp_comm_hook",
                              owner_options=_HOOK_OPTIONS)
    state = MpicommHookState(strategy, comm, overlap=overlap)

    def hook(_state, bucket):  # noqa: ANN001, ANN202 - see mpicomm_hook
        return state.submit(bucket.index(), bucket.buffer())

    hook.state = state  # type: ignore[attr-defined]
    hook.__name__ = f"mpicomm_{state.strategy.name}_hook"
    return hook
