"""Parameter-server mode (:mod:`mpicomm.ps`): the update path of the key-value store.

Multi-rank tests (``@pytest.mark.mpi``) run every (servers, workers) split the rank count
allows (``tests/ps_cases.py``); at 1 rank a parameter server cannot exist, those tests
skip and the configuration test checks the error instead. They cover sync, SSP and async
updates against allreduce references, the dense path and ``push_pull`` with replies sent
whole or in parts, an idle server's sleep, bad configurations and keys, and a push + pull
step against the alpha-beta bound on the virtual clock. Serial tests cover sharding, the
update rules against ``torch.optim``, a piece's reply parts, the wire format, the polling
backoff and the push + pull cost formula.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicomm
from mpicomm.ps import KVStore, server, wire
from mpicomm.ps.optim import ShardOptimizer
from mpicomm.ps.sharding import ShardPlan

from . import ps_cases
from .ps_cases import SHAPES, finish, grad, init_values, problem, splits, worker_comm

torch.set_num_threads(1)

split_small = ps_cases.split_small  # the fixture, where pytest looks for it


@pytest.fixture(params=[False, True], ids=["whole", "parts"])
def reply_parts(request, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Run a test with dense replies sent whole (the default for these small keys) and
    in parts (every piece, 3 parts cut at multiples of 8 elements: the pipelined update
    and reply of large pieces). Returns ``parts`` (which of the two) and ``seen``, the
    part counts of the reply headers this rank sent."""

    seen: list[int] = []
    head = wire.isend_head

    def counted(mpi, dest, tag, op, *args, **kw):
        if op == wire.REPLY:
            seen.append(len(args[-2] if len(args) >= 8 else kw["arrays"]))
        return head(mpi, dest, tag, op, *args, **kw)

    monkeypatch.setattr(wire, "isend_head", counted)
    if request.param:
        monkeypatch.setattr(server, "PIPELINE_MIN_BYTES", 0)
        monkeypatch.setattr(server, "PART_ALIGN", 8)
        monkeypatch.setattr(server, "REPLY_PARTS", 3)
    return SimpleNamespace(parts=request.param, seen=seen)


# ====================================================================== multi-rank
@pytest.mark.mpi
@pytest.mark.parametrize("opt", [dict(optimizer="sgd"),
                                 dict(optimizer="sgd", momentum=0.9, weight_decay=0.01),
                                 dict(optimizer="adam", weight_decay=0.01, lr=0.01)],
                         ids=["sgd", "momentum", "adam"])
def test_sync_equals_allreduce_sgd(comm, split_small, opt):
    for servers, _ in splits(comm.size):
        kv = KVStore(comm, servers=servers, mode="sync", **opt)
        wc = worker_comm(comm, servers)
        if kv.is_worker:
            prob = problem(kv.worker_rank)
            start = init_values()
            ref = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
            cls = torch.optim.Adam if opt["optimizer"] == "adam" else torch.optim.SGD
            kw = {k: v for k, v in opt.items() if k != "optimizer"}
            kw.setdefault("lr", 0.1)
            ref_opt = cls(list(ref.values()), **kw)
            for k, v in start.items():
                kv.init(k, v if kv.worker_rank == 0 else np.zeros_like(v))
            params = {k: kv.pull(k) for k in SHAPES}
            assert all(np.array_equal(params[k], start[k]) for k in SHAPES)
            for _ in range(6):
                for k in SHAPES:
                    kv.push(k, grad(prob, k, params[k]))
                    kv.pull(k, out=params[k])
                for k, p in ref.items():
                    g = grad(prob, k, p.detach().numpy())
                    p.grad = torch.from_numpy(mpicomm.allreduce(g, op="avg", comm=wc))
                ref_opt.step()
            for k in SHAPES:
                np.testing.assert_allclose(params[k], ref[k].detach().numpy(), rtol=0,
                                           atol=1e-12)
            wc.free()
        stats = finish(kv)
        assert stats["max_staleness"] == 0
        if kv.is_server:
            assert stats["duplicates"] == 0 and stats["updates"] > 0


@pytest.mark.mpi
def test_ssp_bound_with_slow_worker(comm):
    for servers, workers in splits(comm.size):
        s = 2
        kv = KVStore(comm, servers=servers, mode="ssp", staleness=s, lr=0.01)
        if kv.is_worker:
            kv.init("x", np.zeros(64, dtype=np.float32))
            for _ in range(10):
                if kv.worker_rank == 0:
                    time.sleep(0.02)  # the straggler
                kv.push("x", np.ones(64, dtype=np.float32))
                kv.pull("x")
        stats = finish(kv)
        seen = comm.allgather_object(stats["max_staleness"])
        assert max(seen) <= s, seen
        if workers > 1:  # the fast workers did run ahead (not lock-step)
            assert max(seen) >= 1, seen


@pytest.mark.mpi
def test_async_pushes_scaled_by_workers(comm):
    for servers, workers in splits(comm.size):
        kv = KVStore(comm, servers=servers, mode="async", lr=0.5)
        wc = worker_comm(comm, servers)
        if kv.is_worker:
            x0 = torch.linspace(-1, 1, 50, dtype=torch.float64)
            kv.init("x", x0)
            for _ in range(4):
                kv.push("x", torch.full((50,), float(kv.worker_rank + 1), dtype=torch.float64))
                assert isinstance(kv.pull("x"), torch.Tensor)
            wc.barrier()  # every push sent before anyone's final pull
            kv.push("x", torch.zeros(50, dtype=torch.float64))
            final = kv.pull("x")
            mean_g = (workers + 1) / 2
            torch.testing.assert_close(final, x0 - 0.5 * 4 * mean_g, rtol=0, atol=1e-12)
            wc.free()
        finish(kv)


def _grads(step: int, workers: int, n: int) -> list[torch.Tensor]:
    """Every worker's float32 gradient of ``step`` (each worker can compute all)."""
    return [torch.from_numpy(np.random.default_rng([step, w]).standard_normal(n)
                             .astype(np.float32)) for w in range(workers)]


@pytest.mark.mpi
def test_dense_path_is_bitwise_and_exactly_once(comm, split_small):
    """The dense path (pushes received into the servers' own buffers, sums and the
    ``1/W`` scaling in place, replies sent from the values, pulls received straight into
    ``out``): sync SGD equals, bit for bit, ``p - lr * ((g_0 + g_1 + ...) / W)`` summed
    left to right in float32, with the key split over the servers; a replayed push
    (already applied) is skipped and its values drained, so the next push is intact;
    async and SSP apply every push exactly once (the value after ``N`` pushes of ones
    is ``N`` steps of ``p - lr / W``, and the servers count ``N`` updates per piece)."""
    n, lr, steps = 1000, 0.25, 5
    for servers, workers in splits(comm.size):
        for mode in ("sync", "async", "ssp"):
            kw = {"staleness": 1} if mode == "ssp" else {}
            kv = KVStore(comm, servers=servers, mode=mode, lr=lr, **kw)
            wc = worker_comm(comm, servers)
            pieces = 0
            if kv.is_worker:
                kv.init("w", np.zeros(n, dtype=np.float32))
                info = kv._worker.info("w")
                pieces = len(info.pieces)
                ref = torch.zeros(n, dtype=torch.float32)
                out = np.empty(n, dtype=np.float32)
                for step in range(steps):
                    gs = _grads(step, workers, n) if mode == "sync" else \
                        [torch.ones(n, dtype=torch.float32)] * workers
                    if mode == "sync" and step == 3:   # replay of push 3, other values
                        for p in info.pieces:
                            sends = wire.isend_detached(
                                kv._worker.mpi, kv._worker.server_rank(p.server),
                                wire.TAG_REQUEST, wire.PUSH, info.key_id, p.index, 3,
                                kv.worker_rank, 3, arrays=[torch.full((p.numel,), 7.0)])
                            MPI.Request.Waitall([r for r, _ in sends])
                    kv.push("w", gs[kv.worker_rank].numpy())
                    if step % 3 == 0:    # a new array, numpy out=, torch out=
                        got = torch.from_numpy(kv.pull("w"))
                    elif step % 3 == 1:
                        kv.pull("w", out=out)
                        got = torch.from_numpy(out.copy())
                    else:
                        got = kv.pull("w", out=torch.empty(n)).clone()
                    if mode == "sync":
                        total = gs[0].clone()
                        for g in gs[1:]:
                            total.add_(g)
                        ref.add_(total / workers, alpha=-lr)
                        assert torch.equal(got, ref), (servers, step)
                wc.barrier()   # every push is in before the final pull
                final = torch.from_numpy(kv.pull("w"))
                if mode != "sync":
                    for _ in range(steps * workers):
                        ref.add_(torch.ones(n) / workers, alpha=-lr)
                assert torch.equal(final, ref), (mode, servers)
                wc.free()
            stats = finish(kv)
            pieces = max(comm.allgather_object(pieces))
            if kv.is_server:
                held = len(kv._server.pieces)
                updates = steps * (1 if mode == "sync" else workers) * held
                assert stats["updates"] == updates, (mode, stats)
                assert stats["duplicates"] == (workers * held if mode == "sync" else 0)
            comm.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("opt", [dict(optimizer="sgd"),
                                 dict(optimizer="sgd", momentum=0.9, weight_decay=0.01),
                                 dict(optimizer="adam", weight_decay=0.01)],
                         ids=["sgd", "momentum", "adam"])
def test_push_pull_replies_bitwise_whole_or_in_parts(comm, split_small, reply_parts, opt):
    """``push_pull`` with the servers' replies sent whole and in parts (the update done
    part by part, each part sent once updated): sync mode gives, bit for bit, the update
    rule applied on the whole key to ``(g_0 + g_1 + ...) / W`` after every step, for
    SGD, momentum with weight decay, and Adam; async applies each of ``N`` pushes once.
    With parts, the servers announced 3-part replies."""
    n, lr, steps = 1000, 0.05, 4
    kw = {k: v for k, v in opt.items() if k != "optimizer"}
    for servers, workers in splits(comm.size):
        for mode in ("sync", "async") if opt == {"optimizer": "sgd"} else ("sync",):
            kv = KVStore(comm, servers=servers, mode=mode, lr=lr, **opt)
            wc = worker_comm(comm, servers)
            if kv.is_worker:
                kv.init("w", np.zeros(n, dtype=np.float32))
                rule = ShardOptimizer(opt["optimizer"], lr, **kw)
                ref = torch.zeros(n, dtype=torch.float32)
                state = rule.init_state(ref)
                out = torch.empty(n, dtype=torch.float32)
                for step in range(steps):
                    gs = _grads(step, workers, n) if mode == "sync" else \
                        [torch.ones(n, dtype=torch.float32)] * workers
                    kv.push_pull("w", gs[kv.worker_rank].clone(), out=out)
                    if mode == "sync":
                        total = gs[0].clone()
                        for g in gs[1:]:
                            total.add_(g)
                        rule.step(ref, total.div_(workers) if workers > 1 else total, state)
                        assert torch.equal(out, ref), (servers, step)
                wc.barrier()   # every push is in before the final pull
                final = torch.from_numpy(kv.pull("w"))
                if mode == "async":
                    for _ in range(steps * workers):
                        rule.step(ref, torch.ones(n) / workers, state)
                assert torch.equal(final, ref), (mode, servers)
                wc.free()
            finish(kv)
            comm.barrier()
    if comm.rank == comm.size - 1:    # the last rank serves in every split
        assert reply_parts.seen and set(reply_parts.seen) <= {1, 3}
        assert (3 in reply_parts.seen) == reply_parts.parts


@pytest.mark.mpi
def test_replies_go_whole_across_hosts(comm, reply_parts):
    """Where the ranks span hosts (here every rank its own) the servers send every reply
    whole, even where pieces would be cut into parts on one host; the values are the
    same."""
    from mpicomm.topology import Topology

    splits(comm.size)
    last = comm.rank == comm.size - 1
    c = mpicomm.Communicator(comm.mpi.Dup(), topology=Topology(tuple(range(comm.size))))
    try:
        kv = KVStore(c, servers=1, mode="sync", lr=0.5)
        if kv.is_worker:
            kv.init("w", np.zeros(1000, dtype=np.float32))
            out = np.empty(1000, dtype=np.float32)
            for _ in range(3):
                kv.push_pull("w", np.ones(1000, dtype=np.float32), out=out)
            assert np.all(out == -1.5)   # three steps of p - 0.5 * mean(ones)
        finish(kv)
    finally:
        c.free()
    if last:
        assert reply_parts.seen and set(reply_parts.seen) == {1}


@pytest.mark.mpi
def test_idle_server_does_not_spin(comm, monkeypatch):
    """Past its spin window an idle server sleeps. The window is set to the one of a host
    with more ranks than cores (``wire.SPIN_SHARED_US``); with a core per rank the
    default window (``wire.SPIN_DEDICATED_US``) polls on purpose."""
    monkeypatch.setenv("MPICOMM_PS_SPIN_US", str(wire.SPIN_SHARED_US))
    for servers, _ in splits(comm.size)[:1]:
        kv = KVStore(comm, servers=servers, mode="async")
        if kv.is_worker:
            kv.init("x", np.zeros(8))
            time.sleep(0.5)  # the servers have nothing to do
            kv.push("x", np.ones(8))
            kv.pull("x")
        stats = finish(kv)
        if kv.is_server:
            assert stats["wall_s"] > 0.5
            assert stats["cpu_s"] < 0.5 * stats["wall_s"], stats  # asleep, not polling


@pytest.mark.mpi
def test_push_pull_reaches_the_alpha_beta_bound_on_the_virtual_clock(comm):
    """Two servers, one 1 MiB key split over both, 1 Gbit/s and 100 us links: a push +
    pull step within 10% of ``2 alpha + 2 max(W/S, 1) n beta``. That needs the staggered
    order (every server answering worker 0 first costs ``(W + S - 1)(n/S) beta`` each
    way: 1.33x the bound at 3 workers)."""
    from mpicomm import clock

    from .test_vclock import virtual

    if comm.size < 3:
        pytest.skip("needs two servers and a worker")
    n, servers = 1 << 20, 2
    workers = comm.size - servers
    step = 0.0
    with virtual(comm) as vc:
        kv = KVStore(vc, servers=servers, mode="sync", lr=0.0)
        wc = vc.split(0 if kv.is_worker else None)
        if kv.is_worker:
            g = np.ones(n // 4, dtype=np.float32)
            kv.init("g", g)
            for _ in range(2):
                wc.barrier()
                t0 = clock.now()
                kv.push("g", g)
                kv.pull("g", out=g)
                step = wc.allreduce_value(clock.now() - t0, "max")
            wc.free()
        finish(kv)
    if kv.is_worker:
        bound = 2 * 100e-6 + 2 * max(workers / servers, 1.0) * n * 8e-9
        assert 0.95 * bound <= step <= 1.1 * bound, (step, bound)


@pytest.mark.mpi
def test_bad_configuration_raises_everywhere(comm):
    cases = [dict(servers=0), dict(servers=comm.size), dict(servers=1, mode="bsp"),
             dict(servers=1, mode="ssp", staleness=-1), dict(servers=1, staleness=2),
             dict(servers=1, optimizer="lamb"), dict(servers=1, lr=-1.0),
             dict(servers=1, compressor="nope"), dict(servers=1, pull_compressor="nope")]
    for kwargs in cases:
        if comm.size == 1 and kwargs["servers"] == 1 and len(kwargs) > 1:
            kwargs = dict(kwargs, servers=0)  # at one rank every store is refused
        with pytest.raises(ValueError):
            KVStore(comm, **kwargs)
    with pytest.raises(TypeError):  # NotAnIntegerError: a TypeError and a ValueError
        KVStore(comm, servers=1.0)
    for bad in (dict(compressor=0.01), dict(pull_compressor=mpicomm.compress.TopK)):
        if comm.size > 1:  # at one rank servers=1 is refused first (ValueError above)
            with pytest.raises(TypeError, match="ompressor must be"):
                KVStore(comm, servers=1, **bad)
    with pytest.raises(ValueError):  # NotAnIntegerError is also a ValueError
        KVStore(comm, servers=1, mode="ssp", staleness=1.5)


@pytest.mark.mpi
def test_bad_keys_and_values(comm):
    for servers, workers in splits(comm.size):
        kv = KVStore(comm, servers=servers)
        if kv.is_worker:
            with pytest.raises(RuntimeError, match="server call"):
                kv.serve()
            kv.init("a", np.zeros((3, 4)))
            with pytest.raises(ValueError, match="already initialised"):
                kv.init("a", np.zeros((3, 4)))
            with pytest.raises(ValueError, match="unknown key"):
                kv.push("b", np.zeros((3, 4)))
            with pytest.raises(ValueError, match="shape"):
                kv.push("a", np.zeros(12))
            with pytest.raises(TypeError, match="dtype"):
                kv.push("a", np.zeros((3, 4), dtype=np.float32))
            with pytest.raises(TypeError, match="floating"):
                kv.init("i", np.zeros(3, dtype=np.int64))
            if workers > 1:  # a shape mismatch between workers: ValueError on every worker
                with pytest.raises(ValueError, match="same keys"):
                    kv.init("c", np.zeros(2 + (kv.worker_rank == 1)))
            np.testing.assert_array_equal(kv.pull("a"), np.zeros((3, 4)))
        else:
            with pytest.raises(RuntimeError, match="worker call"):
                kv.push("a", np.zeros((3, 4)))
        stats = finish(kv)
        if kv.is_server:
            assert stats["updates"] == 0  # nothing bad reached a server


# ====================================================================== serial
def test_sharding_balances_bytes_and_splits_large_keys():
    plan = ShardPlan(3, split_bytes=4000)
    big = plan.place(0, 3001, 4)  # 12004 bytes: split over all servers
    assert [p.server for p in big] == [0, 1, 2]
    assert sum(p.numel for p in big) == 3001 and big[0].start == 0 and big[-1].stop == 3001
    assert max(p.numel for p in big) - min(p.numel for p in big) <= 1
    for k, n in enumerate([900, 10, 500, 400, 20, 800], start=1):
        (piece,) = plan.place(k, n, 4)
        assert piece.numel == n
    assert max(plan.load) - min(plan.load) <= 900 * 4  # within the largest unsplit key
    assert ShardPlan(1, split_bytes=8).place(0, 100, 8)[0].server == 0
    with pytest.raises(ValueError):
        plan.place(0, 5, 4)


@pytest.mark.parametrize("kind,kw", [("sgd", {}), ("sgd", dict(momentum=0.9, weight_decay=0.1)),
                                     ("adam", dict(weight_decay=0.05))])
def test_update_rules_match_torch_optim(kind, kw):
    torch.manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(1000, dtype=torch.float64))
    p = p_ref.detach().clone()
    cls = torch.optim.Adam if kind == "adam" else torch.optim.SGD
    ref = cls([p_ref], lr=0.05, **kw)
    opt = ShardOptimizer(kind, 0.05, **kw)
    halves = [p[:400], p[400:]]  # a key split over two servers: elementwise rules
    states = [opt.init_state(h) for h in halves]
    whole = p.clone()   # one piece updated part by part (the server's pipelined reply)
    whole_state = opt.init_state(whole)
    bounds = [(0, 256), (256, 512), (512, 1000)]
    cut = p.clone()     # the same, given its parts as views (the server keeps them)
    cut_state = opt.init_state(cut)
    kept: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def cutter(t: torch.Tensor) -> list[torch.Tensor]:   # views kept, as the server does
        if id(t) not in kept or kept[id(t)][0] is not t:
            kept[id(t)] = (t, [t[a:b] for a, b in bounds])
        return kept[id(t)][1]

    for _ in range(20):
        g = torch.randn(1000, dtype=torch.float64)
        p_ref.grad = g.clone()
        ref.step()
        for h, st, gh in zip(halves, states, (g[:400], g[400:])):
            opt.step(h, gh.clone(), st)
        before = whole.clone()
        for done, (a, b) in zip(opt.step_parts(whole, g.clone(), whole_state, bounds),
                                bounds):
            assert done == (a, b)
            assert torch.equal(whole[b:], before[b:])   # later parts not yet touched
        assert list(opt.step_parts(cut, g.clone(), cut_state, bounds, cutter)) == bounds
    assert torch.equal(p, p_ref.detach())
    assert torch.equal(whole, p_ref.detach())
    assert torch.equal(cut, p_ref.detach())


def test_a_piece_keeps_the_views_of_its_own_tensors_only():
    value = torch.zeros(3 << 19)   # 6 MiB: three reply parts
    st = server.PieceState(0, 0, "w/0", value, {"momentum_buffer": torch.zeros(3 << 19)}, 2)
    assert len(st.bounds) == 3
    parts = st.parts(st.value)
    assert st.parts(st.value) is parts                     # kept
    buf = st.opt["momentum_buffer"]
    assert st.parts(buf) is st.parts(buf)                  # state: kept too
    grad = torch.ones_like(value)
    assert st.parts(grad) is not st.parts(grad)            # a gradient: cut afresh
    st.value = value.clone()                               # copy on write
    fresh = st.parts(st.value)
    assert fresh is not parts and fresh[0].data_ptr() == st.value.data_ptr()
    assert all(c[0] is not value for c in st.cuts.values())   # the old value let go
    assert st.parts(buf) is st.parts(buf)


def test_reply_parts_grow_with_the_piece():
    mib = 1 << 20
    assert server.reply_bounds(1000, 4) == [(0, 1000)]         # below the pipelining size
    for nbytes, parts in ((mib, 2), (4 * mib, 2), (16 * mib, 8), (17 * mib, 8)):
        bounds = server.reply_bounds(nbytes // 4, 4)
        assert len(bounds) == parts
        assert bounds[0][0] == 0 and bounds[-1][1] == nbytes // 4
        assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
        assert all(a % server.PART_ALIGN == 0 for a, _ in bounds)


def test_update_rule_arguments():
    with pytest.raises(ValueError):
        ShardOptimizer("rmsprop", 0.1)
    with pytest.raises(ValueError):
        ShardOptimizer("sgd", 0.1, momentum=1.0)
    with pytest.raises(ValueError):
        ShardOptimizer("adam", 0.1, momentum=0.9)
    with pytest.raises(TypeError):
        ShardOptimizer("sgd", "0.1")


def test_wire_roundtrip():
    arrays = [torch.randn(5, dtype=torch.float64), torch.arange(3, dtype=torch.int32),
              torch.randn(4).to(torch.bfloat16), torch.zeros(0, dtype=torch.float32)]
    m = wire.unpack(wire.pack(wire.PUSH, 7, 1, 11, 2, 13, arrays=arrays))
    assert (m.op, m.key_id, m.piece, m.a, m.b, m.c) == (wire.PUSH, 7, 1, 11, 2, 13)
    assert all(torch.equal(x, y) for x, y in zip(arrays, m.arrays))
    assert wire.reply_nbytes(5, 8) == len(wire.pack(wire.REPLY, 0, 0, arrays=arrays[:1]))
    # detached: the header announces the arrays, which travel on their own
    head = wire.pack(wire.PUSH, 7, 1, 11, 2, 13, 4, arrays=arrays, detached=True)
    m = wire.unpack(head)
    assert (m.op, m.key_id, m.piece, m.a, m.b, m.c, m.d) == (wire.PUSH, 7, 1, 11, 2, 13, 4)
    assert m.arrays == [] and m.follow == [(t.dtype, t.numel()) for t in arrays]
    assert len(head) == (wire.FIXED + 2 * len(arrays)) * 8
    assert wire.message_nbytes(arrays) == len(wire.pack(wire.PUSH, 0, 0, arrays=arrays))


def test_backoff_windows_from_environment(monkeypatch):
    assert (wire.Backoff().spin_s, wire.Backoff().max_s) == pytest.approx((200e-6, 1e-3))
    monkeypatch.setenv("MPICOMM_PS_SPIN_US", "3000")
    monkeypatch.setenv("MPICOMM_PS_MAX_SLEEP_US", "250")
    b = wire.Backoff()
    assert (b.spin_s, b.max_s) == pytest.approx((3e-3, 250e-6))
    b.expect(1e-3)   # an expected reply lengthens the no-sleep window, never shortens it
    assert b.spin_s == pytest.approx(3e-3)
    b.expect(0.02)
    assert b.spin_s == pytest.approx(0.02)
    b.expect(60.0)
    assert b.spin_s == wire.SPIN_CAP_S
    monkeypatch.setenv("MPICOMM_PS_SPIN_US", "-1")
    with pytest.raises(ValueError, match="MPICOMM_PS_SPIN_US"):
        wire.Backoff()


def test_backoff_polls_without_timed_sleeps_in_its_spin_window(monkeypatch):
    """The first ``spin_s`` of an idle period and every urgent wait only yield the core:
    a timed ``time.sleep`` (even of 0 s) lasts at least the timer slack, 50 us on Linux,
    which, once per poll, can space out the pieces of a large message."""
    slept = []
    monkeypatch.setattr(wire.time, "sleep", slept.append)
    b = wire.Backoff(spin_s=10.0)
    for _ in range(5):
        b.idle()
        b.idle(urgent=True)
    assert slept == []
    b = wire.Backoff(spin_s=0.0)
    b.idle()
    b.idle()   # past the window: timed sleeps with backoff
    assert slept and all(s > 0 for s in slept)


def test_ps_cost_formula():
    from mpicomm.collectives.cost import CostParams, paper_predict, ps_push_pull

    c = CostParams(alpha=3e-5, beta=1e-9, gamma=0.0)
    for w in (1, 2, 4, 7):  # one server: Table I of Tyagi & Swany with N - 1 = W
        assert ps_push_pull(1e6, w, 1, c) == pytest.approx(
            paper_predict("ps", 1e6, w + 1, c.alpha, c.beta), rel=1e-12)
    assert ps_push_pull(1e6, 4, 4, c) == pytest.approx(2 * 3e-5 + 2e6 * 1e-9)
    assert ps_push_pull(1e6, 4, 2, c) == pytest.approx(2 * 3e-5 + 4e6 * 1e-9)
    # more servers than workers: a worker's port carries its n bytes each way
    assert ps_push_pull(1e6, 2, 4, c) == pytest.approx(2 * 3e-5 + 2e6 * 1e-9)
    with pytest.raises(ValueError):
        ps_push_pull(1.0, 0, 1, c)
