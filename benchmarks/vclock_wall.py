"""The virtual clock against the wall clock of the tc-shaped emulated cluster.

``sudo python benchmarks/vclock_wall.py [--hosts 2,4] [--net 100mbit:1ms]
[--sizes 1e6,1e7] [--out benchmarks/results]`` (``make bench-vclock-wall``) runs, for
every host count ``H``:

1. ``launchers/emulated-cluster --hosts H --rate RATE --delay DELAY -- python -m
   mpicomm.bench vclock --sizes SIZES`` on the wall clock: ping-pong, ring and
   recursive-doubling allreduce, ring allgather and gTop-k timed for real (median of
   ``--repeats``), one rank per host (``vclock-wall-H.json``);
2. the same calls on a virtual cluster of ``H`` hosts with the same rate and delay
   (``mpiexec -n H python -m mpicomm.bench vclock --nets RATE:DELAY --costs
   vclock-costs.json``; ``vclock-virtual-H.json``), compute charged from the cost table
   the validation measured (``benchmarks/vclock_validate.py``; measured here first if
   missing);

The emulated links get a token bucket of ``--burst`` bytes (default two frames,
:data:`mpicomm.emulate.netns.MIN_BURST`): the emulator's default bucket (128 KiB at 100
Mbit/s) lets a shorter message through faster than the rate (gTop-k's 80 KB at d = 1e6
and density 0.01 in about 1 ms instead of 6.4 ms), which neither a real NIC nor the
virtual clock's link (every byte at the rate) does.

The emulated links send small packets (acknowledgements) ahead of the data
(``emulated-cluster --ack-priority``: ``htb`` with a small-packet class,
:meth:`mpicomm.emulate.netns.Cluster._shape_ack_first`) and queue at most ``--queue`` of
data (default 20 ms). With one ``tbf`` queue, where both directions of a link are busy
(allgather, allreduce, gTop-k between two hosts) each side's acknowledgements wait behind
its own data and a long queue holds back the other side's TCP window, while a short one
(5 ms) drops the bursts of messages of tens of kilobytes; neither happens on a host whose
queues are per flow (Linux's default ``fq_codel``) nor on the virtual link.
``--no-ack-priority`` shapes with one ``tbf`` queue (use ``--queue 5ms`` then). The
virtual links charge the TCP/IP/Ethernet headers (``--framing tcp``, the default;
:mod:`mpicomm.emulate.vnet`), as tc counts them against the emulated links' rate;
``--framing none`` charges the payload only. ``--reuse-wall`` keeps the wall-clock files
of an earlier run and redoes only the virtual half (which needs no quiet machine).
``--wall-only`` measures the cost table and the wall-clock half and stops: on a borrowed
quiet machine that is all that needs its time (at 100 Mbit/s, d = 1e6 and 1e7 and 5
repeats, each case run 7 times with the warm-ups: about 4 minutes at 2 hosts and 4.5 at
4, most of it the ping-pong's six one-way trips of 40 MB; the virtual half adds under a
minute); bring back the output folder and finish with ``--reuse-wall``, which keeps that
machine's core count and loads.

It writes ``vclock-wall-comparison.json``: per host count, case and size the wall
time, the virtual time (whole cost table), their relative difference and whether it is
within ``--tolerance`` (15%).

The wall-clock half measures the machine: it needs a quiet one, at least one core per
rank and nothing else running (the 1-minute load average before and after is recorded;
the run's own ``H`` ranks poll while they wait, so it counts as quiet when ``H`` is at
most the core count and the load at most ``H + 0.5``, and is flagged otherwise). Root is
needed for the emulated cluster's network namespaces.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: load above the run's own ranks that still counts as a quiet machine
QUIET_MARGIN = 0.5


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.pop("MPICOMM_CLOCK", None)
    env["MPICOMM_PYTHON"] = sys.executable
    return env


def _mpiexec() -> str:
    sys.path.insert(0, str(ROOT))
    from mpicomm.cli import find_mpiexec

    return find_mpiexec()


def _run(cmd: list[str], timeout: float) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, timeout=timeout)


def compare(wall: list[dict], virtual: list[dict], tolerance: float) -> list[dict]:
    """Rows of both runs matched by (case, elems): ``rel_diff = virtual / wall - 1``."""
    mine = {(r["case"], r["elems"]): r["full_s"] for r in virtual if "full_s" in r}
    out = []
    for r in wall:
        v = mine.get((r["case"], r["elems"]))
        if v is None or not r.get("wall_s"):
            continue
        rel = v / r["wall_s"] - 1
        out.append({"case": r["case"], "elems": r["elems"], "ranks": r["ranks"],
                    "wall_s": r["wall_s"], "virtual_s": v, "rel_diff": rel,
                    "within": abs(rel) <= tolerance})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="2,4", help="host counts (one rank per host)")
    ap.add_argument("--net", default="100mbit:1ms", help="RATE:DELAY of every link")
    ap.add_argument("--sizes", default="1e6,1e7", help="float32 elements per vector")
    ap.add_argument("--repeats", type=int, default=5, help="wall clock: repeats per case")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--burst", type=int, default=None,
                    help="tc token bucket of the emulated links in bytes (default: two "
                         "frames, 3028)")
    ap.add_argument("--queue", default="20ms",
                    help="tc queue allowance of the emulated links (default 20ms)")
    ap.add_argument("--ack-priority", action=argparse.BooleanOptionalAction, default=True,
                    help="emulated links shaped by htb with small packets first "
                         "(emulated-cluster --ack-priority; the default)")
    ap.add_argument("--framing", default="tcp",
                    help="headers per frame on the virtual links (tcp, none, PAYLOAD,HEADER)")
    ap.add_argument("--reuse-wall", action="store_true",
                    help="keep vclock-wall-H.json from an earlier run (virtual half only)")
    ap.add_argument("--wall-only", action="store_true",
                    help="the cost table and the wall-clock half only (finish elsewhere "
                         "with --reuse-wall)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    rate, _, delay = args.net.partition(":")
    if not rate or not delay:
        ap.error(f"--net wants RATE:DELAY, got {args.net!r}")
    if args.reuse_wall and args.wall_only:
        ap.error("--reuse-wall and --wall-only exclude each other")
    hosts = [int(h) for h in args.hosts.split(",") if h.strip()]
    sys.path.insert(0, str(ROOT))
    from mpicomm.emulate.mpienv import shaping_name
    from mpicomm.emulate.netns import MIN_BURST

    burst = MIN_BURST if args.burst is None else args.burst
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    costs = out / "vclock-costs.json"
    mpiexec = _mpiexec()
    bench = [sys.executable, "-m", "mpicomm.bench"]
    if not costs.exists():
        _run([mpiexec, "-n", str(max(hosts)), *bench, "costs", "--json", str(costs)],
             args.timeout)
    cores = os.cpu_count() or 1
    earlier = out / "vclock-wall-comparison.json"
    earlier_summary = (json.loads(earlier.read_text())
                       if args.reuse_wall and earlier.exists() else {})
    earlier_hosts = earlier_summary.get("per_hosts", {})
    cores = earlier_summary.get("cores", cores)  # the machine that ran the wall half
    summary: dict = {"net": args.net, "burst_bytes": burst, "sizes": args.sizes,
                     "framing": args.framing, "queue": args.queue,
                     "shaping": shaping_name(args.ack_priority),
                     "tolerance": args.tolerance,
                     "cores": cores, "costs": str(costs.relative_to(ROOT))
                     if costs.is_relative_to(ROOT) else str(costs), "per_hosts": {}}
    for h in hosts:
        wall_path, virt_path = out / f"vclock-wall-{h}.json", out / f"vclock-virtual-{h}.json"
        if args.reuse_wall:
            if not wall_path.exists():
                ap.error(f"--reuse-wall: no {wall_path}")
            loads = earlier_hosts.get(str(h), {})
            before = loads.get("loadavg_before", [math.nan] * 3)
            after = loads.get("loadavg_after", [math.nan] * 3)
        else:
            before = os.getloadavg()
            _run([str(ROOT / "launchers" / "emulated-cluster"), "--hosts", str(h), "--rate",
                  rate, "--delay", delay, "--burst", str(burst), "--queue", args.queue,
                  *(["--ack-priority"] if args.ack_priority else []), "--timeout",
                  str(int(args.timeout)), "--", *bench, "vclock", "--sizes", args.sizes,
                  "--repeats", str(args.repeats), "--json", str(wall_path)],
                 args.timeout + 60)
            after = os.getloadavg()
        quiet = h <= cores and max(before[0], after[0]) <= h + QUIET_MARGIN
        if args.wall_only:
            summary["per_hosts"][h] = {"loadavg_before": before, "loadavg_after": after,
                                       "quiet": quiet, "rows": [], "all_within": None}
            continue
        _run([mpiexec, "-n", str(h), *bench, "vclock", "--nets", args.net, "--framing",
              args.framing, "--sizes", args.sizes, "--costs", str(costs), "--json",
              str(virt_path)], args.timeout)
        rows = compare(json.loads(wall_path.read_text())["results"],
                       json.loads(virt_path.read_text())["results"], args.tolerance)
        summary["per_hosts"][h] = {"loadavg_before": before, "loadavg_after": after,
                                   "quiet": quiet, "rows": rows,
                                   "all_within": all(r["within"] for r in rows)}
        for r in rows:
            print(f"H={h} {r['case']:<30} d={r['elems']:.0e} wall {r['wall_s'] * 1e3:9.3f} ms"
                  f"  virtual {r['virtual_s'] * 1e3:9.3f} ms  {r['rel_diff']:+.1%}"
                  f"  {'ok' if r['within'] else 'OUTSIDE'}")
        if not quiet:
            print(f"WARNING: load average {max(before[0], after[0]):.1f} with {h} ranks on "
                  f"{cores} cores: the wall-clock half measured the machine's other jobs",
                  flush=True)
    (out / "vclock-wall-comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
