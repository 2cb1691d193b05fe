r"""The compression ratio of ``strategy="auto"``: fixed, or the CR controller's.

:class:`RatioControl` is the strategies' side of :class:`mpicomm.control.CRController`:
the ratio in force for the next step, and what the controller is fed. The controller
compares ratios by *Top-k's* gain ``sqrt(Σ||top-k(g_e)||² / Σ||g_e||²)``, ``k`` at the
step's ratio, exact Top-k of each rank's own error-fed bucket
(:meth:`RatioControl.reference`), whatever scheme ran: an exploration window's steps run
different schemes (the cheapest at each ratio), whose own gains are not comparable —
AR-Top-k keeps only what the source rank picked, gTop-k what survived the global
selection. On a probe step it measures that mass at every candidate ratio at once, on
the step's own gradients, beside the exchange at the ratio in force.

Cost: one extra top-k selection per bucket and step where the scheme that ran does not
keep exact Top-k itself (1-3 ms for 1.1e6 floats on one core); a probe step takes the
masses at every candidate from one sort (:func:`~mpicomm.compress.topk_select.topk_masses`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ..compress.topk import k_for
from ..compress.topk_select import topk_masses
from ..control.cr import CRController

__all__ = ["RatioControl"]


class RatioControl:
    """The ratio in force (``fixed``, else ``controller``'s) and the controller's inputs.

    :meth:`reference` measures the step's Top-k mass (and, on a probe step, the masses at
    every candidate, summed into :attr:`probe_sq` until :meth:`take_probe`);
    :meth:`observe` feeds the agreed step to the controller and returns its action
    (``None``, ``"save"`` or ``"restore"``).
    """

    def __init__(self, controller: Optional[CRController], fixed: Optional[float]):
        if (controller is None) == (fixed is None):
            raise ValueError("give a CR controller or a fixed ratio, not both or neither")
        self.controller = controller
        self.fixed = fixed
        #: Σ||top-k(g_e)||² at each candidate ratio over the step's buckets (probe step).
        self.probe_sq: list[float] = []
        self._other_solved: Optional[float] = None  # the step's rest at the last solve

    @property
    def ratio(self) -> float:
        """The CR in force for the next aggregation."""
        if self.fixed is not None:
            return self.fixed
        assert self.controller is not None
        return self.controller.ratio

    @property
    def exploring(self) -> bool:
        return self.controller is not None and self.controller.exploring

    @property
    def probing(self) -> bool:
        return self.controller is not None and self.controller.probing

    def reference(self, ratio: float, fed: Callable[[], torch.Tensor],
                  kept_is_reference: bool) -> Optional[float]:
        """``||top-k(g_e)||²``: what exact Top-k at ``ratio`` would keep of this rank's
        error-fed bucket ``fed()`` (``k = max(1, ceil(ratio·n))``), before the exchange;
        ``None`` where that is what the step keeps itself (``kept_is_reference``:
        Allgather Top-k, the L-GreCo paths) or where there is no Top-k ratio (ratio 1).
        On a probe step, also adds the mass at every candidate ratio to
        :attr:`probe_sq`."""
        probing = self.probing
        if not probing and (kept_is_reference or ratio >= 1.0):
            return None
        vector = fed()
        n = int(vector.shape[0])
        if not probing:
            return topk_masses(vector, [k_for(n, ratio)])[0]
        assert self.controller is not None  # a probe step runs at one of its ratios
        ratios = self.controller.probe_ratios
        masses = topk_masses(vector, [k_for(n, c) for c in ratios] + [k_for(n, ratio)])
        if not self.probe_sq:
            self.probe_sq = [0.0] * len(ratios)
        for i, m in enumerate(masses[:-1]):
            self.probe_sq[i] += m
        return None if kept_is_reference else masses[-1]

    def take_probe(self) -> list[float]:
        """The step's probe masses (empty when it did not probe), and reset them."""
        probe, self.probe_sq = self.probe_sq, []
        return probe

    def observe(self, ran: Optional[float], drift: bool, total: float, ref: float,
                probe: Sequence[float]) -> Optional[str]:
        """One agreed step: ``ran`` the ratio it ran at, ``drift`` whether the network
        changed, ``total`` = ``Σ||g_e||²`` and ``ref`` = ``Σ||top-k(g_e)||²`` over ranks
        and buckets, ``probe`` the probe masses at every candidate (agreed). Returns the
        controller's action."""
        controller = self.controller
        if controller is None:
            return None
        gain = min(math.sqrt(ref / total), 1.0) if total > 0 else 1.0
        if drift:
            controller.network_changed()
        # the probe's masses reach the controller once (the step after the probe ran
        # while its result was being agreed, and measured them too)
        gains = None if not (probe and controller.probing) else {
            c: min(math.sqrt(m / total), 1.0) if total > 0 else 1.0
            for c, m in zip(controller.probe_ratios, probe)}
        if gains is not None or not controller.probing:
            return controller.observe(gain, probe=gains, ratio=ran)
        return None

    def resolve_on_compute(self, other: Optional[float], drift: float) -> None:
        """The controller solves again when ``other``, the measured rest of the step
        (part of its time objective), first becomes known or has moved by the ``drift``
        fraction since its last such solve (agreed numbers: the same on every rank)."""
        controller = self.controller
        if controller is None or other is None or not controller.history:
            return
        last = self._other_solved
        if last is None or abs(other - last) > drift * last:
            self._other_solved = other
            controller.resolve("compute")
