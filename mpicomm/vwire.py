r"""The virtual clock's side of every message and MPI collective mpicomm runs.

The point-to-point layer calls these only when the virtual clock runs
(:func:`active`); on the wall clock nothing here is reached.

Point to point. Before MPI carries a message, :func:`isend` posts it to the shared table
(:mod:`mpicomm.emulate.vengine`) with the sender's virtual time; :func:`irecv` reserves
the receive's ordinal on its channel ``(communicator, source, tag)`` (MPI's
non-overtaking rule: the n-th receive posted on a channel matches the n-th message sent
on it; a probe fixes a wildcard receive's channel with :func:`probed`). Completion is
two-phase, :func:`block` before waiting in MPI (publishes what this thread waits for)
and :func:`finish` after: a send completes when its message has left the sender's
upload link, a receive at the message's arrival; the thread's clock moves to the
latest of these. Receives completed together are resolved in the order of their
arrival keys (deterministic).

MPI collectives (:func:`collective`): the caller runs the real MPI call, then every
member leaves at ``max(entry times) + cost`` where ``cost`` is the caller's model
(:func:`small_collective_cost` for the communicator's control helpers; the cost model's
prediction for ``algorithm="mpi"``). They do not occupy the links of the network model.

Every communicator whose point-to-point traffic or collectives are timed must be
registered (:func:`register`, collective; :class:`mpicomm.Communicator` does it for its
duplicates): ranks agree on an id, and the members' world ranks are recorded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mpi4py import MPI

from . import clock
from .emulate import vengine, vnet
from .emulate.linkdelay import world_ranks

__all__ = ["active", "register", "SendToken", "RecvToken", "isend", "irecv", "probed",
           "next_source", "sent", "release",
           "track", "complete", "block", "finish", "collective", "small_collective_cost",
           "link_alpha_beta", "world_rank", "start_collective", "complete_collectives",
           "Started", "STALL_S", "POLL_S"]

#: Real seconds a thread may wait for a resolution before the job is declared stuck
#: (a thread blocked outside mpicomm, e.g. in a raw mpi4py call, holds back virtual
#: time), unless ``MPICOMM_VIRTUAL_STALL_S`` set another limit when the clock started.
STALL_S = vnet.DEFAULT_STALL_S
#: Longest sleep between tests of a thread waiting in MPI under the virtual clock (its
#: real waiting time is free, so it leaves the cores to the ranks that compute).
POLL_S = 1e-3
#: Longest real time between two resolution passes of a waiting thread when the shared
#: table shows no change.
_RETRY_S = 0.05
_T = TypeVar("_T")


def active() -> bool:
    return clock._virtual is not None


@dataclass
class _CommInfo:
    cid: int
    world: list[int]
    coll_seq: int = 0
    sent: dict[tuple[int, int], int] = field(default_factory=dict)      # (dest, tag)
    received: dict[tuple[int, int], int] = field(default_factory=dict)  # (source, tag)


_comms: dict[int, _CommInfo] = {}
_next_cid = 1
_tracked: dict[int, Any] = {}


def register(mpi_comm: MPI.Intracomm) -> None:
    """Give ``mpi_comm`` an id agreed by its ranks (collective; a no-op on the wall
    clock). Ids are unique among communicators that share a rank."""
    global _next_cid
    if not active():
        return
    cid = mpi_comm.allreduce(_next_cid, op=MPI.MAX)
    _next_cid = cid + 1
    _comms[mpi_comm.py2f()] = _CommInfo(cid, world_ranks(mpi_comm))


def _info(mpi_comm: MPI.Comm) -> _CommInfo:
    info = _comms.get(mpi_comm.py2f())
    if info is None:
        raise RuntimeError("virtual clock: a communicator that is not registered carries "
                           "mpicomm traffic; create it through mpicomm.Communicator")
    return info


def world_rank(mpi_comm: MPI.Comm, rank: int) -> int:
    """World rank of ``rank`` of a registered communicator."""
    return _info(mpi_comm).world[rank]


@dataclass
class SendToken:
    aid: int
    seq: int
    lb: float       # earliest completion
    remote: bool = True     # to another host (through the upload link)


@dataclass
class RecvToken:
    cid: int
    src: int        # world rank
    tag: int
    ordinal: int


def _state() -> tuple[clock._Virtual, clock._Actor]:
    v = clock._virtual
    assert v is not None
    return v, v.actor()


def isend(mpi_comm: MPI.Comm, dest: int, tag: int, nbytes: int) -> SendToken:
    """Post a message of ``nbytes`` to ``dest`` (a rank of ``mpi_comm``) at this thread's
    time; call before handing it to MPI."""
    v, a = _state()
    info = _info(mpi_comm)
    dst = info.world[dest]
    key = (dest, tag)
    ordinal = info.sent.get(key, 0)
    info.sent[key] = ordinal + 1
    eng = v.engine
    seq = eng.try_post(a.aid, dst, info.cid, tag, ordinal, float(nbytes), a.t)
    if seq is None:
        seq = _await(lambda: eng.try_post(a.aid, dst, info.cid, tag, ordinal,
                                          float(nbytes), a.t), "room for a message")
    remote = v.platform.hosts[dst] != v.platform.hosts[v.rank]
    rate = v.platform.conditions(a.t, a.step)[0] if remote else v.platform.shm_rate
    return SendToken(a.aid, seq, a.t + nbytes / rate, remote)


def irecv(mpi_comm: MPI.Comm, source: int, tag: int) -> RecvToken:
    """Reserve the next ordinal of channel ``(mpi_comm, source, tag)`` (a receive with a
    known source and tag, posted in this order)."""
    info = _info(mpi_comm)
    key = (source, tag)
    ordinal = info.received.get(key, 0)
    info.received[key] = ordinal + 1
    return RecvToken(info.cid, info.world[source], tag, ordinal)


def probed(mpi_comm: MPI.Comm, status: MPI.Status) -> RecvToken:
    """The token of a message matched by a probe (its source and tag from ``status``)."""
    return irecv(mpi_comm, status.Get_source(), status.Get_tag())


def next_source(mpi_comm: MPI.Comm, tags: Sequence[int],
                sources: Sequence[int] | None = None) -> tuple[int, int]:
    """``(source, tag)`` of the message this thread receives next on ``mpi_comm`` with
    one of ``tags``, from any other rank: the one that arrives first in virtual time
    (ties: lower source, then tag), once no other can arrive earlier. The virtual
    clock's deterministic answer to a wildcard probe; the caller then probes that very
    message (``MPI_Mprobe(source, tag)``) and completes it with :func:`probed` and
    :func:`finish`. ``sources``: the ranks of ``mpi_comm`` it may come from (default:
    every other rank). Waits, as waiting for messages from those ranks."""
    v, a = _state()
    info = _info(mpi_comm)
    me = v.rank
    members = [r for r, w in enumerate(info.world) if w != me
               and (sources is None or r in sources)]
    block([], sources=[info.world[r] for r in members])

    def decide() -> tuple[int, int] | None:
        expected = {(info.world[r], t): info.received.get((r, t), 0)
                    for r in members for t in tags}
        return v.engine.earliest(me, info.cid, expected)

    src, tag = _await(decide, "the next message of a wildcard receive")
    return info.world.index(src), tag


def sent(request: MPI.Request) -> bool:
    """Whether a tracked send is complete for a loop that tests and drops its sends:
    MPI has completed it *and* its message left the upload link by this thread's time
    (then it is released: the thread will not wait for it). A send that MPI finished
    early in real time but that is still on the link in virtual time stays pending, so
    a later wait takes its completion time: what the clock reads never depends on when
    the real transfer happened to finish."""
    entry = _tracked.get(id(request))
    token = entry[1] if entry is not None and entry[0] is request else None
    if isinstance(token, SendToken):
        v, a = _state()
        if token.lb > a.t:
            return False
        up = v.engine.upload(token.aid, token.seq)
        if up is None:
            v.engine.advance()
            up = v.engine.upload(token.aid, token.seq)
        if up is None or up[1] > a.t:
            return False
    if not request.Test():
        return False
    release(request)
    return True


def release(request: MPI.Request) -> None:
    """A tracked send completed without a wait (tested and dropped): its thread does not
    wait for its completion time."""
    token = _take(request)
    if isinstance(token, SendToken):
        v, _ = _state()
        v.engine.release(token.aid, token.seq)


def track(request: MPI.Request, token: SendToken | RecvToken) -> MPI.Request:
    """Remember which message ``request`` carries (for :func:`complete`); the request is
    kept with it, so its id cannot be reused while it is tracked."""
    _tracked[id(request)] = (request, token)
    return request


def _take(request: MPI.Request) -> SendToken | RecvToken | None:
    entry = _tracked.pop(id(request), None)
    if entry is None or entry[0] is not request:
        return None
    return entry[1]


def complete(requests: Sequence[MPI.Request], poll_s: float | None,
             wait: Callable[[Sequence[MPI.Request], float | None], None]) -> None:
    """Complete tracked ``requests`` with ``wait`` (the real MPI wait) and advance this
    thread's clock to their completion (see the module docstring)."""
    tokens = [t for t in map(_take, requests) if t is not None]
    block(tokens)
    try:
        wait(requests, poll_s)
    finally:
        finish(tokens)


def block(tokens: Sequence[SendToken | RecvToken], sources: Sequence[int] = ()) -> None:
    """Publish that this thread now waits for ``tokens`` (and for messages from the world
    ranks ``sources``, for a probe of a message not matched yet)."""
    v, a = _state()
    sends = [t for t in tokens if isinstance(t, SendToken)]
    srcs = {t.src for t in tokens if isinstance(t, RecvToken)} | set(sources)
    low = max([a.t] + [s.lb for s in sends])
    last = _last_send(a.aid, sends)
    if srcs:
        v.engine.set_state(a.aid, vengine.RECV, low, ranks=srcs, send=last)
    else:
        v.engine.set_state(a.aid, vengine.RESOLVE, a.t, lb=low, send=last)


def _last_send(aid: int, sends: Sequence[SendToken]) -> int:
    """The last of actor ``aid``'s own sends to other hosts among ``sends`` (-1: none):
    the engine raises the waiting actor's floor to its completion as its upload is
    resolved. (While a thread waits in MPI for sends that queue on a busy upload link,
    a floor from their send times alone would stay below what its receivers wait
    for, and the receivers' downloads, which wait for that floor, would never be
    resolved.)"""
    return max((s.seq for s in sends if s.aid == aid and s.remote), default=-1)


def finish(tokens: Sequence[SendToken | RecvToken]) -> None:
    """After MPI completed ``tokens``: resolve their times and move this thread's clock."""
    v, a = _state()
    eng = v.engine
    end = a.t
    found = []
    for t in tokens:
        if isinstance(t, RecvToken):
            loc = eng.find(t.src, v.rank, t.cid, t.tag, t.ordinal)
            if loc is None:    # posted before MPI sent it: only a lost update can do this
                loc = _await(lambda t=t: eng.find(t.src, v.rank, t.cid, t.tag, t.ordinal),
                             "a received message's record")
            found.append(loc)
    lbs = [s.lb for s in tokens if isinstance(s, SendToken)]
    for aid, seq in found:
        m = eng.message(aid, seq)
        lbs.append(m["tsend"] + m["delay"] + m["nbytes"] / m["rate"])
    low = max(lbs, default=a.t)
    last = _last_send(a.aid, [t for t in tokens if isinstance(t, SendToken)])
    eng.set_state(a.aid, vengine.RESOLVE, a.t, lb=low, send=last)
    try:
        for s in tokens:
            if isinstance(s, SendToken):
                _, u1 = _await(lambda s=s: eng.upload(s.aid, s.seq, release=True),
                               "a send's upload")
                end = max(end, u1)
        ordered = []
        for aid, seq in found:
            u0, u1 = _await(lambda aid=aid, seq=seq: eng.upload(aid, seq),
                            "a received message's upload")
            m = eng.message(aid, seq)
            ordered.append((u0 + m["delay"], aid, seq, u1, m))
        ordered.sort(key=lambda x: x[:3])
        # A message that queued on its sender's upload arrives no earlier than its upload
        # ends plus the latency: raise the floor to that before waiting for downloads.
        # With the send-time bound alone, a rank waiting for this one (on the sender's
        # host, say) keeps a floor below the download's key, and the download, which
        # waits for that rank's floor, is never resolved.
        late = max([end, low] + [u1 + m["delay"] for _, _, _, u1, m in ordered])
        if late > low:
            eng.set_state(a.aid, vengine.RESOLVE, a.t, lb=late)
        local = eng.receiver_resolves(v.rank)
        for key, aid, seq, u1, m in ordered:
            if m["flags"] & vengine.INTRA:
                arrival = m["arr"]
            elif local:
                arrival = max(a.gap.fill(key, m["nbytes"] / m["rate"]), u1 + m["delay"])
            else:
                arrival = _await(lambda aid=aid, seq=seq: eng.arrival(aid, seq),
                                 "a message's download")
            end = max(end, arrival)
            if m["step"] > a.step:
                a.step = int(m["step"])
                eng.set_step(a.aid, a.step)
            eng.consume(aid, seq)
    finally:
        a.to(end)
        eng.set_state(a.aid, vengine.RUNNING, a.t)


def _await(fn: Callable[[], _T | None], what: str) -> _T:
    """Poll ``fn`` (advancing the network between tries) until it gives a value."""
    v = clock._virtual
    assert v is not None
    eng, sleep, since = v.engine, 50e-6, time.monotonic()
    seen, tried = -1, since
    while True:
        # resolve again only when the table changed since the last try (or now and
        # then: an unlocked clock store may not count): P waiters re-scanning an
        # unchanged table would take the lock from the ranks that make progress
        version, moment = eng.version(), time.monotonic()
        if version != seen or moment - tried > _RETRY_S:
            seen, tried = version, moment
            eng.advance()
        got = fn()
        if got is not None:
            return got
        MPI.COMM_WORLD.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)   # keep MPI progressing
        time.sleep(sleep)
        sleep = min(2 * sleep, 2e-3)
        limit = STALL_S if v.stall_s is None else v.stall_s
        if time.monotonic() - since > limit:
            raise RuntimeError(f"virtual clock: rank {v.rank} waited {limit:g} s for "
                               f"{what}; held back by {_laggards(eng)} (a thread blocked "
                               "outside mpicomm, e.g. in a raw mpi4py call, stops "
                               "virtual time)")


_STATES = {vengine.RUNNING: "running", vengine.RECV: "waiting for messages",
           vengine.RESOLVE: "waiting for a link", vengine.COLL: "in an MPI collective",
           vengine.IDLE: "idle", vengine.JOIN: "joining a thread"}


def _laggards(eng: vengine.Engine) -> str:
    with eng:
        floors = eng.floors()
        kinds = {a: eng.a_wkind[a] for a in floors}
    low = sorted(floors.items(), key=lambda kv: kv[1])[:3]
    return ", ".join(f"rank {a // eng.T} thread {a % eng.T} at {f:.6f} s "
                     f"({_STATES.get(kinds[a], 'state ' + str(kinds[a]))})" for a, f in low)


# ---------------------------------------------------------------------- collectives
def link_alpha_beta(mpi_comm: MPI.Comm) -> tuple[float, float]:
    """``(alpha, beta)`` that the communicator's ranks see now: shared memory when they
    all share a host, else the network's conditions at this thread's time."""
    v, a = _state()
    hosts = {v.platform.hosts[r] for r in _info(mpi_comm).world}
    if len(hosts) == 1:
        return v.platform.shm_delay, 1 / v.platform.shm_rate
    rate, delay = v.platform.conditions(a.t, a.step)
    return delay, 1 / rate


def small_collective_cost(kind: str, nbytes: float, p: int, alpha: float,
                          beta: float) -> float:
    """The model of MPI's own collectives on small data (the control helpers):
    ``barrier``: ⌈lg p⌉·α; ``allreduce``/``bcast``: ⌈lg p⌉·(α + nβ) (recursive doubling,
    binomial tree); ``allgather``: ⌈lg p⌉·α + (p-1)·nβ (``n`` bytes per rank)."""
    if p <= 1:
        return 0.0
    lg = math.ceil(math.log2(p))
    if kind == "barrier":
        return lg * alpha
    if kind in ("allreduce", "bcast"):
        return lg * (alpha + nbytes * beta)
    if kind == "allgather":
        return lg * alpha + (p - 1) * nbytes * beta
    raise ValueError(f"no model for MPI collective {kind!r}")


@dataclass
class Started:
    """A nonblocking MPI collective under way (:func:`start_collective`)."""

    mpi_comm: MPI.Intracomm
    seq: int
    latest: Any            # the members' latest entry time, once the request is done
    request: MPI.Request


def start_collective(mpi_comm: MPI.Intracomm) -> Started:
    """Record this thread's entry into a nonblocking MPI collective it starts now on
    ``mpi_comm`` (a small max-allreduce of the entry times runs beside it)."""
    import numpy as np

    v, a = _state()
    info = _info(mpi_comm)
    info.coll_seq += 1
    latest = np.array([a.t])
    return Started(mpi_comm, info.coll_seq, latest,
                   mpi_comm.Iallreduce(MPI.IN_PLACE, latest, op=MPI.MAX))


def complete_collectives(started: Sequence[Started], requests: Sequence[MPI.Request],
                         poll_s: float | None,
                         wait: Callable[[Sequence[MPI.Request], float | None], None],
                         cost: Callable[[float, float, int], float]) -> None:
    """Wait (``wait``) for the real ``requests`` of collectives started with
    :func:`start_collective`; this thread continues from the later of its time and each
    one's latest entry plus ``cost(alpha, beta, p)``."""
    if not started:
        wait(requests, poll_s)
        return
    v, a = _state()
    first = started[0]
    info = _info(first.mpi_comm)
    v.engine.set_state(a.aid, vengine.COLL, a.t, ranks=info.world, comm=info.cid,
                       seq=first.seq)
    try:
        wait([*requests, *(s.request for s in started)], poll_s)
        for s in started:
            alpha, beta = link_alpha_beta(s.mpi_comm)
            a.to(float(s.latest[0]) + cost(alpha, beta, s.mpi_comm.Get_size()))
        for s in started:
            v.engine.left_collective(v.rank, _info(s.mpi_comm).cid, s.seq)
    finally:
        v.engine.set_state(a.aid, vengine.RUNNING, a.t)


def collective(mpi_comm: MPI.Intracomm, run: Callable[[], _T],
               cost: Callable[[float, float, int], float]) -> _T:
    """Run the real MPI collective ``run()``; every member leaves at the latest entry
    time plus ``cost(alpha, beta, p)`` (:func:`link_alpha_beta`)."""
    v, a = _state()
    info = _info(mpi_comm)
    info.coll_seq += 1
    seq, entry = info.coll_seq, a.t
    v.engine.set_state(a.aid, vengine.COLL, entry, ranks=info.world, comm=info.cid,
                       seq=seq)
    try:
        result = run()
        latest = mpi_comm.allreduce(entry, op=MPI.MAX)
        alpha, beta = link_alpha_beta(mpi_comm)
        a.to(latest + cost(alpha, beta, mpi_comm.Get_size()))
        v.engine.left_collective(v.rank, info.cid, seq)
    finally:
        v.engine.set_state(a.aid, vengine.RUNNING, a.t)
    return result
