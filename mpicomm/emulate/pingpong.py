"""Ping-pong between two emulated hosts: the measured one-way latency and bandwidth.

Run it on the emulated cluster (it needs ranks on at least two hosts)::

    launchers/emulated-cluster --hosts 2 --rate 200mbit --delay 5ms -- \\
        python -m mpicomm.emulate.pingpong --bytes 2000000

Rank 0 (host 0) and rank ``R`` (the first rank of host 1) exchange messages through
mpicomm's own point-to-point layer (:class:`mpicomm.collectives._common.Ctx`, so the
injected delay applies as it does to the collectives):

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
from collections.abc import Sequence

import numpy as np

from ..buffers import ops_for
from ..collectives._common import Ctx
from ..comm import init
from ..tags import TAG_PINGPONG
from .netns import parse_rate


def _round_trips(ctx: Ctx, me: int, peer: int, buf: np.ndarray, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        if me == 0:
            ctx.send(buf, peer, TAG_PINGPONG)
            ctx.recv(buf, peer, TAG_PINGPONG)
        else:
            ctx.recv(buf, peer, TAG_PINGPONG)
            ctx.send(buf, peer, TAG_PINGPONG)
        times.append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpicomm.emulate.pingpong",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=2_000_000, help="bandwidth message size")
    ap.add_argument("--small", type=int, default=8, help="latency message size")
    ap.add_argument("--rounds", type=int, default=5, help="timed round trips per size")
    ap.add_argument("--json", default=None, help="also write the result here (rank 0)")
    args = ap.parse_args(argv)
    comm = init()
    per_host = int(os.environ.get("MPICOMM_EMU_RANKS_PER_HOST", "1"))
    peer = per_host  # first rank of host 1
    if comm.size <= peer:
        if comm.rank == 0:
            print(f"pingpong needs a rank on a second host: {comm.size} rank(s), "
                  f"{per_host} per host", file=sys.stderr)
        return 2
    ctx = Ctx.of(comm, ops_for("numpy", False))
    result = None
    if comm.rank in (0, peer):
        other = peer if comm.rank == 0 else 0
        small = np.zeros(max(1, args.small), dtype=np.uint8)
        big = np.zeros(max(1, args.bytes), dtype=np.uint8)
        _round_trips(ctx, comm.rank, other, small, 2)  # connection set-up
        _round_trips(ctx, comm.rank, other, big, 1)
        small_rt = _round_trips(ctx, comm.rank, other, small, args.rounds)
        big_rt = _round_trips(ctx, comm.rank, other, big, args.rounds)
        lat, lat_med = min(small_rt) / 2, statistics.median(small_rt) / 2
        rate = os.environ.get("MPICOMM_EMU_RATE", "unshaped")
        bits = big.nbytes * 8
        result = {
            "suite": "pingpong",
            "latency_s": lat,
            "bandwidth_bits": bits / max(min(big_rt) / 2 - lat, 1e-9),
            "latency_median_s": lat_med,
            "bandwidth_median_bits": bits / max(statistics.median(big_rt) / 2 - lat_med,
                                                1e-9),
            "bytes": big.nbytes,
            "configured_delay_s": float(os.environ.get("MPICOMM_EMU_DELAY", "0") or 0),
            "configured_rate_bits": None if rate == "unshaped" else parse_rate(rate),
            "ranks": comm.size,
        }
    comm.barrier()
    if comm.rank == 0:
        from ..bench._util import machine

        assert result is not None
        result["machine"] = machine()
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    comm.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
