"""Gradient buckets of ``GradientSync``: grouping, persistent storage, averaging one bucket.

A bucket is a run of trainable parameters, in reverse registration order (backward
produces gradients roughly from the last layer to the first), of at most ``cap`` bytes
(a larger parameter is a bucket of its own). ``make_buckets`` cuts them;
``aggregate_bucket`` averages one bucket's gradients across ranks in place:

1. one max-allreduce of ``1 + len(bucket)`` bytes on which every rank agrees whether
   any rank's bucket holds a NaN or an Inf, and which parameters got a gradient on some
   rank (``α`` plus a few bytes: negligible next to the bucket's own collective);
2. the gradients are laid out in the bucket's persistent flat buffers
   (``bucket_views``), one per run of same-dtype, same-device parameters, so that
   ``param.grad`` is a view of them after the first step, like DDP's
   ``gradient_as_bucket_view``; the strategy then averages that memory in place
   (``strategy.aggregate_into``), without fusion copies or fresh allocations.

Memory: one persistent copy of the trainable parameters' size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import fusion
from ..collectives import allreduce
from ..comm import Communicator
from ..strategies import Strategy

__all__ = ["Bucket", "make_buckets", "nonfinite_names", "bucket_views", "aggregate_bucket"]


@dataclass
class Bucket:
    """Parameters averaged together, and the persistent layout of their gradients."""

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    nbytes: int
    cuda_devices: list[torch.device]
    #: ``(parameter indices, fusion.Layout)`` per flat buffer; built at the first step.
    layouts: list[tuple[list[int], fusion.Layout]] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        """The parameter names the bucket spans, for messages."""
        if len(self.names) == 1:
            return self.names[0]
        return f"{self.names[0]} .. {self.names[-1]}"


def make_buckets(named: list[tuple[str, torch.nn.Parameter]], cap: int) -> list[Bucket]:
    """Buckets of at most ``cap`` bytes in reverse registration order (any dtype or
    device: the strategy fuses each bucket per dtype and device)."""
    order = list(reversed(named))
    plan = fusion.group([p.numel() * p.element_size() for _, p in order], None, cap)
    buckets = []
    for i, idx in enumerate(plan):
        group = [order[j] for j in idx]
        devices = sorted({p.device for _, p in group if p.device.type == "cuda"}, key=str)
        buckets.append(Bucket(i, [p for _, p in group], [n for n, _ in group],
                              sum(p.numel() * p.element_size() for _, p in group), devices))
    return buckets


def nonfinite_names(grads: list[torch.Tensor], names: list[str]) -> list[str]:
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


def bucket_views(bucket: Bucket, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` as views of the bucket's persistent flat buffers, copying only those
    that are not views yet.

    After the first step ``.grad`` *is* the view, so with ``zero_grad(set_to_none=False)``
    autograd accumulates straight into the buffer and the step copies nothing; with
    ``set_to_none=True`` (PyTorch's default) each gradient is copied in once. A gradient
    that changed dtype or device makes the bucket lay itself out anew.
    """
    layouts = bucket.layouts
    if layouts is not None and not all(layout.matches([grads[i] for i in idx])
                                       for idx, layout in layouts):
        layouts = None
    if layouts is None:
        plan = fusion.group([g.numel() * g.element_size() for g in grads],
                            [fusion.kind_of(g) for g in grads], None, consecutive=True)
        layouts = [(idx, fusion.Layout([tuple(grads[i].shape) for i in idx],
                                       grads[idx[0]].dtype, grads[idx[0]].device))
                   for idx in plan]
        bucket.layouts = layouts
    views = list(grads)
    with torch.no_grad():
        for idx, layout in layouts:
            for i, view in zip(idx, layout.views()):
                if grads[i].data_ptr() != view.data_ptr():
                    view.copy_(grads[i])
                views[i] = view
    return views


def aggregate_bucket(bucket: Bucket, strategy: Strategy, comm: Communicator) -> str | None:
    """Average ``bucket``'s gradients over the ranks of ``comm`` in place (collective).

    A missing gradient counts as zeros; a parameter whose gradient is missing on every
    rank keeps ``grad = None``. Returns ``None`` when the bucket was averaged, or, when
    some rank's bucket held a NaN or an Inf, a message naming the bucket and the ranks
    (identical on every rank but for this rank's own parameter names); the gradients are
    then left alone and the strategy never sees the non-finite values. ``TypeError`` for
    a sparse gradient.
    """
    grads, present = [], []
    for p in bucket.params:
        g = p.grad
        if g is not None and g.layout != torch.strided:
            raise TypeError(f"parameter {bucket.names[len(grads)]!r} has a {g.layout} "
                            "gradient; GradientSync supports dense gradients only")
        present.append(g is not None)
        grads.append(g.detach() if g is not None
                     else torch.zeros_like(p, memory_format=torch.contiguous_format))
    bad = nonfinite_names(grads, bucket.names)
    flags = np.array([1 if bad else 0, *present], dtype=np.uint8)
    agreed = allreduce(flags, op="max", algorithm="mpi", comm=comm)
    if agreed[0]:
        ranks = [r for r, f in enumerate(comm.allgather_object(bool(bad))) if f]
        here = f"; on rank {comm.rank}: {', '.join(bad)}" if bad else ""
        return (f"non-finite gradient (NaN or Inf) in bucket {bucket.index} "
                f"[{bucket.label}] on rank(s) {ranks}{here}")
    views = bucket_views(bucket, grads)
    strategy.aggregate_into(views, bucket.names)
    for p, view, used in zip(bucket.params, views, agreed[1:]):
        if used and p.grad is not view:
            p.grad = view
        # no rank has a gradient: keep None, as a single process would
    for dev in bucket.cuda_devices:
        torch.cuda.current_stream(dev).synchronize()
    return None
