"""Kernels the collectives run on flat work arrays: numpy, torch (CPU/CUDA) and cupy.

One :class:`ArrayOps` per framework and place (host or device, :func:`ops_for`): fresh
arrays, copies, elementwise reductions (``sum``/``avg``/``max``/``min``), the MPI buffer
specification. Reductions use the framework's own kernels (numpy ufuncs, torch ops, cupy
ufuncs), so float16 and bfloat16 are reduced in their own precision, as NCCL does; cost
``gamma`` seconds per byte (:mod:`mpicomm.collectives.cost`). Every method that writes
device memory synchronizes the array's own device stream before returning, so the
result is ready for MPI to read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from . import clock

__all__ = ["ArrayOps", "TorchOps", "ops_for"]


def _nbytes(a: Any) -> int:
    """Bytes of a numpy/cupy array or torch tensor (what the virtual clock charges)."""
    nbytes = getattr(a, "nbytes", None)
    return int(nbytes) if nbytes is not None else a.numel() * a.element_size()


class ArrayOps:
    """Kernels the collectives need on flat work arrays of one framework.

    Every method that writes device memory synchronizes the current stream *of the
    array's own device* before returning, so the result is ready for MPI to read (with
    tensors on ``cuda:1`` the current stream of ``cuda:0`` says nothing about them). Fresh
    device arrays are synchronized too before MPI may write into them: the caching
    allocators hand out memory that a kernel queued earlier on the stream may still use.
    cupy arrays are allocated on the device of the array they are made like, not on the
    thread's current device.
    """

    framework = "numpy"

    def __init__(self, xp: Any = np, device: bool = False):
        self.xp = xp
        self.device = device

    def empty(self, n: int, dtype: Any) -> Any:
        return self.xp.empty(n, dtype=dtype)

    def empty_like(self, a: Any, n: int) -> Any:
        """An uninitialized flat array of ``n`` elements with ``a``'s dtype and device,
        safe for MPI to write into (see the class docstring)."""
        if not self.device:
            return self.xp.empty(n, dtype=a.dtype)
        with a.device:
            result = self.xp.empty(n, dtype=a.dtype)
        self.sync(result)
        return result

    def flat(self, a: Any) -> Any:
        """A 1-D contiguous view of ``a`` (a copy when ``a`` is not contiguous)."""
        return self.xp.ascontiguousarray(a).reshape(-1)

    def copy_(self, dst: Any, src: Any) -> None:
        clock.charge("copy", _nbytes(dst))
        self.xp.copyto(dst, src)
        self.sync(dst)

    def reduce_(self, acc: Any, other: Any, op: str) -> None:
        """``acc = op(acc, other)`` elementwise, in place (``avg`` reduces as ``sum``)."""
        clock.charge("reduce", _nbytes(acc))
        fn = {"sum": self.xp.add, "avg": self.xp.add, "max": self.xp.maximum,
              "min": self.xp.minimum}[op]
        fn(acc, other, out=acc)
        self.sync(acc)

    def combine_(self, out: Any, a: Any, b: Any, op: str) -> None:
        """``out = op(a, b)`` elementwise (``out`` may be ``a``): a reduction that leaves
        its inputs alone, for algorithms that must not modify the caller's buffer."""
        clock.charge("reduce", _nbytes(out))
        fn = {"sum": self.xp.add, "avg": self.xp.add, "max": self.xp.maximum,
              "min": self.xp.minimum}[op]
        fn(a, b, out=out)
        self.sync(out)

    def divide_(self, acc: Any, divisor: int) -> None:
        clock.charge("reduce", _nbytes(acc))
        self.xp.divide(acc, acc.dtype.type(divisor), out=acc)
        self.sync(acc)

    def reshape(self, a: Any, shape: tuple[int, ...]) -> Any:
        return a.reshape(shape)

    def shares_memory(self, a: Any, b: Any) -> bool:
        return self.xp.shares_memory(a, b) if a.size and b.size else a is b

    def concatenate(self, parts: list[Any]) -> Any:
        return self.xp.concatenate(parts)

    def data_ptr(self, a: Any) -> int:
        return a.data.ptr if self.device else a.__array_interface__["data"][0]

    def itemsize(self, a: Any) -> int:
        return a.itemsize

    def sync(self, a: Any) -> None:
        """Wait for the current stream of ``a``'s device (no-op for host arrays)."""
        if self.device:
            with a.device:  # cupy: current streams are per device
                self.xp.cuda.get_current_stream().synchronize()

    @staticmethod
    def msg(a: Any) -> list[Any]:
        """The buffer specification MPI sends from / receives into (raw bytes)."""
        return [a, MPI.BYTE]


class TorchOps(ArrayOps):
    """:class:`ArrayOps` for torch tensors (CPU or CUDA); handles bfloat16 natively."""

    framework = "torch"

    def __init__(self, device: bool = False):
        import torch

        super().__init__(torch, device)
        self.torch = torch

    def empty(self, n: int, dtype: Any, device: Any = "cpu") -> Any:
        result = self.torch.empty(n, dtype=dtype, device=device)
        self.sync(result)
        return result

    def empty_like(self, a: Any, n: int) -> Any:
        result = self.torch.empty(n, dtype=a.dtype, device=a.device)
        self.sync(result)
        return result

    def flat(self, a: Any) -> Any:
        return a.detach().contiguous().view(-1)

    def copy_(self, dst: Any, src: Any) -> None:
        clock.charge("copy", _nbytes(dst))
        dst.copy_(src)
        self.sync(dst)

    def reduce_(self, acc: Any, other: Any, op: str) -> None:
        clock.charge("reduce", _nbytes(acc))
        if op in ("sum", "avg"):
            acc.add_(other)
        elif op == "max":
            self.torch.maximum(acc, other, out=acc)
        else:
            self.torch.minimum(acc, other, out=acc)
        self.sync(acc)

    def combine_(self, out: Any, a: Any, b: Any, op: str) -> None:
        clock.charge("reduce", _nbytes(out))
        fn = {"sum": self.torch.add, "avg": self.torch.add, "max": self.torch.maximum,
              "min": self.torch.minimum}[op]
        fn(a, b, out=out)
        self.sync(out)

    def divide_(self, acc: Any, divisor: int) -> None:
        clock.charge("reduce", _nbytes(acc))
        acc.div_(divisor)
        self.sync(acc)

    def reshape(self, a: Any, shape: tuple[int, ...]) -> Any:
        return a.view(shape)

    def shares_memory(self, a: Any, b: Any) -> bool:
        if a.numel() == 0 or b.numel() == 0:
            return a is b
        if a.device != b.device:
            return False
        a0, b0 = a.data_ptr(), b.data_ptr()
        a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
        return a0 < b1 and b0 < a1

    def concatenate(self, parts: list[Any]) -> Any:
        return self.torch.cat(parts)

    def data_ptr(self, a: Any) -> int:
        return a.data_ptr()

    def itemsize(self, a: Any) -> int:
        return a.element_size()

    def sync(self, a: Any) -> None:
        """Wait for the current stream of ``a``'s device (no-op for host tensors)."""
        if self.device and a.device.type == "cuda":
            self.torch.cuda.current_stream(a.device).synchronize()


_NUMPY_OPS = ArrayOps()


def ops_for(framework: str, device: bool) -> ArrayOps:
    """The :class:`ArrayOps` for work arrays of ``framework`` on host or device."""
    if framework == "numpy":
        return _NUMPY_OPS
    if framework == "torch":
        return TorchOps(device)
    if framework == "cupy":
        if not device:
            return _NUMPY_OPS  # staged cupy data lives in pinned numpy arrays
        import cupy

        return ArrayOps(cupy, device=True)
    raise TypeError(f"unknown framework {framework!r}")
