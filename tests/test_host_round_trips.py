"""No host round trips in QSGD, PowerSGD, error feedback and the top-k compressors.

On a GPU every ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``float(t)``,
``int(t)``, ``bool(t)``, Python loop over a tensor's values, or data-dependent
compaction (``nonzero``, boolean indexing) makes the host wait for the device. These
tests run the compressors on CPU tensors under a ``TorchFunctionMode`` that records
every such call (torch routes them all through ``__torch_function__``), so the same
code paths are checked without a GPU. What remains is deliberate and counted exactly:
the finiteness check (one synchronization per compressed tensor, dropped with
``allow_nonfinite=True``), the single compaction of a threshold top-k, and
``ErrorFeedback.norm``, a diagnostic that returns a float.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mpicomm.compress import (
    QSGD,
    ErrorFeedback,
    PowerSGD,
    SampledTopK,
    TopK,
    _rng,
    powersgd,
    qsgd,
    sampled_topk,
    topk,
)
from mpicomm.compress import topk_select as selection

#: Calls that copy a value to the host (or iterate over values in Python).
HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__",
              "__index__", "__iter__", "unbind"}
#: Data-dependent output sizes: the host must wait for the count.
COMPACTIONS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


class RoundTrips(TorchFunctionMode):
    """Records every call in :data:`HOST_READS` / :data:`COMPACTIONS` and boolean-mask
    indexing, by name."""

    def __init__(self, also: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.also = also  # more names to record, to see where the reads fall

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS or name in COMPACTIONS or name in self.also:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and \
                isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            self.calls.append("bool-index")
        return func(*args, **(kwargs or {}))


def record(fn: Any, also: frozenset[str] = frozenset()) -> list[str]:
    with RoundTrips(also) as mode:
        fn()
    return mode.calls


@pytest.fixture
def draws(monkeypatch) -> list[Any]:
    """The device every compressor RNG stream was asked for ("cpu" when none given)."""
    seen: list[Any] = []
    real = _rng.generator

    def spy(seed: int, name: str, step: int, salt: int = 0, device: Any = "cpu") -> Any:
        seen.append(torch.device(device))
        return real(seed, name, step, salt, device=device)

    for module in (qsgd, powersgd, sampled_topk):
        monkeypatch.setattr(module, "generator", spy)
    return seen


def grad(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- QSGD
def test_qsgd_has_no_host_round_trip(draws):
    x = grad(5000)
    q = QSGD(bits=4, bucket_size=128, allow_nonfinite=True)
    assert record(lambda: q.decompress(q.compress(x, name="w", step=3))) == []
    assert draws == [x.device]  # the rounding noise is drawn on the tensor's device


def test_qsgd_finiteness_check_is_its_one_synchronization():
    """Read once, at the end: the flag is computed first, the host waits for it only
    after the rest of the work is queued (on a GPU the device never idles meanwhile)."""
    x = grad(5000)
    q = QSGD(bits=4, bucket_size=128)
    calls = record(lambda: q.compress(x, name="w", step=3), also=frozenset({"rand"}))
    assert calls == ["rand", "__bool__"]
    x[7] = float("inf")
    with pytest.raises(ValueError, match="'w' holds 1 non-finite"):
        q.compress(x, name="w", step=3)


# ---------------------------------------------------------------------- PowerSGD
def test_powersgd_steps_after_the_first_have_no_host_round_trip(draws):
    p = PowerSGD(rank=2, allow_nonfinite=True)
    m = grad(64, 48)
    p.decompress(p.compress(m, name="w", step=0))
    assert draws == [torch.device("cpu")]  # the initial Q, once per tensor (documented)

    def phases() -> None:
        for step in (1, 2):
            m.mul_(0.5)
            p_sum = p.p_phase(m, "w", step)
            q_sum = p.q_phase(m, "w", p_sum)
            p.reconstruct("w", p_sum, q_sum, world_size=2)
            p.decompress(p.compress(m, name="w", step=step))

    assert record(phases) == []
    assert len(draws) == 1  # warm start: no more host draws


def test_powersgd_checks_finiteness_once_per_step():
    p = PowerSGD(rank=2)
    m = grad(64, 48)
    p.compress(m, name="w", step=0)

    def step() -> None:
        m.mul_(0.5)  # a new gradient: its version changes
        p_sum = p.p_phase(m, "w", 1)
        p.q_phase(m, "w", p_sum)  # the same, unmodified tensor: not checked again

    assert record(step, also=frozenset({"matmul"})) == ["matmul", "__bool__",
                                                        "matmul"]
    m[3, 4] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        p.q_phase(m, "w", p.p_phase(m * 1, "w", 2))


# ---------------------------------------------------------------------- error feedback
def test_error_feedback_has_no_host_round_trip():
    ef = ErrorFeedback(momentum=0.9)
    g = grad(1000)
    sent = torch.tensor([1, 5, 999])

    def loop() -> None:
        for _ in range(2):
            c = ef.compensate("sparse", g)
            ef.update_sparse("sparse", c, sent)
            c = ef.compensate("dense", g)
            ef.update("dense", c, c * 0.5)

    assert record(loop) == []
    assert ef.residual("sparse")[sent].tolist() == [0.0] * 3
    assert ef.velocity("sparse")[sent].tolist() == [0.0] * 3
    assert record(ef.norm) == ["__float__"]  # a float comes back once, not per tensor


@pytest.mark.parametrize("bad", [1000, 1001, -1, -1000])
def test_error_feedback_still_rejects_bad_indices(bad):
    ef = ErrorFeedback()
    c = ef.compensate("x", torch.ones(1000))
    with pytest.raises(ValueError, match="out of range"):
        ef.update_sparse("x", c, torch.tensor([3, bad]))


# ---------------------------------------------------------------------- top-k
def test_topk_on_the_device_path_compacts_once(monkeypatch):
    """TopK with the selection CUDA tensors get (threshold + compaction): one
    synchronization, the candidate count; decompressing has none."""
    monkeypatch.setattr(topk, "topk_indices", selection.topk_threshold)
    x = grad(200_000)
    c = TopK(density=0.01, allow_nonfinite=True)
    payload: list[Any] = []
    assert record(lambda: payload.append(c.compress(x, name="w"))) == ["nonzero"]
    assert record(lambda: c.decompress(payload[0])) == []
    assert payload[0].arrays["indices"].tolist() == \
        selection.topk_indices(x, 2000).tolist()


def test_topk_reads_the_finiteness_flag_after_its_compaction(monkeypatch):
    monkeypatch.setattr(topk, "topk_indices", selection.topk_threshold)
    x = grad(200_000)
    assert record(lambda: TopK(density=0.01).compress(x, name="w")) == ["nonzero",
                                                                        "__bool__"]
    x[5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        TopK(density=0.01).compress(x, name="w")


def test_sampled_topk_compacts_once_per_pass(draws):
    """One compaction per sampling pass (a pass that falls short of k is redone with a
    larger sample), none for the exact selection among the candidates."""
    x = grad(200_000)
    c = SampledTopK(density=0.01, allow_nonfinite=True)
    payload: list[Any] = []
    calls = record(lambda: payload.append(c.compress(x, name="w")))
    assert set(calls) == {"nonzero"}
    assert 1 <= len(calls) <= c.refinements + 1
    assert draws == [x.device]  # the sample positions are drawn on the tensor's device
    assert record(lambda: c.decompress(payload[0])) == []
    idx = payload[0].arrays["indices"].long()
    assert idx.tolist() == selection.topk_indices(x, idx.shape[0]).tolist()
