"""``digits-mlp``: scikit-learn's bundled handwritten digits and a ReLU MLP.

Data: ``sklearn.datasets.load_digits`` (1 797 8x8 images, 10 classes; ships with
scikit-learn, nothing is downloaded), a fixed stratified split (``test_fraction``, default
0.2: 1 437 training and 360 test images, ``random_state=0``), features standardized with
the training split's mean and standard deviation (constant border pixels keep std 1).
Cached after the first build, so later runs do not import scikit-learn.

Model: ``64 -> hidden x layers -> 10`` with ReLU (default 2 hidden layers of 128: 26 122
parameters). Cost per example: about ``2 * parameters`` FLOPs forward, twice that
backward; a step at batch 32 takes well under a millisecond of compute, so at 8 ranks the
whole run is ~11 steps per epoch and dominated by per-step overheads. Use it for tests and
demos; judge controllers and compression on ``mnist1d-cnn`` or ``text-lm``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import (
    ArrayShard,
    Info,
    Workload,
    classification_eval,
    count_parameters,
    cross_entropy,
    require,
    step_flops,
)
from .cache import cached_arrays

NAME = "digits-mlp"
OPTIONS = {"hidden": 128, "layers": 2, "test_fraction": 0.2}
DEFAULTS = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "epochs": 30, "batch": 32}


def load(test_fraction: float) -> dict[str, np.ndarray]:
    """The standardized split as float32 / int64 arrays ``x, y, x_test, y_test``."""
    def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        require("sklearn", NAME, extra="examples")
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction,
                                                  random_state=0, stratify=y)
        mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
        std[std == 0] = 1.0
        arrays = {"x": ((x_tr - mean) / std).astype(np.float32), "y": y_tr.astype(np.int64),
                  "x_test": ((x_te - mean) / std).astype(np.float32),
                  "y_test": y_te.astype(np.int64)}
        return arrays, {"source": "sklearn.datasets.load_digits",
                        "split": f"stratified, test_fraction {test_fraction}, random_state 0"}

    arrays, _ = cached_arrays(f"digits-v1-test{test_fraction:g}", build)
    return arrays


def mlp(widths: list[int], seed: int) -> torch.nn.Module:
    """ReLU MLP through ``widths``, initialized from ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])


def build(*, rank: int, size: int, seed: int, batch: int, hidden: int, layers: int,
          test_fraction: float) -> Workload:
    data = load(test_fraction)
    t = torch.from_numpy
    x, y, x_test, y_test = t(data["x"]), t(data["y"]), t(data["x_test"]), t(data["y_test"])
    shard = ArrayShard(x, y, rank=rank, size=size, seed=seed, batch=batch, name=NAME)
    model = mlp([64, *[hidden] * layers, 10], seed)

    def evaluate(m: torch.nn.Module, comm: Any, split: str) -> dict[str, float]:
        return classification_eval(m, *((x, y) if split == "train" else (x_test, y_test)),
                                   comm)

    info = Info(NAME, f"digits 8x8, MLP 64-{'-'.join([str(hidden)] * layers)}-10",
                count_parameters(model), 0, len(y), len(y_test), batch, shard.steps_per_epoch,
                "accuracy", "max", False, step_flops(model, x[:batch]), dict(DEFAULTS),
                data={"source": "sklearn.datasets.load_digits", "test_fraction": test_fraction},
                options={"hidden": hidden, "layers": layers, "test_fraction": test_fraction})
    return Workload(NAME, model, shard, cross_entropy, evaluate, info)
