r"""The update rules a server applies to its shards, elementwise like ``torch.optim``.

Every rule here is elementwise, so applying it piece by piece to a key split over several
servers gives exactly what it gives on the whole key. The operations and their order
follow PyTorch's single-tensor (CPU) implementations, so a synchronous PS run with these
rules matches ``torch.optim`` on allreduce-averaged gradients to the last few ulps.

``sgd`` (``torch.optim.SGD``, no dampening, no Nesterov), gradient ``g``:

.. math::
    g \leftarrow g + \lambda p;\quad
    b \leftarrow \begin{cases} g & \text{first step}\\ \mu b + g & \text{after}\end{cases};
    \quad p \leftarrow p - \eta\, b \quad(\mu = 0:\ p \leftarrow p - \eta g)

``adam`` (``torch.optim.Adam``, L2 weight decay, betas 0.9/0.999, eps 1e-8), step ``t``:

.. math::
    g \leftarrow g + \lambda p;\quad m \leftarrow m + (1-\beta_1)(g - m);\quad
    v \leftarrow \beta_2 v + (1-\beta_2) g^2;\quad
    p \leftarrow p - \frac{\eta}{1-\beta_1^t}\,
        \frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}

Cost: a few passes over the shard per update (SGD 1-3, Adam about 8); state: one buffer
(SGD with momentum) or two (Adam) of the shard's size, plus Adam's step count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["OPTIMIZERS", "ShardOptimizer"]

OPTIMIZERS = ("sgd", "adam")


class ShardOptimizer:
    """One update rule with its hyper-parameters; the per-shard state is a plain dict.

    State dicts hold only tensors and ints (``{"momentum_buffer": t}``, ``{"exp_avg": m,
    "exp_avg_sq": v, "step": n}``), so they go into a ``weights_only`` checkpoint as is.
    """

    def __init__(self, kind: str, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        if kind not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {kind!r}; choose one of {', '.join(OPTIMIZERS)}")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if kind == "adam" and momentum != 0:
            raise ValueError("momentum is an SGD setting; Adam uses its betas (0.9, 0.999)")
        self.kind = kind
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.betas = betas
        self.eps = eps

    def describe(self) -> dict[str, Any]:
        return {"optimizer": self.kind, "lr": self.lr, "momentum": self.momentum,
                "weight_decay": self.weight_decay}

    def init_state(self, param: torch.Tensor) -> dict[str, Any]:
        """Fresh state for a shard like ``param``."""
        if self.kind == "adam":
            return {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param),
                    "step": 0}
        return {}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
        """Update ``param`` in place with ``grad`` (``grad`` may be overwritten)."""
        for _ in self.step_parts(param, grad, state, [(0, param.numel())]):
            pass

    def step_parts(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                   bounds: Sequence[tuple[int, int]],
                   cut: Callable[[torch.Tensor], Sequence[torch.Tensor]] | None = None
                   ) -> Iterator[tuple[int, int]]:
        """One update of the flat ``param`` done part by part: yields ``(start, stop)``
        once ``param[start:stop]`` holds its new value, so that a caller can send it
        while the next part is updated. The rules are elementwise and the step count
        advances once, so the parts together are the same update as :meth:`step` (the
        same bits where the parts' bounds are multiples of the CPU's vector width).
        ``bounds`` must cover ``param`` in order. ``cut(t)``, if given, returns ``t`` (the
        parameter, the gradient or a state buffer) cut at ``bounds``: a caller that keeps
        the views saves the slicing (about 1 us a slice warm, several after a large
        transfer has gone through the caches)."""
        cut = cut or _slicer(bounds, param.numel())
        if self.kind == "adam":
            state["step"] = step = int(state["step"]) + 1
            for i, (p, g, m, v) in enumerate(zip(cut(param), cut(grad),
                                                 cut(state["exp_avg"]),
                                                 cut(state["exp_avg_sq"]))):
                self._adam(p, g, m, v, step)
                yield bounds[i]
            return
        buf, first = None, False
        if self.momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:   # the first step: b <- g (written part by part below)
                buf = state["momentum_buffer"] = torch.empty_like(grad)
                first = True
        bufs = [None] * len(bounds) if buf is None else cut(buf)
        for i, (p, g, b) in enumerate(zip(cut(param), cut(grad), bufs)):
            self._sgd(p, g, b, first)
            yield bounds[i]

    def _sgd(self, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None,
             first: bool) -> None:
        if self.weight_decay != 0:
            g = g.add(p, alpha=self.weight_decay)
        if buf is not None:
            if first:
                buf.copy_(g)
            else:
                buf.mul_(self.momentum).add_(g)
            g = buf
        p.add_(g, alpha=-self.lr)

    def _adam(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
              step: int) -> None:
        beta1, beta2 = self.betas
        if self.weight_decay != 0:
            g = g.add(p, alpha=self.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1 ** step
        bias2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
        p.addcdiv_(m, denom, value=-(self.lr / bias1))


def _slicer(bounds: Sequence[tuple[int, int]], numel: int
            ) -> Callable[[torch.Tensor], Sequence[torch.Tensor]]:
    """A ``cut`` for :meth:`ShardOptimizer.step_parts` that slices afresh (the tensor
    itself where one part covers it)."""
    if len(bounds) == 1 and tuple(bounds[0]) == (0, numel):
        return lambda t: [t]
    return lambda t: [t[a:b] for a, b in bounds]
