"""Per-step metrics: one record per training step, for the loop and as JSON lines.

:class:`Metrics` is the one recording API of mpicomm. The training loop, and every
subsystem that decides or measures something per step, put fields into the *current*
record; :meth:`Metrics.record` closes it, keeps it (``metrics.last``,
``metrics.records``) and appends it as one JSON line to a file::

    metrics = Metrics("run.jsonl")                # or MPICOMM_METRICS=run.jsonl
    sync = GradientSync(model, "gtopk", metrics=metrics)   # records every step itself
    for x, y in loader:
        ...; loss.backward()
        sync.step(opt, loss=loss)                 # observes the sync, writes the line
        print(metrics.last["compression"], metrics.last["comm_s"])
    metrics.record("eval", accuracy=test_accuracy)  # a held-out number, when you have it

The loss: only the loop knows it, so it is recorded where the loop hands it over:
``GradientSync.step(opt, loss=loss)`` (or ``wait(loss=...)``),
``DistributedOptimizer.step(loss=loss)`` (or the value its closure returns),
``LocalSGD.step(loss)``, or ``metrics.note(loss=...)`` before the step for anything
else (the DDP hook, a parameter server). ``examples/train.py``, ``examples/train_ps.py``
and the benchmark harness (:mod:`mpicomm.bench.harness`) do it themselves, and add a
record per epoch (training ``loss`` and ``accuracy``) and per evaluation (held-out
numbers), whether the metrics come from ``--metrics`` or ``MPICOMM_METRICS``. Without
a loss the plot's loss panels say how to record it.

    # or, without an integration: pull the counters of any source yourself
    metrics.observe(local_sgd, loss=float(loss))  # LocalSGD, GradientSync, DDP hook
                                                  # state, or a bare Strategy

How subsystems report (the API for the selector, parameter servers, schedulers)
---------------------------------------------------------------------------------
Take a ``metrics: Metrics | None`` argument (default ``None``: nothing is recorded, the
cost is one ``is None`` check), and call ``metrics.note(**fields)`` when you know
something about the current step; the fields land in the next record, whoever writes
it. Use the standard names below where they fit (so that ``python -m mpicomm plot``
draws them) and your own otherwise; values must be JSON-able (numbers, strings, bools,
lists, dicts). Examples::

    metrics.note(collective="allgather", cr=0.01, predicted_comm_s=t, gain=g)  # selector
    metrics.note(staleness=s, server_s=t)                                       # PS worker
    metrics.record(kind="decision", collective="gtopk", reason="...")   # a one-off event

Standard fields
---------------
======================  ===========================================================
``kind``                ``"step"`` (default), ``"epoch"``, ``"decision"``, ...
``step``                records of this kind so far (0, 1, ...) unless given
``time_s``              seconds since the ``Metrics`` was created (always set)
``step_s``              seconds since the previous ``step`` record (always set)
``rank``                this rank in ``MPI.COMM_WORLD`` (always set)
``loss``, ``accuracy``  the training loop's numbers
``sent_bytes``          bytes this rank sent through mpicomm collectives this step
``recv_bytes``          bytes it received
``dense_bytes``         bytes of the dense gradients the strategy aggregated
``compression``         ``dense_bytes / sent_bytes`` (> 1: savings)
``total_sent_bytes``    cumulative ``sent_bytes`` (always set; 0 until observed)
``strategy``            the strategy's name; ``collective``: the collective it used
``predicted_comm_s``    the cost model's prediction of this step's communication
``comm_s``              measured communication time (thread time for GradientSync)
``wait_s``              time the loop blocked waiting for communication
``tau``, ``rounds``     local SGD: the averaging period in force, rounds so far
``averaged``            local SGD: whether this step averaged the parameters
``gain``                compression gain ``E‖g_c‖² / E‖g_e‖²`` (the CR selector's)
``staleness``           parameter-server mode: the staleness of the applied gradient
======================  ===========================================================

File: ``path`` (or ``MPICOMM_METRICS``). A ``{rank}`` in it gives every rank its own
file; otherwise only rank 0 writes (every rank still keeps its records in memory). A
line is appended (open, write, close) per record: ~20 µs, no handle to leak. Records
are per rank: ``sent_bytes`` is this rank's.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any

from .. import clock
from ..validate import check_int

__all__ = ["Metrics", "metrics_from", "predict_step_comm", "scalar"]


def _world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def scalar(value: Any) -> float:
    """A number or a one-element tensor (a loss still attached to its graph, too) as a
    float, without autograd's warning; the only cost is the device-to-host copy."""
    detach = getattr(value, "detach", None)
    return float(detach() if callable(detach) else value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


class Metrics:
    """Per-step records, kept in memory and appended to a JSON-lines file.

    Parameters
    ----------
    path:
        File to append to; ``None`` reads ``MPICOMM_METRICS`` (unset or empty: keep the
        records in memory only). ``{rank}`` in it is replaced by the world rank; without
        it only rank 0 writes.
    rank:
        The world rank (default: from MPI).
    keep:
        Keep at most this many records in ``records`` (older ones are dropped; the
        file has all). Default 100 000.
    fresh:
        Empty the file first. Default: yes for an explicit ``path``, no for
        ``MPICOMM_METRICS`` (several objects of one run, e.g. two GradientSyncs, then
        append to the same file; remove it between runs).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, rank: int | None = None,
                 keep: int = 100_000, fresh: bool | None = None):
        if fresh is None:  # an explicit path starts a new file; the variable appends
            fresh = path is not None
        from_env = path is None
        if path is None:
            path = os.environ.get("MPICOMM_METRICS") or None
        keep = check_int("keep", keep, 1)
        self.rank = _world_rank() if rank is None else int(rank)
        raw = None if path is None else str(path)
        self.path: Path | None = None
        if raw is not None and ("{rank}" in raw or self.rank == 0):
            self.path = Path(raw.replace("{rank}", str(self.rank)))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if fresh:
                self.path.write_text("")
            if from_env:
                _say_where_at_exit(self.path)
        self.keep = keep
        self.records: list[dict[str, Any]] = []
        self._pending: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._origin = clock.now()
        self._last_step_t = self._origin
        self._total_sent = 0
        self._seen: dict[int, dict[str, Any]] = {}
        self._predicted: dict[int, float | None] = {}

    def __repr__(self) -> str:
        return f"Metrics(path={self.path}, rank={self.rank}, records={len(self.records)})"

    @property
    def last(self) -> dict[str, Any] | None:
        """The most recent record (``None`` before the first)."""
        return self.records[-1] if self.records else None

    # ------------------------------------------------------------------ recording
    def note(self, **fields: Any) -> None:
        """Put ``fields`` into the current (next) record; later notes overwrite earlier."""
        self._pending.update(fields)

    def record(self, kind: str = "step", **fields: Any) -> dict[str, Any]:
        """Close the current record with ``fields`` (and the noted ones); return it."""
        now = clock.now()
        rec: dict[str, Any] = {"kind": kind, "step": self._counts.get(kind, 0),
                               "rank": self.rank, "time_s": now - self._origin}
        if kind == "step":
            rec["step_s"] = now - self._last_step_t
            self._last_step_t = now
        rec.update(self._pending)
        rec.update(fields)
        self._total_sent += int(rec.get("sent_bytes") or 0)
        rec.setdefault("total_sent_bytes", self._total_sent)
        rec = {k: _jsonable(v) for k, v in rec.items()}
        self._pending = {}
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self.records.append(rec)
        if len(self.records) > self.keep:
            del self.records[:len(self.records) - self.keep]
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def observe(self, source: Any, kind: str = "step", **fields: Any) -> dict[str, Any]:
        """Record one step of ``source`` (counters since its previous observation).

        ``source``: a :class:`~mpicomm.torch.GradientSync`, a
        :class:`~mpicomm.torch.LocalSGD`, a DDP :class:`~mpicomm.torch.MpicommHookState`,
        or a :class:`~mpicomm.strategies.Strategy`. ``fields`` are added (e.g. ``loss``).
        """
        now = _counters(source)
        before = self._seen.get(id(source), {})
        self._seen[id(source)] = now
        derived: dict[str, Any] = {}
        for key in ("sent_bytes", "recv_bytes", "dense_bytes", "comm_s", "wait_s"):
            if key in now:
                derived[key] = now[key] - before.get(key, 0)
        if derived.get("sent_bytes"):
            derived["compression"] = derived.get("dense_bytes", 0) / derived["sent_bytes"]
        for key in ("strategy", "collective", "tau", "rounds", "gain", "staleness"):
            if key in now:
                derived[key] = now[key]
        predicted = self._predicted.get(id(source), ...)
        if predicted is ...:
            predicted = self._predicted[id(source)] = predict_step_comm(source)
        if predicted is not None:
            derived["predicted_calibrated"] = cost_model_calibrated(source)
        if "rounds" in now:  # local SGD: communication only on averaging steps
            derived["averaged"] = now["rounds"] > before.get("rounds", 0)
            if predicted is not None:
                derived["predicted_comm_s"] = predicted if derived["averaged"] else 0.0
        elif predicted is not None:
            derived["predicted_comm_s"] = predicted
        derived.update(fields)
        return self.record(kind, **derived)


_announced: set[str] = set()


def _say_where_at_exit(path: Path) -> None:
    """At a normal exit, one line on stderr: where ``MPICOMM_METRICS`` records went."""
    if str(path) in _announced:
        return
    _announced.add(str(path))

    def say() -> None:
        if path.exists():
            print(f"mpicomm: metrics written to {path} (MPICOMM_METRICS)", file=sys.stderr,
                  flush=True)

    atexit.register(say)


def metrics_from(metrics: Metrics | str | os.PathLike | None) -> Metrics | None:
    """An integration's ``metrics=`` argument: a :class:`Metrics` as is, a path for a new
    one, or ``None``: a new one when ``MPICOMM_METRICS`` is set, else ``None``."""
    if metrics is None:
        return Metrics() if os.environ.get("MPICOMM_METRICS") else None
    if isinstance(metrics, Metrics):
        return metrics
    if isinstance(metrics, (str, os.PathLike)):
        return Metrics(metrics)
    raise TypeError(f"metrics must be a Metrics, a path or None, got {type(metrics).__name__}")


# ---------------------------------------------------------------------- sources
def _is_strategy(obj: Any) -> bool:
    """Whether ``obj`` looks like a :class:`~mpicomm.strategies.Strategy`: it aggregates,
    describes itself and keeps traffic stats (duck typing: this layer sits below the
    strategies and does not import them)."""
    return (callable(getattr(obj, "aggregate", None))
            and callable(getattr(obj, "describe", None))
            and hasattr(getattr(obj, "stats", None), "dense_bytes"))


def _strategy_of(source: Any) -> Any:
    if _is_strategy(source):
        return source
    strategy = getattr(source, "strategy", None)
    return strategy if _is_strategy(strategy) else None


def _counters(source: Any) -> dict[str, Any]:
    """Cumulative counters of a source, by standard field name."""
    out: dict[str, Any] = {}
    strategy = _strategy_of(source)
    if strategy is not None:
        s = strategy.stats
        out.update(sent_bytes=s.sent_bytes, recv_bytes=s.recv_bytes,
                   dense_bytes=s.dense_bytes, comm_s=s.seconds)
        desc = strategy.describe()
        out["strategy"] = desc.get("strategy", strategy.name)
        out["collective"] = desc.get("collective") or \
            f"allreduce({desc.get('algorithm', 'auto')})"
        gain = getattr(strategy, "last_gain", None)  # the selector's (strategy "auto")
        if gain is not None:
            out["gain"] = gain
    stats = getattr(source, "stats", None)
    if stats is not None and hasattr(stats, "wait_seconds"):  # GradientSync
        out["comm_s"] = stats.comm_seconds
        out["wait_s"] = stats.wait_seconds
    if hasattr(source, "rounds") and hasattr(source, "period"):  # LocalSGD
        out.update(sent_bytes=source.traffic.sent_bytes, recv_bytes=source.traffic.recv_bytes,
                   tau=source.period, rounds=source.rounds,
                   strategy="local-sgd" + (" adacomm" if source.adacomm else ""),
                   collective=f"allreduce({source.algorithm})")
    kv = getattr(source, "kv", source)  # a KVStore, or the PSOptimizer wrapping one
    if hasattr(kv, "is_worker") and hasattr(kv, "stats") and callable(kv.stats):
        if not kv.is_worker:
            raise TypeError("observe a KVStore on its workers (servers record no steps)")
        s = kv.stats()
        out.update(sent_bytes=s["bytes_pushed"], recv_bytes=s["bytes_pulled"],
                   wait_s=s["wait_s"], staleness=s["staleness"], strategy=f"ps-{kv.mode}",
                   collective=f"push/pull ({kv.servers} servers)")
    if strategy is None and "rounds" not in out and "staleness" not in out:
        raise TypeError(f"cannot observe a {type(source).__name__}: expected a GradientSync, "
                        "LocalSGD, MpicommHookState, KVStore (or PSOptimizer) or Strategy")
    return out


def cost_model_calibrated(source: Any) -> bool:
    """Whether ``source``'s communicator carries measured cost parameters
    (:func:`mpicomm.collectives.calibrate.measure`, or ``strategy="auto"``'s start-up
    calibration): without them a prediction uses the library defaults, which may be far
    from this machine, and the plot leaves it out."""
    comm = getattr(source, "comm", None)
    resources = getattr(comm, "resources", None) or {}
    return resources.get("cost_params") is not None


def predict_step_comm(source: Any) -> float | None:
    """The cost model's seconds for one step's (or round's) communication, or ``None``.

    GradientSync: the ``"comm"`` part of the strategy's
    :meth:`~mpicomm.strategies.Strategy.predict_parts` summed over the buckets (with the
    communicator's calibration); LocalSGD: its
    :meth:`~mpicomm.torch.LocalSGD.predict_round_s` (one allreduce of the averaged bytes
    with the algorithm the cost model picks). Other sources (a bare strategy, the DDP hook) do
    not know their buffers ahead of time: ``None``.
    """
    if hasattr(source, "rounds") and hasattr(source, "period"):  # LocalSGD
        predict = getattr(source, "predict_round_s", None)
        return predict() if callable(predict) else None
    comm = getattr(source, "comm", None)
    p = comm.size if comm is not None else 1
    strategy = _strategy_of(source)
    model = getattr(source, "model", None)
    if strategy is None or model is None or not hasattr(strategy, "predict_parts"):
        return None
    by_name = dict(model.named_parameters())
    total = 0.0
    for names in getattr(source, "buckets", []):
        ps = [by_name[n] for n in names]
        total += strategy.predict_parts([tuple(q.shape) for q in ps], ps[0].element_size(),
                                        p)["comm"]
    return total
