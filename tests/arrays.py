"""Buffer backends for tests, after mpi4py's ``arrayimpl``: every collective test loops
over each backend present (numpy, torch CPU, torch CUDA, cupy) x each dtype it supports.

``cases()`` yields pytest params ``(backend, dtype)``; backends that are absent on this
machine (no CUDA, no cupy) appear as skipped params with the reason, so a run on a GPU
machine exercises them with no change to the tests.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "int32", "int64")
ALL_DTYPES = FLOATS + INTS


def _torch_cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    return True, ""


def _cupy() -> tuple[bool, str]:
    if importlib.util.find_spec("cupy") is None:
        return False, "cupy is not installed"
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any failure means: no usable GPU
        return False, f"cupy cannot reach a GPU: {exc}"
    return True, ""


@dataclass(frozen=True)
class Backend:
    name: str
    dtypes: tuple[str, ...]
    available: Callable[[], tuple[bool, str]]
    make: Callable[[np.ndarray, str], Any]
    to_numpy: Callable[[Any], np.ndarray]
    gpu: bool = False

    def __str__(self) -> str:
        return self.name


def _np_make(a: np.ndarray, dtype: str) -> Any:
    return np.array(a, dtype=dtype, order="C")  # keeps 0-d (ascontiguousarray would not)


def _torch_make(device: str) -> Callable[[np.ndarray, str], Any]:
    def make(a: np.ndarray, dtype: str) -> Any:
        import torch

        wide = np.float64 if dtype in ("bfloat16", "float16") else dtype
        return torch.from_numpy(np.array(a, dtype=wide, order="C")).to(
            device=device, dtype=getattr(torch, dtype))

    return make


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def _cupy_make(a: np.ndarray, dtype: str) -> Any:
    import cupy

    return cupy.asarray(a.astype(dtype))


def _cupy_to_numpy(x: Any) -> np.ndarray:
    return x.get()


BACKENDS = (
    Backend("numpy", tuple(d for d in ALL_DTYPES if d != "bfloat16"), lambda: (True, ""),
            _np_make, np.asarray),
    Backend("torch-cpu", ALL_DTYPES, lambda: (True, ""), _torch_make("cpu"), _torch_to_numpy),
    Backend("torch-cuda", ALL_DTYPES, _torch_cuda, _torch_make("cuda"), _torch_to_numpy,
            gpu=True),
    Backend("cupy", tuple(d for d in ALL_DTYPES if d != "bfloat16"), _cupy, _cupy_make,
            _cupy_to_numpy, gpu=True),
)


def cases(dtypes: Iterable[str] = ALL_DTYPES) -> list[Any]:
    """pytest params ``(backend, dtype)`` for every backend x requested dtype it supports."""
    wanted = tuple(dtypes)
    params = []
    for backend in BACKENDS:
        ok, reason = backend.available()
        marks = [] if ok else [pytest.mark.skip(reason=f"{backend.name}: {reason}")]
        if backend.gpu:
            marks.append(pytest.mark.gpu)  # ``pytest -m gpu`` selects every CUDA case
        for dtype in wanted:
            if dtype in backend.dtypes:
                params.append(pytest.param(backend, dtype, id=f"{backend.name}-{dtype}",
                                           marks=marks))
    return params


def as_numpy(a: Any) -> np.ndarray:
    """Any backend's array as numpy: floating point widened to float64 (bfloat16
    included), integers as they are."""
    if not isinstance(a, np.ndarray):
        if type(a).__module__.startswith("cupy"):
            a = _cupy_to_numpy(a)
        else:
            a = _torch_to_numpy(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def gaussian(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Seeded standard normal float64 data of ``shape``."""
    return np.random.default_rng(seed).standard_normal(shape)


def tolerance(dtype: str, terms: int = 1) -> dict[str, float]:
    """assert_allclose tolerances for a sum of ``terms`` values in ``dtype`` (0 for ints)."""
    eps = {"float16": 2**-10, "bfloat16": 2**-7, "float32": 2**-23, "float64": 2**-52}
    if dtype not in eps:
        return {"rtol": 0.0, "atol": 0.0}
    return {"rtol": 4 * terms * eps[dtype], "atol": 4 * terms * eps[dtype]}
