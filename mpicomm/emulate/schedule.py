"""``--schedule FILE``: network conditions that change while the job runs.

One entry per line, ``#`` starts a comment::

    # when     rate     delay
    0s         25gbit   1ms
    20s        1gbit    32ms      # seconds since the command started ...
    step 300   25gbit   1ms       # ... or the training step the job reports

``when`` is seconds (``12``, ``12s``, ``500ms``) after the command started, or
``step N``/``step=N``: applied once the job has reported step ``N`` through
:func:`mpicomm.emulate.linkdelay.report_step` (``examples/train.py`` reports every step
on rank 0). ``rate`` is a ``tc`` rate (``100mbit``, ``1gbit``); ``delay`` a one-way
latency (``0``, ``250us``, ``1ms``, ``32ms``). The rate is applied to every link with
``tc qdisc change``; the delay is written to the file that the ranks' injected-latency
layer follows (:mod:`mpicomm.emulate.linkdelay`). The example above steps from 25 Gbit/s
and 1 ms to 1 Gbit/s and 32 ms and back.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .netns import parse_rate

__all__ = ["Entry", "parse_delay", "parse_schedule", "read_schedule", "Applier",
           "write_atomic"]

_DELAY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "": 1.0}


def parse_delay(text: str) -> float:
    """``"32ms"``, ``"250us"``, ``"0"``, ``"0.5s"`` -> seconds (``ValueError`` otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|)\s*", str(text))
    if not m:
        raise ValueError(f"bad delay {text!r}: give a number with s, ms or us (e.g. 1ms)")
    value = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
    if value > 10:
        raise ValueError(f"delay {text!r} exceeds 10 s")
    return value


@dataclass(frozen=True)
class Entry:
    """Conditions from ``at`` seconds (``kind="time"``) or step ``at`` (``kind="step"``)."""

    kind: str
    at: float
    rate_bits: float
    delay: float
    line: int


def parse_schedule(text: str, source: str = "schedule") -> list[Entry]:
    """Entries of a schedule file, time entries by time, step entries by step."""
    entries = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = line.replace("step=", "step ").split()
        where = f"{source}:{n}"
        try:
            if tokens[0] == "step":
                if len(tokens) != 4 or not tokens[1].isdigit():
                    raise ValueError("expected `step N RATE DELAY`")
                kind, at = "step", float(int(tokens[1]))
                rest = tokens[2:]
            else:
                if len(tokens) != 3:
                    raise ValueError("expected `TIME RATE DELAY` or `step N RATE DELAY`")
                kind, at = "time", _seconds(tokens[0])
                rest = tokens[1:]
            entries.append(Entry(kind, at, parse_rate(rest[0]), parse_delay(rest[1]), n))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} (line: {raw.strip()!r})") from None
    if not entries:
        raise ValueError(f"{source}: no entries")
    return sorted(entries, key=lambda e: (e.kind, e.at, e.line))


def _seconds(token: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(s|ms|us|)", token)
    if not m:
        raise ValueError(f"bad time {token!r}: seconds like 20, 20s or 500ms, or `step N`")
    return float(m.group(1)) * _DELAY_UNITS[m.group(2)]


def read_schedule(path: str) -> list[Entry]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read --schedule {path}: {exc.strerror}") from None
    return parse_schedule(text, path)


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` so that readers never see a half-written file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_step(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


class Applier(threading.Thread):
    """Applies the entries while the job runs: ``set_rate(bits)`` and the delay file.

    Time entries fire at ``start + at``; step entries once the step file (rewritten by
    :func:`mpicomm.emulate.linkdelay.report_step`) shows a step ``>= at``. Polls every
    20 ms.
    ``log`` receives one line per change. ``errors`` keeps a failure to apply (the run
    ends with it reported, never silently unshaped).

    Step entries follow the reported step: when it goes *back* below a fired step entry
    (a job that counts its steps again, such as ``python -m mpicomm.bench adaptive``
    training one method after another), those entries are re-armed and the conditions
    return to the last entry still in force (``initial`` = ``(rate_bits, delay)`` of the
    command line when none is; an unshaped start cannot be restored, the rate stays and
    the log says so), so every run over the same steps sees the same network. The
    thread then keeps polling while the schedule has step entries.
    """

    def __init__(self, entries: list[Entry], set_rate: Callable[[float], None],
                 delay_file: str, step_file: str, log: Callable[[str], None],
                 initial: tuple[float | None, float] | None = None):
        super().__init__(name="mpicomm-emulate-schedule", daemon=True)
        self.pending = list(entries)
        self.set_rate = set_rate
        self.delay_file = delay_file
        self.step_file = step_file
        self.log = log
        self.stop = threading.Event()
        self.start_time = time.monotonic()
        self.errors: list[str] = []
        self.applied: list[tuple[float, Entry]] = []
        self.initial = initial
        self._in_force: list[Entry] = []  # applied entries, oldest first
        self._last_step = -1
        self._has_steps = any(e.kind == "step" for e in entries)

    def due(self, now: float, step: int) -> list[Entry]:
        ready = [e for e in self.pending
                 if (e.kind == "time" and now - self.start_time >= e.at)
                 or (e.kind == "step" and step >= e.at)]
        self.pending = [e for e in self.pending if e not in ready]
        return ready

    def rewind(self, step: int) -> None:
        """The job reported ``step`` below fired step entries: re-arm them and return to
        the conditions in force before them."""
        back = [e for e in self._in_force if e.kind == "step" and e.at > step]
        if not back:
            return
        self._in_force = [e for e in self._in_force if e not in back]
        self.pending = sorted(self.pending + back, key=lambda e: (e.kind, e.at, e.line))
        if self._in_force:
            self.apply(self._in_force.pop())
            return
        rate, delay = self.initial if self.initial is not None else (None, 0.0)
        write_atomic(self.delay_file, repr(delay))
        if rate is not None:
            self.set_rate(rate)
        self.log(f"[{time.monotonic() - self.start_time:7.2f}s] schedule: step {step} "
                 "reported again, back to the initial conditions"
                 + ("" if rate is not None else " (delay only: the run started unshaped, "
                    "the rate stays)"))

    def apply(self, entry: Entry) -> None:
        # Delay first: whoever sees the new rate also sees the new delay.
        write_atomic(self.delay_file, repr(entry.delay))
        self.set_rate(entry.rate_bits)
        elapsed = time.monotonic() - self.start_time
        self.applied.append((elapsed, entry))
        self._in_force.append(entry)
        when = f"step {int(entry.at)}" if entry.kind == "step" else f"{entry.at:g}s"
        self.log(f"[{elapsed:7.2f}s] schedule ({when}): rate {entry.rate_bits / 1e6:g} Mbit/s,"
                 f" delay {entry.delay * 1e3:g} ms")

    def run(self) -> None:
        while (self.pending or self._has_steps) and not self.stop.is_set():
            try:
                step = read_step(self.step_file)
                if step < self._last_step:
                    self.rewind(step)
                self._last_step = step
                for entry in self.due(time.monotonic(), step):
                    self.apply(entry)
            except Exception as exc:  # reported by the launcher, which ends the run
                self.errors.append(f"schedule: {exc}")
                return
            self.stop.wait(0.02)
