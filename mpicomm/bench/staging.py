"""Staged CUDA collectives against host collectives of the same bytes.

Run under MPI on a GPU machine whose MPI is not CUDA-aware, e.g.
``mpiexec -n 2 python -m mpicomm.bench staging --json out.json``.

For every size (float32 elements) and collective (ring allreduce, ring allgather,
scatter-allgather broadcast: the algorithms that stream their staging copies, see
:mod:`mpicomm.staging`), the suite times the host collective on a CPU
tensor (``host``) and the same collective on a CUDA tensor staged through pinned memory
with ``MPICOMM_STAGING_CHUNK_BYTES`` set to each ``--chunks-mb`` value (``whole`` = one
chunk as large as the buffer: copy all, then communicate).
Results are written into persistent ``out=`` buffers, as GradientSync does. Each row is
the median over ``--repeats`` of the slowest rank's time; ``x_host`` is the row's time
over the host row's. Target: the best staged allreduce within 1.1x of host.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch

from ..collectives import allgather, allreduce, broadcast
from ..comm import init
from ..cudampi import cuda_aware
from ._util import machine, median_seconds, positive_floats, print_table, write_json

COLUMNS = ("collective", "elems", "MB", "method", "time_ms", "x_host")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=lambda t: [int(v) for v in positive_floats(t)],
                        default=[1_000_000, 25_000_000], help="float32 elements per rank")
    parser.add_argument("--chunks-mb", type=positive_floats, default=[1.0, 4.0, 16.0],
                        help="staging chunk sizes in MB (besides 'whole')")
    parser.add_argument("--collectives", default="allreduce,allgather,broadcast")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per row")


def _call(name: str, comm: Any, x: Any, out: Any) -> Callable[[], Any]:
    if name == "allreduce":
        return lambda: allreduce(x, algorithm="ring", comm=comm, out=out)
    if name == "allgather":
        return lambda: allgather(x, algorithm="ring", comm=comm, out=out)
    return lambda: broadcast(x, algorithm="scatter_allgather", comm=comm, out=out)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    names = [c for c in args.collectives.split(",") if c]
    bad = sorted(set(names) - {"allreduce", "allgather", "broadcast"})
    if bad or not names:
        raise ValueError(f"--collectives: unknown {', '.join(bad)}; choose from allreduce, "
                         "allgather, broadcast")
    if not torch.cuda.is_available():
        raise SystemExit("bench staging needs a CUDA device (torch.cuda.is_available() "
                         "is False)")
    comm = init()
    device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if cuda_aware():
        raise SystemExit("this MPI is CUDA-aware: nothing is staged (set "
                         "MPICOMM_CUDA_AWARE=0 to measure staging anyway)")
    saved = os.environ.get("MPICOMM_STAGING_CHUNK_BYTES")
    rows: list[dict[str, Any]] = []
    try:
        for n in args.sizes:
            host = torch.randn(n)
            dev = host.to(device)
            for name in names:
                p = comm.size if name == "allgather" else 1
                host_out = torch.empty(n * p)
                dev_out = torch.empty(n * p, device=device)
                chunks = [("whole", max(1, 4 * n * p))]
                chunks += [(f"chunk {mb:g} MB", int(mb * 2**20)) for mb in args.chunks_mb]
                t_host = median_seconds(_call(name, comm, host, host_out), comm,
                                        args.repeats, args.warmup)
                rows.append({"collective": name, "elems": n, "MB": round(4 * n / 1e6, 1),
                             "method": "host", "time_ms": round(t_host * 1e3, 3),
                             "x_host": 1.0})
                for label, nbytes in chunks:
                    os.environ["MPICOMM_STAGING_CHUNK_BYTES"] = str(nbytes)
                    call = _call(name, comm, dev, dev_out)
                    t = median_seconds(call, comm, args.repeats, args.warmup)
                    rows.append({"collective": name, "elems": n, "MB": round(4 * n / 1e6, 1),
                                 "method": f"staged {label}", "time_ms": round(t * 1e3, 3),
                                 "x_host": round(t / t_host, 3)})
                if not torch.equal(dev_out.cpu(), host_out):
                    raise RuntimeError(f"staged {name} of {n} elements differs from the "
                                       "host result")
    finally:
        if saved is None:
            os.environ.pop("MPICOMM_STAGING_CHUNK_BYTES", None)
        else:
            os.environ["MPICOMM_STAGING_CHUNK_BYTES"] = saved
    if comm.rank == 0:
        print_table(rows, COLUMNS)
    info = machine()
    info["gpu"] = torch.cuda.get_device_name(device)
    write_json(args.json if comm.rank == 0 else None,
               {"suite": "staging", "machine": info, "ranks": comm.size,
                "torch": torch.__version__, "rows": rows})
    return 0
