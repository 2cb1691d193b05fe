"""Ping-pong between two emulated hosts: the measured one-way latency and bandwidth.

Run it on the emulated cluster (it needs ranks on at least two hosts)::

    launchers/emulated-cluster --hosts 2 --rate 200mbit --delay 5ms -- \\
        python -m mpicomm.emulate.pingpong --bytes 2000000

Rank 0 (host 0) and rank ``R`` (the first rank of host 1) exchange messages on a
duplicate of ``MPI.COMM_WORLD``, delayed by the emulated link
(:mod:`mpicomm.emulate.linkdelay`) exactly as mpicomm's own point-to-point layer delays
the collectives' messages:

* latency: ``--small`` byte messages, one-way = fastest round trip / 2 (``--rounds``);
* bandwidth: ``--bytes`` messages, ``bits / (fastest round trip / 2 - latency)``.

The fastest of the rounds is the one least disturbed by other load on the machine (a rank
woken from its delay waits for a free core); the medians are reported too
(``latency_median_s``, ``bandwidth_median_bits``).

Rank 0 prints one JSON object (and writes it to ``--json``) with the measured and the
configured values (``MPICOMM_EMU_RATE``, ``MPICOMM_EMU_DELAY``); ``make bench-cluster``
puts one per network into the benchmark report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence

from mpi4py import MPI

from .linkdelay import ENV_DELAY, ENV_RANKS_PER_HOST, LinkDelay, from_env
from .mpienv import machine
from .netns import parse_rate


class _Link:
    """Blocking messages on ``mpi`` through the emulated ``link`` (``None``: none)."""

    def __init__(self, mpi: MPI.Intracomm, link: LinkDelay | None):
        self.mpi, self.link = mpi, link

    def send(self, buf: bytearray, dest: int) -> None:
        if self.link is not None:
            self.link.before_send(dest, len(buf))
        self.mpi.Send([buf, MPI.BYTE], dest)

    def recv(self, buf: bytearray, source: int) -> None:
        if self.link is not None:
            self.link.after_receive()
        self.mpi.Recv([buf, MPI.BYTE], source)


def _round_trips(link: _Link, me: int, peer: int, buf: bytearray, rounds: int
                 ) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        if me == 0:
            link.send(buf, peer)
            link.recv(buf, peer)
        else:
            link.recv(buf, peer)
            link.send(buf, peer)
        times.append(time.perf_counter() - start)
    return times


def _measure(args: argparse.Namespace) -> int:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    per_host = int(os.environ.get(ENV_RANKS_PER_HOST, "1"))
    peer = per_host  # first rank of host 1
    if size <= peer:
        if rank == 0:
            print(f"pingpong needs a rank on a second host: {size} rank(s), "
                  f"{per_host} per host", file=sys.stderr)
        return 2
    mpi = world.Dup()  # private: no message of this program meets another
    link = _Link(mpi, from_env(mpi))
    result = None
    if rank in (0, peer):
        other = peer if rank == 0 else 0
        small = bytearray(max(1, args.small))
        big = bytearray(max(1, args.bytes))
        _round_trips(link, rank, other, small, 2)  # connection set-up
        _round_trips(link, rank, other, big, 1)
        small_rt = _round_trips(link, rank, other, small, args.rounds)
        big_rt = _round_trips(link, rank, other, big, args.rounds)
        lat, lat_med = min(small_rt) / 2, statistics.median(small_rt) / 2
        rate = os.environ.get("MPICOMM_EMU_RATE", "unshaped")
        bits = len(big) * 8
        result = {
            "suite": "pingpong",
            "latency_s": lat,
            "bandwidth_bits": bits / max(min(big_rt) / 2 - lat, 1e-9),
            "latency_median_s": lat_med,
            "bandwidth_median_bits": bits / max(statistics.median(big_rt) / 2 - lat_med,
                                                1e-9),
            "bytes": len(big),
            "configured_delay_s": float(os.environ.get(ENV_DELAY, "0") or 0),
            "configured_rate_bits": None if rate == "unshaped" else parse_rate(rate),
            "ranks": size,
        }
    mpi.Barrier()
    if rank == 0:
        assert result is not None
        result["machine"] = machine()
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    mpi.Free()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpicomm.emulate.pingpong",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=2_000_000, help="bandwidth message size")
    ap.add_argument("--small", type=int, default=8, help="latency message size")
    ap.add_argument("--rounds", type=int, default=5, help="timed round trips per size")
    ap.add_argument("--json", default=None, help="also write the result here (rank 0)")
    args = ap.parse_args(argv)
    try:
        return _measure(args)
    except Exception:  # one rank failing must end the job, not leave its peer waiting
        sys.stderr.write(f"[pingpong rank {MPI.COMM_WORLD.Get_rank()}] "
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
