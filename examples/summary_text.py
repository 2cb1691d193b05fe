"""The summary examples/train.py and examples/train_ps.py print at the end of a run:
byte counts, settings and AdaComm's periods written for a person."""

from __future__ import annotations

from typing import Any

__all__ = ["compare_bytes", "count", "format_taus", "megabytes", "plain", "print_summary"]


def megabytes(n: float) -> str:
    """``n`` bytes as ``"1.23 MB"``."""
    return f"{n / 1e6:.3g} MB"


def plain(value: Any) -> str:
    """``value`` for a person: floats to 3 significant digits, dicts as ``key=value``."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={plain(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(plain(v) for v in value) + "]"
    return str(value)


def count(n: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def compare_bytes(ours: float, dense: float) -> str:
    """``ours`` against ``dense``: "12.3x fewer bytes", "4.2% more bytes", ...: "fewer"
    only when fewer, 3 significant digits."""
    if not dense or not ours:
        return "n/a"
    if ours == dense:
        return "as many bytes"
    word, ratio = ("fewer", dense / ours) if ours < dense else ("more", ours / dense)
    if ratio >= 1.1:
        return f"{ratio:.3g}x {word} bytes"
    return f"{(ratio - 1) * 100:.3g}% {word} bytes"


def format_taus(taus: list[int], head: int = 12, tail: int = 4) -> str:
    """AdaComm's periods as ``32 -> 27 -> 3 (x4) -> ...``: repeats folded, middle elided."""
    runs: list[list[int]] = []
    for t in taus:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    parts = [f"{t} (x{n})" if n > 1 else str(t) for t, n in runs]
    if len(parts) > head + tail:
        parts = parts[:head] + [f"... {len(parts) - head - tail} more ..."] + parts[-tail:]
    return " -> ".join(parts) + f"   ({len(taus)} decisions)"


def print_summary(s: dict[str, Any]) -> None:
    """The run's summary: ``s["script"]`` (default examples/train.py) and
    ``s["roles"]`` name the run; ``s["traffic"]`` (optional) replaces the line of bytes
    sent per rank, e.g. a parameter server's pushed and pulled bytes."""
    roles = f" ({s['roles']})" if s.get("roles") else ""
    traffic = s.get("traffic") or [
        f"sent per rank     {megabytes(s['sent_bytes_per_rank'])} (max rank "
        f"{megabytes(s['sent_bytes_max_rank'])})",
        f"dense allreduce   {megabytes(s['dense_bytes_per_rank'])} per rank for the same steps "
        f"({megabytes(s['dense_bytes_per_step'])} per step): "
        f"{compare_bytes(s['sent_bytes_per_rank'], s['dense_bytes_per_rank'])}",
    ]
    lines = [
        f"== mpicomm {s.get('script', 'examples/train.py')}: {count(s['ranks'], 'rank')}"
        f"{roles}, {s['mode']}, {count(s['epochs'], 'epoch')}, {count(s['steps'], 'step')}",
        f"settings          {plain(s['describe'])}",
        f"test {s['metric']:<12} {s['test_metric']:.4f}   test loss {s['test_loss']:.4f}"
        if s["metric"] != "accuracy" else
        f"test accuracy     {s['test_accuracy']:.4f}   test loss {s['test_loss']:.4f}",
        f"train accuracy    {s['train_accuracy']:.4f}   train loss {s['train_loss']:.4f}",
        f"wall time         {s['wall_s']:.1f} s (training {s['train_s']:.1f} s; "
        "imports and set-up included)",
        *traffic,
    ]
    if s["tau_history"] is not None:
        lines.append(f"AdaComm tau       {format_taus(s['tau_history'])}")
    print("\n".join(lines), flush=True)
