r"""Save and restore around the CR controller's exploration windows (``strategy="auto"``).

A window (:class:`mpicomm.control.CRController`, ``probe_triggered=False`` or
``probe_first=False``) runs a few steps at each candidate ratio and then throws them
away: :class:`WindowSnapshot` keeps deep copies of the model's and the optimizer's
``state_dict`` and the strategy's own state (error-feedback residuals, warm starts) at
``"save"`` and loads them back at ``"restore"``. Cost: one copy of the parameters, of
the optimizer's buffers (momentum: another copy) and of the residuals, per window.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from .. import clock

__all__ = ["WindowSnapshot"]


class WindowSnapshot:
    """The state saved at a window's start, restored at its end.

    :meth:`act` carries out an action of the controller; ``overheads`` (the auto
    strategy's) counts the windows (``"windows"``) and the seconds their thrown-away
    steps took (``"exploration_s"``).
    """

    def __init__(self, overheads: dict[str, float]):
        self.overheads = overheads
        self.saved: Optional[dict[str, Any]] = None
        self.saved_at: Optional[float] = None

    def act(self, action: Optional[str], model: Any, optimizer: Any, strategy: Any) -> None:
        """``"save"``: snapshot ``model``, ``optimizer`` and ``strategy.state_dict()``;
        ``"restore"``: load the snapshot back (once); anything else: nothing. Without a
        ``model`` (a caller that never sees it: the DDP hook) the optimizer is neither
        saved nor restored either, since its state (momentum, Adam's moments) belongs to
        the parameters' trajectory that the window keeps; only the strategy's state is
        restored."""
        if model is None:
            optimizer = None
        if action == "save":
            self.saved_at = clock.now()
            self.overheads["windows"] += 1
            self.saved = {
                "model": None if model is None else copy.deepcopy(model.state_dict()),
                "optimizer": None if optimizer is None
                else copy.deepcopy(optimizer.state_dict()),
                "strategy": strategy.state_dict()}
        elif action == "restore" and self.saved is not None:
            saved, self.saved = self.saved, None
            if self.saved_at is not None:  # the window's steps are thrown away
                self.overheads["exploration_s"] += clock.now() - self.saved_at
            if model is not None and saved["model"] is not None:
                model.load_state_dict(saved["model"])
            if optimizer is not None and saved["optimizer"] is not None:
                optimizer.load_state_dict(saved["optimizer"])
            strategy.load_state_dict(saved["strategy"])
