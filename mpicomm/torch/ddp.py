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
background thread that runs ``strategy.aggregate_into`` on a private duplicate of the mpicomm
communicator (so it never interleaves with the training loop's own MPI traffic) and
returns a ``torch.futures.Future`` that the thread completes with the averaged buffer;
DDP waits on it at the end of backward and writes it into ``param.grad``. Buckets are
therefore aggregated while backward is still computing earlier layers, as with DDP's own
allreduce. ``overlap=False`` aggregates on the calling thread instead (simpler to debug;
no MPI_THREAD_MULTIPLE needed).

At the end of every synchronized iteration (after the bucket DDP marks as the last
one) the hook calls the strategy's ``step_done`` itself, on its thread, so that ``auto``
refines its model and decides again and schedules advance; pass the optimizer
(``ddp_comm_hook(..., optimizer=opt)``) for the sparsifiers' and ``auto``'s momentum
correction. ``MpicommHookState`` says when and why.

Error feedback of compressing strategies follows the parameters: each bucket reaches the
strategy as its parameters' gradients, named and ordered by the parameters' first
appearance (last first), so where DDP's bucket rebuild after the first iteration only reorders the
parameters inside a bucket the strategy sees no change and its memory carries from the
first step on (where the rebuild regroups them, the first step's residual is dropped;
``MpicommHookState`` says more).

CUDA buckets: the hook records an event on the autograd stream and the thread waits for
it before the strategy reads the buffer, and synchronizes its own stream before handing
the result to DDP (as ``mpicomm.torch.GradientSync`` does).

Cost: the strategy's own (see ``mpicomm.strategies``) per bucket, plus one queue
hand-off (~10 µs) and, where a bucket holds its parameters in another order than the
strategy's (DDP's first iteration, before its rebuild), two copies of the bucket (into
the strategy's fusion buffer and back). DDP's ``bucket_cap_mb`` (default 25) is the
fusion size: a sparsifier selects top-k per bucket (per piece of ``fusion_bytes``, the
strategy's own fusion size, where that is smaller). The process group's own traffic is
only DDP's set-up broadcast (and ``broadcast_buffers`` for models with buffers, e.g.
BatchNorm).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import clock, hooks
from ..comm import Communicator, resolve
from ..strategies import Strategy
from .rendezvous import loopback_devices, remove_store_file, rendezvous_store
from .strategy_options import build_strategy

__all__ = ["init_process_group", "destroy_process_group", "process_group",
           "MpicommHookState", "mpicomm_hook", "ddp_comm_hook"]


# ---------------------------------------------------------------------- process group
_group_store_file: str | None = None    # the default group's one-node store file


def init_process_group(comm: Communicator | None = None, backend: str = "gloo", *,
                       timeout_s: float = 300.0) -> None:
    """Start ``torch.distributed``'s default process group over the ranks of ``comm``.

    Rank ``r`` of ``comm`` (default: the world) becomes rank ``r`` of the process group.
    The rendezvous goes through ``mpicomm.torch.rendezvous.rendezvous_store``: on one
    node a file store in a private temporary file (no socket is opened), across
    nodes a TCP store that listens only on the address rank 0 announces over MPI; on one
    node gloo's own connections listen on loopback (unless ``GLOO_SOCKET_IFNAME`` is
    set). So no
    ``MASTER_ADDR``/``MASTER_PORT``/``torchrun`` is needed. Collective. Raises
    ``RuntimeError`` on every rank when a default group already exists, and
    ``ValueError`` for an unknown backend. ``backend="nccl"`` works the same way on GPUs.
    Returns on every rank only once every rank's group is complete (an MPI barrier after
    the creation): gloo's full mesh can be complete on one rank while another still
    connects, and a rank that went on to destroy its group then broke the other's
    connection ("Connection closed by peer"). Release with
    ``destroy_process_group`` (or use ``process_group``).
    """
    global _group_store_file
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
    _group_store_file = getattr(store, "path", None)
    comm.barrier()


def destroy_process_group(comm: Communicator | None = None, *, wait: bool = True) -> None:
    """Destroy ``torch.distributed``'s default process group once every rank of ``comm``
    (default: the world) is done with it. Collective unless ``wait=False``.

    An MPI barrier comes first. A rank leaves a gloo collective as soon as it has what
    it needs, and gloo closes a group's connections at once, so a rank that destroyed
    its group (and then exited) while a peer was still inside the last operation could
    fail that peer's operation. After the barrier every rank has left every operation
    of the group. ``wait=False`` skips the barrier: for an error path, where the other
    ranks may never reach it.

    On one node rank 0 then removes the rendezvous store's file between two more
    barriers (``mpicomm.torch.rendezvous.remove_store_file``), which
    torch's own clean-up can miss; ``wait=False`` leaves the file to that clean-up.
    """
    global _group_store_file
    comm = resolve(comm)
    if wait:
        comm.barrier()
    dist.destroy_process_group()
    path, _group_store_file = _group_store_file, None
    if wait and path:
        remove_store_file(comm, path)


@contextlib.contextmanager
def process_group(comm: Communicator | None = None, backend: str = "gloo",
                  **kwargs: Any) -> Iterator[None]:
    """``init_process_group`` for the body of a ``with`` block, and
    ``destroy_process_group`` at its end. When the body raises, the group is
    destroyed without the barrier (the other ranks may never reach it) and the
    exception goes on."""
    comm = resolve(comm)
    init_process_group(comm, backend, **kwargs)
    try:
        yield
    except BaseException:
        destroy_process_group(comm, wait=False)
        raise
    destroy_process_group(comm)


# ---------------------------------------------------------------------- the hook
_HOOK_OPTIONS = ("comm", "overlap", "optimizer")  # the hook's own keywords; the rest
#                                                  go to the strategy


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
    optimizer:
        The training loop's optimizer (optional). It is passed to the strategy's
        ``step_done`` at the end of every iteration, so that a sparsifier's
        ``momentum_correction="optimizer"`` (Top-k's default by name, the default of the
        classes ``TopKAllgather``, ``GTopK`` and ``ARTopK``) and ``auto``'s momentum
        correction can take an SGD optimizer's momentum over (DGC's recipe). Without it
        their memory stays plain error feedback and the optimizer keeps its momentum: it
        is applied once, by the optimizer.

    The end of each iteration: DDP marks the last bucket of every backward
    (``GradBucket.is_last()``, after its bucket rebuild too). Right after that bucket is
    aggregated, on the same thread and before its future completes, the state calls
    ``strategy.step_done(None, optimizer)``: once per synchronized iteration, in the
    same order on every rank, ordered with the aggregations on the private
    communicator. An iteration inside ``ddp_model.no_sync()`` runs no hook and closes
    no step (its gradients are accumulated and synchronized with the next one, as the
    optimizer steps once per synchronized iteration). Before the future completes,
    because the training loop is then still inside ``backward()`` waiting for it: the
    strategy's end of step never runs while ``optimizer.step()`` or the next forward
    runs on the other thread (it may change the optimizer's momentum and the strategy's
    choices). Its cost is ``step_done``'s own (``auto``: arithmetic on agreed numbers,
    no communication), added to the end of backward. It runs before the iteration's
    ``optimizer.step()``, where ``GradientSync.step`` calls it after; the decisions take
    effect from the next iteration's first bucket either way, and the momentum handover
    at the first step is the same (an SGD optimizer's first momentum step applies the
    gradient itself), so runs match ``GradientSync.step`` runs. Exploration windows of
    ``auto`` (``probe_first=False`` / ``probe_triggered=False``; the default probes need
    none) restore only the strategy's state under the hook, which never sees the model.

    Do not call ``state.strategy.step_done`` yourself while the state is open: it
    raises ``RuntimeError`` (the state closes every step; a second call would advance
    the strategy twice per step); after ``close`` it is the strategy's own again. A
    strategy belongs to one open state at a time (``ValueError``). ``state.steps``
    counts the steps closed, ``state.buckets`` the buckets aggregated.

    Error feedback and per-step counters follow the parameters, not DDP's bucket
    layout: each bucket is split into its parameters' gradients, named ``"ddp/p<n>"`` by
    the order in which the parameters first appear, and handed to the strategy in the
    reverse of that order (the order backward produces them in, as DDP's rebuilt buckets
    and ``GradientSync`` hold them). The strategy fuses them again, by its
    ``fusion_bytes``: in place where they lie in that order in DDP's buffer, else a copy
    into a fusion buffer and back. DDP rebuilds its
    buckets after the first iteration, in the order the gradients became ready. Where
    that only reorders the parameters inside the buckets (for example a model in one
    bucket), the strategy sees the same tensors in the same order: residuals and
    schedules carry over exactly. Where it regroups them (more buckets), the buffers of
    the first iteration do not come back: their one-step residual is dropped and their
    schedules start again with the second iteration; afterwards the buckets are stable.
    """

    def __init__(self, strategy: Strategy | str | None = None,
                 comm: Communicator | None = None, *, overlap: bool = True,
                 optimizer: Any = None, **options: Any):
        strategy = build_strategy(strategy, options, owner="MpicommHookState",
                                  owner_options=_HOOK_OPTIONS)
        if getattr(strategy, "step_done", None) is _refuse_step_done:
            raise ValueError("this strategy already belongs to an open MpicommHookState; "
                             "give each hook a strategy of its own")
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        self.comm = resolve(comm)
        if dist.is_initialized() and dist.get_world_size() != self.comm.size:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but the "
                             f"communicator {self.comm.size}")
        self.overlap = bool(overlap)
        self.optimizer = optimizer
        self._hcomm = self.comm.dup()
        self.strategy = strategy.bind(self._hcomm)
        self.buckets = 0
        self.steps = 0
        self._numbers: dict[int, tuple[weakref.ref, int]] = {}  # id(param) -> number
        self._count = 0
        self._queue: clock.Queue = clock.Queue()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.overlap:
            self._thread = clock.start_thread(self._run, name="mpicomm-ddp-hook")
        self._end_step = self.strategy.step_done  # the state closes the steps from now on
        self.strategy.step_done = _refuse_step_done  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return (f"MpicommHookState(strategy={self.strategy.name!r}, ranks={self.comm.size}, "
                f"overlap={self.overlap}, buckets={self.buckets}, steps={self.steps}"
                f"{', closed' if self._closed else ''})")

    @property
    def stats(self) -> Any:
        """The strategy's ``mpicomm.strategies.StrategyStats`` (bytes, time)."""
        return self.strategy.stats

    def submit(self, index: int, grad: torch.Tensor, params: Sequence[torch.Tensor] | None
               = None, *, last: bool = False) -> torch.futures.Future:
        """Aggregate one bucket's flat gradient in place; a future of it, averaged.

        ``params``: the bucket's parameters in the buffer's order
        (``GradBucket.parameters()``), so that the buffer is split per parameter (class
        docstring); without them the buffer is one tensor, keyed by
        ``"ddp/b<index>/<numel>"``. ``last``: the iteration's last bucket
        (``GradBucket.is_last()``): the step is closed after it."""
        if self._closed:
            raise RuntimeError("this MpicommHookState is closed")
        fut: torch.futures.Future = torch.futures.Future()
        ready = None
        if grad.is_cuda:  # the hook thread must not read before autograd's stream wrote
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(grad.device))
        item = (index, grad, None if params is None else list(params), bool(last), ready,
                fut)
        if self._thread is None:
            self._complete(*item)
        else:
            self._queue.put(item)
        return fut

    def _split(self, index: int, grad: torch.Tensor, params: list[torch.Tensor] | None
               ) -> tuple[list[torch.Tensor], list[str]]:
        """The bucket's per-parameter views, last-appearing first, and their names."""
        sizes = [p.numel() for p in params or ()]
        if not sizes or sum(sizes) != grad.numel():
            return [grad], [f"ddp/b{index}/{grad.numel()}"]
        numbers = [self._number(p) for p in params]  # type: ignore[union-attr]
        views = torch.split(grad, sizes)
        order = sorted(range(len(sizes)), key=numbers.__getitem__, reverse=True)
        return ([views[i].view(params[i].shape) for i in order],  # type: ignore[index]
                [f"ddp/p{numbers[i]}" for i in order])

    def _number(self, param: torch.Tensor) -> int:
        """``param``'s number: the count of parameters seen before it."""
        ref, n = self._numbers.get(id(param), (None, -1))
        if ref is None or ref() is not param:  # new (or a dead one's id reused)
            n, self._count = self._count, self._count + 1
            self._numbers[id(param)] = (weakref.ref(param), n)
        return n

    def _complete(self, index: int, grad: torch.Tensor, params: list[torch.Tensor] | None,
                  last: bool, ready: Any, fut: torch.futures.Future) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            tensors, names = self._split(index, grad, params)
            with hooks.block(f"ddp bucket {index}", "bucket", None, bucket=index,
                             bytes=grad.numel() * grad.element_size()):
                self.strategy.aggregate_into(tensors, names)
            if grad.is_cuda:  # finished on this thread's stream before DDP reads it
                torch.cuda.current_stream(grad.device).synchronize()
            self.buckets += 1
            if last:  # before the future: DDP's backward still waits for it
                self.steps += 1
                self._end_step(None, self.optimizer)
        except BaseException as exc:  # handed to DDP, which raises it in backward
            fut.set_exception(exc)
            return
        fut.set_result(grad)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._complete(*item)

    def close(self) -> None:
        """Stop the thread and free the private communicator (collective). Idempotent.
        The strategy's ``step_done`` is its own again afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        with contextlib.suppress(AttributeError):
            del self.strategy.step_done
        self._hcomm.free()

    def __enter__(self) -> MpicommHookState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse_step_done(model: Any = None, optimizer: Any = None) -> None:
    """What ``strategy.step_done`` is while a ``MpicommHookState`` closes its steps."""
    raise RuntimeError("this strategy's steps are closed by its MpicommHookState after "
                       "the last bucket of every DDP iteration; do not call step_done "
                       "yourself (pass the optimizer as MpicommHookState(..., "
                       "optimizer=opt) or ddp_comm_hook(..., optimizer=opt))")


def _submit(state: MpicommHookState, bucket: Any) -> torch.futures.Future:
    return state.submit(bucket.index(), bucket.buffer(), bucket.parameters(),
                        last=bucket.is_last())


def mpicomm_hook(state: MpicommHookState, bucket):  # noqa: ANN001, ANN201
    """DDP communication hook: average ``bucket`` with ``state``'s mpicomm strategy.

    ``bucket`` is DDP's ``torch.distributed.GradBucket``; the return value is a
    ``torch.futures.Future[torch.Tensor]`` (not annotated: DDP compares annotations with
    its own classes, and this module's are strings).

    Register with ``ddp_model.register_comm_hook(state, mpicomm_hook)``. Returns the
    future DDP expects, completed with the bucket's average over ranks (for compressing
    strategies, the strategy's estimate of it). After the last bucket of an iteration
    the state closes the strategy's step (``MpicommHookState``).
    """
    return _submit(state, bucket)


def ddp_comm_hook(strategy: Strategy | str | None = None, comm: Communicator | None = None,
                  *, overlap: bool = True, optimizer: Any = None, **options: Any) -> Any:
    """A ready-made hook for ``ddp_model.register_comm_hook(hook.state, hook)``.

    Builds a ``MpicommHookState`` (collective; arguments as there) and returns a
    hook function with that state attached as ``hook.state``; the hook ignores the
    ``state`` DDP passes back, so ``register_comm_hook(None, hook)`` works too. Call
    ``hook.state.close()`` when training ends.

    ``strategy`` is one of dense, topk, gtopk, artopk, randomk, qsgd, powersgd, fp16,
    bf16, sign, hier_topk, hier_gtopk, hier_artopk, auto (its options as further
    keywords: ``ddp_comm_hook("gtopk", comm, density=0.01)``), a
    ``mpicomm.strategies.Strategy`` instance, or ``None`` for dense allreduce. A keyword
    that neither the hook (``comm``, ``overlap``, ``optimizer``) nor the strategy takes
    raises ``TypeError`` before any communication.

    At the end of every synchronized iteration the hook calls the strategy's
    ``step_done`` itself (``MpicommHookState``): adaptive strategies (``auto``) refine
    and decide again, and with ``optimizer=opt`` the sparsifiers and ``auto`` take an
    SGD optimizer's momentum over. Do not call ``step_done`` yourself.
    """
    strategy = build_strategy(strategy, options, owner="ddp_comm_hook",
                              owner_options=_HOOK_OPTIONS)
    state = MpicommHookState(strategy, comm, overlap=overlap, optimizer=optimizer)

    def hook(_state, bucket):  # noqa: ANN001, ANN202 - see mpicomm_hook
        return _submit(state, bucket)

    hook.state = state  # type: ignore[attr-defined]
    hook.__name__ = f"mpicomm_{state.strategy.name}_hook"
    return hook
