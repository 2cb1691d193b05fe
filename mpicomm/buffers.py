"""numpy arrays, torch tensors (CPU and CUDA) and cupy arrays as MPI-ready buffers.

The collectives work on *flat work arrays*: 1-D, contiguous, in the caller's framework
and dtype, living either where the caller's data lives or, for CUDA data under an MPI
that is not CUDA-aware, in reusable pinned host memory. :class:`Buffer` hands out those
work arrays and turns a finished work array back into the caller's kind of object, so a
cupy array in gives a cupy array out and a CUDA tensor in gives a CUDA tensor out, of the
same dtype, on the same device.

CUDA data
---------
Whether MPI may be given device pointers is decided once per process by
:func:`cuda_aware`: ``MPICOMM_CUDA_AWARE=0`` forces staging; ``auto`` (the default) asks
the MPI library through ``MPIX_Query_cuda_support`` (called with ctypes, since mpi4py has
no wrapper), then Open MPI's ``ompi_info``, and otherwise assumes *not* aware, the only
safe default (a wrong "yes" segfaults). ``MPICOMM_CUDA_AWARE=1`` forces device pointers
for a library that cannot be asked, but is refused with ``ValueError`` when the library
answers that it has no CUDA support. The decision is logged once at INFO level.

Before MPI reads device memory, the producing stream is synchronized: MPI knows nothing
of CUDA streams, so without it MPI could send data a kernel has not written yet. Staging
copies need no such wait: they are queued on that same stream, behind the producer, and
the host waits for their events instead.
When staging, device data is copied to a pinned host buffer taken from a per-communicator
:class:`StagingPool` (allocated once, grown on demand, reused by every later call), in
chunks queued asynchronously on the data's own stream; the large-message ring algorithms
stream those copies so that they overlap the communication (:mod:`mpicomm.staging`).

Reductions on work arrays use the framework's own kernels (numpy ufuncs, torch ops, cupy
ufuncs), so float16 and bfloat16 are reduced in their own precision, as NCCL does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from . import clock
from .config import env_choice, staging_chunk_bytes
from .staging import Pipeline, device_io
from .trace import traced

__all__ = [
    "DTYPES",
    "FLOAT_DTYPES",
    "BufferInfo",
    "Buffer",
    "ArrayOps",
    "StagingPool",
    "cuda_aware",
    "framework_of",
    "inspect",
    "ops_for",
    "to_torch",
    "from_torch",
]

log = logging.getLogger("mpicomm.buffers")

#: dtypes every collective accepts (by name; ``bfloat16`` exists only in torch).
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
          "int64")
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
REDUCE_OPS = ("sum", "avg", "max", "min")


# ---------------------------------------------------------------------- inspection
def framework_of(x: Any) -> str:
    """``"numpy"``, ``"torch"`` or ``"cupy"``; ``TypeError`` for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.split(".", 1)[0]
    if root == "torch":
        import torch

        if isinstance(x, torch.Tensor):
            return "torch"
    elif root == "cupy":
        import cupy

        if isinstance(x, cupy.ndarray):
            return "cupy"
    raise TypeError(
        f"expected a numpy.ndarray, torch.Tensor or cupy.ndarray, got {type(x).__module__}."
        f"{type(x).__qualname__}"
    )


@dataclass(frozen=True)
class BufferInfo:
    """What a buffer is, without touching its data."""

    framework: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@functools.lru_cache(maxsize=128)
def _dtype_name(dtype: Any) -> str:
    """The name of a numpy/cupy or torch dtype (cached: numpy computes ``dtype.name`` in
    Python, a few microseconds that every collective call would otherwise pay)."""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).replace("torch.", "")


def inspect(x: Any) -> BufferInfo:
    """Describe ``x``; ``TypeError`` for an unsupported framework or dtype."""
    fw = framework_of(x)
    if fw == "torch":
        dtype = _dtype_name(x.dtype)
        device = str(x.device)
        itemsize = x.element_size()
    elif fw == "cupy":
        dtype, device, itemsize = _dtype_name(x.dtype), f"cuda:{x.device.id}", x.dtype.itemsize
    else:
        dtype, device, itemsize = _dtype_name(x.dtype), "cpu", x.dtype.itemsize
    if dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {dtype} ({fw}); supported: {', '.join(DTYPES)}")
    if fw == "torch" and device not in ("cpu",) and not device.startswith("cuda"):
        raise TypeError(f"unsupported torch device {device}; use cpu or cuda tensors")
    return BufferInfo(fw, dtype, tuple(map(int, x.shape)), device, int(itemsize))


# ---------------------------------------------------------------------- array ops
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


# ---------------------------------------------------------------------- CUDA awareness
def _query_library() -> tuple[bool | None, str]:
    """What the MPI library itself says about CUDA support: ``(answer, why)``, with
    ``answer`` ``None`` when the library offers no way to ask."""
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        query = None
    if query is not None:
        query.restype = ctypes.c_int
        query.argtypes = []
        answer = int(query())
        return bool(answer), f"MPIX_Query_cuda_support() returned {answer}"
    if "Open MPI" in MPI.Get_library_version() and shutil.which("ompi_info"):
        try:
            text = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                                  text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        built = "mpi_built_with_cuda_support:value:true" in text
        return built, f"ompi_info reports mpi_built_with_cuda_support={str(built).lower()}"
    return None, "the MPI library offers no CUDA-support query"


@functools.cache
def _probe_cuda_aware() -> tuple[bool, str]:
    setting = env_choice("MPICOMM_CUDA_AWARE", ("auto", "0", "1"), "auto")
    if setting == "0":
        return False, "forced by MPICOMM_CUDA_AWARE=0"
    answer, why = _query_library()
    if setting == "1":
        if answer is False:
            # Handing device pointers to an MPI that cannot read them segfaults inside
            # the first send (seen with Debian's Open MPI 4.1.6); refuse instead.
            raise ValueError(
                f"MPICOMM_CUDA_AWARE=1, but the MPI library denies CUDA support ({why}); "
                "passing device pointers to it would crash. Unset MPICOMM_CUDA_AWARE (or "
                "set it to auto or 0) to stage CUDA buffers through pinned host memory, or "
                "use a CUDA-aware MPI build")
        return True, f"forced by MPICOMM_CUDA_AWARE=1 ({why})"
    if answer is None:
        return False, f"{why}; assuming not CUDA-aware"
    return answer, why


def cuda_aware() -> bool:
    """Whether CUDA device pointers are handed to MPI directly (see module docstring).

    ``ValueError`` when ``MPICOMM_CUDA_AWARE=1`` forces it but the library's own query
    says no: every rank reads the same setting and library, so all of them raise, before
    any communication (only CUDA buffers ask)."""
    aware, why = _probe_cuda_aware()
    _log_decision_once(aware, why)
    return aware


@functools.cache
def _log_decision_once(aware: bool, why: str) -> None:
    mode = "passing device pointers to MPI" if aware else "staging through pinned host memory"
    log.info("CUDA buffers: %s (%s)", mode, why)


# ---------------------------------------------------------------------- staging
class StagingPool:
    """Reusable pinned host buffers for CUDA data under an MPI that is not CUDA-aware.

    One buffer per (framework, dtype, slot); a request larger than the buffer held
    replaces it with one of twice the size (amortized growth), a smaller one gets a view.
    Not thread-safe: like its communicator, a pool serves one collective at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str, str], Any] = {}

    def get(self, info: BufferInfo, numel: int, slot: str) -> Any:
        key = (info.framework, info.dtype, slot)
        held = self._buffers.get(key)
        if held is None or held.shape[0] < numel:
            capacity = max(numel, 2 * held.shape[0] if held is not None else 0, 1)
            held = self._allocate(info, capacity)
            self._buffers[key] = held
        return held[:numel]

    @staticmethod
    def _allocate(info: BufferInfo, numel: int) -> Any:
        if info.framework == "torch":
            import torch

            return torch.empty(numel, dtype=getattr(torch, info.dtype), pin_memory=True)
        import cupyx

        return cupyx.empty_pinned((numel,), dtype=info.dtype)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self._buffers.values())


def staging_pool(resources: dict[str, Any]) -> StagingPool:
    """The pool kept in a communicator's ``resources`` (created on first use)."""
    pool = resources.get("staging")
    if pool is None:
        pool = resources["staging"] = StagingPool()
    return pool


def synchronize(x: Any, info: BufferInfo) -> None:
    """Wait for the stream producing ``x`` (no-op for host data)."""
    if not info.is_cuda:
        return
    if info.framework == "torch":
        import torch

        torch.cuda.current_stream(x.device).synchronize()
    else:
        import cupy

        with x.device:  # the current stream of x's device, not of the current device
            cupy.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------------- Buffer
class Buffer:
    """One caller array seen as flat work arrays, and the way back to the caller's type.

    ``staged`` is true for CUDA data under an MPI that is not CUDA-aware: the work arrays
    are then pinned host arrays (torch CPU tensors, or numpy arrays for cupy) and
    :meth:`deliver` copies the result back to the device.
    """

    def __init__(self, x: Any, resources: dict[str, Any] | None = None):
        self.info = inspect(x)
        self._given = x  # the caller's object, to recognise ``out=buf`` cheaply
        self.x = x.detach() if self.info.framework == "torch" else x
        self.staged = self.info.is_cuda and not cuda_aware()
        self.ops = ops_for(self.info.framework, self.info.is_cuda and not self.staged)
        self._resources = resources if resources is not None else {}
        #: Staged mode: the streamed copies of this call (see :meth:`stream`).
        self.pipe: Pipeline | None = None
        self._dev_result: Any = None
        if self.staged:
            # Staging copies are queued on the data's own stream, behind its producer:
            # no host-side wait is needed before them.
            self.io = device_io(self.x, self.info.framework)
        else:
            synchronize(self.x, self.info)

    # -- work arrays
    @property
    def work_dtype(self) -> Any:
        return self.x.dtype

    def _device_kw(self) -> dict[str, Any]:
        if self.info.framework == "torch" and not self.staged:
            return {"device": self.x.device}
        return {}

    def input_view(self) -> Any:
        """The input as a flat work array; may alias the caller's memory (do not write)."""
        if self.staged:
            host = staging_pool(self._resources).get(self.info, self.info.numel, "in")
            self._download(self.device_flat(), host)
            return host
        return self.ops.flat(self.x)

    def writable_copy(self, out: Any = None) -> Any:
        """A flat work array holding the input that the caller may overwrite.

        When ``out`` is given (and not staged) the array *is* ``out``'s memory, so an
        in-place algorithm leaves its result where the caller wants it.
        """
        if self.staged:
            return self.input_view()  # the pinned copy is ours to overwrite
        source = self.ops.flat(self.x)
        if out is not None:
            target = self.ops.flat(out)
            in_place = out is self._given  # contiguous (check_out), so target is source
            if not in_place and self.ops.data_ptr(target) != self.ops.data_ptr(source):
                self.ops.copy_(target, source)
            return target
        result = self.empty(self.info.numel)
        self.ops.copy_(result, source)
        return result

    def result_array(self, numel: int, out: Any = None) -> Any:
        """An uninitialized flat work array of ``numel`` elements for the result."""
        if self.staged:
            return staging_pool(self._resources).get(self.info, numel, "out")
        if out is not None:
            return self.ops.flat(out)
        return self.empty(numel)

    def stream(self, numel: int, shape: tuple[int, ...], out: Any = None,
               slot: str = "out") -> Pipeline:
        """Staged mode: a :class:`~mpicomm.staging.Pipeline` whose host array (``numel``
        elements, the pool's ``slot``) the algorithm runs on, streaming uploads into
        ``out`` (or a new device array of ``shape``) as parts become final; downloads
        are queued with :meth:`Pipeline.prefetch` from :meth:`device_flat`.
        :meth:`deliver` of the host array waits for the last upload."""
        if not self.staged:
            raise RuntimeError("Buffer.stream is for staged CUDA data only")
        host = staging_pool(self._resources).get(self.info, numel, slot)
        self._dev_result = self.io.empty(tuple(shape)) if out is None else out
        dev_out = self._dev_result.reshape(-1)
        self.pipe = Pipeline(self.io, host, dev_out, self._chunk_elems())
        return self.pipe

    def streamed_input(self, ranges: list[tuple[int, int]]) -> Pipeline:
        """Staged mode: the whole input in the pool's ``"in"`` slot, its downloads queued
        in the order ``ranges`` will be read (the algorithm waits with ``Ctx.need``); for
        algorithms whose result is small and uploaded whole by :meth:`deliver`."""
        host = staging_pool(self._resources).get(self.info, self.info.numel, "in")
        pipe = Pipeline(self.io, host, None, self._chunk_elems())
        pipe.prefetch(self.device_flat(), 0, ranges)
        return pipe

    def device_flat(self) -> Any:
        """Staged mode: the caller's device data as one flat contiguous device array."""
        if self.info.framework == "torch":
            return self.x.reshape(-1)
        import cupy

        with self.x.device:  # a non-contiguous input is copied on its own device
            return cupy.ascontiguousarray(self.x).reshape(-1)

    def _chunk_elems(self) -> int:
        return max(1, staging_chunk_bytes() // self.info.itemsize)

    def empty(self, numel: int) -> Any:
        """Scratch space: a flat work array of ``numel`` elements, same dtype."""
        if self.info.framework == "torch":
            return self.ops.empty(numel, self.x.dtype, **self._device_kw())
        if self.staged:
            return np.empty(numel, dtype=self.info.dtype)
        return self.ops.empty_like(self.x, numel)  # cupy: on x's device

    # -- delivery
    def check_out(self, out: Any, shape: tuple[int, ...]) -> None:
        """Validate an ``out=`` argument for a result of ``shape`` (before communicating)."""
        if out is None:
            return
        o = self.info if out is self._given else inspect(out)  # out=buf: already known
        if (o.framework, o.dtype, o.device) != (self.info.framework, self.info.dtype,
                                                  self.info.device):
            raise TypeError(
                f"out is a {o.framework} {o.dtype} array on {o.device}, but the input is a "
                f"{self.info.framework} {self.info.dtype} array on {self.info.device}"
            )
        if o.shape != tuple(shape):
            raise ValueError(f"out has shape {o.shape}, the result has shape {tuple(shape)}")
        contiguous = out.is_contiguous() if o.framework == "torch" else out.flags.c_contiguous
        if not contiguous:
            raise ValueError("out must be contiguous")

    def deliver(self, work: Any, shape: tuple[int, ...], out: Any = None) -> Any:
        """Turn the finished work array into the caller's kind of object of ``shape``."""
        shape = tuple(shape)
        if self.staged:
            pipe = self.pipe
            if pipe is not None and work is pipe.host:  # streamed (see stream)
                n = int(work.shape[0])
                if pipe.uploaded == 0:
                    self._upload_via(pipe, n)
                elif pipe.uploaded != n:
                    raise RuntimeError(f"streamed staging uploaded {pipe.uploaded} of {n} "
                                       "elements: the algorithm missed a final part")
                else:
                    pipe.drain()
                self.pipe = None
                return self._dev_result.reshape(shape) if out is None else out
            if out is None:
                out = self.io.empty(shape)
            self._upload(work, out)
            return out
        if out is not None:
            target = self.ops.flat(out)
            if not self.ops.shares_memory(target, work):
                self.ops.copy_(target, work)
            return out
        return self.ops.reshape(work, shape)

    # -- device transfers (staged mode only): chunked copies on the data's own stream
    @traced("stage to host", cat="staging",
            describe=lambda b, _: {"bytes": b.arguments["self"].info.nbytes})
    def _download(self, dev: Any, host: Any) -> None:
        Pipeline(self.io, host, None, self._chunk_elems()).download_all(dev)

    @traced("stage to device", cat="staging",
            describe=lambda b, _: {"bytes": b.arguments["self"].info.nbytes})
    def _upload(self, host: Any, dev: Any) -> None:
        self._upload_via(Pipeline(self.io, host, dev.reshape(-1), self._chunk_elems()),
                         int(host.shape[0]))

    @staticmethod
    def _upload_via(pipe: Pipeline, n: int) -> None:
        pipe.final(0, n)
        pipe.drain()


# ---------------------------------------------------------------------- conversions
def to_torch(x: Any) -> Any:
    """A torch tensor sharing memory with ``x`` (numpy via ``from_numpy``, cupy via DLPack)."""
    import torch

    fw = framework_of(x)
    if fw == "torch":
        return x
    if fw == "numpy":
        return torch.from_numpy(np.ascontiguousarray(x))
    return torch.from_dlpack(x)


def from_torch(t: Any, like: Any) -> Any:
    """``t`` converted to the framework of ``like`` (zero-copy where possible)."""
    fw = framework_of(like)
    if fw == "torch":
        return t
    if fw == "numpy":
        return t.detach().cpu().numpy()
    import cupy

    return cupy.from_dlpack(t.detach())
