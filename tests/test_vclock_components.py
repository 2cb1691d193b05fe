"""The virtual clock's parts, serially: the platform a job's environment declares (rates,
delays, schedules, framing, host layout), the link disciplines, the cost table and its
calibration, the clock's modes before and without a virtual session, and the engine's
virtual-time order of sends, receives and collectives.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from mpicomm import clock, costtable
from mpicomm.costtable import CostTable, OpCost
from mpicomm.emulate import vengine, vnet
from mpicomm.emulate.vnet import FifoLink, GapLink, Platform, host_layout, platform_from_env

# ---------------------------------------------------------------------- platform


def test_platform_from_env_rates_delays_and_layout():
    p = platform_from_env(6, {"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_VIRTUAL_DELAY": "50us",
                              "MPICOMM_VIRTUAL_RANKS_PER_HOST": "2"})
    assert p.rate == 125e6 and p.delay == pytest.approx(50e-6)
    assert p.hosts == (0, 0, 1, 1, 2, 2) and p.num_hosts == 3
    p = platform_from_env(5, {"MPICOMM_VIRTUAL_RATE": "100mbit", "MPICOMM_HOST_SIZES": "2,2,1"})
    assert p.hosts == (0, 0, 1, 1, 2) and p.delay == 0.0 and p.rate == 12.5e6


@pytest.mark.parametrize("env, needle", [
    ({}, "MPICOMM_VIRTUAL_RATE"),
    ({"MPICOMM_VIRTUAL_RATE": "0"}, "must be > 0"),
    ({"MPICOMM_VIRTUAL_RATE": "fast"}, "bad rate"),
    ({"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_VIRTUAL_DELAY": "soon"}, "bad delay"),
    ({"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_VIRTUAL_RANKS_PER_HOST": "4"}, "per host"),
    ({"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_HOST_SIZES": "2,2"}, "places 4 ranks"),
    ({"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_HOST_SIZES": "2,x"}, "comma-separated"),
    ({"MPICOMM_VIRTUAL_RATE": "1gbit", "MPICOMM_VIRTUAL_SCHEDULE": "/nonexistent"},
     "cannot read"),
])
def test_platform_errors_name_the_variable(env, needle):
    with pytest.raises(ValueError, match=needle):
        platform_from_env(6, env)


def test_schedule_conditions_by_time_and_step(tmp_path):
    sched = tmp_path / "s.txt"
    sched.write_text("0 10gbit 50us\n2s 100mbit 5ms\nstep 100 1gbit 1ms\n")
    p = platform_from_env(2, {"MPICOMM_VIRTUAL_SCHEDULE": str(sched)})
    assert p.conditions(0.0) == pytest.approx((10e9 / 8, 50e-6))   # from the 0 entry
    assert p.conditions(2.5) == pytest.approx((100e6 / 8, 5e-3))
    assert p.conditions(2.5, step=100) == pytest.approx((1e9 / 8, 1e-3))  # step wins
    assert p.conditions(0.1, step=99) == pytest.approx((10e9 / 8, 50e-6))
    assert p.min_delay() == pytest.approx(50e-6)
    bad = tmp_path / "bad.txt"
    bad.write_text("0 0mbit 1ms\n")
    with pytest.raises(ValueError, match="MPICOMM_VIRTUAL_SCHEDULE"):
        platform_from_env(2, {"MPICOMM_VIRTUAL_SCHEDULE": str(bad)})


def test_framing_charges_one_header_per_started_frame():
    plain = platform_from_env(2, {"MPICOMM_VIRTUAL_RATE": "1gbit"})
    assert plain.framing == (0, 0) and plain.wire_factor() == 1.0
    assert [plain.wire_bytes(n) for n in (0, 8, 1 << 20)] == [0, 8, 1 << 20]
    tcp = platform_from_env(2, {"MPICOMM_VIRTUAL_RATE": "1gbit",
                                "MPICOMM_VIRTUAL_FRAMING": " TCP "})
    assert tcp.framing == (1448, 66) == vnet.parse_framing("tcp")
    # an empty message still takes a frame; 1448 bytes fill exactly one
    assert [tcp.wire_bytes(n) for n in (0, 8, 1448, 1449, 10 * 1448)] == \
        [66, 74, 1514, 1449 + 132, 10 * 1514]
    assert tcp.wire_factor() == pytest.approx(1514 / 1448)
    assert tcp.describe()["framing"] == {"payload_bytes": 1448, "header_bytes": 66}
    assert vnet.parse_framing("8948,66") == (8948, 66)
    assert vnet.parse_framing("none") == (0, 0)
    for bad in ("jumbo", "0,66", "1448,-1", "1448", "1448,66,1"):
        with pytest.raises(ValueError, match="MPICOMM_VIRTUAL_FRAMING"):
            platform_from_env(2, {"MPICOMM_VIRTUAL_RATE": "1gbit",
                                  "MPICOMM_VIRTUAL_FRAMING": bad})
    with pytest.raises(ValueError, match="framing"):
        Platform(rate=1e6, delay=0.0, hosts=(0, 1), framing=(0, 66))


def test_host_layout():
    assert host_layout(4) == (0, 1, 2, 3)
    assert host_layout(4, "2") == (0, 0, 1, 1)
    assert host_layout(3, "1", "1,2") == (0, 1, 1)


# ---------------------------------------------------------------------- links


def test_fifo_link_queues():
    link = FifoLink()
    assert link.transmit(0.0, 2.0) == (0.0, 2.0)
    assert link.transmit(1.0, 1.0) == (2.0, 3.0)     # waits for the first
    assert link.transmit(5.0, 1.0) == (5.0, 6.0)


def test_gap_link_busy_time_is_order_independent():
    msgs = [(0.0, 2.0), (1.0, 1.0), (10.0, 1.0), (3.0, 4.0)]
    ends = []
    for order in (msgs, list(reversed(msgs))):
        link = GapLink()
        ends.append(max(link.fill(k, s) for k, s in order))
        assert sum(b - a for a, b in link.busy()) == pytest.approx(8.0)
    assert ends[0] == ends[1] == pytest.approx(11.0)
    link = GapLink()
    assert link.fill(5.0, 1.0) == 6.0
    assert link.fill(4.0, 2.0) == 7.0                 # [4,5] then [6,7]
    link = GapLink(limit=3)
    for i in range(10):
        link.fill(2.0 * i, 1.0)
    assert len(link.busy()) <= 3


# ---------------------------------------------------------------------- cost table


def test_cost_table_round_trip_and_errors(tmp_path):
    t = CostTable({"reduce": OpCost(1e-6, 2e-10, "byte")})
    t.declare("step", 0.25)
    assert t.cost("reduce", 1e6) == pytest.approx(1e-6 + 2e-4)
    assert t.cost("step", 2) == 0.5
    path = tmp_path / "costs.json"
    t.save(str(path))
    back = CostTable.load(str(path))
    assert back.ops == t.ops and json.loads(path.read_text())["format"] == costtable.FORMAT
    with pytest.raises(KeyError, match="no entry for 'merge'"):
        t.cost("merge", 1)
    path.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a cost table"):
        CostTable.load(str(path))
    with pytest.raises(ValueError, match=">= 0"):
        OpCost(-1.0, 0.0)


def test_calibration_measures_registered_kernels_single_rank():
    table = costtable.calibrate(ops=["reduce", "copy"], repeats=3)
    for op in ("reduce", "copy"):
        entry = table.ops[op]
        assert entry.unit == "byte" and entry.source == "measured"
        assert 0 < entry.per_unit < 1e-7        # between 10 MB/s and "free"
    with pytest.raises(ValueError, match="no kernel registered"):
        costtable.calibrate(ops=["no-such-op"])


def test_cpu_seconds_is_the_least_disturbed_sample(monkeypatch):
    """Each sample is a batch of calls lasting >= SAMPLE_S; samples go round-robin over
    the calls; the least seconds per call counts (a disturbed sample only adds)."""
    ticks = iter([0.0, 1e-3,                 # warm-up of a: one call costs 1 ms
                  0.0, 1e-5,                 # b: 10 us -> a batch of 200 calls
                  0.0, 2e-3, 0.0, 9e-3,      # round 1: a = 2 ms (x2), b disturbed
                  0.0, 4e-3, 0.0, 2e-3])     # round 2: a disturbed, b = 2 ms / 200
    monkeypatch.setattr(costtable.time, "thread_time", lambda: next(ticks))
    calls = {"a": [], "b": []}
    got = costtable.cpu_seconds({k: (lambda k=k: calls[k].append(1)) for k in calls}, 2)
    assert got == {"a": pytest.approx(1e-3), "b": pytest.approx(1e-5)}
    assert len(calls["a"]) == 2 + 2 * 2 and len(calls["b"]) == 2 + 2 * 200


def test_compressor_charges_once_per_call(monkeypatch):
    import torch

    from mpicomm.compress import make

    charged = []
    monkeypatch.setattr(clock, "charge", lambda op, n=1.0: charged.append((op, n)))
    c = make("bf16")             # BF16.compress calls Cast.compress: charged once
    payload = c.compress(torch.ones(10))
    c.decompress(payload)
    assert charged == [("compress:bf16", 10), ("decompress:bf16", 10)]


def test_wall_clock_mode(monkeypatch):
    monkeypatch.setattr(clock, "_mode", None)
    monkeypatch.setenv("MPICOMM_CLOCK", "wall")
    assert clock.mode() == "wall" and not clock.started()
    a = clock.now()
    clock.charge("anything", 1e9)       # no table needed on the wall clock
    assert clock.now() >= a
    monkeypatch.setattr(clock, "_mode", None)
    monkeypatch.setenv("MPICOMM_CLOCK", "sundial")
    with pytest.raises(ValueError, match="MPICOMM_CLOCK"):
        clock.mode()
    monkeypatch.setattr(clock, "_mode", None)


def test_before_the_start_the_clock_reads_the_origin_plus_declared_compute(monkeypatch):
    monkeypatch.setattr(clock, "_mode", None)
    monkeypatch.setattr(clock, "_before_start", 0.0)
    monkeypatch.setenv("MPICOMM_CLOCK", "virtual")
    assert not clock.started() and clock.now() == 0.0
    clock.compute(0.25)
    clock.compute(0.5)
    assert clock.now() == 0.75
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        clock.compute(-1.0)
    monkeypatch.setattr(clock, "_mode", None)


# ---------------------------------------------------------------------- engine


@pytest.fixture
def engine():
    plat = Platform(rate=1e6, delay=1e-3, hosts=(0, 0, 1, 1))
    path = vengine.Engine.new_path()
    eng = vengine.Engine(path, plat, create=True, threads=2, slots=8)
    os.unlink(path)                 # open now: the mapping outlives the name
    for rank in range(4):
        eng.open_actor(rank, 0, 0.0)
    yield eng
    eng.close()


def test_engine_resolves_a_shared_upload_in_virtual_time_order(engine):
    # rank 1 posts first (real time) but later (virtual time) than rank 0 will
    engine.set_clock(2, 0.5)          # actor ids: rank * threads + index (rank 1 -> 2)
    late = engine.try_post(2, 2, 1, 5, 0, 1000.0, 0.5)
    engine.advance()
    assert engine.upload(2, late) is None          # rank 0 (clock 0) could still send
    early = engine.try_post(0, 3, 1, 5, 0, 1000.0, 0.1)
    engine.set_clock(0, 0.6)
    engine.advance()
    assert engine.upload(0, early) == pytest.approx((0.1, 0.101))
    assert engine.upload(2, late) == pytest.approx((0.5, 0.501))


def test_engine_floors_follow_waits(engine):
    with engine:
        assert engine.floors()[0] == 0.0
    # rank 0 waits for messages from rank 2, which is itself waiting for rank 0: a
    # deadlock without a message in flight (infinite floors) ...
    engine.set_state(0, vengine.RECV, 1.0, ranks=[2])
    engine.set_state(4, vengine.RECV, 2.0, ranks=[0])
    engine.set_state(2, vengine.RESOLVE, 0.0, lb=5.0)
    engine.set_state(6, vengine.DONE, 0.0)
    with engine:
        f = engine.floors()
    assert math.isinf(f[0]) and math.isinf(f[4]) and f[2] == 5.0
    # ... until rank 2 posts one: rank 0 then cannot wake before it arrives
    seq = engine.try_post(4, 0, 1, 5, 0, 1000.0, 2.0)
    assert seq is not None
    with engine:
        f = engine.floors()
    assert f[0] == pytest.approx(2.0 + 1e-3 + 1e-3)
    assert f[4] == pytest.approx(f[0] + 1e-3)       # + the lookahead between hosts


def test_engine_wildcard_receive_takes_the_earliest_arrival(engine):
    # rank 0 (host 0) expects tag 5 from ranks 2 and 3 (host 1); rank 3 posts first in
    # real time but later in virtual time
    for aid in (0, 2):
        engine.set_state(aid, vengine.RECV, 0.0, ranks=[2, 3])
    expected = {(2, 5): 0, (3, 5): 0}
    engine.try_post(6, 0, 1, 5, 0, 1000.0, 0.2)          # rank 3 at t = 0.2
    engine.set_clock(4, 0.05)
    assert engine.earliest(0, 1, expected) is None        # rank 2 may still send sooner
    engine.try_post(4, 0, 1, 5, 0, 1000.0, 0.1)           # rank 2 at t = 0.1
    engine.set_state(4, vengine.RESOLVE, 0.1, lb=0.5)
    engine.set_state(6, vengine.RESOLVE, 0.2, lb=0.5)
    assert engine.earliest(0, 1, expected) == (2, 5)
    engine.consume(*engine.find(2, 0, 1, 5, 0))
    assert engine.earliest(0, 1, {(2, 5): 1, (3, 5): 0}) == (3, 5)


def test_engine_collective_floor(engine):
    for aid, t in ((0, 1.0), (2, 3.0), (4, 2.0)):
        engine.set_state(aid, vengine.COLL, t, ranks=[0, 1, 2], comm=7, seq=1)
    engine.set_clock(6, 0.5)
    with engine:
        f = engine.floors()
    assert f[0] == f[2] == f[4] == 3.0     # every member inside: the latest entry


def test_engine_collective_floor_ignores_a_member_that_has_left(engine):
    # ranks 1-3 left collective 1 of communicator 7 and went on (to 5.0); rank 0, still
    # inside (MPI has not returned yet), leaves at about 1.0, and may send from there on
    engine.set_state(0, vengine.COLL, 1.0, ranks=[0, 1, 2, 3], comm=7, seq=1)
    for rank in (1, 2, 3):
        engine.left_collective(rank, 7, 1)
        engine.set_clock(2 * rank, 5.0)
    with engine:
        assert engine.floors()[0] == 1.0
    engine.left_collective(3, 7 + vengine.LEFT_SLOTS, 4)   # the same slot, another comm:
    with engine:                                          # rank 3 may not have entered
        assert engine.floors()[0] == 5.0
