"""The controllers' decisions: the ratio solve over the continuous range (ASF as pymoo
defines it), the ratio following the network, the selector switching where the cost
model's curves cross (the same on every rank), L-GreCo following the ratio."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpicomm import strategies
from mpicomm.collectives.cost import ComputeParams, CostParams
from mpicomm.compress.topk import k_for
from mpicomm.compress.topk_select import topk_masses
from mpicomm.control import CRController, LGreco
from mpicomm.control.pareto import asf, asf_choice, interpolate_gains, pareto_front, ratio_grid
from mpicomm.strategies.auto_schemes import build, select

GBPS = 1.25e8
#: The issue's changing network: 10 Gbit/s 0.05 ms, 100 Mbit/s 5 ms, 1 Gbit/s 1 ms.
NETWORKS = [("10gbit", 0.05e-3, 10.0), ("100mbit", 5e-3, 0.1), ("1gbit", 1e-3, 1.0),
            ("10gbit", 0.05e-3, 10.0)]
TEXT_LM = 2_237_440          # parameters of the text-lm workload


# ---------------------------------------------------------------------- ASF / Pareto
def test_asf_is_pymoos_definition():
    """ASF(f; z, w) = max_i (f_i - z_i) / w_i: a larger weight counts *less*."""
    assert asf([0.2, 0.5], [0.6, 0.4]) == pytest.approx(max(0.2 / 0.6, 0.5 / 0.4))
    assert asf([3.0, 1.0], [1.0, 1.0], utopian=[1.0, 0.5]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="weights"):
        asf([1.0, 2.0], [1.0, 0.0])
    rng = np.random.default_rng(0)
    F, w, z = rng.random((20, 2)), rng.random(2) + 0.1, rng.random(2) * 0.1
    ours = [asf(f, w, z) for f in F]
    assert ours == pytest.approx([float(np.max((f - z) / w)) for f in F])
    pymoo = pytest.importorskip("pymoo.decomposition.asf")
    theirs = pymoo.ASF().do(F, w, utopian_point=z)
    np.testing.assert_allclose(np.ravel(theirs), ours, rtol=1e-12)


def test_asf_choice_weights_as_the_reference_code_passes_them():
    """The reference code calls pymoo's ASF with ``1 / weights`` for (0.6 time, 0.4
    gain), so time counts more; ``asf_choice`` with ``normalize="nadir"`` (its
    normalization) picks the same front point, and the opposite orientation (weights
    passed as they are) picks another one on this front."""
    points = [(1.0, 10.0), (2.0, 4.0), (3.0, 2.0), (4.0, 1.5), (6.0, 1.0)]
    F = np.array(points)
    nF = (F - F.min(axis=0)) / (F.max(axis=0) - F.min(axis=0))
    weights = np.array([0.6, 0.4])
    reference = int(np.argmin([np.max(f * weights) for f in nF]))   # ASF(nF; 0, 1/w)
    inverted = int(np.argmin([np.max(f / weights) for f in nF]))    # ASF(nF; 0, w)
    assert reference != inverted
    assert asf_choice(points, (0.6, 0.4), normalize="nadir") == reference
    pymoo = pytest.importorskip("pymoo.decomposition.asf")
    assert int(pymoo.ASF().do(nF, 1 / weights).argmin()) == reference
    # more weight on time picks a faster point, more weight on gain a better-gain one
    fast, good = asf_choice(points, (0.9, 0.1)), asf_choice(points, (0.1, 0.9))
    assert points[fast][0] < points[good][0] and points[fast][1] > points[good][1]


def test_nadir_normalization_is_blind_to_the_network():
    """Ideal-nadir normalization removes any affine change of the time objective: a
    step time ``other + alpha·L + beta·c·M`` gives the same pick whatever alpha, beta
    and ``other`` are. Normalizing by the ideal alone keeps the constant: a slow network
    (time grows with c) moves the pick to small ratios, a fast one to large ones."""
    grid = ratio_grid(0.001, 0.1)
    gain = {c: min(1.0, 0.2 + 0.35 * math.log10(c / 0.001)) for c in grid}

    def pick(normalize, other, alpha, beta):
        points = [(other + 3 * alpha + beta * c * 4e7, 1 / gain[c]) for c in grid]
        return grid[asf_choice(points, normalize=normalize)]

    fast, slow = (0.05, 1e-5, 1e-10), (0.05, 5e-3, 8e-8)
    assert pick("nadir", *fast) == pick("nadir", *slow)
    assert pick("ideal", *fast) >= 4 * pick("ideal", *slow)


def test_ratio_grid_and_interpolated_gains():
    grid = ratio_grid(0.001, 0.1)
    assert len(grid) == 64 and grid[0] == 0.1 and grid[-1] == 0.001
    steps = [a / b for a, b in zip(grid, grid[1:])]
    assert max(steps) / min(steps) < 1.01                      # log-spaced
    gains = interpolate_gains({0.1: 0.9, 0.01: 0.5, 0.001: 0.2}, grid)
    assert gains[0.1] == 0.9 and gains[0.001] == 0.2
    values = [gains[c] for c in grid]
    assert all(a >= b for a, b in zip(values, values[1:]))    # monotone like the data
    mid = min(grid, key=lambda c: abs(math.log(c / 0.01)))
    assert gains[mid] == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError):
        ratio_grid(0.0, 0.1)


# ---------------------------------------------------------------------- the ratio moves
def _gains(n: int, grid, seed: int = 0) -> dict[float, float]:
    """Top-k's gain ``||top-k(x)|| / ||x||`` of a heavy-tailed vector at every ratio."""
    x = torch.from_numpy(np.random.default_rng(seed).standard_t(2.0, n).astype(np.float32))
    total = float((x.double() ** 2).sum())
    masses = topk_masses(x, [k_for(n, c) for c in grid])
    return {c: math.sqrt(m / total) for c, m in zip(grid, masses)}


def _optimum(step_time, gains, grid) -> float:
    """Brute force: the Pareto points of (T(c), 1/gain(c)) over the grid, each
    objective as its relative excess over the best one, least max(0.6·t, 0.4·g)."""
    pts = {c: (step_time(c), 1 / gains[c]) for c in grid}
    front = [c for c in grid if not any(
        q[0] <= pts[c][0] and q[1] <= pts[c][1] and q != pts[c] for q in pts.values())]
    best = [min(pts[c][d] for c in front) for d in (0, 1)]
    return min(front, key=lambda c: (max(0.6 * (pts[c][0] / best[0] - 1),
                                         0.4 * (pts[c][1] / best[1] - 1)), -c))


def test_ratio_follows_every_change_of_the_network():
    """The issue's schedule (10 Gbit/s, 100 Mbit/s, 1 Gbit/s, 10 Gbit/s) for the language
    model's 2.2 M-parameter gradient at 8 ranks: after the probe and after every change
    the controller's ratio is the exact optimum over the 64-point grid of the range, and
    the optimum (hence the ratio) moves by at least 2x at every change."""
    net = {}

    def step_time(c: float) -> float:   # 50 ms of compute + the cheapest scheme at c
        return 0.05 + select([(TEXT_LM,)], c, 4, 8, net["params"], ComputeParams()).predicted

    cr = CRController(step_time, probe_first=True)
    grid = cr.probe_ratios
    gains = _gains(TEXT_LM, grid)
    chosen = []
    for i, (_, delay, gbps) in enumerate(NETWORKS):
        net["params"] = CostParams(alpha=delay, beta=1 / (gbps * GBPS))
        if i == 0:
            cr.start()
            cr.observe(0.5, probe=gains)
        else:
            cr.network_changed()
        assert cr.ratio == _optimum(step_time, gains, grid)
        chosen.append(cr.ratio)
    assert [h.reason for h in cr.history] == ["probe", "network", "network", "network"]
    moves = [max(a, b) / min(a, b) for a, b in zip(chosen, chosen[1:])]
    assert all(m >= 2 for m in moves), (chosen, moves)
    assert chosen[1] < chosen[2] < chosen[0]   # slowest network: the smallest ratio
    # the history keeps the Pareto front the pick came from
    front = cr.history[-1].points
    assert cr.ratio in [c for c, _, _ in front]


def test_ratio_stays_when_the_model_says_so():
    """A change that leaves the objectives as they were (the same network reported
    again) leaves the ratio; a slower compute step moves it up (the network's share of
    the step shrinks)."""
    net = {"params": CostParams(alpha=1e-3, beta=1 / GBPS), "other": 0.01}

    def step_time(c: float) -> float:
        return net["other"] + select([(TEXT_LM,)], c, 4, 8, net["params"],
                                     ComputeParams()).predicted

    cr = CRController(step_time, probe_first=True)
    cr.start()
    cr.observe(0.5, probe=_gains(TEXT_LM, cr.probe_ratios))
    before = cr.ratio
    cr.network_changed()
    assert cr.ratio == before
    net["other"] = 2.0
    cr.resolve("compute")
    assert cr.ratio >= 2 * before and cr.history[-1].reason == "compute"


def test_cr_controller_rejects_bad_grid_options():
    with pytest.raises(ValueError, match="normalize"):
        CRController(lambda c: c, normalize="max")
    with pytest.raises(ValueError, match="grid_points"):
        CRController(lambda c: c, grid_points=1)
    cr = CRController(lambda c: c, probe_first=True)
    cr.start()
    with pytest.raises(ValueError, match="every ratio"):
        cr.observe(0.5, probe={c: 0.5 for c in cr.ratios})   # the candidates only


# ---------------------------------------------------------------------- scheme switch
SPARSE = ("allgather_topk", "artopk_ring", "gtopk")


def _curves(n: int, c: float, p: int, alpha: float, beta: float) -> dict[str, float]:
    """The cost model's prediction of each scheme (its strategy's ``predict``)."""
    params = CostParams(alpha=alpha, beta=beta)
    return {s: build(s, c, [(n,)]).predict([(n,)], 4, p, params, ComputeParams())
            for s in SPARSE}


def _crossings(n: int, c: float, p: int, alpha: float, betas) -> list[tuple[float, str]]:
    """Where the cheapest curve changes along ``betas`` (log grid), each crossing
    refined by bisection on the two curves' difference to 1e-9 relative: (beta, new)."""
    out = []
    cheapest = [min(_curves(n, c, p, alpha, b).items(), key=lambda kv: kv[1])[0]
                for b in betas]
    for i in range(1, len(betas)):
        old, new = cheapest[i - 1], cheapest[i]
        if old == new:
            continue
        lo, hi = betas[i - 1], betas[i]
        while hi / lo - 1 > 1e-9:
            mid = math.sqrt(lo * hi)
            t = _curves(n, c, p, alpha, mid)
            lo, hi = (mid, hi) if t[old] <= t[new] else (lo, mid)
        out.append((hi, new))
    return out


def _switches(n, c, p, alpha, betas, choose) -> list[tuple[float, str]]:
    """Where ``choose(beta)`` changes along ``betas``, refined by bisection on it."""
    out = []
    picks = [choose(b) for b in betas]
    for i in range(1, len(betas)):
        if picks[i] == picks[i - 1]:
            continue
        lo, hi = betas[i - 1], betas[i]
        while hi / lo - 1 > 1e-9:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if choose(mid) == picks[i - 1] else (lo, mid)
        out.append((hi, picks[i]))
    return out


@pytest.mark.parametrize(("p", "n", "c", "alpha"), [(8, 1_000_000, 0.01, 1e-3),
                                                     (16, 10_000_000, 0.001, 1e-4),
                                                     (5, 2_237_440, 0.004, 5e-3)])
def test_selector_switches_exactly_where_the_curves_cross(p, n, c, alpha):
    """Sweeping the bandwidth from 100 Gbit/s down to 10 Mbit/s at a fixed latency, the
    selector moves between Allgather Top-k, AR-Top-k and gTop-k, and every switch is at
    a crossing of the cost model's curves (to 1e-6 relative), and only there."""
    betas = list(np.geomspace(1 / (100 * GBPS), 1 / (0.01 * GBPS), 120))

    def choose(beta: float) -> str:
        return select([(n,)], c, 4, p, CostParams(alpha=alpha, beta=beta), ComputeParams(),
                      schemes=SPARSE).scheme

    crossings = _crossings(n, c, p, alpha, betas)
    switches = _switches(n, c, p, alpha, betas, choose)
    assert len(crossings) >= 1
    assert [s for _, s in switches] == [s for _, s in crossings]
    for (b1, _), (b2, _) in zip(switches, crossings):
        assert b1 == pytest.approx(b2, rel=1e-6)


# ---------------------------------------------------------------------- L-GreCo
def test_lgreco_rebase_scales_the_settings_with_the_default():
    lg = LGreco(0.01, every=10, acc_steps=2)
    lg.apply({"densities": {"a": 0.04, "b": 0.0025}})
    lg.rebase(0.002)
    assert lg.default == 0.002
    assert lg.values == pytest.approx({"a": 0.008, "b": 0.0005})
    assert lg.candidates() == pytest.approx([0.0005, 0.001, 0.002, 0.004, 0.008])
    lg.rebase(0.5)
    assert lg.values["a"] == 1.0                     # clipped
    with pytest.raises(ValueError):
        lg.rebase(0.0)
    with pytest.raises(ValueError, match="top-k"):
        LGreco(4, family="qsgd").rebase(0.1)


def test_pareto_front_reexported_by_the_controller_module():
    from mpicomm.control import cr

    assert cr.pareto_front is pareto_front and cr.asf_choice is asf_choice


@pytest.mark.mpi
def test_auto_selector_follows_a_scripted_network_identically_on_every_rank(comm):
    """The auto strategy's own choice path (prediction only, no hysteresis) on a
    scripted network, the bandwidth stepping from 100 Gbit/s to 10 Mbit/s: at every step
    each rank picks the cheapest curve of the cost model, and all ranks pick alike."""
    n, c = 2_237_440, 0.004
    auto = strategies.make("auto", comm=comm, ratio=c, schemes=SPARSE, trial_steps=0,
                           switch_margin=0.0, gain_weighted=False, calibrate_links=0)
    shapes, segments = [(n,)], [("w", n, (n,))]
    picks = []
    for beta in np.geomspace(1 / (100 * GBPS), 1 / (0.01 * GBPS), 60):
        params = CostParams(alpha=1e-3, beta=float(beta))
        auto.choices.forget()                           # what a network drift does
        choice, _ = auto._choose(("bucket", c), shapes, segments, 4, params,
                                 ComputeParams(), {})
        curves = _curves(n, c, comm.size, 1e-3, float(beta))
        best = min(curves.values())
        assert curves[choice.scheme] == best, (beta, choice.scheme, curves)
        picks.append(choice.scheme)
    assert comm.allgather_object(picks) == [picks] * comm.size
    if comm.size >= 3:
        assert len(set(picks)) >= 2, picks              # it did move


@pytest.mark.mpi
def test_auto_reports_the_params_it_used_after_its_communicator_is_freed(comm):
    """``describe()["params"]`` is the refined alpha and beta auto ran with, also once
    the communicator that held them is freed (as at the end of a ``GradientSync``)."""
    mine = comm.dup()
    mine.resources["cost_params"] = CostParams(alpha=1e-3, beta=8e-8)   # 100 Mbit/s
    auto = strategies.make("auto", comm=mine, calibrate_links=0)
    torch.manual_seed(mine.rank)
    for _ in range(3):
        auto.aggregate([torch.randn(5000)], names=["w"])
    used = auto.describe()["params"]
    assert used["beta"] > 1e-9           # the refined 100 Mbit/s link, not the default
    mine.free()
    assert auto.describe()["params"] == used


# ---------------------------------------------------------------------- one rule
@pytest.mark.parametrize("gain_weighted", [True, False])
def test_cr_time_objective_prices_each_ratio_with_the_scheme_that_runs_there(monkeypatch,
                                                                             gain_weighted):
    """The CR controller's time objective at a ratio is the cost of the scheme the
    choice then settles on at that ratio (trials, then the kept choice), by the same
    rule: on a scripted 100 Mbit/s, 5 ms network with gTop-k and AR-Top-k measured to
    keep 0.4 and 0.3 of Top-k's mass at one ratio (carried to the others). Gain-weighted,
    the choice runs Allgather Top-k at some ratios where gTop-k's exchange is the
    fastest, and the objective prices those ratios with Allgather Top-k, at every ratio
    of the grid; by time alone (the default) it runs the fastest exchange everywhere."""
    from types import SimpleNamespace

    import mpicomm.strategies.auto as auto_module

    n, p = 105_738, 8
    params, compute = CostParams(alpha=5e-3, beta=8 / 1e8), ComputeParams()
    monkeypatch.setattr(auto_module, "calibrated", lambda comm: (params, compute))
    auto = strategies.make("auto", schemes=("dense",) + SPARSE, calibrate_links=0,
                           gain_weighted=gain_weighted)
    auto._comm = SimpleNamespace(size=p)
    shapes = [(n,)]
    auto._layouts = {"b0": (shapes, 4)}
    auto.choices.bucket_seen("b0", shapes)
    auto.choices.step_other = 0.0086
    auto.choices.efficiency = {("gtopk", 0.03): 0.4, ("artopk_ring", 0.03): 0.3}
    assert auto.choices.efficiency_at("gtopk", 0.01) == 0.4           # carried over
    assert auto.choices.efficiency_at("allgather_topk", 0.01) == 1.0  # unmeasured
    differ = 0
    for c in auto.controller.grid:
        key = ("b0", c)
        predicted = select(shapes, c, 4, p, params, compute, schemes=auto.schemes)
        for _ in range(len(SPARSE) + 2):             # trials, then the kept choice
            choice, trial = auto._choose(key, shapes, [("w", n, (n,))], 4, params,
                                         compute, {})
            if not trial:
                break           # a trial step "measures" the scheme's predicted time
            auto.choices.record(key, choice.scheme, predicted.candidates[choice.scheme],
                                True)
        scheme, seconds, cost = auto._run_costs(c)["b0"]
        assert choice.scheme == scheme, c
        # the whole step: gain-weighted costs carry the step's other time in shares
        whole = cost if gain_weighted else seconds + auto.choices.step_other
        assert auto.step_time(c) == pytest.approx(whole)
        assert choice.predicted == pytest.approx(cost)   # settled on by this cost
        assert auto.sync_time(c) == pytest.approx(predicted.candidates[scheme])
        fastest = predicted.scheme
        differ += fastest != scheme
    if gain_weighted:
        assert differ >= 1      # the fastest exchange is not always the one that runs
    else:
        assert differ == 0


# ---------------------------------------------------------------------- ratio ramp
def test_ratio_ramp_brings_a_large_fall_down_geometrically():
    """A fall by more than ``factor`` runs ``r0^(1-j/R) · r1^(j/R)`` for j = 1..R
    (from at most ``start``); a small fall, a rise or the first step run at once; a
    small move of the target during a ramp changes where it goes, a large one starts
    a new ramp from the ratio in force."""
    from mpicomm.strategies.auto_ramp import RatioRamp

    ramp = RatioRamp(steps=4, factor=4.0)
    assert ramp.ratio("b", 0.01) == 0.01                  # first step: the target
    assert ramp.ratio("b", 1.0) == 1.0                    # a rise: at once
    run = [ramp.ratio("b", 0.01) for _ in range(6)]
    assert run == pytest.approx([0.01 ** 0.25, 0.01 ** 0.5, 0.01 ** 0.75, 0.01, 0.01,
                                 0.01])
    assert ramp.ratio("b", 0.004) == 0.004                # 2.5x: no ramp
    assert not ramp.active("b")
    capped = RatioRamp(steps=2, factor=4.0, start=0.1)
    capped.ratio("b", 1.0)
    assert [capped.ratio("b", 0.001) for _ in range(3)] == pytest.approx([0.01, 0.001,
                                                                          0.001])
    moving = RatioRamp(steps=4, factor=4.0)
    moving.ratio("b", 1.0)
    assert moving.ratio("b", 0.01) == pytest.approx(0.01 ** 0.25)
    assert moving.ratio("b", 0.0081) == pytest.approx(0.0081 ** 0.5)   # same ramp
    first = moving.ratio("b", 1e-4)                        # a new ramp from 0.0081**0.5
    assert first == pytest.approx(0.0081 ** 0.375 * 1e-4 ** 0.25)
    assert RatioRamp(steps=0, factor=4.0).ratio("b", 1.0) == 1.0
    off = RatioRamp(steps=0, factor=4.0)
    off.ratio("b", 1.0)
    assert off.ratio("b", 0.001) == 0.001
    for bad in ({"steps": -1, "factor": 4.0}, {"steps": 4, "factor": 1.0},
                {"steps": 4, "factor": 4.0, "start": 0.0}):
        with pytest.raises(ValueError):
            RatioRamp(**bad)
    for option in ({"ramp_steps": -1}, {"ramp_factor": 0.5}, {"ramp_start": 1.5}):
        with pytest.raises(ValueError, match=next(iter(option))):
            strategies.make("auto", calibrate_links=0, **option)


def test_ramp_steps_count_neither_for_the_targets_times_nor_its_efficiency():
    """A ramp step runs above its key's ratio: its gain does not enter the (scheme,
    ratio)'s efficiency (it would read as exact Top-k at the smaller ratio)."""
    auto = strategies.make("auto", calibrate_links=0, ratio=0.01)
    record = {"step": 3, "scheme": "gtopk", "key_ratio": 0.01, "ramp": True}
    auto.choices.track_gains([record], [0.9], [1.0], [0.8])
    assert auto.efficiency == {} and auto.scheme_gains == {}
    auto.choices.track_gains([dict(record, ramp=False)], [0.4], [1.0], [0.8])
    assert auto.efficiency[("gtopk", 0.01)] == pytest.approx(0.5)


# ---------------------------------------------------------------------- momentum correction
def _momentum_run(comm, strategy, steps=6, own_step=False):
    """``steps`` of a small MLP, SGD with momentum 0.9, under ``strategy``: the final
    weights and the optimizer's momentum afterwards. ``own_step``: ``sync.wait()`` and
    the caller's ``optimizer.step()``, so the strategy never sees the optimizer."""
    from mpicomm.torch import GradientSync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + comm.rank)
    with GradientSync(model, strategy=strategy, comm=comm, bucket_mb=0.002) as sync:
        for _ in range(steps):
            x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 4, (16,),
                                                                     generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if own_step:
                sync.wait()
                opt.step()
            else:
                sync.step(opt)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), \
        opt.param_groups[0]["momentum"]


@pytest.mark.mpi
@pytest.mark.parametrize(("scheme", "ratio"), [("dense", 1.0), ("allgather_topk", 0.1)])
def test_auto_takes_the_momentum_over_as_the_fixed_strategies_do(comm, scheme, ratio):
    """``momentum_correction=True``: auto moves the optimizer's momentum into its
    error-feedback memory at the first step. Dense steps keep the velocity (momentum SGD
    on the averaged gradient, as the optimizer would); sparse steps send entries of the
    velocity plus the residual and clear it where they sent, exactly as the fixed
    strategy with its default DGC recipe; with ``momentum_correction=False`` the
    optimizer keeps it and a sparse run differs."""
    auto = strategies.make("auto", comm=comm, ratio=ratio, schemes=(scheme,),
                           calibrate_links=0, trial_steps=0, momentum_correction=True)
    mine, momentum = _momentum_run(comm, auto)
    assert momentum == 0.0 and auto.memory.momentum == 0.9
    fixed = (strategies.make("dense", comm=comm) if scheme == "dense"     # the classes'
             else strategies.TopKAllgather(comm=comm, density=ratio))      # DGC recipe
    theirs, theirs_momentum = _momentum_run(comm, fixed)
    assert theirs_momentum == (0.9 if scheme == "dense" else 0.0)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    if scheme != "dense":
        plain = strategies.make("auto", comm=comm, ratio=ratio, schemes=(scheme,),
                                calibrate_links=0, trial_steps=0, momentum_correction=False)
        other, kept = _momentum_run(comm, plain)
        assert kept == 0.9 and plain.memory.momentum == 0.0
        assert not torch.allclose(other, mine, rtol=1e-4, atol=1e-5)
    gathered = comm.allgather_object(mine.numpy())
    for w in gathered:
        np.testing.assert_allclose(w, gathered[0], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize(("scheme", "ratio"), [("dense", 1.0), ("allgather_topk", 0.1)])
def test_auto_never_applies_momentum_twice_when_it_never_sees_the_optimizer(comm, scheme,
                                                                          ratio):
    """A run whose steps end without ``step_done(optimizer)`` (``wait`` and the caller's
    own ``optimizer.step()``, as under the DDP hook without ``optimizer=``): the
    optimizer keeps its momentum and auto's memory falls back to plain error feedback at
    the second step, so the run
    equals auto with ``momentum_correction=False``; the state says no handover is due,
    and a strategy loaded from it does not take the momentum over later."""
    def auto(**kw):
        return strategies.make("auto", comm=comm, ratio=ratio, schemes=(scheme,),
                               calibrate_links=0, trial_steps=0, **kw)

    first = auto(momentum_correction=True)
    mine, momentum = _momentum_run(comm, first, own_step=True)
    assert momentum == 0.9 and first.memory.momentum == 0.0
    theirs, _ = _momentum_run(comm, auto(momentum_correction=False))
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    state = first.state_dict()
    assert state["adopt_pending"] is False
    again = auto(momentum_correction=True)
    assert again.handover.pending
    again.load_state_dict(state)
    assert not again.handover.pending and again.memory.momentum == 0.0


@pytest.mark.mpi
def test_auto_after_dense_hands_over_after_a_dense_run_and_stays_momentum_sgd(comm):
    """``momentum_correction="after_dense"`` (the default): after ``dense_steps`` dense
    steps in a row the optimizer's momentum buffers become the memory's velocities, so
    the run goes on exactly as momentum SGD (a velocity restarted from zero would not);
    the optimizer runs without momentum from then on."""
    auto = strategies.make("auto", comm=comm, ratio=1.0, schemes=("dense",),
                           calibrate_links=0, trial_steps=0)
    assert auto.handover.waiting and not auto.handover.pending
    auto.handover.dense_steps = 3
    mine, momentum = _momentum_run(comm, auto)
    assert momentum == 0.0 and auto.memory.momentum == 0.9 and not auto.handover.waiting
    theirs, kept = _momentum_run(comm, strategies.make("dense", comm=comm))
    assert kept == 0.9
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    state = auto.state_dict()
    assert state["adopt_waiting"] is False and state["adopt_pending"] is False
    again = strategies.make("auto", comm=comm, ratio=1.0, schemes=("dense",),
                            calibrate_links=0, trial_steps=0)
    again.load_state_dict(state)
    assert not again.handover.waiting and again.memory.momentum == 0.9


@pytest.mark.mpi
def test_auto_after_dense_keeps_plain_error_feedback_from_a_sparse_start(comm):
    """A run that starts sparse never hands over under ``"after_dense"``: it equals
    ``momentum_correction=False`` and the optimizer keeps its momentum."""
    def auto(**kw):
        return strategies.make("auto", comm=comm, ratio=0.1, schemes=("allgather_topk",),
                               calibrate_links=0, trial_steps=0, **kw)

    first = auto()
    first.handover.dense_steps = 3
    mine, momentum = _momentum_run(comm, first)
    assert momentum == 0.9 and first.memory.momentum == 0.0 and first.handover.waiting
    theirs, _ = _momentum_run(comm, auto(momentum_correction=False))
    assert torch.equal(mine, theirs)


def test_momentum_handover_after_dense_counts_dense_steps_in_a_row():
    """Sparse steps restart the count, steps of an exploration window do not count, and
    without an optimizer nothing moves; the optimizer's buffers become the velocities of
    the buckets whose parameters it holds."""
    from mpicomm.compress import ErrorFeedback
    from mpicomm.strategies.auto_exchange import MomentumHandover

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    memory = ErrorFeedback()
    handover = MomentumHandover(memory, "after_dense")
    handover.dense_steps = 2
    handover.bucket("b0", ["weight", "bias"])
    for schemes, window in [(["dense"], False), (["gtopk"], False), (["dense"], False),
                            (["dense", "gtopk"], True), (["dense"], True)]:
        handover.step_done(opt, model, schemes, window=window)
        assert handover.waiting
    handover.step_done(None, model, ["dense"])
    assert handover.waiting and handover.dense_run == 2
    handover.step_done(opt, model, ["dense"])
    assert not handover.waiting and memory.momentum == 0.5
    assert opt.param_groups[0]["momentum"] == 0.0 and not opt.state[model.weight]
    expected = torch.cat([model.weight.grad.reshape(-1), model.bias.grad.reshape(-1)])
    torch.testing.assert_close(memory.velocity("b0"), expected)
    with pytest.raises(ValueError, match="momentum_correction"):
        strategies.make("auto", calibrate_links=0, momentum_correction="yes")
