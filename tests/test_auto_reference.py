"""``strategy="auto"``'s reference ``||top-k(g + e)||²`` (the CR controller's gain) comes
from the scheme's own selection where the scheme selects on this rank (gTop-k on every
rank, AR-Top-k on the step's source) instead of a second selection; elsewhere the extra
selection is counted in ``overheads["reference_s"]``."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from mpicomm import strategies
from mpicomm.strategies import ARTopK, GTopK

from .test_controllers import _momentum_run

if MPI.COMM_WORLD.Get_size() > 1:
    torch.set_num_threads(1)


def _topk_mass(x: torch.Tensor, k: int) -> float:
    return float((x.double().abs().topk(k).values ** 2).sum())


@pytest.mark.mpi
@pytest.mark.parametrize("scheme", ["gtopk", "artopk_tree"])
def test_the_schemes_own_selection_is_the_reference(comm, scheme):
    """This rank's recorded mass is the exact top-k mass of its error-fed bucket, and only
    where it selected: gTop-k on every rank, AR-Top-k where ``selects_locally`` said so
    before the step (the step's source, round-robin)."""
    strategy = (GTopK if scheme == "gtopk" else ARTopK)(density=0.1).bind(comm)
    gen = torch.Generator().manual_seed(10 + comm.rank)
    sources = 0
    for _ in range(2 * comm.size):
        g = torch.randn(200, generator=gen)
        fed = g + (strategy.residual("w") if "w" in strategy.memory else 0.0)
        selects = strategy.selects_locally("w")
        strategy.stats.extra.pop("selected_sq", None)
        strategy.aggregate([g], ["w"])
        recorded = strategy.stats.extra.get("selected_sq", {}).get("w")
        if scheme == "gtopk":
            assert selects
        else:
            assert selects == (strategy.state("w").source == comm.rank)
        sources += selects
        assert (recorded is not None) == selects
        if selects:
            assert recorded == pytest.approx(_topk_mass(fed, 20), rel=1e-6)
    assert sources == (2 * comm.size if scheme == "gtopk" else 2)


def _recorded_references(auto) -> list[list[float]]:
    """A list that receives, at every step, each bucket's reference as ``auto`` queues it
    for agreement across ranks."""
    refs: list[list[float]] = []
    finish = auto.agreement.finish

    def spy(pending, sums):
        refs.append([r["ref_sq"] for r in pending])
        return finish(pending, sums)

    auto.agreement.finish = spy
    return refs


def _run(comm, scheme: str, reuse: bool, monkeypatch) -> tuple[list, torch.Tensor, float]:
    """Six steps of a small MLP under auto running ``scheme`` at 0.1: every bucket's
    reference per step (as queued for agreement), the final weights, ``reference_s``."""
    from mpicomm.strategies.auto_ratio import RatioControl

    # a reference on every step (none carried between measurements), the scheme's
    # own selection or, without ``reuse``, a selection of its own
    monkeypatch.setattr(RatioControl, "due", lambda self, bucket, step, ratio: True)
    if not reuse:
        for cls in (GTopK, ARTopK):
            monkeypatch.setattr(cls, "selects_locally", lambda self, name: False)
    auto = strategies.make("auto", comm=comm, ratio=0.1, schemes=(scheme,),
                           calibrate_links=0, trial_steps=0)
    refs = _recorded_references(auto)
    weights, _ = _momentum_run(comm, auto)
    monkeypatch.undo()
    return refs, weights, auto.overheads["reference_s"]


@pytest.mark.mpi
@pytest.mark.parametrize("scheme", ["gtopk", "artopk_tree"])
def test_auto_reads_the_reference_instead_of_selecting_again(comm, scheme, monkeypatch):
    """The same references and the same run as with a second selection per bucket; with
    gTop-k no second selection at all (``reference_s`` stays 0), without the reuse it is
    counted."""
    refs, weights, seconds = _run(comm, scheme, True, monkeypatch)
    again, weights_again, seconds_again = _run(comm, scheme, False, monkeypatch)
    assert len(refs) == len(again) == 6 and all(refs)
    for mine, theirs in zip(refs, again):
        assert mine == pytest.approx(theirs, rel=1e-5)
    assert torch.equal(weights, weights_again)
    assert seconds_again > 0.0
    if scheme == "gtopk":
        assert seconds == 0.0


def test_a_costly_reference_is_measured_every_few_steps_and_carried_between():
    """Where the reference costs a selection, it is measured on the first step at a
    ratio, on every ``REFERENCE_EVERY``-th step and on probe steps; between, the last
    measured share of ``||g_e||²`` times the step's own; a scheme that kept exact Top-k
    (or ratio 1) has no reference of its own."""
    from mpicomm.strategies.auto_ratio import REFERENCE_EVERY, RatioControl

    control = RatioControl(None, 0.1)
    assert control.due("b", 0, 0.1)
    assert control.settle("b", 0, 0.1, 2.0, 8.0, due=True, exact=False) == 2.0
    for step in range(1, REFERENCE_EVERY):
        assert not control.due("b", step, 0.1)
        assert control.settle("b", step, 0.1, None, 4.0, due=False,
                              exact=False) == pytest.approx(1.0)
        assert control.settle("b", step, 0.1, None, 4.0, due=False, exact=True) is None
    assert control.due("b", REFERENCE_EVERY, 0.1) and control.due("b", 3, 0.05)
    assert control.due("other", 3, 0.1)
    assert control.settle("other", 3, 0.1, None, 4.0, due=False, exact=False) is None


@pytest.mark.mpi
def test_auto_dense_selects_for_its_reference_every_few_steps(comm, monkeypatch):
    """A dense run at ratio 0.1 selects for the gain's reference on steps 0 and
    ``REFERENCE_EVERY`` only, and feeds a reference on every step."""
    from mpicomm.strategies import auto_ratio

    calls = []
    real = auto_ratio.topk_masses
    monkeypatch.setattr(auto_ratio, "topk_masses",
                        lambda x, ks: calls.append(len(ks)) or real(x, ks))
    steps = auto_ratio.REFERENCE_EVERY + 2
    auto = strategies.make("auto", comm=comm, ratio=0.1, schemes=("dense",),
                           calibrate_links=0, trial_steps=0)
    refs = _recorded_references(auto)
    gen = torch.Generator().manual_seed(7 + comm.rank)
    for _ in range(steps):
        auto.aggregate([torch.randn(300, generator=gen)], ["w"])
        auto.step_done()
    assert len(calls) == 2 and auto.overheads["reference_s"] > 0
    assert len(refs) == steps and all(r[0] > 0 for r in refs)
