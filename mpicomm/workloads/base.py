"""What a workload is: a model, this rank's shard of the training data, an evaluation that
every rank calls, and the facts a benchmark reports (:class:`Info`).

Sharding (:class:`ArrayShard`): every epoch the ``n`` training examples are permuted with
a generator seeded by ``(seed, epoch)``, the same on every rank, and rank ``r`` of ``P``
takes the block ``perm[r*m:(r+1)*m]`` with ``m = n // P``; the shards of one epoch are
disjoint and equal, and the last ``n mod P`` examples of each permutation sit the epoch
out. Each rank takes ``m // batch`` full batches per epoch (the same count on every
rank, so collective steps stay matched).

Evaluation (:func:`sums_over_ranks`): rank ``r`` evaluates examples ``r, r+P, ...`` of the
held-out set and one allreduce of (loss sum, hits, count) gives every rank the same
figures; cost ``1/P`` of a forward pass over the set plus one small allreduce.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class WorkloadError(ValueError):
    """A request no rank can train: an unknown workload or option, a batch larger than a
    shard, more ranks than the data has examples for. Raised identically on every rank
    (it depends only on the arguments), before any communication."""


class MissingPackageError(ImportError):
    """A workload needs a package that is not installed (the message names the pip
    command)."""


def require(module: str, workload: str, extra: str = "workloads") -> Any:
    """Import ``module`` or raise :class:`MissingPackageError` with one clear message."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        raise MissingPackageError(
            f"workload {workload!r} needs the package {package!r} ({exc}); install it with "
            f"`pip install {package}` or `pip install \"mpicomm[{extra}]\"`") from None


@dataclass(frozen=True)
class Info:
    """Facts about one built workload (all JSON-serializable)."""

    name: str
    description: str
    parameters: int              # trainable parameters of the model
    embedding_parameters: int    # of which in embedding / output layers (0 if none)
    train_examples: int          # whole training set (all ranks)
    eval_examples: int           # held-out set
    batch: int                   # per rank
    steps_per_epoch: int         # per rank, the same on every rank
    metric: str                  # "accuracy", "perplexity" or "loss"
    direction: str               # "max" or "min": which way the metric improves
    timing_only: bool            # True when the metric means nothing (random data)
    flops_per_step: float        # per rank: 6 x forward multiply-adds (step_flops)
    defaults: dict[str, float]   # optimizer recipe: lr, momentum, weight_decay, epochs
    data: dict[str, Any] = field(default_factory=dict)     # where the data came from
    options: dict[str, Any] = field(default_factory=dict)  # resolved workload options

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)

    def better(self, a: float, b: float) -> bool:
        """Whether metric value ``a`` is at least as good as ``b``."""
        return a >= b if self.direction == "max" else a <= b


class Shard(ABC):
    """This rank's training batches, epoch by epoch (see the module docstring)."""

    steps_per_epoch: int

    @abstractmethod
    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(inputs, targets)`` batches of ``epoch`` on this rank."""

    @abstractmethod
    def __len__(self) -> int:
        """Training examples on this rank."""


class ArrayShard(Shard):
    """A block of a per-epoch permutation of in-memory arrays (module docstring)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, *, rank: int, size: int,
                 seed: int, batch: int, name: str) -> None:
        n = len(targets)
        check_shardable(name, n, size, batch)
        self.inputs, self.targets = inputs, targets
        self.rank, self.size, self.seed, self.batch = rank, size, seed, batch
        self.per_rank = n // size
        self.steps_per_epoch = self.per_rank // batch

    def __len__(self) -> int:
        return self.per_rank

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's examples in ``epoch`` (a block of the epoch's shared permutation)."""
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.targets))
        m = self.per_rank
        return torch.from_numpy(perm[self.rank * m:(self.rank + 1) * m])

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.indices(epoch)
        for s in range(self.steps_per_epoch):
            b = idx[s * self.batch:(s + 1) * self.batch]
            yield self.inputs[b], self.targets[b]


def check_shardable(name: str, examples: int, size: int, batch: int) -> None:
    """:class:`WorkloadError` when a rank would get no data or less than one batch."""
    if examples < size:
        raise WorkloadError(f"workload {name!r}: {size} ranks but only {examples} training "
                            "examples: a rank would get no data; use fewer ranks")
    per_rank = examples // size
    if batch > per_rank:
        raise WorkloadError(f"workload {name!r}: batch {batch} is larger than a rank's "
                            f"shard ({examples} examples / {size} ranks = {per_rank}); "
                            "use a batch <= the shard or fewer ranks")


def sums_over_ranks(values: list[float], comm: Any) -> list[float]:
    """Element-wise sum of ``values`` over the ranks of ``comm`` (``None``: this rank)."""
    if comm is None or comm.size == 1:
        return list(values)
    everyone = comm.allgather_object([float(v) for v in values])
    return [float(sum(col)) for col in zip(*everyone)]


def my_slice(n: int, comm: Any) -> slice:
    """The held-out examples this rank evaluates: ``r, r+P, ...`` (all without ``comm``)."""
    if comm is None:
        return slice(0, n)
    return slice(comm.rank, n, comm.size)


@torch.no_grad()
def classification_eval(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, comm: Any,
                        chunk: int = 4096) -> dict[str, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``, split over the ranks."""
    mine = my_slice(len(y), comm)
    xs, ys = x[mine], y[mine]
    loss = hits = 0.0
    was_training = model.training
    model.eval()
    for i in range(0, len(ys), chunk):
        out = model(xs[i:i + chunk])
        loss += float(torch.nn.functional.cross_entropy(out, ys[i:i + chunk], reduction="sum"))
        hits += float((out.argmax(1) == ys[i:i + chunk]).sum())
    model.train(was_training)
    loss, hits, count = sums_over_ranks([loss, hits, len(ys)], comm)
    return {"loss": loss / count, "accuracy": hits / count}


def cross_entropy(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, float, int]:
    """Mean cross-entropy of ``model`` on one batch (logits over the last dimension), the
    number of top-1 hits and of predictions (running training accuracy for free)."""
    x, y = batch
    out = model(x)
    flat = out.reshape(-1, out.shape[-1])
    target = y.reshape(-1)
    hits = float((flat.detach().argmax(1) == target).sum())
    return torch.nn.functional.cross_entropy(flat, target), hits, target.numel()


@torch.no_grad()
def step_flops(model: torch.nn.Module, inputs: torch.Tensor) -> float:
    """Floating-point operations of one training step on ``inputs``: ``6 * MACs`` of the
    forward pass (2 per multiply-add forward, 4 backward), counting ``Linear``, ``Conv1d``
    / ``Conv2d`` and ``LSTM`` layers (elementwise work and lookups left out). A cost model
    for compute (the virtual clock), not a measurement."""
    macs = 0.0

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        nonlocal macs
        if isinstance(module, torch.nn.Linear):
            macs += out.numel() * module.in_features
        elif isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)):
            k = int(np.prod(module.kernel_size)) * module.in_channels // module.groups
            macs += out.numel() * k
        elif isinstance(module, torch.nn.LSTM):
            seq = out[0]
            h = module.hidden_size
            macs += seq.shape[0] * seq.shape[1] * 4 * h * (module.input_size + h)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d,
                                 torch.nn.LSTM))]
    try:
        model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return 6.0 * macs


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@dataclass
class Workload:
    """One training task, built for one rank.

    ``model``: the initial model (identical on every rank for the same seed); ``shard``:
    this rank's batches (``shard.batches(epoch)``); ``loss(model, batch)``: ``(mean
    training loss of the batch, top-1 hits, predictions)``; ``evaluate(model, comm,
        split="test")``: ``{"loss": ..., metric: ...}`` on the held-out set
    (``split="train"``: on the training set), collective over
    ``comm`` (``None``: this rank alone evaluates the whole set); ``info``: sizes, metric
    and direction, optimizer defaults, data provenance.
    """

    name: str
    model: torch.nn.Module
    shard: Shard
    loss: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, float, int]]
    evaluator: Callable[[torch.nn.Module, Any, str], dict[str, float]]
    info: Info

    def evaluate(self, model: torch.nn.Module | None = None, comm: Any = None,
                 split: str = "test") -> dict[str, float]:
        if split not in ("test", "train"):
            raise ValueError(f"split must be 'test' or 'train', got {split!r}")
        return self.evaluator(self.model if model is None else model, comm, split)
