"""PNG plots of a metrics file (``python -m mpicomm plot metrics.jsonl [-o out.png]``).

Six panels from the records of :class:`mpicomm.observe.metrics.Metrics`: loss and accuracy
against time, loss against cumulative bytes sent, the local-SGD period ``tau`` over
steps, the collective chosen at each step, bytes sent per step with the compression
ratio, and predicted against measured communication time (the prediction only where the
cost model was calibrated on this machine: records with ``predicted_calibrated`` false
are left out and the panel says "uncalibrated"). A panel without data says so; the
loss panels then say how to record the loss (:data:`LOSS_HINT`).
Needs matplotlib (``pip install "mpicomm[plot]"``); nothing else in mpicomm imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["load_records", "plot_metrics", "plot_trace", "span_depths", "png_path",
           "loss_note", "METRIC_KEYS", "LOSS_HINT"]

#: Keys that a record of :class:`mpicomm.observe.metrics.Metrics` carries (every record
#: has ``kind``, ``step``, ``rank`` and ``time_s``): a file whose records have none of
#: ``kind``/``step``/``time_s`` is not a metrics file.
METRIC_KEYS = ("kind", "step", "time_s")


def png_path(path: str | Path) -> Path:
    """The one naming rule of plots: the input's name with its last suffix replaced by
    ``.png`` (``run.jsonl`` -> ``run.png``, ``trace.json`` -> ``trace.png``)."""
    return Path(path).with_suffix(".png")


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines metrics file (``ValueError`` naming a bad line)."""
    records = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: a record must be a JSON object")
        records.append(rec)
    return records


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'mpicomm[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: Iterable[dict[str, Any]], x: str, y: str, kind: str | None = None
            ) -> tuple[list[Any], list[Any]]:
    xs, ys = [], []
    for r in records:
        if (kind is None or r.get("kind", "step") == kind) and r.get(x) is not None \
                and r.get(y) is not None:
            xs.append(r[x])
            ys.append(r[y])
    return xs, ys


def _empty(ax: Any, what: str, hint: str = "") -> None:
    ax.text(0.5, 0.5, f"no {what} in the records" + (f"\n{hint}" if hint else ""),
            ha="center", va="center", transform=ax.transAxes, color="gray",
            fontsize=8 if hint else None)


#: How a loop gets its loss into the records: what an empty loss panel says.
LOSS_HINT = ("record it: sync.step(opt, loss=loss), opt.step(loss=loss)\n"
             "(DistributedOptimizer), local.step(loss) (LocalSGD)\n"
             "or metrics.note(loss=...) before the step")

def loss_note(records: list[dict[str, Any]]) -> str | None:
    """One line saying how to get a loss curve when no step record has a ``loss``
    (``python -m mpicomm plot`` prints it), else ``None``."""
    if any(r.get("kind", "step") == "step" and r.get("loss") is not None for r in records):
        return None
    return "no step loss in the records (two panels without it); " + \
        " ".join(LOSS_HINT.split())


#: Records that carry an accuracy, by kind, and their label in the plot.
ACCURACY_KINDS = {"epoch": "training accuracy (epoch)", "eval": "held-out accuracy",
                  "step": "accuracy (step)"}


def _accuracy(ax: Any, records: list[dict[str, Any]], x: str, scale: float) -> bool:
    """Accuracy against ``x`` (divided by ``scale``) on a twin axis, a line per record
    kind (training accuracy per epoch and held-out accuracy are different numbers);
    whether there was any."""
    twin = None
    colors = iter(("tab:green", "tab:red", "tab:purple", "tab:brown"))
    for kind in sorted({r.get("kind", "step") for r in records if "accuracy" in r}):
        xs, acc = _series(records, x, "accuracy", kind)
        if not acc:
            continue
        twin = twin or ax.twinx()
        twin.plot([v / scale for v in xs], acc, "o-", ms=3, color=next(colors, None),
                  label=ACCURACY_KINDS.get(kind, f"accuracy ({kind})"))
    if twin is not None:
        twin.set_ylabel("accuracy")
        twin.legend(loc="lower right", fontsize=8)
    return twin is not None


def plot_metrics(records: list[dict[str, Any]] | str | Path, out: str | Path,
                 title: str | None = None) -> Path:
    """Draw the six panels of the module docstring into the PNG ``out``; return its path."""
    source = str(title) if title else "the records"
    if not isinstance(records, list):
        title = title or str(records)
        source = str(records)
        records = load_records(records)
    if not any(all(k in rec for k in METRIC_KEYS) for rec in records):
        raise ValueError(f"{source}: no metrics records (JSON objects with "
                         f"{', '.join(METRIC_KEYS)}, as mpicomm.observe.metrics writes)")
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (a_time, a_bytes, a_tau), (a_coll, a_sent, a_pred) = axes

    # loss / accuracy against time
    t, loss = _series(records, "time_s", "loss", "step")
    if loss:
        a_time.plot(t, loss, lw=0.8, label="step loss")
        a_time.legend(loc="upper left", fontsize=8)
    else:
        _empty(a_time, "step loss", LOSS_HINT)
    _accuracy(a_time, records, "time_s", 1.0)
    a_time.set(xlabel="time (s)", ylabel="loss", title="loss and accuracy over time")

    # loss / accuracy against bytes
    b, bl = _series(records, "total_sent_bytes", "loss", "step")
    if bl:
        a_bytes.plot([v / 1e6 for v in b], bl, lw=0.8)
    _accuracy(a_bytes, records, "total_sent_bytes", 1e6)
    if not bl:
        _empty(a_bytes, "step loss", LOSS_HINT)
    a_bytes.set(xlabel="MB sent by this rank (cumulative)", ylabel="loss",
                title="loss against bytes")

    # tau
    s, tau = _series(records, "step", "tau", "step")
    if tau:
        a_tau.step(s, tau, where="post")
    else:
        _empty(a_tau, "tau (local SGD)")
    a_tau.set(xlabel="step", ylabel="tau", title="local-SGD period")

    # collective chosen
    s, coll = _series(records, "step", "collective", "step")
    if coll:
        names = sorted(set(coll))
        a_coll.scatter(s, [names.index(c) for c in coll], s=6)
        a_coll.set_yticks(range(len(names)), names)
    else:
        _empty(a_coll, "collective")
    a_coll.set(xlabel="step", title="collective chosen")

    # bytes per step and compression
    s, sent = _series(records, "step", "sent_bytes", "step")
    if sent:
        a_sent.plot(s, [v / 1e3 for v in sent], lw=0.8, label="sent")
        s2, dense = _series(records, "step", "dense_bytes", "step")
        if dense:
            a_sent.plot(s2, [v / 1e3 for v in dense], lw=0.8, label="dense equivalent")
        a_sent.legend(loc="upper right")
        values = [v for v in sent + dense if v > 0]
        if values and max(values) > 10 * min(values):  # a log axis only for a wide range
            a_sent.set_yscale("symlog")
    else:
        _empty(a_sent, "bytes")
    a_sent.set(xlabel="step", ylabel="kB per step (this rank)", title="traffic")

    # predicted vs measured
    s, meas = _series(records, "step", "comm_s", "step")
    calibrated = [r for r in records if r.get("predicted_calibrated", True)]
    s2, pred = _series(calibrated, "step", "predicted_comm_s", "step")
    uncalibrated = any(r.get("predicted_calibrated") is False for r in records)
    if meas:
        a_pred.plot(s, [v * 1e3 for v in meas], lw=0.8, label="measured")
    if pred:
        a_pred.plot(s2, [v * 1e3 for v in pred], lw=0.8, label="predicted (cost model)")
    if uncalibrated and not pred:
        a_pred.text(0.5, 1.0, "no prediction: cost model uncalibrated "
                    "(mpicomm.collectives.calibrate.measure)", ha="center", va="bottom",
                    transform=a_pred.transAxes, fontsize=8, color="gray")
    if meas or pred:
        a_pred.legend(loc="upper right")
    else:
        _empty(a_pred, "communication times")
    a_pred.set(xlabel="step", ylabel="ms",
               title="communication time per step" + ("\n" if uncalibrated and not pred else ""))

    if title:
        fig.suptitle(title)
    return _save(plt, fig, out, 90)


def plot_trace(trace: str | Path | dict[str, Any], out: str | Path,
               max_rows: int = 40) -> Path:
    """Render a Chrome-trace JSON's spans as a Gantt chart: one row per (rank, thread),
    nested spans drawn thinner on top of their parents, coloured by category."""
    data = trace if isinstance(trace, dict) else json.loads(Path(trace).read_text())
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    if not events:
        raise ValueError("the trace has no spans")
    rows = sorted({(e["pid"], str(e["tid"])) for e in events})[:max_rows]
    row_of = {r: i for i, r in enumerate(rows)}
    cats = sorted({e.get("cat", "") for e in events})
    plt = _pyplot()
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * len(rows)))
    t0 = min(e["ts"] for e in events)
    depths = span_depths(events)
    for i in sorted(range(len(events)), key=lambda i: depths[i]):
        e = events[i]
        key = (e["pid"], str(e["tid"]))
        if key not in row_of:
            continue
        height = 0.8 * (0.7 ** min(depths[i], 4))
        ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3)],
                       (row_of[key] - height / 2, height),
                       facecolors=colors(cats.index(e.get("cat", "")) % 10),
                       edgecolor="black", linewidth=0.2)
    names = {(e["pid"], str(e["tid"])): e["args"]["name"] for e in data["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ax.set_yticks(range(len(rows)), [f"rank {p} / {names.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i % 10)) for i in range(len(cats))]
    ax.legend(handles, [c or "(none)" for c in cats], loc="upper right", fontsize=8,
              ncol=min(len(cats), 6))
    return _save(plt, fig, out, 100)


def _save(plt: Any, fig: Any, out: str | Path, dpi: int) -> Path:
    """Lay out ``fig``, write it to ``out`` (parents created), close it; return the path."""
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def span_depths(events: list[dict[str, Any]]) -> list[int]:
    """Nesting depth of every span (``ph: "X"``) within its rank and thread: 0 for a span
    no other encloses. ``ValueError`` when two spans of one thread overlap without one
    containing the other (a broken trace)."""
    depths = [0] * len(events)
    by_row: dict[tuple[Any, Any], list[int]] = {}
    for i, e in enumerate(events):
        by_row.setdefault((e["pid"], e["tid"]), []).append(i)
    for idx in by_row.values():
        idx.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        stack: list[float] = []  # end times of the open ancestors
        for i in idx:
            start, end = events[i]["ts"], events[i]["ts"] + events[i]["dur"]
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1] + 1e-3:  # 1 ns of rounding slack
                raise ValueError(f"span {events[i]['name']!r} at {start:.3f} us overlaps its "
                                 "enclosing span without nesting")
            depths[i] = len(stack)
            stack.append(end)
    return depths
