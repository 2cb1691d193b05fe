"""gTop-k S-SGD: local top-k, butterfly merge-and-truncate, residual put-back."""

from __future__ import annotations

from typing import Any

import torch

from ..collectives import allreduce, cost
from ..compress import TopK
from ..sparse import gtopk
from ..sparse.coding import check_coding
from ._compressed import (
    ADOPT,
    BYTES,
    SparsifyingStrategy,
    check_flag,
    k_of,
    pair_bytes,
    sparsity,
)
from .base import DEFAULT_FUSION_BYTES

__all__ = ["GTopK"]


class GTopK(SparsifyingStrategy):
    r"""Error-fed gTop-k (Shi et al., ICDCS 2019, arXiv 1901.04359) ("gtopk").

    Per fused buffer ``g`` of ``d`` elements on rank r::

        c_r    = g_r + e_r                    # error feedback (e_r = 0 without it)
        L_r    = top-k of |c_r|,  v_r = c_r[L_r]
        (I, V) = gtopk({(L_j, v_j)}_j, k)     # butterfly merge-and-truncate, every rank
        A_r    = the picks of L_r whose own value reached V (tracked along the butterfly)
        e_r    = c_r with the positions A_r zeroed   # every other pick stays
        u      = zeros(d);  u[I] = V / P      # division by P for every index

    The global update is *not* the exact top-k of the sum for P > 2: a value in V may
    miss contributions of ranks whose pair was truncated in an intermediate merge. The
    default (``own_contribution=True``, ours, not the paper's) puts those truncated
    picks back into their rank's residual (tracked locally, no extra traffic; a
    folded-out rank of a non-power-of-two P keeps the index rule), so that on a power
    of two ``Σ_r c_r = P·u + Σ_r e_r`` holds (up to the rounding of the merges' sums):
    no gradient mass is lost, as for AR-Top-k. ``own_contribution=False`` is the
    paper's rule ``A_r = L_r ∩ I``: a rank whose pair was truncated on the way still
    counts the index as sent, and that mass is lost. ``exact_values=True`` keeps the
    butterfly's index set ``I`` but replaces its values by an allreduce (ring, average)
    of every rank's ``c_r[I]``, and every residual is ``c_r`` with ``I`` zeroed: the
    update at ``I`` is the exact mean and the identity above holds at any P. Cost: one
    ring allreduce of k values more, ``2(P-1)/P·k·itemsize`` bytes per rank, about a
    quarter more than the butterfly at P = 8 and 16 (float32). The by-name recipe turns
    it on (below).
    ``coding="log8"`` (with ``exact_values=True`` only) sends the butterfly's sets in
    :mod:`mpicomm.sparse.coding`'s format, about 2.3 bytes a pair at density 0.01
    instead of 8: the butterfly then only chooses the indices (values within the
    coding's 4.4% of each other may trade places at the boundary of the top k), the
    allreduce gives the exact mean there, and the residuals are exact as above. Bytes
    per rank ``lg p2·k·s + 2(P-1)/P·k·itemsize`` with s ≈ 2.3: about half of the plain
    butterfly's, exact values included. Cost: an encode and a decode of k pairs per
    round on the host.
    ``k = max(1, ceil(density·d))`` (or the given ``k``), capped at ``d``; neither given
    means ``density=0.01``. With ``density=1`` no merge truncates and ``u`` is the exact
    mean.

    Bytes sent per rank (s = 4 + itemsize; p2 = largest power of two <= P,
    rem = P - p2; every message holds k pairs as soon as every rank has k picks):
    ``lg p2·k·s`` for a rank of the power-of-two group, plus ``k·s`` (the fold-out) for
    the odd rank of a folded pair (ranks 1, 3, .., 2rem-1); ``k·s`` for the folded-out
    even ranks 0, 2, .., 2rem-2. Nothing at P = 1.

    Class default: error feedback with DGC's momentum correction and masking taken over
    from the optimizer (``momentum_correction="optimizer"``: at the first
    ``GradientSync.step(optimizer)`` an SGD optimizer's momentum m moves into the
    memory and the optimizer's is set to 0) and the put-back of truncated picks
    (``own_contribution=True``). Cost: no bytes; one velocity buffer of the bucket's
    size, one multiply-add per element per step, and an ``isin`` over the k own picks
    per round. ``momentum_correction=0.0`` keeps plain error feedback with the
    optimizer's momentum. Whole-run bytes against a dense ring allreduce (float32, P a
    power of two): ``(P-1) / (P·lg P·density)``, 29x at P = 8 and density 0.01.

    By name (``strategies.make("gtopk")``, ``GradientSync(model, strategy="gtopk")``,
    ``examples/train.py --strategy gtopk``) the default is the recipe measured on
    MNIST-1D's CNN (:func:`mpicomm.strategies.recipe`): plain error feedback
    (``momentum_correction=0.0``, the optimizer keeps its momentum), a density ramp,
    ``schedule=BudgetRamp(0.03, 7.48)``, from 0.03 geometrically down to ``density``
    while sending 7.48 density-steps in all (411 steps at density 0.01, no ramp from
    0.03 on), and the exact values with the coded butterfly (``exact_values=True``,
    ``coding="log8"``); below density 0.003 plain pairs (``coding=None``), still with
    the exact values, and a ramp of 6.2 density-steps instead (``BudgetRamp(0.03,
    6.2)``, 727 steps at 0.001). Cost: per unit of density the plain butterfly sends
    ``P·lg P/(P-1)`` dense allreduces' bytes (``lg P·8`` bytes per pair-slot against
    ``2(P-1)/P·4``), the coded one with the exact values about half of that; a 2 028-step
    run at density 0.01 sends 44.3x (P = 8) and 39.6x (P = 16) fewer bytes than
    dense (25.0x and 20.1x with the plain butterfly's values); one at 0.001 60.9x and
    51.2x (226x and 190x without the ramp and the exact values). Why the ramp: the
    update changes k entries per step, and at density 0.001 the two large layers of
    MNIST-1D's CNN were picked about once per parameter in 2 028 steps; the ramp
    applies 3-30x more entries per step while the gradients change fast. Why plain
    error feedback: at 16 ranks the momentum correction lost 1.07 points against 0.14
    (seed 0, the same ramp). Why the exact values: the butterfly's values are partial
    sums for P > 2 (a truncated rank's value is missing); without them the same recipe
    gave -0.22 (8 ranks) and -0.69 points (16) at density 0.001, and on digits (8 ranks,
    120 steps, density 0.01) -1.11. Why the coding only from 0.003 on: it pays for the
    exact values at density 0.01, and at 0.001 the plain pairs were measured (the
    coding there is not). Measured (2 028 steps, 3 seeds, medians against dense): +0.00
    points at density 0.001 and +0.05 at 0.01 on 8 ranks, -0.06 and -0.21 on 16
    (docs/compression.md). On the language model (``text-lm``, one epoch of 3 626 steps,
    8 ranks) it misses at density 0.001: -3.73%, -2.99% and -3.02% of dense's perplexity
    (seeds 0-2) at 89.8x fewer bytes, each parameter changed about 3.6 times in the run;
    at 0.002 -0.04%, -1.40% and -1.41% at 66.7x (seeds 0-2), within the 2% and 50x
    bounds (at 0.0015 -0.91%, -3.04% and -2.77% at 76.7x: outside 2%); at 0.01
    +1.22%, +0.67% and +1.40% at 48.0x (seeds 0-2). At 16 ranks (1 551 steps on
    CPython 3.12's corpus, seed 0, density 0.001) -12.5% at 41.8x: four rounds
    instead of three, and half the changes per parameter. With the run's length known,
    a final phase at a higher density narrows the gap at 0.001: ``schedule=FinalPhase(0.01,
    3263, BudgetRamp(0.03, 6.2))`` (the last 363 of those 3 626 steps at 0.01) gave
    -3.63%, -2.38% and -0.98% (seeds 0-2, dense on the same machine) at 66.1x
    (:class:`~mpicomm.control.FinalPhase`). Tuning: start it a tenth of the run before
    the end. Pass ``schedule=None`` for no
    ramp, ``exact_values=False, coding=None`` for the butterfly's own values; the
    class's own default has neither ramp, nor exact values, nor coding.

    ``schedule`` (a density warm-up, :mod:`mpicomm.control.schedules`),
    ``momentum_correction`` / ``momentum_masking`` (DGC's momentum correction in the
    error-feedback memory: with a number m, use an optimizer without momentum), ``clip_norm``
    (local clipping at ``clip_norm / sqrt(P)``) and ``warmup_dense`` (dense warm-up
    steps where they send fewer bytes than the sparse collective): see
    :class:`~mpicomm.strategies._compressed.CompressedStrategy`.

    Cost model: :func:`mpicomm.collectives.cost.gtopk` ``(k, s, P)`` =
    (lg p2 + 2·fold)(α + k·s·β) (:meth:`predict`), plus a merge (sort of <= 2k indices,
    top-k) per round and the O(d) local selection.

    Tuning: bandwidth grows as lg P instead of the Allgather's P - 1 (3/7 of it at
    P = 8), at the price of approximation; prefer power-of-two rank counts (two extra
    latencies otherwise). The update changes k entries per step, so a run of T steps
    updates each parameter about ``T·density`` times: keep that above ~20 (density 0.01
    for a few thousand steps); the paper's density 0.001 (0.004 in the first epoch)
    comes with runs of tens of thousands of steps. Error feedback is needed at such
    densities.
    """

    name = "gtopk"

    def __init__(self, density: float | None = None, k: int | None = None, *,
                 error_feedback: bool = True, own_contribution: bool = True,
                 comm: Any = None,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, schedule: Any = None,
                 momentum_correction: float | str = ADOPT,
                 momentum_masking: bool = True,
                 clip_norm: float | None = None, warmup_dense: bool = False,
                 flush_every: int | None = None, exact_values: bool = False,
                 coding: str | None = None):
        self.density, self.k = sparsity(density, k)
        self.own_contribution = check_flag("own_contribution", own_contribution)
        self.exact_values = check_flag("exact_values", exact_values)
        self.coding = check_coding(coding)
        if self.coding is not None and not self.exact_values:
            raise ValueError(f"coding={coding!r} needs exact_values=True (the coded "
                             "butterfly only picks the indices); pass coding=None for "
                             "the butterfly's own values")
        super().__init__(comm, error_feedback=error_feedback, fusion_bytes=fusion_bytes,
                         schedule=schedule,
                         momentum_correction=momentum_correction,
                         momentum_masking=momentum_masking, clip_norm=clip_norm,
                         warmup_dense=warmup_dense, flush_every=flush_every)

    def aggregate_flat(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        step = self._step(name)
        k = self._sparse_k(flat, step)
        if k is None:
            return self._aggregate_dense(name, flat)
        numel = flat.shape[0]
        c = self._compensate(name, flat)
        payload = TopK(k=k).compress(c, name=name)
        picks, values = payload.arrays["indices"], payload.arrays["values"]
        self._record_selected(name, values)
        idx, val, dropped = gtopk(picks, values, k, self.comm, return_dropped=True,
                                  size=numel, own_contribution=self.own_contribution,
                                  coding=self.coding)
        self.stats.extra.setdefault("k", {})[name] = k
        self.stats.extra.setdefault("survived", {})[name] = int(
            k - int(dropped.sum()))
        out = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
        ix = idx.to(torch.int64)
        if self.exact_values:   # every rank's c at the global index set, averaged
            out[ix] = allreduce(c[ix].contiguous(), op="avg", algorithm="ring",
                                comm=self.comm)
            if self.memory is not None:
                self.memory.update_sparse(name, c, ix)
            return out
        if self.memory is not None:
            survived = picks[~dropped]
            self.memory.update_sparse(name, c, survived)  # dropped picks stay in c
        out[ix] = val / self.comm.size
        return out

    def selects_locally(self, name: str) -> bool:
        """Every rank selects its own top-k first (the butterfly merges those)."""
        return True

    def describe(self) -> dict[str, Any]:
        collective = "gtopk(butterfly)" + ("+allreduce(ring)" if self.exact_values else "")
        return {**super().describe(), "density": self.density, "k": self.k,
                "own_contribution": self.own_contribution,
                "exact_values": self.exact_values, "coding": self.coding,
                "compressor": "topk", "collective": collective}

    def _sparse_bytes(self, numel: int, k: int, itemsize: int, p: int) -> float:
        """Butterfly of k pairs: ``(lg p2 + 2·fold)·k·s`` on the critical path, and with
        ``exact_values`` a ring allreduce of k values."""
        return (cost.gtopk(k, sum(pair_bytes(self.coding, numel, k, itemsize)), p, BYTES)
                + self._exact(k, itemsize, p, BYTES))

    def _exact(self, k: int, itemsize: int, p: int, params: cost.CostParams) -> float:
        """The ring allreduce of the k values of ``exact_values`` (0 without it)."""
        return cost.allreduce_ring(k * itemsize, p, params) if self.exact_values else 0.0

    def _predict_flat(self, numel: int, itemsize: int, p: int, params: cost.CostParams,
                      compute: cost.ComputeParams) -> tuple[float, float]:
        """Butterfly of k pairs; compute: compensation, selection, one merge of <= 2k
        pairs per round (the term that dominates at large k on a fast link), densify."""
        k = k_of(numel, self.density, self.k)
        return (cost.gtopk(k, sum(pair_bytes(self.coding, numel, k, itemsize)), p, params)
                + self._exact(k, itemsize, p, params),
                self._work(numel, itemsize, p, k, compute))

    def _predict_hosts(self, numel: int, itemsize: int, hosts: cost.HostCosts,
                       compute: cost.ComputeParams) -> tuple[float, float]:
        """The butterfly's rounds on the host layout (a round across hosts sends every
        local rank's k pairs through the host's port), and the values' allreduce."""
        k = k_of(numel, self.density, self.k)
        t = hosts.flat_sparse("gtopk", k, *pair_bytes(self.coding, numel, k, itemsize))
        if self.exact_values and hosts.p > 1:
            t = t + hosts.flat("allreduce", "ring", float(k * itemsize))
        return t.comm, t.local + self._work(numel, itemsize, hosts.p, k, compute)

    def _work(self, numel: int, itemsize: int, p: int, k: int,
              compute: cost.ComputeParams) -> float:
        rounds = 0 if p == 1 else (p.bit_length() - 1) + (p & (p - 1) != 0)
        merges = 2 if self.coding is None else 4   # the coding's encode and decode
        return (self._feedback_seconds(numel, itemsize, compute) + numel * compute.select
                + rounds * merges * k * compute.merge + numel * compute.scatter)
