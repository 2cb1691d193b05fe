"""The checkpoint directory: one folder per step, one manifest per writing rank.

Layout of ``DIR`` (standard library only, so that a launcher can read it without torch)::

    DIR/step-000000120/rank-00000.pt      rank 0's state (torch.save, weights-only data)
    DIR/step-000000120/rank-00000.json    rank 0's manifest, written after its files
    DIR/step-000000120/store.pt           parameter-server mode: the KVStore's checkpoint
    ...                                   (worker 0 writes it; its manifest lists it)

A manifest (:func:`manifest`) names the format, the step, the run (a token drawn when
the job started, so that files of two attempts at the same step never mix), the job's
world size, the ranks that write (``writers``), this rank's fingerprint of what it saves
(:mod:`mpicomm.checkpoint.state`) and, per file, its SHA-256 and size. A rank writes its
data files first (atomically, :func:`mpicomm.durable.write_atomic`), then its manifest
(atomically too), so a manifest never names a file that is not whole on disk.

A step is *complete* when every writer's manifest is there, all of one run, and every
file they name has its size and SHA-256 (:func:`complete_steps` checks the manifests;
each rank checks its own files' bytes when it reads them,
:func:`mpicomm.durable.read_verified`). A checkpoint that a kill cut short lacks a
manifest or fails a checksum, and the previous complete one is used instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from typing import Any

from .. import durable

__all__ = ["FORMAT", "step_dir", "rank_file", "manifest_file", "STORE_FILE", "list_steps",
           "read_manifests", "complete_steps", "newest_complete", "write_manifest", "prune"]

FORMAT = "mpicomm.checkpoint/1"
STORE_FILE = "store.pt"
_STEP = re.compile(r"^step-(\d{9,})$")


def step_dir(directory: str, step: int) -> str:
    """``DIR/step-<step, 9 digits>``."""
    return os.path.join(directory, f"step-{step:09d}")


def rank_file(rank: int) -> str:
    """The name of ``rank``'s state file in a step folder."""
    return f"rank-{rank:05d}.pt"


def manifest_file(rank: int) -> str:
    """The name of ``rank``'s manifest in a step folder."""
    return f"rank-{rank:05d}.json"


def list_steps(directory: str) -> list[int]:
    """The steps that have a folder in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for n in names if (m := _STEP.match(n))]
    return sorted(steps, reverse=True)


def read_manifests(directory: str, step: int) -> dict[int, dict[str, Any]]:
    """Every readable manifest of ``step``, by rank (a torn or foreign one is left out)."""
    folder = step_dir(directory, step)
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        m = re.match(r"^rank-(\d{5,})\.json$", name)
        if not m:
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT and \
                data.get("rank") == int(m.group(1)) and data.get("step") == step:
            out[int(m.group(1))] = data
    return out


def _files_present(folder: str, entry: dict[str, Any]) -> bool:
    for name, meta in entry.get("files", {}).items():
        try:
            if os.path.getsize(os.path.join(folder, name)) != int(meta["bytes"]):
                return False
        except (OSError, KeyError, TypeError, ValueError):
            return False
    return True


def complete_steps(directory: str) -> list[tuple[int, dict[int, dict[str, Any]]]]:
    """``(step, manifests by rank)`` of every step whose writers all have a manifest of
    the same run, with files of the right size, newest first (the checksums are checked
    by whoever reads the files)."""
    out = []
    for step in list_steps(directory):
        manifests = read_manifests(directory, step)
        if not manifests:
            continue
        first = next(iter(manifests.values()))
        writers = first.get("writers")
        if not isinstance(writers, list) or any(
                m.get("run") != first.get("run") or m.get("writers") != writers
                for m in manifests.values()):
            continue
        if set(writers) - set(manifests):
            continue
        folder = step_dir(directory, step)
        if all(_files_present(folder, manifests[r]) for r in writers):
            out.append((step, {r: manifests[r] for r in writers}))
    return out


def newest_complete(directory: str) -> int | None:
    """The newest complete step in ``directory`` (by manifests and sizes), or ``None``."""
    steps = complete_steps(directory)
    return steps[0][0] if steps else None


def manifest(step: int, rank: int, *, run: str, ranks: int, writers: Iterable[int],
             fingerprint: dict[str, Any], files: dict[str, durable.Written],
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of ``rank`` at ``step`` (module docstring)."""
    return {"format": FORMAT, "step": step, "rank": rank, "run": run, "ranks": ranks,
            "writers": sorted(writers), "fingerprint": fingerprint,
            "files": {name: {"sha256": w.sha256, "bytes": w.nbytes}
                      for name, w in files.items()},
            **(extra or {})}


def write_manifest(directory: str, step: int, rank: int, data: dict[str, Any]) -> None:
    """Write ``rank``'s manifest of ``step`` atomically (after its files)."""
    path = os.path.join(step_dir(directory, step), manifest_file(rank))
    durable.write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())


def prune(directory: str, keep: int, protect: Iterable[int] = ()) -> list[int]:
    """Remove all but the ``keep`` newest complete steps, and every incomplete step older
    than the newest complete one (never a step in ``protect``, e.g. one being written).
    Returns the steps removed."""
    complete = [s for s, _ in complete_steps(directory)]
    if not complete:
        return []
    kept = set(complete[:keep]) | set(protect)
    newest = complete[0]
    removed = []
    for step in list_steps(directory):
        if step in kept or (step > newest and step not in complete):
            continue
        shutil.rmtree(step_dir(directory, step), ignore_errors=True)
        removed.append(step)
    return removed
