"""The one registry of point-to-point message tags used by mpicomm.

Every subsystem that sends point-to-point messages takes its tags from here, so that no
two of them can collide even when they share a communicator. Subsystems that run
*concurrently* with other traffic (the gradient thread, parameter servers, Crossover jobs,
gossip) additionally work on a duplicated communicator of their own; the tag ranges are
the second line of defence and make every message's origin readable in a trace.

A subsystem owns the half-open range ``[start, stop)``; :data:`RANGES` lists them and
:func:`check_registry` (run by the test suite) proves they are disjoint and inside the
MPI standard's guaranteed tag space (``MPI_TAG_UB >= 32767``).
"""

from __future__ import annotations

#: Half-open tag ranges ``name -> (start, stop)``, one per subsystem.
RANGES: dict[str, tuple[int, int]] = {
    "collectives": (10, 20),   # dense allreduce / allgather / broadcast / reduce_scatter
    "sparse": (20, 30),        # gTop-k rounds and fold
    "gossip": (30, 40),        # neighbour averaging
    "control": (50, 60),       # calibration ping-pongs of the selector (mpicomm.control)
    "stall": (60, 70),         # stall inspector queries and replies (own communicator)
    "abort": (70, 80),         # failure reports of the error policy (MPI_COMM_WORLD)
    "ps": (100, 200),          # parameter server requests and replies
    "sched": (200, 300),       # Crossover scheduler tokens
    "user": (1000, 32768),     # free for applications on their own communicators
}

#: The guaranteed minimum of ``MPI_TAG_UB`` in the MPI standard.
MPI_TAG_UB_MIN = 32767


def tag(subsystem: str, offset: int) -> int:
    """The tag ``offset`` of ``subsystem``'s range; ``ValueError`` if it falls outside."""
    try:
        start, stop = RANGES[subsystem]
    except KeyError:
        raise ValueError(f"unknown tag subsystem {subsystem!r}; known: {sorted(RANGES)}") from None
    if not 0 <= offset < stop - start:
        raise ValueError(f"tag offset {offset} outside {subsystem!r} range [{start}, {stop})")
    return start + offset


def check_registry() -> None:
    """Raise ``AssertionError`` if two ranges overlap or one leaves the guaranteed tag space."""
    spans = sorted(RANGES.items(), key=lambda item: item[1])
    for (name_a, (a0, a1)), (name_b, (b0, _)) in zip(spans, spans[1:]):
        assert a1 <= b0, f"tag ranges {name_a} [{a0}, {a1}) and {name_b} overlap"
    for name, (start, stop) in spans:
        assert 0 <= start < stop <= MPI_TAG_UB_MIN + 1, f"tag range {name} out of bounds"


# Dense collectives (on a communicator's private p2p duplicate). Collectives on one
# communicator run one at a time and MPI keeps messages between a pair in order, so the
# tags only need to tell the phases of one collective apart.
TAG_ALLREDUCE = tag("collectives", 1)
TAG_ALLGATHER = tag("collectives", 2)
TAG_BCAST = tag("collectives", 3)
TAG_REDUCE_SCATTER = tag("collectives", 4)
TAG_FOLD = tag("collectives", 5)
TAG_HOST = tag("collectives", 6)   # hierarchical: the phases inside a host
TAG_LANE = tag("collectives", 7)   # hierarchical: the lanes across hosts
# Sparse collectives.
TAG_GTOPK_FOLD = tag("sparse", 1)
TAG_GTOPK_ROUND = tag("sparse", 2)
TAG_GTOPK_ALIVE = tag("sparse", 3)  # gTop-k: a folded-out rank's surviving picks
# Gossip averaging.
TAG_GOSSIP = tag("gossip", 1)
# Parameter server (mpicomm.ps), on each store's own duplicated communicator.
TAG_PS_REQUEST = tag("ps", 1)   # worker -> server: push, pull, close, checkpoint
TAG_PS_REPLY = tag("ps", 2)     # server -> worker: pull replies
TAG_PS_CONTROL = tag("ps", 3)   # worker 0 <-> server: init / restore and acks
TAG_PS_STATE = tag("ps", 4)     # server -> worker 0: shard state for a checkpoint
TAG_PS_DATA = tag("ps", 5)      # either way: the arrays of a detached push or reply
# Calibration ping-pong (mpicomm.collectives.calibrate.pingpong: bench collectives,
# mpicomm.control.calibration, mpicomm.jobinfo.measure_link).
TAG_CALIBRATE = tag("control", 1)
# Stall inspector (mpicomm.observe.stall, on its own duplicate of the world).
TAG_STALL_QUERY = tag("stall", 1)
TAG_STALL_REPLY = tag("stall", 2)
# Error policy (mpicomm.abort): a failing rank's report to every rank, on MPI_COMM_WORLD
# itself (the only communicator every rank is sure to have when a rank fails).
TAG_FAILURE = tag("abort", 1)
