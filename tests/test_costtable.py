"""The cost table's selection entries: ``select:kept`` (what a selection keeping more than
the measured 1% adds), its calibration (a slope, no per-call part), and tables of the
first format, which lack it and charge it nothing."""

from __future__ import annotations

import json

import pytest
import torch

import mpicomm
from mpicomm import clock, costtable
from mpicomm.compress.topk_select import SELECT_COST_DENSITY, topk_indices
from mpicomm.costtable import CostTable, OpCost
from mpicomm.emulate.vnet import platform_from_env

PER_ELEMENT, PER_KEPT = 1e-9, 1e-6


def _platform(size: int):
    return platform_from_env(size, {"MPICOMM_VIRTUAL_RATE": "1gbit"})


def _charged(table: CostTable, n: int, k: int) -> float:
    """Virtual seconds one ``topk_indices`` of ``k`` among ``n`` advances this rank by."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + k))
    with clock.session(_platform(1), table, clock.MPI.COMM_SELF):
        t0 = clock.now()
        topk_indices(x, k)
        return clock.now() - t0


def test_a_selection_pays_per_element_and_per_index_kept_beyond_the_measured_share():
    table = CostTable({"select": OpCost(0.0, PER_ELEMENT),
                       "select:kept": OpCost(0.0, PER_KEPT, "kept element")})
    n = 20000
    base = int(SELECT_COST_DENSITY * n)
    assert _charged(table, n, n // 2) == pytest.approx(PER_ELEMENT * n + PER_KEPT * (n // 2 - base))
    assert _charged(table, n, base) == pytest.approx(PER_ELEMENT * n)
    assert _charged(table, n, 10) == pytest.approx(PER_ELEMENT * n)
    assert _charged(table, n, n) == 0.0                 # nothing to select


def test_a_first_format_table_loads_and_records_select_kept_as_absent(tmp_path):
    old = {"format": "mpicomm-cost-table/1", "info": {"when": "then"},
           "ops": {"select": {"per_call": 0.0, "per_unit": PER_ELEMENT, "unit": "element",
                              "source": "measured"}}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    table = CostTable.load(str(path))
    assert "select:kept" not in table.ops
    assert _charged(table, 20000, 10000) == pytest.approx(PER_ELEMENT * 20000)
    assert table.ops["select:kept"] == OpCost(0.0, 0.0, "kept element", "absent")
    table.save(str(path))
    saved = json.loads(path.read_text())
    assert saved["format"] == costtable.FORMAT == "mpicomm-cost-table/2"
    assert saved["ops"]["select:kept"]["source"] == "absent"
    with pytest.raises(KeyError, match="no entry for 'merge'"):
        table.cost("merge", 1)


def test_select_kept_calibrates_to_a_slope_without_a_per_call_part(monkeypatch):
    """A kernel registered without an intercept gets ``per_call`` 0 and the slope of its
    two sizes. ``select:kept``'s own slope is small beside the noise of a loaded machine
    (a single sample may even read it as 0, clamped), so its measured value is checked
    for its form only; the slope is checked on a kernel whose work grows 256-fold."""
    import mpicomm.sparse  # noqa: F401  (registers the sparse layer's kernels)

    kernel = costtable.kernels()["select:kept"]
    assert not kernel.intercept and kernel.unit == "kept element"
    entry = costtable.calibrate(ops=["select:kept"], repeats=1).ops["select:kept"]
    assert entry.per_call == 0.0 and entry.source == "measured"
    assert 0.0 <= entry.per_unit < 1e-5

    def summed(n: int):  # type: ignore[no-untyped-def]
        x = torch.ones(n)
        return lambda: float(x.cumsum(0)[-1])

    monkeypatch.setattr(costtable, "_KERNELS", dict(costtable.kernels()))  # dropped after
    costtable.register_kernel("test:slope", summed, "element", (1 << 12, 1 << 20),
                              intercept=False)
    slope = costtable.calibrate(ops=["test:slope"], repeats=3).ops["test:slope"]
    assert slope.per_call == 0.0 and 1e-12 < slope.per_unit < 1e-6
    with pytest.raises(ValueError, match="increasing"):
        costtable.register_kernel("bad", kernel.make, "x", (5, 5), intercept=False)


@pytest.mark.mpi
def test_select_kept_is_measured_alike_on_every_rank_and_charges_gtopk_more(comm):
    import mpicomm.sparse  # noqa: F401
    from mpicomm.sparse import gtopk

    measured = costtable.calibrate(comm.mpi, ops=["select:kept"], repeats=1, turns=2)
    entry = measured.ops["select:kept"]
    # one sample of a small slope may read 0 (clamped); the serial test checks a slope
    assert entry.per_call == 0.0 and entry.per_unit >= 0.0
    assert comm.allgather_object(entry) == [entry] * comm.size
    zero = {op: OpCost(0.0, 0.0, unit) for op, unit in (
        ("reduce", "byte"), ("copy", "byte"), ("merge", "pair"), ("scatter", "element"),
        ("select", "element"))}
    d, k = 50_000, 500
    gen = torch.Generator().manual_seed(comm.rank)
    idx, val = torch.randperm(d, generator=gen)[:k], torch.randn(k, generator=gen)
    runs = []
    for kept in (None, OpCost(0.0, PER_KEPT, "kept element")):
        table = CostTable({**zero, **({"select:kept": kept} if kept else {})})
        with clock.session(_platform(comm.size), table):
            sub = comm.dup()
            sub.check = False
            try:
                sub.barrier()
                t0 = clock.now()
                out = gtopk(idx, val, k, comm=sub, size=d)
                runs.append((sub.allreduce_value(clock.now() - t0, "max"), out))
            finally:
                sub.free()
    (t_without, a), (t_with, b) = runs
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if comm.size == 1:
        assert t_with == t_without
    else:   # each merge keeps k of up to 2k pairs: at least k - 2k/100 kept beyond 1%
        assert t_with - t_without >= PER_KEPT * (k - int(2 * k * SELECT_COST_DENSITY)) * 0.999


def test_a_sparse_input_in_random_order_pays_its_sort_and_a_sorted_one_does_not():
    from mpicomm.sparse import gtopk

    per_sort = 1e-6
    table = CostTable({"sort": OpCost(0.0, per_sort), "select": OpCost(0.0, 0.0),
                       "select:kept": OpCost(0.0, 0.0, "kept element"),
                       "merge": OpCost(0.0, 0.0, "pair")})
    idx = torch.randperm(5000, generator=torch.Generator().manual_seed(3))[:400]
    val = torch.randn(400, generator=torch.Generator().manual_seed(4))

    def charged(i: torch.Tensor) -> float:
        with clock.session(_platform(1), table, clock.MPI.COMM_SELF):
            raw = clock.MPI.COMM_SELF.Dup()
            one = mpicomm.init(raw, check=False, abort_on_error=False)
            try:
                t0 = clock.now()
                gtopk(i, val, 40, comm=one, size=5000)
                return clock.now() - t0
            finally:
                one.free()
                raw.Free()

    assert charged(idx) == pytest.approx(per_sort * 400)
    assert charged(torch.sort(idx).values) == 0.0


def test_a_table_without_sort_charges_it_nothing():
    table = CostTable({"select": OpCost(0.0, PER_ELEMENT)})
    assert table.cost("sort", 1000) == 0.0
    assert table.ops["sort"] == OpCost(0.0, 0.0, "element", "absent")
