"""The strategies under test and their inputs, shared by tests/test_strategies.py and
tests/test_strategy_algorithms.py: a factory for every registered strategy (and a few
variants) with small-problem settings, every rank's gradients generated from a seed (so
each rank can replay what all ranks computed), and the conversions of results to numpy
that the checks compare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mpicomm.strategies import (
    ARTopK,
    BF16Allreduce,
    Dense,
    FP16Allreduce,
    GTopK,
    HierarchicalARTopK,
    HierarchicalGTopK,
    HierarchicalTopK,
    PowerSGDAllreduce,
    QSGDAllgather,
    RandomKAllreduce,
    SignAllgather,
    Strategy,
    TopKAllgather,
)

# Every registered strategy (and a few variants), built with small-problem settings.
FACTORIES: dict[str, Callable[[], Strategy]] = {
    "dense": lambda: Dense(),
    "topk": lambda: TopKAllgather(density=0.1),
    "topk-sampled": lambda: TopKAllgather(density=0.1, sampled=True),
    "topk-noef": lambda: TopKAllgather(k=3, error_feedback=False),
    "gtopk": lambda: GTopK(density=0.1),
    "artopk": lambda: ARTopK(density=0.1),
    "artopk-var-tree": lambda: ARTopK(density=0.1, source="var", algorithm="tree"),
    "randomk": lambda: RandomKAllreduce(density=0.1, seed=3),
    "qsgd": lambda: QSGDAllgather(bits=4, bucket_size=64),
    "qsgd-ef": lambda: QSGDAllgather(bits=2, bucket_size=16, error_feedback=True),
    "powersgd": lambda: PowerSGDAllreduce(rank=2),
    "powersgd-late": lambda: PowerSGDAllreduce(rank=1, start_iter=1),
    "fp16": lambda: FP16Allreduce(),
    "bf16": lambda: BF16Allreduce(),
    "sign": lambda: SignAllgather(),
    "hier_topk": lambda: HierarchicalTopK(density=0.1),
    "hier_gtopk-sliced": lambda: HierarchicalGTopK(density=0.1, sliced=True),
    "hier_artopk": lambda: HierarchicalARTopK(density=0.1),
}


def grads(p: int, seed: int, shapes: list[tuple[int, ...]], dtype: str = "float64"
          ) -> list[list[np.ndarray]]:
    """``out[r][t]``: rank r's gradient for tensor t (heavy-tailed, all ranks differ)."""
    out = []
    for r in range(p):
        rng = np.random.default_rng(seed * 7919 + r)
        out.append([rng.standard_t(3, size=s).astype(dtype) for s in shapes])
    return out


def flat(arrays: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


def as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype in (torch.bfloat16,) else x).numpy()
    if isinstance(x, np.ndarray):
        return x
    return x.get()  # cupy
