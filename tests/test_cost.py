"""The alpha-beta-gamma cost model: formulas, selection, and the paper's Table VI.

Serial, except for one multi-rank check that ``algorithm="auto"`` really runs the
algorithm the model picks (observed through the bytes it moves).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import mpicomm
from mpicomm.collectives import ALGORITHMS, calibrate, cost
from mpicomm.collectives.cost import FORMULAS, CostParams, choose, paper_predict, predict
from mpicomm.p2p import fold_layout

ALPHA = CostParams(alpha=1.0, beta=0.0, gamma=0.0)  # counts messages on the critical path
BETA = CostParams(alpha=0.0, beta=1.0, gamma=0.0)  # counts bytes on the critical path
GAMMA = CostParams(alpha=0.0, beta=0.0, gamma=1.0)  # counts bytes reduced


def terms(fn, n: float, p: int) -> tuple[float, float, float]:
    """A formula split into its (alpha, beta, gamma) coefficients."""
    return fn(n, p, ALPHA), fn(n, p, BETA), fn(n, p, GAMMA)


# ---------------------------------------------------------------------- formulas
@pytest.mark.parametrize(("collective", "algorithm"),
                         [(c, a) for c, table in FORMULAS.items() for a in table])
def test_one_rank_costs_nothing(collective, algorithm):
    assert FORMULAS[collective][algorithm](1e6, 1, CostParams()) == 0.0


@pytest.mark.parametrize(("collective", "algorithm"),
                         [(c, a) for c, table in FORMULAS.items() for a in table])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 13])
def test_costs_are_positive_and_grow_with_size(collective, algorithm, p):
    fn, c = FORMULAS[collective][algorithm], CostParams()
    small, large = fn(1e3, p, c), fn(1e6, p, c)
    assert 0 < small < large
    assert fn(0, p, c) == pytest.approx(fn(0, p, ALPHA) * c.alpha)


@pytest.mark.parametrize(("collective", "algorithm", "p", "n", "expected"), [
    # (alpha count, beta bytes, gamma bytes) per the Thakur-Rabenseifner-Gropp forms
    ("allreduce", "ring", 4, 1000, (6, 1500, 750)),
    ("allreduce", "ring", 5, 1000, (8, 1600, 800)),
    ("allreduce", "recursive_doubling", 4, 1000, (2, 2000, 2000)),
    ("allreduce", "recursive_doubling", 5, 1000, (3, 4000, 3000)),   # + fold α 2nβ nγ
    ("allreduce", "recursive_doubling", 7, 1000, (4, 4000, 3000)),   # + fold 2α 2nβ nγ
    ("allreduce", "rabenseifner", 4, 1000, (4, 1500, 750)),
    ("allreduce", "rabenseifner", 6, 1000, (6, 3500, 1750)),         # p2 = 4, + fold
    ("allgather", "ring", 4, 1000, (3, 750, 0)),
    ("allgather", "bruck", 5, 1000, (3, 800, 1200)),                 # + its two copies
    ("allgather", "recursive_doubling", 4, 1000, (2, 750, 0)),
    ("allgather", "direct", 4, 1000, (3, 750, 0)),                    # as ring, one-port
    ("allgather", "recursive_doubling", 6, 1200, (4, 2400, 0)),      # 1000 + 200 + 1200
    ("allgatherv", "ring", 3, 900, (2, 600, 0)),
    ("broadcast", "binomial", 5, 1000, (3, 3000, 0)),
    ("broadcast", "binomial", 8, 1000, (3, 3000, 0)),
    ("broadcast", "scatter_allgather", 4, 1000, (5, 1500, 0)),
    ("reduce_scatter", "ring", 4, 1000, (3, 750, 750)),
    ("reduce_scatter", "recursive_halving", 4, 1000, (2, 750, 750)),
    ("reduce_scatter", "direct", 4, 1000, (3, 750, 750)),
    ("reduce_scatter", "recursive_halving", 5, 1000, (4, 1950, 1750)),
])
def test_known_values(collective, algorithm, p, n, expected):
    got = terms(FORMULAS[collective][algorithm], n, p)
    assert got == pytest.approx(expected)


def test_ring_allreduce_at_four_ranks():
    c = CostParams(alpha=3e-6, beta=2e-10, gamma=5e-11)
    n = 1e6
    assert cost.allreduce_ring(n, 4, c) == pytest.approx(
        6 * c.alpha + 1.5 * n * c.beta + 0.75 * n * c.gamma)


def test_bandwidth_optimal_algorithms_meet_the_lower_bound():
    """Ring allreduce moves 2(p-1)/p·n and ring allgather (p-1)/p·n: the nccl-tests
    bus-bandwidth factors, i.e. the bandwidth lower bounds."""
    for p in (2, 3, 7, 16):
        assert cost.allreduce_ring(1.0, p, BETA) == pytest.approx(2 * (p - 1) / p)
        assert cost.allgather_ring(1.0, p, BETA) == pytest.approx((p - 1) / p)
        assert cost.reduce_scatter_ring(1.0, p, BETA) == pytest.approx((p - 1) / p)
        for algorithm, fn in FORMULAS["allreduce"].items():
            assert fn(1.0, p, BETA) >= 2 * (p - 1) / p - 1e-12, algorithm


def test_sparse_formulas():
    c = CostParams(alpha=1e-5, beta=1e-9, gamma=0.0)
    k, s = 1000, 8
    assert cost.topk_allgather(k, s, 4, c) == pytest.approx(3 * c.alpha + 3 * k * s * c.beta)
    assert cost.gtopk(k, s, 8, c) == pytest.approx(3 * (c.alpha + k * s * c.beta))
    # P = 6: the two folded virtual ranks differ in one bit, so the slowest path has
    # one latency less than the textbook fold's two
    assert cost.gtopk(k, s, 6, c) == pytest.approx(3 * c.alpha + 4 * k * s * c.beta)
    assert cost.gtopk(k, s, 7, c) == pytest.approx(4 * (c.alpha + k * s * c.beta))
    # P = 3: the unfolded rank sends at once; one latency less than the textbook fold
    assert cost.gtopk(k, s, 3, c) == pytest.approx(2 * c.alpha + 3 * k * s * c.beta)
    assert cost.gtopk(k, s, 1, c) == 0.0
    ring = cost.artopk_ring(k, 4, 4, 4, c)
    assert ring == pytest.approx(cost.broadcast_binomial(4 * k, 4, c)
                                 + cost.allreduce_ring(4 * k, 4, c))
    tree = cost.artopk_tree(k, 4, 4, 4, c)  # as mpicomm.sparse runs it: bcast + rec. doubling
    assert tree == pytest.approx(cost.broadcast_binomial(4 * k, 4, c)
                                 + cost.allreduce_recursive_doubling(4 * k, 4, c))
    assert terms(lambda n, p, cp: cost.artopk_tree(n, 4, 4, p, cp), k, 4)[0] == 2 + 2


# ---------------------------------------------------------------------- predict/choose
def test_predict_matches_formulas_and_mpi_is_the_best():
    c = CostParams()
    for collective, table in FORMULAS.items():
        for algorithm, fn in table.items():
            assert predict(collective, algorithm, 12345, 6, c) == fn(12345, 6, c)
        assert predict(collective, "mpi", 12345, 6, c) == min(
            fn(12345, 6, c) for fn in table.values())
    assert predict("allreduce", "ring", 1e6, 4) == cost.allreduce_ring(1e6, 4, CostParams())


def test_predict_rejects_unknown_names():
    with pytest.raises(ValueError, match="collective"):
        predict("alltoall", "ring", 10, 4)
    with pytest.raises(ValueError, match="algorithm"):
        predict("allreduce", "bruck", 10, 4)
    with pytest.raises(ValueError, match="collective"):
        choose("alltoall", 10, 4)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 12])
def test_choose_latency_vs_bandwidth(p):
    c = CostParams(alpha=10e-6, beta=1 / 10e9, gamma=1 / 20e9)
    assert choose("allreduce", 8, p, c) == "recursive_doubling"
    # blocks of one ring segment: the textbook choices. No Bruck (its local copies cost
    # more than the messages it saves); recursive doubling/halving on powers of two
    # (lg p < p - 1 messages, same bytes), ring otherwise
    one_segment = p * 512 * 1024
    assert choose("allreduce", one_segment, p, c) in ("ring", "rabenseifner")
    power_of_two = p == fold_layout(p)[0]
    assert choose("allgather", one_segment, p, c) == (
        "recursive_doubling" if power_of_two and p > 2 else "ring")
    assert choose("broadcast", 8, p, c) == "binomial"
    if p >= 3:
        assert choose("broadcast", 4e9, p, c) == "scatter_allgather"
    halving_wins = p > 2 and power_of_two
    if p > 2:  # (at p = 2 both are one exchange)
        assert choose("reduce_scatter", one_segment, p, c) == (
            "recursive_halving" if halving_wins else "ring")
    # blocks of many segments: the ring pipelines, paying about one latency per pass and
    # hiding its reductions behind the transfers, and wins every bandwidth-bound case
    for collective in ("allreduce", "allgather", "reduce_scatter"):
        assert choose(collective, 4e9, p, c) == "ring", collective


def test_choose_prefers_rabenseifner_on_powers_of_two_and_ring_otherwise():
    c = CostParams(alpha=10e-6, beta=1 / 10e9, gamma=1 / 20e9)
    n = 4 * 512 * 1024      # ring blocks of one segment
    assert choose("allreduce", n, 4, c) == "rabenseifner"   # 4α < 6α, same bytes
    assert choose("allreduce", 5 * n / 4, 5, c) == "ring"   # the fold costs 2nβ
    assert choose("allgather", 8, 5, c) == "bruck"          # ⌈lg 5⌉ = 3 < 4 messages


def test_ring_pipelines_segments():
    """A block of m segments: the upload link never idles once the first segment has
    arrived, so a bandwidth-bound pass pays the latency once (not p - 1 times) and the
    reduce-scatter's reductions hide behind the transfers but for the last segment."""
    c = CostParams(alpha=1e-3, beta=1e-8, gamma=1e-10)
    seg = float(mpicomm.config.ring_segment_bytes())
    p, block = 4, 8 * seg
    assert cost.ring_allgather_pass(block, p, c) == pytest.approx(
        c.alpha + (p - 1) * block * c.beta)
    assert cost.ring_reduce_scatter_pass(block, p, c) == pytest.approx(
        c.alpha + (p - 1) * block * c.beta + seg * c.gamma)
    assert cost.allreduce_ring(p * block, p, c) == pytest.approx(
        cost.ring_reduce_scatter_pass(block, p, c) + cost.ring_allgather_pass(block, p, c))
    # one segment per block: the textbook (p-1)(α + Bβ [+ Bγ])
    small = seg / 2
    assert cost.ring_allgather_pass(small, p, c) == pytest.approx(
        (p - 1) * (c.alpha + small * c.beta))
    assert cost.ring_reduce_scatter_pass(small, p, c) == pytest.approx(
        (p - 1) * (c.alpha + small * (c.beta + c.gamma)))


def _ring_events(block: float, p: int, c: CostParams, reduce: bool) -> float:
    """The segmented ring pass event by event, as the algorithm runs on every rank
    (symmetric: the left neighbour's k-th upload starts when this rank's does): a
    segment is reduced when it has arrived and the processor is free, and uploaded when
    reduced and the link is free; the pass ends at the last reduction or upload."""
    seg = mpicomm.config.ring_segment_bytes()
    sizes = [min(seg, block - a) for a in range(0, int(block), seg)]
    start, link, cpu = {}, 0.0, 0.0
    for j, size in enumerate(sizes):
        start[0, j], link = link, link + size * c.beta
    for step in range(1, p):
        for j, size in enumerate(sizes):
            cpu = max(cpu, start[step - 1, j] + c.alpha + size * c.beta)
            cpu += size * c.gamma if reduce else 0.0
            if step < p - 1:
                start[step, j] = max(cpu, link)
                link = start[step, j] + size * c.beta
    return max(cpu, link)


def _butterfly_events(p: int, a: float, b: float, g: float) -> float:
    """Fold-in, exchanges, fold-out as ``allreduce(algorithm="recursive_doubling")`` runs
    them: an exchange ends at max(own time, partner's time + a) + b + g."""
    p2, rem = fold_layout(p)
    t = [a + b + g if v < rem else 0.0 for v in range(p2)]
    mask = 1
    while mask < p2:
        t = [max(t[v], t[v ^ mask] + a) + b + g for v in range(p2)]
        mask <<= 1
    return max([t[v] + a + b for v in range(rem)] + t[rem:])


def test_ring_and_butterfly_formulas_are_the_critical_path():
    rng = np.random.default_rng(7)
    seg = mpicomm.config.ring_segment_bytes()
    for _ in range(400):
        p = int(rng.integers(2, 20))
        block = float(rng.choice([rng.integers(1, 6 * seg), seg, 2 * seg + 1]))
        c = CostParams(*(10.0 ** rng.uniform(lo, hi) for lo, hi in
                         ((-7, -2), (-11, -7), (-12, -8))))
        assert cost.ring_reduce_scatter_pass(block, p, c) == pytest.approx(
            _ring_events(block, p, c, True), rel=1e-9)
        assert cost.ring_allgather_pass(block, p, c) == pytest.approx(
            _ring_events(block, p, c, False), rel=1e-9)
        a, b, g = c.alpha, block * c.beta, block * c.gamma
        assert cost.folded_butterfly(p, a, b, g) == pytest.approx(
            _butterfly_events(p, a, b, g), rel=1e-9)


def test_allgather_crossover_from_bruck_to_ring():
    """Bruck saves p - 1 - ⌈lg p⌉ messages but copies n + n/p bytes locally, so it wins
    only below n ≈ α·(p - 1 - ⌈lg p⌉) / ((1 + 1/p)·γ) (MPICH switches at 80 KiB)."""
    c = CostParams(alpha=2e-6, beta=1 / 10e9, gamma=1 / 30e9)
    p = 6
    crossover = c.alpha * (p - 1 - 3) / ((1 + 1 / p) * c.gamma)
    assert choose("allgather", 0.5 * crossover, p, c) == "bruck"
    assert choose("allgather", 2 * crossover, p, c) != "bruck"


def test_choose_uses_the_default_params():
    assert choose("allreduce", 8, 4) == "recursive_doubling"
    assert choose("allreduce", 1e9, 6) == "ring"


def test_choose_breaks_ties_by_listing_order():
    assert choose("allreduce", 1e6, 1, CostParams()) == "ring"
    assert choose("allgather", 1e6, 2, CostParams(beta=0, gamma=0)) == "ring"
    assert choose("allgatherv", 1e6, 5) == "ring"  # direct ties with the ring


# ---------------------------------------------------------------------- CostParams
@pytest.mark.parametrize("field", ["alpha", "beta", "gamma"])
@pytest.mark.parametrize("bad", [-1e-9, math.inf, math.nan, -math.inf])
def test_cost_params_reject_bad_values(field, bad):
    with pytest.raises(ValueError, match=field):
        CostParams(**{field: bad})


def test_cost_params_are_frozen_and_accept_zero():
    c = CostParams(alpha=0.0, beta=0.0, gamma=0.0)
    assert predict("allreduce", "ring", 1e9, 8, c) == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.alpha = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------- Table VI
GBPS = 1.25e8  # bytes per second per Gbit/s
PARAMS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "alexnet": 61_100_840}

# (model, Gbit/s, c, (AG, ART-Ring, ART-Tree) in ms), Table VI of Tyagi & Swany 2023.
TABLE_VI = [
    ("resnet18", 10, 0.1, (54.0, 35.0, 43.2)),
    ("resnet18", 10, 0.01, (7.66, 18.1, 12.2)),
    ("resnet18", 10, 0.001, (3.28, 16.7, 9.0)),
    ("resnet18", 1, 0.1, (526.3, 194.7, 345.6)),
    ("resnet18", 1, 0.001, (8.86, 19.5, 12.8)),
    ("alexnet", 1, 0.1, (2718.7, 964.4, 1778.0)),
    ("alexnet", 1, 0.001, (31.33, 27.0, 27.3)),
    ("resnet50", 5, 0.1, (232.0, 94.7, 156.2)),
]
# Rows the model does not reproduce within 3%: the same product M·c·β appears as
# ResNet-18 @10 Gbps c=0.01 (AG 7.66) and @1 Gbps c=0.001 (AG 8.86), and any formula
# gives one value (8.24) for both, so the table scatters about ±7.5% around the model
# in its small-c rows (AlexNet c=0.001 is off by 3.05%). Those rows are checked at 8%;
# the bandwidth-dominated c=0.1 rows match within 2.6% (ResNet-50's exactly).
LOOSE = {("resnet18", 10, 0.01), ("resnet18", 10, 0.001), ("resnet18", 1, 0.001),
         ("alexnet", 1, 0.001)}


def paper_row(model: str, gbps: float, c: float) -> tuple[float, float, float]:
    M, beta, alpha, n = 4 * PARAMS[model], 1 / (gbps * GBPS), 1e-3, 8
    return tuple(1e3 * paper_predict(s, M, n, alpha, beta, cr=c)
                 for s in ("allgather_topk", "artopk_ring", "artopk_tree"))


@pytest.mark.parametrize(("model", "gbps", "c", "table"), TABLE_VI,
                         ids=[f"{m}-{g}G-c{c}" for m, g, c, _ in TABLE_VI])
def test_paper_table_vi(model, gbps, c, table):
    got = paper_row(model, gbps, c)
    rel = 0.08 if (model, gbps, c) in LOOSE else 0.03
    assert got == pytest.approx(table, rel=rel)
    # the model picks the same collective as the table
    assert int(np.argmin(got)) == int(np.argmin(table))


def test_paper_resnet50_row_is_exact():
    assert paper_row("resnet50", 5, 0.1) == pytest.approx((232.0, 94.7, 156.2), abs=0.05)


def test_paper_formulas_agree_with_the_library_formulas():
    """The paper's Ring-AR term is the library's ring allreduce; its broadcast is binomial."""
    n, p, alpha, beta = 8, 8, 1e-3, 1e-9
    c = CostParams(alpha=alpha, beta=beta, gamma=0.0)
    M, ratio = 4e6, 0.01
    bcast = cost.broadcast_binomial(M * ratio, p, c)
    assert paper_predict("artopk_ring", M, n, alpha, beta, cr=ratio) == pytest.approx(
        bcast + cost.allreduce_ring(M * ratio, p, c))


# ---------------------------------------------------------------------- auto (multi-rank)
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("params", "expected"), [
    (CostParams(alpha=1.0, beta=0.0, gamma=0.0), "recursive_doubling"),
    (CostParams(alpha=0.0, beta=1.0, gamma=1.0), None),  # ring or rabenseifner
])
def test_auto_runs_the_algorithm_the_model_picks(comm, params, expected):
    """With ``comm.resources["cost_params"]`` set, ``auto`` follows :func:`choose`; the
    bytes a rank sends tell which algorithm ran."""
    p, n = comm.size, 4 * comm.size
    picked = choose("allreduce", 4 * n, p, params)
    if expected is not None:
        assert picked == expected
    saved = comm.resources.get("cost_params")
    comm.resources["cost_params"] = params
    try:
        x = np.ones(n, np.float32)
        before = comm.traffic.snapshot()
        result = mpicomm.allreduce(x, comm=comm)
        auto = comm.traffic.snapshot() - before
        before = comm.traffic.snapshot()
        mpicomm.allreduce(x, algorithm=picked, comm=comm)
        explicit = comm.traffic.snapshot() - before
    finally:
        if saved is None:
            comm.resources.pop("cost_params", None)
        else:
            comm.resources["cost_params"] = saved
    np.testing.assert_array_equal(result, np.full(n, p, np.float32))
    assert picked in ALGORITHMS["allreduce"]
    assert auto == explicit  # bytes *and* message counts (ring and Rabenseifner differ)


# ---------------------------------------------------------------------- calibration
def test_fit_alpha_beta_recovers_a_line():
    sizes = [8, 1024, 65536, 1 << 20]
    alpha, beta = calibrate.fit_alpha_beta(sizes, [3e-6 + n * 2e-10 for n in sizes])
    assert alpha == pytest.approx(3e-6, rel=1e-6)
    assert beta == pytest.approx(2e-10, rel=1e-6)


def test_fit_alpha_beta_never_goes_negative():
    # a falling curve (pure noise) cannot give a negative bandwidth term
    alpha, beta = calibrate.fit_alpha_beta([8, 1024, 4096], [5e-6, 4e-6, 3e-6])
    assert alpha >= 0 and beta >= 0
    CostParams(alpha=alpha, beta=beta)  # valid parameters
    with pytest.raises(ValueError, match="two sizes"):
        calibrate.fit_alpha_beta([8], [1e-6])
    with pytest.raises(ValueError):
        calibrate.fit_alpha_beta([8, 16], [1e-6, 0.0])


def test_pingpong_and_measure_check_their_arguments():
    from mpicomm.comm import init

    comm = init()
    with pytest.raises(ValueError, match="peer"):
        calibrate.pingpong(comm, 8, peer=0)
    with pytest.raises(ValueError, match="peer"):
        calibrate.pingpong(comm, 8, peer=1, origin=1)
    with pytest.raises(ValueError, match="links"):
        calibrate.measure(comm, links=0)


@pytest.mark.mpi
def test_measure_links_adds_a_one_way_transfer_per_link(comm):
    """``oneway_bytes``: one large transfer per link answered by the smallest size, one
    more point of the fit; bad values are refused on every rank before any message."""
    with pytest.raises(ValueError, match="oneway_bytes"):
        calibrate.measure_links(comm, links=1, sizes=(8, 4096), oneway_bytes=-1)
    with pytest.raises(ValueError, match="oneway_bytes"):
        calibrate.measure_links(comm, links=1, sizes=(8, 4096), oneway_bytes=True)
    found = calibrate.measure_links(comm, links=2, sizes=(8, 4096), repeats=2,
                                    oneway_bytes=1 << 18)
    assert comm.allgather_object(found) == [found] * comm.size
    rounds = calibrate.link_rounds(comm.allgather_object(comm.node), 2)
    assert [(lk.a, lk.b) for lk in found] == [pair for pairs in rounds for pair in pairs]
    assert all(lk.alpha >= 0 and lk.beta >= 0 for lk in found)
    if comm.size > 1 and comm.rank in (0, 1):
        # the reply's own time is subtracted (clamped at 0); an echo is halved
        small = calibrate.pingpong(comm, 1 << 16, 2, peer=1, reply_bytes=8, reply_s=0.0)
        none = calibrate.pingpong(comm, 1 << 16, 2, peer=1, reply_bytes=8, reply_s=60.0)
        if comm.rank == 0:
            assert small > 0 and none == 0.0
    if comm.size > 3 and comm.rank in (2, 3):  # another pair, its own origin
        got = calibrate.pingpong(comm, 64, 2, peer=3, origin=2)
        assert (got > 0) == (comm.rank == 2)
    comm.barrier()


@pytest.mark.mpi
def test_measure_links_leaves_out_a_one_way_point_lost_in_noise(comm, monkeypatch):
    """A one-way transfer timed at 0 (round trip minus the small messages' median
    one-way time, on a loaded host) is no point of the fit: the link is fitted from the
    ping-pongs, on every rank alike, instead of failing the job."""
    real = calibrate.pingpong

    def noisy(*args, **kwargs):
        t = real(*args, **kwargs)  # the messages still go both ways
        return 0.0 if kwargs.get("reply_bytes") is not None else t

    monkeypatch.setattr(calibrate, "pingpong", noisy)
    found = calibrate.measure_links(comm, links=2, sizes=(8, 4096), repeats=2,
                                    oneway_bytes=1 << 16)
    rounds = calibrate.link_rounds(comm.allgather_object(comm.node), 2)
    assert [(lk.a, lk.b) for lk in found] == [pair for pairs in rounds for pair in pairs]
    assert all(lk.alpha >= 0 and lk.beta >= 0 for lk in found)
    assert comm.allgather_object(found) == [found] * comm.size


def test_measure_gamma_is_a_plausible_memory_rate():
    gamma = calibrate.measure_gamma(1 << 20, repeats=3)
    assert 1 / 1e12 < gamma < 1 / 1e7  # between 10 MB/s and 1 TB/s


@pytest.mark.mpi
def test_measure_gives_every_rank_the_same_params(comm):
    saved = comm.resources.pop("cost_params", None)
    try:
        params = calibrate.measure(comm, sizes=(8, 4096, 1 << 16), repeats=3, store=True)
        assert comm.resources["cost_params"] is params
        # several links (not only ranks 0 and 1), the slowest one's alpha and beta
        found = calibrate.measure_links(comm, links=2, sizes=(8, 4096), repeats=2)
        assert [lk.b for lk in found] == calibrate.choose_peers(
            comm.allgather_object(comm.node), 2)
        assert calibrate.slowest(found, 1.0).beta == max(
            [lk.beta for lk in found], default=CostParams().beta)
        assert comm.allgather_object(params) == [params] * comm.size
        assert params.gamma > 0
        if comm.size == 1:  # no link to measure: the defaults stay
            assert (params.alpha, params.beta) == (CostParams().alpha, CostParams().beta)
        else:
            assert params.alpha + 4096 * params.beta > 0
    finally:
        comm.resources.pop("cost_params", None)
        if saved is not None:
            comm.resources["cost_params"] = saved
