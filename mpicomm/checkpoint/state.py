"""What a rank saves: copies of its objects' state, its random generators, and a fingerprint.

* :func:`freeze` deep-copies a ``state_dict`` into plain data (dicts, lists, tuples,
  numbers, strings, CPU tensors), so that training can change the originals while a
  background thread writes the copy, and so that ``torch.load(weights_only=True)`` reads
  it back without unpickling code; numpy arrays travel as tensors (:func:`thaw` turns
  them back). Cost: one memory copy of the state.
* :func:`rng_state` / :func:`set_rng_state`: Python's ``random``, numpy's global
  generator, torch's CPU generator and every CUDA device's, so that dropout, random
  augmentation or sampling continue as if nothing had happened. Generators a program
  holds itself (``numpy.random.Generator`` objects) are its own to save, e.g. in the
  position it passes to :meth:`~mpicomm.checkpoint.Checkpointer.save`.
* :func:`fingerprint` summarizes what a checkpoint must match to be loaded: a module's
  tensor names, shapes and dtypes, an optimizer's kind and parameter-group sizes, and
  the kind (and strategy) of anything else; :func:`mismatch` says in one sentence how
  two fingerprints differ.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["freeze", "thaw", "rng_state", "set_rng_state", "fingerprint", "mismatch"]

_NDARRAY = "__ndarray__"


def freeze(x: Any, where: str = "state") -> Any:
    """A deep copy of ``x`` as plain data with CPU tensors (``TypeError`` naming the path
    of anything else, e.g. an object that would need pickling)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.array(x, copy=True))}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: freeze(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(freeze(v, f"{where}[{i}]") for i, v in enumerate(x))
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot checkpoint {where}: a {type(x).__name__} (state must be "
                    "tensors, arrays, numbers, strings, lists and dicts)")


def thaw(x: Any) -> Any:
    """Undo :func:`freeze`'s encoding of numpy arrays (tensors stay tensors)."""
    if isinstance(x, dict):
        if set(x) == {_NDARRAY}:
            return x[_NDARRAY].numpy()
        return {k: thaw(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(thaw(v) for v in x)
    return x


def rng_state() -> dict[str, Any]:
    """The state of Python's, numpy's (global), torch's and CUDA's generators."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s output."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fingerprint(obj: Any) -> dict[str, Any]:
    """What a checkpoint of ``obj`` must match (module docstring)."""
    if isinstance(obj, torch.nn.Module):
        return {"kind": "module",
                "tensors": [[name, list(t.shape), str(t.dtype).replace("torch.", "")]
                            for name, t in obj.state_dict().items()]}
    if isinstance(obj, torch.optim.Optimizer):
        return {"kind": type(obj).__name__,
                "groups": [len(g["params"]) for g in obj.param_groups]}
    inner = getattr(obj, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and hasattr(obj, "param_groups"):
        return {"kind": type(obj).__name__, "optimizer": fingerprint(inner)}
    strategy = getattr(getattr(obj, "strategy", None), "name", None)
    return {"kind": type(obj).__name__, **({"strategy": strategy} if strategy else {})}


def mismatch(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """How the fingerprints of the saved objects (by name) differ from this rank's,
    in one sentence, or ``None`` if they match."""
    if sorted(saved) != sorted(mine):
        return (f"it holds the state of {sorted(saved)}, this job checkpoints "
                f"{sorted(mine)}")
    for name in sorted(mine):
        a, b = saved[name], mine[name]
        if a == b:
            continue
        if a.get("kind") == b.get("kind") == "module":
            ta, tb = a["tensors"], b["tensors"]
            for x, y in zip(ta, tb):
                if x != y:
                    return (f"{name}: tensor {x[0]!r} is {tuple(x[1])} {x[2]} there, "
                            f"{y[0]!r} is {tuple(y[1])} {y[2]} here (another model)")
            return (f"{name}: {len(ta)} tensors there, {len(tb)} here (another model)")
        return f"{name}: {a} there, {b} here"
    return None
