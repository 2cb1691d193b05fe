"""``python -m mpicomm``: what this installation is, and a launcher that picks the right mpiexec.

``python -m mpicomm info``
    Versions (mpicomm, Python, numpy, torch, mpi4py), the MPI library, the thread level,
    whether CUDA is available, the CUDA-aware decision with its reason, and the default
    alpha-beta-gamma cost parameters. Under ``mpiexec -n N`` (rank 0 prints) also the
    nodes and local ranks, alpha and beta measured per link kind (intra-/inter-node) and
    which buffer backends work (:mod:`mpicomm.jobinfo`).

``python -m mpicomm strategies``
    The strategy names that ``GradientSync``, ``DistributedOptimizer`` and
    ``ddp_comm_hook`` take, their classes and their options with defaults
    (:func:`strategies_table`). ``python -m mpicomm --version`` prints the version.

``python -m mpicomm plot metrics.jsonl [-o out.png]``
    PNG plots of a metrics file (:mod:`mpicomm.observe.metrics`) or of a Chrome trace
    (:mod:`mpicomm.observe.trace`); needs matplotlib (the ``plot`` extra).

``python -m mpicomm run -n N [--servers S] [--restarts K --checkpoint-dir DIR] [--] command ...``
    Runs ``mpiexec -n N command ...`` with the ``mpiexec`` of the MPI library that mpi4py
    is linked against and exits with its status; a bare ``python`` command runs this
    interpreter (:func:`mpicomm.emulate.mpienv.own_python`). ``--servers S`` (parameter-server mode,
    ``1 <= S < N``) puts ``MPICOMM_PS_SERVERS=S`` in every rank's environment; a script
    reads it with :func:`ps_servers` and passes it on, e.g.
    ``mpicomm.ps.KVStore(comm, servers=ps_servers(), ...)``. ``--checkpoint-dir DIR`` (an
    existing directory) puts ``MPICOMM_CHECKPOINT_DIR=DIR`` in every rank's environment
    (:class:`mpicomm.checkpoint.Checkpointer` and the examples read it);
    ``--restarts K`` ends and restarts the whole job when any rank dies, up to ``K``
    times, and the training resumes from the newest complete checkpoint in ``DIR``
    (:mod:`mpicomm.supervise`). Same logic as ``launchers/mpicomm-run``
    (:mod:`mpicomm.emulate.mpienv`: which ``mpiexec``, and the settings Open MPI needs in
    containers and on oversubscribed machines).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from .emulate.mpienv import find_mpiexec, launcher_env, library_version, mpi_flavor, own_python
from .supervise import supervise

__all__ = ["main", "info", "ps_servers", "ENV_PS_SERVERS", "ENV_CHECKPOINT_DIR"]

#: Set by ``python -m mpicomm run --servers S`` for every rank.
ENV_PS_SERVERS = "MPICOMM_PS_SERVERS"
#: Set by ``python -m mpicomm run --checkpoint-dir DIR`` for every rank.
ENV_CHECKPOINT_DIR = "MPICOMM_CHECKPOINT_DIR"

_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


# ---------------------------------------------------------------------- run
def ps_servers(default: int | None = None) -> int | None:
    """The server count given by ``python -m mpicomm run --servers S``
    (``$MPICOMM_PS_SERVERS``), else ``default``; ``ValueError`` if it is not an integer
    >= 1."""
    raw = os.environ.get(ENV_PS_SERVERS, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV_PS_SERVERS}={raw!r}: expected an integer >= 1")
    return int(raw)


def run(ranks: int, command: Sequence[str], servers: int | None = None,
        restarts: int = 0, checkpoint_dir: str | None = None) -> int:
    """``mpiexec -n ranks command...`` for mpi4py's MPI; returns the exit status.
    ``servers``: exported to the ranks as ``MPICOMM_PS_SERVERS`` (``1 <= servers <
    ranks``: at least one worker). ``checkpoint_dir`` (must exist): exported as
    ``MPICOMM_CHECKPOINT_DIR``; ``restarts``: how many times a failed job is started
    again (:func:`mpicomm.supervise.supervise`)."""
    if ranks < 1:
        raise ValueError(f"-n must be >= 1, got {ranks}")
    if servers is not None and not 1 <= servers < ranks:
        raise ValueError(f"--servers must be in [1, {ranks - 1}] for {ranks} ranks (at "
                         f"least one worker), got {servers}")
    if restarts < 0:
        raise ValueError(f"--restarts must be >= 0, got {restarts}")
    if checkpoint_dir is not None and not os.path.isdir(checkpoint_dir):
        raise ValueError(f"--checkpoint-dir {checkpoint_dir!r}: no such directory "
                         "(create it first)")
    if not command:
        raise ValueError("no command to run")
    flavor = mpi_flavor(library_version())
    argv = [find_mpiexec(), "-n", str(ranks), *own_python(list(command))]
    env = launcher_env(flavor, ranks)
    if servers is not None:
        env[ENV_PS_SERVERS] = str(servers)
    if checkpoint_dir is not None:
        env[ENV_CHECKPOINT_DIR] = os.path.abspath(checkpoint_dir)
    if restarts:
        return supervise(argv, env, restarts)
    return wait_for_launcher(subprocess.Popen(argv, env=env))


def wait_for_launcher(proc: subprocess.Popen, grace_s: float = 5.0) -> int:
    """``proc``'s exit status. On Ctrl-C the launcher got the same signal from the
    terminal and is ending the ranks (they print "interrupted" once): wait for it
    rather than kill it, which would leave the ranks behind. If it is still running
    after ``grace_s`` (the signal reached this process alone), pass it on; after twice
    that, kill the launcher."""
    stage = 0
    while True:
        try:
            return proc.wait(timeout=None if stage == 0 else grace_s)
        except KeyboardInterrupt:
            stage = max(stage, 1)
        except subprocess.TimeoutExpired:
            if stage == 1:
                proc.send_signal(signal.SIGINT)
            elif stage >= 2:
                proc.kill()
            stage += 1


# ---------------------------------------------------------------------- info
def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except ImportError:
        return "not installed"
    return str(getattr(mod, "__version__", "unknown"))


def info() -> dict[str, Any]:
    """What ``python -m mpicomm info`` prints, as a dict (initializes MPI: one process)."""
    from mpi4py import MPI

    from . import __version__
    from .collectives.cost import CostParams
    from .cudampi import cuda_aware_reason

    cuda = "torch not installed"
    try:
        import torch

        cuda = (f"yes ({torch.cuda.device_count()} device(s))" if torch.cuda.is_available()
                else "no")
    except ImportError:
        pass
    try:
        aware, reason = cuda_aware_reason()
    except ValueError as exc:  # MPICOMM_CUDA_AWARE=1 on an MPI that denies CUDA support
        aware, reason = False, f"refused: {exc}"
    params = CostParams()
    level = MPI.Query_thread()
    return {
        "mpicomm": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "mpi4py": _version("mpi4py"),
        "MPI library": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "thread level": f"MPI_THREAD_{_THREAD_LEVELS[level].upper()}"
        if 0 <= level < len(_THREAD_LEVELS) else str(level),
        "CUDA available": cuda,
        "CUDA-aware MPI": f"{'yes' if aware else 'no'} ({reason})",
        "cost defaults": f"alpha={params.alpha:.3g} s, beta={params.beta:.3g} s/B "
                         f"({1 / params.beta / 1e9:.3g} GB/s), gamma={params.gamma:.3g} s/B",
        "mpiexec": _mpiexec_or_none(),
    }


def _world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


class RankZeroParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` for MPI jobs: help and errors are printed by rank 0 only (one
    copy instead of one per rank), and an error is one ``prog: error: ...`` line; every
    rank exits with status 2, so no rank goes on to communicate alone. Sub-parsers made
    with ``add_subparsers`` are of this class too. Used by ``python -m mpicomm.bench`` and
    the examples."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if _world_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def job_info() -> dict[str, str]:
    """Under ``mpiexec -n N`` (N > 1): nodes, local ranks, measured alpha/beta per link
    kind and usable buffer backends (:mod:`mpicomm.jobinfo`; collective). One process
    gets its placement and backends (no link to measure)."""
    from .comm import init
    from .jobinfo import describe_job, format_job

    return format_job(describe_job(init()))


def _mpiexec_or_none() -> str:
    try:
        return find_mpiexec()
    except FileNotFoundError as exc:
        return str(exc)


# ---------------------------------------------------------------------- strategies
def strategies_table(width: int = 100) -> str:
    """``python -m mpicomm strategies``: every strategy name, its class and its options
    with their defaults (from the constructors' signatures), as the wrappers take them:
    ``GradientSync(model, strategy="gtopk", density=0.05)``."""
    import inspect
    import textwrap

    from .strategies import available
    from .torch.strategy_options import strategy_class, strategy_option_names

    rows = []
    for name in available():
        cls = strategy_class(name)
        options = strategy_option_names(name)
        if cls is None or options is None:
            rows.append((name, cls.__name__ if cls else "?", "(see its documentation)"))
            continue
        params = inspect.signature(cls.__init__).parameters
        shown = [f"{o}={params[o].default!r}" if params[o].default is not inspect.Parameter.empty
                 else o for o in options]
        rows.append((name, cls.__name__, ", ".join(shown)))
    w_name = max(len(r[0]) for r in rows + [("name", "", "")])
    w_cls = max(len(r[1]) for r in rows + [("", "class", "")])
    indent = " " * (w_name + w_cls + 4)
    lines = [f"{'name':{w_name}}  {'class':{w_cls}}  options (default)"]
    for name, cls_name, options in rows:
        wrapped = textwrap.wrap(options, width=max(40, width - len(indent)),
                                break_on_hyphens=False) or [""]
        lines.append(f"{name:{w_name}}  {cls_name:{w_cls}}  {wrapped[0]}")
        lines.extend(indent + rest for rest in wrapped[1:])
    lines.append("")
    lines += ["GradientSync, DistributedOptimizer, ddp_comm_hook and TorchJob take a name",
              'and its options as keywords: GradientSync(model, strategy="gtopk", density=0.05).',
              "auto's options are the fields of mpicomm.strategies.AutoConfig; the bytes each",
              "strategy sends are in docs/compression.md."]
    return "\n".join(lines)


# ---------------------------------------------------------------------- plot
def plot(path: str, output: str | None = None) -> int:
    """``python -m mpicomm plot``: a metrics file's panels, or a trace's spans, as PNG."""
    from .observe.plot import load_records, loss_note, plot_metrics, plot_trace, png_path

    out = output or str(png_path(path))
    note = None
    try:
        with open(path) as f:
            head = f.read(64).lstrip()
        if head.startswith('{"traceEvents"') or head.startswith('{ "traceEvents"'):
            written = plot_trace(path, out)
        else:
            records = load_records(path)
            written = plot_metrics(records, out, title=path)
            note = loss_note(records)
    except (OSError, ValueError, ImportError) as exc:
        print(f"python -m mpicomm plot: {exc}", file=sys.stderr)
        return 2
    print(f"plot written to {written}")
    if note:
        print(f"python -m mpicomm plot: {note}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mpicomm",
                                 description="mpicomm command-line tools.")
    ap.add_argument("--version", action="version", version=f"mpicomm {_own_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("strategies", help="the gradient strategies' names, classes and options",
                   description="Print every strategy name that GradientSync, "
                               "DistributedOptimizer and ddp_comm_hook take, its class and "
                               "its options with their defaults.")
    sub.add_parser("info", help="versions, MPI library, thread level, CUDA-awareness, "
                                "cost-model defaults; under mpiexec also nodes, links "
                                "(alpha/beta) and usable buffer backends")
    pp = sub.add_parser("plot", help="PNG plots of a metrics JSON-lines file (or a trace)",
                        description="Plot a metrics file of mpicomm.observe.metrics (loss and "
                                    "accuracy against time and bytes, tau, collective, "
                                    "traffic, predicted vs measured communication) or, for "
                                    "a Chrome-trace JSON, its spans. Needs matplotlib.")
    pp.add_argument("file", help="metrics.jsonl (or a trace .json)")
    pp.add_argument("-o", "--output", default=None,
                    help="PNG path (default: FILE with .png in place of its suffix: "
                         "run.jsonl -> run.png)")
    rp = sub.add_parser("run", help="mpiexec for mpi4py's MPI (Open MPI settings included)",
                        description="Run `mpiexec -n N command...` with the mpiexec of the "
                                    "MPI library mpi4py uses; exits with its status.")
    rp.add_argument("-n", "-np", dest="ranks", type=int, required=True,
                    help="number of ranks")
    rp.add_argument("--servers", type=int, default=None, metavar="S",
                    help="parameter-server mode: S of the ranks are servers; exported to "
                         "every rank as MPICOMM_PS_SERVERS=S (read it with "
                         "mpicomm.cli.ps_servers())")
    rp.add_argument("--restarts", type=int, default=0, metavar="K",
                    help="when any rank dies, end the whole job and start it again, up to "
                         "K times; the training resumes from the newest complete "
                         "checkpoint in --checkpoint-dir (exit status 2, a usage error, "
                         "is never restarted)")
    rp.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                    help="an existing directory, exported to every rank as "
                         "MPICOMM_CHECKPOINT_DIR=DIR (mpicomm.checkpoint and the examples "
                         "checkpoint there and resume from there)")
    rp.add_argument("cmd", nargs=argparse.REMAINDER,
                    help="the command each rank runs (a leading -- is optional)")
    return ap


def _own_version() -> str:
    from ._version import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "strategies":
        print(strategies_table())
        return 0
    if args.command == "info":
        report = info()
        report.update(job_info())
        if _world_rank() == 0:
            for key, value in report.items():
                print(f"{key:18s} {value}")
        return 0
    if args.command == "plot":
        return plot(args.file, args.output)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        return run(args.ranks, cmd, servers=args.servers, restarts=args.restarts,
                   checkpoint_dir=args.checkpoint_dir)
    except (ValueError, FileNotFoundError) as exc:
        print(f"python -m mpicomm run: {exc}", file=sys.stderr)
        return 2
