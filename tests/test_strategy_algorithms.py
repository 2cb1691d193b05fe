"""mpicomm.strategies, algorithm by algorithm, at every rank count of the suite
(``@pytest.mark.mpi``). Each rank generates *every* rank's gradients from a seed
(tests/strategy_cases.py), so it can replay the algorithms (PowerSGD, gTop-k, AR-Top-k,
Top-k S-SGD, random-k, QSGD, as their papers state them) for all ranks in numpy and
compare with what the distributed strategy returned and kept as residual. Byte counts
come from ``strategy.stats`` (the communicator's traffic counters) and are compared with
closed forms written here, independently of the implementation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpicomm.compress import QSGD, RandomK
from mpicomm.compress.topk_select import topk_indices
from mpicomm.sparse import reference as ref
from mpicomm.strategies import (
    ARTopK,
    BF16Allreduce,
    Dense,
    FP16Allreduce,
    GTopK,
    PowerSGDAllreduce,
    QSGDAllgather,
    RandomKAllreduce,
    SignAllgather,
    Strategy,
    TopKAllgather,
)

from .strategy_cases import FACTORIES, as_numpy, flat, grads
from .traffic_forms import (
    binomial_fanout,
    doubling_allreduce_bytes,
    doubling_messages,
    ring_allreduce_bytes,
)

if MPI.COMM_WORLD.Get_size() > 1:
    torch.set_num_threads(1)  # several ranks share few cores


# ---------------------------------------------------------------------- helpers


def run(strategy: Strategy, comm, tensors: list[Any], names: list[str] | None = None
        ) -> tuple[list[Any], int]:
    """(results, bytes this rank sent) of one aggregation; checks the two counters agree."""
    before_stats, before = strategy.stats.sent_bytes, comm.traffic.snapshot()
    out = strategy.aggregate(tensors, names)
    sent = strategy.stats.sent_bytes - before_stats
    assert sent == (comm.traffic - before).sent_bytes
    return out, sent


# ---------------------------------------------------------------------- PowerSGD
def low_rank(p: int, seed: int, n: int, m: int, r: int) -> list[np.ndarray]:
    """Every rank's n x m gradient of rank <= r, all sharing one column space."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((n, r))
    return [u @ np.random.default_rng(seed * 31 + i).standard_normal((r, m))
            for i in range(p)]


@pytest.mark.mpi
@pytest.mark.parametrize("r", [1, 2])
def test_powersgd_is_exact_when_rank_covers_the_gradients(comm, r):
    strategy = PowerSGDAllreduce(rank=r).bind(comm)
    n, m = 16, 12
    bias_all = grads(comm.size, 40, [(n,)])
    for step in range(3):  # warm start: Q from the previous step's (different) space
        mats = low_rank(comm.size, 50 + step, n, m, r)
        out = strategy.aggregate([torch.from_numpy(mats[comm.rank]),
                                  torch.from_numpy(bias_all[comm.rank][0])], ["w", "b"])
        np.testing.assert_allclose(out[0].numpy(), np.mean(mats, axis=0), rtol=1e-10,
                                   atol=1e-10)
        np.testing.assert_allclose(out[1].numpy(), np.mean([b[0] for b in bias_all], axis=0),
                                   rtol=1e-12, atol=1e-12)
        assert strategy.stats.extra["compressed_tensors"] == 1
        # each rank keeps M_i - mean (torch's hook): nothing is lost over all ranks
        res = comm.allgather_object(strategy.residual("w").numpy())
        np.testing.assert_allclose(np.sum(res, axis=0), 0.0, atol=1e-9)
    # the control: a full-rank mean is *not* reproduced by a rank-r approximation
    full = grads(comm.size, 60, [(n, m)])
    out = strategy.aggregate([torch.from_numpy(full[comm.rank][0]),
                              torch.from_numpy(bias_all[comm.rank][0])], ["w", "b"])
    assert not np.allclose(out[0].numpy(), np.mean([f[0] for f in full], axis=0), atol=1e-3)


@pytest.mark.mpi
def test_powersgd_start_iter_is_dense_then_compressed(comm):
    strategy = PowerSGDAllreduce(rank=1, start_iter=2).bind(comm)
    shapes = [(16, 12), (12,)]
    for step in range(3):
        everyone = grads(comm.size, 70 + step, shapes)
        out = strategy.aggregate([torch.from_numpy(a) for a in everyone[comm.rank]],
                                 ["w", "b"])
        exact = np.allclose(flat(out), np.mean([flat(g) for g in everyone], axis=0),
                            rtol=1e-12, atol=1e-12)
        assert exact == (step < 2), step
        assert (strategy.memory is not None and "w" in strategy.memory) == (step >= 2)


@pytest.mark.mpi
def test_powersgd_error_feedback_uses_the_global_approximation(comm):
    strategy = PowerSGDAllreduce(rank=1).bind(comm)
    shapes = [(16, 12), (8, 30), (12,)]
    names = ["w", "v", "b"]
    residual = [np.zeros(s) for s in shapes[:2]]
    applied = np.zeros(sum(math.prod(s) for s in shapes))
    total = np.zeros_like(applied)
    for step in range(4):
        everyone = grads(comm.size, 80 + step, shapes)
        mine = everyone[comm.rank]
        out = strategy.aggregate([torch.from_numpy(a) for a in mine], names)
        for j in range(2):  # compressed tensors: e = (g + e_prev) - U, U the global approx
            want = (mine[j] + residual[j]) - out[j].numpy()
            got = strategy.residual(names[j]).numpy()
            np.testing.assert_array_equal(got, want)
            residual[j] = got
        applied += flat(out)
        total += np.mean([flat(g) for g in everyone], axis=0)
    # conservation over ranks: sum_t u_t + mean_r e_r == mean_r sum_t g_r
    mean_res = np.mean(comm.allgather_object(flat(residual + [np.zeros(12)])), axis=0)
    np.testing.assert_allclose(applied + mean_res, total, rtol=1e-11, atol=1e-11)


# ---------------------------------------------------------------------- error feedback
def simulate(which: str, p: int, steps: list[list[np.ndarray]], k: int, name: str,
             smoothing: float = 0.1) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Replay a sparsifying EF strategy for all ranks: (updates per step, final residuals).

    ``steps[t][r]`` is rank r's flat gradient at step t. Independent of the strategies'
    code: top-k by :func:`mpicomm.compress.topk_select.topk_indices`, gTop-k by the numpy reference
    simulator, random indices by the compressor :class:`mpicomm.compress.RandomK`.
    """
    d = steps[0][0].shape[0]
    e = [np.zeros(d) for _ in range(p)]
    ewma: list[float | None] = [None] * p
    updates = []
    for t, gs in enumerate(steps):
        c = [gs[r] + e[r] for r in range(p)]
        u = np.zeros(d)
        if which == "topk":
            picks = [topk_indices(c[r], k) for r in range(p)]
            u = ref.scatter_add([(i, c[r][i]) for r, i in enumerate(picks)], d, op="avg")
            for r in range(p):
                e[r] = c[r].copy()
                e[r][picks[r]] = 0
        elif which == "gtopk":
            picks = [topk_indices(c[r], k) for r in range(p)]
            idx, val = ref.simulate_gtopk([(i, c[r][i]) for r, i in enumerate(picks)], k)
            u[idx] = val / p
            for r in range(p):
                e[r] = c[r].copy()
                e[r][np.intersect1d(picks[r], idx)] = 0  # survivors only (A.3 put-back)
        else:
            if which == "randomk":
                idx = RandomK(k=k, seed=3).indices(d, name=name, step=t).numpy()
            elif which == "gtopk-exact":  # gTop-k's index set, every rank's own values
                picks = [topk_indices(c[r], k) for r in range(p)]
                idx = ref.simulate_gtopk([(i, c[r][i]) for r, i in enumerate(picks)], k)[0]
            else:
                if which == "artopk":
                    src = t % p
                elif which == "largest":  # argmax of the error-fed vectors' norms
                    src = int(np.argmax([np.linalg.norm(x) for x in c]))
                else:  # artopk-var: argmax of the EWMA of the raw gradient norm
                    for r in range(p):
                        norm = float(np.linalg.norm(gs[r]))
                        ewma[r] = norm if ewma[r] is None else (
                            (1 - smoothing) * ewma[r] + smoothing * norm)
                    src = int(np.argmax(ewma))
                idx = topk_indices(c[src], k)
            u[idx] = np.mean([c[r][idx] for r in range(p)], axis=0)
            for r in range(p):
                e[r] = c[r].copy()
                e[r][idx] = 0
        updates.append(u)
    return updates, e


EF_SPARSE = {
    "topk": lambda k: TopKAllgather(k=k),
    "gtopk": lambda k: GTopK(k=k, own_contribution=False),  # the replay: the paper's rule
    "gtopk-exact": lambda k: GTopK(k=k, exact_values=True),
    "artopk": lambda k: ARTopK(k=k),
    "artopk-var": lambda k: ARTopK(k=k, source="var"),
    "artopk-largest": lambda k: ARTopK(k=k, source="largest"),
    "randomk": lambda k: RandomKAllreduce(k=k, seed=3),
}


@pytest.mark.mpi
@pytest.mark.parametrize("which", list(EF_SPARSE))
def test_sparse_error_feedback_matches_the_algorithm(comm, which):
    p, k, shapes, names = comm.size, 5, [(7, 5), (13,)], ["w", "b"]
    strategy = EF_SPARSE[which](k).bind(comm)
    T = 2 * p + 1  # every AR-Top-k source gets a turn (twice)
    per_step = [grads(p, 100 + t, shapes) for t in range(T)]
    updates, residuals = simulate(which.replace("artopk-", ""), p,
                                  [[flat(g) for g in step] for step in per_step], k, "w..b")
    sent_total = np.zeros(48)
    for t in range(T):
        mine = per_step[t][comm.rank]
        c = flat(mine) + (strategy.residual("w..b").numpy() if t else 0.0)
        out = strategy.aggregate([torch.from_numpy(a) for a in mine], names)
        if which in ("topk", "gtopk"):  # same operations in the same order: same bits
            np.testing.assert_array_equal(flat(out), updates[t])
        else:  # allreduce sums in ring order, the replay in rank order
            np.testing.assert_allclose(flat(out), updates[t], rtol=1e-12, atol=1e-12)
        e = strategy.residual("w..b").numpy()
        sent = c - e
        # each entry is either sent unchanged (residual 0) or kept (nothing sent)
        assert np.all((e == 0) | (sent == 0))
        assert np.count_nonzero(e == 0) >= k or which == "gtopk"
        sent_total += sent
    np.testing.assert_array_equal(strategy.residual("w..b").numpy(), residuals[comm.rank])
    # per rank: sum over steps of what this rank sent + its residual == sum of its inputs
    mine_total = np.sum([flat(per_step[t][comm.rank]) for t in range(T)], axis=0)
    np.testing.assert_allclose(sent_total + residuals[comm.rank], mine_total, rtol=1e-12,
                               atol=1e-12)
    if which != "gtopk":
        # over ranks: P * sum_t u_t + sum_r e_r == sum_r sum_t g_r (exact mass conservation)
        total = np.sum([flat(g) for step in per_step for g in step], axis=0)
        np.testing.assert_allclose(p * np.sum(updates, axis=0) + np.sum(residuals, axis=0),
                                   total, rtol=1e-11, atol=1e-11)


@pytest.mark.mpi
def test_gtopk_residual_put_back(comm):
    """A.3: compensated == residual + (this rank's local picks that survived globally);
    picks dropped by the global selection stay in the residual."""
    p, k, d = comm.size, 4, 40
    strategy = GTopK(k=k, own_contribution=False).bind(comm)
    e_prev = np.zeros(d)
    saw_dropped = False
    for t in range(6):
        everyone = [flat(g) for g in grads(p, 200 + t, [(d,)])]
        g = everyone[comm.rank]
        c = g + e_prev
        u = strategy.aggregate([torch.from_numpy(g)], ["x"])[0].numpy()
        e = strategy.residual("x").numpy()
        picks = topk_indices(c, k)
        survived = picks[u[picks] != 0]
        dropped = np.setdiff1d(picks, survived)
        expect = c.copy()
        expect[survived] = 0
        np.testing.assert_array_equal(e, expect)
        np.testing.assert_array_equal(e[dropped], c[dropped])  # put back
        assert np.count_nonzero(u) <= k
        saw_dropped |= comm.allreduce_value(int(dropped.size)) > 0
        e_prev = e
    assert saw_dropped == (p > 1)  # with several ranks some local picks lose


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["topk-sampled", "qsgd-ef", "powersgd", "sign",
                                   "artopk-var-tree", "hier_topk", "hier_gtopk-sliced"])
def test_error_feedback_conserves_mass(comm, which):
    """P·Σ_t u_t + Σ_r e_r == Σ_r Σ_t g_r for every strategy whose update is the mean of
    what the ranks sent (all error-fed ones but gTop-k)."""
    strategy = FACTORIES[which]().bind(comm)
    shapes = [(16, 12), (12,)]
    names = ["w", "b"]
    applied, total = np.zeros(204), np.zeros(204)
    for step in range(4):
        everyone = grads(comm.size, 300 + step, shapes)
        out = strategy.aggregate([torch.from_numpy(a) for a in everyone[comm.rank]], names)
        applied += flat(out)
        total += np.sum([flat(g) for g in everyone], axis=0)
    memory = strategy.memory
    assert memory is not None
    if "w..b" in memory:  # fused buffer
        res = flat([memory.residual("w..b")])
    else:  # per tensor (PowerSGD keeps none for the dense bias)
        res = flat([memory.residual(n) if n in memory else np.zeros(s)
                    for n, s in zip(names, shapes)])
    res_sum = np.sum(comm.allgather_object(res), axis=0)
    np.testing.assert_allclose(comm.size * applied + res_sum, total, rtol=1e-10, atol=1e-10)
    assert np.abs(res_sum).max() > 0  # compression did leave something behind


@pytest.mark.mpi
def test_no_error_feedback_keeps_no_memory(comm):
    strategy = GTopK(k=2, error_feedback=False).bind(comm)
    g = grads(comm.size, 5, [(20,)])
    out1 = strategy.aggregate([torch.from_numpy(g[comm.rank][0])], ["x"])[0]
    out2 = strategy.aggregate([torch.from_numpy(g[comm.rank][0])], ["x"])[0]
    assert torch.equal(out1, out2)  # nothing carried over
    assert strategy.state_dict()["residuals"] == {}


# ---------------------------------------------------------------------- QSGD
@pytest.mark.mpi
def test_qsgd_averages_independently_rounded_payloads(comm):
    p, bits_, bucket = comm.size, 3, 32
    strategy = QSGDAllgather(bits=bits_, bucket_size=bucket, seed=7).bind(comm)
    same = grads(1, 400, [(100,)])[0][0]  # the same input on every rank
    for step in range(2):
        out = strategy.aggregate([torch.from_numpy(same)], ["x"])[0].numpy()
        decoded = []
        for r in range(p):
            q = QSGD(bits_, bucket, 7, salt=r)
            decoded.append(as_numpy(q.decompress(q.compress(torch.from_numpy(same), name="x",
                                                            step=step))))
        acc = np.zeros(100)
        for dec in decoded:
            acc += dec
        np.testing.assert_array_equal(out, acc / p if p > 1 else acc)
        if p > 1:  # ranks round independently (salt = rank), so their decodings differ
            assert any(not np.array_equal(decoded[0], dec) for dec in decoded[1:])


# ---------------------------------------------------------------------- bytes
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bytes_match_the_formulas(comm, dtype):
    p, r = comm.size, comm.rank
    v = 4 if dtype == "float32" else 8
    shapes = [(40, 25), (30,), (6, 5)]
    d = 1000 + 30 + 30
    density = 0.05
    k = math.ceil(density * d)  # 53
    names = ["w", "b", "s"]
    everyone = grads(p, 500, shapes, dtype)
    mine = [torch.from_numpy(a) for a in everyone[r]]

    def bytes_of(strategy: Strategy, calls: int = 1) -> list[int]:
        strategy.bind(comm)
        return [run(strategy, comm, mine, names)[1] for _ in range(calls)]

    assert bytes_of(TopKAllgather(density=density)) == [(p - 1) * k * (4 + v)]
    assert bytes_of(GTopK(density=density), 2) == [doubling_messages(r, p) * k * (4 + v)] * 2
    assert bytes_of(GTopK(density=density, exact_values=True), 2) == [
        doubling_messages(r, p) * k * (4 + v) + ring_allreduce_bytes(r, p, k, v)] * 2
    for algorithm in ("ring", "tree"):
        values = (ring_allreduce_bytes(r, p, k, v) if algorithm == "ring"
                  else doubling_allreduce_bytes(r, p, k, v))
        got = bytes_of(ARTopK(density=density, algorithm=algorithm), p + 1)
        assert got == [binomial_fanout(r, t % p, p) * k * 4 + values for t in range(p + 1)]
        for source in ("var", "largest"):  # + the norms' allgather
            chosen = ARTopK(density=density, source=source, algorithm=algorithm)
            got = bytes_of(chosen)[0]
            src = chosen.stats.extra["source"]["w..s"]
            assert got == binomial_fanout(r, src, p) * k * 4 + values + (p - 1) * 8
    assert bytes_of(RandomKAllreduce(density=density), 2) == [ring_allreduce_bytes(r, p, k, v)] * 2
    m = math.ceil(d * 5 / 8) + 4 * math.ceil(d / 64)
    assert bytes_of(QSGDAllgather(bits=4, bucket_size=64)) == [(p - 1) * m]
    # PowerSGD rank 2: (40, 25) is compressed ((40+25)*2*2 < 1000), (30,) and (6, 5) not
    w = 8 if dtype == "float64" else 4
    low = ring_allreduce_bytes(r, p, 40 * 2, w) + ring_allreduce_bytes(r, p, 25 * 2, w)
    powersgd = PowerSGDAllreduce(rank=2, start_iter=1)
    assert bytes_of(powersgd, 3) == [ring_allreduce_bytes(r, p, d, v)] + [
        low + ring_allreduce_bytes(r, p, 60, v)] * 2
    # two compressed matrices: their P factors share one allreduce, their Q factors one,
    # and the two dense tensors one (3 ring allreduces of 2(P-1) messages each)
    extra = grads(p, 501, [(20, 30)], dtype)[r][0]
    powersgd = PowerSGDAllreduce(rank=2).bind(comm)
    before = comm.traffic.snapshot()
    powersgd.aggregate([*mine, torch.from_numpy(extra)], [*names, "x"])
    moved = comm.traffic - before
    assert moved.sent_bytes == (ring_allreduce_bytes(r, p, (40 + 20) * 2, w)
                                + ring_allreduce_bytes(r, p, (25 + 30) * 2, w)
                                + ring_allreduce_bytes(r, p, 60, v))
    assert moved.messages == 3 * 2 * (p - 1)
    assert bytes_of(FP16Allreduce()) == [ring_allreduce_bytes(r, p, d, 2)]
    assert bytes_of(BF16Allreduce()) == [ring_allreduce_bytes(r, p, d, 2)]
    sign = (p - 1) * sum(math.ceil(math.prod(s) / 8) + 4 for s in shapes)
    assert bytes_of(SignAllgather()) == [sign]
    # dense for comparison: the strategy the compressed ones are measured against
    assert bytes_of(Dense(algorithm="ring")) == [ring_allreduce_bytes(r, p, d, v)]


@pytest.mark.mpi
def test_artopk_sources_rotate_per_buffer(comm):
    """Buffer b (in order of first appearance) at its t-th aggregation uses source
    (t + b) mod P: round-robin per buffer, the buffers of one step on different ranks."""
    strategy = ARTopK(k=2).bind(comm)
    g32 = torch.from_numpy(grads(comm.size, 600, [(10,)], "float32")[comm.rank][0])
    g64 = torch.from_numpy(grads(comm.size, 601, [(10,)])[comm.rank][0])
    for t in range(comm.size + 1):
        strategy.aggregate([g32, g64], ["a", "b"])  # two dtypes: two fused buffers
        assert strategy.stats.extra["source"] == {"a": t % comm.size,
                                                  "b": (t + 1) % comm.size}
