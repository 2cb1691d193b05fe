"""AR-Top-k: one source rank's top-k indices, an allreduce of the values there."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..collectives import cost
from ..compress.topk import index_itemsize
from ..sparse import ARTopKState, artopk
from ..sparse.artopk import ALGORITHMS, SOURCES, star_source
from ..validate import check_algorithm
from ._compressed import ADOPT, BYTES, SparsifyingStrategy, k_of, sparsity
from .base import DEFAULT_FUSION_BYTES

__all__ = ["ARTopK"]


class ARTopK(SparsifyingStrategy):
    r"""Error-fed Allreduce-compatible top-k (Tyagi & Swany, BigData 2023; B.2) ("artopk").

    Per fused buffer ``g`` of ``d`` elements on rank r, at the buffer's t-th aggregation::

        c_r = g_r + e_r                       # error feedback (e_r = 0 without it)
        s   = source rank: "star" (t + b) mod P, b = the buffer's slot (the order in
              which buffer names first appeared), i.e. round-robin per buffer with the
              buffers of one step spread over different sources; "var" the rank with the
              largest EWMA of its raw gradient's L2 norm; "largest" the rank with the
              largest ||c_r|| at this step (ties: lowest rank)
        I   = top-k of |c_s|, broadcast from s  (the same on every rank)
        u   = zeros(d);  u[I] = (1/P) Σ_r c_r[I]     # allreduce (avg) of k values
        e_r = c_r with I zeroed

    Summed over ranks, mass is conserved exactly: ``Σ_r c_r = P·u + Σ_r e_r`` (B.2
    invariant 5). ``k = max(1, ceil(density·d))`` (or the given ``k``), capped at ``d``;
    neither given means ``density=0.01``. With ``density=1`` it is the exact mean.

    Bytes sent per rank (ib = 4 index bytes below 2^31 elements, vb = itemsize):

    * index broadcast (binomial tree rooted at s): ``children(r)·k·ib``, where
      ``children`` counts r's children in the tree (⌈lg P⌉ for the root, 0 for leaves;
      (P-1)·k·ib over all ranks);
    * ``algorithm="ring"``: ring allreduce of k values, ``(2k - |B_{r+1}| - |B_{r+2}|)·vb``
      with ``B_j`` the j-th (mod P) of P near-equal blocks of k, ≈ 2(P-1)/P·k·vb;
      ``"tree"`` (recursive doubling): ``lg p2·k·vb`` (+ fold messages when P is not a
      power of two);
    * ``source="var"`` or ``"largest"`` adds a Bruck allgather of one float64 per rank:
      ``(P-1)·8``.

    Default recipe: error feedback with DGC's momentum correction and masking taken over
    from the optimizer (``momentum_correction="optimizer"``: at the first
    ``GradientSync.step(optimizer)`` an SGD optimizer's momentum m moves into the
    memory and the optimizer's is set to 0). Cost: no bytes; one velocity buffer of the
    bucket's size and one multiply-add per element per step. ``momentum_correction=0.0``
    keeps plain error feedback with the optimizer's momentum. Whole-run bytes against a
    dense ring allreduce (ring, 4-byte values and indices, summed over the ranks):
    ``2(P-1)·d`` words against ``2(P-1)·k`` values plus ``(P-1)·k`` broadcast indices,
    i.e. ``2 / (3·density)``: 67x at density 0.01, 667x at 0.001, flat in P.

    By name (``strategies.make("artopk")``, ``GradientSync(model, strategy="artopk")``,
    ``examples/train.py --strategy artopk``) the default is another recipe
    (:data:`mpicomm.strategies.RECIPES`): plain error feedback with the optimizer's
    momentum (``momentum_correction=0.0``), ``schedule=BudgetRamp(0.1, 23.47)``, from
    density 0.1 geometrically down to ``density`` while sending 23.47 density-steps in
    all (1 092 steps at density 0.001, 600 at 0.01, no ramp from 0.1 on), and
    ``source="largest"``: the rank whose error-fed buffer ``c_r`` has the largest norm
    picks the indices. Cost: 3/2 of a dense allreduce's bytes per unit of density, so
    about 35 dense allreduces' bytes for the ramp, and one Bruck allgather of P float64
    per step (⌈lg P⌉ latencies): a 2 028-step run sends 55.0x fewer bytes than dense at
    density 0.001 (665x without the ramp) and 35.7x at 0.01 (66.6x without). Measured
    (MNIST-1D CNN, 2 028 steps, gaps to dense on seeds 0-2, medians): at 8 ranks +0.03
    points at 0.001 and +0.11 at 0.01; at 16 ranks with the same global batch -0.44 and
    -0.14. On the language model (``text-lm``, one epoch of 3 626 steps, 8 ranks,
    density 0.001) -5.21%, -5.19% and -3.88% of dense's perplexity at 92.7x (seeds 0-2): too
    few updates per parameter for a run that short (docs/compression.md); at 0.002
    +0.05%, -2.12% and -1.18% at 83.6x (seeds 0-2; median within the 2% and 50x bounds);
    at density 0.01 +1.36%, -0.05% and -0.59% at 45.0x. With the round-robin source instead
    (``source="star"``) the 8-rank gaps are the same (+0.03 and +0.03) but at 16 ranks
    they fall to -2.90 and -0.52: between its turns a rank's residual grows for P-1
    steps, while the largest-norm rule hands the turn to whichever rank has fallen
    furthest behind. The accuracy is noisy mid-run and climbs over the last epochs (2-4
    points in the last two at 0.001 at 8 ranks): judge it at the end of the run. Why not
    momentum correction here: only the source's top-k is drained, so on the other ranks
    the corrected velocity (about 1/(1-m) times the gradient) piles up outside the
    picked indices and leaves as bursts; with the ramp, 312 steps reached 67.8% with
    plain error feedback against 38.0% with the correction (seed 0, density 0.001, 8
    ranks, the STAR source; each layer its own top-k instead of one over the fused
    bucket: 56.4%). Pass ``schedule=None``, ``source="star"`` and
    ``momentum_correction="optimizer"`` for the class's default.

    ``schedule`` (a density warm-up, :mod:`mpicomm.control.schedules`),
    ``momentum_correction`` / ``momentum_masking`` (DGC's momentum correction in the
    error-feedback memory: with a number m, use an optimizer without momentum), ``clip_norm``
    (local clipping at ``clip_norm / sqrt(P)``) and ``warmup_dense`` (dense warm-up
    steps where they send fewer bytes than the sparse collective): see
    :class:`~mpicomm.strategies._compressed.CompressedStrategy`.

    Cost model: :func:`mpicomm.collectives.cost.artopk_ring` / ``artopk_tree``
    ``(k, ib, vb, P)``, plus :func:`~mpicomm.collectives.cost.allgather_bruck` of the P
    norms for ``"var"`` and ``"largest"`` (:meth:`predict`). Only the source runs the
    O(d) selection.

    Tuning: the ring version's bandwidth barely grows with P, so it beats the sparse
    Allgather from P ≈ 3-4 on when bandwidth dominates; ``"tree"`` wins for small k or
    high latency. STAR spreads index ownership evenly (the paper found VAR concentrates
    it and loses accuracy); ``smoothing`` is VAR's EWMA weight; ``"largest"`` follows
    the error-fed buffers' norms and keeps the accuracy as P grows (above), for ⌈lg P⌉
    latencies per step that matter only where the step is latency-bound. With few steps per epoch
    (digits at 8 ranks: 10) and SGD momentum in the optimizer, plain error feedback makes
    the updates residual bursts (~5x dense's norm: one rank's top-k drains the global
    residual poorly) that the momentum amplifies into late oscillations (one seed ended
    12 pp below dense): decay the learning rate at the end, warm the density up
    (``schedule``), or use ``momentum_correction`` (no amplification, slower in very few
    steps); tests/test_accuracy_scale.py replays that run. The update changes k entries
    per step, so a run of T steps updates each parameter about ``T·density`` times: keep
    that above ~20.
    """

    name = "artopk"

    def __init__(self, density: float | None = None, k: int | None = None, *,
                 source: str = "star", algorithm: str = "ring", error_feedback: bool = True,
                 smoothing: float = 0.1, comm: Any = None,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, schedule: Any = None,
                 momentum_correction: float | str = ADOPT,
                 momentum_masking: bool = True,
                 clip_norm: float | None = None, warmup_dense: bool = False,
                 flush_every: int | None = None):
        self.density, self.k = sparsity(density, k)
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        algorithm = check_algorithm("AR-Top-k", algorithm, ALGORITHMS, auto=False)
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or \
                not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.source = source
        self.algorithm = algorithm
        self.smoothing = float(smoothing)
        self._states: dict[str, ARTopKState] = {}
        super().__init__(comm, error_feedback=error_feedback, fusion_bytes=fusion_bytes,
                         schedule=schedule,
                         momentum_correction=momentum_correction,
                         momentum_masking=momentum_masking, clip_norm=clip_norm,
                         warmup_dense=warmup_dense, flush_every=flush_every)

    def state(self, name: str) -> ARTopKState:
        """The :class:`~mpicomm.sparse.ARTopKState` of buffer ``name`` (source, EWMA)."""
        if name not in self._states:
            self._states[name] = ARTopKState(smoothing=self.smoothing)
        return self._states[name]

    def aggregate_flat(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        own = self._step(name)
        step = self._source_step(name, own)
        k = self._sparse_k(flat, own)
        if k is None:
            return self._aggregate_dense(name, flat)
        numel = flat.shape[0]
        c = self._compensate(name, flat)
        idx, mean = artopk(c, k, step, self.source, self.comm, self.state(name),
                           self.algorithm, grad=flat)
        if self.state(name).source == self.comm.rank:  # the source selected at idx
            self._record_selected(name, c[idx])
        if self.memory is not None:
            self.memory.update_sparse(name, c, idx)  # = artopk's return_residual
        self.stats.extra.setdefault("k", {})[name] = k
        self.stats.extra.setdefault("source", {})[name] = self.state(name).source
        out = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
        out[idx] = mean
        return out

    def selects_locally(self, name: str) -> bool:
        """Only the step's source selects: with ``source="star"`` the rank
        ``(step + slot) % P`` of the bucket's next step (``"var"``: not known before the
        step's norms are gathered, so ``False``)."""
        if self.source != "star":
            return False
        step = self._source_step(name, self._steps.get(name, 0))
        return star_source(step, self.comm.size) == self.comm.rank

    def _source_step(self, name: str, own: int) -> int:
        """The step number :func:`~mpicomm.sparse.artopk` gets for bucket ``name``'s
        aggregation number ``own``: shifted by the bucket's slot, so that the buckets of
        one step start from different sources (a new bucket takes the next slot)."""
        return own + self._slots.get(name, len(self._slots))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "density": self.density, "k": self.k,
                "source": self.source, "algorithm": self.algorithm,
                "collective": f"broadcast(binomial)+allreduce({ALGORITHMS[self.algorithm]})"}

    def state_dict(self) -> dict[str, Any]:
        """Residuals, step counters and every buffer's :class:`ARTopKState`."""
        return {**super().state_dict(),
                "artopk": {k: asdict(v) for k, v in self._states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._states = {k: ARTopKState(**v) for k, v in state.get("artopk", {}).items()}

    def _sparse_bytes(self, numel: int, k: int, itemsize: int, p: int) -> float:
        """Index broadcast + allreduce of k values (the root's/critical path bytes), and
        the sources' norms where the source is chosen by them."""
        fn = cost.artopk_ring if self.algorithm == "ring" else cost.artopk_tree
        return fn(k, index_itemsize(numel), itemsize, p, BYTES) + self._norms(p, BYTES)

    def _norms(self, p: int, params: cost.CostParams) -> float:
        """The Bruck allgather of one float64 per rank that ``"var"`` and ``"largest"``
        choose the source with (0 for ``"star"``)."""
        return 0.0 if self.source == "star" else cost.allgather_bruck(8.0 * p, p, params)

    def _predict_flat(self, numel: int, itemsize: int, p: int, params: cost.CostParams,
                      compute: cost.ComputeParams) -> tuple[float, float]:
        """Index broadcast + allreduce of k values; compute: compensation, the source's
        selection (every rank waits for it), densify."""
        k = k_of(numel, self.density, self.k)
        fn = cost.artopk_ring if self.algorithm == "ring" else cost.artopk_tree
        return (fn(k, index_itemsize(numel), itemsize, p, params) + self._norms(p, params),
                self._work(numel, itemsize, compute))

    def _predict_hosts(self, numel: int, itemsize: int, hosts: cost.HostCosts,
                       compute: cost.ComputeParams) -> tuple[float, float]:
        """The index broadcast and the values' allreduce on the host layout."""
        k = k_of(numel, self.density, self.k)
        t = hosts.flat_sparse("artopk", k, index_itemsize(numel), itemsize,
                              ALGORITHMS[self.algorithm])
        if self.source != "star" and hosts.p > 1:  # the norms' allgather
            t = t + hosts.flat("allgather", "bruck", 8.0 * hosts.p)
        return t.comm, t.local + self._work(numel, itemsize, compute)

    def _work(self, numel: int, itemsize: int, compute: cost.ComputeParams) -> float:
        """Compensation, the source's selection, densify, and for ``"var"`` and
        ``"largest"`` the norm (one pass over the buffer, priced as a copy)."""
        norm = 0.0 if self.source == "star" else numel * itemsize * compute.copy
        return (self._feedback_seconds(numel, itemsize, compute) + numel * compute.select
                + numel * compute.scatter + norm)
