"""What the virtual clock counts before it starts and while a cost table is measured.

Compute charged before the clock starts (:func:`mpicomm.clock.charge` before
``mpicomm.init()`` or the first collective) is priced when the clock starts and delays
the rank from its start; the kernels a calibration times are measurement, not the
job's work, so they never move the clock.
"""

from __future__ import annotations

import ast
import json
import sys

import pytest

from mpicomm import clock
from mpicomm.costtable import CostTable, OpCost
from mpicomm.emulate.vnet import platform_from_env

from .launch import run_job

#: 1e-10 s per byte of ``reduce``: 2.5e9 bytes charged before the start are 0.25 s
REDUCE_S_PER_BYTE = 1e-10


def _table_file(tmp_path) -> str:
    table = CostTable({"reduce": OpCost(0.0, REDUCE_S_PER_BYTE, "byte"),
                       "copy": OpCost(0.0, 0.0, "byte")})
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(table.to_json()))
    return str(path)


@pytest.fixture
def virtual_mode(monkeypatch):
    """``MPICOMM_CLOCK=virtual`` in this process, the clock not started, nothing charged."""
    monkeypatch.setattr(clock, "_mode", None)
    monkeypatch.setattr(clock, "_before_start", 0.0)
    monkeypatch.setattr(clock, "_charged_before_start", [])
    monkeypatch.setenv("MPICOMM_CLOCK", "virtual")
    yield
    monkeypatch.setattr(clock, "_mode", None)


def test_charges_before_the_start_wait_for_its_table(virtual_mode):
    clock.charge("reduce", 4096)
    clock.charge("select", 10)
    assert clock._charged_before_start == [("reduce", 4096.0), ("select", 10.0)]
    assert clock.now() == 0.0            # priced only when the clock (and its table) exist


def test_a_measurement_counts_for_nothing(virtual_mode):
    with clock._measuring():
        clock.charge("reduce", 4096)
        clock.compute(1.0)
        with clock._measuring():
            clock.compute(1.0)
        clock.compute(1.0)               # still inside the outer measurement
    assert clock._charged_before_start == [] and clock.now() == 0.0
    clock.compute(0.5)
    assert clock.now() == 0.5


def test_charges_on_the_wall_clock_are_nothing(monkeypatch):
    monkeypatch.setattr(clock, "_mode", "wall")
    monkeypatch.setattr(clock, "_charged_before_start", [])
    clock.charge("reduce", 4096)
    assert clock._charged_before_start == []


_CHARGE_FIRST = """
import numpy as np, mpicomm
from mpi4py import MPI
from mpicomm import clock
rank = MPI.COMM_WORLD.Get_rank()
clock.charge("reduce", 2.5e9 if rank == 0 else 0.0)     # before any communicator
t0 = clock.now()
y = mpicomm.allreduce(np.ones(10**6, dtype=np.float32), algorithm="ring")
rows = MPI.COMM_WORLD.gather((t0, clock.now(), float(y[0])), root=0)
if rank == 0:
    print("T", repr(rows), flush=True)
"""


def test_compute_charged_before_the_start_delays_the_ring(tmp_path):
    res = run_job(3, [sys.executable, "-c", _CHARGE_FIRST], timeout=180,
                  MPICOMM_CLOCK="virtual", MPICOMM_VIRTUAL_RATE="1gbit",
                  MPICOMM_VIRTUAL_DELAY="1ms", MPICOMM_VIRTUAL_COSTS=_table_file(tmp_path))
    assert res.returncode == 0, res.output
    rows = ast.literal_eval(res.output.split("T ", 1)[1].splitlines()[0])
    line = 2 * (2 / 3) * 4e6 * 8 / 1e9              # the ring's 2(P-1)/P·n bytes at 1 Gbit/s
    reductions = 2 / 3 * 4e6 * REDUCE_S_PER_BYTE    # its (P-1)/P·n bytes of sums
    for t0, t1, value in rows:
        assert t0 == 0.0 and value == 3.0           # read before the start: the origin
        # rank 0's 0.25 s charged before the start delays every rank's ring
        assert 0.25 + line <= t1 <= 0.25 + line + reductions + 4e-3


def test_an_op_charged_before_the_start_that_the_table_lacks_is_one_error(tmp_path):
    script = ("import numpy as np, mpicomm\nfrom mpicomm import clock\n"
              "clock.charge('step')\nmpicomm.allreduce(np.ones(4), algorithm='ring')\n")
    res = run_job(3, [sys.executable, "-c", script], timeout=180, MPICOMM_CLOCK="virtual",
                  MPICOMM_VIRTUAL_RATE="1gbit", MPICOMM_VIRTUAL_COSTS=_table_file(tmp_path))
    assert res.returncode != 0
    assert "it was charged before the clock started" in res.output, res.output
    assert res.output.count("Traceback") == 0, res.output


@pytest.mark.mpi
def test_calibrating_under_the_clock_leaves_it_where_it_was(comm):
    table = CostTable({"reduce": OpCost(0.0, 1e-9, "byte"), "copy": OpCost(0.0, 0.0, "byte")})
    plat = platform_from_env(comm.size, {"MPICOMM_VIRTUAL_RATE": "1gbit"})
    with clock.session(plat, table):
        t0 = clock.now()
        measured = clock.calibrate(ops=["reduce", "copy"], repeats=1)
        calls = clock.calibrate_calls({"charging": lambda: clock.charge("reduce", 1e6)},
                                      repeats=1)
        assert clock.now() == t0
        assert table.ops["reduce"] == measured.ops["reduce"]      # the table took them
        assert table.ops["charging"] == calls.ops["charging"]
