"""``mnist1d-cnn``: MNIST-1D and a 1-D convolutional network of the paper's kind.

Data: MNIST-1D (S. Greydanus, "Scaling Down Deep Learning", 2020, arXiv:2011.14439),
generated here by the ``mnist1d`` package's own generator (``mnist1d.data.make_dataset``
with the package's default transformation arguments and data seed 42; never its download
path): ten 1-D digit templates, padded, translated, sheared, scaled and noised into
length-40 signals. ``train_examples`` (default 40 000) training signals and a quarter of
that held out (the package's 80/20 split), balanced over the 10 classes. Generating 50 000
signals takes about a minute of one core; the result is cached (:mod:`.cache`).

Model (the paper's ``ConvBase`` with ``channels`` filters): three ``Conv1d`` layers (kernel
5 stride 2, then kernel 3 stride 2 twice, padding 1, ReLU) take 40 samples to 19, 10 and 5
positions, then one linear layer from ``5 * channels`` to 10 logits. Parameters:
``channels * (6C + 61) + 10 + ...``: 5 210 at the paper's 25 channels, 105 866 at 128.
The paper reports about 94% test accuracy for its CNN and 68% for an MLP (with 4 000
training signals); more training data raises both.

Cost per example forward about ``2 * (19*5C + 10*3C^2 + 5*3C^2 + 50C)`` FLOPs (3 MFLOP at
C = 128); the default batch of 32 takes a few ms per step on one core.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .base import (
    ArrayShard,
    Info,
    Workload,
    WorkloadError,
    classification_eval,
    count_parameters,
    cross_entropy,
    require,
    step_flops,
)
from .cache import cached_arrays

NAME = "mnist1d-cnn"
OPTIONS = {"train_examples": 40_000, "channels": 128}
DEFAULTS = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "epochs": 13, "batch": 32}
DATA_SEED = 42  # the package's default: the data set is the same for every run seed


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """The generator seeds numpy's and random's global state: restore both after."""
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def load(train_examples: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Arrays ``x, y, x_test, y_test`` (float32 ``[n, 40]`` / int64) and the generator's
    arguments."""
    total = train_examples * 5 // 4  # the package's 80/20 split

    def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        data_mod = require("mnist1d.data", NAME)
        args = data_mod.get_dataset_args()
        args.num_samples, args.seed = total, DATA_SEED
        with _global_rng_kept():
            d = data_mod.make_dataset(args)
        arrays = {"x": d["x"].astype(np.float32), "y": d["y"].astype(np.int64),
                  "x_test": d["x_test"].astype(np.float32),
                  "y_test": d["y_test"].astype(np.int64)}
        meta = {k: v for k, v in vars(args).items() if k != "url"}
        return arrays, {"generator": "mnist1d.data.make_dataset", "args": meta}

    return cached_arrays(f"mnist1d-v1-n{total}-s{DATA_SEED}", build)


class ConvNet1d(torch.nn.Module):
    """Greydanus's ``ConvBase``: 3 strided ``Conv1d`` + ReLU, then a linear classifier."""

    def __init__(self, channels: int, length: int = 40) -> None:
        super().__init__()
        self.conv = torch.nn.Sequential(
            torch.nn.Conv1d(1, channels, 5, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv1d(channels, channels, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv1d(channels, channels, 3, stride=2, padding=1), torch.nn.ReLU())
        out = length
        for k in (5, 3, 3):
            out = (out + 2 - k) // 2 + 1
        self.linear = torch.nn.Linear(channels * out, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.conv(x.unsqueeze(1)).flatten(1))


def build(*, rank: int, size: int, seed: int, batch: int, train_examples: int,
          channels: int) -> Workload:
    if train_examples < 100:
        raise WorkloadError(f"workload {NAME!r}: train_examples must be >= 100, got "
                            f"{train_examples}")
    arrays, meta = load(train_examples)
    t = torch.from_numpy
    x, y = t(arrays["x"]), t(arrays["y"])
    x_test, y_test = t(arrays["x_test"]), t(arrays["y_test"])
    shard = ArrayShard(x, y, rank=rank, size=size, seed=seed, batch=batch, name=NAME)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ConvNet1d(channels, x.shape[1])

    def evaluate(m: torch.nn.Module, comm: Any, split: str) -> dict[str, float]:
        return classification_eval(m, *((x, y) if split == "train" else (x_test, y_test)),
                                   comm)

    info = Info(NAME, f"MNIST-1D ({len(y)} train), 1-D CNN {channels} channels",
                count_parameters(model), 0, len(y), len(y_test), batch, shard.steps_per_epoch,
                "accuracy", "max", False, step_flops(model, x[:batch]), dict(DEFAULTS), data=meta,
                options={"train_examples": train_examples, "channels": channels})
    return Workload(NAME, model, shard, cross_entropy, evaluate, info)
