"""Average gradients during ``loss.backward()``: buckets, a communication thread, overlap.

:class:`GradientSync` attaches to a ``torch.nn.Module`` and turns any training loop into a
synchronous data-parallel one::

    comm = mpicomm.init()
    sync = GradientSync(model, comm=comm)         # checks + broadcasts rank 0's weights
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()            # buckets are averaged while this runs
        sync.step(optimizer)                       # = sync.wait(); optimizer.step()

:func:`broadcast_module` copies one rank's parameters and buffers to every rank.

How a step flows
----------------
Parameters that require a gradient are grouped into *buckets* of about ``bucket_mb``
megabytes, in reverse registration order (backward produces gradients roughly from the
last layer to the first). A post-accumulate-grad hook on every parameter counts the
gradients of its bucket; when a bucket is complete it is handed to a background
*communication thread*, which averages it in place with ``strategy.aggregate_into`` on
a private duplicate of the communicator. The gradients of a bucket live in persistent
flat buffers (``param.grad`` becomes a view of them after the first step, as with DDP's
``gradient_as_bucket_view``), so a dense strategy reduces that memory directly, without
fusion copies or fresh allocations; the thread makes the model's CUDA device its current
one. The thread
takes buckets strictly in index order (a bucket that is ready early waits for the earlier
ones), so every rank issues the same collectives in the same order, and the communication
of the last layers runs while backward is still computing the first ones.
:meth:`GradientSync.wait` blocks until every bucket of the step is done.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import fusion
from ..collectives import allreduce, broadcast
from ..comm import Communicator, resolve
from ..observe.metrics import metrics_from
from ..observe.timeline import Timeline
from ..observe.trace import active as active_timeline
from ..strategies import Dense, Strategy, StrategyStats, make

__all__ = [
    "GradientSync",
    "SyncStats",
    "broadcast_module",
    "check_same_module",
    "describe_module_mismatch",
]

log = logging.getLogger("mpicomm.torch")

_ALIGN = 16  # byte alignment of each tensor inside a packed broadcast buffer


# ---------------------------------------------------------------------- module checks
def _signature(module: torch.nn.Module, buffers: bool) -> list[tuple[Any, ...]]:
    """(kind, name, shape, dtype, requires_grad) of every parameter (and buffer)."""
    sig: list[tuple[Any, ...]] = [
        ("parameter", name, tuple(int(s) for s in p.shape), str(p.dtype).replace("torch.", ""),
         bool(p.requires_grad))
        for name, p in module.named_parameters()
    ]
    if buffers:
        sig += [("buffer", name, tuple(int(s) for s in b.shape),
                 str(b.dtype).replace("torch.", ""), False)
                for name, b in module.named_buffers()]
    return sig


def describe_module_mismatch(signatures: Sequence[Sequence[tuple[Any, ...]]]) -> str | None:
    """The first difference between rank 0's module and another rank's, or ``None``.

    ``signatures[r]`` lists ``(kind, name, shape, dtype, requires_grad)`` for rank ``r``'s
    parameters (then buffers) in registration order. "First" means the earliest position
    in that order at which some rank differs, and at that position the lowest such rank.
    """
    ref = signatures[0]
    longest = max(len(s) for s in signatures)
    for i in range(longest):
        mine = ref[i] if i < len(ref) else None
        for rank, sig in enumerate(signatures):
            theirs = sig[i] if i < len(sig) else None
            if theirs == mine:
                continue
            if mine is None:
                kind, name, shape, dtype, _ = theirs
                return (f"rank {rank} has {kind} {name!r} (shape {shape}, {dtype}) beyond the "
                        f"{len(ref)} parameters and buffers of rank 0")
            kind, name, shape, dtype, grad = mine
            if theirs is None:
                return (f"{kind} {name!r} (#{i}) exists on rank 0 but rank {rank} has only "
                        f"{len(sig)} parameters and buffers")
            okind, oname, oshape, odtype, ograd = theirs
            if (kind, name) != (okind, oname):
                return f"{kind} #{i} is {name!r} on rank 0 but {okind} {oname!r} on rank {rank}"
            if shape != oshape:
                return (f"{kind} {name!r} has shape {shape} on rank 0 but {oshape} on rank "
                        f"{rank}")
            if dtype != odtype:
                return f"{kind} {name!r} has dtype {dtype} on rank 0 but {odtype} on rank {rank}"
            return (f"{kind} {name!r} has requires_grad={grad} on rank 0 but "
                    f"requires_grad={ograd} on rank {rank}")
    return None


def check_same_module(module: torch.nn.Module, comm: Communicator | None = None, *,
                      buffers: bool = True) -> None:
    """Raise ``ValueError`` on every rank unless all ranks hold the same module layout.

    Compares parameter (and buffer) names, shapes, dtypes and ``requires_grad`` in
    registration order; the message names the first mismatch (see
    :func:`describe_module_mismatch`). Collective. Costs one allgather of a 16-byte digest;
    the full descriptions are gathered only when the digests differ.
    """
    comm = resolve(comm)
    sig = _signature(module, buffers)
    digest = hashlib.blake2b(repr(sig).encode(), digest_size=16).digest()
    if len(set(comm.allgather_object(digest))) == 1:
        return
    problem = describe_module_mismatch(comm.allgather_object(sig))
    raise ValueError(f"the model differs across ranks: {problem}")


def _groups_by_device(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Tensors of one device each, at most ``cap`` bytes per group (any dtypes)."""
    plan = fusion.group([t.numel() * t.element_size() for t in tensors],
                 [t.device for t in tensors], cap, consecutive=False)
    return [[tensors[i] for i in idx] for idx in plan]


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, total


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, root: int = 0, comm: Communicator | None = None,
                     *, buffers: bool = True, chunk_mb: float = 64.0) -> None:
    """Copy ``root``'s parameters (and buffers) into the same module on every rank.

    Call it once before training so that every replica starts from the same weights
    (:class:`GradientSync` does it by default). The tensors are sent as raw bytes, packed
    per device into buffers of at most ``chunk_mb`` megabytes (one broadcast per buffer
    rather than per tensor), so any dtype works, bit for bit. Collective; raises
    ``ValueError`` on every rank first when the modules differ (:func:`check_same_module`).
    Costs about ``model bytes`` of extra memory per chunk and, per chunk, one broadcast of
    ``(⌈lg p⌉ + p - 1)α + 2(p-1)/p·nβ`` with the scatter-allgather algorithm.
    """
    comm = resolve(comm)
    if not 0 <= root < comm.size:
        raise ValueError(f"root must be in [0, {comm.size - 1}], got {root}")
    check_same_module(module, comm, buffers=buffers)
    tensors = [p for _, p in module.named_parameters()]
    if buffers:
        tensors += [b for _, b in module.named_buffers()]
    if comm.size == 1:
        return
    for group in _groups_by_device(tensors, max(1, int(chunk_mb * 2**20))):
        offsets, total = _offsets(group)
        flat = torch.zeros(total, dtype=torch.uint8, device=group[0].device)
        if comm.rank == root:
            for t, off in zip(group, offsets):
                raw = t.detach().reshape(-1).view(torch.uint8)
                flat[off:off + raw.numel()].copy_(raw)
        broadcast(flat, root=root, comm=comm, out=flat)
        if comm.rank != root:
            for t, off in zip(group, offsets):
                n = t.numel() * t.element_size()
                t.copy_(flat[off:off + n].view(t.dtype).view(t.shape))


# ---------------------------------------------------------------------- statistics
@dataclass
class SyncStats:
    """What a :class:`GradientSync` has done so far on this rank.

    ``comm_seconds`` is the time the communication thread spent on buckets (control
    reduction + aggregation + write-back); ``wait_seconds`` the time callers spent blocked
    in :meth:`GradientSync.wait`, i.e. the communication backward did *not* hide.
    ``strategy`` is the strategy's own :class:`~mpicomm.strategies.StrategyStats` (bytes
    sent and received, dense-equivalent bytes, time in ``aggregate``).
    """

    steps: int = 0
    skipped: int = 0
    buckets: int = 0
    comm_seconds: float = 0.0
    wait_seconds: float = 0.0
    strategy: StrategyStats = field(default_factory=StrategyStats)


# ---------------------------------------------------------------------- internals
@dataclass
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    nbytes: int
    cuda_devices: list[torch.device]

    @property
    def label(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        return f"{self.names[0]} .. {self.names[-1]}"


class _Step:
    """The communication state of one synchronized backward pass."""

    def __init__(self, nbuckets: int):
        self.launched = [False] * nbuckets
        self.events: list[list[Any]] = [[] for _ in range(nbuckets)]
        self.finished = False
        self.error: BaseException | None = None
        self.nonfinite: str | None = None


def _make_buckets(named: list[tuple[str, torch.nn.Parameter]], cap: int) -> list[_Bucket]:
    """Buckets of at most ``cap`` bytes in reverse registration order (any dtype or
    device: the strategy fuses each bucket per dtype and device)."""
    order = list(reversed(named))
    plan = fusion.group([p.numel() * p.element_size() for _, p in order], None, cap)
    groups = [[order[i] for i in idx] for idx in plan]
    buckets = []
    for i, group in enumerate(groups):
        devices = sorted({p.device for _, p in group if p.device.type == "cuda"}, key=str)
        buckets.append(_Bucket(i, [p for _, p in group], [n for n, _ in group],
                               sum(p.numel() * p.element_size() for _, p in group), devices))
    return buckets


def _nonfinite(grads: list[torch.Tensor], names: list[str]) -> list[str]:
    """Names of the gradients holding a NaN or an Inf (one host transfer per device)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for n, g in zip(names, grads):
        if g.is_floating_point() or g.is_complex():
            by_device.setdefault(g.device, []).append((n, torch.isfinite(g).all()))
    bad = set()
    for items in by_device.values():
        finite = torch.stack([f for _, f in items]).cpu().tolist()
        bad.update(n for (n, _), ok in zip(items, finite) if not ok)
    return [n for n in names if n in bad]


def _bind_thread_device(buckets: list[_Bucket]) -> torch.device | None:
    """Make the first CUDA device of the model the calling thread's current device.

    A new thread starts on device 0 whatever the model uses, so without this the
    communication thread would open a context on GPU 0 on every rank and its
    device-less calls (``torch.cuda.current_stream()``, allocations) would target GPU 0
    rather than the model's ``cuda:N``. Returns the device, ``None`` for a host model."""
    devices = [d for b in buckets for d in b.cuda_devices]
    if not devices:
        return None
    device = devices[0]
    torch.cuda.set_device(device)
    return device


def _record_events(devices: list[torch.device]) -> list[Any]:
    events = []
    for dev in devices:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        events.append(ev)
    return events


# ---------------------------------------------------------------------- GradientSync
class GradientSync:
    r"""Average a model's gradients across ranks during backward, overlapping the two.

    Construction is collective. It checks that every rank holds the same parameters and
    buffers (names, shapes, dtypes, ``requires_grad``; a mismatch raises ``ValueError`` on
    every rank naming the first one), broadcasts rank 0's parameters and buffers
    (``broadcast=True``), splits the trainable parameters into buckets, duplicates the
    communicator for a background thread and registers two hooks per parameter.

    Use :meth:`step` (or :meth:`wait` then your own ``optimizer.step()``) after every
    ``backward()``; use :meth:`no_sync` for gradient accumulation; :meth:`close` (or a
    ``with`` block) to detach.

    Parameters
    ----------
    model:
        The ``torch.nn.Module`` to synchronize; same architecture on every rank. CPU or
        CUDA parameters (or both).
    strategy:
        How a bucket is averaged: a :class:`~mpicomm.strategies.Strategy` instance, a name
        for :func:`mpicomm.strategies.make`, or ``None`` for
        :class:`~mpicomm.strategies.Dense` (allreduce, exact average). The strategy is
        bound to the private communicator of the communication thread and must not be
        used elsewhere afterwards. Compressing strategies with error feedback key their
        memory by the bucket's parameter names, which stay the same across steps.
    bucket_mb:
        Bucket size cap in megabytes (a larger parameter is a bucket of its own). Smaller
        buckets start communicating earlier in backward and overlap more, but each costs
        at least one collective's latency (α, tens of µs on one host, more across hosts)
        plus one control reduction (see ``on_nonfinite``). The default, 25, is DDP's;
        try 1-5 for models under ~50 MB, and raise it when profiles show many tiny
        collectives. For a compressing strategy a bucket is also the scope of its
        selection (top-k over a bucket, a low-rank factor per bucket's matrix).
    comm:
        The :class:`~mpicomm.Communicator` over the data-parallel ranks (default: world).
    broadcast:
        Copy rank 0's parameters and buffers to every rank at construction (default on).
        Turn it off only when replicas are already identical, e.g. loaded from the same
        checkpoint.
    on_nonfinite:
        Before aggregating each bucket the ranks agree, with one small max-reduction over
        a flag per bucket, whether any rank's bucket holds a NaN or an Inf. ``"raise"``:
        the step's remaining buckets are left alone and :meth:`wait`/:meth:`step` raise
        ``FloatingPointError`` on every rank, naming the bucket and the ranks.
        ``"skip"``: no aggregation, every gradient of the model is zeroed, and
        :meth:`step` returns ``False`` without calling the optimizer, on every rank (for
        mixed-precision loss scaling or rare bad batches). Either way a non-finite value
        never reaches a strategy, so error-feedback residuals stay finite. The same
        reduction also tells which parameters got a gradient on some rank (below); its
        cost is one latency per bucket, negligible next to the bucket's own collective.
    timeline:
        A :class:`~mpicomm.timeline.Timeline` to record into (``True`` makes a new one):
        ``bucket ready`` instants on the autograd thread, one ``aggregate`` span per bucket
        on the communication thread (with bytes and parameter count), and ``wait`` spans
        on the caller's thread. ``None``: the recording of :mod:`mpicomm.trace` active at
        construction (``MPICOMM_TIMELINE``), else a disabled timeline (no cost).
    metrics:
        A :class:`~mpicomm.metrics.Metrics` (or a path for a new one) that gets one record
        per step from :meth:`wait` (bytes, compression, strategy and collective, predicted
        and measured communication time, wait time; ``skipped`` for a skipped step).
        ``None``: one from ``MPICOMM_METRICS`` when that is set, else none (no cost).

    Unused parameters
    -----------------
    A parameter that gets no gradient in a backward (a branch not taken, a frozen head)
    never completes its bucket through the hook. :meth:`wait` therefore launches every
    bucket that is still incomplete, with zeros standing in for the missing gradients, so
    that every rank runs the same collectives in the same order whatever each rank's graph
    looked like. Afterwards a parameter that had a gradient on *some* rank holds the
    average (missing gradients counted as zeros); one whose ``.grad`` is ``None`` on every
    rank keeps ``None``, so optimizers skip it as in a single process. Such a bucket
    starts only at :meth:`wait`, and since buckets are aggregated in order, so do all the
    buckets after it: an unused parameter near the end of ``__init__`` (the front of the
    bucket order) forfeits the overlap. Register rarely used parameters early in
    ``__init__`` (they land in the last buckets), or freeze them with
    ``requires_grad=False`` before constructing this object (frozen parameters get no
    bucket at all).

    Threads and ordering
    --------------------
    The hooks only count and hand buckets over; all communication happens on one thread
    per ``GradientSync``, named ``mpicomm-gradsync``, on ``comm.dup()`` (mpi4py initializes
    MPI with ``MPI_THREAD_MULTIPLE``, so the training thread may keep using ``comm``). It
    aggregates buckets in index order, so ranks never disagree on the order of
    collectives. If MPI provides less than ``MPI_THREAD_MULTIPLE`` (``mpi4py.rc.thread_level``
    set lower, or an MPI library without it), no thread is started: :meth:`wait` then
    aggregates every bucket on the calling thread, in the same order (correct, but with
    no overlap; the ``threaded`` attribute tells which mode is in force).
    A backward that starts while the previous step's communication is
    unfinished (two ``backward()`` calls without :meth:`wait`) first waits for it: a
    pre-accumulation hook on each parameter calls :meth:`wait` before autograd touches a
    gradient the thread may still be writing. The second backward then accumulates onto
    averaged gradients and is averaged again, which for the exact ``Dense`` strategy gives
    the average of the summed gradients, as DDP does; use :meth:`no_sync` to avoid the
    extra communication. An error on the thread is re-raised by :meth:`wait` on the
    calling thread (and, if it stays uncaught, :func:`mpicomm.install_abort_handler` ends
    the job instead of letting the other ranks hang).

    Leaving a ``with`` block by an exception does no collective (another rank may never
    get there): the hooks are removed and the thread is told to stop. A thread that is
    inside a collective the other ranks will not join cannot stop; after
    ``EXIT_JOIN_S`` seconds it is left behind, and when the process exits (before
    ``MPI_Finalize``, which would hang on it) the rank prints why and calls
    ``MPI_Abort``, so the job ends instead of hanging. The private communicator is not
    freed on that path (freeing is collective); :meth:`close` frees it.

    Not supported: sparse gradients (``nn.Embedding(sparse=True)``), and a parameter whose
    gradient is accumulated twice within one backward (reentrant activation checkpointing
    that also uses the parameter outside the checkpoint) - that second accumulation looks
    like a new backward and completes the step early.

    CUDA: the hook records a CUDA event on the current stream of each of the bucket's
    devices, and the communication thread waits for those events before reading the
    gradients (the autograd thread does not stall); the thread synchronizes its own stream
    after writing the averages back, before :meth:`wait` returns.

    Performance: overlap hides communication only where it has resources of its own. With
    GPUs or a real network, backward computes while the NIC and MPI move data. With CPU
    training over shared memory, the communication thread copies and polls on a core, so
    leave one per rank (``torch.set_num_threads(cores_per_rank - 1)``). On an
    oversubscribed host, a synchronized step costs about compute + communication even
    though the two run concurrently (``examples/overlap_bench.py`` measures both).
    ``stats.wait_seconds`` / ``stats.steps`` is the communication that was not hidden.

    Example (gradient accumulation over 4 micro-batches)::

        with GradientSync(model, strategy="dense", bucket_mb=4) as sync:
            for i, (x, y) in enumerate(loader):
                ctx = sync.no_sync() if (i + 1) % 4 else contextlib.nullcontext()
                with ctx:
                    (loss_fn(model(x), y) / 4).backward()
                if (i + 1) % 4 == 0:
                    sync.step(optimizer)
                    optimizer.zero_grad()
    """

    def __init__(self, model: torch.nn.Module, strategy: Strategy | str | None = None,
                 bucket_mb: float = 25.0, comm: Communicator | None = None,
                 broadcast: bool = True, on_nonfinite: str = "raise",
                 timeline: Timeline | bool | None = None, metrics: Any = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) \
                or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        if strategy is None:
            strategy = Dense()
        elif isinstance(strategy, str):
            strategy = make(strategy)
        elif not isinstance(strategy, Strategy):
            raise TypeError("strategy must be an mpicomm Strategy, a strategy name or None, "
                            f"got {type(strategy).__name__}")
        if timeline is None:  # the MPICOMM_TIMELINE / trace.recording() one, if any
            timeline = active_timeline() or Timeline(enabled=False)
        elif timeline is False:
            timeline = Timeline(enabled=False)
        elif timeline is True:
            timeline = Timeline()
        elif not isinstance(timeline, Timeline):
            raise TypeError(f"timeline must be a Timeline, a bool or None, got "
                            f"{type(timeline).__name__}")

        self.comm = resolve(comm)
        self.model = model
        self.on_nonfinite = on_nonfinite
        self.bucket_mb = float(bucket_mb)
        self.timeline = timeline
        self.metrics = metrics_from(metrics)

        # collective set-up: every rank runs these in this order
        check_same_module(model, self.comm, buffers=broadcast)
        if broadcast:
            broadcast_module(model, 0, self.comm)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._buckets = _make_buckets(named, max(1, int(self.bucket_mb * 2**20)))
        #: Whether a background thread communicates (needs ``MPI_THREAD_MULTIPLE``);
        #: otherwise :meth:`wait` aggregates on the calling thread.
        self.threaded = _thread_multiple()
        if not self.threaded:
            log.info("MPI provides less than MPI_THREAD_MULTIPLE: GradientSync aggregates "
                     "in wait() on the calling thread (no overlap with backward)")
        self._tcomm = self.comm.dup()
        self.strategy = strategy.bind(self._tcomm)

        # per-parameter slots, in bucket order
        self._slots: list[torch.nn.Parameter] = [p for b in self._buckets for p in b.params]
        self._bucket_of: list[int] = [b.index for b in self._buckets for _ in b.params]
        self._cond = threading.Condition()
        self._ready = [False] * len(self._slots)
        self._remaining = [len(b.params) for b in self._buckets]
        self._step: _Step | None = None
        self._sync_enabled = True
        self._last_ok = True
        self._closed = False
        self._stopping = False
        self._thread_error: BaseException | None = None
        self._grad_layouts: dict[int, list[tuple[list[int], fusion.Layout]]] = {}
        self._stats = SyncStats(strategy=self.strategy.stats)

        self._handles: list[Any] = []
        for slot, p in enumerate(self._slots):
            self._handles.append(p.register_hook(functools.partial(self._before_grad, slot)))
            self._handles.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._after_grad, slot)))
        self._thread: threading.Thread | None = None
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="mpicomm-gradsync",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public API
    def __repr__(self) -> str:
        return (f"GradientSync(strategy={self.strategy.name!r}, buckets={len(self._buckets)}, "
                f"bucket_mb={self.bucket_mb}, ranks={self.comm.size}, "
                f"on_nonfinite={self.on_nonfinite!r}{', closed' if self._closed else ''})")

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are aggregated."""
        return [list(b.names) for b in self._buckets]

    @property
    def stats(self) -> SyncStats:
        """Counters and times of this rank (see :class:`SyncStats`); live, not a copy."""
        return self._stats

    def wait(self) -> bool:
        """Block until every bucket of the current backward is averaged into ``.grad``.

        Buckets still incomplete (parameters without a gradient on this rank) are launched
        now with zeros for the missing gradients. Re-raises an error of the
        communication thread, and raises ``FloatingPointError`` on every rank when a
        bucket held a NaN/Inf and ``on_nonfinite="raise"``. Returns ``True`` when the
        gradients are averaged and may be applied, ``False`` when the step was skipped
        (``on_nonfinite="skip"``; the gradients are then zero). Without a synchronized
        backward since the last call it returns the previous result at once.
        """
        self._check_open()
        with self._cond:
            step = self._step
        if step is None:
            return self._last_ok
        start = time.perf_counter()
        with self.timeline.span("wait", cat="wait"):
            for b, bucket in enumerate(self._buckets):
                if not step.launched[b]:
                    self.timeline.instant(f"bucket {b} ready", cat="bucket", bucket=b,
                                          at="wait")
                    self._launch(step, b, _record_events(bucket.cuda_devices))
            if self._thread is None:  # no MPI_THREAD_MULTIPLE: communicate here, in order
                for b in range(len(self._buckets)):
                    self._process(step, b)
                step.finished = True
            with self._cond:
                while not step.finished:
                    if self._thread is None or not self._thread.is_alive():
                        raise RuntimeError("the gradient communication thread has stopped")
                    self._cond.wait(1.0)
                self._step = None
                self._ready = [False] * len(self._slots)
                self._remaining = [len(b.params) for b in self._buckets]
        self._stats.wait_seconds += time.perf_counter() - start
        ok = self._conclude(step)
        if self.metrics is not None:
            self.metrics.observe(self, skipped=not ok)
        return ok

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """:meth:`wait`, then ``optimizer.step()`` unless the step was skipped.

        Returns ``True`` when the optimizer stepped, ``False`` when a non-finite gradient
        made every rank skip the step (``on_nonfinite="skip"``).
        """
        if not self.wait():
            return False
        optimizer.step()
        self.strategy.step_done(self.model, optimizer)  # adaptive strategies decide here
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block backward only accumulates local gradients (no communication).

        The next backward outside the block averages the accumulated gradients, so ``k``
        micro-batches (``k-1`` inside, the last outside) cost one synchronization. Every
        rank must use the same pattern. Scale each micro-batch's loss by ``1/k`` to get the
        gradient of the mean over all ``k`` micro-batches.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def close(self) -> None:
        """Finish an in-flight step, stop the thread, remove the hooks (collective).

        Afterwards backward produces plain local gradients again. Idempotent.
        """
        if self._closed:
            return
        try:
            if self._step is not None:
                self.wait()
        finally:
            self._shutdown(free=True)

    def __enter__(self) -> GradientSync:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # another rank may not be here: do no collective, leave the comm be
            self._shutdown(free=False)

    # ------------------------------------------------------------------ hooks
    def _before_grad(self, slot: int, grad: torch.Tensor) -> None:
        # Runs before autograd accumulates into param.grad. A parameter already counted in
        # the unfinished step means a new backward: finish the previous step first, so
        # that autograd never writes a gradient the communication thread is using.
        if self._ready[slot] and not self._closed:
            self.wait()

    def _after_grad(self, slot: int, param: torch.Tensor) -> None:
        if not self._sync_enabled or self._closed:
            return
        with self._cond:
            if self._ready[slot]:  # pragma: no cover - _before_grad makes this impossible
                raise RuntimeError("a gradient was accumulated twice in one step")
            step = self._step
            if step is None:
                step = self._step = _Step(len(self._buckets))
                self._cond.notify_all()
            self._ready[slot] = True
            b = self._bucket_of[slot]
            self._remaining[b] -= 1
            complete = self._remaining[b] == 0
        if complete:
            self.timeline.instant(f"bucket {b} ready", cat="bucket", bucket=b, at="hook")
            self._launch(step, b, _record_events(self._buckets[b].cuda_devices))

    def _launch(self, step: _Step, b: int, events: list[Any]) -> None:
        with self._cond:
            step.events[b] = events
            step.launched[b] = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            _bind_thread_device(self._buckets)
        except BaseException as exc:  # reported by the first wait(), like any thread error
            self._thread_error = exc
        while True:
            with self._cond:
                while not self._stopping and (self._step is None or self._step.finished):
                    self._cond.wait()
                if self._stopping:
                    return
                step = self._step
            for b in range(len(self._buckets)):
                with self._cond:
                    while not step.launched[b] and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                self._process(step, b)
            with self._cond:
                step.finished = True
                self._cond.notify_all()

    def _process(self, step: _Step, b: int) -> None:
        bucket = self._buckets[b]
        if self._thread_error is not None and step.error is None:
            step.error = self._thread_error
        # Once a bucket was non-finite every rank knows it (the flag was reduced), so all
        # of them skip the rest identically. After a local error, skipping lets wait()
        # raise it promptly; the other ranks then end with the abort handler.
        if step.error is not None or step.nonfinite is not None:
            return
        start = time.perf_counter()
        try:
            for ev in step.events[b]:
                ev.synchronize()
            with self.timeline.span(f"aggregate bucket {b}", cat="comm", bucket=b,
                                    params=len(bucket.params), bytes=bucket.nbytes):
                self._aggregate(step, bucket)
        except BaseException as exc:  # re-raised by wait() on the caller's thread
            step.error = exc
            return
        self._stats.buckets += 1
        self._stats.comm_seconds += time.perf_counter() - start

    def _aggregate(self, step: _Step, bucket: _Bucket) -> None:
        grads, present = [], []
        for p in bucket.params:
            g = p.grad
            if g is not None and g.layout != torch.strided:
                raise TypeError(f"parameter {bucket.names[len(grads)]!r} has a {g.layout} "
                                "gradient; GradientSync supports dense gradients only")
            present.append(g is not None)
            grads.append(g.detach() if g is not None
                         else torch.zeros_like(p, memory_format=torch.contiguous_format))
        bad = _nonfinite(grads, bucket.names)
        flags = np.array([1 if bad else 0, *present], dtype=np.uint8)
        agreed = allreduce(flags, op="max", algorithm="mpi", comm=self._tcomm)
        if agreed[0]:
            ranks = [r for r, f in enumerate(self._tcomm.allgather_object(bool(bad))) if f]
            here = f"; on rank {self.comm.rank}: {', '.join(bad)}" if bad else ""
            step.nonfinite = (f"non-finite gradient (NaN or Inf) in bucket {bucket.index} "
                              f"[{bucket.label}] on rank(s) {ranks}{here}")
            return
        # In place, with no copy where possible: the gradients live in the bucket's
        # persistent flat buffers (copied there once if autograd made a fresh tensor), the
        # strategy aggregates that memory in place, and .grad stays a view of it.
        views = self._bucket_views(bucket, grads)
        self.strategy.aggregate_into(views, bucket.names)
        for p, view, used in zip(bucket.params, views, agreed[1:]):
            if used and p.grad is not view:
                p.grad = view
            # no rank has a gradient: keep None, as a single process would
        for dev in bucket.cuda_devices:
            torch.cuda.current_stream(dev).synchronize()

    # ------------------------------------------------------------------ helpers
    def _bucket_views(self, bucket: _Bucket, grads: list[torch.Tensor]
                      ) -> list[torch.Tensor]:
        """``grads`` as views of the bucket's persistent flat buffers (one per run of
        same-dtype, same-device parameters), copying only those that are not views yet.

        Like DDP's ``gradient_as_bucket_view``: after the first step ``.grad`` *is* the
        view, so with ``zero_grad(set_to_none=False)`` autograd accumulates straight into
        the buffer and the step copies nothing; with ``set_to_none=True`` (PyTorch's
        default) each gradient is copied in once. Costs one persistent copy of the
        trainable parameters' size."""
        layouts = self._grad_layouts.get(bucket.index)
        if layouts is not None and not all(layout.matches([grads[i] for i in idx])
                                           for idx, layout in layouts):
            layouts = None  # a gradient changed dtype or device: lay the bucket out anew
        if layouts is None:
            plan = fusion.group([g.numel() * g.element_size() for g in grads],
                                [fusion.kind_of(g) for g in grads], None, consecutive=True)
            layouts = [(idx, fusion.Layout([tuple(grads[i].shape) for i in idx],
                                           grads[idx[0]].dtype, grads[idx[0]].device))
                       for idx in plan]
            self._grad_layouts[bucket.index] = layouts
        views = list(grads)
        with torch.no_grad():
            for idx, layout in layouts:
                for i, view in zip(idx, layout.views()):
                    if grads[i].data_ptr() != view.data_ptr():
                        view.copy_(grads[i])
                    views[i] = view
        return views

    def _conclude(self, step: _Step) -> bool:
        if step.error is not None:
            self._last_ok = False
            raise step.error
        if step.nonfinite is not None:
            self._last_ok = False
            if self.on_nonfinite == "raise":
                raise FloatingPointError(
                    f"{step.nonfinite}; the gradients were not averaged (zero them before "
                    "the next backward)")
            with torch.no_grad():
                for p in self._slots:
                    if p.grad is not None:
                        p.grad.zero_()
            self._stats.skipped += 1
            log.warning("rank %d: skipped an optimizer step: %s", self.comm.rank,
                        step.nonfinite)
            return False
        self._last_ok = True
        self._stats.steps += 1
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this GradientSync is closed")

    def _shutdown(self, free: bool) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with self._cond:
            self._closed = True
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=None if free else EXIT_JOIN_S)
            if thread.is_alive():  # stuck in a collective that other ranks left
                _abort_at_exit_if_alive(thread)
                return
        if free:
            self._tcomm.free()


#: Seconds :meth:`GradientSync.__exit__` waits for the thread after an exception.
EXIT_JOIN_S = 2.0


def _thread_multiple() -> bool:
    """Whether MPI may be called from several threads at once."""
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def _abort_at_exit_if_alive(thread: threading.Thread) -> None:
    """At interpreter exit (before mpi4py's ``MPI_Finalize``), abort the job if ``thread``
    is still inside MPI: finalizing under it would hang or crash."""
    import atexit

    def guard() -> None:
        thread.join(timeout=1.0)
        if not thread.is_alive():
            return
        from ..abort import abort_job

        abort_job("GradientSync's communication thread is still inside an MPI collective "
                  "that the other ranks left (its with block ended with an exception); "
                  "calling MPI_Abort so that MPI_Finalize cannot hang")

    atexit.register(guard)
