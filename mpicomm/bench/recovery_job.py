# ruff: noqa: E402
"""The training job that the recovery benchmark (and its tests) kill and restart.

Run under ``python -m mpicomm run -n N --restarts K --checkpoint-dir DIR -- python -m
mpicomm.bench.recovery_job MODE ...``; it checkpoints every ``--every`` steps with
:class:`mpicomm.checkpoint.Checkpointer` and resumes from the newest complete one.

Modes:

``peer``
    A small MLP (with dropout, so torch's generator matters) trained by
    :class:`~mpicomm.torch.GradientSync` with a compressing strategy and error feedback
    (``--strategy``, default Top-k 5 %) and SGD with momentum; each rank's minibatch of
    step ``t`` is drawn from ``default_rng([seed, rank, t])``. Rank 0 saves the final
    ``state_dict`` (``--save``): bitwise equal to an uninterrupted run's.
``sync``
    The same model through a parameter server (``--servers``, the last ranks; SGD with
    momentum on the servers) in BSP mode via :class:`~mpicomm.torch.PSOptimizer`.
``async`` / ``ssp``
    Exactly-once counting: one key of ``W * steps`` zeros, plain SGD with ``lr = W``;
    worker ``w`` pushes at step ``t`` the one-hot vector of entry ``w * steps + t``, so
    the final value is minus the number of times each (worker, step) push was applied.
    Worker 0 computes ``--slow`` times as long as the others. The JSON says whether every
    entry is exactly 1 and the largest staleness the servers served (SSP: at most
    ``--staleness``, across the restart too).

``--progress DIR``: every rank writes ``pid-<rank>`` (its process id, per start) and rank 0
``step`` (the last step done) so that a harness can kill a chosen rank at a chosen step;
after a restart rank 0 writes ``resumed.json`` with the time of its first step after the
restore and the restore's duration, and every rank ``phases-<rank>.json``: the
``time.time()`` of each stage of its start (:data:`PHASES`) and the launcher's
``MPICOMM_RESTART_FAILED_AT`` / ``_LAUNCHED_AT``. ``--json PATH``: rank 0 writes the
run's facts.
"""

from __future__ import annotations

import time

#: Python is up and ``mpicomm`` (with ``mpi4py``, so ``MPI_Init``) is imported; the
#: imports below (torch) come after it on purpose.
_MODULE_AT = time.time()

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import torch

from ..checkpoint import Checkpointer, CheckpointError
from ..cli import RankZeroParser
from ..comm import Communicator, init
from ..ps import KVStore
from ..supervise import ENV_FAILED_AT, ENV_LAUNCHED_AT, ENV_RESTART
from ..torch import GradientSync, PSOptimizer

MODES = ("peer", "sync", "async", "ssp")
#: The stages of a start, in order, each a ``time.time()`` in ``phases-<rank>.json``:
#: the process exists; Python and ``mpicomm`` (``MPI_Init``) are loaded; torch and the
#: rest too (``main`` entered); ``mpicomm.init`` done; the checkpoint restored; the
#: first step done (workers).
PHASES = ("process_at", "module_at", "main_at", "init_at", "restored_at", "first_step_at")


def process_start_time() -> float:
    """When this process started, in ``time.time()`` seconds (Linux ``/proc``, to a clock
    tick: 10 ms), or ``nan`` where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = RankZeroParser(prog="python -m mpicomm.bench.recovery_job",
                        description="A job to kill and resume (see the module docstring).")
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint period in steps")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--strategy", default="topk")
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=20.0,
                    help="extra compute per step (sleep), so that a kill lands mid-run")
    ap.add_argument("--slow", type=float, default=3.0, help="async/ssp: worker 0's factor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="rank 0 saves the final state_dict here")
    ap.add_argument("--progress", default=None, help="folder for pid and step files")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("steps", "every", "hidden"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    return args


def build_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(),
                               torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 4))


def batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng([seed, rank, step])
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = (x[:, :4].argmax(1)).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


class Progress:
    """The files a harness watches (module docstring); no-ops without a folder."""

    def __init__(self, folder: str | None, rank: int, main_at: float, init_at: float
                 ) -> None:
        self.folder, self.rank = folder, rank
        self.restart = int(os.environ.get(ENV_RESTART, "0"))
        self.first_step_at: float | None = None
        self.marks: dict[str, float | None] = {
            "process_at": process_start_time(), "module_at": _MODULE_AT, "main_at": main_at,
            "init_at": init_at}
        for name, var in (("failed_at", ENV_FAILED_AT), ("launched_at", ENV_LAUNCHED_AT)):
            self.marks[name] = float(os.environ[var]) if os.environ.get(var) else None
        if folder:
            _write(os.path.join(folder, f"pid-{rank}"), f"{os.getpid()} {self.restart}")

    def restored(self, load_s: float) -> None:
        """The checkpoint is loaded (or there was none); servers' last stage."""
        self.marks["restored_at"] = time.time()
        self.marks["load_s"] = load_s
        self._phases()

    def step(self, step: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = self.marks["first_step_at"] = time.time()
            self._phases()
        if self.folder and self.rank == 0:
            _write(os.path.join(self.folder, "step"), f"{step} {self.restart}")

    def _phases(self) -> None:
        if self.folder and self.restart:
            _write(os.path.join(self.folder, f"phases-{self.rank}.json"),
                   json.dumps({"rank": self.rank, "restart": self.restart, **self.marks}))

    def resumed(self, ckpt: Checkpointer, restored_step: int | None) -> None:
        if self.folder and self.rank == 0 and self.restart:
            _write(os.path.join(self.folder, "resumed.json"), json.dumps(
                {"first_step_at": self.first_step_at, "load_s": ckpt.stats.load_s,
                 "restored_step": restored_step, "restart": self.restart}))


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def pace(args: argparse.Namespace, worker: int) -> None:
    factor = args.slow if args.mode in ("async", "ssp") and worker == 0 else 1.0
    time.sleep(args.step_ms * factor / 1e3)


# ---------------------------------------------------------------------- peer
def run_peer(args: argparse.Namespace, comm: Communicator, progress: Progress
             ) -> dict[str, Any]:
    model = build_model(args.hidden, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = GradientSync(model, args.strategy, comm=comm, density=args.density)
    ckpt = Checkpointer(comm=comm, every=args.every, model=model, optimizer=opt, sync=sync)
    resumed = ckpt.restore()
    progress.restored(ckpt.stats.load_s)
    start = resumed.position["step"] if resumed else 0
    for step in range(start, args.steps):
        x, y = batch(args.seed, comm.rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sync.step(opt)
        pace(args, comm.rank)
        progress.step(step + 1)
        if step == start:
            progress.resumed(ckpt, resumed.step if resumed else None)
        ckpt.maybe_save(step + 1, {"step": step + 1})
    ckpt.close()
    sync.close()
    if args.save and comm.rank == 0:
        torch.save(model.state_dict(), args.save)
    return {"restored_step": resumed.step if resumed else None,
            "waited_s": ckpt.stats.waited_s, "write_s": ckpt.stats.write_s,
            "snapshot_s": ckpt.stats.snapshot_s}


# ---------------------------------------------------------------------- parameter server
def run_ps(args: argparse.Namespace, comm: Communicator, progress: Progress
           ) -> dict[str, Any]:
    counting = args.mode in ("async", "ssp")
    kw: dict[str, Any] = {"staleness": args.staleness} if args.mode == "ssp" else {}
    workers = comm.size - args.servers
    if counting:
        kv = KVStore(comm, servers=args.servers, mode=args.mode, lr=float(workers), **kw)
    else:
        kv = KVStore(comm, servers=args.servers, mode="sync", lr=0.05, momentum=0.9)
    model = None if kv.is_server or counting else build_model(args.hidden, args.seed)
    objects = {} if model is None else {"model": model}
    ckpt = Checkpointer(comm=comm, every=args.every, kv=kv, **objects)
    wc = comm.split(0 if kv.is_worker else None)
    resumed = ckpt.restore()
    progress.restored(ckpt.stats.load_s)
    start = resumed.position["step"] if resumed and resumed.position else 0
    facts: dict[str, Any] = {"restored_step": resumed.step if resumed else None}
    if kv.is_server:
        kv.serve()
    else:
        w = kv.worker_rank
        assert w is not None
        opt = None
        if counting:
            size = workers * args.steps
            if resumed is None:
                kv.init("count", np.zeros(size))
        else:
            assert model is not None
            opt = PSOptimizer(model, kv)
        for step in range(start, args.steps):
            if counting:
                g = np.zeros(workers * args.steps)
                g[w * args.steps + step] = 1.0
                kv.push("count", g)
                kv.pull("count")
            else:
                assert model is not None and opt is not None
                x, y = batch(args.seed, w, step)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            pace(args, w)
            progress.step(step + 1)
            if step == start:
                progress.resumed(ckpt, facts["restored_step"])
            ckpt.maybe_save(step + 1, {"step": step + 1})
        ckpt.close()
        assert wc is not None
        wc.barrier()  # every push is in (each worker's last pull came after its push)
        if counting:
            final = kv.pull("count")
            kv.close()
            counts = -final
            facts.update(exactly_once=bool(np.all(counts == 1.0)),
                         applied=int(np.count_nonzero(counts)),
                         expected=workers * args.steps,
                         twice=int(np.sum(counts > 1.0)), missing=int(np.sum(counts == 0)))
        else:
            assert opt is not None and model is not None
            opt.pull()
            opt.close()
            if args.save and comm.rank == 0:
                torch.save(model.state_dict(), args.save)
        facts["worker_staleness"] = kv.stats()["max_staleness"]
    if wc is not None:
        wc.free()
    stats = comm.allgather_object(kv.stats() if kv.is_server else None)
    facts["server_staleness"] = max(s["max_staleness"] for s in stats if s is not None)
    facts["server_duplicates"] = sum(s["duplicates"] for s in stats if s is not None)
    return facts


def main(argv: list[str] | None = None) -> int:
    main_at = time.time()
    args = parse_args(argv)
    comm = init()
    init_at = time.time()
    torch.set_num_threads(1)
    if args.progress and comm.rank == 0:
        os.makedirs(args.progress, exist_ok=True)
    comm.barrier()
    progress = Progress(args.progress, comm.rank, main_at, init_at)
    try:
        facts = run_peer(args, comm, progress) if args.mode == "peer" else \
            run_ps(args, comm, progress)
    except CheckpointError as exc:  # raised on every rank alike, before any training
        if comm.rank == 0:
            print(f"recovery_job: error: {exc}", file=sys.stderr, flush=True)
        return 2
    facts.update(mode=args.mode, ranks=comm.size, restart=progress.restart)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
