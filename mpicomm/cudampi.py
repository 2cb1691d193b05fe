"""CUDA and MPI: may device pointers be handed to MPI, and waiting for a device stream.

Whether MPI may be given device pointers is decided once per process by
:func:`cuda_aware`: ``MPICOMM_CUDA_AWARE=0`` forces staging; ``auto`` (the default) asks
the MPI library through ``MPIX_Query_cuda_support`` (called with ctypes, since mpi4py has
no wrapper), then Open MPI's ``ompi_info``, and otherwise assumes *not* aware, the only
safe default (a wrong "yes" segfaults). ``MPICOMM_CUDA_AWARE=1`` forces device pointers
for a library that cannot be asked, but is refused with ``ValueError`` when the library
answers that it has no CUDA support. The decision is logged once at INFO level
(:func:`cuda_aware_reason` gives it with its reason, for ``python -m mpicomm info``).

Before MPI reads device memory, the producing stream is synchronized
(:func:`synchronize`): MPI knows nothing of CUDA streams, so without it MPI could send
data a kernel has not written yet.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
from typing import Any

from mpi4py import MPI

from .config import env_choice

__all__ = ["cuda_aware", "cuda_aware_reason", "synchronize"]

log = logging.getLogger("mpicomm.buffers")  # the logger name users configure


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


def cuda_aware_reason() -> tuple[bool, str]:
    """``(aware, why)``: the decision of :func:`cuda_aware` and its reason, without
    logging it (``ValueError`` as there)."""
    return _probe_cuda_aware()


def synchronize(x: Any, info: Any) -> None:
    """Wait for the stream producing ``x`` (no-op for host data); ``info`` is its
    :class:`~mpicomm.buffers.BufferInfo`."""
    if not info.is_cuda:
        return
    if info.framework == "torch":
        import torch

        torch.cuda.current_stream(x.device).synchronize()
    else:
        import cupy

        with x.device:  # the current stream of x's device, not of the current device
            cupy.cuda.get_current_stream().synchronize()
