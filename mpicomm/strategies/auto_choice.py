r"""Which scheme each fused bucket runs: the kept choices and the measurements behind them.

:class:`SchemeChoices` is the bookkeeping of :class:`~mpicomm.strategies.AutoStrategy`'s
choice per ``(bucket, ratio)``, pure arithmetic on numbers every rank has agreed on, so
every rank keeps the same choices:

* the selector's prediction (:func:`~mpicomm.strategies.auto_schemes.select`) is
  settled (:meth:`SchemeChoices.settle`): where it does not separate the schemes (within
  ``trial_margin`` of the cheapest) each close scheme is *tried* for ``trial_steps``
  real steps and the lowest measured cost decides (:meth:`SchemeChoices.by_measurement`);
  the running scheme stays unless another is cheaper by more than ``switch_margin``
  (hysteresis); the result is kept until something re-decides it;
* the agreed times of the steps that ran (:meth:`SchemeChoices.record`) replace the
  predictions, and a kept choice measured slower than another candidate is dropped
  (:meth:`SchemeChoices.outrun`);
* compression gains (:meth:`SchemeChoices.track_gains`): each scheme's
  ``sqrt(Σ||g_c||² / Σ||g_e||²)`` over its buckets (:attr:`SchemeChoices.scheme_gains`,
  the selector's ``min_gain`` constraint) and each (scheme, ratio)'s *efficiency*
  ``Σ||g_c||² / Σ||top-k(g_e)||²`` (1 for Allgather Top-k, which sends each rank's own
  top-k), EWMAs over the steps the scheme ran.

Cost per unit of progress (``gain_weighted``, :meth:`SchemeChoices.costs`):
``(t + share) / efficiency``, with ``t`` the bucket's measured (else predicted) exchange
time and ``share`` its part, by elements, of :attr:`SchemeChoices.step_other` (the
forward, backward and optimizer time every step pays): a scheme that keeps less of the
error-fed gradient per step needs more steps, each with the whole forward and backward.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from .auto_schemes import SCHEMES, Choice

__all__ = ["SchemeChoices", "EFFICIENCY_DECAY", "EFFICIENCY_STALE", "MEASURED_TIMES"]

#: ``(bucket name, ratio)``: what a choice is kept for.
Key = tuple[str, float]

#: EWMA decay of :attr:`SchemeChoices.efficiency`: faster than the gains' (``decay``),
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
#: Agreed times kept per (bucket, ratio, scheme), at least: a measured cost is the
#: minimum of them (one step's time on a shared host is noisy).
MEASURED_TIMES = 2


class SchemeChoices:
    """The kept choice per (bucket, ratio) and the agreed measurements it rests on.

    ``trial_steps``, ``trial_margin``, ``switch_margin``, ``gain_weighted`` as in
    :class:`~mpicomm.strategies.AutoConfig`; ``drift`` the fraction by which a kept
    choice's own times must move to count as a network change (:meth:`times_moved`);
    ``decay`` the EWMA decay of the gains and of :attr:`step_other`.
    """

    def __init__(self, *, trial_steps: int = 1, trial_margin: float = 0.5,
                 switch_margin: float = 0.1, gain_weighted: bool = True,
                 drift: float = 0.3, decay: float = 0.9):
        self.trial_steps = trial_steps
        self.trial_margin, self.switch_margin = float(trial_margin), float(switch_margin)
        self.gain_weighted = bool(gain_weighted)
        self.drift, self.decay = float(drift), float(decay)
        #: (bucket, ratio) -> the kept :class:`~.auto_schemes.Choice`.
        self.kept: dict[Key, Choice] = {}
        #: (bucket, ratio) -> the scheme last kept there (the hysteresis' incumbent).
        self.current: dict[Key, str] = {}
        #: (bucket, ratio) -> the selector's predictions when the choice was kept.
        self.predicted: dict[Key, dict[str, float]] = {}
        #: (bucket, ratio) -> scheme -> its last ``max(trial_steps, MEASURED_TIMES)``
        #: agreed times (seconds).
        self.measured: dict[Key, dict[str, deque[float]]] = {}
        #: (bucket, ratio) -> (kept scheme, its settled time): :meth:`times_moved`.
        self.baseline: dict[Key, tuple[str, float]] = {}
        #: (step, bucket, scheme) of each trial step (choice by measurement).
        self.trials: list[tuple[int, str, str]] = []
        #: (key, scheme) -> trial steps run whose times are not agreed yet.
        self.in_trial: dict[tuple[Key, str], int] = {}
        #: Each scheme's compression gain, EWMA over the steps it ran (agreed), checked
        #: against ``min_gain`` by the selector.
        self.scheme_gains: dict[str, float] = {}
        #: Each (scheme, ratio)'s efficiency: its compression gain relative to exact
        #: Top-k's on the same gradients, EWMA over the steps it ran (agreed): the
        #: divisor of its cost with ``gain_weighted``.
        self.efficiency: dict[tuple[str, float], float] = {}
        self.efficiency_step: dict[tuple[str, float], int] = {}  # last measured at
        #: EWMA of a step's wall time outside the buckets' exchanges (forward, backward,
        #: optimizer; mean over ranks): the part of a step's time that
        #: ``gain_weighted`` divides by the efficiency too.
        self.step_other: Optional[float] = None
        #: Elements per bucket (the step share of :meth:`costs`).
        self.numels: dict[str, int] = {}

    # ------------------------------------------------------------------ costs
    def costs(self, key: Key, predicted: Mapping[str, float], partial: bool = False,
              measured: bool = True) -> dict[str, float]:
        """Each candidate's cost at ``key`` = (bucket, ratio): its measured time (min of
        its kept agreed times, :data:`MEASURED_TIMES`) once measured ``trial_steps``
        times (``partial``: once measured at all), else its prediction. With
        ``gain_weighted``: seconds of the *step* per unit of Top-k progress,
        ``(t + share) / efficiency``, where ``share`` is the bucket's part (by elements)
        of :attr:`step_other` and the :attr:`efficiency` at this ratio is 1 for dense
        and for a scheme not measured yet (not ruled out unseen). The share matters: a
        scheme whose exchange takes half the time but keeps 0.6 of Top-k's mass needs
        about 1/0.6 the steps, each with the whole forward and backward."""
        share = 0.0
        if self.gain_weighted and self.step_other and key[0] in self.numels:
            share = self.step_other * self.numels[key[0]] / max(1, sum(self.numels.values()))
        cost = self.times(key, predicted, partial) if measured else dict(predicted)
        if self.gain_weighted:
            for s, t in cost.items():
                cost[s] = (t + share) / (1.0 if s == "dense" else
                                         max(self.efficiency_at(s, key[1]), 1e-3))
        return cost

    def times(self, key: Key, predicted: Mapping[str, float], partial: bool = False
              ) -> dict[str, float]:
        """Each candidate's exchange time at ``key``: measured (min of its kept agreed
        times) once measured ``trial_steps`` times (``partial``: at all), else
        predicted."""
        seen = self.measured.get(key, {})
        enough = max(1 if partial else self.trial_steps, 1)
        return {s: min(seen[s]) if len(seen.get(s, ())) >= enough else t
                for s, t in predicted.items()}

    def efficiency_at(self, scheme: str, ratio: float) -> float:
        """``scheme``'s efficiency at ``ratio``: measured there, else carried over from
        the nearest ratio (in ``log c``) it was measured at, else 1 (not ruled out
        unseen). Carried over because the CR controller prices ratios the scheme has not
        run at with it (:meth:`run_choice`): a scheme that keeps half of Top-k's mass at
        0.03 is not assumed to keep all of it at 0.025."""
        own = self.efficiency.get((scheme, ratio))
        if own is not None:
            return own
        seen = [(abs(math.log(c / ratio)), c) for s, c in self.efficiency if s == scheme]
        return self.efficiency[(scheme, min(seen)[1])] if seen else 1.0

    def run_choice(self, key: Key, predicted: Mapping[str, float], measured: bool = True
                   ) -> tuple[str, float, float]:
        """The scheme this rule settles on at ``key`` given the selector's
        ``predicted`` candidates: the lowest :meth:`costs` (ties: the order of
        :data:`~.auto_schemes.SCHEMES`), what the trials and :meth:`outrun` converge to
        where the measured times are the predicted ones; returns ``(scheme, its
        exchange time, its cost)``. ``measured=False`` prices with the predictions
        alone (the refined model), as the CR controller's time objective does at every
        ratio alike: the ratio is traded against the time of the scheme that then runs,
        not of another, and the ratio in force (the one with measured times) is not
        priced differently from its neighbours for having run."""
        cost = self.costs(key, predicted, measured=measured)
        best = min(cost, key=lambda s: (cost[s], SCHEMES.index(s)))
        return best, (self.times(key, {best: predicted[best]})[best] if measured
                      else predicted[best]), cost[best]

    def by_measurement(self, key: Key, choice: Choice) -> tuple[Choice, bool]:
        """The choice among ``choice.candidates`` by measured cost where the model does
        not separate them: ``(choice, True)`` for a trial step of a scheme not measured
        enough yet, else the cheapest by measured cost (prediction where unmeasured;
        :meth:`costs`). A scheme partly tried counts with the steps it ran, so one step
        that puts it outside the margin ends its trial (PowerSGD at ratio 0.011 on the
        adaptive bench: 74 ms at efficiency 0.3). Trial steps whose times are still
        being agreed count as run, and the schemes take turns: one with a step under way
        waits while the others run (when all wait, the cheapest fully tried scheme
        runs, uncached), so no scheme runs a step more than ``trial_steps`` because of
        the agreement's lag."""
        seen = self.measured.get(key, {})
        cost = self.costs(key, choice.candidates, partial=True)
        best = min(cost.values())
        close = sorted((s for s in cost if cost[s] <= (1 + self.trial_margin) * best),
                       key=lambda s: (cost[s], SCHEMES.index(s)))
        untried = [s for s in close if len(seen.get(s, ())) +
                   self.in_trial.get((key, s), 0) < self.trial_steps]
        waiting = [s for s in untried if not self.in_trial.get((key, s))]
        done = [s for s in close if s not in untried]
        # round robin: a scheme whose last trial step is still being agreed waits; the
        # others (or, when all wait, the cheapest fully tried one) run meanwhile
        pick = waiting[0] if waiting else (done or untried or close)[0]
        return Choice(pick, 1.0 if pick == "dense" else key[1], cost[pick], cost), \
            bool(untried) and len(close) > 1

    # ------------------------------------------------------------------ deciding
    def settle(self, key: Key, choice: Choice, *, step: int, exploring: bool,
               by_measurement: bool, ratio_of: Callable[[str], float]
               ) -> tuple[Choice, bool]:
        """The selector's ``choice`` for ``key`` made final: by measurement (with
        ``by_measurement`` and ``trial_steps``, outside explorations), then the
        hysteresis (``ratio_of(scheme)`` the ratio a kept incumbent runs at); a trial
        step is counted (returned ``True`` while its time is not agreed) and not kept,
        an exploration's choice is not kept, any other is kept."""
        trial, predicted, counted = False, choice.candidates, False
        if by_measurement and self.trial_steps and not exploring:
            choice, trial = self.by_measurement(key, choice)
        current = self.current.get(key)
        if not trial and current is not None and current in choice.candidates and \
                current != choice.scheme and choice.candidates[current] <= \
                (1 + self.switch_margin) * choice.predicted:
            # hysteresis: keep the running scheme unless the new one is clearly cheaper
            choice = Choice(current, ratio_of(current), choice.candidates[current],
                            choice.candidates)
        if trial:  # not cached: the next steps decide again, with it counted
            under_way = self.in_trial.get((key, choice.scheme), 0)
            if len(self.measured.get(key, {}).get(choice.scheme, ())) + under_way < \
                    self.trial_steps:  # (else the cheapest tried, while others wait)
                self.trials.append((step, key[0], choice.scheme))
                self.in_trial[(key, choice.scheme)] = under_way + 1
                counted = True
        elif not exploring:  # a window's choice (sparse schemes only) is not kept
            self.kept[key] = choice
            self.current[key] = choice.scheme
            if by_measurement:  # the candidates outrun() re-checks it against
                self.predicted[key] = dict(predicted)
        return choice, counted

    def record(self, key: Key, scheme: str, seconds: float, trial: bool) -> None:
        """One bucket's agreed time: a trial step no longer under way, the scheme's
        measured times, and a kept choice's settled time (its first ``trial_steps``)."""
        if trial:
            left = self.in_trial.get((key, scheme), 0) - 1
            if left > 0:
                self.in_trial[(key, scheme)] = left
            else:
                self.in_trial.pop((key, scheme), None)
        if self.trial_steps:
            times = self.measured.setdefault(key, {}).setdefault(
                scheme, deque(maxlen=max(self.trial_steps, MEASURED_TIMES)))
            times.append(seconds)
            choice = self.kept.get(key)
            if choice is not None and choice.scheme == scheme and \
                    len(times) == self.trial_steps and key not in self.baseline:
                self.baseline[key] = (scheme, min(times))

    def below(self, min_gain: float) -> set[Key]:
        """Kept choices whose scheme's measured gain is below ``min_gain``."""
        return {k for k, c in self.kept.items()
                if self.scheme_gains.get(c.scheme, 1.0) < min_gain}

    def outrun(self) -> set[Key]:
        """Kept choices whose own measured cost (:meth:`costs`, ``trial_steps`` agreed
        times) exceeds another candidate's by more than ``switch_margin`` where that
        one's cost is measured too, by more than ``trial_margin`` where it is only
        predicted: to be re-decided (a prediction that was wrong, e.g. a dense step
        predicted cheap from a beta the sparse steps' times could not pin down, runs
        ``trial_steps`` steps, not until the next drift; a scheme whose efficiency fell
        as training went on gives way to one measured cheaper per unit of progress)."""
        out = set()
        for key, choice in self.kept.items():
            predicted = self.predicted.get(key)
            seen = self.measured.get(key, {})
            if predicted is None or len(seen.get(choice.scheme, ())) < self.trial_steps or \
                    len(predicted) < 2:
                continue
            cost = self.costs(key, predicted)
            mine = cost.get(choice.scheme, 0.0)
            for s, v in cost.items():
                margin = self.switch_margin if len(seen.get(s, ())) >= self.trial_steps \
                    else self.trial_margin
                if s != choice.scheme and mine > (1 + margin) * v:
                    out.add(key)
        return out

    def drop(self, keys: set[Key]) -> None:
        """Re-decide these keys at their next step."""
        for key in keys:
            del self.kept[key]
            self.baseline.pop(key, None)

    def forget(self) -> None:
        """Re-decide every bucket at its next step (measurements kept)."""
        self.kept.clear()
        self.baseline.clear()

    def keep_ratio(self, ratio: float) -> None:
        """Keep only the choices made at ``ratio`` (the ratio moved)."""
        self.kept = {k: v for k, v in self.kept.items() if k[1] == ratio}
        self.baseline = {k: v for k, v in self.baseline.items() if k in self.kept}

    def times_moved(self) -> bool:
        """Whether a kept choice's own recent times (min of its last ``trial_steps``)
        moved by more than the drift fraction from those it settled at: a network change,
        after which every measured time is stale. A drift of the fitted alpha/beta alone
        (the fit settling away from the short start-up ping-pongs, in the first tens of
        steps) leaves them in place, so it re-decides without repeating the trials.
        ``False`` when no kept choice has settled times to compare: the trials under way
        are recent (on the adaptive bench the fit's drift came at step 5, during the
        first trials, in two of three runs; forgetting them re-ran every trial, and
        those runs took 3.4-3.7 s to the target against 2.5 s for the third)."""
        for key, (scheme, base) in self.baseline.items():
            choice, recent = self.kept.get(key), self.measured.get(key, {}).get(scheme)
            if choice is None or choice.scheme != scheme or not recent:
                continue
            if abs(min(recent) - base) > self.drift * base:
                return True
        return False

    # ------------------------------------------------------------------ gains
    def track_gains(self, pending: Sequence[Mapping[str, Any]], kept: Sequence[float],
                    total: Sequence[float], ref: Sequence[float]) -> None:
        """EWMAs (weight ``1 - decay``) over the steps a scheme ran, from the step's
        squared norms summed over ranks (agreed): each scheme's compression gain
        ``sqrt(Σ||g_c||² / Σ||g_e||²)`` over its buckets (:attr:`scheme_gains`, the
        selector's ``min_gain`` constraint) and each (scheme, ratio)'s *efficiency*
        ``Σ||g_c||² / Σ||top-k(g_e)||²``, capped at 1 (:attr:`efficiency`, the divisor of
        its cost with ``gain_weighted``; squared, as the paper's gain; decay
        :data:`EFFICIENCY_DECAY`; a value last measured more than
        :data:`EFFICIENCY_STALE` steps before is replaced, not averaged). ``pending``:
        the buckets' records (``step``, ``scheme``, ``key_ratio``)."""
        for gains, key_of, den, power, decay in (
                (self.scheme_gains, lambda r: r["scheme"], total, 0.5, self.decay),
                (self.efficiency, lambda r: (r["scheme"], r["key_ratio"]), ref, 1.0,
                 EFFICIENCY_DECAY)):
            sums: dict[Any, list[float]] = {}
            for r, c, e in zip(pending, kept, den):
                if r.get("ramp"):  # ran above its key's ratio: not the key's gain
                    continue
                acc = sums.setdefault(key_of(r), [0.0, 0.0])
                acc[0], acc[1] = acc[0] + float(c), acc[1] + float(e)
            step = pending[0]["step"] if pending else 0
            for k, (c, e) in sums.items():
                if e > 0:
                    g = min(1.0, c / e) ** power
                    old = gains.get(k)
                    if gains is self.efficiency:  # an old value is no prior: replaced
                        if step - self.efficiency_step.get(k, step) > EFFICIENCY_STALE:
                            old = None
                        self.efficiency_step[k] = step
                    gains[k] = g if old is None else decay * old + (1 - decay) * g

    def observe_other(self, other: float) -> None:
        """One step's agreed time outside the buckets' exchanges (:attr:`step_other`)."""
        self.step_other = other if self.step_other is None else \
            self.decay * self.step_other + (1 - self.decay) * other

    def bucket_seen(self, bucket: str, shapes: Sequence[tuple[int, ...]]) -> None:
        """Note a bucket's size (elements) for the step share of :meth:`costs`."""
        self.numels[bucket] = sum(math.prod(s) for s in shapes)
