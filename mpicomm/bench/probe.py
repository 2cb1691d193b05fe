"""What a compressing strategy sends, measured during training: a harness ``on_step`` hook.

:class:`CompressionProbe` watches a run of the time-to-accuracy harness
(:mod:`mpicomm.bench.harness`) through its ``on_step`` hook, after each optimizer step,
when every parameter's ``.grad`` holds the synchronized update of that step:

* **per-layer density of the update**: for every parameter, the fraction of its entries
  that the synchronized gradient changed (nonzero entries / entries), summed over a window
  of ``every`` steps and kept as the window's mean. For Top-k, gTop-k and AR-Top-k this
  is where the selected entries land (Top-k's Allgather applies the union of the ranks'
  picks, gTop-k and AR-Top-k the k global entries); for a dense strategy it is ~1.
* **residual norm**: every ``every`` steps, the L2 norm of the strategy's error-feedback
  memory (all buffers; with momentum correction the accumulated residual, not the
  velocity), averaged over the ranks, next to the norm of the update itself.

Cost per step: one count of nonzero entries per parameter (O(d), no communication);
every ``every`` steps one pass over the residuals (O(d)) and one small allreduce on the
training communicator (the strategy's own traffic counters do not see it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["CompressionProbe"]


class CompressionProbe:
    """Records the per-layer density of the synchronized update and the residual norm
    every ``every`` steps; :meth:`as_dict` is what goes into a run's JSON. ``comm``: the
    training communicator (every rank calls the hook at every step)."""

    def __init__(self, comm: Any, every: int = 25) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.comm, self.every = comm, every
        self.layers: list[str] = []
        self.sizes: list[int] = []
        self.steps: list[int] = []
        self.density: list[list[float]] = []      # per window, per layer
        self.residual_norm: list[float] = []
        self.update_norm: list[float] = []
        self._nonzero: list[int] = []
        self._window = 0

    def on_step(self, step: int, ctx: Any) -> None:
        """The harness hook (``train(..., on_step=probe.on_step)``)."""
        params = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
        if not self.layers:
            self.layers = [n for n, _ in params]
            self.sizes = [p.numel() for _, p in params]
            self._nonzero = [0] * len(params)
        sq = 0.0
        for i, (_, p) in enumerate(params):
            if p.grad is not None:
                g = p.grad.detach()
                self._nonzero[i] += int(torch.count_nonzero(g))
                if step % self.every == 0:
                    sq += float(torch.sum(g.double() ** 2))
        self._window += 1
        if step % self.every:
            return
        comm = self.comm
        self.steps.append(step)
        self.density.append([nz / (self._window * n)
                             for nz, n in zip(self._nonzero, self.sizes)])
        self._nonzero = [0] * len(params)
        self._window = 0
        self.update_norm.append(math.sqrt(sq))
        memory = getattr(ctx.sync.strategy, "memory", None) \
            if hasattr(ctx.sync, "strategy") else None
        local = memory.norm() if memory is not None and len(memory) else 0.0
        self.residual_norm.append(float(comm.allreduce_value(local, "sum")) / comm.size)

    def as_dict(self) -> dict[str, Any]:
        """``{"every", "layers", "sizes", "steps", "density", "residual_norm",
        "update_norm"}``: one entry per window of ``every`` steps."""
        return {"every": self.every, "layers": self.layers, "sizes": self.sizes,
                "steps": self.steps, "density": self.density,
                "residual_norm": self.residual_norm, "update_norm": self.update_norm}
