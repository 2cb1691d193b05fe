"""The array backends and dtypes the compressor tests run over (tests/test_compress.py,
tests/test_compress_methods.py), after mpi4py's ``arrayimpl`` idea: numpy, torch CPU,
torch CUDA and cupy (the last two skipped with a reason where unavailable) x float16,
bfloat16 (torch only), float32 and float64, with conversions to and from numpy and the
seeded Gaussian data the tests compress.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

try:  # pragma: no cover - only on GPU machines
    import cupy

    HAVE_CUPY = bool(cupy.cuda.is_available())
except Exception:  # ImportError, or a CUDA runtime error
    cupy = None
    HAVE_CUPY = False

HAVE_CUDA = torch.cuda.is_available()

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch", id="torch-cpu"),
    pytest.param("torch-cuda", id="torch-cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")]),
    pytest.param("cupy", id="cupy", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUPY, reason="cupy/CUDA unavailable")]),
]
DTYPES = ["float16", "bfloat16", "float32", "float64"]
TORCH_ONLY = {"bfloat16"}


def backend_dtype_params(dtypes: list[str] = DTYPES) -> list[Any]:
    """backend x dtype, without the combinations a framework cannot hold (bfloat16)."""
    out = []
    for b in BACKENDS:
        for d in dtypes:
            if d in TORCH_ONLY and not b.values[0].startswith("torch"):
                continue
            out.append(pytest.param(b.values[0], d, id=f"{b.id}-{d}", marks=b.marks))
    return out


def make_array(backend: str, data: np.ndarray, dtype: str) -> Any:
    if backend == "numpy":
        return np.ascontiguousarray(data.astype(dtype))
    if backend.startswith("torch"):
        t = torch.tensor(data, dtype=getattr(torch, dtype))
        return t.cuda() if backend == "torch-cuda" else t
    return cupy.asarray(data.astype(dtype))


def to_np(a: Any) -> np.ndarray:
    """Any array as a float64 (or integer) numpy array."""
    if isinstance(a, np.ndarray):
        return a.astype(np.float64) if a.dtype.kind == "f" else a
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        return a.double().numpy() if a.is_floating_point() else a.numpy()
    out = cupy.asnumpy(a)
    return out.astype(np.float64) if out.dtype.kind == "f" else out


def gaussian(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)
