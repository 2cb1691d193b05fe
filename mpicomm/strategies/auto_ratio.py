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

Cost: where the scheme selects exact Top-k on the rank itself (Allgather Top-k; gTop-k;
AR-Top-k on the step's source) its own selection is the reference, for free. Elsewhere
(dense, PowerSGD, AR-Top-k's other ranks) the reference costs one more top-k selection
(1-3 ms for 1.1e6 floats on one core: 10% of a dense step of a small model on a fast
link, which would tilt the selector against dense), so it is measured on every
:data:`REFERENCE_EVERY`-th step of a bucket at one ratio and carried to the steps between
as the measured share ``||top-k(g_e)||² / ||g_e||²`` times the step's own ``||g_e||²``
(:meth:`RatioControl.due`, :meth:`RatioControl.settle`). A probe step takes the masses
at every candidate from one sort (:func:`~mpicomm.compress.topk_select.topk_masses`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ..compress.topk import k_for
from ..compress.topk_select import topk_masses
from ..control.cr import CRController

__all__ = ["RatioControl", "REFERENCE_EVERY"]

#: Steps of a bucket at one ratio between two measured references where the reference
#: costs a selection of its own: the share of Top-k's mass moves slowly (the CR
#: controller smooths it further), a selection per step would not.
REFERENCE_EVERY = 8


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
        #: bucket -> (step, ratio, ||top-k(g_e)||² / ||g_e||²) of its last measurement
        self._shares: dict[str, tuple[int, float, float]] = {}

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

    def due(self, bucket: str, step: int, ratio: float) -> bool:
        """Whether ``bucket``'s reference is measured at ``step`` (``ratio``): on a probe
        step, the first time at a ratio, and every :data:`REFERENCE_EVERY` steps."""
        last = self._shares.get(bucket)
        return (self.probing or last is None or last[1] != ratio
                or step - last[0] >= REFERENCE_EVERY)

    def settle(self, bucket: str, step: int, ratio: float, ref_sq: Optional[float],
               e_sq: float, *, due: bool, exact: bool) -> Optional[float]:
        """The bucket's reference after the exchange: ``ref_sq`` as measured (kept when
        ``due``), else (``exact``: the scheme kept exact Top-k, ``None``) the last
        measured share times this step's ``||g_e||²``."""
        if due:
            if ref_sq is not None and e_sq > 0:
                self._shares[bucket] = (step, ratio, min(ref_sq / e_sq, 1.0))
            return ref_sq
        if exact or ratio >= 1.0 or bucket not in self._shares:
            return None
        return self._shares[bucket][2] * e_sq

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
