"""The ``log8`` wire format of sparse pairs: the codec, the coded sparse Allgather and
gTop-k butterfly, and Top-k's and gTop-k's ``coding`` options with error feedback.

Single-process tests check the codec against its definition; the ``mpi`` tests run at
any rank count and compare every rank's result with a numpy reference built from the
same quantized values, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpicomm import costtable, strategies
from mpicomm.compress import ErrorFeedback
from mpicomm.sparse import coding, gtopk, topk_allgather
from mpicomm.sparse import reference as ref


def _pairs(seed: int, size: int, k: int, dtype: torch.dtype = torch.float32
           ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(size, generator=gen)[:k]
    return idx, torch.randn(k, generator=gen, dtype=torch.float64).to(dtype)


def _definition(values: np.ndarray) -> np.ndarray:
    """The format's decoded values, from its definition (float64)."""
    v = values.astype(np.float64)
    scale = np.abs(v).max() if v.size else 0.0
    out = np.zeros_like(v)
    if scale == 0:
        return out
    nz = v != 0
    q = np.rint(-8 * np.log2(np.abs(v[nz]) / scale))
    out[nz] = np.where(q >= 127, 0.0, np.sign(v[nz]) * scale * np.exp2(-np.minimum(q, 126) / 8))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size,k", [(10, 10), (1000, 7), (105_738, 1_058), (1 << 20, 300)])
def test_round_trip_keeps_indices_and_decodes_the_defined_values(dtype, size, k):
    idx, val = _pairs(size + k, size, k, dtype)
    buf = coding.encode(idx, val)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    got_idx, got_val = coding.decode(buf, dtype)
    order = torch.argsort(idx)
    assert torch.equal(got_idx, idx[order].to(torch.int64))
    assert got_val.dtype == dtype
    np.testing.assert_allclose(got_val.numpy(), _definition(val[order].numpy()).astype(
        got_val.numpy().dtype), rtol=1e-12, atol=0)
    assert torch.equal(coding.quantize(val)[order], got_val)   # what the sender keeps
    # within range the relative error is at most 2^(1/16) - 1
    v = val[order].double()
    inside = v.abs() >= v.abs().max() * 2 ** (-126.5 / 8)
    rel = ((got_val.double() - v).abs() / v.abs())[inside]
    assert float(rel.max()) <= 2 ** (1 / 16) - 1 + 1e-12
    assert torch.equal(torch.sign(got_val[inside]), torch.sign(v[inside]).to(dtype))
    # size: 12 header bytes, one per value, the varints of the gaps
    gaps = np.diff(np.sort(idx.numpy()), prepend=0)
    varint = sum(max(1, math.ceil(int(g).bit_length() / 7)) for g in gaps)
    assert buf.shape[0] == 12 + k + varint
    assert coding.encode(idx, val).tolist() == buf.tolist()    # deterministic
    # the sender's one-pass form: the same message, and the values the receiver decodes
    msg, (sent_idx, sent_val) = coding.to_wire_as_read(idx, val, torch.int32, "log8")
    assert torch.equal(msg, buf) and sent_idx is idx
    assert torch.equal(sent_val, coding.quantize(val))
    plain, (same_idx, same_val) = coding.to_wire_as_read(idx, val, torch.int32, None)
    assert torch.equal(plain, coding.to_wire(idx, val, torch.int32, None))
    assert same_idx is idx and same_val is val


def test_edge_values_zero_tiny_large_indices_and_an_empty_message():
    idx = torch.tensor([2**62, 0, 1, 2**40, 7])
    val = torch.tensor([3.0, -1.0, 0.0, 3.0 * 2.0**-20, -3.0], dtype=torch.float64)
    got_idx, got_val = coding.decode(coding.encode(idx, val), torch.float64)
    assert got_idx.tolist() == [0, 1, 7, 2**40, 2**62]
    assert got_val[[2, 4]].tolist() == [-3.0, 3.0]          # the scale is exact
    assert got_val[1] == 0 and got_val[3] == 0               # zero, and below the range
    assert got_val[0] == pytest.approx(-1.0, rel=0.045)
    empty = coding.encode(torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    assert empty.shape[0] == 12
    i, v = coding.decode(empty, torch.float32)
    assert i.shape == v.shape == (0,)
    i, v = coding.decode(coding.encode(torch.tensor([5]), torch.tensor([0.0])), torch.float32)
    assert i.tolist() == [5] and v.tolist() == [0.0]
    bf = torch.tensor([1.5, -0.25], dtype=torch.bfloat16)   # no numpy dtype: goes via float64
    i, v = coding.decode(coding.encode(torch.tensor([3, 1]), bf), torch.bfloat16)
    assert i.tolist() == [1, 3] and torch.equal(v, coding.quantize(bf).flip(0))


def test_bad_coding_values_and_messages_are_clear_errors():
    with pytest.raises(ValueError, match="coding must be None or one of"):
        coding.check_coding("gzip")
    with pytest.raises(ValueError, match="finite"):
        coding.encode(torch.tensor([0, 1]), torch.tensor([1.0, float("nan")]))
    buf = coding.encode(*_pairs(0, 1000, 20))
    with pytest.raises(RuntimeError, match="shorter than its header"):
        coding.decode(buf[:5], torch.float32)
    with pytest.raises(RuntimeError, match="indices for a count"):
        coding.decode(buf[:-1], torch.float32)
    empty = coding.encode(torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    for tail in ([0x80], [0x05]):   # after an empty message: an unfinished varint, one more
        with pytest.raises(RuntimeError, match="for a count of 0"):
            coding.decode(torch.cat([empty, torch.tensor(tail, dtype=torch.uint8)]),
                          torch.float32)
    with pytest.raises(ValueError, match="coding must be None"):
        strategies.make("topk", coding="zip")


def test_expected_bytes_follow_the_mean_gap():
    assert coding.coded_bytes(0, 100) == 12
    assert coding.coded_bytes(1_000, 100_000) == 12 + 1_000 * 2      # gap 100: 1 byte
    assert coding.coded_bytes(100, 100_000) == 12 + 100 * 3          # gap 1 000: 2 bytes
    assert coding.coded_bytes(10, 10) == 12 + 10 * 2


def test_update_sparse_keeps_what_the_wire_lost():
    ef = ErrorFeedback()
    ef.track_sent = True
    c = torch.tensor([1.0, -2.0, 3.0, 0.5])
    sent = torch.tensor([-1.9, 3.1])
    ef.update_sparse("w", c.clone(), torch.tensor([1, 2]), sent=sent)
    residual = ef.residual("w")
    assert torch.equal(residual, torch.stack([c[0], c[1] - sent[0], c[2] - sent[1], c[3]]))
    assert float(ef.sent_sq("w")) == pytest.approx(1.9**2 + 3.1**2)
    with pytest.raises(ValueError, match="2 sent values for 1 indices"):
        ef.update_sparse("w", c.clone(), torch.tensor([1]), sent=sent)


def test_the_virtual_clock_has_the_coding_kernels_and_older_tables_charge_nothing():
    assert {"encode:log8", "decode:log8"} <= set(costtable.kernels())
    table = costtable.CostTable({})
    assert table.cost("encode:log8", 1000) == 0.0 and table.cost("decode:log8", 10) == 0.0


def test_topk_predicts_the_coded_bytes():
    plain = strategies.TopKAllgather(density=0.01)
    coded = strategies.TopKAllgather(density=0.01, coding="log8")
    assert coded.describe()["coding"] == "log8" and plain.describe()["coding"] is None
    n, k, p = 105_738, 1_058, 16
    assert plain._sparse_bytes(n, k, 4, p) == (p - 1) * k * 8
    assert coded._sparse_bytes(n, k, 4, p) == (p - 1) * coding.coded_bytes(k, n)


def test_gtopk_coding_needs_the_exact_values_and_predicts_its_bytes():
    with pytest.raises(ValueError, match="needs exact_values=True"):
        strategies.GTopK(density=0.01, coding="log8")
    with pytest.raises(ValueError, match="coding must be None"):
        strategies.GTopK(density=0.01, coding="zip", exact_values=True)
    coded = strategies.GTopK(density=0.01, coding="log8", exact_values=True)
    assert coded.describe()["coding"] == "log8"
    n, k = 105_738, 1_058
    for p, rounds in ((8, 3), (16, 4)):
        ring = 2 * (p - 1) / p * k * 4               # the exact values' ring allreduce
        assert coded._sparse_bytes(n, k, 4, p) == pytest.approx(
            rounds * coding.coded_bytes(k, n) + ring, rel=1e-6)


def test_the_coded_simulator_merges_decoded_sets():
    sets = [(np.array([1, 4, 9]), np.array([3.0, -1.1, 0.7])),
            (np.array([4, 9, 12]), np.array([1.3, 0.2, -2.9]))]
    idx, val = ref.simulate_gtopk(sets, 2, coding="log8")
    q = [coding.quantize(torch.from_numpy(v)).numpy() for _, v in sets]
    assert idx.tolist() == [1, 12]
    assert val.tolist() == [q[0][0], q[1][2]]
    assert ref.simulate_gtopk(sets, 2)[1].tolist() == [3.0, -2.9]


# ------------------------------------------------------------------------ several ranks
@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coded_allgather_sums_every_ranks_decoded_values(comm, op, dtype):
    size = 5_000
    sets = [_pairs(10 + r, size, 20 + 7 * r, dtype) for r in range(comm.size)]
    before = comm.traffic.snapshot()
    got = topk_allgather(*sets[comm.rank], size, op=op, comm=comm, coding="log8")
    moved = comm.traffic - before
    want = torch.zeros(size, dtype=dtype)
    for idx, val in sets:                       # rank order, as the collective adds
        want[idx] += coding.quantize(val)
    if op == "avg" and comm.size > 1:
        want /= comm.size
    assert got.dtype == dtype and torch.equal(got, want)
    right = (comm.rank + 1) % comm.size
    expected = sum(coding.encode(*s).shape[0] for r, s in enumerate(sets) if r != right)
    assert moved.sent_bytes == (expected if comm.size > 1 else 0)
    plain = sum((4 + dtype.itemsize) * s[0].shape[0] for r, s in enumerate(sets) if r != right)
    assert comm.size == 1 or moved.sent_bytes < plain / 2


@pytest.mark.mpi
def test_coded_allgather_refuses_bad_arguments_on_every_rank(comm):
    idx, val = _pairs(comm.rank, 100, 5)
    with pytest.raises(ValueError, match="coding must be None or one of"):
        topk_allgather(idx, val, 100, comm=comm, coding="zip")
    with pytest.raises(ValueError, match="allow_nonfinite"):
        topk_allgather(idx, val, 100, comm=comm, coding="log8", allow_nonfinite=True)
    if comm.size > 1:   # one rank asks for another format: refused everywhere
        with pytest.raises(ValueError, match="coding"):
            topk_allgather(idx, val, 100, comm=comm,
                           coding="log8" if comm.rank == 0 else None)
    assert topk_allgather(idx, val, 100, comm=comm, coding="log8").shape == (100,)


_SHAPES = [(30, 40), (300,)]


def _check_no_mass_lost(comm, strategy, seed: int, max_applied: int) -> None:
    """Four steps of random gradients: every rank applies the same update, of at most
    ``max_applied`` entries, and what was applied plus the residuals adds up to every
    gradient given (P·Σ_t u_t + Σ_r e_r = Σ_t Σ_r g_r,t)."""
    applied = np.zeros(1_500)
    total = np.zeros(1_500)
    for step in range(4):
        gs = [[torch.randn(s, dtype=torch.float64, generator=torch.Generator().manual_seed(
            seed * step + 7 * r + i)) for i, s in enumerate(_SHAPES)]
              for r in range(comm.size)]
        out = strategy.aggregate([g.clone() for g in gs[comm.rank]], ["w", "b"])
        flat = torch.cat([o.reshape(-1) for o in out]).numpy()
        everyone = comm.allgather_object(flat.tobytes())
        assert all(b == everyone[0] for b in everyone)
        assert np.count_nonzero(flat) <= max_applied
        applied += flat
        total += sum(torch.cat([g.reshape(-1) for g in ranks]).numpy() for ranks in gs)
    residual = np.sum(comm.allgather_object(strategy.residual("w..b").numpy()), axis=0)
    np.testing.assert_allclose(comm.size * applied + residual, total, rtol=0, atol=1e-9)


@pytest.mark.mpi
def test_coded_topk_loses_no_gradient_mass(comm):
    """With error feedback nothing of the gradients is lost, at any rank count, and the
    coded pairs send fewer than a third of the plain pairs' bytes."""
    strategy = strategies.TopKAllgather(density=0.02, coding="log8",
                                        momentum_correction=0.0, comm=comm)
    _check_no_mass_lost(comm, strategy, 97, 30 * comm.size)
    plain = strategies.TopKAllgather(density=0.02, momentum_correction=0.0, comm=comm)
    assert strategy.describe()["coding"] == "log8"
    if comm.size > 1:
        before = comm.traffic.snapshot()
        strategy.aggregate([torch.ones(s, dtype=torch.float64) for s in _SHAPES], ["w", "b"])
        coded = (comm.traffic - before).sent_bytes
        before = comm.traffic.snapshot()
        plain.aggregate([torch.ones(s, dtype=torch.float64) for s in _SHAPES], ["w", "b"])
        assert coded < (comm.traffic - before).sent_bytes / 3


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coded_gtopk_matches_the_simulator_and_sends_fewer_bytes(comm, dtype):
    size, k = 4_000, 40
    sets = [_pairs(50 + r, size, 30 + 9 * r, dtype) for r in range(comm.size)]
    trace = ref.GTopKTrace(comm.size)
    want = ref.simulate_gtopk([(i.numpy(), v.numpy()) for i, v in sets], k, trace=trace,
                              coding="log8")
    before = comm.traffic.snapshot()
    idx, val, dropped = gtopk(*sets[comm.rank], k, comm=comm, size=size,
                              return_dropped=True, own_contribution=True, coding="log8")
    moved = comm.traffic - before
    assert idx.tolist() == want[0].tolist()
    assert val.numpy().tobytes() == want[1].tobytes()
    everyone = comm.allgather_object((idx.tolist(), val.numpy().tobytes()))
    assert all(e == everyone[0] for e in everyone)
    assert dropped.shape == sets[comm.rank][0].shape
    assert set(sets[comm.rank][0][~dropped].tolist()) <= set(idx.tolist())
    assert moved.messages == trace.messages(comm.rank)
    plain = trace.bytes_sent(comm.rank, 4 + dtype.itemsize)
    folded_pair = comm.rank < 2 * (comm.size - (1 << (comm.size.bit_length() - 1)))
    if comm.size > 1 and not folded_pair:      # the fold-out stays plain
        assert 0 < moved.sent_bytes < plain / 2


@pytest.mark.mpi
def test_coded_gtopk_refuses_bad_arguments_on_every_rank(comm):
    idx, val = _pairs(comm.rank, 100, 5)
    with pytest.raises(ValueError, match="coding must be None or one of"):
        gtopk(idx, val, 5, comm=comm, coding="zip")
    with pytest.raises(ValueError, match="allow_nonfinite"):
        gtopk(idx, val, 5, comm=comm, coding="log8", allow_nonfinite=True)
    if comm.size > 1:
        with pytest.raises(ValueError, match="coding"):
            gtopk(idx, val, 5, comm=comm, coding="log8" if comm.rank == 0 else None)
    assert gtopk(idx, val, 5, comm=comm, coding="log8")[0].shape[0] <= 5


@pytest.mark.mpi
def test_coded_gtopk_strategy_loses_no_gradient_mass(comm):
    """The coded butterfly only picks the indices; the values are the exact mean, and
    what was applied plus the residuals is every gradient given, at any rank count."""
    strategy = strategies.GTopK(density=0.02, coding="log8", exact_values=True,
                                momentum_correction=0.0, comm=comm)
    _check_no_mass_lost(comm, strategy, 31, 30)
