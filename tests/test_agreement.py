"""Cross-rank agreement: settings that must be equal on every rank are checked, not assumed.

Multi-rank (``@pytest.mark.mpi``): ``MPICOMM_RING_SEGMENT_BYTES`` is read checked and
compared by checked mode; ``algorithm="auto"`` is resolved before the ranks compare their
calls (so different cost parameters are caught); LocalSGD with AdaComm agrees on the
learning rate; averaged momentum buffers have the same layout on every rank even when a
parameter got no gradient on some of them. Serial: the configuration reader.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm.collectives.cost import CostParams, choose
from mpicomm.config import RING_SEGMENT_BYTES, env_int, ring_segment_bytes
from mpicomm.control import AdaComm
from mpicomm.torch import LocalSGD

torch.set_num_threads(1)

SEG = "MPICOMM_RING_SEGMENT_BYTES"


# ---------------------------------------------------------------------- serial
def test_ring_segment_bytes_is_read_checked(monkeypatch):
    monkeypatch.delenv(SEG, raising=False)
    assert ring_segment_bytes() == RING_SEGMENT_BYTES
    monkeypatch.setenv(SEG, " 4096 ")
    assert ring_segment_bytes() == 4096
    for bad in ("abc", "1.5", "0", "-8", "1e6"):
        monkeypatch.setenv(SEG, bad)
        with pytest.raises(ValueError, match=SEG):
            ring_segment_bytes()
    with pytest.raises(ValueError, match="MPICOMM_X"):
        monkeypatch.setenv("MPICOMM_X", "7")
        env_int("MPICOMM_X", 1, low=8)


def test_config_table_lists_every_variable_the_package_reads():
    """Every ``MPICOMM_*`` variable the package reads is in config.py's table (before,
    ``MPICOMM_RING_SEGMENT_BYTES`` was read in ``_ring.py`` only, with a bare ``int()``)."""
    import pathlib
    import re

    import mpicomm.config as config

    root = pathlib.Path(mpicomm.__file__).parent
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r'"(MPICOMM_[A-Z_]+)"', path.read_text()))
    assert "MPICOMM_RING_SEGMENT_BYTES" in read
    assert {v for v in read if f"``{v}``" not in config.__doc__} == set()


# ---------------------------------------------------------------------- collectives
@pytest.mark.mpi
def test_bad_segment_variable_raises_on_every_rank(comm, monkeypatch):
    x = np.ones(8, np.float32)
    monkeypatch.setenv(SEG, "lots")
    for call in (lambda: mpicomm.allreduce(x, algorithm="ring", comm=comm),
                 lambda: mpicomm.allgather(x, comm=comm),
                 lambda: mpicomm.allgatherv(x[:comm.rank], comm=comm),
                 lambda: mpicomm.broadcast(x, comm=comm),
                 lambda: mpicomm.reduce_scatter(np.ones(comm.size, np.float32), comm=comm)):
        with pytest.raises(ValueError, match=SEG):
            call()
    monkeypatch.delenv(SEG)
    assert mpicomm.allreduce(x, comm=comm)[0] == comm.size  # still in step


@pytest.mark.mpi(min_size=2)
def test_segment_size_differing_across_ranks_is_caught(comm, monkeypatch):
    """Before: ranks cut ring blocks into different segments and the transfers did not
    match (MPI truncation error on one rank, a hang on the others)."""
    monkeypatch.setenv(SEG, "16" if comm.rank == comm.size - 1 else "32")
    x = np.arange(64, dtype=np.float32)
    with pytest.raises(ValueError, match="segment_bytes"):
        mpicomm.allreduce(x, algorithm="ring", comm=comm)
    with pytest.raises(ValueError, match=SEG):
        mpicomm.allgatherv(x[:comm.rank + 1], comm=comm)
    monkeypatch.setenv(SEG, "16")
    np.testing.assert_array_equal(mpicomm.allreduce(x, algorithm="ring", comm=comm),
                                  x * comm.size)


@pytest.mark.mpi(min_size=2)
def test_auto_resolved_before_the_ranks_compare(comm):
    """Ranks whose cost parameters make ``auto`` pick different algorithms are caught in
    checked mode (before: the check compared the unresolved ``"auto"`` and the ranks ran
    different algorithms against each other)."""
    n = 4 * 4 * comm.size
    latency = CostParams(alpha=1.0, beta=0.0, gamma=0.0)
    bandwidth = CostParams(alpha=0.0, beta=1.0, gamma=1.0)
    assert choose("allreduce", n, comm.size, latency) != \
        choose("allreduce", n, comm.size, bandwidth)
    saved = comm.resources.get("cost_params")
    comm.resources["cost_params"] = latency if comm.rank == 0 else bandwidth
    try:
        with pytest.raises(ValueError, match="algorithm"):
            mpicomm.allreduce(np.ones(n // 4, np.float32), comm=comm)
    finally:
        if saved is None:
            comm.resources.pop("cost_params", None)
        else:
            comm.resources["cost_params"] = saved
    # an explicit choice on some ranks that equals the others' auto is fine
    algo = choose("allreduce", n, comm.size, comm.resources.get("cost_params"))
    mine = algo if comm.rank % 2 else "auto"
    out = mpicomm.allreduce(np.ones(n // 4, np.float32), algorithm=mine, comm=comm)
    np.testing.assert_array_equal(out, np.full(n // 4, comm.size, np.float32))


# ---------------------------------------------------------------------- LocalSGD
def _linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


@pytest.mark.mpi(min_size=2)
def test_adacomm_learning_rate_must_agree(comm):
    model = _linear()
    lr = 0.1 if comm.rank < comm.size - 1 else 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    local = LocalSGD(model, AdaComm(2, interval_rounds=1), opt, comm=comm)
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match="learning rate differs"):
        for _ in range(4):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            local.step(loss)


@pytest.mark.mpi
def test_adacomm_equal_learning_rates_pass(comm):
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSGD(model, AdaComm(2, interval_rounds=1), opt, comm=comm)
    x = torch.ones(2, 4) * (1 + comm.rank / comm.size)  # in [1, 2): stable at any size
    for _ in range(6):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        local.step(loss)
    assert local.rounds >= 2


@pytest.mark.mpi
def test_momentum_layout_same_when_a_parameter_got_no_gradient_on_some_rank(comm):
    """The second layer gets a gradient on odd ranks only, so even ranks have no
    momentum buffer for it. Before: the fused momentum buffers had different sizes on
    different ranks (a checked-mode error or a hang, or silently mixed-up values)."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    local = LocalSGD(model, 1, opt, average_momentum=True, comm=comm)
    first, second = model[0], model[1]
    uses_second = comm.rank % 2 == 1
    x = torch.full((2, 4), float(comm.rank + 1))
    opt.zero_grad()
    h = first(x)
    loss = (second(h) if uses_second else h).square().mean()
    loss.backward()
    local_bufs = {}
    opt.step()
    for name, p in model.named_parameters():
        buf = opt.state.get(p, {}).get("momentum_buffer")
        local_bufs[name] = None if buf is None else buf.clone()
    local.step()
    for name, p in model.named_parameters():
        buf = opt.state.get(p, {}).get("momentum_buffer")
        owners = comm.allgather_object(local_bufs[name])
        present = [b for b in owners if b is not None]
        if not present:
            assert buf is None
            continue
        expected = sum(present) / comm.size  # missing buffers count as zeros
        assert buf is not None, name
        torch.testing.assert_close(buf, expected.to(buf.dtype), rtol=1e-6, atol=1e-7)
    digests = comm.allgather_object([b.numpy().tobytes() for b in
                                     (opt.state[p]["momentum_buffer"] for p in model.parameters()
                                      if "momentum_buffer" in opt.state.get(p, {}))])
    assert all(d == digests[0] for d in digests)


@pytest.mark.mpi
def test_dup_carries_calibrated_cost_parameters(comm):
    """GradientSync and other users of ``comm.dup()`` choose ``auto`` algorithms with the
    parameters calibrated on ``comm`` (before: a dup started from the defaults)."""
    params = CostParams(alpha=1.0, beta=0.0, gamma=0.0)
    saved = comm.resources.get("cost_params")
    comm.resources["cost_params"] = params
    try:
        d = comm.dup()
        assert d.resources["cost_params"] is params
        d.free()
        assert d.resources == {}  # free() drops the caches with the communicators
    finally:
        if saved is None:
            comm.resources.pop("cost_params", None)
        else:
            comm.resources["cost_params"] = saved
