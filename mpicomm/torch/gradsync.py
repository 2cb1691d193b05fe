"""Average gradients during ``loss.backward()``: buckets, a communication thread, overlap.

``GradientSync`` attaches to a ``torch.nn.Module`` and turns any training loop into a
synchronous data-parallel one::

    comm = mpicomm.init()
    sync = GradientSync(model, comm=comm)         # checks + broadcasts rank 0's weights
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()            # buckets are averaged while this runs
        sync.step(optimizer)                       # = sync.wait(); optimizer.step()

How a step flows
----------------
Parameters that require a gradient are grouped into *buckets* of about ``bucket_mb``
megabytes, in reverse registration order (backward produces gradients roughly from the
last layer to the first; see ``mpicomm.torch.buckets``). A post-accumulate-grad hook on
every parameter counts the gradients of its bucket; when a bucket is complete it is
handed to a background *communication thread*, which averages it in place with
``strategy.aggregate_into`` on a private duplicate of the communicator. The gradients of
a bucket live in persistent flat buffers (``param.grad`` becomes a view of them after the
first step, as with DDP's ``gradient_as_bucket_view``), so a dense strategy reduces that
memory directly, without fusion copies or fresh allocations; the thread makes the
model's CUDA device its current one (``mpicomm.torch.comm_thread``). The thread takes
buckets strictly in index order (a bucket that is ready early waits for the earlier
ones), so every rank issues the same collectives in the same order, and the
communication of the last layers runs while backward is still computing the first ones.
``GradientSync.wait`` blocks until every bucket of the step is done.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import clock
from ..comm import Communicator, resolve
from ..observe.metrics import metrics_from, scalar
from ..observe.timeline import Timeline
from ..observe.trace import active as active_timeline
from ..strategies import Strategy, StrategyStats
from . import comm_thread
from .bucket_pipeline import BucketPipeline, Step
from .buckets import make_buckets
from .replicas import broadcast_module, check_same_module
from .strategy_options import build_strategy, keyword_names

__all__ = ["GradientSync", "SyncStats"]

log = logging.getLogger("mpicomm.torch")


@dataclass
class SyncStats:
    """What a ``GradientSync`` has done so far on this rank.

    ``comm_seconds`` is the time the communication thread spent on buckets (control
    reduction + aggregation + write-back); ``wait_seconds`` the time callers spent blocked
    in ``GradientSync.wait``, i.e. the communication backward did *not* hide.
    ``strategy`` is the strategy's own ``mpicomm.strategies.StrategyStats`` (bytes sent
    and received, dense-equivalent bytes, time in ``aggregate``).
    """

    steps: int = 0
    skipped: int = 0
    buckets: int = 0
    comm_seconds: float = 0.0
    wait_seconds: float = 0.0
    strategy: StrategyStats = field(default_factory=StrategyStats)


class GradientSync:
    r"""Average a model's gradients across ranks during backward, overlapping the two.

    Construction is collective. It checks that every rank holds the same parameters and
    buffers (names, shapes, dtypes, ``requires_grad``; a mismatch raises ``ValueError`` on
    every rank naming the first one), broadcasts rank 0's parameters and buffers
    (``broadcast=True``), splits the trainable parameters into buckets, duplicates the
    communicator for a background thread and registers two hooks per parameter.

    Use ``step`` (or ``wait`` then your own ``optimizer.step()``) after every
    ``backward()``; use ``no_sync`` for gradient accumulation; ``close`` (or a
    ``with`` block) to detach.

    Parameters
    ----------
    model:
        The ``torch.nn.Module`` to synchronize; same architecture on every rank. CPU or
        CUDA parameters (or both).
    strategy:
        How a bucket is averaged: a ``mpicomm.strategies.Strategy`` instance, ``None``
        for ``"dense"``, or one of these names (``mpicomm.strategies.available()``), with
        its options as further keywords (``strategy="gtopk", density=0.05``):

        ===========  ==========================================  =====================
        name         per bucket                                  main options
        ===========  ==========================================  =====================
        dense        allreduce: the exact average                algorithm
        topk         EF + top-k + sparse allgather               density or k
        gtopk        EF + global top-k (butterfly merge)         density or k
        artopk       EF + one rank's top-k indices, allreduce    density or k, source
                     of the k values
        randomk      EF + shared random indices, allreduce       density or k, seed
        qsgd         stochastic quantization + allgather         bits, bucket_size
        powersgd     EF + rank-r factors per matrix, allreduce   rank, start_iter
        fp16         cast to float16, allreduce, cast back       algorithm
        bf16         cast to bfloat16, allreduce, cast back      algorithm
        sign         EF + scaled sign + allgather                (none needed)
        hier_topk    EF + dense sum inside hosts, top-k, then    density or k, sliced
                     Allgather Top-k across hosts only
        hier_gtopk   the same with gTop-k across hosts           density or k, sliced
        hier_artopk  the same with AR-Top-k across hosts         density or k, sliced
        auto         the cheapest of dense and the compressors   ratios, schemes
                     at an adaptive ratio, per bucket
        ===========  ==========================================  =====================

        EF: error feedback (what was not sent is added to the next step's gradient).
        The strategies with EF (and qsgd) also take ``error_feedback``, ``schedule``
        (a density warm-up), ``momentum_correction`` and ``clip_norm``. By name, topk,
        gtopk and artopk build their measured recipe (``mpicomm.strategies.recipe``:
        plain error feedback with the optimizer's momentum, gTop-k's and AR-Top-k's
        density ramps; Top-k below density 0.003 ``momentum_correction="optimizer"``,
        where ``step(optimizer)`` moves an SGD optimizer's momentum into the memory at
        the first step, DGC's momentum correction; docs/compression.md); every strategy
        takes ``fusion_bytes``. Each class's docstring
        (``help(mpicomm.strategies.GTopK)``) gives its cost in bytes and tuning advice.
        A keyword that neither this class nor the strategy takes raises ``TypeError``
        before any communication. The strategy is bound to the private
        communicator of the communication thread and must not be used elsewhere
        afterwards. Compressing strategies with error feedback key their memory by the
        bucket's parameter names, which stay the same across steps.
    bucket_mb:
        Bucket size cap in megabytes (a larger parameter is a bucket of its own). Smaller
        buckets start communicating earlier in backward and overlap more, but each costs
        at least one collective's latency (α, tens of µs on one host, more across hosts)
        plus one control reduction (see ``on_nonfinite``). The default, 25, is DDP's;
        try 1-5 for models under ~50 MB, and raise it when profiles show many tiny
        collectives. For a compressing strategy a bucket is also the scope of its
        selection (top-k over a bucket, a low-rank factor per bucket's matrix).
    comm:
        The ``mpicomm.Communicator`` over the data-parallel ranks (default: world).
    broadcast:
        Copy rank 0's parameters and buffers to every rank at construction (default on).
        Turn it off only when replicas are already identical, e.g. loaded from the same
        checkpoint.
    on_nonfinite:
        Before aggregating each bucket the ranks agree, with one small max-reduction over
        a flag per bucket, whether any rank's bucket holds a NaN or an Inf. ``"raise"``:
        the step's remaining buckets are left alone and ``wait``/``step`` raise
        ``FloatingPointError`` on every rank, naming the bucket and the ranks.
        ``"skip"``: no aggregation, every gradient of the model is zeroed, and
        ``step`` returns ``False`` without calling the optimizer, on every rank (for
        mixed-precision loss scaling or rare bad batches). Either way a non-finite value
        never reaches a strategy, so error-feedback residuals stay finite. The same
        reduction also tells which parameters got a gradient on some rank (below); its
        cost is one latency per bucket, negligible next to the bucket's own collective.
    timeline:
        A ``mpicomm.observe.timeline.Timeline`` to record into (``True`` makes a new one):
        ``bucket ready`` instants on the autograd thread, one ``aggregate`` span per bucket
        on the communication thread (with bytes and parameter count), and ``wait`` spans
        on the caller's thread. ``None``: the recording of ``mpicomm.observe.trace`` active at
        construction (``MPICOMM_TIMELINE``), else a disabled timeline (no cost).
    metrics:
        A ``mpicomm.observe.metrics.Metrics`` (or a path for a new one) that gets one record
        per step from ``wait`` (bytes, compression, strategy and collective, predicted
        and measured communication time, wait time; ``skipped`` for a skipped step).
        ``None``: one from ``MPICOMM_METRICS`` when that is set, else none (no cost).
    **strategy_options:
        Options of the strategy named by ``strategy`` (see the table above).

    Unused parameters
    -----------------
    A parameter that gets no gradient in a backward (a branch not taken, a frozen head)
    never completes its bucket through the hook. ``wait`` therefore launches every
    bucket that is still incomplete, with zeros standing in for the missing gradients, so
    that every rank runs the same collectives in the same order whatever each rank's graph
    looked like. Afterwards a parameter that had a gradient on *some* rank holds the
    average (missing gradients counted as zeros); one whose ``.grad`` is ``None`` on every
    rank keeps ``None``, so optimizers skip it as in a single process. Such a bucket
    starts only at ``wait``, and since buckets are aggregated in order, so do all the
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
    set lower, or an MPI library without it), no thread is started: ``wait`` then
    aggregates every bucket on the calling thread, in the same order (correct, but with
    no overlap; the ``threaded`` attribute tells which mode is in force).
    A backward that starts while the previous step's communication is
    unfinished (two ``backward()`` calls without ``wait``) first waits for it: a
    pre-accumulation hook on each parameter calls ``wait`` before autograd touches a
    gradient the thread may still be writing. The second backward then accumulates onto
    averaged gradients and is averaged again, which for the exact ``Dense`` strategy gives
    the average of the summed gradients, as DDP does; use ``no_sync`` to avoid the
    extra communication. An error on the thread is re-raised by ``wait`` on the
    calling thread (and, if it stays uncaught, ``mpicomm.install_abort_handler`` ends
    the job instead of letting the other ranks hang).

    Leaving a ``with`` block by an exception does no collective (another rank may never
    get there): the hooks are removed and the thread is told to stop. A thread that is
    inside a collective the other ranks will not join cannot stop; after
    ``mpicomm.torch.comm_thread.EXIT_JOIN_S`` seconds it is left behind, and when the
    process exits (before ``MPI_Finalize``, which would hang on it) the rank prints why
    and calls ``MPI_Abort``, so the job ends instead of hanging. The private communicator is not
    freed on that path (freeing is collective); ``close`` frees it.

    Not supported: sparse gradients (``nn.Embedding(sparse=True)``), and a parameter whose
    gradient is accumulated twice within one backward (reentrant activation checkpointing
    that also uses the parameter outside the checkpoint) - that second accumulation looks
    like a new backward and completes the step early.

    CUDA: the hook records a CUDA event on the current stream of each of the bucket's
    devices, and the communication thread waits for those events before reading the
    gradients (the autograd thread does not stall); the thread synchronizes its own stream
    after writing the averages back, before ``wait`` returns.

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
                 timeline: Timeline | bool | None = None, metrics: Any = None,
                 **strategy_options: Any):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) \
                or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        strategy = build_strategy(strategy, strategy_options, owner="GradientSync",
                                  owner_options=OPTIONS)
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
        self._buckets = make_buckets(named, max(1, int(self.bucket_mb * 2**20)))
        #: Whether a background thread communicates (needs ``MPI_THREAD_MULTIPLE``);
        #: otherwise ``wait`` aggregates on the calling thread.
        self.threaded = comm_thread.thread_multiple()
        if not self.threaded:
            log.info("MPI provides less than MPI_THREAD_MULTIPLE: GradientSync aggregates "
                     "in wait() on the calling thread (no overlap with backward)")
        self._tcomm = self.comm.dup()
        self.strategy = strategy.bind(self._tcomm)
        self._stats = SyncStats(strategy=self.strategy.stats)
        self._sync_enabled = True
        self._last_ok = True
        self._closed = False
        self._pipeline = BucketPipeline(self._buckets, self.strategy, self._tcomm,
                                        self.timeline, self._stats, threaded=self.threaded)
        self._handles: list[Any] = []
        for slot, p in enumerate(self._pipeline.slots):
            self._handles.append(p.register_hook(functools.partial(self._before_grad, slot)))
            self._handles.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._after_grad, slot)))

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
        """Counters and times of this rank (see ``SyncStats``); live, not a copy."""
        return self._stats

    def wait(self, *, loss: Any = None) -> bool:
        """Block until every bucket of the current backward is averaged into ``.grad``.

        ``loss`` (a number or a one-element tensor, this rank's): put into the step's
        metrics record when metrics are on (``metrics=`` or ``MPICOMM_METRICS``), so
        that the plots have a loss curve; ignored otherwise.

        Buckets still incomplete (parameters without a gradient on this rank) are launched
        now with zeros for the missing gradients. Re-raises an error of the
        communication thread, and raises ``FloatingPointError`` on every rank when a
        bucket held a NaN/Inf and ``on_nonfinite="raise"``. Returns ``True`` when the
        gradients are averaged and may be applied, ``False`` when the step was skipped
        (``on_nonfinite="skip"``; the gradients are then zero). Without a synchronized
        backward since the last call it returns the previous result at once.
        """
        self._check_open()
        if self._pipeline.step is None:
            return self._last_ok
        start = clock.now()
        with self.timeline.span("wait", cat="wait"):
            step = self._pipeline.finish()
        if step is None:
            return self._last_ok
        self._stats.wait_seconds += clock.now() - start
        ok = self._conclude(step)
        if self.metrics is not None:
            extra = {} if loss is None else {"loss": scalar(loss)}
            self.metrics.observe(self, skipped=not ok, **extra)
        return ok

    def step(self, optimizer: torch.optim.Optimizer, *, loss: Any = None) -> bool:
        """``wait(loss=loss)``, then ``optimizer.step()`` unless the step was skipped.

        Returns ``True`` when the optimizer stepped, ``False`` when a non-finite gradient
        made every rank skip the step (``on_nonfinite="skip"``).
        """
        if not self.wait(loss=loss):
            return False
        optimizer.step()
        self.strategy.step_done(self.model, optimizer)  # adaptive strategies decide here
        return True

    def state_dict(self) -> dict[str, Any]:
        """This rank's synchronization state between steps: the strategy's
        (``Strategy.state_dict``: error-feedback residuals, warm starts, step
        counters, adaptive controllers) and the step counters. The model and the
        optimizer are checkpointed on their own (``mpicomm.checkpoint.Checkpointer``)."""
        self._check_open()
        if self._pipeline.step is not None:
            raise RuntimeError("GradientSync.state_dict in the middle of a step: call it "
                               "after step() / wait()")
        return {"strategy": self.strategy.name, "strategy_state": self.strategy.state_dict(),
                "steps": self._stats.steps, "skipped": self._stats.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s output (same strategy kind, else ``ValueError``)."""
        self._check_open()
        if state.get("strategy") != self.strategy.name:
            raise ValueError(f"GradientSync.load_state_dict: the state is of strategy "
                             f"{state.get('strategy')!r}, this one runs "
                             f"{self.strategy.name!r}")
        self.strategy.load_state_dict(state["strategy_state"])
        self._stats.steps = int(state.get("steps", 0))
        self._stats.skipped = int(state.get("skipped", 0))

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
            if self._pipeline.step is not None:
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

    @property
    def _thread(self) -> threading.Thread | None:
        """The communication thread (``None`` without ``MPI_THREAD_MULTIPLE``)."""
        return self._pipeline.thread

    # ------------------------------------------------------------------ hooks
    def _before_grad(self, slot: int, grad: torch.Tensor) -> None:
        # Runs before autograd accumulates into param.grad. A parameter already counted in
        # the unfinished step means a new backward: finish the previous step first, so
        # that autograd never writes a gradient the communication thread is using.
        if self._pipeline.counted(slot) and not self._closed:
            self.wait()

    def _after_grad(self, slot: int, param: torch.Tensor) -> None:
        if self._sync_enabled and not self._closed:
            self._pipeline.grad_ready(slot)

    def _conclude(self, step: Step) -> bool:
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
                for p in self._pipeline.slots:
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
        self._closed = True
        if not self._pipeline.stop(None if free else comm_thread.EXIT_JOIN_S):
            # stuck in a collective that the other ranks left
            comm_thread.abort_at_exit_if_alive(self._pipeline.thread)
            return
        if free:
            self._tcomm.free()


#: The keywords ``GradientSync`` takes itself; any other keyword is a strategy option.
OPTIONS: tuple[str, ...] = keyword_names(GradientSync.__init__, ("model", "strategy"))
