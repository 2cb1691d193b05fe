"""numpy arrays, torch tensors (CPU and CUDA) and cupy arrays as MPI-ready buffers.

The collectives work on *flat work arrays*: 1-D, contiguous, in the caller's framework
and dtype, living either where the caller's data lives or, for CUDA data under an MPI
that is not CUDA-aware, in reusable pinned host memory. :class:`Buffer` hands out those
work arrays and turns a finished work array back into the caller's kind of object, so a
cupy array in gives a cupy array out and a CUDA tensor in gives a CUDA tensor out, of the
same dtype, on the same device. :func:`inspect` describes a caller's array without
touching its data; :func:`to_torch` / :func:`from_torch` convert without copying where
the frameworks allow.

CUDA data: whether MPI may read device memory is decided once per process
(:func:`mpicomm.cudampi.cuda_aware`). If it may, the producing stream is synchronized
before MPI touches the data. If not, device data is copied to a pinned host buffer taken
from the communicator's :class:`~mpicomm.staging.StagingPool` (allocated once, grown on
demand, reused by every later call), in chunks queued asynchronously on the data's own
stream; the large-message ring algorithms stream those copies so that they overlap the
communication (:mod:`mpicomm.staging`). Staging copies need no host-side wait before
them: they are queued on that same stream, behind the producer.

The kernels on work arrays are :mod:`mpicomm.arrayops`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrayops import ops_for
from .config import staging_chunk_bytes
from .cudampi import cuda_aware, synchronize
from .hooks import traced
from .staging import Pipeline, device_io, staging_pool

__all__ = [
    "DTYPES",
    "FLOAT_DTYPES",
    "REDUCE_OPS",
    "BufferInfo",
    "Buffer",
    "framework_of",
    "inspect",
    "to_torch",
    "from_torch",
]

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
