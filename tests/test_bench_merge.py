"""mpicomm.bench.merge: which results run as separate jobs may be merged."""

from __future__ import annotations

import pytest

from mpicomm.bench.merge import charged, check_mergeable

OP = {"per_call": 1e-3, "per_unit": 0.0, "unit": "call", "source": "measured"}
ABSENT = {"per_call": 0.0, "per_unit": 0.0, "unit": "kept element", "source": "absent"}


def _clock(fmt="mpicomm-cost-table/2", info=None, **ops):
    return {"mode": "virtual", "platform": {"rate_bits": 1e9, "hosts": 4},
            "costs": {"format": fmt, "ops": ops, "info": info or {}}}


def _result(seeds, clock=None, ranks=4, **args):
    return {"suite": "ps", "ranks": ranks, "clock": clock or _clock(step=OP),
            "args": {"seeds": seeds, "json": f"{seeds}.json", "lr": 0.1, **args}}


def test_charged_ignores_what_charges_nothing():
    base = charged(_clock(step=OP))
    assert charged(_clock("mpicomm-cost-table/1", step=OP)) == base      # format tag
    assert charged(_clock(info={"measured": "elsewhere"}, step=OP)) == base
    assert charged(_clock(step=OP, **{"select:kept": ABSENT})) == base
    assert charged(_clock(step=dict(OP, per_call=2e-3))) != base
    assert charged(_clock(step=OP, **{"select:kept": dict(ABSENT, source="measured")})) \
        != base
    moved = _clock(step=OP)
    moved["platform"] = {"rate_bits": 1e10, "hosts": 4}
    assert charged(moved) != base
    assert charged({"mode": "wall"}) != base and charged(None) is None


def test_check_mergeable_names_the_file_and_the_difference():
    ok = [_result("0"), _result("1,2", clock=_clock("mpicomm-cost-table/1", step=OP))]
    check_mergeable(ok, ["a", "b"], options="args", per_job=("seeds", "json"))
    cases = [(_result("1", ranks=8), "b: ranks differ from a's"),
             (_result("1", clock=_clock(step=dict(OP, per_call=5e-3))), "b: clock differs"),
             (_result("1", lr=0.2), r"b: options \['lr'\] differ from a's")]
    for other, message in cases:
        with pytest.raises(ValueError, match=message):
            check_mergeable([ok[0], other], ["a", "b"], options="args",
                            per_job=("seeds", "json"))
    with pytest.raises(ValueError, match="nothing to merge"):
        check_mergeable([], [], options="args", per_job=())
