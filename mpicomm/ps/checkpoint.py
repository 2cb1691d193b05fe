"""Checkpoints of a parameter-server job: one file, written atomically, loaded without pickle.

What is saved (everything needed to continue as if nothing happened): per key its full
value (the servers' pieces joined, so a checkpoint does not depend on the number of
servers), the optimizer state joined the same way, the version (updates applied), and
``last_seq[w]``, the sequence number of the last push of each worker applied; per worker
the error-feedback residuals and the push compressor's state (PowerSGD's warm-start
``Q`` per piece; ``compressor``, optional on load). Not saved: the copies that pull
compression keeps of what each worker holds; a restored store starts without them, so
each worker's first pull after a restore is a full-precision one (see
:class:`~mpicomm.ps.KVStore`). A worker's own sequence counters are *not* stored apart:
at a checkpoint every push a worker sent has been applied, so they equal ``last_seq``
(checked when the checkpoint is assembled: a difference would be a lost update).

Format: a dict of tensors, ints, strings and lists saved with ``torch.save``, so that
``torch.load(path, weights_only=True)`` reads it (no arbitrary code is unpickled);
``format`` names the layout version. Atomicity (:func:`mpicomm.durable.write_atomic`):
written to a temporary file beside ``path``, flushed and fsynced, then ``os.replace``-d
over ``path`` (and the directory fsynced): a reader sees the old file or the new one,
never half of one; a crash leaves at most a stray temp file, which :func:`load` never
opens.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import durable
from ..durable import Written

__all__ = ["FORMAT", "assemble", "serialize", "write_atomic", "load", "check", "metadata",
           "piece_state", "to_numpy", "to_torch_cpu", "worker_states"]

FORMAT = "mpicomm.ps/1"
_FIELDS = ("workers", "mode", "optimizer", "keys", "shapes", "dtypes", "frameworks", "values",
           "opt", "version", "last_seq", "residuals")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy copy of a CPU tensor (bfloat16 travels as its int16 bit pattern)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.clone().numpy()


def to_torch_cpu(x: Any) -> torch.Tensor:
    """A CPU torch copy of an array or tensor (for saving)."""
    from ..buffers import to_torch

    return to_torch(x).detach().cpu().clone()


def _tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.array(a, copy=True)) if isinstance(a, np.ndarray) else a
    return t.view(dtype) if dtype == torch.bfloat16 and t.dtype == torch.int16 else t


def assemble(infos: Sequence[Any], states: dict[int, dict[tuple[int, int], Any]],
             workers_state: Sequence[dict[str, Any]], *, workers: int, mode: str,
             optimizer: dict[str, Any]) -> dict[str, Any]:
    """Join the servers' piece states (``states[server][(key_id, piece)]``) and the
    workers' states into the checkpoint dict; ``RuntimeError`` if they disagree."""
    values, opt, versions, last_seq = [], [], [], []
    for info in infos:
        parts = [states[p.server][(info.key_id, p.index)] for p in info.pieces]
        versions.append(_agree(info, "version", [int(x["version"]) for x in parts]))
        seqs = [tuple(int(v) for v in x["last_seq"]) for x in parts]
        last_seq.append(torch.tensor(_agree(info, "last_seq", seqs), dtype=torch.int64))
        values.append(torch.cat([_tensor(x["value"], info.dtype) for x in parts])
                      .reshape(info.shape))
        state: dict[str, Any] = {}
        for name in parts[0]["opt"]:
            items = [x["opt"][name] for x in parts]
            if isinstance(items[0], np.ndarray):
                state[name] = torch.cat([_tensor(a, info.dtype) for a in items])
            else:
                state[name] = _agree(info, name, [int(a) for a in items])
        opt.append(state)
    for w, ws in enumerate(workers_state):
        expected = [int(s[w]) for s in last_seq]
        if list(ws["seq"]) != expected:
            raise RuntimeError(f"worker {w} has pushed {ws['seq']} times per key but the "
                               f"servers applied {expected}: an update was lost")
    return {
        "format": FORMAT,
        "workers": workers,
        "mode": mode,
        "optimizer": dict(optimizer),
        "keys": [info.key for info in infos],
        "shapes": [list(info.shape) for info in infos],
        "dtypes": [str(info.dtype).replace("torch.", "") for info in infos],
        "frameworks": [info.framework for info in infos],
        "values": values,
        "opt": opt,
        "version": versions,
        "last_seq": last_seq,
        "residuals": [dict(ws["residuals"]) for ws in workers_state],
        "compressor": [dict(ws["compressor"]) for ws in workers_state],
    }


def _agree(info: Any, what: str, items: Sequence[Any]) -> Any:
    if any(x != items[0] for x in items):
        raise RuntimeError(f"key {info.key!r}: pieces disagree on {what}: {items}")
    return items[0]


def serialize(data: dict[str, Any]) -> bytes:
    """The bytes of ``torch.save(data)`` (what :func:`write_atomic` writes)."""
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getbuffer().tobytes()


def write_atomic(data: dict[str, Any], path: str | os.PathLike[str]) -> Written:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over it
    (:func:`mpicomm.durable.write_atomic`); returns the file's SHA-256 and size."""
    return durable.write_atomic(path, serialize(data))


def load(path: str | os.PathLike[str], *, workers: int, optimizer: dict[str, Any],
         stateful_compressor: bool = True) -> dict[str, Any]:
    """Read and :func:`check` a checkpoint (``weights_only``: tensors and plain data only)."""
    data = torch.load(os.fspath(path), weights_only=True, map_location="cpu")
    return check(data, workers=workers, optimizer=optimizer,
                 stateful_compressor=stateful_compressor)


def check(data: Any, *, workers: int, optimizer: dict[str, Any],
          stateful_compressor: bool = True) -> dict[str, Any]:
    """``data`` if a store of ``workers`` workers with ``optimizer`` (its description)
    can restore it, else ``ValueError`` saying why. ``stateful_compressor``: whether the
    store's push compressor keeps state (PowerSGD's warm start) that the checkpoint may
    hold."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a parameter-server checkpoint (format "
                         f"{data.get('format') if isinstance(data, dict) else None!r}, "
                         f"expected {FORMAT!r})")
    missing = [f for f in _FIELDS if f not in data]
    if missing:
        raise ValueError(f"corrupt checkpoint: no {', '.join(missing)}")
    if data["workers"] != workers:
        raise ValueError(f"the checkpoint has {data['workers']} workers' sequence numbers, "
                         f"this store has {workers} workers")
    if data["optimizer"]["optimizer"] != optimizer["optimizer"]:
        raise ValueError(f"the checkpoint holds {data['optimizer']['optimizer']} state, this "
                         f"store uses {optimizer['optimizer']}")
    n = len(data["keys"])
    for field in ("shapes", "dtypes", "frameworks", "values", "opt", "version", "last_seq"):
        if len(data[field]) != n:
            raise ValueError(f"corrupt checkpoint: {len(data[field])} {field} for {n} keys")
    for field in ("residuals", "compressor"):
        if field in data and len(data[field]) != workers:
            raise ValueError(f"corrupt checkpoint: {field} for {len(data[field])} workers, "
                             f"expected {workers}")
    if any(data.get("compressor") or []) and not stateful_compressor:
        raise ValueError("the checkpoint holds push compressor state, this store's "
                         "compressor keeps none")
    return data


def worker_states(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per worker: its error-feedback residuals and its push compressor's state (empty in
    checkpoints written before compressor state was saved)."""
    compressor = data.get("compressor") or [{} for _ in data["residuals"]]
    return [{"residuals": r, "compressor": c} for r, c in zip(data["residuals"], compressor)]


def metadata(data: dict[str, Any]) -> dict[str, Any]:
    """What every worker needs from a checkpoint (not the values): keys, shapes, dtypes,
    frameworks (``cupy`` comes back as torch on the CPU) and sequence numbers."""
    return {"keys": list(data["keys"]), "shapes": [list(s) for s in data["shapes"]],
            "dtypes": list(data["dtypes"]),
            "frameworks": [fw if fw in ("numpy", "torch") else "torch"
                           for fw in data["frameworks"]],
            "last_seq": [s.tolist() for s in data["last_seq"]]}


def piece_state(data: dict[str, Any], k: int, start: int, stop: int) -> dict[str, Any]:
    """The server-side state of elements ``[start, stop)`` of key ``k`` for an init message."""
    opt = {name: (to_numpy(v.reshape(-1)[start:stop]) if isinstance(v, torch.Tensor)
                  else int(v)) for name, v in data["opt"][k].items()}
    return {"opt": opt, "version": int(data["version"][k]),
            "last_seq": data["last_seq"][k].numpy().copy()}
