"""``cnn-large-synthetic``: a VGG-like CNN of more than 10 M parameters on random images,
for throughput only (its metric, the loss on a fixed random batch, means nothing).

Model (``width`` scales every layer; default 1): 3x3 convolutions with ReLU and 2x2 max
pooling on 3x32x32 inputs, ``32 - pool - 64 - pool - 128 - pool - 256 - pool - 512 - 512 -
512`` channels, then a fully connected ``2048 -> 2048 -> 10`` classifier: 10.7 M
parameters, most of them (like VGG's) in the last convolutions and the first linear layer,
for about 43 M multiply-adds per image forward. A step at the default batch 8 costs about
0.2 GFLOP forward and backward per image on one core; the gradient is 43 MB of float32,
so communication dominates on any real network: the regime where compression pays.

Data: every batch is drawn from a generator seeded by ``(seed, rank, epoch, step)``:
normal inputs, uniform labels. ``steps_per_epoch`` (default 100) steps make an epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .base import Info, Shard, Workload, WorkloadError, count_parameters, cross_entropy, step_flops

NAME = "cnn-large-synthetic"
OPTIONS = {"width": 1.0, "steps_per_epoch": 100, "image": 32}
DEFAULTS = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "epochs": 1, "batch": 8}
EVAL_BATCH = 64


class RandomShard(Shard):
    """Random images and labels, a fresh seeded batch every step."""

    def __init__(self, *, rank: int, seed: int, batch: int, steps_per_epoch: int,
                 image: int) -> None:
        self.rank, self.seed, self.batch, self.image = rank, seed, batch, image
        self.steps_per_epoch = steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.batch

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(self.steps_per_epoch):
            gen = torch.Generator().manual_seed(hash((self.seed, self.rank, epoch, step))
                                                & 0x7FFFFFFF)
            yield (torch.randn(self.batch, 3, self.image, self.image, generator=gen),
                   torch.randint(0, 10, (self.batch,), generator=gen))


def vgg_like(width: float, image: int) -> torch.nn.Sequential:
    def c(n: int) -> int:
        return max(1, round(n * width))

    layers: list[torch.nn.Module] = []
    cin, side = 3, image
    for cout in (32, "M", 64, "M", 128, "M", 256, "M", 512, 512, 512):
        if cout == "M":
            layers.append(torch.nn.MaxPool2d(2))
            side //= 2
            continue
        layers += [torch.nn.Conv2d(cin, c(cout), 3, padding=1), torch.nn.ReLU()]
        cin = c(cout)
    flat = cin * side * side
    layers += [torch.nn.Flatten(), torch.nn.Linear(flat, c(2048)), torch.nn.ReLU(),
               torch.nn.Linear(c(2048), 10)]
    return torch.nn.Sequential(*layers)


def build(*, rank: int, size: int, seed: int, batch: int, width: float, steps_per_epoch: int,
          image: int) -> Workload:
    if not width > 0 or steps_per_epoch < 1 or image < 16 or image % 16:
        raise WorkloadError(f"workload {NAME!r}: width must be > 0, steps_per_epoch >= 1 "
                            f"and image a multiple of 16, got {width}, {steps_per_epoch}, "
                            f"{image}")
    shard = RandomShard(rank=rank, seed=seed, batch=batch, steps_per_epoch=steps_per_epoch,
                        image=image)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = vgg_like(width, image)
    gen = torch.Generator().manual_seed(12345)
    fixed = (torch.randn(EVAL_BATCH, 3, image, image, generator=gen),
             torch.randint(0, 10, (EVAL_BATCH,), generator=gen))

    @torch.no_grad()
    def evaluate(m: torch.nn.Module, comm: Any, split: str) -> dict[str, float]:
        loss = float(cross_entropy(m, fixed)[0])  # the same batch on every rank: no exchange
        return {"loss": loss}

    info = Info(NAME, f"VGG-like CNN x{width:g} on random {image}x{image} images "
                "(timing only)", count_parameters(model), 0, steps_per_epoch * batch * size,
                EVAL_BATCH, batch, steps_per_epoch, "loss", "min", True,
                step_flops(model, fixed[0][:batch]), dict(DEFAULTS),
                data={"source": "random normal images, uniform labels"},
                options={"width": width, "steps_per_epoch": steps_per_epoch, "image": image})
    return Workload(NAME, model, shard, cross_entropy, evaluate, info)
