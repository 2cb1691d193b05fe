"""The emulated cluster's command line (``launchers/emulated-cluster``).

``emulated-cluster --hosts H [--ranks-per-host R] [--rate RATE] [--delay DELAY]
[--schedule FILE] [--burst BYTES] [--queue DELAY] [--ack-priority] [--timeout SECONDS]
[--no-shm] [--clock wall|virtual] [--framing F] [--nics-per-host N] -- command args...``

With ``--clock virtual`` nothing is shaped and no namespace is made (no root needed):
the command runs under ``mpiexec -n H*R`` with the virtual clock's platform variables
(``MPICOMM_CLOCK=virtual``, ``MPICOMM_VIRTUAL_RATE``/``_DELAY``/``_RANKS_PER_HOST``/
``_SCHEDULE``/``_FRAMING``, :mod:`mpicomm.clock`), so that the same command line gives
the same cluster's timings in virtual time, whatever else runs on the machine. ``--rate``
is required then, and ``--no-shm`` does not apply. ``--framing tcp`` charges the
TCP/IP/Ethernet headers against the virtual links' rate as tc does against the wall
clock's (:mod:`mpicomm.emulate.vnet`); the default ``none`` charges the payload only.
``--nics-per-host N`` gives every host ``N`` network ports (``MPICOMM_HOST_NICS``; ``N =
R``: one per rank, as on servers with a NIC per GPU): local rank ``j`` sends and receives
through port ``j mod N``. On the virtual clock the platform models them; on the wall clock
each port is a namespace of its own with its own shaped link (below).

The steps of a wall-clock run:

1. Checks every argument, that the MPI is MPICH (see below) and that namespaces, veth and
   ``tbf`` work here (:func:`mpicomm.emulate.netns.probe`); exits 2 with the reason
   when it cannot run.
2. Creates the hosts (:class:`mpicomm.emulate.netns.Cluster`), shaped to ``RATE``.
3. Runs ``mpiexec -n H*R <wrapper> command args...`` where the per-rank wrapper moves
   rank ``r`` (``PMI_RANK``) into host ``r // R`` with ``ip netns exec`` (host-major
   placement). With ``--nics-per-host N``, host ``i`` is ``M = min(N, R)`` namespaces,
   one per port, each with its own shaped link, and rank ``r`` runs in namespace
   ``i·M + (r mod R) mod M``: the ranks of a port share its link, the ranks of a host
   still share memory (MPICH's cliques below do not depend on namespaces). MPI traffic
   between hosts goes over TCP on ``eth0``:
   ``UCX_TLS=tcp UCX_NET_DEVICES=eth0``, eager sends at every size
   (:data:`RNDV_THRESH`: both directions of an exchange at once), and MPICH's clique
   emulation (``MPIR_CVAR_NUM_CLIQUES=H``, ``MPIR_CVAR_CLIQUES_BY_BLOCK=1``: ranks of
   different hosts are not "local", so there is no shared-memory shortcut between
   them). With ``--no-shm``, ``MPIR_CVAR_NOLOCAL=1``: TCP between ranks of one host too
   (over the host's loopback, which is not shaped, as on a real machine; refused with
   several ports, whose namespaces have no common loopback).
4. Latency: this kernel has no ``netem``; ``DELAY`` is injected by mpicomm's own
   point-to-point layer (:mod:`mpicomm.emulate.linkdelay`) which the wrapper's environment
   switches on. The MPI library's own collectives bypass it.
5. ``--schedule`` entries are applied while the job runs
   (:mod:`mpicomm.emulate.schedule`).
6. Exits with the command's status (124 after ``--timeout``, 130 after Ctrl-C, 143
   after SIGTERM) and tears everything down on every path: the job's process group and
   anything left in the namespaces are killed, the namespaces and the run directory
   removed.

The job sees ``MPICOMM_EMU_HOSTS``, ``MPICOMM_EMU_RANKS_PER_HOST``, ``MPICOMM_EMU_RATE``,
``MPICOMM_EMU_DELAY`` (seconds) and ``MPICOMM_EMU_SCHEDULE``, which the benchmark suites
record as the conditions of their measurements, and ``MPICOMM_HOST_SIZES`` (``R,R,...``),
the host layout of :mod:`mpicomm.topology` (hierarchical collectives, the cost model's
two link classes).

Open MPI is refused for now: its wheel places ranks by its own rules and needs
``btl_tcp_if_include`` instead of the UCX variables; the MPICH path is the one verified.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType

from . import linkdelay, vnet
from .mpienv import shaping_name
from .netns import (
    QUEUE_S,
    Cluster,
    NetnsUnavailable,
    burst_bytes,
    parse_rate,
    probe,
    remove_stale,
)
from .schedule import Applier, parse_delay, read_schedule, write_atomic

__all__ = ["main", "build_parser", "job_env", "WRAPPER"]

PROG = "emulated-cluster"
#: Per-rank wrapper: rank from the launcher's environment; namespace = host·M + port,
#: host = rank // R, port = (rank mod R) mod M (M = ports per host; 1: the host).
WRAPPER = """#!/bin/sh
r=${{PMI_RANK:-${{PMIX_RANK:-${{OMPI_COMM_WORLD_RANK:-}}}}}}
if [ -z "$r" ]; then echo "{prog}: no PMI_RANK in the rank's environment" >&2; exit 97; fi
h=$((r / {per_host} * {ports} + r % {per_host} % {ports}))
exec {ip} netns exec {prefix}$h "$@"
"""


class _Stop(Exception):
    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Run an MPI command on H emulated hosts (network namespaces on one "
                    "machine) joined by tc-shaped links; latency is injected by "
                    "mpicomm's point-to-point layer. Needs root and iproute2.",
        epilog="example: emulated-cluster --hosts 4 --rate 1gbit --delay 100us -- "
               "python -m mpicomm.bench sparse")
    ap.add_argument("--hosts", type=int, required=True, help="number of emulated hosts H")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks per host R (rank r on host r // R; default 1)")
    ap.add_argument("--rate", default=None,
                    help="link rate of every host, tc units (100mbit, 1gbit); default "
                         "unshaped")
    ap.add_argument("--delay", default="0",
                    help="one-way latency between hosts (0, 250us, 1ms); injected by "
                         "mpicomm's point-to-point layer")
    ap.add_argument("--schedule", default=None,
                    help="file of `TIME|step N  RATE  DELAY` lines applied during the run")
    ap.add_argument("--burst", type=int, default=None,
                    help="tc token bucket in bytes (default 1 ms at the rate, at least "
                         "128 KiB; as small as 3028 for a link that serialises every "
                         "message at the rate)")
    ap.add_argument("--queue", default=None,
                    help="tc queue allowance of every shaped link, a delay such as 5ms "
                         "(default 50ms): how long a packet may wait behind others")
    ap.add_argument("--ack-priority", action="store_true",
                    help="shape with htb and send small packets (acknowledgements) ahead "
                         "of data, as a host's per-flow queues do; use with --queue 20ms")
    ap.add_argument("--timeout", type=float, default=None,
                    help="kill the job after SECONDS (exit status 124)")
    ap.add_argument("--no-shm", action="store_true",
                    help="TCP also between ranks of the same host")
    ap.add_argument("--clock", choices=("wall", "virtual"), default="wall",
                    help="wall (default): namespaces and tc; virtual: no shaping, the "
                         "virtual clock times the job on this platform (no root needed)")
    ap.add_argument("--framing", default="none",
                    help="--clock virtual: headers per frame charged on the links between "
                         "hosts: none (default), tcp, or PAYLOAD,HEADER bytes")
    ap.add_argument("--nics-per-host", type=int, default=1,
                    help="network ports per host, local rank j on port j mod N (default "
                         "1; R for one per rank); each port its own shaped link")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command args...")
    return ap


def _log(msg: str) -> None:
    sys.stderr.write(f"{PROG}: {msg}\n")
    sys.stderr.flush()


#: Size from which UCX switches from eager sends to its rendezvous protocol on the emulated
#: TCP links: never. With UCX's default rendezvous over TCP (and with ``put_zcopy``
#: forced) an exchange in both directions at once between two of 4 hosts sometimes ran
#: one direction after the other: 4 MB each way at 100 Mbit/s took either about 350 or
#: about 670 ms (line time 320 ms), so one of the two rounds of a recursive doubling ran
#: at half speed. Eager sends need no reply from the receiver before the data moves;
#: every pairing then took 346-361 ms, what a full-duplex link gives (``get_zcopy`` did
#: too). A value the caller sets is kept.
RNDV_THRESH = "inf"


def ports_per_host(per_host: int, nics: int) -> int:
    """Namespaces (shaped links) per host of a wall-clock run: ``min(N, R)``, as ports
    no rank uses carry nothing."""
    return min(nics, per_host)


def job_env(hosts: int, per_host: int, rate: str | None, delay: float, no_shm: bool,
            rundir: str, schedule: str | None,
            base: dict[str, str] | None = None, nics: int = 1) -> dict[str, str]:
    """The environment of ``mpiexec`` and so of every rank."""
    env = dict(os.environ if base is None else base)
    env.update(UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
    env.setdefault("UCX_RNDV_THRESH", RNDV_THRESH)
    if no_shm:
        env["MPIR_CVAR_NOLOCAL"] = "1"
    else:
        env.update(MPIR_CVAR_NUM_CLIQUES=str(hosts), MPIR_CVAR_CLIQUES_BY_BLOCK="1")
    env.update({
        "MPICOMM_EMU_HOSTS": str(hosts),
        linkdelay.ENV_RANKS_PER_HOST: str(per_host),
        "MPICOMM_EMU_RATE": rate or "unshaped",
        linkdelay.ENV_DELAY: repr(delay),
        linkdelay.ENV_DELAY_FILE: os.path.join(rundir, "delay"),
        linkdelay.ENV_STEP_FILE: os.path.join(rundir, "step"),
        "MPICOMM_EMU_SCHEDULE": os.path.abspath(schedule) if schedule else "",
        # the host layout mpicomm.topology reads (with --no-shm MPI sees no hosts at all)
        # and its ports: one shaped link per port namespace
        vnet.ENV_HOST_SIZES: ",".join([str(per_host)] * hosts),
        vnet.ENV_HOST_NICS: str(ports_per_host(per_host, nics)),
    })
    return env


def _check(args: argparse.Namespace) -> tuple[list[str], float | None, float, list]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command to run (put it after --)")
    if not 1 <= args.hosts <= 1000:
        raise ValueError(f"--hosts must be in [1, 1000], got {args.hosts}")
    if args.ranks_per_host < 1:
        raise ValueError(f"--ranks-per-host must be >= 1, got {args.ranks_per_host}")
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    rate = None if args.rate is None else parse_rate(args.rate)
    if args.burst is not None:
        if args.clock == "virtual":
            raise ValueError("--burst sizes the tc bucket; the virtual clock's links have none")
        burst_bytes(rate or 1e8, args.burst)
    if args.queue is not None:
        if args.clock == "virtual":
            raise ValueError("--queue sizes the tc queue; the virtual clock's links have none")
        Cluster.check_queue(_queue_s(args))
    if args.ack_priority and args.clock == "virtual":
        raise ValueError("--ack-priority shapes tc queues; the virtual clock's links have none")
    if args.nics_per_host < 1:
        raise ValueError(f"--nics-per-host must be >= 1, got {args.nics_per_host}")
    ports = ports_per_host(args.ranks_per_host, args.nics_per_host)
    if args.clock == "wall" and args.hosts * ports > 1000:
        raise ValueError(f"--hosts x min(--nics-per-host, --ranks-per-host) = "
                         f"{args.hosts * ports} namespaces; at most 1000")
    if args.clock == "wall" and args.no_shm and ports > 1:
        raise ValueError("--no-shm with --nics-per-host: the ranks of a host would meet "
                         "over the shaped links of their ports, not over a loopback")
    if args.clock == "wall" and _framed(args):
        raise ValueError("--framing is for --clock virtual; on the wall clock tc counts the "
                         "real headers")
    delay = parse_delay(args.delay)
    entries = read_schedule(args.schedule) if args.schedule else []
    return cmd, rate, delay, entries


def _queue_s(args: argparse.Namespace) -> float:
    return QUEUE_S if args.queue is None else parse_delay(args.queue)


def _framed(args: argparse.Namespace) -> bool:
    """Whether ``--framing`` asks for headers (anything but ``none``)."""
    return args.framing.strip().lower() != "none"


def virtual_env(hosts: int, per_host: int, rate: str, delay: str, schedule: str | None,
                base: dict[str, str] | None = None, framing: str = "none",
                nics: int = 1) -> dict[str, str]:
    """The environment of a ``--clock virtual`` job (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update({"MPICOMM_CLOCK": "virtual", vnet.ENV_RATE: rate, vnet.ENV_DELAY: delay,
                vnet.ENV_RANKS_PER_HOST: str(per_host),
                vnet.ENV_SCHEDULE: os.path.abspath(schedule) if schedule else "",
                vnet.ENV_FRAMING: framing, vnet.ENV_HOST_NICS: str(nics)})
    env.pop(vnet.ENV_HOST_SIZES, None)
    return env


def _run_virtual(args: argparse.Namespace, cmd: list[str]) -> int:
    """``--clock virtual``: plain mpiexec with the platform in the environment."""
    from .mpienv import find_mpiexec

    if args.rate is None:
        _log("--clock virtual needs --rate (the virtual links' rate, e.g. 1gbit)")
        return 2
    if args.no_shm:
        _log("--no-shm does not apply to --clock virtual (shared memory is modelled)")
        return 2
    ranks = args.hosts * args.ranks_per_host
    env = virtual_env(args.hosts, args.ranks_per_host, args.rate, args.delay, args.schedule,
                      framing=args.framing, nics=args.nics_per_host)
    try:   # the ranks would each raise it; say it once, before starting them
        vnet.platform_from_env(ranks, env)
        mpiexec = find_mpiexec()
    except (ValueError, FileNotFoundError) as exc:
        _log(str(exc))
        return 2
    _log(f"{args.hosts} host(s) x {args.ranks_per_host} rank(s), virtual clock: rate "
         f"{args.rate}, delay {args.delay}" + (f", schedule {args.schedule}"
                                              if args.schedule else "")
         + (f", framing {args.framing}" if _framed(args) else "")
         + (f", {args.nics_per_host} NICs per host" if args.nics_per_host > 1 else ""))
    proc = subprocess.Popen([mpiexec, "-n", str(ranks), *cmd], env=env,
                            start_new_session=True)
    try:
        return proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        _log(f"stopping the job: timed out after {args.timeout:g} s")
        return 124
    finally:
        _terminate(proc)


def _mpich_mpiexec() -> str:
    from .mpienv import find_mpiexec, library_version, mpi_flavor

    if mpi_flavor(library_version()) != "mpich":
        raise ValueError("the emulated cluster supports MPICH (the project's default MPI: "
                         "make MPI=mpich); this mpi4py uses another MPI")
    return find_mpiexec()


def _terminate(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the job's process group, then SIGKILL what is left after ``grace``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cmd, rate, delay, entries = _check(args)
        if args.clock == "virtual":
            return _run_virtual(args, cmd)
        mpiexec = _mpich_mpiexec()
    except (ValueError, FileNotFoundError) as exc:
        _log(str(exc))
        return 2
    reason = probe()
    if reason is not None:
        _log(f"cannot run here: {reason}")
        return 2
    stale = remove_stale()
    if stale:
        _log(f"removed {len(stale)} namespace(s) left by killed runs: {', '.join(stale)}")

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise _Stop(128 + signum, signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM,
                                                    signal.SIGHUP)}
    ports = ports_per_host(args.ranks_per_host, args.nics_per_host)
    cluster = Cluster(args.hosts * ports, rate, args.burst, _queue_s(args),
                      ack_priority=args.ack_priority)
    rundir: str | None = None
    proc: subprocess.Popen | None = None
    applier: Applier | None = None
    ranks = args.hosts * args.ranks_per_host
    try:
        rundir = tempfile.mkdtemp(prefix=f"{cluster.switch}-")
        cluster.setup()
        write_atomic(os.path.join(rundir, "delay"), repr(delay))
        wrapper = os.path.join(rundir, "rank")
        with open(wrapper, "w") as f:
            f.write(WRAPPER.format(prog=PROG, per_host=args.ranks_per_host, ports=ports,
                                   ip=cluster.ip, prefix=cluster.host(0)[:-1]))
        os.chmod(wrapper, 0o755)
        env = job_env(args.hosts, args.ranks_per_host, args.rate, delay, args.no_shm,
                      rundir, args.schedule, nics=args.nics_per_host)
        if rate is not None:
            env["MPICOMM_EMU_BURST"] = str(burst_bytes(rate, args.burst))
            env["MPICOMM_EMU_QUEUE"] = repr(cluster.queue)
            env["MPICOMM_EMU_SHAPING"] = shaping_name(args.ack_priority)
        qdisc = "htb, small packets first" if args.ack_priority else "tbf"
        shaped = (f"{args.rate} (tc {qdisc}, bucket {burst_bytes(rate, args.burst)} B, queue "
                  f"{cluster.queue * 1e3:g} ms)"
                  if rate is not None else "unshaped")
        _log(f"{args.hosts} host(s) x {args.ranks_per_host} rank(s)"
             + (f", {ports} ports per host" if ports > 1 else "")
             + f", rate {shaped}, delay {delay * 1e3:g} ms (injected by mpicomm p2p), "
             f"namespaces {cluster.host(0)[:-1]}*")
        proc = subprocess.Popen([mpiexec, "-n", str(ranks), wrapper, *cmd], env=env,
                                start_new_session=True)
        if entries:
            applier = Applier(entries, cluster.set_rate, os.path.join(rundir, "delay"),
                              os.path.join(rundir, "step"), _log, initial=(rate, delay))
            applier.start()
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        while True:
            try:
                code = proc.wait(0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if applier is not None and applier.errors:
                raise _Stop(1, applier.errors[0])
            if deadline is not None and time.monotonic() > deadline:
                raise _Stop(124, f"timed out after {args.timeout:g} s")
        if applier is not None and applier.errors:
            _log(applier.errors[0])
            return code or 1
        return code
    except _Stop as stop:
        _log(f"stopping the job: {stop}")
        return stop.code
    except NetnsUnavailable as exc:
        _log(f"cannot run here: {exc}")
        return 2
    finally:
        # teardown must not be cut short by a second Ctrl-C
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        try:
            if applier is not None:
                applier.stop.set()
            if proc is not None:
                _terminate(proc)
            cluster.teardown()
            if rundir is not None:
                shutil.rmtree(rundir, ignore_errors=True)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
