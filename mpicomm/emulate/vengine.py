r"""Resolving the virtual network's shared links in virtual-time order, across processes.

Every rank of a virtual-clock job (:mod:`mpicomm.clock`) maps one shared-memory table
(a file under ``/dev/shm``, unlinked as soon as every rank has it open):

* one row per **actor** (a thread with its own virtual clock: a rank's main thread, a
  communication thread, ...): its clock and what it is doing (running, waiting for
  messages from some ranks, waiting for a link to be resolved, inside an MPI
  collective, idle until another thread of its rank hands it work);
* one ring of **messages** per actor: every point-to-point message a rank sends through
  mpicomm is posted here (destination, communicator id, tag, its ordinal on that
  channel, bytes, virtual send time, the conditions in force) before MPI carries the
  data; the receiver finds it by ``(source, destination, communicator, tag, ordinal)``
  (MPI's non-overtaking rule makes the n-th receive on a channel match the n-th send);
* per network **port** (a host's NIC; one per host unless ``MPICOMM_HOST_NICS`` gives
  more): when its upload link (and, for ports of several ranks, its download) is free.

**Determinism.** A link shared by several actors must serve its messages in
virtual-time order (ties: actor id, then sequence number), whatever order the operating
system runs the processes in. A message is resolved on a shared link only once no actor
can still post an earlier one: for every actor that could, a *floor* (a lower bound on
the virtual time of anything it can still send) must exceed the message's key. Floors
come from the table (conservative parallel discrete-event simulation, Chandy & Misra,
"Distributed simulation: a case study in design and verification of distributed
programs", IEEE TSE 1979):

* running: its clock (it can send right away);
* waiting for messages from ranks ``S``: ``max(clock, min(earliest possible arrival of
  a message already posted to it from S, min over s in S of floor(s) + lookahead))``,
  the lookahead being the smallest one-way latency between the two ranks;
* waiting for a link resolution: ``max(clock, that message's earliest completion)``;
  waiting for its own sends (in MPI, or for a resolution), at least the completion of
  the last of them to another host, followed as its upload is resolved: its upload's
  end, or until then the upload link's free time plus its transmission;
* inside an MPI collective: ``max(clock, clocks of the members already inside it,
  min floor of the members not yet inside)``; a member that has left it adds nothing
  (all have entered; where it has gone since would give too high a floor);
* idle or joining another thread of its rank: ``max(clock, min(stamp of work already
  handed to it, floors of the other threads of its rank))``.

These are computed together with a Dijkstra-style pass in increasing order (a set of
actors that only wait for each other gets no finite floor: that is a deadlock of the
program itself). Every resolution is a function of the posted messages alone, so any
process may perform it (under one lock), and every run gives the same virtual times.

A link used by one actor only (one rank per port, no helper thread) is resolved when
its message is posted. Downloads of a port with one rank are resolved by the receiver
itself (:class:`mpicomm.emulate.vnet.GapLink`) in program order, others here.

Costs: every post, state change and resolution takes a process lock and an ``flock``
(a few microseconds); a waiting actor re-checks with a sleeping backoff (50 us to 2 ms)."""

from __future__ import annotations

import fcntl
import heapq
import mmap
import os
import tempfile
import threading
from collections.abc import Iterable

from .vnet import Platform

__all__ = ["Engine", "RUNNING", "RECV", "RESOLVE", "COLL", "IDLE", "JOIN", "DONE",
           "SLOTS", "THREADS"]

RUNNING, RECV, RESOLVE, COLL, IDLE, JOIN, DONE = range(7)
#: Messages a single actor may have in flight (posted, not yet received and resolved).
SLOTS = 2048
#: Actors (threads with their own clock) alive at once per rank (a rank's main thread,
#: GradientSync's communication thread, a Crossover job's sync thread, ...).
THREADS = 8
#: Communicators per rank whose last collective left is remembered (slot: id modulo).
LEFT_SLOTS = 64
INF = float("inf")
_MAGIC = 0x6D70636F6D6D7643  # "mpcommvC"
_VERSION = 4                  # header slot of the change counter

# message flags
POSTED, UPLOADED, DOWNLOADED, CONSUMED, INTRA, RELEASED = 1, 2, 4, 8, 16, 32

_ACTOR_D = ("clock", "wlb", "qmin")
_ACTOR_Q = ("status", "wkind", "wcomm", "wseq", "wsend", "step", "seq", "head", "up")
_MSG_D = ("nbytes", "tsend", "rate", "delay", "u0", "u1", "arr")
_MSG_Q = ("dst", "comm", "tag", "ord", "step", "flags")


class Engine:
    """The shared table of one job (see the module docstring). One per process.

    ``path`` names the shared file; the process that ``create``\\ s it sizes it. All
    public methods are thread-safe.
    """

    def __init__(self, path: str, platform: Platform, create: bool,
                 threads: int = THREADS, slots: int = SLOTS):
        self.platform = platform
        self.P, self.T, self.N = platform.size, threads, slots
        self.A = self.P * self.T
        self.H = platform.num_ports        # links are per port (NIC), not per host
        self.hosts, self.ports = platform.hosts, platform.ports
        self._port_host = {q: h for q, h in zip(self.ports, self.hosts)}
        self.lookahead = platform.min_delay()
        layout: list[tuple[str, str, int]] = [("hdr", "q", 8)]
        layout += [("up_free", "d", self.H), ("dl_free", "d", self.H)]
        layout += [(f"a_{n}", "d", self.A) for n in _ACTOR_D]
        layout += [(f"a_{n}", "q", self.A) for n in _ACTOR_Q]
        layout += [(f"m_{n}", "d", self.A * self.N) for n in _MSG_D]
        layout += [(f"m_{n}", "q", self.A * self.N) for n in _MSG_Q]
        layout += [("a_wsrc", "B", self.A * self.P)]
        layout += [("r_lcid", "q", self.P * LEFT_SLOTS), ("r_lseq", "q", self.P * LEFT_SLOTS)]
        offset, spans = 0, {}
        for name, fmt, count in layout:
            size = 1 if fmt == "B" else 8
            spans[name] = (fmt, offset, count)
            offset += (count * size + 7) // 8 * 8
        self.nbytes = offset
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self._fd, self.nbytes)
        self._mm = mmap.mmap(self._fd, self.nbytes)
        view = memoryview(self._mm)
        for name, (fmt, off, count) in spans.items():
            size = 1 if fmt == "B" else 8
            setattr(self, name, view[off:off + count * size].cast(fmt))
        if create:
            self.hdr[0] = _MAGIC
            self.hdr[1], self.hdr[2], self.hdr[3] = self.P, self.T, self.N
        elif self.hdr[0] != _MAGIC or (self.hdr[1], self.hdr[2], self.hdr[3]) != \
                (self.P, self.T, self.N):
            raise RuntimeError(f"virtual clock: {path} is not this job's table")
        self._lock = threading.Lock()
        #: ports whose downloads are resolved here (several ranks)
        self._multi = [len(platform.ranks_on_port(g)) > 1 for g in range(self.H)]

    # ------------------------------------------------------------------ locking
    def __enter__(self) -> Engine:
        self._lock.acquire()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock.release()

    def version(self) -> int:
        """A counter that moves whenever the table changes: a waiter that saw no change
        since its last :meth:`advance` need not try again (a racy read: an unlocked
        clock store may be missed, so waiters still advance now and then)."""
        return self.hdr[_VERSION]

    def _changed(self) -> None:
        self.hdr[_VERSION] += 1

    def close(self) -> None:
        for name in list(vars(self)):
            if name.startswith(("a_", "m_", "r_")) or name in ("hdr", "up_free", "dl_free"):
                getattr(self, name).release()
        self._mm.close()
        os.close(self._fd)

    # ------------------------------------------------------------------ actors
    def open_actor(self, rank: int, index: int, clock: float) -> int:
        """Make actor ``index`` (0 = the main thread) of ``rank`` live at ``clock``."""
        if not 0 <= index < self.T:
            raise RuntimeError(f"virtual clock: more than {self.T} threads of rank {rank} "
                               "keep their own virtual time")
        aid = rank * self.T + index
        with self:
            self.a_clock[aid] = clock
            self.a_wkind[aid] = RUNNING
            self.a_step[aid] = -1
            self.a_status[aid] = 1
            self._changed()
        return aid

    def close_actor(self, aid: int) -> None:
        with self:
            self.a_wkind[aid] = DONE
            self.a_status[aid] = 0
            self._changed()

    def set_clock(self, aid: int, clock: float) -> None:
        """Publish a running actor's clock (one aligned store: old or new, both floors)."""
        self.a_clock[aid] = clock
        self.hdr[_VERSION] += 1     # unlocked: a lost increment only delays a waiter

    def set_state(self, aid: int, kind: int, clock: float, lb: float = INF,
                  ranks: Iterable[int] = (), comm: int = 0, seq: int = 0,
                  qmin: float = INF, send: int = -1) -> None:
        """Publish what actor ``aid`` waits for (see the module docstring). ``send``:
        the sequence number of the last of its own messages it waits to complete (-1:
        none); its floor then follows that message's upload as it is resolved."""
        with self:
            self.a_wsend[aid] = send + 1
            if kind in (RECV, COLL):
                base = aid * self.P
                self.a_wsrc[base:base + self.P] = bytes(self.P)
                for r in ranks:
                    self.a_wsrc[base + r] = 1
            self.a_clock[aid] = clock
            self.a_wlb[aid] = lb
            self.a_wcomm[aid], self.a_wseq[aid] = comm, seq
            self.a_qmin[aid] = qmin
            self.a_wkind[aid] = kind
            self._changed()

    def left_collective(self, rank: int, comm: int, seq: int) -> None:
        """Rank ``rank`` has left collective number ``seq`` on communicator ``comm``."""
        with self:   # a rank leaves the collectives of a communicator in order
            i = rank * LEFT_SLOTS + comm % LEFT_SLOTS
            self.r_lcid[i], self.r_lseq[i] = comm, seq
            self._changed()

    def _has_left(self, rank: int, comm: int, seq: int) -> bool:
        """Whether ``rank`` is known to have left collective ``seq`` on ``comm``."""
        i = rank * LEFT_SLOTS + comm % LEFT_SLOTS
        return self.r_lcid[i] == comm and self.r_lseq[i] >= seq

    def set_qmin(self, aid: int, qmin: float) -> None:
        with self:
            self.a_qmin[aid] = qmin
            self._changed()

    def set_step(self, aid: int, step: int) -> None:
        self.a_step[aid] = step

    # ------------------------------------------------------------------ messages
    def _slot(self, aid: int, seq: int) -> int:
        return aid * self.N + seq % self.N

    def _free_head(self, aid: int) -> None:
        head, seq = self.a_head[aid], self.a_seq[aid]
        done = CONSUMED | UPLOADED | RELEASED
        while head < seq and self.m_flags[self._slot(aid, head)] & done == done:
            self.m_flags[self._slot(aid, head)] = 0
            head += 1
        self.a_head[aid] = head

    def try_post(self, aid: int, dst: int, comm: int, tag: int, ordinal: int,
                 nbytes: float, t: float) -> int | None:
        """Post one message of actor ``aid`` sent at virtual time ``t``; its sequence
        number, or None while the actor's ring is full (retry after receivers caught
        up). Messages within a host are resolved at once (shared memory, no link)."""
        with self:
            self._free_head(aid)
            seq = self.a_seq[aid]
            if seq - self.a_head[aid] >= self.N:
                return None
            i = self._slot(aid, seq)
            src_rank = aid // self.T
            step = self.a_step[aid]
            intra = self.hosts[src_rank] == self.hosts[dst]
            if intra:
                rate, delay = self.platform.shm_rate, self.platform.shm_delay
            else:
                rate, delay = self.platform.conditions(t, step)
                nbytes = self.platform.wire_bytes(nbytes)
            self.m_dst[i], self.m_comm[i], self.m_tag[i], self.m_ord[i] = dst, comm, tag, ordinal
            self.m_step[i] = step
            self.m_nbytes[i], self.m_tsend[i] = nbytes, t
            self.m_rate[i], self.m_delay[i] = rate, delay
            self.m_arr[i] = INF
            if intra:
                self.m_u0[i], self.m_u1[i] = t, t + nbytes / rate
                self.m_arr[i] = t + delay + nbytes / rate
                self.m_flags[i] = POSTED | UPLOADED | DOWNLOADED | INTRA
            else:
                self.m_flags[i] = POSTED
            self.a_seq[aid] = seq + 1
            self._changed()
            return seq

    def find(self, src: int, dst: int, comm: int, tag: int, ordinal: int
             ) -> tuple[int, int] | None:
        """``(actor, seq)`` of the ``ordinal``-th message from rank ``src`` to ``dst`` on
        ``(comm, tag)``, or None if it is not posted yet."""
        with self:
            return self._find(src, dst, comm, tag, ordinal)

    def _find(self, src: int, dst: int, comm: int, tag: int, ordinal: int
              ) -> tuple[int, int] | None:
        for aid in range(src * self.T, (src + 1) * self.T):
            if not self.a_status[aid] and self.a_seq[aid] == 0:
                continue
            for seq in range(self.a_head[aid], self.a_seq[aid]):
                i = self._slot(aid, seq)
                if (self.m_flags[i] & POSTED and not self.m_flags[i] & CONSUMED
                        and self.m_dst[i] == dst and self.m_ord[i] == ordinal
                        and self.m_tag[i] == tag and self.m_comm[i] == comm):
                    return aid, seq
        return None

    def earliest(self, dst: int, comm: int, expected: dict[tuple[int, int], int]
                 ) -> tuple[int, int] | None:
        """Which message rank ``dst`` receives next on ``comm`` among the channels
        ``expected`` (``(source rank, tag) -> the ordinal it receives next``): the one
        that reaches ``dst``'s download link first (ties: source, then tag), once no
        other can come earlier (messages still in their upload, or not sent yet: their
        senders' floors plus the lookahead). ``(source, tag)``, or None while that is
        not decided (call again)."""
        with self:
            self._advance()
            best, blocked = None, INF
            for (src, tag), ordinal in expected.items():
                loc = self._find(src, dst, comm, tag, ordinal)
                if loc is None:
                    continue
                i = self._slot(*loc)
                if not self.m_flags[i] & UPLOADED:
                    blocked = min(blocked, self.m_tsend[i] + self.m_delay[i])
                    continue
                cand = (self.m_u0[i] + self.m_delay[i], src, tag)
                if best is None or cand < best:
                    best = cand
            if best is None or blocked <= best[0]:
                return None
            floors = self.floors()
            sources = {src for src, _ in expected}
            for src in sources:
                la = (self.platform.shm_delay if self.hosts[src] == self.hosts[dst]
                      else self.lookahead)
                for aid in range(src * self.T, (src + 1) * self.T):
                    if self.a_status[aid] and floors.get(aid, INF) + la <= best[0]:
                        return None
            return best[1], best[2]

    def message(self, aid: int, seq: int) -> dict[str, float]:
        """The fields of a posted message (a copy)."""
        i = self._slot(aid, seq)
        with self:
            out = {n: getattr(self, f"m_{n}")[i] for n in _MSG_D}
            out.update({n: getattr(self, f"m_{n}")[i] for n in _MSG_Q})
        return out

    def release(self, aid: int, seq: int) -> None:
        """The sender will not wait for this message's completion."""
        with self:
            self.m_flags[self._slot(aid, seq)] |= RELEASED
            self._changed()

    def consume(self, aid: int, seq: int) -> None:
        with self:
            self.m_flags[self._slot(aid, seq)] |= CONSUMED
            self._changed()

    # ------------------------------------------------------------------ resolution
    def advance(self) -> None:
        """Resolve every link slot that is safe now (see the module docstring)."""
        with self:
            self._advance()

    def _live(self) -> list[int]:
        return [a for a in range(self.A) if self.a_status[a]]

    def _advance(self) -> None:
        live = self._live()
        per_port = [0] * self.H
        for a in live:
            per_port[self.ports[a // self.T]] += 1
        floors: dict[int, float] | None = None
        resolved = False
        # uploads (resolving one never enables another's conditions: the floors are
        # fixed within this call), then the downloads they may have enabled
        for h in range(self.H):
            while True:
                nxt = self._next_upload(h, live)
                if nxt is None:
                    break
                key, aid, seq = nxt
                if per_port[h] > 1:
                    if floors is None:
                        floors = self.floors(live)
                    if not self._quiet(floors, key, aid,
                                       (b for b in live if self.ports[b // self.T] == h)):
                        break
                i = self._slot(aid, seq)
                start = max(key, self.up_free[h])
                end = start + self.m_nbytes[i] / self.m_rate[i]
                self.up_free[h] = end
                self.m_u0[i], self.m_u1[i] = start, end
                self.m_flags[i] |= UPLOADED
                self.a_up[aid] = seq + 1
                resolved = True
        for g, cands, pending in self._downloads():
            cands.sort()
            remote = [b for b in live if self.hosts[b // self.T] != self._port_host[g]]
            bounds: dict[int, float] | None = None
            for key, aid, seq in cands:
                if pending <= key:   # a message not through its upload may come first
                    break
                if bounds is None:
                    if floors is None:
                        floors = self.floors(live)
                    # what a remote actor sends next leaves its port's upload link no
                    # earlier than that link is free
                    bounds = {b: max(floors.get(b, INF), self.up_free[self.ports[b // self.T]])
                              for b in remote}
                if not self._quiet(bounds, key - self.lookahead, aid, remote):
                    break
                i = self._slot(aid, seq)
                start = max(key, self.dl_free[g])
                end = start + self.m_nbytes[i] / self.m_rate[i]
                self.dl_free[g] = end
                self.m_arr[i] = max(end, self.m_u1[i] + self.m_delay[i])
                self.m_flags[i] |= DOWNLOADED
                resolved = True
        if resolved:
            self._changed()

    def _downloads(self) -> list[tuple[int, list[tuple[float, int, int]], float]]:
        """Per port of several ranks with messages to resolve on its download link:
        ``(port, [(download key, actor, seq)] of the messages through their upload,
        lowest key a message still in its upload could have)`` (one scan of the
        messages in flight)."""
        multi = self._multi
        cands: dict[int, list[tuple[float, int, int]]] = {}
        pending: dict[int, float] = {}
        ports, flags_, dst_ = self.ports, self.m_flags, self.m_dst
        skip = DOWNLOADED | INTRA
        for aid in range(self.A):
            head, top = self.a_head[aid], self.a_seq[aid]
            for seq in range(head, top):
                i = aid * self.N + seq % self.N
                flags = flags_[i]
                if flags & skip or not flags & POSTED:
                    continue
                g = ports[dst_[i]]
                if not multi[g]:
                    continue      # one rank: the receiver resolves its own download
                if flags & UPLOADED:
                    cands.setdefault(g, []).append((self.m_u0[i] + self.m_delay[i], aid, seq))
                else:
                    low = self.m_tsend[i] + self.m_delay[i]
                    if low < pending.get(g, INF):
                        pending[g] = low
        return [(g, c, pending.get(g, INF)) for g, c in sorted(cands.items())]

    @staticmethod
    def _quiet(floors: dict[int, float], key: float, aid: int, actors: Iterable[int]) -> bool:
        """No actor of ``actors`` (other than ``aid``) can still post a message ordered
        before ``(key, aid)``."""
        for b in actors:
            if b == aid:
                continue
            f = floors.get(b, INF)
            if f < key or (f == key and b < aid):
                return False
        return True

    def _next_upload(self, h: int, live: list[int]) -> tuple[float, int, int] | None:
        best = None
        for rank in self.platform.ranks_on_port(h):
            for aid in range(rank * self.T, (rank + 1) * self.T):
                seq = self.a_up[aid]
                while seq < self.a_seq[aid]:
                    i = self._slot(aid, seq)
                    if not self.m_flags[i] & UPLOADED:
                        break
                    seq += 1
                self.a_up[aid] = seq
                if seq < self.a_seq[aid]:
                    cand = (self.m_tsend[self._slot(aid, seq)], aid, seq)
                    if best is None or cand < best:
                        best = cand
        return best

    def upload(self, aid: int, seq: int, release: bool = False
               ) -> tuple[float, float] | None:
        """The message's upload interval once resolved (None before). ``release``: the
        sender has taken its completion (the slot may be reused once received too)."""
        i = self._slot(aid, seq)
        with self:
            if not self.m_flags[i] & UPLOADED:
                return None
            if release:
                self.m_flags[i] |= RELEASED
                self._changed()
            return self.m_u0[i], self.m_u1[i]

    def arrival(self, aid: int, seq: int) -> float | None:
        i = self._slot(aid, seq)
        with self:
            if not self.m_flags[i] & DOWNLOADED:
                return None
            return self.m_arr[i]

    def receiver_resolves(self, dst: int) -> bool:
        """True when ``dst``'s port has one rank: its receiver resolves its downloads."""
        return len(self.platform.ranks_on_port(self.ports[dst])) < 2

    # ------------------------------------------------------------------ floors
    def _lower_bound(self, i: int) -> float:
        """Earliest possible complete arrival of message slot ``i``."""
        flags = self.m_flags[i]
        if flags & DOWNLOADED:
            return self.m_arr[i]
        if flags & UPLOADED:
            return self.m_u1[i] + self.m_delay[i]
        return self.m_tsend[i] + self.m_delay[i] + self.m_nbytes[i] / self.m_rate[i]

    def _send_floor(self, aid: int) -> float:
        """Earliest completion of the last send actor ``aid`` waits for: its upload's end
        once resolved, else no earlier than the upload link's free time plus its
        transmission (a send completes when it has left the link; the actor's own
        sends leave in order, so the last one ends last)."""
        seq = self.a_wsend[aid] - 1
        if seq < self.a_head[aid]:
            return 0.0      # completed and freed
        i = self._slot(aid, seq)
        if self.m_flags[i] & UPLOADED:
            return self.m_u1[i]
        free = self.up_free[self.ports[aid // self.T]]
        return max(self.m_tsend[i], free) + self.m_nbytes[i] / self.m_rate[i]

    def floors(self, live: list[int] | None = None) -> dict[int, float]:
        """Every live actor's floor (see the module docstring); call under the lock."""
        live = self._live() if live is None else live
        T, P = self.T, self.P
        posted: dict[tuple[int, int], float] = {}   # (src rank, dst rank) -> min bound
        flags_, N = self.m_flags, self.N
        for aid in range(self.A):   # messages of ended threads count too
            src = aid // T
            for seq in range(self.a_head[aid], self.a_seq[aid]):
                i = aid * N + seq % N
                if flags_[i] & CONSUMED or not flags_[i] & POSTED:
                    continue
                key = (src, self.m_dst[i])
                lb = self._lower_bound(i)
                if lb < posted.get(key, INF):
                    posted[key] = lb
        cand: dict[int, float] = {}
        # dependants[r]: (actor, kind-specific const) waiting on a floor of rank r
        dependants: list[list[tuple[int, float, float]]] = [[] for _ in range(P)]
        for a in live:
            kind, c, rank = self.a_wkind[a], self.a_clock[a], a // T
            if kind in (RESOLVE, RECV) and self.a_wsend[a]:
                c = max(c, self._send_floor(a))
            if kind == RUNNING:
                cand[a] = c
            elif kind == RESOLVE:
                cand[a] = max(c, self.a_wlb[a])
            elif kind == RECV:
                base, k = a * P, self.a_wlb[a]
                waits = bytes(self.a_wsrc[base:base + P])
                for s in (s for s, w in enumerate(waits) if w):
                    k = min(k, posted.get((s, rank), INF))
                    la = (self.platform.shm_delay if self.hosts[s] == self.hosts[rank]
                          else self.lookahead)
                    dependants[s].append((a, c, la))
                cand[a] = max(c, k)
            elif kind == COLL:
                base, low, others = a * P, c, []
                comm, seq = self.a_wcomm[a], self.a_wseq[a]
                for m in range(P):
                    if not self.a_wsrc[base + m] or m == rank:
                        continue
                    inside = [b for b in range(m * T, (m + 1) * T) if self.a_status[b]
                              and self.a_wkind[b] == COLL and self.a_wcomm[b] == comm
                              and self.a_wseq[b] == seq]
                    if inside:
                        low = max(low, max(self.a_clock[b] for b in inside))
                    elif not self._has_left(m, comm, seq):
                        others.append(m)
                for m in others:
                    dependants[m].append((a, low, 0.0))
                cand[a] = INF if others else low
            elif kind in (IDLE, JOIN):
                k = self.a_qmin[a] if kind == IDLE else self.a_wlb[a]
                dependants[rank].append((a, c, 0.0))
                cand[a] = max(c, k)
        floors: dict[int, float] = {}
        heap = [(v, a) for a, v in cand.items()]
        heapq.heapify(heap)
        while heap:
            v, a = heapq.heappop(heap)
            if a in floors or v > cand.get(a, INF):
                continue
            floors[a] = v
            for b, low, la in dependants[a // T]:
                if b == a or b in floors:
                    continue
                nv = max(low, v + la)
                if nv < cand.get(b, INF):
                    cand[b] = nv
                    heapq.heappush(heap, (nv, b))
        for a in live:
            floors.setdefault(a, INF)
        return floors

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def new_path() -> str:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="mpicomm-vclock-", dir=base)
        os.close(fd)
        os.unlink(path)
        return path
