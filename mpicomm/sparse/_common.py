"""Plumbing shared by the sparse collectives: argument checks, cross-rank agreement on
errors, the span describer and the way back to the caller's framework.

A *sparse set* here is a pair of 1-D torch tensors ``(idx, val)`` on one device with
``idx`` int64, strictly increasing (no duplicates), and ``val`` of a floating dtype. That
is the canonical form inside :mod:`mpicomm.sparse`; callers' arrays (numpy, torch, cupy,
any order) are converted to it on entry and back on exit.

Selection always uses :func:`mpicomm.compress.topk_select.topk_indices` on the
magnitudes of a set's values (:mod:`mpicomm.sparse.sets`); since a set is sorted by
index, "smaller position" is "smaller index", so the tie-break is the library-wide total
order (``|v|`` desc, then index asc). A NaN magnitude (possible only with
``allow_nonfinite=True``, or after an overflow produced ``inf - inf``) ranks as ``+inf``
so that the order stays total and deterministic.

Wire format (:func:`mpicomm.p2p.pack`): one message per set, raw bytes: the ``n``
indices as int32 (int64 when the index space has 2^31 or more entries), then the ``n``
values in their own dtype. The receiver learns ``n`` from the message length
(``MPI_Mprobe`` + ``MPI_Get_count``, :class:`mpicomm.p2p.Wire`), so no header message is
needed; ``s = index bytes + value bytes`` bytes per pair.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from .. import clock
from ..buffers import framework_of, from_torch, to_torch
from ..buffers import inspect as inspect_buffer
from ..collectives import cost
from ..comm import Communicator
from ..compress.topk_select import index_dtype_for
from ..hooks import Describe
from ..tags import TAG_GTOPK_ALIVE, TAG_GTOPK_FOLD, TAG_GTOPK_ROUND  # noqa: F401
from ..validate import check_int
from .coding import check_coding, coded_bytes

__all__ = [
    "SparseInput",
    "all_finite",
    "check_int",
    "check_k",
    "describe_sparse",
    "read_pairs",
    "read_topk_args",
    "wire_index_dtype",
    "to_caller",
]


FLOAT_TORCH = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_TORCH = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
#: Largest index space for which int32 wire indices are used when no ``size`` is given.
INT32_LIMIT = 2**31


# ---------------------------------------------------------------------- checks
def check_k(k: Any, limit: int | None, what: str = "size") -> int:
    """``k >= 1`` and, when ``limit`` is known, ``k <= limit``."""
    k = check_int("k", k, 1)
    if limit is not None and k > limit:
        raise ValueError(f"k={k} exceeds {what}={limit}")
    return int(k)


def read_dense_topk_args(x: Any, k: Any, step: Any,
                         agreed: dict[str, Any]) -> tuple[torch.Tensor, int, int, int]:
    """The checks every top-k of a dense vector makes before communicating: ``x`` a
    floating array or tensor, ``k`` in ``[0, numel]``, ``step`` an integer >= 0; records
    ``numel`` and ``dtype`` in ``agreed`` (the values the ranks cross-check). Returns
    ``(x as a detached torch tensor, numel, k, step)``."""
    framework_of(x)
    xt = to_torch(x).detach()
    if xt.dtype not in FLOAT_TORCH:
        raise TypeError(f"x must have a floating dtype, got {xt.dtype}")
    numel = xt.numel()
    agreed.update(numel=numel, dtype=str(xt.dtype))
    return xt, numel, check_k(k, numel, "numel of x"), check_int("step", step, 0)


def wire_index_dtype(size: int | None) -> torch.dtype:
    """int32 on the wire when every index fits in 31 bits (``size`` unknown: int32)."""
    if size is None:
        return torch.int32
    return torch.int32 if index_dtype_for(size) == "int32" else torch.int64


@dataclass
class SparseInput:
    """A caller's (indices, values) after validation, in canonical form.

    ``idx``/``val`` are sorted by index; ``idx_in`` is the caller's index tensor converted
    to int64 in the caller's order (for the dropped mask) and ``idx_dtype`` its original
    dtype; ``like_idx``/``like_val`` are the caller's original objects (to convert results
    back to their framework); ``order`` the sort's permutation (``idx = idx_in[order]``),
    ``None`` where the caller's indices were sorted already.
    """

    idx: torch.Tensor
    val: torch.Tensor
    idx_in: torch.Tensor
    idx_dtype: torch.dtype
    like_idx: Any
    like_val: Any
    order: torch.Tensor | None = None

    def in_caller_order(self, mask: torch.Tensor) -> torch.Tensor:
        """A per-pair tensor in ``idx``'s (sorted) order, rearranged to the caller's."""
        if self.order is None:
            return mask
        out = torch.empty_like(mask)
        out[self.order] = mask
        return out

    @property
    def device(self) -> torch.device:
        return self.val.device


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite. A finite sum proves it (NaN and inf cannot cancel
    out of a sum), which costs a fraction of an elementwise test; only when the sum is not
    finite (a non-finite element, or a legitimate overflow) is every element tested."""
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def read_pairs(indices: Any, values: Any, size: int | None, allow_nonfinite: bool) -> SparseInput:
    """Validate one rank's (indices, values) and sort them by index.

    Raises ``TypeError`` for unsupported frameworks or dtypes, ``ValueError`` for
    mismatched lengths, non-1-D inputs, indices outside ``[0, size)`` (``[0, 2^31)`` when
    ``size`` is None), duplicate indices, or non-finite values (unless allowed).
    """
    fi, fv = framework_of(indices), framework_of(values)
    if fi != fv:
        raise TypeError(f"indices are a {fi} array but values are a {fv} array")
    ti, tv = to_torch(indices), to_torch(values)
    if ti.device != tv.device:
        raise TypeError(f"indices are on {ti.device} but values on {tv.device}")
    if ti.dtype not in INT_TORCH:
        raise TypeError(f"indices must have an integer dtype, got {ti.dtype}")
    if tv.dtype not in FLOAT_TORCH:
        raise TypeError(f"values must have a floating dtype, got {tv.dtype}")
    if ti.dim() != 1 or tv.dim() != 1:
        raise ValueError(f"indices and values must be 1-D, got shapes {tuple(ti.shape)} and "
                         f"{tuple(tv.shape)}")
    if ti.shape[0] != tv.shape[0]:
        raise ValueError(f"indices ({ti.shape[0]}) and values ({tv.shape[0]}) differ in length")
    idx_in = ti.detach().to(torch.int64)
    n = idx_in.shape[0]
    limit = INT32_LIMIT if size is None else size
    if n:
        lo, hi = int(idx_in.min()), int(idx_in.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            where = (f"[0, size={size})" if size is not None
                     else "[0, 2^31) (pass size= for larger index spaces)")
            raise ValueError(f"index {bad} is outside {where}")
    val = tv.detach()
    if not allow_nonfinite and not all_finite(val):
        raise ValueError("values contain NaN or infinity (pass allow_nonfinite=True to allow)")
    if n < 2 or bool((idx_in[1:] > idx_in[:-1]).all()):  # already canonical: O(n)
        return SparseInput(idx_in, val.contiguous(), idx_in, ti.dtype, indices, values)
    clock.charge("sort", n)
    idx, order = torch.sort(idx_in, stable=True)
    same = idx[1:] == idx[:-1]
    if bool(same.any()):
        raise ValueError(f"duplicate index {int(idx[1:][same][0])} in this rank's input")
    return SparseInput(idx, val[order].contiguous(), idx_in, ti.dtype, indices, values,
                       order)


def read_topk_args(comm: Communicator, name: str, indices: Any, values: Any, k: Any,
                   size: Any, allow_nonfinite: bool, coding: str | None = None
                   ) -> tuple[SparseInput, int, int | None]:
    """Validate the (indices, values, k, size, coding) arguments shared by the top-k
    collectives.

    Runs under :meth:`Communicator.validating`, so in checked mode a bad argument on one
    rank raises on every rank and the ranks' k, size and value dtype are compared.
    Returns the canonical sparse input, ``k`` and ``size``.
    """
    with comm.validating(name) as agreed:
        agreed.update(k=k, size=size, coding=coding)
        check_coding(coding, allow_nonfinite)
        if size is not None:
            size = check_int("size", size, 1)
        k = check_k(k, size)
        sp = read_pairs(indices, values, size, allow_nonfinite)
        agreed["dtype"] = str(sp.val.dtype)
    return sp, k, size


# ---------------------------------------------------------------------- results
def to_caller(t: torch.Tensor, like: Any, dtype: torch.dtype | None = None) -> Any:
    """``t`` (optionally cast to ``dtype``) in the framework of ``like``."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return from_torch(t, like)


def describe_sparse(collective: str) -> Describe:
    """Span args of a sparse collective for :func:`mpicomm.hooks.traced`: ``k``, value
    bytes and, for ``gtopk`` and ``topk_allgather``, the cost model's prediction (with
    ``coding`` and ``size``, for the coded pairs' expected bytes)."""

    def describe(bound: inspect.BoundArguments, comm: Any) -> dict[str, Any]:
        a = bound.arguments
        first = a.get("values", a.get("x"))
        info = inspect_buffer(first)
        out: dict[str, Any] = {"bytes": info.nbytes}
        k = a.get("k")
        if k is None and "indices" in a:
            k = inspect_buffer(a["indices"]).numel
        out["k"] = k
        p = comm.size if comm is not None else 1
        params = comm.resources.get("cost_params") if comm is not None else None
        formula = {"gtopk": cost.gtopk, "topk_allgather": cost.topk_allgather}.get(collective)
        if formula is not None and k and p > 1 and "indices" in a:
            s = inspect_buffer(a["indices"]).nbytes // max(1, inspect_buffer(
                a["indices"]).numel) + info.nbytes // max(1, info.numel)
            if a.get("coding") is not None and a.get("size"):   # the coded pairs' bytes
                s = coded_bytes(k, a["size"]) / k
            out["predicted_s"] = formula(k, s, p, params or cost.CostParams())
        return out

    return describe
