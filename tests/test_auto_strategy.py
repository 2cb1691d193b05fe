"""``strategy="auto"``: choosing schemes by measurement where predictions are close,
weighing them by efficiency and the whole step, redeciding slow or drifted choices, its
configuration, and, on several ranks in ``GradientSync``, exploration and restore, probes,
the minimum gain, trials of close schemes, and decisions identical on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpicomm import strategies
from mpicomm.collectives.cost import CostParams
from mpicomm.comm import CALIBRATION_KEYS
from mpicomm.control import OnlineCalibration
from mpicomm.strategies.auto_schemes import select

from .auto_runs import GBPS, ZERO, train_auto


# ---------------------------------------------------------------------- auto (one rank)
def test_auto_chooses_by_measurement_where_predictions_are_close():
    """Candidates within ``trial_margin`` of the cheapest are tried ``trial_steps`` times
    each (cheapest prediction first), then the lowest measured time wins; a prediction
    that separates the schemes clearly is taken without trials."""
    from collections import deque

    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.auto_schemes import Choice

    auto = AutoStrategy(calibrate_links=0, ratio=0.01, trial_margin=0.5, trial_steps=2)
    key = ("b0", 0.01)
    cands = {"dense": 1.0, "gtopk": 0.10, "artopk_tree": 0.12, "allgather_topk": 0.14}
    pred = Choice("gtopk", 0.01, 0.10, cands)
    choice, trial = auto.choices.by_measurement(key, pred)
    assert (choice.scheme, choice.ratio, trial) == ("gtopk", 0.01, True)
    auto.measured[key] = {"gtopk": deque([0.30, 0.25], maxlen=2)}   # measured 2.5x slower
    choice, trial = auto.choices.by_measurement(key, pred)
    assert (choice.scheme, trial) == ("artopk_tree", True)          # next-cheapest untried
    auto.measured[key]["artopk_tree"] = deque([0.09, 0.08], maxlen=2)
    auto.measured[key]["allgather_topk"] = deque([0.2, 0.11], maxlen=2)
    choice, trial = auto.choices.by_measurement(key, pred)
    assert (choice.scheme, trial, choice.predicted) == ("artopk_tree", False, 0.08)
    # dense is 8x the cheapest: never tried; one clear winner: no trial at all
    assert "dense" not in auto.measured[key]
    clear = Choice("gtopk", 0.01, 0.1, {"dense": 1.0, "gtopk": 0.1})
    assert auto.choices.by_measurement(("b1", 0.01), clear)[1] is False
    with pytest.raises(ValueError, match="trial_steps"):
        AutoStrategy(trial_steps=-1)
    with pytest.raises(ValueError, match="drift_patience"):
        AutoStrategy(drift_patience=0)
    with pytest.raises(ValueError, match="trial_margin"):
        AutoStrategy(trial_margin=-0.1)


def test_auto_weighs_schemes_by_their_efficiency_and_the_whole_step():
    """``gain_weighted`` (off by default): cost = (time + the bucket's share of the
    step's other time) / efficiency of that (scheme, ratio); a faster exchange that keeps
    less of Top-k's mass loses to a slower one that keeps more; dense and a scheme whose
    efficiency is unknown divide by 1."""
    from collections import deque

    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.auto_schemes import Choice

    assert not AutoStrategy(calibrate_links=0).choices.gain_weighted   # time alone
    auto = AutoStrategy(calibrate_links=0, ratio=0.01, trial_margin=0.5, trial_steps=2,
                        gain_weighted=True)
    assert auto.choices.gain_weighted
    key = ("b0", 0.01)
    pred = Choice("artopk_tree", 0.01, 0.05,
                  {"dense": 1.0, "gtopk": 0.06, "artopk_tree": 0.05})
    auto.measured[key] = {"gtopk": deque([0.063, 0.066], maxlen=2),
                          "artopk_tree": deque([0.047, 0.050], maxlen=2)}
    auto.choices.gain_weighted = False
    assert auto.choices.by_measurement(key, pred)[0].scheme == "artopk_tree"   # time alone
    auto.choices.gain_weighted = True
    auto.choices.efficiency = {("gtopk", 0.01): 0.9, ("artopk_tree", 0.01): 0.5,
                       ("gtopk", 0.1): 0.2}
    choice, trial = auto.choices.by_measurement(key, pred)
    assert (choice.scheme, trial) == ("gtopk", False)
    assert choice.predicted == pytest.approx(0.063 / 0.9)
    assert choice.candidates["artopk_tree"] == pytest.approx(0.047 / 0.5)
    assert choice.candidates["dense"] == 1.0
    assert auto.choices.costs(key, {"allgather_topk": 0.07})["allgather_topk"] == \
        pytest.approx(0.07)                                   # unknown efficiency: 1
    # the step's time outside the exchanges, the bucket's share by elements, counts too
    auto.choices.numels = {"b0": 30, "b1": 10}
    auto.choices.step_other = 0.04
    cost = auto.choices.costs(key, {"gtopk": 0.06, "artopk_tree": 0.05, "dense": 1.0})
    assert cost["gtopk"] == pytest.approx((0.063 + 0.03) / 0.9)
    assert cost["artopk_tree"] == pytest.approx((0.047 + 0.03) / 0.5)
    assert cost["dense"] == pytest.approx(1.03)


def test_auto_efficiency_is_an_ewma_until_it_is_stale():
    """A (scheme, ratio)'s efficiency is an EWMA (decay ``EFFICIENCY_DECAY``) over the
    steps it ran; measured again more than ``EFFICIENCY_STALE`` steps after its last
    measurement, the new value replaces it (it falls as training goes on)."""
    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.auto_choice import EFFICIENCY_DECAY, EFFICIENCY_STALE

    auto = AutoStrategy(calibrate_links=0, ratio=0.01)

    def measure(step, efficiency):
        record = {"step": step, "scheme": "artopk_tree", "key_ratio": 0.01}
        auto.choices.track_gains([record], [efficiency], [1.0], [1.0])
        return auto.efficiency[("artopk_tree", 0.01)]

    assert measure(0, 0.8) == pytest.approx(0.8)
    assert measure(3, 0.6) == pytest.approx(EFFICIENCY_DECAY * 0.8 +
                                            (1 - EFFICIENCY_DECAY) * 0.6)
    assert measure(4 + EFFICIENCY_STALE, 0.5) == pytest.approx(0.5)


def test_auto_topk_reference_is_the_exact_topk_mass_of_the_error_fed_bucket():
    """What exact Top-k would keep of ``g + residual`` (the efficiency's and the CR
    controller's reference), in float32 and float64; ``None`` where the step keeps it
    itself (Allgather Top-k) or without a Top-k ratio."""
    from types import SimpleNamespace

    from mpicomm.strategies import AutoStrategy

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        auto = AutoStrategy(calibrate_links=0, ratio=0.05)
        g = torch.randn(1000, generator=gen, dtype=dtype)
        buf = SimpleNamespace(flat=g, name="b0")
        args = (buf, ["w"], [g], None)
        assert auto._topk_reference("allgather_topk", 0.05, *args) is None
        assert auto._topk_reference("gtopk", 1.0, *args) is None
        top = float((g.abs().topk(50).values ** 2).sum())
        assert auto._topk_reference("gtopk", 0.05, *args) == pytest.approx(top, rel=1e-6)
        held = torch.randn(1000, generator=gen, dtype=dtype)
        auto.memory.update("b0", held, torch.zeros_like(held))    # residual = held
        fed = g + held
        top = float((fed.abs().topk(50).values ** 2).sum())
        for scheme in ("artopk_tree", "dense"):
            assert auto._topk_reference(scheme, 0.05, *args) == pytest.approx(top,
                                                                              rel=1e-6)


def test_auto_redecides_a_kept_choice_that_measures_slower_than_another():
    """A kept choice whose own measured cost (``trial_steps`` agreed times) exceeds
    another candidate's by more than ``trial_margin`` is dropped (re-decided at the next
    step): a dense step predicted cheap runs ``trial_steps`` steps, not until a drift."""
    from collections import deque

    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.auto_schemes import Choice

    auto = AutoStrategy(calibrate_links=0, ratio=0.1, trial_margin=0.5, trial_steps=2)
    key = ("b0", 0.1)
    predicted = {"dense": 0.4, "allgather_topk": 0.5, "artopk_tree": 0.45}
    auto.choices.predicted[key] = predicted
    auto.choices.kept[key] = Choice("dense", 1.0, 0.4, predicted)
    auto.measured[key] = {"dense": deque([1.2], maxlen=2)}
    assert auto.choices.outrun() == set()                  # measured once: not yet
    auto.measured[key]["dense"].append(1.25)
    assert auto.choices.outrun() == {key}                  # 1.2 s against 0.45 predicted
    auto.choices.kept[key] = Choice("artopk_tree", 0.1, 0.45, predicted)
    auto.measured[key]["artopk_tree"] = deque([0.5, 0.55], maxlen=2)
    assert auto.choices.outrun() == set()                  # within trial_margin of predictions
    # a measured alternative: switch_margin (0.1) applies, 0.5 > 1.1 * 0.44
    auto.measured[key]["allgather_topk"] = deque([0.44, 0.46], maxlen=2)
    assert auto.choices.outrun() == {key}
    auto.measured[key]["allgather_topk"] = deque([0.47, 0.48], maxlen=2)
    assert auto.choices.outrun() == set()                  # 0.5 < 1.1 * 0.47


def test_make_auto_and_its_prediction():
    s = strategies.make("auto", ratio=0.01, calibrate_links=0)
    assert s.name == "auto"
    slow = CostParams(alpha=1e-4, beta=1 / GBPS, gamma=0.0)
    best = select([(1000, 1000)], 0.01, 4, 8, slow, ZERO).predicted
    assert s.predict([(1000, 1000)], 4, 8, slow, ZERO) == pytest.approx(best)
    with pytest.raises(ValueError, match="schemes"):
        strategies.make("auto", schemes=("bogus",))
    with pytest.raises(ValueError, match="ratio"):
        strategies.make("auto", ratio=2.0)


def test_auto_config_is_validated_once_and_names_unknown_options():
    """``AutoConfig``: keywords or one config object (keywords override it), sequences
    kept as tuples, frozen; an unknown keyword is one ``TypeError`` naming it and the
    closest option; bad values are ``ValueError`` at construction; README's keywords
    build."""
    import dataclasses

    from mpicomm.strategies import AutoConfig, AutoStrategy

    with pytest.raises(TypeError, match="'trail_steps' .did you mean 'trial_steps'"):
        strategies.make("auto", trail_steps=2)
    with pytest.raises(TypeError, match="AutoConfig"):
        AutoStrategy(config={"ratio": 0.1})
    cfg = AutoConfig(ratio=0.05, trial_steps=2, schemes=["dense", "gtopk"])
    assert cfg.schemes == ("dense", "gtopk") and cfg.ratios == (0.1, 0.033, 0.011, 0.004,
                                                                 0.001)
    assert AutoStrategy(config=cfg).config is cfg
    auto = AutoStrategy(config=cfg, calibrate_links=0)
    assert (auto.config.trial_steps, auto.config.calibrate_links, auto.ratio,
            auto.schemes) == (2, 0, 0.05, ("dense", "gtopk"))
    assert cfg.calibrate_links == 2                     # the given config is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ratio = 0.1  # type: ignore[misc]
    for bad, match in [({"decay": 1.0}, "decay"), ({"drift": 0.0}, "drift"),
                       ({"window": 0}, "window"), ({"calibrate_links": 1.5}, "calibrate"),
                       ({"lgreco": True, "lgreco_every": 3}, "lgreco_acc_steps"),
                       ({"ratios": ()}, "ratios"), ({"weights": (1.0,)}, "weights"),
                       ({"lgreco_family": "sign"}, "lgreco_family"),
                       ({"trigger": 0.0}, "trigger"), ({"total_steps": 0}, "total_steps")]:
        with pytest.raises(ValueError, match=match):
            AutoConfig(**bad)
    # the keywords the README shows
    per_layer = AutoStrategy(lgreco=True, lgreco_family="powersgd", lgreco_default=4)
    assert per_layer.family == "powersgd" and per_layer.controller is None
    assert per_layer.schemes == ("dense", "lgreco_powersgd") and per_layer.ratio == 1.0
    tuned = strategies.make("auto", min_gain=0.5, probe_triggered=False, trial_steps=2,
                            lgreco=True, lgreco_every=10, lgreco_family="qsgd")
    assert tuned.lgreco is not None and tuned.lgreco.default == 4 and \
        tuned.lgreco.every == 10 and tuned.min_gain == 0.5


# ---------------------------------------------------------------------- multi-rank
@pytest.mark.mpi
def test_auto_in_gradsync_decides_identically_and_restores_after_exploring(comm):
    auto, weights, seen = train_auto(comm, 9, calibrate_links=1, window=1,
                                      ratios=(0.5, 0.1, 0.02), probe_first=False)
    try:
        mine = (auto.decisions, [(h.step, h.reason, h.ratio) for h in auto.controller.history],
                [(r.bucket, r.scheme, r.ratio, r.measured) for r in auto.records], seen)
        assert comm.allgather_object(mine) == [mine] * comm.size
        # one record per bucket per step (the last step is agreed at the next one)
        assert len(auto.records) == 8 * len({r.bucket for r in auto.records})
        assert all(r.measured > 0 for r in auto.records)
        # exploration ran the three ratios once and then solved
        assert [h.reason for h in auto.controller.history][:1] == ["solve"]
        assert set(auto.controller.gains) == {0.5, 0.1, 0.02}
        assert all(0 < g <= 1 for g in auto.controller.gains.values())
        # replicas agree after exploring and restoring
        gathered = comm.allgather_object(weights.numpy())
        for w in gathered:
            np.testing.assert_allclose(w, gathered[0], rtol=1e-5, atol=1e-6)
    finally:
        auto.callbacks.clear()


@pytest.mark.mpi
def test_auto_probes_every_ratio_on_the_first_step_without_a_window(comm):
    """``probe_first`` (default): step 0 runs at the middle ratio with a sparse scheme
    and measures Top-k's gain at every candidate on its own gradients; the controller
    solves on them at step 1 (reason "probe"): no exploration window, nothing saved or
    restored, and the same on every rank. Top-k's gain grows with the ratio."""
    auto, weights, seen = train_auto(comm, 6, window=1, ratios=(0.5, 0.1, 0.02))
    history = [(h.step, h.reason, h.ratio) for h in auto.controller.history]
    assert history[0][:2] == (1, "probe")
    assert seen[0] == 0.1          # step 0 ran at the middle ratio; step 1 decides
    gains = [g for _, g in sorted(auto.controller.gains.items())]
    assert sorted(auto.controller.gains) == sorted(auto.controller.grid)
    assert gains[0] > 0 and all(a <= b for a, b in zip(gains, gains[1:])) \
        and gains[-1] <= 1, gains
    assert auto.snapshot.saved is None
    assert auto.overheads["windows"] == 0 and auto.overheads["exploration_s"] == 0.0
    step0 = [(s, c) for t, _, s, c in auto.decisions if t == 0]
    assert step0 and all(c == 0.1 and s not in ("dense", "powersgd") for s, c in step0)
    mine = (history, sorted(auto.controller.gains.items()), auto.decisions, seen)
    assert comm.allgather_object(mine) == [mine] * comm.size
    gathered = comm.allgather_object(weights.numpy())
    for w in gathered:
        np.testing.assert_allclose(w, gathered[0], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_auto_exploration_restores_the_saved_model(comm):
    """window=2, two ratios, step t's measurements agreed during step t+1 and deciding
    step t+2: exploration starts with step 0 and the state is saved after it; each ratio
    runs its 2 observed steps and the one in flight (steps 0-2 at 0.5, 3-5 at 0.2), the
    restore comes after step 5, back to the state saved after step 0; step 6 trains on
    (the default, the paper's loop; ``restore_first=False`` keeps the first window's
    steps, the second run)."""
    from mpicomm.strategies import AutoStrategy
    from mpicomm.torch import GradientSync

    def run(restore_first):
        torch.manual_seed(1)
        model = torch.nn.Linear(6, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        auto = AutoStrategy(calibrate_links=0, window=2, ratios=(0.5, 0.2),
                            restore_first=restore_first, probe_first=False)
        states = []
        with GradientSync(model, strategy=auto, comm=comm) as sync:
            for step in range(7):
                opt.zero_grad()
                model(torch.full((4, 6), float(step + comm.rank))).sum().backward()
                sync.step(opt)
                states.append(copy_state(model))
        return states, auto

    states, auto = run(True)
    assert states[5] == states[0]
    assert states[1] != states[0] and states[6] != states[5]
    assert [d[0] for d in auto.decisions if d[3] == 0.2][:3] == [3, 4, 5]
    # 4 observed, 1 ignored (then re-solved once the rest of the step is measured)
    assert [h.step for h in auto.controller.history if h.reason != "compute"] == [5]
    # the thrown-away window's steps are counted as exploration, nothing as calibration
    assert auto.overheads["windows"] == 1 and auto.overheads["exploration_s"] > 0
    assert auto.overheads["calibration_s"] == 0.0 and auto.overheads["probes"] == 0
    kept, auto = run(False)   # the first window keeps its steps: no save, no restore
    assert all(kept[i] != kept[i - 1] for i in range(1, 7))
    assert auto.snapshot.saved is None
    # and goes up the ratios: its largest ratio last, sending what the small one left
    assert [d[3] for d in auto.decisions if d[0] < 6] == [0.2] * 3 + [0.5] * 3
    assert all(d[2] not in ("dense", "powersgd") for d in auto.decisions if d[0] < 4)
    reasons = [h.reason for h in auto.controller.history]  # + re-solves on timing drift
    assert reasons[0] == "solve" and set(reasons[1:]) <= {"network", "compute"}


def copy_state(model):
    return [tuple(p.detach().reshape(-1).tolist()) for p in model.parameters()]


@pytest.mark.mpi
def test_auto_decisions_identical_on_every_rank_at_every_step_with_their_lag(comm):
    """The ratio, each bucket's scheme and the saved exploration state, after every step,
    are the same on every rank; step t's measurements are agreed during step t+1 and
    decide at its ``step_done`` (the records of step t appear after step t+1), on every
    rank alike."""
    trail = []

    def after_step(auto):
        t = auto.steps - 1
        agreed = max((r.step for r in auto.records), default=-1)
        assert agreed == t - 1, (t, agreed)
        trail.append((auto.steps, auto.ratio, sorted(auto.choices.current.items()),
                      auto.snapshot.saved is not None, len(auto.controller.history)))

    train_auto(comm, 10, after_step=after_step, window=1, ratios=(0.5, 0.1, 0.02),
                cooldown=2, probe_first=False)
    assert comm.allgather_object(trail) == [trail] * comm.size
    assert len({ratio for _, ratio, _, _, _ in trail}) >= 3, "the controller explored"
    assert any(saved for *_, saved, _ in trail), "an exploration window was saved"


@pytest.mark.mpi
def test_auto_triggered_explorations_are_probes_identical_on_every_rank(comm):
    """With the defaults (``probe_first``, ``probe_triggered``) and a short cooldown,
    the explorations the gain's changes trigger are probes: the controller solves with
    reason "probe" more than once, nothing is ever saved (no window, no restore), and
    every rank takes the same decisions at every step."""
    trail = []

    def after_step(auto):
        assert auto.snapshot.saved is None and auto._action is None
        trail.append((auto.steps, auto.ratio, auto.controller.probing,
                      sorted(auto.choices.current.items())))

    auto, _, _ = train_auto(comm, 16, lr=0.5, after_step=after_step,
                             ratios=(0.5, 0.1, 0.02), cooldown=1, trigger=0.001)
    reasons = [h.reason for h in auto.controller.history]
    assert reasons.count("probe") >= 2 and "solve" not in reasons, reasons
    assert comm.allgather_object(trail) == [trail] * comm.size
    mine = [(h.step, h.ratio, h.points) for h in auto.controller.history]
    assert comm.allgather_object(mine) == [mine] * comm.size


@pytest.mark.mpi
def test_auto_min_gain_excludes_a_scheme_whose_measured_gain_is_too_low(comm):
    if comm.size == 1:
        pytest.skip("one rank: dense moves no bytes, no compressed scheme is ever chosen")
    saved = {k: comm.resources.pop(k) for k in CALIBRATION_KEYS if k in comm.resources}
    comm.resources["cost_params"] = CostParams(alpha=1e-6, beta=1e-6, gamma=0.0)  # 1 MB/s
    try:
        auto, _, _ = train_auto(comm, 4, ratio=0.01, schemes=("dense", "allgather_topk"),
                                 min_gain=0.999)
    finally:
        for k in CALIBRATION_KEYS:
            comm.resources.pop(k, None)
        comm.resources.update(saved)
    first = {bucket: scheme for step, bucket, scheme, _ in auto.decisions if step == 0}
    assert set(first.values()) == {"allgather_topk"}   # cheapest on the slow link
    assert auto.scheme_gains["allgather_topk"] < 0.999
    last = {bucket: scheme for _, bucket, scheme, _ in auto.decisions}
    assert set(last.values()) == {"dense"}             # its measured gain ruled it out
    mine = (auto.decisions, sorted(auto.scheme_gains.items()))
    assert comm.allgather_object(mine) == [mine] * comm.size


def _feed(auto, pending, sums):
    """One finished step through the strategy: its bucket measurements ``pending`` and
    step sums (kept, error-fed and Top-k mass, wall time) agreed as during the next
    step's aggregation, then decided as at that step's ``step_done``."""
    auto.agreement.finish([{"trial": False, **r} for r in pending], sums)
    auto.agreement.post(auto.comm)
    if auto.agreement.posted:
        auto.agreement.complete(auto.comm)
    return [auto._decide(p, a) for p, a in auto.agreement.take()]


@pytest.mark.mpi
def test_auto_redecides_on_persistent_drift_not_on_one_outlier(comm):
    """Agreed step times fed to the strategy: a single step 5x slower keeps the choices;
    the same slowdown for ``drift_patience`` steps in a row re-decides, on every rank at
    the same step."""
    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.auto_schemes import Choice

    auto = AutoStrategy(comm=comm, calibrate_links=0, ratio=0.01, drift_patience=3)
    base = CostParams(alpha=1e-4, beta=1e-8, gamma=0.0)
    auto.online = OnlineCalibration(base, decay=0.7, drift=0.3, patience=3)
    kept = Choice("gtopk", 0.01, 0.01, {"gtopk": 0.01})
    a, b = 4.0, 1e5

    def step(t, slow):
        auto.choices.kept[("b0", 0.01)] = kept
        pending = [{"step": t, "bucket": "b0", "scheme": "gtopk", "key_ratio": 0.01,
                    "ratio": 0.01, "seconds": slow * (a * base.alpha + b * base.beta),
                    "a": a, "b": b, "work": 0.0, "kept_sq": 0.5, "e_sq": 1.0,
                    "ref_sq": 0.5, "predicted": a * base.alpha + b * base.beta}]
        _feed(auto, pending, [0.5, 1.0, 0.5, 0.0])
        return ("b0", 0.01) in auto.choices.kept

    trail = [step(t, 1.0) for t in range(3)] + [step(3, 5.0)] + \
        [step(t, 1.0) for t in range(4, 8)]
    assert trail == [True] * 8, trail              # one outlier: no re-decision
    persistent = [step(t, 5.0) for t in range(8, 14)]
    assert False in persistent and persistent.index(False) >= 2, persistent
    assert comm.allgather_object(trail + persistent) == [trail + persistent] * comm.size


@pytest.mark.mpi
@pytest.mark.parametrize("moved", [False, True])
def test_auto_keeps_measured_times_after_a_drift_of_the_fit_alone(comm, moved):
    """A drift forgets the measured times only when the kept choice's own times moved
    from those it settled at (a network change); a drift of the fitted alpha/beta away
    from a calibration that was off from the start, with the times steady, re-decides
    but keeps them (no repeated trials). Identical on every rank."""
    from collections import deque

    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.auto_schemes import Choice

    auto = AutoStrategy(comm=comm, calibrate_links=0, ratio=0.01, drift_patience=2)
    base = CostParams(alpha=1e-4, beta=1e-8, gamma=0.0)
    auto.online = OnlineCalibration(base, decay=0.5, drift=0.3, patience=2)
    key, a, b = ("b0", 0.01), 4.0, 1e6
    model = a * base.alpha + b * base.beta
    kept = Choice("gtopk", 0.01, model, {"gtopk": model, "artopk_tree": 2 * model})
    auto.measured[key] = {"artopk_tree": deque([3 * model] * 2, maxlen=2)}
    slow, cleared = [], []
    for t in range(12):
        slow.append(4.0 if not moved or t >= 4 else 1.0)
        if key not in auto.choices.kept:
            auto.choices.kept[key] = kept
        pending = [{"step": t, "bucket": "b0", "scheme": "gtopk", "key_ratio": 0.01,
                    "ratio": 0.01, "seconds": slow[-1] * model, "a": a, "b": b,
                    "work": 0.0, "kept_sq": 0.5, "e_sq": 1.0, "ref_sq": 0.6,
                    "predicted": model}]
        _feed(auto, pending, [0.5, 1.0, 0.6, 0.0])
        cleared.append("artopk_tree" not in auto.measured.get(key, {}))
    assert auto.efficiency[("gtopk", 0.01)] == pytest.approx(0.5 / 0.6)
    assert cleared[-1] is moved, cleared
    assert comm.allgather_object(cleared) == [cleared] * comm.size


@pytest.mark.mpi
def test_auto_drops_a_choice_measured_slow_at_the_same_step_on_every_rank(comm):
    """Agreed step times fed to the strategy: a kept dense choice predicted at 0.4 s that
    measures 1.2 s is dropped after ``trial_steps`` agreed steps (no drift involved), and
    the next decision by measurement is not dense; identical on every rank."""
    from mpicomm.strategies import AutoStrategy
    from mpicomm.strategies.auto_schemes import Choice

    auto = AutoStrategy(comm=comm, calibrate_links=0, ratio=0.1, trial_steps=2)
    base = CostParams(alpha=1e-4, beta=1e-8, gamma=0.0)
    auto.online = OnlineCalibration(base, drift=100.0)   # no drift: only the measurement
    key = ("b0", 0.1)
    predicted = {"dense": 0.4, "allgather_topk": 0.5, "artopk_tree": 0.45}
    auto.choices.predicted[key] = predicted
    auto.choices.kept[key] = auto.choices.current[key] = Choice("dense", 1.0, 0.4, predicted)
    kept = []
    for t in range(3):
        pending = [{"step": t, "bucket": "b0", "scheme": "dense", "key_ratio": 0.1,
                    "ratio": 1.0, "seconds": 1.2, "a": 4.0, "b": 4e7, "work": 0.0,
                    "kept_sq": 1.0, "e_sq": 1.0, "ref_sq": 0.5, "predicted": 0.4}]
        _feed(auto, pending, [1.0, 1.0, 0.5, 0.0])
        kept.append(key in auto.choices.kept)
        if not kept[-1]:
            break
    assert kept == [True, False], kept
    choice, _ = auto.choices.by_measurement(key, Choice("dense", 1.0, 0.4, predicted))
    assert choice.scheme != "dense"
    assert comm.allgather_object((kept, choice.scheme)) == [(kept, choice.scheme)] * comm.size


@pytest.mark.mpi
@pytest.mark.parametrize("trial_steps", [1, 2])
def test_auto_trials_close_schemes_identically_and_keeps_the_fastest_measured(
        comm, trial_steps):
    """On a slow modelled link the compressed schemes are predicted close: each is tried
    for ``trial_steps`` real steps, every rank tries the same schemes at the same steps,
    and the cached choice is the tried scheme with the lowest agreed measured time."""
    if comm.size == 1:
        pytest.skip("one rank: no bytes move, the schemes' predictions do not compete")
    saved = {k: comm.resources.pop(k) for k in CALIBRATION_KEYS if k in comm.resources}
    comm.resources["cost_params"] = CostParams(alpha=1e-6, beta=1e-6, gamma=0.0)  # 1 MB/s
    try:
        auto, _, _ = train_auto(comm, 12, ratio=0.1, trial_margin=10.0,
                                 trial_steps=trial_steps,
                                 drift=100.0,  # no drift: the measurements are all kept
                                 schemes=("dense", "allgather_topk", "artopk_tree",
                                          "gtopk"))
    finally:
        for k in CALIBRATION_KEYS:
            comm.resources.pop(k, None)
        comm.resources.update(saved)
    assert auto.trials, "close predictions were tried"
    # each scheme is tried at most trial_steps times, although its time decides only
    # two steps later: the trial steps under way count, and the schemes take turns
    tries = [(bucket, s) for _, bucket, s in auto.trials]
    assert max(tries.count(t) for t in tries) <= trial_steps, tries
    steps = {(t, b, s) for t, b, s in auto.trials}
    assert not any((t + 1, b, s) in steps for t, b, s in steps), auto.trials
    mine = (auto.trials, auto.decisions, sorted(auto.choices.current.items()))
    assert comm.allgather_object(mine) == [mine] * comm.size
    for key, scheme in auto.choices.current.items():
        seen = auto.measured[key]
        # step t's times are agreed during step t+1 and taken at its step_done
        tried = {s for t, bucket, s in auto.trials if bucket == key[0] and t < 11}
        assert tried <= set(seen) and scheme in seen
        # after its trials the bucket runs one of the tried (measured) schemes, cached
        last_trial = max(t for t, bucket, _ in auto.trials if bucket == key[0])
        after = [s for t, bucket, s, _ in auto.decisions if bucket == key[0]
                 and t > last_trial]
        if last_trial < 10:
            assert after and after[0] in tried, (after, tried)
