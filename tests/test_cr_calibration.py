"""The paper's cost model and the compression-ratio controller: ``predict`` against
Table VI, the Pareto front, ASF and knee choices, the CR controller's exploration windows,
probes and triggers, the Top-k masses its gains come from, link and online calibration
(peers, rounds, drift, the injected link delay, the numbers every rank agrees on) and the
scheme selector that turns calibrated costs into a choice."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mpicomm.collectives.calibrate import choose_peers
from mpicomm.collectives.cost import ComputeParams, CostParams, calibrated
from mpicomm.comm import CALIBRATION_KEYS
from mpicomm.control import CRController, OnlineCalibration, predict
from mpicomm.control.cr import asf_choice, knee_choice, pareto_front
from mpicomm.strategies.auto_schemes import select

from .auto_runs import GBPS, ZERO

PARAMS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "alexnet": 61_100_840}
# the Table VI rows tests/test_cost.py checks (Tyagi & Swany 2023), (AG, ART-Ring, ART-Tree)
TABLE_VI = [
    ("resnet18", 10, 0.1, (54.0, 35.0, 43.2), 0.03),
    ("resnet18", 1, 0.1, (526.3, 194.7, 345.6), 0.03),
    ("alexnet", 1, 0.1, (2718.7, 964.4, 1778.0), 0.03),
    ("resnet50", 5, 0.1, (232.0, 94.7, 156.2), 0.03),
    ("resnet18", 10, 0.01, (7.66, 18.1, 12.2), 0.08),
    ("resnet18", 10, 0.001, (3.28, 16.7, 9.0), 0.08),
    ("resnet18", 1, 0.001, (8.86, 19.5, 12.8), 0.08),
    ("alexnet", 1, 0.001, (31.33, 27.0, 27.3), 0.08),
]


# ---------------------------------------------------------------------- predict
@pytest.mark.parametrize(("model", "gbps", "c", "table", "rel"), TABLE_VI)
def test_predict_reproduces_table_vi(model, gbps, c, table, rel):
    M, beta = 4 * PARAMS[model], 1 / (gbps * GBPS)
    got = tuple(1e3 * predict(s, M, 8, 1e-3, beta, cr=c)
                for s in ("allgather_topk", "artopk_ring", "artopk_tree"))
    assert got == pytest.approx(table, rel=rel)
    assert int(np.argmin(got)) == int(np.argmin(table))


def test_predict_dense_schemes_and_errors():
    M, a, b = 1e6, 1e-4, 1e-9
    assert predict("allreduce_ring", M, 4, a, b) == pytest.approx(6 * a + 1.5 * M * b)
    assert predict("allreduce_tree", M, 4, a, b) == pytest.approx(4 * a + 4 * M * b)
    assert predict("broadcast", M, 8, a, b) == pytest.approx(3 * a + 3 * M * b)
    assert predict("gtopk", M, 8, a, b, cr=0.01) == pytest.approx(3 * a + 6 * 0.01 * M * b)
    assert predict("allreduce_ring", M, 1, a, b) == 0.0
    with pytest.raises(ValueError, match="scheme"):
        predict("alltoall", M, 4, a, b)
    with pytest.raises(ValueError, match="cr"):
        predict("gtopk", M, 4, a, b, cr=0.0)
    with pytest.raises(ValueError, match="ranks"):
        predict("gtopk", M, 0, a, b)
    with pytest.raises(TypeError, match="alpha"):
        predict("gtopk", M, 4, "1ms", b)


# ---------------------------------------------------------------------- CR / Pareto
def test_pareto_front_asf_and_knee():
    pts = [(1.0, 10.0), (2.0, 4.0), (3.0, 3.5), (4.0, 1.0), (5.0, 5.0)]
    assert pareto_front(pts) == [0, 1, 2, 3]
    assert asf_choice(pts, (0.6, 0.4)) in (1, 2)
    assert asf_choice(pts, (100.0, 0.01)) == 0   # only time counts
    assert asf_choice(pts, (0.01, 100.0)) == 3   # only gain counts
    assert knee_choice(pts) == 1


def test_cr_controller_explores_restores_and_picks_by_asf():
    times = {0.1: 10.0, 0.033: 4.0, 0.011: 2.0, 0.004: 1.5, 0.001: 1.4}
    gains = {0.1: 0.9, 0.033: 0.8, 0.011: 0.6, 0.004: 0.3, 0.001: 0.1}
    cr = CRController(times.__getitem__, grid_points=0, window=2, warmup_steps=2, cooldown=5,
                      restore_first=True)
    assert cr.ratio == 1.0 and cr.start() is None  # warm-up from dense first
    assert cr.observe(1.0) is None and 0.1 < cr.ratio < 1.0
    assert cr.observe(1.0) == "save"               # warm-up over: explore
    actions = []
    for _ in range(10):
        actions.append(cr.observe(gains[cr.ratio]))
    assert actions[-1] == "restore" and actions[:-1] == [None] * 9
    assert cr.gains == pytest.approx(gains)
    points = [(times[c], 1 / gains[c]) for c in sorted(times, reverse=True)]
    assert cr.ratio == sorted(times, reverse=True)[asf_choice(points)]
    assert cr.history[-1].reason == "solve"
    # a steady gain never triggers; a sustained >= 10% change does, within a few steps,
    # once the cooldown after the solve is over
    for _ in range(20):
        assert cr.observe(0.6) is None
    actions = [cr.observe(0.2) for _ in range(10)]
    assert "save" in actions


def test_cr_controller_resolves_on_network_change():
    t = {"scale": 1.0}
    cr = CRController(lambda c: c * t["scale"] + 0.01 / c, ratios=(0.1, 0.01), window=1)
    assert cr.start() == "save"
    cr.observe(0.9)
    assert cr.observe(0.5) == "restore"
    first = cr.ratio
    t["scale"] = 1e6   # bandwidth collapses: the time of large c explodes
    cr.network_changed()
    assert cr.history[-1].reason == "network"
    assert cr.ratio <= first / 5 and cr.ratio in cr.grid


def test_cr_controller_starts_no_window_near_the_end_of_training():
    """``total_steps``: a gain change in the last ``2·window·len(ratios)`` steps starts
    no exploration (it could not pay back, and the run could end inside it); earlier
    it does."""
    times = {0.1: 10.0, 0.01: 1.0}

    def run(total_steps, change_at):
        cr = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.01), window=2,
                          cooldown=2, total_steps=total_steps)
        assert cr.start() == "save"
        actions = [cr.observe(g) for g in (0.9, 0.9, 0.5, 0.5)]
        assert actions[-1] == "restore"
        for t in range(5, total_steps + 1):
            actions.append(cr.observe(0.5 if t < change_at else 0.1))
        return actions.count("save")

    assert run(40, 20) == 1          # 20 + 8 <= 40: explores
    assert run(40, 34) == 0          # too late
    with pytest.raises(ValueError, match="total_steps"):
        CRController(times.__getitem__, grid_points=0, total_steps=0)
    untimed = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.01), window=2,
                           cooldown=2)
    untimed.start()
    acts = [untimed.observe(g) for g in [0.9, 0.9, 0.5, 0.5] + [0.5] * 28 + [0.1] * 6]
    assert acts.count("save") == 1   # without total_steps, no limit


def test_cr_controller_first_window_keeps_its_steps_later_windows_restore():
    """``restore_first=False``: the start-up exploration neither saves nor restores; a
    window triggered later by a gain change does both; the default (the paper's loop)
    restores the first one too."""
    times = {0.1: 10.0, 0.01: 1.0}
    cr = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.01), window=1, cooldown=2,
                      restore_first=False)
    assert cr.start() is None and cr.exploring
    assert [cr.observe(g) for g in (0.9, 0.5)] == [None, None]
    assert not cr.exploring and cr.history[-1].reason == "solve"
    actions = [cr.observe(0.5) for _ in range(4)]
    while "save" not in actions and len(actions) < 12:
        actions.append(cr.observe(0.1))   # the gain drops: a triggered window
    assert actions.count("save") == 1 and cr.exploring
    assert [cr.observe(0.3) for _ in range(2)] == [None, "restore"]
    paper = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.01), window=1)
    assert paper.start() == "save"
    assert [paper.observe(g) for g in (0.9, 0.5)] == [None, "restore"]


def test_cr_controller_probe_first_solves_on_the_probe():
    times = {0.1: 10.0, 0.03: 3.0, 0.01: 1.0}
    cr = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.03, 0.01), probe_first=True)
    assert cr.start() is None and cr.probing and cr.exploring and cr.ratio == 0.03
    with pytest.raises(ValueError, match="probe"):
        cr.observe(0.5)                                  # the probe's gains are due
    with pytest.raises(ValueError, match="every ratio"):
        cr.observe(0.5, probe={0.1: 0.9})
    assert cr.observe(0.5, probe={0.1: 0.9, 0.03: 0.7, 0.01: 0.5}) is None
    assert not cr.probing and cr.history[-1].reason == "probe"
    assert cr.gains == {0.1: 0.9, 0.03: 0.7, 0.01: 0.5}
    points = [(times[c], 1 / cr.gains[c]) for c in (0.1, 0.03, 0.01)]
    assert cr.ratio == (0.1, 0.03, 0.01)[asf_choice(points)]
    with pytest.raises(ValueError, match="no probe step"):
        cr.observe(0.5, probe={0.1: 0.9, 0.03: 0.7, 0.01: 0.5})
    # later explorations are windows with save and restore
    actions = [cr.observe(0.5) for _ in range(60)] + [cr.observe(0.1) for _ in range(5)]
    assert actions.count("save") == 1


def test_cr_controller_probe_triggered_probes_at_the_ratio_in_force():
    """``probe_triggered``: an exploration the gain's change triggers is a probe on one
    ordinary step at the ratio in force (no save, no restore), solved at the next
    ``observe`` with every candidate's gain; the cooldown starts again from there."""
    times = {0.1: 10.0, 0.03: 3.0, 0.01: 1.0}
    cr = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.03, 0.01), probe_first=True,
                      probe_triggered=True, cooldown=5)
    cr.start()
    cr.observe(0.5, probe={0.1: 0.9, 0.03: 0.7, 0.01: 0.5})
    ratio = cr.ratio
    actions = [cr.observe(0.5) for _ in range(10)]
    assert actions == [None] * 10 and not cr.probing
    actions = []
    while not cr.probing and len(actions) < 10:      # the gain moved: a probe, no window
        actions.append(cr.observe(0.2))
    assert actions == [None] * len(actions) and cr.probing and cr.ratio == ratio
    assert len(cr.history) == 1
    with pytest.raises(ValueError, match="probe"):
        cr.observe(0.2)
    assert cr.observe(0.2, probe={0.1: 0.4, 0.03: 0.3, 0.01: 0.2}) is None
    assert cr.history[-1].reason == "probe" and not cr.exploring
    assert cr.gains == {0.1: 0.4, 0.03: 0.3, 0.01: 0.2}
    points = [(times[c], 1 / cr.gains[c]) for c in (0.1, 0.03, 0.01)]
    assert cr.ratio == (0.1, 0.03, 0.01)[asf_choice(points)]
    assert [cr.observe(0.2) for _ in range(5)] == [None] * 5 and not cr.probing  # cooldown
    # probe_first alone: the triggered exploration is the paper's window
    cr = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.03, 0.01), probe_first=True,
                      cooldown=5)
    cr.start()
    cr.observe(0.5, probe={0.1: 0.9, 0.03: 0.7, 0.01: 0.5})
    actions = [cr.observe(0.5) for _ in range(10)] + [cr.observe(0.2) for _ in range(10)]
    assert "save" in actions and not cr.probing


def test_cr_controller_windows_with_gains_one_step_late():
    """``observe(ratio=)`` for a caller whose gains arrive a step late (the adaptive
    strategy's): a window's ratio moves on after ``window`` steps observed *at* it, a
    late step of an earlier ratio adds to that ratio's mean, one from before the window
    is ignored, and after the solve a late step at another ratio does not move the
    smoothed gain; the means are exactly the gains of the ratios' own steps."""
    times = {0.1: 10.0, 0.01: 1.0}
    own = {0.1: 0.9, 0.01: 0.5}
    cr = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.01), window=2, cooldown=0,
                      trigger=0.05)
    actions, ran, late = [cr.start()], [], None
    for _ in range(12):
        ran.append(cr.ratio)                    # this step runs at the ratio in force
        gain = own[ran[-1]] if cr.exploring or late is None else 0.2  # (0.2: a change)
        if late is not None:
            actions.append(cr.observe(late[1], ratio=late[0]))
        late = (ran[-1], gain)
    assert ran[:6] == [0.1] * 3 + [0.01] * 3, ran          # 2 observed + 1 in flight
    assert actions[0] == "save" and actions[5] == "restore", actions
    first = cr.history[0]
    assert first.reason == "solve" and [p[2] for p in first.points] == \
        [1 / own[0.1], 1 / own[0.01]]
    # the gains changed (0.2): a second window, saved; the late step from before it
    # (0.2 at 0.01) is ignored, its late step at 0.1 counts for 0.1
    assert actions.count("save") == 2 and cr.exploring
    assert cr._explore_sums == {0.1: [0.9, 0.9, 0.9]}, cr._explore_sums
    # a late gain at another ratio than the one in force leaves the smoothed gain alone
    cr = CRController(times.__getitem__, grid_points=0, ratios=(0.1, 0.01), explore=False)
    cr.observe(0.5, ratio=0.1)
    assert cr.gain == 0.5
    cr.observe(0.9, ratio=0.01)
    assert cr.gain == 0.5


def test_topk_masses_are_prefix_sums_of_the_sorted_squares():
    from mpicomm.compress.topk_select import topk_masses

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64, torch.float16):
        x = torch.randn(500, generator=gen).to(dtype)
        want = [float((x.double().abs().topk(k).values ** 2).sum()) for k in (50, 5, 1)]
        got = topk_masses(x, [50, 5, 1])
        assert got == pytest.approx(want, rel=1e-6), dtype
        assert topk_masses(x, [5]) == pytest.approx(want[1:2], rel=1e-6)   # one k
    assert topk_masses(torch.ones(3), [3, 2, 0, 7]) == pytest.approx([3.0, 2.0, 0.0, 3.0])


# ---------------------------------------------------------------------- calibration
def test_choose_peers_prefers_other_nodes():
    assert choose_peers([0, 0, 1, 1, 2, 2], 3) == [2, 4, 1]
    assert choose_peers([0, 0, 0], 5) == [1, 2]
    assert choose_peers([0], 3) == []


def test_link_rounds_measure_node_disjoint_pairs_at_once():
    from mpicomm.collectives.calibrate import link_rounds

    # one rank per node (the emulated cluster): every rank in the first round
    assert link_rounds([0, 1, 2, 3], 2) == [[(0, 1), (2, 3)]]
    assert link_rounds([0, 1, 2, 3], 3) == [[(0, 1), (2, 3)], [(0, 2)]]
    assert link_rounds([0, 1, 2, 3, 4], 4) == [[(0, 1), (2, 3)], [(0, 2), (1, 3)]]
    # one node: one pair a round (they would share the node), rank 0's links first
    assert link_rounds([0, 0, 0], 3) == [[(0, 1)], [(0, 2)], [(1, 2)]]
    assert link_rounds([0], 3) == [] and link_rounds([0, 1], 0) == []
    # two ranks a node: a round never uses a node twice
    for nodes in ([0, 0, 1, 1, 2, 2], [0, 1, 0, 1], [0, 0, 1, 1, 1]):
        rounds = link_rounds(nodes, 4)
        assert rounds[0][0][0] == 0 and nodes[rounds[0][0][1]] != nodes[0]
        for pairs in rounds:
            used = [{nodes[a], nodes[b]} for a, b in pairs]
            assert all(x.isdisjoint(y) for x, y in itertools.combinations(used, 2)), rounds
            ranks = [r for pair in pairs for r in pair]
            assert len(ranks) == len(set(ranks))
        assert sum(len(p) for p in rounds) == 4


def test_online_calibration_tracks_a_bandwidth_change_and_flags_drift():
    base = CostParams(alpha=1e-5, beta=1e-9, gamma=0.0)
    cal = OnlineCalibration(base, decay=0.7, drift=0.3, patience=1)
    shapes = [(4, 1e3), (4, 1e6), (10, 1e5), (2, 1e7)]  # (messages, bytes)
    for _ in range(3):
        for a, b in shapes:
            cal.observe(a, b, a * base.alpha + b * base.beta)
        assert cal.refine() is False
    assert cal.params.beta == pytest.approx(base.beta, rel=0.05)
    slow = 4e-9   # bandwidth drops 4x
    drift = []
    for _ in range(6):
        for a, b in shapes:
            cal.observe(a, b, a * base.alpha + b * slow)
        drift.append(cal.refine())
    assert drift[0] or drift[1]
    assert cal.params.beta == pytest.approx(slow, rel=0.15)
    assert cal.params.alpha == pytest.approx(base.alpha, rel=0.5)


def test_online_calibration_drift_is_debounced():
    """One outlier refinement (a slow step on a loaded host) does not flag drift; a change
    that persists for ``patience`` refinements does, once, and becomes the reference."""
    base = CostParams(alpha=1e-5, beta=1e-9, gamma=0.0)
    shapes = [(4, 1e3), (4, 1e6), (10, 1e5), (2, 1e7)]

    def feed(cal, beta):
        for a, b in shapes:
            cal.observe(a, b, a * base.alpha + b * beta)
        return cal.refine()

    cal = OnlineCalibration(base, decay=0.7, drift=0.3, patience=3)
    assert [feed(cal, base.beta) for _ in range(3)] == [False] * 3
    assert feed(cal, 5e-9) is False          # a single 5x outlier: moved, not persistent
    assert [feed(cal, base.beta) for _ in range(6)] == [False] * 6
    flags = [feed(cal, 4e-9) for _ in range(8)]   # the bandwidth really drops 4x
    assert flags.count(True) == 1 and flags.index(True) >= 2
    assert cal.reference.beta == pytest.approx(4e-9, rel=0.3)
    # patience=1 reacts at the first refinement outside the band
    eager = OnlineCalibration(base, decay=0.7, drift=0.3, patience=1)
    feed(eager, base.beta)
    assert feed(eager, 5e-9) is True
    with pytest.raises(ValueError, match="patience"):
        OnlineCalibration(base, patience=0)


def test_injected_link_is_the_alpha_beta_time_of_the_traffic_sent(monkeypatch):
    import types

    from mpicomm.emulate import linkdelay

    slept: list[float] = []
    monkeypatch.setattr(linkdelay.time, "sleep", slept.append)
    monkeypatch.delenv(linkdelay.ENV_RANKS_PER_HOST, raising=False)
    fake = types.SimpleNamespace(resources={}, rank=0, size=3)
    assert linkdelay.link_delay(fake) is None  # no link set: nothing to wait
    ld = linkdelay.set_link(fake, 1e-4, 1e-8)
    assert linkdelay.link_delay(fake) is ld
    for dest, nbytes in ((1, 200), (2, 300), (1, 500)):  # 3 messages, 1000 bytes
        ld.before_send(dest, nbytes)
    ld.before_send(0, 10_000)  # to itself: free
    assert sum(slept) == pytest.approx(3e-4 + 1e-5) == ld.cost(3, 1000)
    assert len(slept) == 3
    linkdelay.set_link(fake, None)
    assert linkdelay.link_delay(fake) is None


def test_calibrated_reads_the_communicators_calibration_keys():
    class Fake:
        resources: dict = {}

    fake = Fake()
    assert calibrated(fake) == (CostParams(), ComputeParams())
    mine = (CostParams(alpha=1.0), ComputeParams(select=1.0))
    fake.resources = dict(zip(CALIBRATION_KEYS, mine))
    assert calibrated(fake) == mine


# ---------------------------------------------------------------------- selector
def test_selector_follows_the_network_and_counts_compute():
    shapes = [(1000, 1000)]
    slow = CostParams(alpha=1e-4, beta=1 / (1 * GBPS), gamma=0.0)   # 1 Gbit/s
    choice = select(shapes, 0.01, 4, 8, slow, ZERO)
    assert choice.scheme != "dense"
    assert choice.predicted == min(choice.candidates.values())
    assert set(choice.candidates) == {"dense", "allgather_topk", "gtopk", "artopk_ring",
                                      "artopk_tree", "powersgd"}
    # a very fast link: the dense allreduce wins as soon as compute is counted
    fast = CostParams(alpha=1e-6, beta=1e-12, gamma=0.0)
    work = ComputeParams(select=1e-8, merge=1e-7, scatter=1e-9, flop=1e-10, copy=1e-10)
    assert select(shapes, 0.01, 4, 8, fast, work).scheme == "dense"
    # expensive merges rule gTop-k out where bytes alone would pick it
    bytes_only = select(shapes, 0.01, 4, 8, slow, ZERO, schemes=("gtopk", "allgather_topk"))
    assert bytes_only.scheme == "gtopk"
    merges = ComputeParams(select=0, merge=1e-5, scatter=0, flop=0, copy=0)
    assert select(shapes, 0.01, 4, 8, slow, merges,
                  schemes=("gtopk", "allgather_topk")).scheme == "allgather_topk"
    # accuracy constraint: no approximate aggregation
    assert "gtopk" not in select(shapes, 0.01, 4, 8, slow, ZERO, approximate=False).candidates
    assert select(shapes, 1.0, 4, 8, slow, ZERO).scheme == "dense"
    with pytest.raises(ValueError, match="schemes"):
        select(shapes, 0.01, 4, 8, slow, ZERO, schemes=("nope",))


# ---------------------------------------------------------------------- multi-rank
@pytest.mark.mpi
def test_calibrate_gives_every_rank_the_same_numbers_and_dup_keeps_them(comm):
    from mpicomm.strategies.kernel_timing import calibrate

    saved = {k: comm.resources.pop(k) for k in CALIBRATION_KEYS if k in comm.resources}
    try:
        params, compute, links = calibrate(comm, links=2, sizes=(8, 4096, 1 << 15),
                                           repeats=2, compute_numel=1 << 14)
        assert comm.allgather_object((params, compute, links)) == \
            [(params, compute, links)] * comm.size
        assert len(links) == min(2, comm.size - 1)
        assert compute.select > 0 and compute.merge > 0
        dup = comm.dup()
        try:
            assert dup.resources["cost_params"] is params
            assert dup.resources["compute_params"] is compute
        finally:
            dup.free()
        half = comm.split(comm.rank % 2)
        try:
            assert half.resources["cost_params"] is params
        finally:
            half.free()
    finally:
        for k in CALIBRATION_KEYS:
            comm.resources.pop(k, None)
        comm.resources.update(saved)
