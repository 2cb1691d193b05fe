"""``DistributedOptimizer``: gradient averaging shaped as a wrapper around your optimizer.

For code written against the Horovod/DDP habit of "wrap the optimizer"::

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()                     # buckets are averaged while this runs
        opt.step(loss=loss)                 # waits for the averages, then steps

It is a wrapper by *composition*: it holds the optimizer you built and a
``mpicomm.torch.GradientSync``, and forwards to them. Unlike Horovod's
``DistributedOptimizer`` it never creates a subclass of your optimizer's class at run
time, so ``type(opt.optimizer)``, pickling and ``super()`` calls inside your optimizer all
keep working; the price is that ``isinstance(opt, torch.optim.Optimizer)`` is false. Hand
``opt.optimizer`` to code that insists on a real optimizer, e.g. learning-rate schedulers
(``StepLR(opt.optimizer, ...)``); they share the same ``param_groups``, so the wrapper
sees their changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..strategies import Strategy
from .gradsync import OPTIONS as SYNC_OPTIONS
from .gradsync import GradientSync
from .strategy_options import build_strategy

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """Average gradients across ranks, then step the wrapped ``optimizer``.

    Parameters
    ----------
    optimizer:
        Any ``torch.optim.Optimizer`` over (a subset of) ``model``'s parameters. Every
        parameter it holds must belong to ``model``, so that its gradient is averaged;
        otherwise ``ValueError``.
    model:
        The module whose gradients are synchronized (see ``GradientSync``).
    strategy:
        How gradients are averaged: a ``mpicomm.strategies.Strategy``, ``None`` for
        ``"dense"`` (allreduce), or one of the names dense, topk, gtopk, artopk, randomk,
        qsgd, powersgd, fp16, bf16, sign, hier_topk, hier_gtopk, hier_artopk, auto, with
        its options as keywords (``strategy="gtopk", density=0.05``; the table is in
        ``GradientSync``'s docstring).
    **options:
        ``GradientSync``'s own keywords (``bucket_mb``, ``comm``, ``broadcast``,
        ``on_nonfinite``, ``timeline``, ``metrics``) and the strategy's options. A
        keyword that neither takes raises ``TypeError`` before any communication.

    Construction is collective (it builds a ``GradientSync``, which checks the model
    on every rank and broadcasts rank 0's weights). ``step``, ``zero_grad``,
    ``param_groups``, ``state``, ``defaults``, ``state_dict``, ``load_state_dict`` and
    ``add_param_group`` act on the wrapped optimizer; any other attribute is looked up on
    it too. ``state_dict`` holds the optimizer's state only: a compressing strategy's
    per-rank state (error-feedback residuals) is ``opt.sync.strategy.state_dict()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 strategy: Strategy | str | None = None, **options: Any):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        sync_options = {k: v for k, v in options.items() if k in SYNC_OPTIONS}
        strategy = build_strategy(
            strategy, {k: v for k, v in options.items() if k not in SYNC_OPTIONS},
            owner="DistributedOptimizer", owner_options=SYNC_OPTIONS)
        self.optimizer = optimizer
        self._model_params = {id(p) for p in model.parameters()}
        self._check_params(optimizer.param_groups)
        self.sync = GradientSync(model, strategy, **sync_options)
        #: ``False`` after a step skipped for a non-finite gradient (``on_nonfinite="skip"``).
        self.last_step_ok = True

    def __repr__(self) -> str:
        return f"DistributedOptimizer({type(self.optimizer).__name__}, {self.sync!r})"

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes not found normally; "optimizer" is guarded so that a
        # half-constructed object does not recurse.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    # ------------------------------------------------------------------ stepping
    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> Any:
        """Wait for the averaged gradients, then step the wrapped optimizer.

        ``loss`` (a number or a one-element tensor, this rank's): put into the step's
        metrics record when metrics are on (``metrics=`` or ``MPICOMM_METRICS``), so
        that the plots have a loss curve; with a ``closure``, what it returns is
        recorded instead.

        With a ``closure`` (L-BFGS and friends), each evaluation of it - a forward and a
        backward - is followed by a wait, so the optimizer always sees averaged
        gradients. Returns what the optimizer's ``step`` returns, or ``None`` when a
        non-finite gradient made every rank skip the step (``on_nonfinite="skip"``;
        ``last_step_ok`` is then ``False``). With a closure the optimizer decides
        how often to evaluate it, so a skipped evaluation cannot skip the step: it leaves
        zero gradients for that evaluation and sets ``last_step_ok`` to ``False``.
        """
        self.last_step_ok = self.sync.wait(loss=loss)
        if closure is None:
            if not self.last_step_ok:
                return None
            out = self.optimizer.step()
            # as GradientSync.step: the strategy's end-of-step hook (adaptive decisions,
            # the sparsifiers' default taking over the optimizer's momentum)
            self.sync.strategy.step_done(self.sync.model, self.optimizer)
            return out

        def synchronized_closure() -> Any:
            with torch.enable_grad():
                value = closure()
            self.last_step_ok = self.sync.wait(loss=value) and self.last_step_ok
            return value

        return self.optimizer.step(synchronized_closure)

    def synchronize(self) -> bool:
        """Wait until the gradients of the last backward are averaged (see
        ``GradientSync.wait``); useful before clipping or inspecting them."""
        return self.sync.wait()

    def no_sync(self) -> Any:
        """Accumulate gradients locally in this block (see ``GradientSync.no_sync``)."""
        return self.sync.no_sync()

    def close(self) -> None:
        """Detach from the model (collective; see ``GradientSync.close``)."""
        self.sync.close()

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sync.__exit__(*exc)

    # ------------------------------------------------------------------ delegation
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters must belong to the model."""
        self._check_params([param_group])
        self.optimizer.add_param_group(param_group)

    def _check_params(self, groups: list[dict[str, Any]]) -> None:
        for group in groups:
            params = group["params"]
            if isinstance(params, torch.Tensor):
                params = [params]
            elif not isinstance(params, list):  # a generator would be used up here
                params = group["params"] = list(params)
            for p in params:
                if id(p) not in self._model_params:
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that is "
                        "not in the model; its gradient would not be averaged")
