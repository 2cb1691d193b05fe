"""The :class:`Checkpointer`: save every few steps in the background, resume after a restart."""

from __future__ import annotations

import io
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import durable
from ..comm import Communicator, resolve
from ..ps.checkpoint import serialize
from ..validate import check_int
from . import layout
from .state import fingerprint, freeze, mismatch, rng_state, set_rng_state, thaw

__all__ = ["Checkpointer", "CheckpointError", "Restored", "ENV_CHECKPOINT_DIR"]

log = logging.getLogger("mpicomm.checkpoint")

#: Where ``python -m mpicomm run --checkpoint-dir DIR`` tells every rank to checkpoint.
ENV_CHECKPOINT_DIR = "MPICOMM_CHECKPOINT_DIR"


class CheckpointError(ValueError):
    """A checkpoint that this job must not load (another model, world size or store), or
    an unusable directory; raised on every rank alike, before any state is changed.

    Uncaught, it ends the job with exit status 2 (``exit_status``), which ``python -m
    mpicomm run --restarts`` does not restart: the same input would fail again."""

    exit_status = 2


@dataclass
class Restored:
    """What :meth:`Checkpointer.restore` resumed from: the step saved, the position the
    program passed to :meth:`Checkpointer.save`, and the folder read."""

    step: int
    position: Any
    path: str


@dataclass
class CheckpointStats:
    """Counters of one rank's :class:`Checkpointer`.

    ``waited_s``: time steps spent waiting for the previous write (the only time the
    disk costs training); ``snapshot_s``: time spent copying the state (and, with a
    parameter server, gathering the store's); ``write_s``: time the background writes
    took; ``saves``: checkpoints started; ``load_s``: time :meth:`restore` took.
    """

    saves: int = 0
    waited_s: float = 0.0
    snapshot_s: float = 0.0
    write_s: float = 0.0
    load_s: float = 0.0
    last_step: int | None = None
    bytes_written: int = 0
    steps: list[int] = field(default_factory=list)


class Checkpointer:
    r"""Checkpoint a training job every ``every`` steps and resume it after a restart.

    Built on every rank of ``comm`` (collective), with the objects to save as keywords:
    anything with ``state_dict()`` / ``load_state_dict()``, e.g. the model, the optimizer
    and the synchronization object (:class:`~mpicomm.torch.GradientSync`: the strategy's
    error-feedback residuals, warm starts and controllers; :class:`~mpicomm.torch.LocalSGD`:
    the period schedule and AdaComm; :class:`~mpicomm.torch.DistributedOptimizer`)::

        ckpt = Checkpointer(comm=comm, every=50, model=model, optimizer=opt, sync=sync)
        resumed = ckpt.restore()                 # None: nothing to resume, start at 0
        start = 0 if resumed is None else resumed.position["step"]
        for step in range(start, steps):
            train_one_step(step)                 # forward, backward, sync.step(opt)
            ckpt.maybe_save(step + 1, {"step": step + 1})
        ckpt.close()                             # the last write is finished

    ``directory`` defaults to ``$MPICOMM_CHECKPOINT_DIR`` (set by ``python -m mpicomm
    run --checkpoint-dir DIR``) and must exist. Each checkpoint is one folder per step
    with one file and one manifest per writing rank (:mod:`mpicomm.checkpoint.layout`).

    What a rank saves: copies of its objects' states, the ``position`` the program
    passes (its place in the data: epoch, batch, sampler state; plain data), and the
    random generators of Python, numpy and torch (:mod:`mpicomm.checkpoint.state`). With
    the same seed and data order, a run killed and resumed ends bit for bit where an
    uninterrupted run ends.

    **Background writing**: :meth:`save` copies the state (a memory copy), hands it to a
    writer thread and returns; the thread serializes, hashes, writes and fsyncs while
    training goes on. A step waits for the disk only when the previous checkpoint is
    still being written when the next one is due (counted in ``stats.waited_s``).

    **Never half-written**: files are written atomically and the manifest last; on
    :meth:`restore` every rank checks its own files against the manifest's SHA-256. A
    checkpoint that a kill cut short is skipped, and the previous complete one is used
    (every rank agrees on which).

    **Parameter-server mode** (``kv=`` a :class:`mpicomm.ps.KVStore` on ``comm``): built
    and restored on every rank, servers included; :meth:`save` is called by the workers
    only (between steps, after the pulls). Worker 0 also writes the store
    (:meth:`KVStore.snapshot <mpicomm.ps.KVStore.snapshot>`: shards, optimizer state,
    per-worker sequence numbers, error-feedback residuals) and :meth:`restore` loads it
    with :meth:`KVStore.restore <mpicomm.ps.KVStore.restore>` in place of ``init``
    (:class:`~mpicomm.torch.PSOptimizer` then adopts the restored keys). Servers call
    ``kv.serve()`` after :meth:`restore`.

    **Bad input**: a missing directory, or a newest complete checkpoint written by a job
    of another world size or for another model (tensor names, shapes, dtypes), raise
    :class:`CheckpointError` on every rank before any state is changed; nothing in the
    directory is touched.

    Parameters
    ----------
    directory:
        An existing folder (default ``$MPICOMM_CHECKPOINT_DIR``).
    comm:
        The ranks that train (default: the world).
    every:
        :meth:`maybe_save` saves at steps that are multiples of ``every`` (0: never).
    keep:
        Complete checkpoints kept; older ones are removed by rank 0's writer.
    background:
        ``False`` writes in :meth:`save` itself (for tests and tiny states).
    kv:
        Parameter-server mode (see above).
    objects:
        Name -> object with ``state_dict``/``load_state_dict``; the same names on every
        writing rank.

    Tuning: ``every`` trades the work lost by a kill (``every / 2`` steps on average)
    against disk traffic; with background writing, the steady cost is the memory copy
    per save, so the lower bound on ``every`` is where one write takes longer than
    ``every`` steps.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 comm: Communicator | None = None, every: int = 0, keep: int = 2,
                 background: bool = True, kv: Any = None, **objects: Any) -> None:
        comm = resolve(comm)
        with comm.validating("checkpoint.Checkpointer") as agreed:
            if directory is None:
                directory = os.environ.get(ENV_CHECKPOINT_DIR) or None
            if directory is None:
                raise CheckpointError(
                    "no checkpoint directory: pass directory= or run under python -m "
                    "mpicomm run --checkpoint-dir DIR (MPICOMM_CHECKPOINT_DIR)")
            directory = os.path.abspath(os.fspath(directory))
            if not os.path.isdir(directory):
                raise CheckpointError(f"checkpoint directory {directory!r} does not exist "
                                      "(create it first)")
            every = check_int("every", every, 0)
            keep = check_int("keep", keep, 1)
            for name, obj in objects.items():
                if not (callable(getattr(obj, "state_dict", None))
                        and callable(getattr(obj, "load_state_dict", None))):
                    raise TypeError(f"{name}: a {type(obj).__name__} has no state_dict() "
                                    "and load_state_dict()")
            if kv is not None and kv.workers + kv.servers != comm.size:
                raise ValueError(f"kv has {kv.workers + kv.servers} ranks, comm has "
                                 f"{comm.size}: build the Checkpointer on the store's ranks")
            agreed.update(every=every, keep=keep, directory=directory, ps=kv is not None)
        self.directory = directory
        self.comm = comm
        self.every = every
        self.keep = keep
        self.background = bool(background)
        self.kv = kv
        self.objects = dict(objects)
        self.writers = list(range(kv.workers)) if kv is not None else list(range(comm.size))
        self.is_writer = comm.rank in self.writers
        self.fingerprints = {name: fingerprint(obj) for name, obj in self.objects.items()}
        self.run = comm.bcast_object(os.urandom(8).hex() if comm.rank == 0 else None)
        self.stats = CheckpointStats()
        self._writer = durable.BackgroundWriter(f"mpicomm-checkpoint-{comm.rank}")
        self._closed = False

    def __repr__(self) -> str:
        mode = "parameter server" if self.kv is not None else "peers"
        return (f"Checkpointer({self.directory!r}, {mode}, every={self.every}, "
                f"keep={self.keep}, objects={sorted(self.objects)})")

    # ------------------------------------------------------------------ restore
    def restore(self) -> Restored | None:
        """Load the newest complete checkpoint into the objects (collective over
        ``comm``); ``None`` when there is none (start from scratch). Raises
        :class:`CheckpointError` on every rank for one of another world size or model."""
        t0 = time.perf_counter()
        candidates = self.comm.bcast_object(
            layout.complete_steps(self.directory) if self.comm.rank == 0 else None)
        for step, manifests in candidates:
            path = layout.step_dir(self.directory, step)
            first = manifests[min(manifests)]
            if first["ranks"] != self.comm.size or first["writers"] != self.writers:
                raise CheckpointError(
                    f"{path} was written by a job of {first['ranks']} ranks "
                    f"({len(first['writers'])} saving), this job has {self.comm.size} "
                    f"({len(self.writers)} saving): resume with the same ranks, or use "
                    "another checkpoint directory")
            verdict, payload = self._read_own(step, manifests.get(self.comm.rank))
            verdicts = self.comm.allgather_object(verdict)
            problems = [(r, v[1]) for r, v in enumerate(verdicts) if v[0] == "mismatch"]
            if problems:
                r, why = problems[0]
                raise CheckpointError(f"{path} cannot be loaded by this job (rank {r}): {why}")
            damaged = [(r, v[1]) for r, v in enumerate(verdicts) if v[0] == "damaged"]
            if damaged:
                if self.comm.rank == 0:
                    log.warning("skipping checkpoint %s: rank %d: %s", path, *damaged[0])
                continue
            self._discard_newer(step)
            resumed = self._apply(step, payload, path)
            self.stats.load_s = time.perf_counter() - t0
            return resumed
        self._discard_newer(-1)
        return None

    def _read_own(self, step: int, entry: dict[str, Any] | None
                  ) -> tuple[tuple[str, str], dict[str, Any] | None]:
        """(verdict, payload): ``("ok", "")`` with this rank's saved state, or
        ``("mismatch" | "damaged", why)``."""
        if not self.is_writer:
            return ("ok", ""), None
        if entry is None:
            return ("damaged", "no manifest"), None
        why = mismatch(entry.get("fingerprint", {}), self.fingerprints)
        if why is not None:
            return ("mismatch", why), None
        folder = layout.step_dir(self.directory, step)
        try:
            blobs = {name: durable.read_verified(os.path.join(folder, name), meta["sha256"],
                                                 int(meta["bytes"]))
                     for name, meta in entry["files"].items()}
            state = _load(blobs[layout.rank_file(self.comm.rank)])
            if layout.STORE_FILE in blobs:
                state["__store__"] = _load(blobs[layout.STORE_FILE])
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            return ("damaged", f"{type(exc).__name__}: {exc}"), None
        if self.kv is not None and self.comm.rank == self.writers[0]:
            if "__store__" not in state:
                return ("damaged", "the parameter-server store is missing"), None
            try:  # refused here, before the servers serve: every rank raises alike
                self.kv.check_checkpoint(state["__store__"])
            except ValueError as exc:
                return ("mismatch", f"the store: {exc}"), None
        return ("ok", ""), state

    def _apply(self, step: int, state: dict[str, Any] | None, path: str) -> Restored:
        if self.kv is not None and self.kv.is_worker:
            # collective over the workers; the servers are serving by now
            self.kv.restore(state.pop("__store__") if state and "__store__" in state
                            else os.path.join(path, layout.STORE_FILE))
        position = None
        if state is not None:
            for name, obj in self.objects.items():
                obj.load_state_dict(thaw(state["objects"][name]))
            set_rng_state(state["rng"])
            position = thaw(state["position"])
        self.stats.last_step = step
        if self.comm.rank == 0:
            log.info("resumed from %s", path)
        return Restored(step, position, path)

    def _discard_newer(self, step: int) -> None:
        """Rank 0 removes the folders of steps after ``step`` (cut short by the kill that
        ended the previous run); the others wait, so no new write races the removal."""
        if self.comm.rank == 0:
            for s in layout.list_steps(self.directory):
                if s > step:
                    log.info("removing the incomplete checkpoint %s",
                             layout.step_dir(self.directory, s))
                    shutil.rmtree(layout.step_dir(self.directory, s), ignore_errors=True)
        self.comm.barrier()

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, position: Any = None) -> bool:
        """:meth:`save` when ``every`` divides ``step`` (``step > 0``); returns whether it
        saved."""
        if self.every and step > 0 and step % self.every == 0:
            self.save(step, position)
            return True
        return False

    def save(self, step: int, position: Any = None) -> None:
        """Checkpoint the objects as step ``step`` (writing ranks, all together, between
        steps). Waits for the previous write first, copies the state, and returns while
        a thread writes it (``background=True``)."""
        if self._closed:
            raise RuntimeError("Checkpointer.save after close()")
        if not self.is_writer:
            raise RuntimeError("Checkpointer.save is a worker call; servers only serve")
        step = check_int("step", step, 0)
        self.stats.waited_s += self._writer.wait()
        t0 = time.perf_counter()
        state = {"step": step, "position": freeze(position, "position"), "rng": rng_state(),
                 "objects": {name: freeze(obj.state_dict(), name)
                             for name, obj in self.objects.items()}}
        store = self.kv.snapshot() if self.kv is not None else None
        self.stats.snapshot_s += time.perf_counter() - t0
        self.stats.saves += 1
        self.stats.last_step = step

        def write() -> None:
            self._write(step, state, store)

        if self.background:
            self._writer.submit(write)
        else:
            write()

    def _write(self, step: int, state: dict[str, Any], store: dict[str, Any] | None) -> None:
        t0 = time.perf_counter()
        folder = layout.step_dir(self.directory, step)
        os.makedirs(folder, exist_ok=True)
        rank = self.comm.rank
        files = {layout.rank_file(rank): durable.write_atomic(
            os.path.join(folder, layout.rank_file(rank)), serialize(state))}
        if store is not None:
            files[layout.STORE_FILE] = durable.write_atomic(
                os.path.join(folder, layout.STORE_FILE), serialize(store))
        layout.write_manifest(self.directory, step, rank, layout.manifest(
            step, rank, run=self.run, ranks=self.comm.size, writers=self.writers,
            fingerprint=self.fingerprints, files=files))
        if rank == 0:
            layout.prune(self.directory, self.keep, protect=(step,))
        self.stats.bytes_written += sum(w.nbytes for w in files.values())
        self.stats.write_s += time.perf_counter() - t0
        self.stats.steps.append(step)

    def wait(self) -> None:
        """Block until the last checkpoint is on disk (re-raising a write error)."""
        self.stats.waited_s += self._writer.wait()

    def close(self) -> None:
        """Finish the last write; further saves are refused. Idempotent."""
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _load(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
