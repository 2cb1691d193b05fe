"""Pieces shared by the L-GreCo, CR/calibration and auto-strategy tests: the unit their
link speeds are written in, the compute cost that counts nothing, and a short training
run of a small MLP under ``GradientSync`` with an ``AutoStrategy``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mpicomm.collectives.cost import ComputeParams

if TYPE_CHECKING:
    from mpicomm.comm import Communicator
    from mpicomm.strategies import AutoStrategy

#: Bytes per second in one Gbit/s.
GBPS = 1.25e8
#: Compute parameters under which selection, merges, scatters, flops and copies are free.
ZERO = ComputeParams(select=0, merge=0, scatter=0, flop=0, copy=0)


def train_auto(comm: Communicator, steps: int, calibrate_links: int = 0, lr: float = 0.1,
               after_step: Callable[[AutoStrategy], None] | None = None,
               **options: Any) -> tuple[AutoStrategy, torch.Tensor, list[float]]:
    """``steps`` of a small MLP under ``GradientSync`` with an ``AutoStrategy`` of
    ``options``; ``after_step(auto)`` is called after each step. Returns the strategy,
    the trained weights flattened, and the ratio in force after each step."""
    from mpicomm.strategies import AutoStrategy
    from mpicomm.torch import GradientSync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    auto = AutoStrategy(calibrate_links=calibrate_links, **options)
    gen = torch.Generator().manual_seed(100 + comm.rank)
    seen = []
    with GradientSync(model, strategy=auto, comm=comm, bucket_mb=0.002) as sync:
        for _ in range(steps):
            x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sync.step(opt)
            seen.append(auto.ratio)
            if after_step is not None:
                after_step(auto)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return auto, weights, seen
