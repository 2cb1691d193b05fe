r"""L-GreCo's measurements: per-layer errors and sizes of every candidate setting.

:class:`mpicomm.control.LGreco` decides from a table of sizes and errors; this module
fills the table on real gradients, with the project's own compressors
(:mod:`mpicomm.compress`), so sizes are their ``wire_bytes`` and errors are
``||A - decompress(compress(A))||`` of that very compressor:

* ``"topk"``: size ``2·k`` words (value + index), error the exact top-k tail
  ``sqrt(Σ_{i>k} |A|²_(i))`` (:func:`topk_tail_errors`);
* ``"qsgd"``: :class:`~mpicomm.compress.QSGD` at each candidate's bits
  (``bucket_size``, fixed ``seed``): its wire bytes and one sample of its stochastic
  quantization error (the expectation falls with the bits; one sample is the paper's
  per-layer measurement as well);
* ``"powersgd"``: :class:`~mpicomm.compress.PowerSGD` at each candidate rank, no warm
  start, on the layer reshaped to its matrix view: its wire bytes (a layer too small to
  compress is sent dense at every rank: same size, zero error) and the error of the one
  power-iteration step the training loop applies, which is at least the SVD tail the
  authors' reference code measures.

:class:`LayerErrors` keeps rank 0's accumulated gradient per layer,
``A_l = Σ_t G_l,t / T`` over the last ``acc_steps`` steps before a decision, and
:meth:`LayerErrors.adjust` measures on rank 0, decides there and broadcasts the
decision, so every rank uses the same settings. Cost of a decision: one
compress/decompress per layer and candidate on rank 0, then one broadcast of the
settings. Where a compression-ratio controller moves the default
(:meth:`mpicomm.control.LGreco.rebase`), the decision is taken again at once on the last
accumulated gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..compress.powersgd import PowerSGD
from ..compress.qsgd import QSGD
from ..compress.topk import TopK
from ..compress.topk_select import topk_masses
from ..control.lgreco import LGreco

__all__ = ["LayerErrors", "topk_tail_errors", "layer_shape", "family_compressor"]


def topk_tail_errors(a: torch.Tensor, ks: Sequence[int]) -> list[float]:
    """``||a - topk_k(a)||`` for each k: the norm of all but the k largest magnitudes
    (:func:`~mpicomm.compress.topk_select.topk_masses` of ``a``'s entries, taken from its total)."""
    flat = a.detach().reshape(-1)
    total = float(flat.double().pow(2).sum())
    return [math.sqrt(max(total - kept, 0.0)) for kept in topk_masses(flat, ks)]


def layer_shape(spec: Any) -> tuple[int, ...]:
    """A layer's shape from ``numel`` (a vector) or a shape."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return (spec,)
    return tuple(int(d) for d in spec)


def family_compressor(lgreco: LGreco, value: Any) -> Any:
    """The project's compressor of ``lgreco``'s family at setting ``value`` (a density,
    bits or a rank), configured as the training loop runs it."""
    if lgreco.family == "topk":
        return TopK(density=float(value))
    if lgreco.family == "qsgd":
        return QSGD(bits=int(value), bucket_size=lgreco.bucket_size, seed=lgreco.seed)
    return PowerSGD(rank=int(value), warm_start=False, seed=lgreco.seed)


class LayerErrors:
    """Accumulated layer gradients and their measured (sizes, errors) per candidate.

    ``lgreco`` is the controller whose candidates are measured and whose decisions
    :meth:`adjust` puts in force. Call :meth:`accumulate` on rank 0 only, on the steps
    ``lgreco.accumulating(step)`` says.
    """

    def __init__(self, lgreco: LGreco):
        self.lgreco = lgreco
        self._acc: dict[str, torch.Tensor] = {}
        self._last: dict[str, torch.Tensor] = {}  # the last decision's accumulated ones

    def compressor(self, layer: str, value: Any = None) -> Any:
        """The compressor of ``layer`` at its setting in force (or at ``value``)."""
        return family_compressor(self.lgreco, self.lgreco.value(layer)
                                 if value is None else value)

    def accumulate_bucket(self, segments: Sequence[tuple[str, int, Any]], c: torch.Tensor,
                          rank: int, step: int) -> None:
        """Rank 0 adds a bucket's error-fed gradient ``c`` (its layers' ``segments``:
        (layer, elements, shape), in order) on the steps before a solve."""
        if rank != 0 or not self.lgreco.accumulating(step):
            return
        offset = 0
        for layer, n, _ in segments:
            self.accumulate(layer, c[offset:offset + n])
            offset += n

    def accumulate(self, layer: str, grad: torch.Tensor) -> None:
        """Add one step's error-fed layer gradient (weight ``1 / acc_steps``)."""
        g = grad.detach().reshape(-1).double() / self.lgreco.acc_steps
        held = self._acc.get(layer)
        self._acc[layer] = g.clone() if held is None else held + g

    def problem(self, numels: dict[str, Any]) -> tuple[list[str], list[list[float]],
                                                       list[list[float]], list[float]]:
        """(layers, sizes, errors, candidates) from the accumulated gradients;
        ``numels[layer]`` a numel or a shape (a shape is needed for PowerSGD's matrix
        view; an int means a vector)."""
        lg = self.lgreco
        cands = lg.candidates()
        acc = self._acc if self._acc else self._last
        layers = [name for name in numels if name in acc]
        sizes, errors = [], []
        for name in layers:
            shape = layer_shape(numels[name])
            n = math.prod(shape)
            if lg.family == "topk":
                ks = [max(1, min(n, math.ceil(c * n))) for c in cands]
                sizes.append([2.0 * k for k in ks])
                errors.append(topk_tail_errors(acc[name], ks))
                continue
            a = acc[name].float().reshape(shape)
            row_s, row_e = [], []
            for c in cands:
                comp = self.compressor(name, c)
                approx = comp.decompress(comp.compress(a, name=name))
                row_s.append(float(comp.wire_bytes(n, 4, shape=shape)
                                   if lg.family == "powersgd" else comp.wire_bytes(n, 4)))
                row_e.append(float(torch.linalg.vector_norm((a - approx).double())))
            sizes.append(row_s)
            errors.append(row_e)
        return layers, sizes, errors, cands

    def solve(self, numels: dict[str, Any]) -> dict[str, Any]:
        """:meth:`problem` measured here, decided by :meth:`LGreco.decide` (local)."""
        layers, sizes, errors, _ = self.problem(numels)
        return self.lgreco.decide(layers, sizes, errors)

    def adjust(self, comm: Any, numels: dict[str, Any]) -> dict[str, float]:
        """Measure and decide on rank 0, broadcast, put in force (collective). The
        accumulated gradients are kept until the next accumulation starts, so that a
        new default (:meth:`LGreco.rebase`, the ratio controller moved) is re-solved at
        once on the latest gradients (rank 0 holds one model's worth of float64)."""
        decision = None
        if comm.rank == 0:
            decision = self.solve(numels)
        decision = comm.bcast_object(decision, root=0)
        values = self.lgreco.apply(decision)
        if self._acc:
            self._last, self._acc = self._acc, {}
        return values
