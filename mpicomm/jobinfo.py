"""The job description of ``python -m mpicomm info``: nodes, local ranks, measured
links, usable buffers.

:func:`describe_job` (printed by :func:`format_job`) is what ``mpiexec -n N python -m
mpicomm info`` adds to the single-process report. Collective over the communicator:

* **placement**: every rank's host, node index and local rank (ranks sharing memory);
* **links**: alpha (latency, s) and beta (s/byte) fitted by
  :func:`mpicomm.collectives.calibrate.fit_alpha_beta` to ping-pongs over mpicomm's
  point-to-point path, measured for each link kind present: *intra-node* (rank 0 and
  another rank on its node) and *inter-node* (rank 0 and the first rank of another
  node). A kind with no such pair is reported as absent;
* **buffer backends**: for numpy, torch CPU, torch CUDA and cupy, whether a 4-element
  ``mpicomm.allreduce`` actually works (and gives the right sum) on every rank; CUDA
  entries say whether device pointers go to MPI directly or through host staging.

Cost: two communicator splits, ~1 s of ping-pongs per link kind on shared memory, and
one small allreduce per backend.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from .collectives.calibrate import fit_alpha_beta, pingpong
from .comm import Communicator, resolve

__all__ = ["describe_job", "measure_link", "usable_backends"]

LINK_SIZES = (8, 1 << 12, 1 << 16, 1 << 20)


def _pair(comm: Communicator, partner: int | None) -> Communicator | None:
    """A 2-rank communicator {0, partner} (rank 0 first) on those ranks; collective."""
    member = partner is not None and comm.rank in (0, partner)
    return comm.split(0 if member else None, key=0 if comm.rank == 0 else 1)


def measure_link(comm: Communicator, partner: int | None, repeats: int = 10
                 ) -> tuple[float, float] | None:
    """(alpha, beta) between rank 0 and ``partner`` (collective; every rank gets rank
    0's figures), or ``None`` when ``partner`` is ``None``."""
    pair = _pair(comm, partner)
    fitted = None
    if pair is not None:
        try:
            times = [pingpong(pair, n, repeats) for n in LINK_SIZES]
            if pair.rank == 0:
                fitted = fit_alpha_beta(LINK_SIZES, times)
        finally:
            pair.free()
    return comm.bcast_object(fitted)


def usable_backends(comm: Communicator) -> dict[str, str]:
    """Backend name -> ``"yes (...)"`` / ``"no (why)"``, agreed over all ranks."""
    from . import allreduce
    from .cudampi import cuda_aware

    candidates: list[tuple[str, Any]] = [("numpy", lambda: np.ones(4, dtype=np.float32))]
    try:
        import torch

        candidates.append(("torch cpu", lambda: torch.ones(4)))
        if torch.cuda.is_available():
            candidates.append(("torch cuda", lambda: torch.ones(4, device="cuda")))
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            candidates.append(("cupy", lambda: cupy.ones(4, dtype=cupy.float32)))
    except Exception:  # not installed, or no driver: not usable
        pass
    found = comm.allgather_object([name for name, _ in candidates])
    common = [name for name, _ in candidates if all(name in f for f in found)]
    out: dict[str, str] = {}
    for name, make in candidates:
        if name not in common:
            out[name] = "no (not available on every rank)"
            continue
        try:
            total = allreduce(make(), op="sum", comm=comm)
            ok = float(total.sum()) == 4.0 * comm.size
            why = ""
        except Exception as exc:  # report, do not fail the whole info command
            ok, why = False, f"{type(exc).__name__}: {exc}"
        everywhere = comm.allreduce_value(ok, op="min")
        if everywhere:
            how = (" (CUDA-aware MPI)" if cuda_aware() else " (staged through host)") \
                if "cu" in name else ""
            out[name] = "yes" + how
        else:
            out[name] = f"no ({why or 'failed on another rank'})"
    for name in ("torch cuda", "cupy"):
        out.setdefault(name, "no (no CUDA device)")
    return out


def describe_job(comm: Communicator | None = None) -> dict[str, Any]:
    """The placement, link and backend report of the module docstring (collective)."""
    comm = resolve(comm)
    me = (socket.gethostname(), comm.node, comm.local_rank, comm.local_size)
    everyone = comm.allgather_object(me)
    nodes: dict[int, list[int]] = {}
    hosts: dict[int, str] = {}
    for rank, (host, node, _, _) in enumerate(everyone):
        nodes.setdefault(node, []).append(rank)
        hosts[node] = host
    intra = next((r for r in nodes[everyone[0][1]] if r != 0), None)
    inter = next((ranks[0] for node, ranks in sorted(nodes.items())
                  if node != everyone[0][1]), None)
    links = {"intra-node": measure_link(comm, intra), "inter-node": measure_link(comm, inter)}
    return {
        "ranks": comm.size,
        "nodes": {node: {"host": hosts[node], "ranks": ranks}
                  for node, ranks in sorted(nodes.items())},
        "local ranks": [e[2] for e in everyone],
        "links": {kind: None if ab is None else {"alpha_s": ab[0], "beta_s_per_byte": ab[1],
                                                 "partner": intra if kind == "intra-node"
                                                 else inter}
                  for kind, ab in links.items()},
        "buffer backends": usable_backends(comm),
    }


def format_job(job: dict[str, Any]) -> dict[str, str]:
    """``describe_job``'s result as ``info`` lines (name -> text)."""
    lines = {"ranks": str(job["ranks"])}
    for node, d in job["nodes"].items():
        lines[f"node {node}"] = f"{d['host']}: ranks {d['ranks']}"
    lines["local ranks"] = " ".join(str(r) for r in job["local ranks"]) + "  (by rank)"
    for kind, link in job["links"].items():
        if link is None:
            lines[f"link {kind}"] = "none (no such pair of ranks)"
        else:
            beta = link["beta_s_per_byte"]
            bw = f"{1 / beta / 1e9:.3g} GB/s" if beta > 0 else "unmeasurable"
            lines[f"link {kind}"] = (f"alpha={link['alpha_s'] * 1e6:.3g} us, beta={beta:.3g} "
                                     f"s/B ({bw}); ranks 0<->{link['partner']}")
    for name, state in job["buffer backends"].items():
        lines[f"backend {name}"] = state
    return lines
