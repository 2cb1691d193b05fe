r"""``strategy="auto"``: the selector, the CR controller and L-GreCo in the training loop.

:class:`AutoStrategy` is a :class:`~mpicomm.strategies.Strategy` that, per fused bucket,
runs whichever of dense / Allgather Top-k / gTop-k / AR-Top-k ring and tree / PowerSGD
the selector (:mod:`mpicomm.control.selector`) predicts cheapest at the current
compression ratio, and adapts while training::

    sync = GradientSync(model, strategy="auto")     # or strategies.make("auto", ...)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward()
        sync.step(opt)          # = wait + opt.step + strategy.step_done(model, opt)

What happens, on every rank identically:

* first aggregation: :func:`~mpicomm.control.calibration.calibrate` (a short ping-pong
  over several links + compute kernels) unless the communicator is calibrated already,
  and the CR controller's first exploration starts with step 0: by default a *probe*
  (step 0 runs at the middle candidate ratio and measures Top-k's gain at every
  candidate on its own gradients; the ratio is solved at step 1; the explorations
  triggered later probe likewise at the ratio in force), with
  ``probe_first=False`` / ``probe_triggered=False`` the paper's window (one ratio after
  the other, restored);
* each bucket: the cached choice for (bucket, ratio), else :func:`~.selector.select`;
  where the predictions do not separate the schemes (within ``trial_margin`` of the
  cheapest), each close scheme is *tried* for ``trial_steps`` real steps (no rollback)
  and the lowest agreed cost per unit of progress (``gain_weighted``) decides; its time
  (wall, including an emulated link's delay) is logged against the prediction;
* :meth:`AutoStrategy.step_done` (after ``optimizer.step()``) closes the step; its
  measured times and squared norms are agreed during the next step (mean over ranks, one
  small nonblocking allreduce) and refine alpha/beta and each scheme's compute factor
  (:class:`~.calibration.OnlineCalibration`) at the ``step_done`` after that; a drift of
  alpha/beta, or of a compute factor by the same fraction, that persists for
  ``drift_patience`` steps (each step's own times off the prediction by that fraction:
  debounced against load noise) clears the choices (re-decide), and a network drift
  also forgets the measured times and tells the CR controller; one
  :class:`~.selector.Record` per bucket is appended to :attr:`records` and passed to each
  callback in :attr:`callbacks`; the step's compression gain (averaged over ranks) feeds
  the :class:`~.cr.CRController`, whose ``"save"``/``"restore"`` actions snapshot and
  restore the model, the optimizer and the error-feedback memory around exploration
  windows right there (see *When decisions take effect*); every ``lgreco_every`` steps
  :class:`~.lgreco.LGreco` re-solves the per-layer settings on rank 0 and broadcasts
  them.

When decisions take effect, for steps ``t = 0, 1, ...`` (the aggregations of step t,
then ``step_done`` after its ``optimizer.step()``):

* the measurements of step ``t`` (every bucket's time, the compression gain) are agreed
  *during step t+1*: the allreduce starts (nonblocking) at its first aggregation and is
  completed at the end of that aggregation, after the buckets' exchanges; ``step_done``
  of step t+1 decides with them (refined alpha/beta and compute factors, re-chosen
  schemes, the CR controller's ratio, L-GreCo's settings, solved at the first
  aggregation of step t+2 when ``(t + 2) % lgreco_every == 0``) for *every* bucket of
  step t+2, and carries out a ``"save"``/``"restore"`` at once (after step t+1's
  update). So a decision uses the measurements of two steps back.
* why not sooner: agreeing before step t+1's first bucket (this module's earlier
  design, one step back) made every rank wait there for the slowest one's backward pass,
  and then select its top-k at the same moment as the others; after the buckets
  instead (deciding at ``step_done`` of step t, no lag) made every rank wait for the
  slowest one's unpacking, and start its next forward pass with all the others. Where
  ranks share cores both cost: on the adaptive bench (4 ranks on 2 cores, Allgather
  Top-k at a fixed ratio) 67.5 and about 80 ms a step, against 61 ms without any
  agreement and 59 ms for the static strategy. Posted at the first aggregation, the
  allreduce moves along inside the buckets' own exchanges (MPI progresses every
  pending request in any call), so completing it after them waits for nothing new.
* what the extra step changes: a scheme on trial runs ``trial_steps`` steps, counting
  those still being agreed, before the next is tried; a CR exploration window runs each
  ratio ``window`` steps plus one whose gain arrives after the ratio moved on (it adds
  to that ratio's mean: :meth:`~.cr.CRController.observe` ``ratio=``), and its restore
  discards that one too; the step after a probe runs at the probe's ratio again.
* decisions are the same on every rank: every rank calls ``step_done`` as often and
  aggregates the same buckets in the same order (the ``GradientSync`` contract, checked
  in ``comm.check`` mode), the allreduces are posted and completed at the same
  aggregations on every rank, and every input of a decision is agreed (allreduce;
  L-GreCo: rank 0's solution broadcast) — ``tests/test_control_selector.py`` checks the
  ratio, the schemes, the pending action and the L-GreCo settings step by step on every
  rank.

Error feedback: one memory shared by every scheme, keyed by bucket name, so a switch
between sparse schemes keeps the residual; a dense step adds and clears it. PowerSGD keeps
its residuals per tensor (its own keys): a switch to or from PowerSGD leaves the other
scheme's residual waiting until that scheme returns (delayed, not lost) — ours, the papers
do not switch schemes.

Compression gain (B.4): ``sqrt(Σ||g_c||² / Σ||g_e||²)`` over the step's buckets, with
``||g_c||² = ||g_e||² - ||e_new||²`` (exact for the sparse schemes, whose residual is the
error-fed gradient minus what was sent; for PowerSGD the residual is relative to the
global approximation, an estimate), summed over ranks: :attr:`AutoStrategy.last_gain`
and, per scheme, the ``min_gain`` constraint. The CR controller is fed *Top-k's* gain
instead, ``sqrt(Σ||top-k(g_e)||² / Σ||g_e||²)`` with ``k`` at the step's ratio (exact
Top-k of each rank's own error-fed bucket, :meth:`AutoStrategy._topk_reference`), the
paper's compressor whatever scheme ran: an exploration window's steps run different
schemes (the cheapest at each ratio), whose own gains are not comparable — AR-Top-k
keeps only what the source rank picked, gTop-k what survived the global selection.
Each (scheme, ratio)'s *efficiency*, ``Σ||g_c||² / Σ||top-k(g_e)||²`` (1 for Allgather
Top-k, which sends each rank's own top-k), is what ``gain_weighted`` divides by.

L-GreCo (``lgreco=True``), ``lgreco_family``:

* ``"topk"`` (default): inside each fused bucket every layer (segment) gets its own top-k
  density; the Allgather and AR-Top-k schemes send the union of per-segment top-k
  (AR-Top-k: the source's), so error feedback is per layer (each segment of the bucket's
  residual is that layer's). gTop-k truncates to one global k and PowerSGD has ranks, so
  the selector chooses among dense, Allgather Top-k and AR-Top-k.
* ``"qsgd"`` / ``"powersgd"``: every layer of a bucket gets its own QSGD bits / PowerSGD
  rank (:mod:`~.perlayer`: still one allgather, resp. two allreduces, per bucket); the
  selector chooses between dense and that per-layer scheme, predicted for the settings in
  force (:func:`~.perlayer.predict_bucket`), and re-decides after every L-GreCo solve.
  PowerSGD keeps error feedback per layer (segments of the bucket's residual) and a
  warm-start Q per layer; QSGD is unbiased and runs without.

Without ``step_done`` calls (a loop that neither uses ``GradientSync.step`` nor calls it)
the strategy keeps its first choices: no records, no refinement, no CR changes.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch
from mpi4py import MPI

from ..buffers import from_torch, to_torch
from ..collectives.cost import CostParams, calibrated
from ..comm import wait_all
from ..compress import ErrorFeedback
from ..compress.topk import k_for
from ..selection import topk_indices, topk_masses
from ..sparse import artopk, topk_allgather
from ..strategies._compressed import CompressedStrategy, check_floating
from ..strategies.base import DEFAULT_FUSION_BYTES, Strategy, fuse, fused_groups, link_delay
from .calibration import OnlineCalibration, calibrate
from .cr import DEFAULT_RATIOS, CRController
from .lgreco import DEFAULT_FACTORS, FAMILIES, LGreco
from .perlayer import FAMILY_SCHEMES, powersgd_bucket, predict_bucket, qsgd_bucket
from .selector import SCHEMES, Choice, Record, build, select

__all__ = ["AutoStrategy"]

_ALPHA = CostParams(alpha=1.0, beta=0.0, gamma=0.0)
_BETA = CostParams(alpha=0.0, beta=1.0, gamma=0.0)
_GAMMA_ONLY = CostParams(alpha=0.0, beta=0.0, gamma=1.0)
#: Ping-pong sizes (bytes) of the start-up calibration (``calibrate_links``): alpha.
CALIBRATION_SIZES = (8, 1 << 12)
#: Bytes of its one large transfer per link (``oneway_bytes``): beta.
CALIBRATION_ONEWAY_BYTES = 1 << 19
#: EWMA decay of :attr:`AutoStrategy.efficiency`: faster than the gains' (``decay``),
#: since an approximate scheme's efficiency falls within tens of steps as the ranks'
#: gradients stop agreeing (AR-Top-k on the adaptive bench: 0.8 at the first steps,
#: 0.5 by step 30), and a kept choice must give way before most of its steps ran.
EFFICIENCY_DECAY = 0.7
#: Steps after which a (scheme, ratio)'s efficiency counts as stale: its next
#: measurement replaces it instead of entering the EWMA. Efficiencies are measured only
#: while a scheme runs, and they fall as training goes on; on the adaptive bench the
#: AR-Top-k efficiency measured in the first trials (0.7-0.8) made it look cheapest
#: again when the network changed at step 66 (its exchange then took about half of
#: Allgather Top-k's), and it ran 5-9 steps at 0.5 before its EWMA caught up.
EFFICIENCY_STALE = 10
#: Longest sleep (seconds) between tests of the agreement allreduce still pending after
#: a step's exchanges (:func:`~mpicomm.comm.wait_all`; mostly it is complete by then): a
#: spinning rank takes a core from the others where ranks share cores.
AGREE_POLL_S = 5e-4
#: Agreed times kept per (bucket, ratio, scheme), at least: a measured cost is the
#: minimum of them (one step's time on a shared host is noisy).
MEASURED_TIMES = 2


class AutoStrategy(Strategy):
    """Adaptive strategy ("auto"): collective selector + CR controller + L-GreCo.

    Parameters
    ----------
    ratios:
        CR candidates (fractions kept) of the controller (default the paper's
        {0.1, 0.033, 0.011, 0.004, 0.001}).
    ratio:
        A fixed CR instead of the controller (1.0 = always dense).
    schemes:
        The schemes the selector may pick (default all of :data:`~.selector.SCHEMES`).
    approximate, min_gain:
        Accuracy constraints of the selector (see :func:`~.selector.select`): no gTop-k
        with ``approximate=False``; no scheme whose measured compression gain
        (:attr:`scheme_gains`, EWMA over the steps it ran, agreed) is below ``min_gain``
        — the buckets are re-decided as soon as a running scheme's gain falls below it.
        Not applied to the per-layer QSGD/PowerSGD families.
    weights, choice, window, trigger, warmup_steps, explore, cooldown, restore_first,
    total_steps, probe_first, probe_triggered:
        The CR controller's (:class:`~.cr.CRController`). The first exploration starts
        with the first step, a one-step probe by default (``probe_first``: Top-k's gain
        at every candidate ratio on step 0's error-fed gradients, measured locally
        beside the step's own exchange at the middle ratio; ours, see :mod:`~.cr`: on
        the adaptive bench it saved the 0.3-0.4 s of a 5-step window that is thrown
        away, about 10% of the best static run's time to the target); the explorations
        triggered later are probes too by default (``probe_triggered``, at the ratio in
        force: nothing thrown away), with ``probe_triggered=False`` the paper's windows,
        which save and restore (``restore_first=False`` keeps the first window's steps,
        going up the ratios: see :mod:`~.cr`); with ``total_steps`` (the training's
        length, when known) no exploration starts in the last
        ``2·window·len(ratios)`` steps. An exploration step runs the cheapest
        *sparse* scheme at its ratio, never dense or PowerSGD (PowerSGD at ratios 0.1
        and 0.033 cost up to 0.6 s a step in the window), and the controller is fed
        Top-k's gain at the ratio whatever scheme ran (module docstring). Its choices
        are not kept for later steps.
    switch_margin:
        Hysteresis of a re-decision: the running scheme stays unless another is
        predicted (or measured) cheaper by more than this fraction (noise on a shared
        host otherwise flips schemes, each switch costing a cold start).
    trial_margin, trial_steps:
        Choice by measurement where the model does not separate the schemes: every
        scheme whose cost (its measured time once it has run ``trial_steps`` steps at
        this bucket and ratio, else its prediction) is within ``trial_margin`` of the
        cheapest is *tried* for ``trial_steps`` real training steps (no rollback: every
        candidate is a valid aggregation at the same ratio), and the bucket then runs
        the scheme with the lowest measured time (min over its last
        ``max(trial_steps, MEASURED_TIMES)`` agreed times). A prediction that separates
        the schemes clearly (one candidate within the margin) is used without trials.
        ``trial_steps=0`` chooses by prediction only. Trials run outside CR exploration
        windows; a (debounced) network drift forgets the measurements and tries again.
        Default 1: on the adaptive bench every trial step of an approximate scheme
        (AR-Top-k, gTop-k, PowerSGD at efficiency 0.3-0.7) costs progress, and 2 put
        about 9 of the first 12 steps on trials. Ours, not the papers'.
    gain_weighted:
        ``True`` (default): compare schemes (in the choice by measurement and
        :meth:`_outrun`) by the step's seconds per unit of Top-k progress,
        ``(t + share) / efficiency`` (:meth:`_costs`): ``t`` the bucket's exchange,
        ``share`` its part of :attr:`step_other` (the forward, backward and optimizer
        time every step pays), ``efficiency`` the scheme's mass kept relative to exact
        Top-k's at that ratio (:attr:`efficiency`, squared like the paper's gain; dense
        and an unmeasured scheme 1). The idea: the number of steps to an accuracy grows
        as a scheme applies less of the error-fed gradient per step. Measured on the
        adaptive bench (digits, 4 ranks, ratio 0.011): AR-Top-k's exchange took about
        half Allgather Top-k's (20 against 38 ms) at efficiency 0.5-0.7, and its static
        run needed 1.4-2x the steps to 0.96; gTop-k's efficiency was 0.6-0.8. Without
        the share the faster exchange looked cheaper per unit of progress (20/0.6 < 38),
        with it (50/0.6 > 68) it does not. ``False``: time alone (the "cheapest that
        meets ``min_gain``" rule of the issue, per step). Efficiencies are measured
        only while a scheme runs (in trials and while kept), so an approximate scheme
        chosen early (efficiency 0.8 in the first steps, when the ranks' gradients
        agree) gives way within a few steps as its efficiency falls
        (:data:`EFFICIENCY_DECAY`). Ours.
    drift_patience:
        Debounce of re-decisions: a drift of alpha/beta
        (:class:`~.calibration.OnlineCalibration`'s ``patience``) or of a compute factor
        must persist for this many agreed steps in a row before the buckets are
        re-decided (a single slow step on a shared host does not re-decide). Default 5:
        on the emulated cluster (4 ranks on 2 cores) 3 re-decided 4 times in the first
        35 steps with nothing changed (the fit settling from the short calibration, and
        load noise), each re-running the trials; with 5, once or never in two runs,
        and the bench's network change at step 66 (2x the time per byte, 5x the
        latency) was flagged at step 70. ``drift=0.5`` missed that change altogether:
        it moves a whole compressed step's time by only about 40%.
    calibrate_links:
        Ping-pong links of the start-up calibration; ``0`` keeps the communicator's
        calibration (or the defaults) without measuring. It is short on purpose: per
        link, ping-pongs of 8 B and 4 KiB (3 repeats after 2 warm-ups: alpha) and one
        512 KiB transfer answered by 8 B (beta), about ``22·alpha + 512 KiB·beta`` per
        round of links (pairs on different nodes run at the same time,
        :func:`~mpicomm.collectives.calibrate.link_rounds`; the default 2 links are one
        round where there are 4 or more nodes: 0.09 s on the emulated cluster's 4
        hosts at 100 Mbit/s and 1 ms, compute kernels included, against 0.2 s for 3
        links one after another and 0.76 s for ping-pongs up to 256 KiB, which saw only
        half the rate behind its 128 KiB ``tbf`` burst). The online refinement corrects
        what it misses from the first real collectives; beta must be right to within a
        few times from the start, or a dense step looks cheap (measured: 32 KiB
        ping-pongs alone gave beta 100x too small, and a 1.1 s dense step).
    drift, decay:
        :class:`~.calibration.OnlineCalibration`'s drift fraction and EWMA decay.
    lgreco, lgreco_every, lgreco_acc_steps, lgreco_factors:
        Per-layer settings (:class:`~.lgreco.LGreco`), re-solved every so many steps
        from candidates around the uniform default (top-k and PowerSGD:
        ``factors × default``, ``(1.0,)`` = per-layer uniform, the baseline at the same
        total error; QSGD: ``default + {-2..2}`` bits).
    lgreco_family, lgreco_default:
        What L-GreCo sets per layer: ``"topk"`` densities (default: ``ratio``, else the
        largest of ``ratios``), ``"qsgd"`` bits (default 4) or ``"powersgd"`` ranks
        (default 4). With ``"qsgd"``/``"powersgd"`` the selector chooses between dense
        and the per-layer scheme (``"lgreco_qsgd"``/``"lgreco_powersgd"``,
        :mod:`~.perlayer`; ``schemes=("lgreco_qsgd",)`` forces it), and
        ``ratio``/``ratios`` and the CR controller are not used (the bits/ranks are the
        compression).
    history:
        How many :class:`~.selector.Record` entries :attr:`records` keeps.
    """

    name = "auto"

    def __init__(self, comm: Any = None, *, ratios: Sequence[float] = DEFAULT_RATIOS,
                 ratio: Optional[float] = None, schemes: Sequence[str] = SCHEMES,
                 approximate: bool = True, min_gain: float = 0.0,
                 weights: tuple[float, float] = (0.6, 0.4), choice: str = "asf",
                 window: int = 10, trigger: float = 0.1, warmup_steps: int = 0,
                 explore: bool = True, calibrate_links: int = 2, drift: float = 0.3,
                 decay: float = 0.9, lgreco: bool = False, lgreco_every: int = 50,
                 lgreco_acc_steps: int = 5, history: int = 10_000,
                 switch_margin: float = 0.1, cooldown: int = 50,
                 lgreco_factors: Sequence[float] = DEFAULT_FACTORS,
                 lgreco_family: str = "topk", lgreco_default: Optional[float] = None,
                 trial_margin: float = 0.5, trial_steps: int = 1, drift_patience: int = 5,
                 restore_first: bool = True, gain_weighted: bool = True,
                 total_steps: Optional[int] = None, probe_first: bool = True,
                 probe_triggered: bool = True,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES):
        super().__init__(comm, fusion_bytes=fusion_bytes)
        schemes = tuple(schemes)
        for name, v in (("trial_steps", trial_steps), ("drift_patience", drift_patience)):
            if isinstance(v, bool) or not isinstance(v, int) or \
                    v < (1 if name == "drift_patience" else 0):
                raise ValueError(f"{name} must be an int >= "
                                 f"{int(name == 'drift_patience')}, got {v!r}")
        if isinstance(trial_margin, bool) or not isinstance(trial_margin, (int, float)) or \
                not trial_margin >= 0:
            raise ValueError(f"trial_margin must be a number >= 0, got {trial_margin!r}")
        if lgreco_family not in FAMILIES:
            raise ValueError(f"lgreco_family must be one of {FAMILIES}, got {lgreco_family!r}")
        own = (FAMILY_SCHEMES[lgreco_family],) if lgreco and lgreco_family != "topk" else ()
        if not schemes or any(s not in SCHEMES + own for s in schemes):
            raise ValueError(f"schemes must be a non-empty subset of {SCHEMES + own}, "
                             f"got {schemes}")
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        if isinstance(calibrate_links, bool) or not isinstance(calibrate_links, int) or \
                calibrate_links < 0:
            raise ValueError(f"calibrate_links must be an int >= 0, got {calibrate_links!r}")
        #: ``"qsgd"``/``"powersgd"`` when L-GreCo runs that family, else ``None``.
        self.family: Optional[str] = None
        if own:
            self.family = lgreco_family
            # dense and the per-layer scheme; schemes=(own,) forces the per-layer scheme
            schemes = own if own[0] in schemes and "dense" not in schemes else \
                ("dense",) + own
            ratio, ratios = 1.0, (1.0,)  # not used: the per-layer bits/ranks compress
        elif lgreco:
            schemes = tuple(s for s in schemes if s not in ("gtopk", "powersgd")) or ("dense",)
        self.schemes = schemes
        self.approximate, self.min_gain = bool(approximate), float(min_gain)
        self.calibrate_links = calibrate_links
        self._drift, self._decay = drift, decay
        self.controller: Optional[CRController] = None
        if ratio is None and self.family is None:
            self.controller = CRController(self.sync_time, ratios, weights=weights,
                                           choice=choice, window=window, trigger=trigger,
                                           warmup_steps=warmup_steps, explore=explore,
                                           cooldown=cooldown, restore_first=restore_first,
                                           total_steps=total_steps, probe_first=probe_first,
                                           probe_triggered=probe_triggered)
        self._fixed_ratio = None if ratio is None else float(ratio)
        self.lgreco: Optional[LGreco] = None
        if lgreco:
            default: Any = lgreco_default
            if default is None:
                default = 4 if self.family else min(
                    ratio if ratio is not None else max(ratios), 1.0)
            self.lgreco = LGreco(default, every=lgreco_every, acc_steps=lgreco_acc_steps,
                                 factors=lgreco_factors, family=lgreco_family)
        self._psgd: dict[int, Any] = {}  # rank -> PowerSGD: per-layer warm starts
        self.memory = ErrorFeedback()
        self.memory.track_sent = True  # the step's ||g_e||² without forming g + e again
        self.records: deque[Record] = deque(maxlen=history)
        #: Called with each :class:`~.selector.Record` (e.g. a trace or metrics exporter).
        self.callbacks: list[Callable[[Record], None]] = []
        self.online: Optional[OnlineCalibration] = None
        self.steps = 0
        #: The last step's compression gain ``||g_c|| / ||g_e||`` (``None`` before one).
        self.last_gain: Optional[float] = None
        #: Each scheme's compression gain, EWMA over the steps it ran (agreed), checked
        #: against ``min_gain`` by the selector.
        self.scheme_gains: dict[str, float] = {}
        #: Each (scheme, ratio)'s efficiency: its compression gain relative to exact
        #: Top-k's on the same gradients, EWMA over the steps it ran (agreed): the
        #: divisor of its cost with ``gain_weighted``.
        self.efficiency: dict[tuple[str, float], float] = {}
        self._efficiency_step: dict[tuple[str, float], int] = {}  # last measured at
        self.gain_weighted = bool(gain_weighted)
        self._predicted: dict[tuple[str, float], dict[str, float]] = {}
        self.decisions: list[tuple[int, str, str, float]] = []  # (step, bucket, scheme, c)
        self._choices: dict[tuple[str, float], Choice] = {}
        self._subs: dict[tuple[str, float, Any], Strategy] = {}
        self._layouts: dict[str, tuple[list[tuple[int, ...]], int]] = {}
        self._coeffs: dict[tuple[Any, ...], tuple[float, float, float, float]] = {}
        self._segments: dict[str, list[tuple[str, int, tuple[int, ...]]]] = {}
        self._pending: list[dict[str, Any]] = []
        self._gain_sq = [0.0, 0.0, 0.0]  # Σ||g_c||², Σ||g_e||², Σ||top-k(g_e)||²: step
        self._probe_sq: list[float] = []  # Σ||top-k(g_e)||² at each ratio: a probe step
        self._saved: Optional[dict[str, Any]] = None
        self._started = False
        self._done: list[tuple[list[dict[str, Any]], list[float]]] = []
        #: Agreements under way (records, local sums, agreed sums, request) and agreed
        #: ones waiting for the next ``step_done`` (records, agreed sums).
        self._posted: list[tuple[list[dict[str, Any]], Any, Any, Any]] = []
        self._ready: list[tuple[list[dict[str, Any]], Any]] = []
        self._in_trial: dict[tuple[tuple[str, float], str], int] = {}  # trial steps
        self._adjust_due = False
        self._last_done: Optional[float] = None
        #: EWMA of a step's wall time outside the buckets' exchanges (forward, backward,
        #: optimizer; between ``step_done`` calls, mean over ranks): the part of a
        #: step's time that ``gain_weighted`` divides by the efficiency too.
        self.step_other: Optional[float] = None
        self._action: Optional[str] = None
        self._scales_used: dict[str, float] = {}
        self._current: dict[tuple[str, float], str] = {}
        self.switch_margin = float(switch_margin)
        self.trial_margin, self.trial_steps = float(trial_margin), trial_steps
        self.drift_patience = drift_patience
        self._moved_streak = 0  # consecutive agreed steps with a compute factor moved
        #: (bucket, ratio) -> scheme -> its last ``max(trial_steps, MEASURED_TIMES)``
        #: agreed times (seconds).
        self.measured: dict[tuple[str, float], dict[str, deque[float]]] = {}
        #: (bucket, ratio) -> (kept scheme, its settled time): :meth:`_times_moved`.
        self._baseline: dict[tuple[str, float], tuple[str, float]] = {}
        #: (step, bucket, scheme) of each trial step (choice by measurement).
        self.trials: list[tuple[int, str, str]] = []

    # ------------------------------------------------------------------ state
    @property
    def ratio(self) -> float:
        """The CR in force for the next aggregation."""
        if self._fixed_ratio is not None:
            return self._fixed_ratio
        assert self.controller is not None
        return self.controller.ratio

    @property
    def params(self) -> CostParams:
        """The agreed, refined alpha-beta-gamma in use."""
        return calibrated(self.comm)[0]

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
        """Residuals, the sub-strategies' own state (PowerSGD warm starts, AR-Top-k) and
        the per-layer PowerSGD family's warm-start Q per layer."""
        return {"residuals": self.memory.state_dict()["residuals"],
                "subs": {repr(k): s.state_dict() for k, s in self._subs.items()},
                "per_layer_q": {r: c.state_dict() for r, c in self._psgd.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "residuals" not in state:
            raise ValueError("AutoStrategy.load_state_dict: missing 'residuals'")
        self.memory.load_state_dict({"residuals": state["residuals"]})
        for k, s in self._subs.items():
            if repr(k) in state.get("subs", {}):
                s.load_state_dict(state["subs"][repr(k)])
        for r, q in state.get("per_layer_q", {}).items():
            if r not in self._psgd:
                from ..compress import PowerSGD

                seed = self.lgreco.seed if self.lgreco is not None else 0
                self._psgd[r] = PowerSGD(rank=int(r), warm_start=True, seed=seed)
            self._psgd[r].load_state_dict(q)

    # ------------------------------------------------------------------ prediction
    def _predict_shapes(self, shapes: list[tuple[int, ...]], itemsize: int, p: int,
                        params: CostParams, compute: Any) -> dict[str, float]:
        """The selector's cheapest scheme at the current ratio, per fused buffer."""
        comm_s = work = 0.0
        for positions in fused_groups(shapes, itemsize, self.fusion_bytes):
            group = [shapes[i] for i in positions]
            if self.family is not None:  # every layer at the uniform default
                assert self.lgreco is not None
                segs = [(f"#{i}", math.prod(s), s) for i, s in enumerate(group)]
                choice = self._family_choice(segs, itemsize, p, params, compute, {})
                parts = self._parts(choice.scheme, choice.ratio, segs, itemsize, p, params,
                                    compute)
                comm_s, work = comm_s + parts["comm"], work + parts["compute"]
                continue
            choice = select(group, self.ratio, itemsize, p, params, compute,
                            schemes=self.schemes, approximate=self.approximate)
            sub = build(choice.scheme, choice.ratio, group, fusion_bytes=self.fusion_bytes)
            assert sub is not None
            parts = sub.predict_parts(group, itemsize, p, params, compute)
            comm_s, work = comm_s + parts["comm"], work + parts["compute"]
        return {"comm": comm_s, "compute": work}

    def _family_values(self, segments: Sequence[tuple[str, int, tuple[int, ...]]]
                       ) -> list[float]:
        assert self.lgreco is not None
        return [self.lgreco.value(layer) for layer, _, _ in segments]

    def _parts(self, scheme: str, ratio: float,
               segments: Sequence[tuple[str, int, tuple[int, ...]]], itemsize: int,
               p: int, params: CostParams, compute: Any) -> dict[str, float]:
        """``predict_parts`` of ``scheme`` on a bucket of ``segments`` (the per-layer
        family schemes at the layers' current L-GreCo settings)."""
        shapes = [shape for _, _, shape in segments]
        if self.family is not None and scheme == FAMILY_SCHEMES[self.family]:
            assert self.lgreco is not None
            return predict_bucket(self.family, shapes, self._family_values(segments),
                                  itemsize, p, params, compute, self.lgreco.bucket_size)
        sub = build(scheme, ratio, shapes, fusion_bytes=self.fusion_bytes)
        assert sub is not None, scheme
        return sub.predict_parts(shapes, itemsize, p, params, compute)

    def _family_choice(self, segments: Sequence[tuple[str, int, tuple[int, ...]]],
                       itemsize: int, p: int, params: CostParams, compute: Any,
                       scales: dict[str, float]) -> Choice:
        """Dense or the family's per-layer scheme at the current settings, the cheaper
        (ties: dense); ``ratio`` of the per-layer scheme = its wire bytes / dense bytes."""
        assert self.family is not None
        candidates = {}
        for scheme in self.schemes:
            parts = self._parts(scheme, 1.0, segments, itemsize, p, params, compute)
            candidates[scheme] = parts["comm"] + scales.get(scheme, 1.0) * parts["compute"]
        best = min(candidates, key=lambda s: (candidates[s], self.schemes.index(s)))
        return Choice(best, 1.0 if best == "dense" else self._family_ratio(segments, itemsize),
                      candidates[best], candidates)

    def _family_ratio(self, segments: Sequence[tuple[str, int, tuple[int, ...]]],
                      itemsize: int) -> float:
        """Wire bytes of the layers at their settings / their dense bytes (the L-GreCo
        DP's sizes: the compressors' ``wire_bytes``)."""
        lg = self.lgreco
        assert lg is not None
        wire = sum(lg.compressor(layer).wire_bytes(n, 4, shape=shape)
                   for layer, n, shape in segments)
        return min(1.0, wire / max(1, 4 * sum(n for _, n, _ in segments)))

    def sync_time(self, ratio: float) -> float:
        """Predicted seconds of one step's synchronization at ``ratio`` (all buckets seen
        so far, the cheapest scheme each): the CR controller's time objective."""
        params, compute = calibrated(self.comm)
        total = 0.0
        for shapes, itemsize in self._layouts.values():
            total += select(shapes, ratio, itemsize, self.comm.size, params, compute,
                            schemes=self.schemes, approximate=self.approximate).predicted
        return total

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
            self._adjust_lgreco()
        if self._done:  # the first aggregation of a step: agree on the finished ones
            self._post()
        as_torch = [to_torch(t) for t in tensors]
        results: list[Any] = [None] * len(tensors)
        comm = self.comm
        before, start = comm.traffic.snapshot(), time.perf_counter()
        for buf in fuse(as_torch, names, self.fusion_bytes):
            shapes = list(buf.shapes)
            itemsize = buf.flat.element_size()
            self._layouts[buf.name] = (shapes, itemsize)
            self._segments[buf.name] = [(names[i], math.prod(s), tuple(s))
                                        for i, s in zip(buf.indices, shapes)]
            parts = self._run_bucket(buf, [names[i] for i in buf.indices],
                                     [as_torch[i] for i in buf.indices])
            for i, part in zip(buf.indices, parts):
                results[i] = from_torch(part.view(as_torch[i].shape), like=tensors[i])
        # Not base.measure: the inner strategies already sleep their emulated link delay.
        self.stats.add_call(comm.traffic - before, as_torch, time.perf_counter() - start)
        if self._posted:  # progressed during the buckets' exchanges: done or nearly
            self._complete()
        return results

    def aggregate_flat(self, flat: Any, name: str) -> Any:
        return self.aggregate([flat], [name])[0]

    def _ensure_calibrated(self) -> None:
        if self.online is not None:
            return
        comm = self.comm
        if self.calibrate_links and "compute_params" not in comm.resources:
            # short (class docstring, calibrate_links): the online refinement fixes beta
            calibrate(comm, links=self.calibrate_links, compute_numel=1 << 19,
                      sizes=CALIBRATION_SIZES, repeats=3,
                      oneway_bytes=CALIBRATION_ONEWAY_BYTES)
        self.online = OnlineCalibration(calibrated(comm)[0], decay=self._decay,
                                        drift=self._drift, patience=self.drift_patience)

    def _sub(self, scheme: str, ratio: float, shapes: list[tuple[int, ...]]) -> Strategy:
        key = (scheme, ratio, tuple(shapes) if scheme == "powersgd" else None)
        sub = self._subs.get(key)
        if sub is None:
            sub = build(scheme, ratio, shapes, comm=self.comm, fusion_bytes=self.fusion_bytes)
            assert sub is not None, scheme
            if isinstance(sub, CompressedStrategy) and scheme != "powersgd":
                sub.memory = self.memory  # one residual per bucket, whatever the scheme
            self._subs[key] = sub
        return sub

    def _run_bucket(self, buf: Any, names: list[str], tensors: list[torch.Tensor]
                    ) -> list[torch.Tensor]:
        ratio = self.ratio
        key = (buf.name, ratio)
        choice = self._choices.get(key)
        counted = False  # a trial step, counted until its time is agreed
        params, compute = calibrated(self.comm)
        shapes, itemsize = self._layouts[buf.name]
        p = self.comm.size
        scales = self.online.compute_scales() if self.online is not None else {}
        segments = self._segments[buf.name]
        exploring = self.controller is not None and self.controller.exploring
        if choice is None:
            if self.family is not None:
                choice = self._family_choice(segments, itemsize, p, params, compute, scales)
            else:
                # an exploration step measures the top-k gain at the ratio: a sparse
                # scheme (dense's gain is 1 at any ratio, PowerSGD's is a rank's)
                schemes = tuple(s for s in self.schemes
                                if s not in ("dense", "powersgd") or not exploring) \
                    if ratio < 1.0 else self.schemes
                choice = select(shapes, ratio, itemsize, p, params, compute,
                                schemes=schemes or self.schemes, approximate=self.approximate,
                                fusion_bytes=self.fusion_bytes, compute_scale=scales,
                                gains=self.scheme_gains, min_gain=self.min_gain)
            trial, predicted = False, choice.candidates
            if self.family is None and self.trial_steps and not exploring:
                choice, trial = self._by_measurement(key, choice)
            current = self._current.get(key)
            if not trial and current is not None and current in choice.candidates and \
                    current != choice.scheme and choice.candidates[current] <= \
                    (1 + self.switch_margin) * choice.predicted:
                # hysteresis: keep the running scheme unless the new one is clearly cheaper
                choice = Choice(current, 1.0 if current == "dense" else
                                (self._family_ratio(segments, itemsize) if self.family
                                 else ratio),
                                choice.candidates[current], choice.candidates)
            if trial:  # not cached: the next steps decide again, with it counted
                under_way = self._in_trial.get((key, choice.scheme), 0)
                if len(self.measured.get(key, {}).get(choice.scheme, ())) + under_way < \
                        self.trial_steps:  # (else the cheapest tried, while others wait)
                    self.trials.append((self.steps, buf.name, choice.scheme))
                    self._in_trial[(key, choice.scheme)] = under_way + 1
                    counted = True
            elif not exploring:  # a window's choice (sparse schemes only) is not kept
                self._choices[key] = choice
                self._current[key] = choice.scheme
                if self.family is None:  # the candidates _outrun re-checks it against
                    self._predicted[key] = dict(predicted)
            self.decisions.append((self.steps, buf.name, choice.scheme, choice.ratio))
        per_layer = self.family is not None and choice.scheme != "dense"
        sub = None if per_layer else self._sub(choice.scheme, choice.ratio, shapes)
        ref_sq = self._topk_reference(choice.scheme, ratio, buf, names, tensors, sub)
        comm = self.comm
        before, start = comm.traffic.snapshot(), time.perf_counter()
        if choice.scheme == "powersgd":
            assert sub is not None
            e_sq = sum(_sq(t) + (_sq(to_torch(sub.memory.residual(n)))  # type: ignore
                                 if sub.memory is not None and n in sub.memory else 0.0)
                       for t, n in zip(tensors, names))
            out = [to_torch(o) for o in sub.aggregate(tensors, names)]  # sleeps its delay
            left = sum(_sq(to_torch(sub.memory.residual(n)))  # type: ignore
                       for n in names if sub.memory is not None and n in sub.memory)
        else:
            flat = buf.flat
            if choice.scheme == "dense":
                assert sub is not None
                if buf.name in self.memory:
                    flat = self.memory.compensate(buf.name, flat)
                    self.memory.reset(buf.name)
                e_sq, left = _sq(flat), 0.0  # gain 1
                averaged = sub.aggregate_flat(flat, buf.name)
            elif per_layer:
                c = self._error_fed(choice.scheme, buf, names, tensors, sub)
                e_sq = _sq(c)
                self._accumulate(buf.name, c)
                averaged, left = self._per_layer(c, buf.name)
            else:  # the sparse schemes send entries of g + e and keep the others:
                if self.lgreco is not None:  # ||g + e||² = ||sent||² + ||residual||²
                    c = self._error_fed(choice.scheme, buf, names, tensors, sub)
                    self._accumulate(buf.name, c)
                    averaged = self._segmented(choice.scheme, choice.ratio, c, buf.name)
                else:  # (the strategy forms g + e itself)
                    assert sub is not None
                    averaged = sub.aggregate_flat(flat, buf.name)
                left = _sq(to_torch(self.memory.residual(buf.name)))
                e_sq = left + self.memory.sent_sq(buf.name)
            delay = link_delay(comm, comm.traffic - before)
            if delay > 0:
                time.sleep(delay)
            out = buf.split(averaged)
        seconds = time.perf_counter() - start
        kept_sq = max(e_sq - left, 0.0)
        if ref_sq is None:  # Allgather Top-k (or no ratio): what it kept is the reference
            ref_sq = kept_sq
        for i, v in enumerate((kept_sq, e_sq, ref_sq)):
            self._gain_sq[i] += v
        a, b, work, g = self._coefficients(buf.name, choice.scheme, choice.ratio, itemsize,
                                           compute)
        work += params.gamma * g
        kappa = scales.get(choice.scheme, 1.0)
        self._pending.append({"step": self.steps, "bucket": buf.name,
                              "scheme": choice.scheme, "key_ratio": ratio,
                              "ratio": choice.ratio, "seconds": seconds, "a": a, "b": b,
                              "work": work, "kept_sq": kept_sq, "e_sq": e_sq,
                              "ref_sq": ref_sq, "trial": counted,
                              "predicted": a * params.alpha + b * params.beta + kappa * work})
        return [o.reshape(-1) for o in out]

    def _coefficients(self, bucket: str, scheme: str, ratio: float, itemsize: int,
                      compute: Any) -> tuple[float, float, float, float]:
        """``scheme``'s prediction for ``bucket`` is linear in the link parameters:
        ``a·alpha + b·beta + work + g·gamma``; returns ``(a, b, work, g)``, computed once
        per (bucket, scheme, ratio, per-layer settings, compute kernels) and kept (three
        ``predict_parts`` calls otherwise, every step)."""
        segments = self._segments[bucket]
        settings = tuple(self._family_values(segments)) \
            if self.family is not None and scheme == FAMILY_SCHEMES[self.family] else ()
        key = (bucket, tuple(segments), scheme, ratio, settings, compute)
        cached = self._coeffs.get(key)
        if cached is None:
            p = self.comm.size
            parts = [self._parts(scheme, ratio, segments, itemsize, p, c, compute)
                     for c in (_ALPHA, _BETA, _GAMMA_ONLY)]
            cached = (parts[0]["comm"], parts[1]["comm"], parts[0]["compute"],
                      parts[2]["comm"])
            self._coeffs[key] = cached
        return cached

    def _costs(self, key: tuple[str, float], predicted: dict[str, float],
               partial: bool = False) -> dict[str, float]:
        """Each candidate's cost at ``key`` = (bucket, ratio): its measured time (min of
        its kept agreed times, :data:`MEASURED_TIMES`) once measured ``trial_steps``
        times (``partial``: once measured at all), else its prediction. With
        ``gain_weighted``: seconds of the *step* per unit of Top-k progress,
        ``(t + share) / efficiency``, where ``share`` is the bucket's part (by elements)
        of :attr:`step_other` and the :attr:`efficiency` at this ratio is 1 for dense
        and for a scheme not measured yet (not ruled out unseen). The share matters: a
        scheme whose exchange takes half the time but keeps 0.6 of Top-k's mass needs
        about 1/0.6 the steps, each with the whole forward and backward."""
        seen = self.measured.get(key, {})
        share = 0.0
        if self.gain_weighted and self.step_other and key[0] in self._layouts:
            sizes = {b: sum(math.prod(s) for s in shapes)
                     for b, (shapes, _) in self._layouts.items()}
            share = self.step_other * sizes[key[0]] / max(1, sum(sizes.values()))
        cost = {}
        enough = 1 if partial else self.trial_steps
        for s, t in predicted.items():
            t = min(seen[s]) if len(seen.get(s, ())) >= max(enough, 1) else t
            if self.gain_weighted:
                t = (t + share) / (1.0 if s == "dense" else
                                   max(self.efficiency.get((s, key[1]), 1.0), 1e-3))
            cost[s] = t
        return cost

    def _error_fed(self, scheme: str, buf: Any, names: list[str],
                   tensors: list[torch.Tensor], sub: Optional[Strategy]) -> torch.Tensor:
        """This rank's error-fed bucket ``g + residual`` (flat, a new tensor where there is
        a residual), before the exchange."""
        if scheme == "powersgd":  # error feedback per tensor, in the sub-strategy
            memory = getattr(sub, "memory", None)
            return torch.cat([t.reshape(-1) + to_torch(memory.residual(n)).reshape(-1)
                              if memory is not None and n in memory else t.reshape(-1)
                              for t, n in zip(tensors, names)])
        fed = buf.flat.reshape(-1)
        if buf.name in self.memory:
            fed = fed + to_torch(self.memory.residual(buf.name)).reshape(-1)
        return fed

    def _topk_reference(self, scheme: str, ratio: float, buf: Any, names: list[str],
                        tensors: list[torch.Tensor], sub: Optional[Strategy]
                        ) -> Optional[float]:
        """``||top-k(g_e)||²``: what exact Top-k at ``ratio`` would keep of this rank's
        error-fed bucket (``k = max(1, ceil(ratio·n))``), before the exchange; ``None``
        where that is what the step keeps itself (Allgather Top-k) or where there is no
        Top-k ratio (fixed ratio 1, the L-GreCo paths). During the CR controller's probe
        step, also adds the mass at every candidate ratio to the step's probe sums. One
        extra top-k selection per bucket (1-3 ms for 1.1e6 floats on one core) on the
        other schemes' steps."""
        probing = self.controller is not None and self.controller.probing
        kept_is_reference = scheme == "allgather_topk" or self.lgreco is not None
        if not probing and (kept_is_reference or ratio >= 1.0):
            return None
        fed = self._error_fed(scheme, buf, names, tensors, sub)
        n = int(fed.shape[0])
        if not probing:
            return topk_masses(fed, [k_for(n, ratio)])[0]
        assert self.controller is not None  # a probe step runs at one of its ratios
        ratios = self.controller.ratios
        masses = topk_masses(fed, [k_for(n, c) for c in ratios])
        if not self._probe_sq:
            self._probe_sq = [0.0] * len(ratios)
        for i, m in enumerate(masses):
            self._probe_sq[i] += m
        return None if kept_is_reference else masses[ratios.index(ratio)]

    def _by_measurement(self, key: tuple[str, float], choice: Choice
                        ) -> tuple[Choice, bool]:
        """The choice among ``choice.candidates`` by measured time where the model
        does not separate them (``trial_margin``/``trial_steps``, class docstring):
        ``(choice, True)`` for a trial step of a scheme not measured enough yet, else the
        cheapest by measured time (prediction where unmeasured; :meth:`_costs`). A scheme
        partly tried counts with the steps it ran, so one step that puts it outside the
        margin ends its trial (PowerSGD at ratio 0.011 on the adaptive bench: 74 ms at
        efficiency 0.3). Trial steps whose times are still being agreed count as run,
        and the schemes take turns: one with a step under way waits while the others
        run (when all wait, the cheapest fully tried scheme runs, uncached), so no
        scheme runs a step more than ``trial_steps`` because of the agreement's lag.
        Pure arithmetic on agreed numbers: the same on every rank."""
        seen = self.measured.get(key, {})
        cost = self._costs(key, choice.candidates, partial=True)
        best = min(cost.values())
        close = sorted((s for s in cost if cost[s] <= (1 + self.trial_margin) * best),
                       key=lambda s: (cost[s], SCHEMES.index(s)))
        untried = [s for s in close if len(seen.get(s, ())) +
                   self._in_trial.get((key, s), 0) < self.trial_steps]
        waiting = [s for s in untried if not self._in_trial.get((key, s))]
        done = [s for s in close if s not in untried]
        # round robin: a scheme whose last trial step is still being agreed waits; the
        # others (or, when all wait, the cheapest fully tried one) run meanwhile
        pick = waiting[0] if waiting else (done or untried or close)[0]
        return Choice(pick, 1.0 if pick == "dense" else key[1], cost[pick], cost), \
            bool(untried) and len(close) > 1

    # ------------------------------------------------------------------ L-GreCo path
    def _accumulate(self, bucket: str, c: torch.Tensor) -> None:
        lg = self.lgreco
        if lg is None or self.comm.rank != 0 or not lg.accumulating(self.steps):
            return
        offset = 0
        for layer, n, _ in self._segments[bucket]:
            lg.accumulate(layer, c[offset:offset + n])
            offset += n

    def _segment_indices(self, c: torch.Tensor, bucket: str) -> torch.Tensor:
        """Per-layer top-k of ``c`` with each layer's L-GreCo density, as bucket indices."""
        assert self.lgreco is not None
        picks, offset = [], 0
        for layer, n, _ in self._segments[bucket]:
            k = max(1, min(n, math.ceil(self.lgreco.density(layer) * n)))
            picks.append(topk_indices(c[offset:offset + n], k).to(torch.int64) + offset)
            offset += n
        return torch.cat(picks).sort().values

    def _per_layer(self, c: torch.Tensor, bucket: str) -> tuple[torch.Tensor, float]:
        """The bucket with each layer at its own QSGD bits / PowerSGD rank, and the
        squared norm of what was not transmitted. PowerSGD: that is the error-feedback
        residual, kept per layer (= per segment of the bucket's residual). QSGD is
        unbiased and runs without error feedback (as :class:`~mpicomm.strategies.
        QSGDAllgather` by default: at 2-4 bits its residual is as large as the gradient
        and error feeding it diverges)."""
        lg, segments = self.lgreco, self._segments[bucket]
        assert lg is not None and self.family is not None
        values = {layer: int(lg.value(layer)) for layer, _, _ in segments}
        if self.family == "qsgd":
            mean, own = qsgd_bucket(c, segments, values, self.comm, self.steps,
                                    bucket_size=lg.bucket_size, seed=lg.seed)
            return mean, _sq(c - own)
        mean, sent = powersgd_bucket(c, segments, values, self.comm, self.steps, self._psgd,
                                     seed=lg.seed)
        self.memory.update(bucket, c, sent)
        return mean, _sq(to_torch(self.memory.residual(bucket)))

    def _segmented(self, scheme: str, ratio: float, c: torch.Tensor, bucket: str
                   ) -> torch.Tensor:
        numel = c.shape[0]
        idx = self._segment_indices(c, bucket)
        if scheme == "allgather_topk":
            values = c[idx]
            self.memory.update_sparse(bucket, c, idx, inplace=False)
            return topk_allgather(idx, values, numel, op="avg", comm=self.comm)
        # AR-Top-k: the source's per-segment picks; k agreed from the source's count
        step = self.steps
        source = step % self.comm.size
        k = int(self.comm.bcast_object(int(idx.shape[0]), root=source))
        got, mean = artopk(c, k, step, "star", self.comm, None, scheme.split("_")[1],
                           source_indices=idx if self.comm.rank == source else None)
        self.memory.update_sparse(bucket, c, got, inplace=False)
        out = torch.zeros(numel, dtype=c.dtype, device=c.device)
        out[got] = mean
        return out

    # ------------------------------------------------------------------ the step
    def step_done(self, model: Any = None, optimizer: Any = None) -> None:
        """End of a training step (no communication here; see the module docstring).

        The step's measurements are queued for agreement; the measurements agreed during
        this step (those of the step before) decide the next step (:meth:`_decide`,
        pure arithmetic on agreed numbers), and an action the CR controller decided is
        carried out now, at this safe point: ``model``/``optimizer`` (and the
        error-feedback memory) are saved or restored around CR exploration windows
        (without them the windows run but only the memory is restored)."""
        now = time.perf_counter()
        wall = 0.0 if self._last_done is None else now - self._last_done
        self._done.append((self._pending, self._gain_sq + [wall] + self._probe_sq))
        self._pending, self._gain_sq, self._probe_sq = [], [0.0, 0.0, 0.0], []
        actions = [self._action]
        self._action = None
        ready, self._ready = self._ready, []
        actions += [self._decide(pending, agreed) for pending, agreed in ready]
        self.steps += 1
        for action in actions:
            self._act(action, model, optimizer)
        self._last_done = time.perf_counter()

    def _post(self) -> None:
        """Start agreeing on the finished steps' measurements: one small nonblocking
        allreduce per step at the first aggregation of the next step, completed at its
        end (:meth:`_complete`), after the buckets' exchanges have moved it along and
        have made the ranks wait for each other anyway (module docstring, *When
        decisions take effect*)."""
        comm = self.comm
        for pending, gain_sq in self._done:
            local = np.array([r[f] for f in ("seconds", "kept_sq", "e_sq", "ref_sq")
                              for r in pending] + gain_sq, dtype=np.float64)
            if comm.size == 1:
                self._ready.append((pending, local))
                continue
            if comm.check:  # checked mode: the ranks aggregated the same buckets
                counts = comm.allgather_object(len(pending))
                if len(set(counts)) != 1:
                    raise RuntimeError(f"auto strategy: ranks aggregated different numbers "
                                       f"of buckets in a step: {counts}")
            agreed = np.empty_like(local)
            self._posted.append((pending, local, agreed,
                                 comm.ctl.Iallreduce(local, agreed, op=MPI.SUM)))
        self._done = []

    def _complete(self) -> None:
        """Finish the agreements :meth:`_post` started (waiting asleep,
        :data:`AGREE_POLL_S`); they decide at the next ``step_done``."""
        posted, self._posted = self._posted, []
        wait_all([request for *_, request in posted], AGREE_POLL_S)
        for pending, _, agreed, _ in posted:
            agreed[:len(pending)] /= self.comm.size
            self._ready.append((pending, agreed))

    def _decide(self, pending: list[dict[str, Any]], agreed: Any) -> Optional[str]:
        """One finished step's agreed measurements (``pending``: its buckets' records,
        ``agreed``: their seconds and squared norms, then the step's sums, wall time and
        probe masses) decide the next step, at ``step_done``, the same on every rank:
        records, the online refinement, the trials' times, the gains; a re-decision on
        a drift, an outrun choice or a gain below ``min_gain``; the CR controller (its
        action is returned) and L-GreCo's next solve."""
        assert self.online is not None
        n = len(pending)
        seconds = agreed[:n]
        self._track_gains(pending, agreed[n:2 * n], agreed[2 * n:3 * n],
                          agreed[3 * n:4 * n])
        params = self.online.params
        for r, t in zip(pending, seconds):
            self._observe(r, float(t), params)
        drift = self.online.refine(None)
        self.comm.resources["cost_params"] = self.online.params
        scales = self.online.compute_scales()
        shifted = any(abs(v - self._scales_used.get(k, 1.0)) > self._drift *
                      self._scales_used.get(k, 1.0) for k, v in scales.items())
        # counted only while the step's own times are off the predictions by the drift
        # fraction (the EWMA fit stays moved for steps after one outlier step)
        predicted = sum(r["predicted"] for r in pending)
        off = predicted > 0 and abs(float(seconds.sum()) - predicted) > \
            self._drift * predicted
        self._moved_streak = self._moved_streak + 1 if shifted and off else 0
        moved = self._moved_streak >= self.drift_patience  # debounced like alpha/beta
        low = {k for k, c in self._choices.items()
               if self.scheme_gains.get(c.scheme, 1.0) < self.min_gain}
        if self.trial_steps and not drift and not moved:
            for key in self._outrun():  # measured slower than another choice: re-decide
                del self._choices[key]
                self._baseline.pop(key, None)
        if drift and self._times_moved():  # the network changed: measured times are
            self.measured.clear()              # stale, try again
        if drift or moved or low:  # re-decide with the refined model / measured gains
            self._choices.clear()
            self._baseline.clear()
            self._scales_used = scales
            self._moved_streak = 0
        kept, total, ref, wall = (float(v) for v in agreed[4 * n:4 * n + 4])
        probe = [float(v) for v in agreed[4 * n + 4:]]
        if wall > 0:  # mean over ranks of the step's wall time outside the buckets
            other = max(wall / self.comm.size - float(seconds.sum()), 0.0)
            self.step_other = other if self.step_other is None else \
                self._decay * self.step_other + (1 - self._decay) * other
        self.last_gain = min(math.sqrt(kept / total), 1.0) if total > 0 else 1.0
        # the CR controller's gain: exact Top-k's at the ratio on this step's error-fed
        # gradients, whatever scheme ran (comparable across the ratios of a window)
        gain = min(math.sqrt(ref / total), 1.0) if total > 0 else 1.0
        action = None
        if self.controller is not None:
            before = self.controller.ratio
            if drift:
                self.controller.network_changed()
            # the probe's masses reach the controller once (the step after the probe
            # ran while its result was being agreed, and measured them too)
            gains = None if not (probe and self.controller.probing) else {
                c: min(math.sqrt(m / total), 1.0) if total > 0 else 1.0
                for c, m in zip(self.controller.ratios, probe)}
            ran = pending[0]["key_ratio"] if pending else None
            if gains is not None or not self.controller.probing:
                action = self.controller.observe(gain, probe=gains, ratio=ran)
            if self.controller.ratio != before:
                self._choices = {k: v for k, v in self._choices.items()
                                 if k[1] == self.controller.ratio}
                self._baseline = {k: v for k, v in self._baseline.items()
                                  if k in self._choices}
        lg = self.lgreco
        if lg is not None and (self.steps + 1) % lg.every == 0:
            self._adjust_due = True  # at the next aggregation, inside the collectives
        return action

    def _observe(self, r: dict[str, Any], seconds: float, params: CostParams) -> None:
        """One bucket's agreed time: the online refinement, the trials' measured times
        (and a kept choice's settled time), a :class:`~.selector.Record`."""
        assert self.online is not None
        self.online.observe(r["a"], r["b"], seconds, r["work"], r["scheme"])
        key = (r["bucket"], r["key_ratio"])
        if r["trial"]:
            left = self._in_trial.get((key, r["scheme"]), 0) - 1
            if left > 0:
                self._in_trial[(key, r["scheme"])] = left
            else:
                self._in_trial.pop((key, r["scheme"]), None)
        if self.trial_steps:
            times = self.measured.setdefault(key, {}).setdefault(
                r["scheme"], deque(maxlen=max(self.trial_steps, MEASURED_TIMES)))
            times.append(seconds)
            choice = self._choices.get(key)
            if choice is not None and choice.scheme == r["scheme"] and \
                    len(times) == self.trial_steps and key not in self._baseline:
                self._baseline[key] = (r["scheme"], min(times))
        rec = Record(r["step"], r["bucket"], r["scheme"], r["ratio"], r["predicted"],
                     seconds, params.alpha, params.beta)
        self.records.append(rec)
        for cb in self.callbacks:
            cb(rec)

    def _adjust_lgreco(self) -> None:
        """L-GreCo's solve on rank 0, broadcast (:meth:`~.lgreco.LGreco.adjust`); the
        per-layer families' choices are re-decided with the new settings."""
        assert self.lgreco is not None
        shapes = {layer: shape for segs in self._segments.values()
                  for layer, _, shape in segs}
        self.lgreco.adjust(self.comm, shapes)
        if self.family is not None:  # the predictions changed with the settings
            self._choices.clear()
            self._baseline.clear()

    def _track_gains(self, pending: list[dict[str, Any]], kept: Any, total: Any,
                     ref: Any) -> None:
        """EWMAs (weight ``1 - decay``) over the steps a scheme ran, from the step's
        squared norms summed over ranks (agreed): each scheme's compression gain
        ``sqrt(Σ||g_c||² / Σ||g_e||²)`` over its buckets (:attr:`scheme_gains`, the
        selector's ``min_gain`` constraint) and each (scheme, ratio)'s *efficiency*
        ``Σ||g_c||² / Σ||top-k(g_e)||²``, capped at 1 (:attr:`efficiency`, the divisor of
        its cost with ``gain_weighted``; squared, as the paper's gain; decay
        :data:`EFFICIENCY_DECAY`; a value last measured more than
        :data:`EFFICIENCY_STALE` steps before is replaced, not averaged)."""
        for gains, key_of, den, power, decay in (
                (self.scheme_gains, lambda r: r["scheme"], total, 0.5, self._decay),
                (self.efficiency, lambda r: (r["scheme"], r["key_ratio"]), ref, 1.0,
                 EFFICIENCY_DECAY)):
            sums: dict[Any, list[float]] = {}
            for r, c, e in zip(pending, kept, den):
                acc = sums.setdefault(key_of(r), [0.0, 0.0])
                acc[0], acc[1] = acc[0] + float(c), acc[1] + float(e)
            step = pending[0]["step"] if pending else self.steps
            for k, (c, e) in sums.items():
                if e > 0:
                    g = min(1.0, c / e) ** power
                    old = gains.get(k)
                    if gains is self.efficiency:  # an old value is no prior: replaced
                        if step - self._efficiency_step.get(k, step) > EFFICIENCY_STALE:
                            old = None
                        self._efficiency_step[k] = step
                    gains[k] = g if old is None else decay * old + (1 - decay) * g

    def _times_moved(self) -> bool:
        """Whether a kept choice's own recent times (min of its last ``trial_steps``)
        moved by more than the drift fraction from those it settled at: a network change,
        after which every measured time is stale. A drift of the fitted alpha/beta alone
        (the fit settling away from the short start-up ping-pongs, in the first tens of
        steps) leaves them in place, so it re-decides without repeating the trials.
        ``False`` when no kept choice has settled times to compare: the trials under way
        are recent (on the adaptive bench the fit's drift came at step 5, during the
        first trials, in two of three runs; forgetting them re-ran every trial, and
        those runs took 3.4-3.7 s to the target against 2.5 s for the third)."""
        for key, (scheme, base) in self._baseline.items():
            choice, recent = self._choices.get(key), self.measured.get(key, {}).get(scheme)
            if choice is None or choice.scheme != scheme or not recent:
                continue
            if abs(min(recent) - base) > self._drift * base:
                return True
        return False

    def _outrun(self) -> set[tuple[str, float]]:
        """Kept choices whose own measured cost (:meth:`_costs`, ``trial_steps`` agreed
        times) exceeds another candidate's by more than ``switch_margin`` where that
        one's cost is measured too, by more than ``trial_margin`` where it is only
        predicted: re-decided at the next step (a prediction that was wrong, e.g. a dense
        step predicted cheap from a beta the sparse steps' times could not pin down, runs
        ``trial_steps`` steps, not until the next drift; a scheme whose efficiency fell
        as training went on gives way to one measured cheaper per unit of progress)."""
        out = set()
        for key, choice in self._choices.items():
            predicted = self._predicted.get(key)
            seen = self.measured.get(key, {})
            if predicted is None or len(seen.get(choice.scheme, ())) < self.trial_steps or \
                    len(predicted) < 2:
                continue
            cost = self._costs(key, predicted)
            mine = cost.get(choice.scheme, 0.0)
            for s, v in cost.items():
                margin = self.switch_margin if len(seen.get(s, ())) >= self.trial_steps \
                    else self.trial_margin
                if s != choice.scheme and mine > (1 + margin) * v:
                    out.add(key)
        return out

    def _act(self, action: Optional[str], model: Any, optimizer: Any) -> None:
        if action == "save":
            self._saved = {
                "model": None if model is None else copy.deepcopy(model.state_dict()),
                "optimizer": None if optimizer is None
                else copy.deepcopy(optimizer.state_dict()),
                "strategy": self.state_dict()}
        elif action == "restore" and self._saved is not None:
            saved, self._saved = self._saved, None
            if model is not None and saved["model"] is not None:
                model.load_state_dict(saved["model"])
            if optimizer is not None and saved["optimizer"] is not None:
                optimizer.load_state_dict(saved["optimizer"])
            self.load_state_dict(saved["strategy"])


def _sq(t: torch.Tensor) -> float:
    """``||t||²``. CPU float32/64 in numpy's single-threaded einsum (the norms of every
    step: torch's intra-op threads compete with the ranks where they share cores, as in
    :func:`~mpicomm.selection.topk_masses`; 0.16 ms for 1.1e6 float32, relative error
    1e-6 against float64), else torch in float64."""
    t = t.detach().reshape(-1)
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        a = t.numpy()
        return float(np.einsum("i,i->", a, a))
    t = t.to(torch.float64)
    return float(torch.dot(t, t))
