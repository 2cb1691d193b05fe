"""A model's training step in the virtual clock's cost table.

Under the virtual clock (``mpicomm.clock``) a training loop's own compute costs
nothing unless it is charged. ``calibrate_model`` measures one model's step with the
ranks taking turns (``mpicomm.clock.calibrate_calls``: thread CPU time, one torch
thread, the minimum of repeated samples) and enters three per-call costs in the table:

``forward``    ``loss_fn(model(inputs), target)`` with autograd recording;
``backward``   ``loss.backward()`` (forward + backward measured, minus ``forward``);
``optimizer``  ``optimizer.step()`` (only with an optimizer).

The loop then charges them::

    mpicomm.clock.charge("forward")
    loss = loss_fn(model(x), y)
    loss.backward()
    mpicomm.clock.charge("backward")     # after it: the time backward ends
    sync.step(optimizer)
    mpicomm.clock.charge("optimizer")

``GradientSync`` hands each bucket to its thread at the time backward has produced it
(the bucket's share of ``backward`` after the step's first gradient,
``mpicomm.torch.bucket_pipeline``), so the overlap of the averaging with backward is
the model's; the loop's own ``charge("backward")`` after ``loss.backward()`` then ends
backward at the same time (charge it after, not before). A GPU's step can be declared instead
(``mpicomm.clock.declare("backward", seconds)``). The model's parameters, gradients and
the optimizer's state are restored after measuring. Cost: ``(repeats + 1)`` forward
passes and forward+backward passes (and optimizer steps) per measuring rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from .. import clock
from ..comm import Communicator, resolve
from ..costtable import CostTable

__all__ = ["calibrate_model"]


def calibrate_model(model: torch.nn.Module, inputs: Any, target: Any,
                    loss_fn: Callable[[Any, Any], torch.Tensor],
                    optimizer: torch.optim.Optimizer | None = None,
                    comm: Communicator | None = None, repeats: int = 5,
                    turns: int | None = 1) -> CostTable:
    """Measure ``forward``, ``backward`` (and ``optimizer``) of one step of ``model`` on
    ``(inputs, target)`` into the clock's cost table (collective over ``comm``; see the
    module docstring). ``turns``: how many ranks measure in turn (1: rank 0 while the
    others sleep). Returns the measured entries; on the wall clock they are measured and
    returned but charge nothing."""
    comm = resolve(comm)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    saved_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    def forward() -> None:
        loss_fn(model(inputs), target)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), target).backward()

    calls: dict[str, Callable[[], Any]] = {"forward": forward,
                                           "forward+backward": forward_backward}
    if optimizer is not None:
        forward_backward()
        calls["optimizer"] = optimizer.step
    try:
        measured = clock.calibrate_calls(calls, repeats, comm.mpi, turns)
    finally:
        model.load_state_dict(saved_model)
        if optimizer is not None and saved_opt is not None:
            optimizer.load_state_dict(saved_opt)
        for p, g in zip(model.parameters(), saved_grads):
            p.grad = g
    fb = measured.ops.pop("forward+backward")
    backward = max(0.0, fb.per_call - measured.ops["forward"].per_call)
    measured.ops["backward"] = type(fb)(backward, 0.0, "call", "measured")
    table = clock.cost_table()
    if table is not None:
        table.ops.pop("forward+backward", None)
        table.ops["backward"] = measured.ops["backward"]
    return measured
