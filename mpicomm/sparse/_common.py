"""Plumbing shared by the sparse collectives: argument checks, cross-rank agreement on
errors, the sparse union/truncation kernel and the wire format.

A *sparse set* here is a pair of 1-D torch tensors ``(idx, val)`` on one device with
``idx`` int64, strictly increasing (no duplicates), and ``val`` of a floating dtype. That
is the canonical form inside :mod:`mpicomm.sparse`; callers' arrays (numpy, torch, cupy,
any order) are converted to it on entry and back on exit.

Selection always uses :func:`mpicomm.selection.topk_indices` on the magnitudes of a
set's values; since a set is sorted by index, "smaller position" is "smaller index", so
the tie-break is the library-wide total order (``|v|`` desc, then index asc). A NaN
magnitude (possible only with ``allow_nonfinite=True``, or after an overflow produced
``inf - inf``) ranks as ``+inf`` so that the order stays total and deterministic.

Wire format: one message per set, raw bytes: the ``n`` indices as int32 (int64 when the
index space has 2^31 or more entries), then the ``n`` values in their own dtype. The
receiver learns ``n`` from the message length (``MPI_Mprobe`` + ``MPI_Get_count``), so no
header message is needed; ``s = index bytes + value bytes`` bytes per pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from mpi4py import MPI

from .. import clock, vwire
from ..buffers import (
    BufferInfo,
    cuda_aware,
    framework_of,
    from_torch,
    ops_for,
    staging_pool,
    to_torch,
)
from ..comm import Communicator, poll_until, wait_all
from ..linkdelay import link_delay
from ..selection import index_dtype_for, topk_indices
from ..tags import TAG_GTOPK_FOLD, TAG_GTOPK_ROUND  # noqa: F401  (re-exported)
from ..validate import check_int

__all__ = [
    "Pairs",
    "SparseInput",
    "Wire",
    "all_finite",
    "check_int",
    "check_k",
    "merge_truncate",
    "pack",
    "pack_bytes",
    "pair_bytes",
    "read_pairs",
    "read_topk_args",
    "selection_key",
    "truncate",
    "union",
    "unpack",
    "unpack_bytes",
    "wire_index_dtype",
    "to_caller",
]


FLOAT_TORCH = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_TORCH = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
#: Largest index space for which int32 wire indices are used when no ``size`` is given.
INT32_LIMIT = 2**31

Pairs = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------- checks
def check_k(k: Any, limit: int | None, what: str = "size") -> int:
    """``k >= 1`` and, when ``limit`` is known, ``k <= limit``."""
    k = check_int("k", k, 1)
    if limit is not None and k > limit:
        raise ValueError(f"k={k} exceeds {what}={limit}")
    return int(k)


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
    back to their framework).
    """

    idx: torch.Tensor
    val: torch.Tensor
    idx_in: torch.Tensor
    idx_dtype: torch.dtype
    like_idx: Any
    like_val: Any

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
    idx, order = torch.sort(idx_in, stable=True)
    same = idx[1:] == idx[:-1]
    if bool(same.any()):
        raise ValueError(f"duplicate index {int(idx[1:][same][0])} in this rank's input")
    return SparseInput(idx, val[order].contiguous(), idx_in, ti.dtype, indices, values)


def read_topk_args(comm: Communicator, name: str, indices: Any, values: Any, k: Any,
                   size: Any, allow_nonfinite: bool) -> tuple[SparseInput, int, int | None]:
    """Validate the (indices, values, k, size) arguments shared by the top-k collectives.

    Runs under :meth:`Communicator.validating`, so in checked mode a bad argument on one
    rank raises on every rank and the ranks' k, size and value dtype are compared.
    Returns the canonical sparse input, ``k`` and ``size``.
    """
    with comm.validating(name) as agreed:
        agreed.update(k=k, size=size)
        if size is not None:
            size = check_int("size", size, 1)
        k = check_k(k, size)
        sp = read_pairs(indices, values, size, allow_nonfinite)
        agreed["dtype"] = str(sp.val.dtype)
    return sp, k, size


# ---------------------------------------------------------------------- kernels
def selection_key(val: torch.Tensor) -> torch.Tensor:
    """Magnitudes to rank by: ``|v|`` (half types widened exactly), NaN as ``+inf``."""
    key = val.abs()
    if key.dtype in (torch.float16, torch.bfloat16):
        key = key.float()
    # a sum of non-negative numbers is NaN exactly when one of them is NaN
    if key.numel() and bool(torch.isnan(key.sum())):
        key = torch.where(torch.isnan(key), torch.full_like(key, float("inf")), key)
    return key


def truncate(idx: torch.Tensor, val: torch.Tensor, k: int) -> Pairs:
    """The ``k`` pairs of a sparse set with the largest ``|value|`` (ties: smaller index)."""
    if idx.shape[0] <= k:
        return idx, val
    clock.charge("select", idx.shape[0])
    pos = topk_indices(selection_key(val), k)
    return idx[pos], val[pos]


def union(a: Pairs, b: Pairs) -> Pairs:
    """True sparse union: indices of both sets once, values added where both have one.

    ``a``'s value is the left operand of every addition (``a + b``), so a caller that
    always passes the lower-ranked operand first computes the same bits on every rank
    (IEEE addition is commutative anyway; the fixed order documents the association).
    """
    ai, av = a
    bi, bv = b
    clock.charge("merge", ai.shape[0] + bi.shape[0])
    if ai.shape[0] == 0 or bi.shape[0] == 0:
        return (bi, bv) if ai.shape[0] == 0 else (ai, av)
    ci = torch.cat([ai, bi])
    cv = torch.cat([av, bv])
    si, order = torch.sort(ci, stable=True)  # equal indices: a's entry first
    sv = cv[order]
    first = torch.nonzero(si[1:] == si[:-1]).view(-1)  # each index occurs at most twice
    if first.shape[0]:
        sv[first] = sv[first] + sv[first + 1]
        keep = torch.ones(si.shape[0], dtype=torch.bool, device=si.device)
        keep[first + 1] = False
        si, sv = si[keep], sv[keep]
    return si, sv


def merge_truncate(a: Pairs, b: Pairs, k: int) -> Pairs:
    """MERGE_TRUNCATE of algorithms.md A.4: sparse union, then the top-k of it."""
    return truncate(*union(a, b), k)


# ---------------------------------------------------------------------- wire format
def pack_bytes(arrays: Sequence[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of several tensors (one device) back to back, as uint8.

    Empty tensors contribute nothing (torch cannot byte-view them).
    """
    parts = [a.contiguous().reshape(-1).view(torch.uint8) for a in arrays if a.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=arrays[0].device)
    return torch.cat(parts)


def unpack_bytes(buf: torch.Tensor, layout: Sequence[tuple[torch.dtype, int]]
                 ) -> list[torch.Tensor]:
    """Inverse of :func:`pack_bytes` for ``layout`` = ``[(dtype, numel), ...]``.

    Each part is copied into its own (suitably aligned) storage before the dtype view.
    """
    out, offset = [], 0
    for dtype, numel in layout:
        nbytes = numel * dtype.itemsize
        out.append(buf[offset:offset + nbytes].clone().view(dtype))
        offset += nbytes
    if offset != buf.shape[0]:
        raise RuntimeError(f"payload of {buf.shape[0]} bytes, expected {offset}: the ranks "
                           "disagree on the tensors being aggregated")
    return out


def pack(idx: torch.Tensor, val: torch.Tensor, index_dtype: torch.dtype) -> torch.Tensor:
    """One uint8 tensor: the indices as ``index_dtype``, then the values (raw bytes)."""
    return pack_bytes([idx.to(index_dtype), val])


def pair_bytes(index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """``s``: bytes per (index, value) pair on the wire."""
    return index_dtype.itemsize + value_dtype.itemsize


def unpack(buf: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype) -> Pairs:
    """Inverse of :func:`pack`; the pair count follows from the byte length."""
    s = pair_bytes(index_dtype, value_dtype)
    nbytes = buf.shape[0]
    if nbytes % s:
        raise RuntimeError(f"received {nbytes} bytes, not a multiple of the {s}-byte pair "
                           "size: the ranks disagree on the value dtype or index space")
    n = nbytes // s
    idx, val = unpack_bytes(buf, [(index_dtype, n), (value_dtype, n)])
    return idx.to(torch.int64), val


class Wire:
    """Point-to-point transfer of packed sets whose length the receiver does not know.

    Host tensors go to MPI as they are. CUDA tensors go as device pointers when the MPI
    library is CUDA-aware (after synchronizing the current stream); otherwise they are
    staged through the communicator's reusable pinned host buffers
    (:class:`mpicomm.buffers.StagingPool`, slots ``sparse-send``/``sparse-recv``) and
    moved back to the device after receipt. Every message is counted in
    ``comm.traffic`` (bytes sent, bytes received, messages sent). With the
    communicator's ``wait_poll_s`` set, sends complete and receives are probed by test +
    sleep (:func:`mpicomm.comm.wait_all`, ``MPI_Improbe``) instead of blocking in MPI.
    """

    def __init__(self, comm: Communicator, device: torch.device):
        self.mpi = comm.p2p
        self.traffic = comm.traffic
        self.device = device
        self.staged = device.type == "cuda" and not cuda_aware()
        self.direct = device.type == "cuda" and not self.staged
        self._resources = comm.resources
        self._ops = ops_for("torch", self.direct)
        self.virtual = vwire.active()
        # the emulated cluster's injected latency (None outside it and on the virtual clock)
        self.delay = None if self.virtual else link_delay(comm)
        self.poll_s = comm.wait_poll_s
        if self.virtual and self.poll_s is None:
            self.poll_s = vwire.POLL_S

    def _host(self, numel: int, slot: str) -> torch.Tensor:
        info = BufferInfo("torch", "uint8", (numel,), str(self.device), 1)
        return staging_pool(self._resources).get(info, numel, slot)

    def _outgoing(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        torch.cuda.current_stream(t.device).synchronize()
        if self.direct:
            return t
        host = self._host(t.shape[0], "sparse-send")
        host.copy_(t)
        return host

    def _count_send(self, t: torch.Tensor) -> None:
        self.traffic.sent_bytes += int(t.shape[0])
        self.traffic.messages += 1

    def _isend(self, out: torch.Tensor, dest: int, tag: int) -> MPI.Request:
        self._count_send(out)
        if self.delay is not None:
            self.delay.before_send(dest)
        if not self.virtual:
            return self.mpi.Isend([out, MPI.BYTE], dest, tag)
        token = vwire.isend(self.mpi, dest, tag, int(out.shape[0]))
        return vwire.track(self.mpi.Isend([out, MPI.BYTE], dest, tag), token)

    def _wait(self, request: MPI.Request) -> None:
        if self.virtual:
            vwire.complete([request], self.poll_s, wait_all)
        else:
            wait_all([request], self.poll_s)

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        out = self._outgoing(t)
        if self.poll_s is None:
            self._count_send(out)
            if self.delay is not None:
                self.delay.before_send(dest)
            self.mpi.Send([out, MPI.BYTE], dest, tag)
        else:
            self._wait(self._isend(out, dest, tag))

    def recv(self, source: int, tag: int) -> torch.Tensor:
        status = MPI.Status()
        if self.virtual:
            vwire.block([], sources=[vwire.world_rank(self.mpi, source)])
        if self.poll_s is None:
            message = self.mpi.Mprobe(source, tag, status)
        else:
            message = poll_until(lambda: self.mpi.Improbe(source, tag, status), self.poll_s)
        token = vwire.probed(self.mpi, status) if self.virtual else None
        n = status.Get_count(MPI.BYTE)
        if self.staged:
            buf = self._host(n, "sparse-recv")
        else:  # direct: the fresh block is synchronized before MPI writes into it
            buf = self._ops.empty(n, torch.uint8, device=self.device)
        message.Recv([buf, MPI.BYTE])
        if token is not None:
            vwire.finish([token])
        if self.delay is not None:
            self.delay.after_receive()
        self.traffic.recv_bytes += n
        return buf.to(self.device) if self.staged else buf

    def exchange(self, t: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        """Send ``t`` to ``peer`` while receiving ``peer``'s message of unknown length."""
        request = self._isend(self._outgoing(t), peer, tag)
        try:
            got = self.recv(peer, tag)
        finally:
            self._wait(request)
        return got


# ---------------------------------------------------------------------- results
def to_caller(t: torch.Tensor, like: Any, dtype: torch.dtype | None = None) -> Any:
    """``t`` (optionally cast to ``dtype``) in the framework of ``like``."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return from_torch(t, like)
