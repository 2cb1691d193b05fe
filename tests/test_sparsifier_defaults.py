"""The sparsifiers' default recipe: momentum correction taken over from the optimizer
(and, for gTop-k, the put-back of truncated picks).

``strategies.make("topk")`` and the classes ``GTopK`` and ``ARTopK`` default to
``momentum_correction="optimizer"`` (gTop-k and AR-Top-k by name: plain error feedback
and a density ramp, checked here too): at the first ``GradientSync.step(optimizer)`` the
strategy moves an SGD optimizer's momentum into its error-feedback memory. Checked under
``mpiexec -n 1..5`` on a real model: the run is the same as the explicit DGC recipe
(``momentum_correction=0.9`` with SGD without momentum), different from plain error
feedback, and a loop that never calls ``step_done`` keeps plain error feedback.
"""

from __future__ import annotations

import math

import pytest
import torch

from mpicomm import strategies
from mpicomm.strategies._compressed import adopt_momentum
from mpicomm.torch import GradientSync


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _train(comm, strategy, momentum: float, steps: int = 6, use_step: bool = True):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    gen = torch.Generator().manual_seed(100 + comm.rank)
    with GradientSync(model, strategy=strategy, comm=comm) as sync:
        for _ in range(steps):
            x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if use_step:
                sync.step(opt)
            else:
                sync.wait()
                opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt, \
            sync.strategy


def _class_default(name: str, **kwargs):
    """The classes' default at density 0.05 (by name the sparsifiers have other recipes:
    no momentum correction, a density ramp for gTop-k and AR-Top-k, Top-k's coding)."""
    if name in ("gtopk", "artopk"):
        kwargs = {"schedule": None, "momentum_correction": "optimizer", **kwargs}
    else:
        kwargs = {"coding": None, "momentum_correction": "optimizer", **kwargs}
    return strategies.make(name, density=0.05, **kwargs)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["topk", "gtopk", "artopk"])
def test_default_takes_the_optimizers_momentum(comm, name):
    default, opt, strategy = _train(comm, _class_default(name), 0.9)
    assert all(g["momentum"] == 0.0 for g in opt.param_groups)
    assert strategy.momentum_correction == 0.9 and not strategy.adopt_pending
    explicit, _, _ = _train(comm, _class_default(name, momentum_correction=0.9), 0.0)
    assert torch.allclose(default, explicit, rtol=1e-5, atol=1e-6), \
        (default - explicit).abs().max()
    plain, opt, strategy = _train(comm, _class_default(name, momentum_correction=0.0),
                                  0.9)
    assert (default - plain).abs().max() > 1e-4  # the recipe is not plain EF
    assert strategy.momentum_correction == 0.0 and opt.param_groups[0]["momentum"] == 0.9
    # without step_done (wait + the caller's own optimizer step) nothing is adopted
    kept, opt, strategy = _train(comm, _class_default(name), 0.9, use_step=False)
    assert strategy.adopt_pending and opt.param_groups[0]["momentum"] == 0.9
    assert torch.allclose(kept, plain, rtol=1e-5, atol=1e-6)


def test_adopt_momentum_only_from_plain_sgd():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.8)
    opt.step()
    assert "momentum_buffer" in opt.state[p]
    assert adopt_momentum(opt) == 0.8
    assert opt.param_groups[0]["momentum"] == 0.0 and "momentum_buffer" not in opt.state[p]
    for other in (torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True),
                  torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1),
                  torch.optim.SGD([p], lr=0.1), torch.optim.Adam([p])):
        before = [dict(g) for g in other.param_groups]
        assert adopt_momentum(other) == 0.0
        assert [dict(g) for g in other.param_groups] == before
    s = strategies.make("gtopk", density=0.01, error_feedback=False)
    assert s.momentum_correction == 0.0 and not s.adopt_pending
    assert strategies.TopKAllgather().describe()["momentum_correction"] == "optimizer"
    with pytest.raises(ValueError, match="'optimizer'"):
        strategies.make("artopk", momentum_correction="sgd")


def test_gtopk_default_puts_truncated_picks_back():
    """gTop-k's default keeps the mass of a pick whose own value was truncated on the
    butterfly (``own_contribution=True``); the paper's index rule is opt-in, and the
    experiments' labels keep every option off unless a modifier names it."""
    from mpicomm.bench.recipes import label_strategy

    assert strategies.make("gtopk").own_contribution is True
    assert strategies.make("gtopk", own_contribution=False).describe()[
        "own_contribution"] is False
    assert label_strategy("gtopk", density=0.01).strategy.own_contribution is True
    assert label_strategy("gtopk+ef", density=0.01).strategy.own_contribution is False
    assert label_strategy("gtopk+ef+own", density=0.01).strategy.own_contribution is True
    # the exact values at the global index set: the class's opt-in, and for gTop-k only
    assert strategies.GTopK().exact_values is False
    assert label_strategy("gtopk+ef+own", density=0.01).strategy.exact_values is False
    assert label_strategy("gtopk+ef+exact", density=0.01).strategy.exact_values is True
    assert label_strategy("gtopk:exact_values=true", density=0.01).strategy.describe()[
        "exact_values"] is True
    with pytest.raises(ValueError, match="'exact' modifier is for gtopk only"):
        label_strategy("topk+ef+exact", density=0.01)


def test_gtopk_by_name_ramps_its_density_within_a_fixed_budget():
    """``make("gtopk")`` (and every entry point that builds by name) adds the measured
    recipe: plain error feedback with the optimizer's momentum, a density ramp from
    0.03 geometrically down to the density, 7.48 density-steps in all (411 steps at
    0.01), and the coded butterfly with the exact values; the class itself and
    ``schedule=None`` have no ramp, and the class keeps the momentum correction and
    the plain butterfly."""
    from mpicomm.bench.recipes import label_strategy
    from mpicomm.control import BudgetRamp

    s = strategies.make("gtopk", density=0.01)
    assert s.schedule == BudgetRamp(0.03, 7.48)
    assert s.describe()["schedule"] == "ramp:0.03,7.48"
    assert s.momentum_correction == 0.0 and not s.adopt_pending
    assert s.exact_values is True and s.coding == "log8"
    assert s.describe() == label_strategy("gtopk+ef+own+exact+log8+ramp:0.03,7.48",
                                          density=0.01).strategy.describe()
    with pytest.raises(ValueError, match="pass coding=None"):
        strategies.make("gtopk", exact_values=False)
    plain = strategies.make("gtopk", exact_values=False, coding=None)
    assert plain.describe()["collective"] == "gtopk(butterfly)"
    assert strategies.GTopK().coding is None
    # k of a 100 000-element buffer: 3 000 at step 0, 1 000 from step 411 on
    assert [s._k(100_000, t, 0.01, None) for t in (0, 205, 410, 411, 5000)] == \
        [3000, math.ceil(100_000 * 0.03 * (1 / 3) ** (205 / 411)), 1003, 1000, 1000]
    assert label_strategy("gtopk", density=0.01).strategy.schedule == s.schedule
    assert strategies.make("gtopk").describe() == s.describe()
    assert strategies.make("gtopk", schedule=None).schedule is None
    assert strategies.GTopK(density=0.001).schedule is None
    assert strategies.GTopK(density=0.001).momentum_correction == "optimizer"
    assert strategies.make("gtopk", momentum_correction="optimizer").adopt_pending
    assert strategies.make("gtopk", density=0.05)._k(1000, 0, 0.05, None) == 50
    assert strategies.make("topk").schedule is None


def test_gtopk_by_name_below_density_0003_averages_exact_values_on_a_shorter_ramp():
    """Under density 0.003 the name's recipe keeps the exact mean at the butterfly's
    indices but sends plain pairs, and shortens the ramp to 6.2 density-steps (727
    steps at 0.001); at 0.003 and above, from ``k`` alone, or for another name, nothing
    changes; a keyword given wins over the recipe."""
    from mpicomm.bench.recipes import label_strategy
    from mpicomm.control import BudgetRamp

    low = strategies.make("gtopk", density=0.001)
    assert low.exact_values is True and low.schedule == BudgetRamp(0.03, 6.2)
    assert low.coding is None
    assert low.momentum_correction == 0.0 and low.own_contribution is True
    assert [low._k(100_000, t, 0.001, None) for t in (0, 726, 727)] == [3000, 101, 100]
    assert low.describe() == label_strategy(
        "gtopk+ef+own+exact+ramp:0.03,6.2", density=0.001).strategy.describe()
    assert label_strategy("gtopk", density=0.001).strategy.describe() == low.describe()
    assert strategies.make("gtopk", density=0.002999).exact_values is True
    for kwargs in ({"density": 0.003}, {"density": 0.01}, {"k": 10}, {}):
        s = strategies.make("gtopk", **kwargs)
        assert s.coding == "log8" and s.schedule == BudgetRamp(0.03, 7.48), kwargs
    assert strategies.make("gtopk", density=0.001, exact_values=False).exact_values is False
    assert strategies.make("gtopk", density=0.001, schedule=None).schedule is None
    assert strategies.recipe("gtopk", 0.001) == {
        "schedule": BudgetRamp(0.03, 6.2), "momentum_correction": 0.0,
        "exact_values": True, "coding": None}
    assert strategies.recipe("artopk", 0.001) == strategies.recipe("artopk", 0.01)
    with pytest.raises(ValueError, match="density"):   # the class's own message
        strategies.make("gtopk", density=-1.0)


def test_topk_by_name_codes_its_pairs_with_plain_error_feedback_from_density_0003():
    """From density 0.003 (and from ``k`` alone) Top-k by name sends its pairs in the
    log8 format with plain error feedback; below, the class's plain pairs and the
    momentum correction taken over from the optimizer; a keyword given wins."""
    from mpicomm.bench.recipes import label_strategy

    for kwargs in ({"density": 0.01}, {"density": 0.003}, {"k": 10}, {}):
        s = strategies.make("topk", **kwargs)
        assert s.coding == "log8" and s.momentum_correction == 0.0, kwargs
        assert not s.adopt_pending and s.schedule is None
    low = strategies.make("topk", density=0.001)
    assert low.coding is None and low.adopt_pending
    assert low.describe() == strategies.TopKAllgather(density=0.001).describe()
    assert strategies.TopKAllgather(density=0.01).coding is None   # the class: plain
    assert strategies.make("topk", density=0.01, coding=None).coding is None
    assert strategies.make("topk", density=0.001, coding="log8").coding == "log8"
    assert label_strategy("topk", density=0.01).strategy.describe() == \
        strategies.make("topk", density=0.01).describe()
    assert label_strategy("topk:coding=none,momentum_correction=optimizer",
                          density=0.01).strategy.describe() == \
        strategies.TopKAllgather(density=0.01).describe()
    assert strategies.recipe("topk", 0.001) == {"coding": None,
                                                "momentum_correction": "optimizer"}


@pytest.mark.mpi
def test_artopk_by_name_is_plain_error_feedback_with_a_density_ramp(comm):
    """``make("artopk")`` (and the bare label) builds the measured recipe: plain error
    feedback with the optimizer's momentum, a ramp from 0.1 spending 23.47
    density-steps (1 092 steps at 0.001, 600 at 0.01) and the source with the largest
    error-fed vector; a keyword given wins. A run by name is the same as the explicit
    recipe, leaves the optimizer's momentum in place and sends the ramp's k."""
    from mpicomm.bench.recipes import label_strategy
    from mpicomm.control import BudgetRamp

    s = strategies.make("artopk", density=0.001)
    assert s.schedule == BudgetRamp(0.1, 23.47) and s.momentum_correction == 0.0
    assert s.source == "largest" and strategies.ARTopK().source == "star"
    assert strategies.make("artopk", source="star").source == "star"
    assert s.schedule.steps(0.001) == 1092 and s.schedule.steps(0.01) == 600
    assert [s._k(100_000, t, 0.001, None) for t in (0, 1091, 1092)] == [10_000, 101, 100]
    assert label_strategy("artopk", density=0.001).strategy.describe() == s.describe()
    assert label_strategy("artopk+ef+largest+ramp:0.1,23.47",
                          density=0.001).strategy.describe() == s.describe()
    assert label_strategy("artopk+ef", density=0.001).strategy.source == "star"
    with pytest.raises(ValueError, match="'largest' modifier is for artopk only"):
        label_strategy("gtopk+ef+largest", density=0.001)
    assert strategies.make("artopk", schedule=None).schedule is None
    assert strategies.make("artopk", momentum_correction="optimizer").momentum_correction \
        == "optimizer"
    assert strategies.ARTopK().schedule is None
    assert strategies.ARTopK().momentum_correction == "optimizer"
    by_name, opt, strategy = _train(comm, strategies.make("artopk", density=0.01), 0.9)
    assert opt.param_groups[0]["momentum"] == 0.9 and strategy.momentum_correction == 0.0
    explicit, _, _ = _train(comm, strategies.ARTopK(
        density=0.01, schedule=BudgetRamp(0.1, 23.47), momentum_correction=0.0,
        source="largest"), 0.9)
    assert torch.equal(by_name, explicit)
    star, _, _ = _train(comm, strategies.make("artopk", density=0.01, source="star"), 0.9)
    assert comm.size < 3 or not torch.equal(by_name, star)
    if comm.size > 1:  # step 5 of the ramp: 26 of the 259 entries, not 0.01's 3
        assert list(strategy.stats.extra["k"].values()) == [26]
