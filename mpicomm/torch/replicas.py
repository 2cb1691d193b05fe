"""Replicas of one model on every rank: check that they match, copy one rank's weights.

``check_same_module`` raises on every rank, naming the first difference, unless all ranks
hold the same parameters and buffers (names, shapes, dtypes, ``requires_grad``), and
``broadcast_module`` copies one rank's parameters and buffers into every replica. Both
are collective. ``GradientSync``, ``LocalSGD`` and ``GossipAveraging`` call them when they
are built, so that every replica starts from the same weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from .. import fusion
from ..collectives import broadcast
from ..comm import Communicator, resolve
from ..validate import check_int

__all__ = ["broadcast_module", "check_same_module", "describe_module_mismatch",
           "check_model"]

_ALIGN = 16  # byte alignment of each tensor inside a packed broadcast buffer


def check_model(model: Any) -> torch.nn.Module:
    """``model`` if it is a ``torch.nn.Module`` with at least one parameter.

    ``TypeError`` for anything that is not a module, ``ValueError`` for a module without
    parameters (nothing to average).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise ValueError("model has no parameters to average")
    return model


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
    ``describe_module_mismatch``). Collective. Costs one allgather of a 16-byte digest;
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
    """Byte offset of each tensor in a packed buffer (each aligned to 16 bytes), and the
    buffer's size."""
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
    (``GradientSync`` does it by default). The tensors are sent as raw bytes, packed per
    device into buffers of at most ``chunk_mb`` megabytes (one broadcast per buffer rather
    than per tensor), so any dtype works, bit for bit. Collective; raises ``ValueError``
    on every rank first when the modules differ (``check_same_module``).

    Cost: about ``chunk_mb`` of extra memory, and per chunk of ``n`` bytes one broadcast
    of ``(⌈lg p⌉ + p - 1)α + 2(p-1)/p·nβ`` with the scatter-allgather algorithm. A larger
    ``chunk_mb`` saves latencies (``α`` per chunk) at the price of memory.
    """
    comm = resolve(comm)
    root = check_int("root", root, 0, comm.size - 1)
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
