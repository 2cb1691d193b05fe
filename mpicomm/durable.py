"""Files that are never seen half-written, and a thread that writes them behind training.

:func:`write_atomic` writes to ``<path>.tmp-<pid>`` beside the target, flushes and
``fsync``-s it, ``os.replace``-s it over ``path`` and ``fsync``-s the directory: a reader
sees the old file or the new one, never a mix, even after a crash or a ``kill -9`` at any
instant; a crash leaves at most a stray temporary file, which no reader opens. It returns
the SHA-256 and size of what it wrote, so that a manifest written afterwards can prove
the file whole (:func:`sha256_bytes` checks it when the file is read back).

:class:`BackgroundWriter` runs one write task at a time on a daemon thread, so that a
training loop hands a snapshot over and goes on computing while the disk works; handing
over the next task first waits for the previous one (that wait is the only time a step
spends on the disk). An exception of a task is raised again in the caller by the next
:meth:`~BackgroundWriter.submit`, :meth:`~BackgroundWriter.wait` or
:meth:`~BackgroundWriter.close`.

Cost: one pass over the bytes for the hash (about 1-2 GB/s) besides the write and the
``fsync``; the thread holds no MPI resource and calls no MPI function.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Written", "write_atomic", "sha256_bytes", "read_verified", "BackgroundWriter"]


@dataclass(frozen=True)
class Written:
    """What :func:`write_atomic` wrote: the file's SHA-256 (hex) and size in bytes."""

    sha256: str
    nbytes: int


def sha256_bytes(data: bytes | memoryview) -> str:
    """The SHA-256 of ``data`` as 64 hex digits."""
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | memoryview) -> Written:
    """Write ``data`` to ``path`` atomically and durably (module docstring)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path)
    return Written(sha256_bytes(data), len(data))


def read_verified(path: str | os.PathLike[str], sha256: str, nbytes: int) -> bytes:
    """The bytes of ``path`` if their size and SHA-256 are the ones given, else
    ``ValueError`` saying which differs (``OSError`` if the file cannot be read)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != nbytes:
        raise ValueError(f"{os.fspath(path)}: {len(data)} bytes, the manifest says {nbytes} "
                         "(cut short)")
    if sha256_bytes(data) != sha256:
        raise ValueError(f"{os.fspath(path)}: SHA-256 differs from the manifest's (damaged)")
    return data


class BackgroundWriter:
    """One write task at a time on a daemon thread (module docstring).

    ``waited_s`` adds up the time callers spent waiting for a previous task;
    ``tasks`` counts the tasks completed.
    """

    def __init__(self, name: str = "mpicomm-writer") -> None:
        self.name = name
        self.waited_s = 0.0
        self.tasks = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """Whether a task is still running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, task: Callable[[], None]) -> float:
        """Wait for the previous task (re-raising its error), then start ``task``;
        returns the seconds waited."""
        waited = self.wait()
        self._thread = threading.Thread(target=self._run, args=(task,), name=self.name,
                                        daemon=True)
        self._thread.start()
        return waited

    def _run(self, task: Callable[[], None]) -> None:
        try:
            task()
            self.tasks += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc

    def wait(self) -> float:
        """Block until the running task (if any) is done; re-raise its error."""
        waited = 0.0
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            waited = time.perf_counter() - t0
            self.waited_s += waited
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return waited

    def close(self) -> None:
        """:meth:`wait` (the last task is finished, not dropped)."""
        self.wait()
