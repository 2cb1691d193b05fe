"""Generated data sets, cached per user: built once, then read by every rank and run.

Folder: ``$MPICOMM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/mpicomm``, else
``~/.cache/mpicomm``. One ``.npz`` file per data set and generation parameters (the key
names both). The first process to need a file builds it under an exclusive ``flock``
on ``KEY.lock`` and writes it atomically (temporary file, then rename); the others wait
on the lock and read the result, so the ranks of a job never build it twice and never
read half a file. Delete the folder to rebuild everything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

ENV_CACHE_DIR = "MPICOMM_CACHE_DIR"


def cache_dir() -> str:
    """The per-user cache folder (created on first use)."""
    path = os.environ.get(ENV_CACHE_DIR)
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        path = os.path.join(base, "mpicomm")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_arrays(key: str, build: Callable[[], tuple[dict[str, np.ndarray], dict[str, Any]]]
                  ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and JSON metadata stored under ``key``, built by ``build()`` if absent.

    ``build`` returns ``(arrays, metadata)``; ``key`` must change whenever what ``build``
    would produce changes (include every generation parameter in it).
    """
    path = os.path.join(cache_dir(), f"{key}.npz")
    if not os.path.exists(path):
        with _locked(path):
            if not os.path.exists(path):
                arrays, meta = build()
                tmp = f"{path}.{os.getpid()}.tmp.npz"
                np.savez(tmp, _meta=np.array(json.dumps(meta)), **arrays)
                os.replace(tmp, path)
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files if k != "_meta"}
        meta = json.loads(str(data["_meta"]))
    return arrays, meta
