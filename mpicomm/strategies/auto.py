r"""``strategy="auto"``: the selector, the CR controller and L-GreCo in the training loop.

:class:`AutoStrategy` is a :class:`~mpicomm.strategies.Strategy` that, per fused bucket,
runs whichever of dense / Allgather Top-k / gTop-k / AR-Top-k ring and tree / PowerSGD
the selector (:func:`~mpicomm.strategies.auto_schemes.select`) predicts cheapest at the
current compression ratio, and adapts while training::

    sync = GradientSync(model, strategy="auto")     # or strategies.make("auto", ...)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward()
        sync.step(opt)          # = wait + opt.step + strategy.step_done(model, opt)

Its options are :class:`~mpicomm.strategies.AutoConfig`'s fields. What happens, on every
rank identically:

* first aggregation: :func:`~mpicomm.strategies.kernel_timing.calibrate` (a short
  ping-pong over several links + compute kernels) unless the communicator is calibrated
  already, and the CR controller's first exploration starts with step 0: by default a
  *probe* (step 0 runs at the middle candidate ratio and measures Top-k's gain at every
  candidate on its own gradients; the ratio is solved at step 1; the explorations
  triggered later probe likewise at the ratio in force), with ``probe_first=False`` /
  ``probe_triggered=False`` the paper's window (one ratio after the other, restored);
* each bucket: the kept choice for (bucket, ratio), else the selector's, settled by
  :class:`~mpicomm.strategies.auto_choice.SchemeChoices` (trials of close schemes,
  hysteresis), run by :func:`~mpicomm.strategies.auto_exchange.exchange`; its time
  (wall, including an emulated link's delay) is logged against the prediction;
* :meth:`AutoStrategy.step_done` (after ``optimizer.step()``) closes the step; its
  measured times and squared norms are agreed during the next step
  (:class:`~mpicomm.strategies.auto_agree.StepAgreement`) and decide at the
  ``step_done`` after that: they refine alpha/beta and each scheme's compute factor
  (:class:`mpicomm.control.OnlineCalibration`); a drift of alpha/beta, or of a compute
  factor by the same fraction, that persists for ``drift_patience`` steps (each step's
  own times off the prediction by that fraction: debounced against load noise) clears
  the choices (re-decide), and a network drift also forgets the measured times and tells
  the CR controller; one :class:`~mpicomm.strategies.auto_schemes.Record` per bucket is
  appended to :attr:`AutoStrategy.records` and passed to each callback in
  :attr:`AutoStrategy.callbacks`; the step's gain feeds the
  :class:`mpicomm.control.CRController`, whose ``"save"``/``"restore"`` actions
  snapshot and restore the model, the optimizer and the error-feedback memory around
  exploration windows right there; every ``lgreco_every`` steps
  :class:`mpicomm.control.LGreco` re-solves the per-layer settings on rank 0
  (:class:`~mpicomm.strategies.lgreco_errors.LayerErrors`) and broadcasts them.

Compression gain: ``sqrt(Σ||g_c||² / Σ||g_e||²)`` over the step's buckets and ranks
(:attr:`AutoStrategy.last_gain`, the ``min_gain`` constraint). The CR controller is fed
*Top-k's* gain, whatever scheme ran (:class:`~mpicomm.strategies.auto_ratio.RatioControl`,
which says what its reference costs, ``overheads["reference_s"]``); each (scheme, ratio)'s
*efficiency* ``Σ||g_c||² / Σ||top-k(g_e)||²`` is what ``gain_weighted`` divides by.

L-GreCo (``lgreco=True``), ``lgreco_family``:

* ``"topk"`` (default): inside each fused bucket every layer (segment) gets its own top-k
  density; the Allgather and AR-Top-k schemes send the union of per-segment top-k
  (AR-Top-k: the source's), so error feedback is per layer (each segment of the bucket's
  residual is that layer's). gTop-k truncates to one global k and PowerSGD has ranks, so
  the selector chooses among dense, Allgather Top-k and AR-Top-k.
* ``"qsgd"`` / ``"powersgd"``: every layer of a bucket gets its own QSGD bits / PowerSGD
  rank (:mod:`~mpicomm.strategies.lgreco_buckets`: still one allgather, resp. two
  allreduces, per bucket); the selector chooses between dense and that per-layer scheme,
  predicted for the settings in force, and re-decides after every L-GreCo solve.

Without ``step_done`` (called by ``GradientSync.step`` and the DDP hook) the strategy
keeps its first choices: no records, no refinement, no CR changes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from .. import clock
from ..buffers import from_torch, to_torch
from ..collectives.cost import CostParams, calibrated, host_costs
from ..compress import ErrorFeedback, PowerSGD
from ..control.cost_refit import OnlineCalibration
from ..control.cr import CRController
from ..control.lgreco import LGreco
from ._compressed import CompressedStrategy, check_floating
from .auto_agree import StepAgreement
from .auto_choice import SchemeChoices
from .auto_config import AutoConfig, strategy_signature
from .auto_exchange import MomentumHandover, error_fed, exchange
from .auto_predict import SchemePredictor
from .auto_ramp import RatioRamp
from .auto_ratio import RatioControl
from .auto_schemes import Choice, Record, build
from .auto_snapshot import WindowSnapshot
from .base import Strategy, fuse
from .kernel_timing import calibrate
from .lgreco_buckets import Segment
from .lgreco_errors import LayerErrors

__all__ = ["AutoStrategy", "CALIBRATION_SIZES", "CALIBRATION_ONEWAY_BYTES"]

#: Ping-pong sizes (bytes) of the start-up calibration (``calibrate_links``): alpha.
CALIBRATION_SIZES = (8, 1 << 12)
#: Bytes of its one large transfer per link (``oneway_bytes``): beta.
CALIBRATION_ONEWAY_BYTES = 1 << 19


class AutoStrategy(Strategy):
    """Adaptive strategy ("auto"): collective selector + CR controller + L-GreCo.

    ``AutoStrategy(comm=None, *, config=None, **options)``: ``options`` are
    :class:`~mpicomm.strategies.AutoConfig`'s fields (documented there; the signature
    lists them with their defaults), over ``config`` where both are given; an unknown
    option is a ``TypeError``, a bad value a ``ValueError``, before any communication.
    The module docstring says what it does step by step.

    Read while training: :attr:`ratio`, :attr:`records` (and :attr:`callbacks`),
    :attr:`decisions`, :attr:`last_gain`, :attr:`scheme_gains`, :attr:`efficiency`,
    :attr:`measured`, :attr:`trials`, :attr:`step_other`, :attr:`controller` (the CR
    controller, ``None`` at a fixed ratio), :attr:`lgreco` (``None`` without L-GreCo),
    :attr:`online` (the refined cost model, after the first aggregation).
    """

    name = "auto"

    def __init__(self, comm: Any = None, *, config: Optional[AutoConfig] = None,
                 **options: Any):
        if config is not None and not isinstance(config, AutoConfig):
            raise TypeError(f"config must be an AutoConfig, got {type(config).__name__}")
        cfg = AutoConfig.from_options(config, **options) if options or config is None \
            else config
        super().__init__(comm, fusion_bytes=cfg.fusion_bytes)
        self.config = cfg
        #: ``"qsgd"``/``"powersgd"`` when L-GreCo runs that family, else ``None``.
        self.family: Optional[str] = cfg.family
        #: The schemes the selector chooses among.
        self.schemes = cfg.selectable()
        self.approximate, self.min_gain = bool(cfg.approximate), float(cfg.min_gain)
        self.calibrate_links = cfg.calibrate_links
        self.drift_patience = cfg.drift_patience
        self.controller: Optional[CRController] = None
        if cfg.ratio is None and self.family is None:
            self.controller = CRController(self.step_time, cfg.ratios, **cfg.cr_options())
        # the per-layer families compress by their bits/ranks: no ratio
        fixed = None if self.controller is not None else \
            1.0 if self.family else float(cfg.ratio)  # type: ignore[arg-type]
        self.ratio_control = RatioControl(self.controller, fixed)
        self.lgreco: Optional[LGreco] = None
        self.layer_errors: Optional[LayerErrors] = None
        if cfg.lgreco:
            self.lgreco = LGreco(cfg.lgreco_uniform(), every=cfg.lgreco_every,
                                 acc_steps=cfg.lgreco_acc_steps, factors=cfg.lgreco_factors,
                                 family=cfg.lgreco_family)
            self.layer_errors = LayerErrors(self.lgreco)
        self.choices = SchemeChoices(trial_steps=cfg.trial_steps,
                                     trial_margin=cfg.trial_margin,
                                     switch_margin=cfg.switch_margin,
                                     gain_weighted=cfg.gain_weighted, drift=cfg.drift,
                                     decay=cfg.decay)
        self.predictor = SchemePredictor(self.schemes, approximate=self.approximate,
                                         lgreco=self.lgreco, family=self.family,
                                         fusion_bytes=self.fusion_bytes)
        self.agreement = StepAgreement()
        #: The ratio ramp (:mod:`~mpicomm.strategies.auto_ramp`): a large fall of a
        #: bucket's ratio is spread over ``ramp_steps`` steps.
        self.ramp = RatioRamp(cfg.ramp_steps, cfg.ramp_factor, cfg.ramp_start)
        self._psgd: dict[int, PowerSGD] = {}  # rank -> PowerSGD: per-layer warm starts
        self.memory = ErrorFeedback()
        self.memory.track_sent = True  # the step's ||g_e||² without forming g + e again
        self.handover = MomentumHandover(self.memory, not cfg.lgreco and cfg.momentum_correction)
        self.records: deque[Record] = deque(maxlen=cfg.history)
        #: Called with each :class:`~mpicomm.strategies.auto_schemes.Record` (e.g. a
        #: trace or metrics exporter).
        self.callbacks: list[Callable[[Record], None]] = []
        self.online: Optional[OnlineCalibration] = None
        self.steps = 0
        #: The last step's compression gain ``||g_c|| / ||g_e||`` (``None`` before one).
        self.last_gain: Optional[float] = None
        self.decisions: list[tuple[int, str, str, float]] = []  # (step, bucket, scheme, c)
        self._subs: dict[tuple[str, float, Any], Strategy] = {}
        self._layouts: dict[str, tuple[list[tuple[int, ...]], int]] = {}
        self._segments: dict[str, list[Segment]] = {}
        self._pending: list[dict[str, Any]] = []
        self._gain_sq = [0.0, 0.0, 0.0]  # Σ||g_c||², Σ||g_e||², Σ||top-k(g_e)||²: step
        self._started = False
        self._adjust_due = False
        self._last_done: Optional[float] = None
        self._action: Optional[str] = None
        self._scales_used: dict[str, float] = {}
        self._moved_streak = 0  # consecutive agreed steps with a compute factor moved
        #: Seconds this rank spent on the controllers' own work (not training):
        #: ``calibration_s`` (start-up ping-pongs and kernels), ``probe_s`` (the gains at
        #: every grid ratio on probe steps), ``reference_s`` (the gain's extra selection on
        #: other steps), ``exploration_s`` (the steps of exploration windows, thrown away
        #: by their restore), ``lgreco_s`` (L-GreCo's measurement, solve and broadcast);
        #: ``probes`` and ``windows`` count them.
        self.overheads: dict[str, float] = {"calibration_s": 0.0, "probe_s": 0.0,
                                            "reference_s": 0.0, "exploration_s": 0.0,
                                            "lgreco_s": 0.0, "probes": 0, "windows": 0}
        #: The save/restore around CR exploration windows.
        self.snapshot = WindowSnapshot(self.overheads)

    # ------------------------------------------------------------------ state
    @property
    def ratio(self) -> float:
        """The CR in force for the next aggregation."""
        return self.ratio_control.ratio

    @property
    def params(self) -> CostParams:
        """The agreed, refined alpha-beta-gamma in use (kept once the communicator is freed)."""
        return self.online.params if self.online is not None else calibrated(self.comm)[0]

    @property
    def scheme_gains(self) -> dict[str, float]:
        """Each scheme's compression gain, EWMA over the steps it ran (agreed)."""
        return self.choices.scheme_gains

    @property
    def efficiency(self) -> dict[tuple[str, float], float]:
        """Each (scheme, ratio)'s gain relative to exact Top-k's, EWMA (agreed)."""
        return self.choices.efficiency

    @property
    def measured(self) -> dict[tuple[str, float], dict[str, deque[float]]]:
        """(bucket, ratio) -> scheme -> its last agreed times (seconds)."""
        return self.choices.measured

    @property
    def trials(self) -> list[tuple[int, str, str]]:
        """(step, bucket, scheme) of each trial step (choice by measurement)."""
        return self.choices.trials

    @property
    def step_other(self) -> Optional[float]:
        """EWMA of a step's wall time outside the buckets' exchanges (mean over ranks)."""
        return self.choices.step_other

    def bind(self, comm: Any) -> AutoStrategy:
        super().bind(comm)
        for s in self._subs.values():
            s.bind(self.comm)
        return self

    def describe(self) -> dict[str, Any]:
        last: dict[str, str] = {}
        for _, bucket, scheme, c in self.decisions:
            last[bucket] = f"{scheme}@{c:g}"
        return {"strategy": self.name, "ratio": None if self.family else self.ratio,
                "schemes": list(self.schemes), "lgreco": self.lgreco is not None,
                "lgreco_family": None if self.lgreco is None else self.lgreco.family,
                "choices": last,
                "params": None if self.online is None else
                {"alpha": self.params.alpha, "beta": self.params.beta}}

    def state_dict(self) -> dict[str, Any]:
        """Residuals (and momentum-correction velocities), the sub-strategies' own state
        (PowerSGD warm starts, AR-Top-k) and the per-layer PowerSGD family's warm-start
        Q per layer."""
        return {**self.memory.state_dict(), "momentum": self.memory.momentum,
                **self.handover.state_dict(),
                "subs": {repr(k): s.state_dict() for k, s in self._subs.items()},
                "per_layer_q": {r: c.state_dict() for r, c in self._psgd.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "residuals" not in state:
            raise ValueError("AutoStrategy.load_state_dict: missing 'residuals'")
        self.memory.momentum = float(state.get("momentum", self.memory.momentum))
        self.handover.load_state_dict(state)
        self.memory.load_state_dict({"residuals": state["residuals"],
                                     "velocities": state.get("velocities", {})})
        for k, s in self._subs.items():
            if repr(k) in state.get("subs", {}):
                s.load_state_dict(state["subs"][repr(k)])
        for r, q in state.get("per_layer_q", {}).items():
            if r not in self._psgd:
                seed = self.lgreco.seed if self.lgreco is not None else 0
                self._psgd[r] = PowerSGD(rank=int(r), warm_start=True, seed=seed)
            self._psgd[r].load_state_dict(q)

    # ------------------------------------------------------------------ prediction
    def _predict_shapes(self, shapes: list[tuple[int, ...]], itemsize: int, p: int,
                        params: CostParams, compute: Any) -> dict[str, float]:
        """The selector's cheapest scheme at the current ratio, per fused buffer."""
        return self.predictor.shapes(shapes, self.ratio, itemsize, p, params, compute)

    def _run_costs(self, ratio: float) -> dict[str, tuple[str, float, float]]:
        """Per bucket seen so far: the scheme the choice rule would run at ``ratio``,
        its exchange time and its cost (:meth:`SchemePredictor.run_costs`)."""
        params, compute = calibrated(self.comm)
        scales = self.online.compute_scales() if self.online is not None else {}
        return self.predictor.run_costs(self._layouts, ratio, self.comm.size, params,
                                        compute, self.choices, scales=scales,
                                        gains=self.choices.scheme_gains,
                                        min_gain=self.min_gain)

    def sync_time(self, ratio: float) -> float:
        """Predicted seconds of one step's synchronization at ``ratio``: each bucket's
        exchange at the scheme the choice rule would run there
        (:meth:`SchemeChoices.run_choice` on the refined model's predictions)."""
        return sum(t for _, t, _ in self._run_costs(ratio).values())

    def step_time(self, ratio: float) -> float:
        """The CR controller's time objective at ``ratio``: the seconds of a whole step
        (the paper's Eq. 6 counts the computation too: :attr:`step_other`) as the
        scheme choice counts them, so that the ratio is traded against the time of the
        scheme that runs at it: with ``gain_weighted``, per unit of Top-k progress,
        ``Σ_buckets (t + share) / efficiency`` at the scheme of lowest such cost (the
        shares add up to :attr:`step_other`); without, :meth:`sync_time` plus
        :attr:`step_other`."""
        costs = self._run_costs(ratio).values()
        other = self.choices.step_other or 0.0
        if self.choices.gain_weighted and other and costs:
            return sum(c for _, _, c in costs)
        return sum(t for _, t, _ in costs) + other

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, tensors: Sequence[Any], names: Optional[Sequence[str]] = None
                  ) -> list[Any]:
        tensors, names = self._validate(tensors, names)
        check_floating(tensors, names)
        self._ensure_calibrated()
        if not self._started and self.controller is not None:
            self._started = True  # the first aggregation: exploration starts with step 0
            self._action = self.controller.start()
        if self._adjust_due:  # L-GreCo's solve (a broadcast): inside the collectives
            self._adjust_due = False
            begin = clock.now()
            self._adjust_lgreco()
            self.overheads["lgreco_s"] += clock.now() - begin
        if self.agreement.done:  # the first aggregation of a step: agree on the last ones
            self.agreement.post(self.comm)
        as_torch = [to_torch(t) for t in tensors]
        results: list[Any] = [None] * len(tensors)
        comm = self.comm
        before, start = comm.traffic.snapshot(), clock.now()
        for buf in fuse(as_torch, names, self.fusion_bytes):
            shapes = list(buf.shapes)
            self._layouts[buf.name] = (shapes, buf.flat.element_size())
            self.choices.bucket_seen(buf.name, shapes)
            self._segments[buf.name] = [(names[i], math.prod(s), tuple(s))
                                        for i, s in zip(buf.indices, shapes)]
            parts = self._run_bucket(buf, [names[i] for i in buf.indices],
                                     [as_torch[i] for i in buf.indices])
            for i, part in zip(buf.indices, parts):
                results[i] = from_torch(part.view(as_torch[i].shape), like=tensors[i])
        # Not base.measure: the exchanges already sleep their emulated link delay.
        self.stats.add_call(comm.traffic - before, as_torch, clock.now() - start)
        if self.agreement.posted:  # progressed during the buckets' exchanges
            self.agreement.complete(comm)
        return results

    def aggregate_flat(self, flat: Any, name: str) -> Any:
        return self.aggregate([flat], [name])[0]

    def _ensure_calibrated(self) -> None:
        if self.online is not None:
            return
        comm, cfg = self.comm, self.config
        if self.calibrate_links and "compute_params" not in comm.resources:
            # short (AutoConfig: calibrate_links): the online refinement fixes beta
            begin = clock.now()
            calibrate(comm, links=self.calibrate_links, compute_numel=1 << 19,
                      sizes=CALIBRATION_SIZES, repeats=3,
                      oneway_bytes=CALIBRATION_ONEWAY_BYTES)
            self.overheads["calibration_s"] += clock.now() - begin
        self.online = OnlineCalibration(calibrated(comm)[0], decay=cfg.decay,
                                        drift=cfg.drift, patience=self.drift_patience)
        # the layout every prediction is priced on (two link classes across hosts)
        self.predictor.topology = comm.topology
        self.predictor.local = host_costs(comm).local

    def _sub(self, scheme: str, ratio: float, shapes: list[tuple[int, ...]],
             cache: bool = True) -> Strategy:
        """The strategy running ``scheme`` at ``ratio``, kept for later steps unless
        ``cache`` is false (a ramp's ratios each run once)."""
        key = (scheme, ratio, tuple(shapes) if scheme == "powersgd" else None)
        sub = self._subs.get(key)
        if sub is None:
            sub = build(scheme, ratio, shapes, comm=self.comm, fusion_bytes=self.fusion_bytes)
            assert sub is not None, scheme
            if isinstance(sub, CompressedStrategy) and scheme != "powersgd":
                sub.memory = self.memory  # one residual per bucket, whatever the scheme
            if cache:
                self._subs[key] = sub
        return sub

    def _choose(self, key: tuple[str, float], shapes: list[tuple[int, ...]],
                segments: list[Segment], itemsize: int, params: CostParams, compute: Any,
                scales: dict[str, float]) -> tuple[Choice, bool]:
        """The bucket's scheme at ``key`` = (bucket, ratio): the kept choice, else the
        selector's (an exploration step: a sparse scheme), settled by
        :meth:`SchemeChoices.settle`; ``(choice, counted as a trial step)``."""
        choice = self.choices.kept.get(key)
        if choice is not None:
            return choice, False
        ratio, p = key[1], self.comm.size
        exploring = self.ratio_control.exploring
        if self.family is not None:
            choice = self.predictor.family_choice(segments, itemsize, p, params, compute,
                                                  scales)
        else:
            # an exploration step measures the top-k gain at the ratio: a sparse
            # scheme (dense's gain is 1 at any ratio, PowerSGD's is a rank's)
            schemes = tuple(s for s in self.schemes
                            if s not in ("dense", "powersgd") or not exploring) \
                if ratio < 1.0 else self.schemes
            choice = self.predictor.candidates(shapes, ratio, itemsize, p, params, compute,
                                               schemes=schemes, scales=scales,
                                               gains=self.choices.scheme_gains,
                                               min_gain=self.min_gain)

        def ratio_of(scheme: str) -> float:
            if scheme == "dense":
                return 1.0
            return self.predictor.family_ratio(segments) if self.family else ratio

        choice, counted = self.choices.settle(key, choice, step=self.steps,
                                              exploring=exploring,
                                              by_measurement=self.family is None,
                                              ratio_of=ratio_of)
        self.decisions.append((self.steps, key[0], choice.scheme, choice.ratio))
        return choice, counted

    def _run_bucket(self, buf: Any, names: list[str], tensors: list[torch.Tensor]
                    ) -> list[torch.Tensor]:
        self.handover.bucket(buf.name, names)
        ratio = self.ratio
        key = (buf.name, ratio)
        params, compute = calibrated(self.comm)
        shapes, itemsize = self._layouts[buf.name]
        scales = self.online.compute_scales() if self.online is not None else {}
        segments = self._segments[buf.name]
        choice, counted = self._choose(key, shapes, segments, itemsize, params, compute,
                                       scales)
        per_layer = self.family is not None and choice.scheme != "dense"
        choice, ramped = self.ramp.apply(  # trials, windows: at the key's ratio
            buf.name, choice, not counted and not per_layer and self.lgreco is None and
            (self.ratio_control.probing or not self.ratio_control.exploring))
        sub = None if per_layer else self._sub(choice.scheme, choice.ratio, shapes,
                                               cache=not ramped)
        reads = (isinstance(sub, CompressedStrategy) and not ramped and ratio < 1.0 and
                 not self.ratio_control.probing and sub.selects_locally(buf.name))
        due = not reads and self.ratio_control.due(buf.name, self.steps, ratio)
        ref_sq = self._topk_reference(choice.scheme, ratio, buf, names, tensors, sub,
                                      ramped) if due else None
        start = clock.now()
        out, e_sq, left = exchange(choice.scheme, buf, names, tensors, sub, self.memory,
                                   self.comm, self.steps, lgreco=self.lgreco,
                                   family=self.family, segments=segments,
                                   compressors=self._psgd,
                                   accumulate=lambda c: self._accumulate(buf.name, c))
        seconds = clock.now() - start
        kept_sq = max(e_sq - left, 0.0)
        ref_sq = sub.stats.extra.get("selected_sq", {}).pop(buf.name, None) if reads else \
            self.ratio_control.settle(buf.name, self.steps, ratio, ref_sq, e_sq, due=due,
                                      exact=choice.scheme == "allgather_topk")
        if ref_sq is None:  # Allgather Top-k (or no ratio): what it kept is the reference
            ref_sq = kept_sq
        for i, v in enumerate((kept_sq, e_sq, ref_sq)):
            self._gain_sq[i] += v
        a, b, work, g = self.predictor.coefficients(buf.name, segments, choice.scheme,
                                                    choice.ratio, itemsize, self.comm.size,
                                                    compute)
        work += params.gamma * g
        kappa = scales.get(choice.scheme, 1.0)
        self._pending.append({"step": self.steps, "bucket": buf.name,
                              "scheme": choice.scheme, "key_ratio": ratio,
                              "ratio": choice.ratio, "seconds": seconds, "a": a, "b": b,
                              "work": work, "kept_sq": kept_sq, "e_sq": e_sq,
                              "ref_sq": ref_sq, "trial": counted, "ramp": ramped,
                              "predicted": a * params.alpha + b * params.beta + kappa * work})
        return out

    def _topk_reference(self, scheme: str, ratio: float, buf: Any, names: list[str],
                        tensors: list[torch.Tensor], sub: Optional[Strategy],
                        ramped: bool = False) -> Optional[float]:
        """``||top-k(g_e)||²`` of this rank's error-fed bucket at ``ratio`` (``None`` where
        the step keeps exact Top-k: Allgather Top-k not ``ramped``, the L-GreCo paths)."""
        probing = self.ratio_control.probing
        begin = clock.now()
        ref = self.ratio_control.reference(
            ratio, lambda: error_fed(scheme, buf, names, tensors, sub, self.memory),
            kept_is_reference=scheme == "allgather_topk" and not ramped or
            self.lgreco is not None)
        self.overheads["probe_s" if probing else "reference_s"] += clock.now() - begin
        return ref

    def _accumulate(self, bucket: str, c: torch.Tensor) -> None:
        """Rank 0 feeds L-GreCo's accumulator on the steps before a solve."""
        if self.layer_errors is not None:
            self.layer_errors.accumulate_bucket(self._segments[bucket], c, self.comm.rank,
                                                self.steps)

    # ------------------------------------------------------------------ the step
    def step_done(self, model: Any = None, optimizer: Any = None) -> None:
        """End of a training step (no communication here; see the module docstring).

        The step's measurements are queued for agreement; the measurements agreed during
        this step (those of the step before) decide the next step (:meth:`_decide`,
        pure arithmetic on agreed numbers), and an action the CR controller decided is
        carried out now, at this safe point: ``model``/``optimizer`` (and the
        error-feedback memory) are saved or restored around CR exploration windows
        (without them the windows run but only the memory is restored)."""
        self.handover.step_done(optimizer, model, [r["scheme"] for r in self._pending],
                                window=self.snapshot.saved is not None)  # once
        now = clock.now()
        wall = 0.0 if self._last_done is None else now - self._last_done
        probe = self.ratio_control.take_probe()
        self.overheads["probes"] += bool(probe)
        self.agreement.finish(self._pending, self._gain_sq + [wall] + probe)
        self._pending, self._gain_sq = [], [0.0, 0.0, 0.0]
        actions = [self._action]
        self._action = None
        actions += [self._decide(pending, agreed) for pending, agreed in self.agreement.take()]
        self.steps += 1
        for action in actions:
            self.snapshot.act(action, model, optimizer, self)
        self._last_done = clock.now()

    def _decide(self, pending: list[dict[str, Any]], agreed: Any) -> Optional[str]:
        """One finished step's agreed measurements (``pending``: its buckets' records,
        ``agreed``: their seconds and squared norms, then the step's sums, wall time and
        probe masses) decide the next step, at ``step_done``, the same on every rank:
        records, the online refinement, the trials' times, the gains; a re-decision on
        a drift, an outrun choice or a gain below ``min_gain``; the CR controller (its
        action is returned) and L-GreCo's next solve."""
        assert self.online is not None
        choices = self.choices
        n = len(pending)
        seconds = agreed[:n]
        choices.track_gains(pending, agreed[n:2 * n], agreed[2 * n:3 * n],
                            agreed[3 * n:4 * n])
        params = self.online.params
        for r, t in zip(pending, seconds):
            self._observe(r, float(t), params)
        drift = self.online.refine()
        self.comm.resources["cost_params"] = self.online.params
        scales = self.online.compute_scales()
        tolerance = self.config.drift
        shifted = any(abs(v - self._scales_used.get(k, 1.0)) > tolerance *
                      self._scales_used.get(k, 1.0) for k, v in scales.items())
        # counted only while the step's own times are off the predictions by the drift
        # fraction (the EWMA fit stays moved for steps after one outlier step)
        predicted = sum(r["predicted"] for r in pending)
        off = predicted > 0 and abs(float(seconds.sum()) - predicted) > tolerance * predicted
        self._moved_streak = self._moved_streak + 1 if shifted and off else 0
        moved = self._moved_streak >= self.drift_patience  # debounced like alpha/beta
        low = choices.below(self.min_gain)
        if choices.trial_steps and not drift and not moved:
            choices.drop(choices.outrun())  # measured slower than another: re-decide
        if drift and choices.times_moved():  # the network changed: measured times are
            choices.measured.clear()         # stale, try again
        if drift or moved or low:  # re-decide with the refined model / measured gains
            choices.forget()
            self._scales_used = scales
            self._moved_streak = 0
        kept, total, ref, wall = (float(v) for v in agreed[4 * n:4 * n + 4])
        probe = [float(v) for v in agreed[4 * n + 4:]]
        if wall > 0:  # mean over ranks of the step's wall time outside the buckets
            choices.observe_other(max(wall / self.comm.size - float(seconds.sum()), 0.0))
        self.last_gain = min(math.sqrt(kept / total), 1.0) if total > 0 else 1.0
        before = self.ratio
        action = self.ratio_control.observe(pending[0]["key_ratio"] if pending else None,
                                            drift, total, ref, probe)
        self.ratio_control.resolve_on_compute(self.choices.step_other, self.config.drift)
        if self.ratio != before:  # choices kept for another ratio are dropped
            self.choices.keep_ratio(self.ratio)
            if self.lgreco is not None and self.family is None and self.ratio < 1.0:
                # L-GreCo re-solves around the controller's ratio (its uniform default)
                self.lgreco.rebase(self.ratio)
                self._adjust_due = True
        lg = self.lgreco
        if lg is not None and lg.due(self.steps):
            self._adjust_due = True  # at the next aggregation, inside the collectives
        return action

    def _observe(self, r: dict[str, Any], seconds: float, params: CostParams) -> None:
        """One bucket's agreed time: the online refinement, the trials' measured times
        (and a kept choice's settled time), a :class:`~.auto_schemes.Record`."""
        assert self.online is not None
        self.online.observe(r["a"], r["b"], seconds, r["work"], r["scheme"])
        if not r.get("ramp"):  # a ramp step's time is not its key's (another ratio)
            self.choices.record((r["bucket"], r["key_ratio"]), r["scheme"], seconds,
                                r["trial"])
        rec = Record(r["step"], r["bucket"], r["scheme"], r["ratio"], r["predicted"],
                     seconds, params.alpha, params.beta)
        self.records.append(rec)
        for cb in self.callbacks:
            cb(rec)

    def _adjust_lgreco(self) -> None:
        """L-GreCo's solve on rank 0, broadcast
        (:meth:`~mpicomm.strategies.lgreco_errors.LayerErrors.adjust`); the per-layer
        families' choices are re-decided with the new settings."""
        assert self.layer_errors is not None
        shapes = {layer: shape for segs in self._segments.values()
                  for layer, _, shape in segs}
        self.layer_errors.adjust(self.comm, shapes)
        if self.family is not None:  # the predictions changed with the settings
            self.choices.forget()

AutoStrategy.__init__.__signature__ = strategy_signature()  # type: ignore[attr-defined]
