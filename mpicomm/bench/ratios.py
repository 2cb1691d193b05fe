"""Compression ratios at no loss of accuracy: compressing strategies against dense.

Trains a workload (:mod:`mpicomm.workloads`) with every ``--strategy`` label
(:mod:`mpicomm.bench.recipes`; the bare names ``topk``, ``gtopk``, ``artopk`` are the
strategies' defaults at ``--density``, ``powersgd:rank=2`` or ``qsgd:bits=4`` set one
option) for every seed, through the time-to-accuracy harness, with a
:class:`~mpicomm.bench.probe.CompressionProbe` on every run (per-layer density of the
synchronized update, residual norm over time)::

    mpiexec -n 8 python -m mpicomm.bench ratios --workload mnist1d-cnn --seeds 3 \
        --strategy dense --strategy topk --strategy gtopk --strategy artopk \
        --density 0.001 --eval-every 156 --json benchmarks/results/ratios/mnist1d-cnn-8-d0.001.json

Every run record holds the bytes of the whole run summed over the ranks
(``sent_bytes_total``: every byte each rank sent through the strategy's collectives,
warm-up, indices and values included). Then, without MPI::

    python -m mpicomm.bench ratios --collect benchmarks/results/ratios \
        --rows benchmarks/results/compression-ratios.json

compares every run with the dense run of the same workload, rank count and seed, and
writes one row per run with exactly the keys of :data:`ROW_KEYS`:

* ``metric_gap``: accuracy in percentage points (``100·(acc - acc_dense)``), or
  perplexity in percent of dense's (``100·(ppl_dense - ppl) / ppl_dense``); negative =
  worse than dense;
* ``bytes_vs_dense``: dense's total bytes over this run's (``None`` when this run sent
  nothing: one rank);
* ``density``: the sparsifiers' final density, ``None`` for the other strategies.

:data:`TARGETS` are the bounds the defaults are held to (medians over seeds);
``python -m mpicomm.bench report`` renders the files with their plots
(:mod:`mpicomm.bench.report_ratios`).
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from ._util import UsageError, machine, print_table, write_json
from .probe import CompressionProbe
from .recipes import BASES, label_density, label_strategy, named_options
from .train import add_arguments as add_train_arguments
from .train import methods, parse_options

#: The keys of one row of the collected results, exactly.
ROW_KEYS = ("workload", "strategy", "density", "ranks", "seed", "metric_gap",
            "bytes_vs_dense")
#: Largest loss against dense (median over seeds): points of accuracy, % of perplexity.
GAP_BOUND = {"accuracy": 0.5, "perplexity": 2.0}
#: Fewest times fewer bytes than dense (median over seeds) by final density.
BYTES_TARGET = {0.001: 50.0, 0.01: 20.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)
    parser.add_argument("--probe-every", type=int, default=25,
                        help="steps per probe window (per-layer density, residual norm)")
    parser.add_argument("--collect", action="append", default=[], metavar="DIR",
                        help="no training: read the ratios results under DIR (repeatable) "
                             "and write one row per run to --rows")
    parser.add_argument("--rows", default=None, metavar="PATH",
                        help="with --collect: the rows file to write")


def run(args: argparse.Namespace) -> int:
    if args.collect:
        if not args.rows:
            raise UsageError("--collect needs --rows PATH")
        runs = load_runs(args.collect)
        write_rows(args.rows, collect(runs))
        print_table(medians(collect(runs, steps=True)),
                    ["workload", "ranks", "strategy", "density", "steps", "seeds",
                     "metric_gap", "worst_gap", "bytes_vs_dense", "met"])
        return 0
    return train_all(args)


def train_all(args: argparse.Namespace) -> int:
    from .. import workloads
    from ..comm import init
    from .harness import Spec, default_threads, train

    if args.seeds < 1 or args.eval_every < 0 or args.seed_offset < 0 or \
            args.probe_every < 1:
        raise UsageError("--seeds and --probe-every must be >= 1, --seed-offset and "
                         "--eval-every >= 0")
    if args.local_sgd:
        raise UsageError("ratios compares gradient strategies: no --local-sgd")
    options = parse_options(args.option)
    comm = init()
    torch.set_num_threads(args.threads or default_threads(comm))
    try:
        info = workloads.get(args.workload, rank=comm.rank, size=comm.size, seed=0,
                             batch=args.batch, **options).info
        methods(args, info)  # a bad label fails here, on every rank
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    records = []
    for seed in range(args.seed_offset, args.seed_offset + args.seeds):
        for method in methods(args, info):
            spec = Spec(workload=args.workload, seed=seed, batch=args.batch, options=options,
                        epochs=args.epochs, max_steps=args.steps, eval_every=args.eval_every,
                        lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                        clip_norm=args.clip_norm, lr_decay_epoch=args.lr_decay,
                        label=method.label)
            probe = CompressionProbe(comm, args.probe_every)
            r = train(spec, method, comm, on_step=probe.on_step)
            rec = r.record()
            rec["step_s"] = []  # wall times of a shared machine: not results
            rec["density"] = label_density(method.label, args.density)
            rec["probe"] = probe.as_dict()
            records.append(rec)
            if comm.rank == 0:
                print(f"# {r.label} seed {seed}: {r.steps} steps, {r.metric} "
                      f"{r.final_metric():.5g}, {r.sent_bytes_total / 1e6:.1f} MB sent",
                      flush=True)
                # after every run: a long job cut short keeps what it finished
                write_json(args.json, {"suite": "ratios", "machine": machine(),
                                       "ranks": comm.size, "workload": info.as_dict(),
                                       "args": vars(args), "training_runs": records})
    comm.barrier()
    return 0


# ---------------------------------------------------------------------- collecting
def load_runs(folders: Sequence[str]) -> list[dict[str, Any]]:
    """Every run record of the ``ratios`` results under ``folders``
    (:func:`runs_by_file`)."""
    files = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
            with open(path) as f:
                data = json.load(f)
            if isinstance(data, dict) and data.get("suite") == "ratios":
                files.append(data)
    return runs_by_file(files)


def runs_by_file(files: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run records of ``ratios`` results ``files``, each (a copy) with two keys by
    which :func:`collect` chooses a run's dense run: ``source``, the index of its file
    (the same job, so the same machine), and ``platform``, what the file's machine
    record says of the arithmetic (:func:`platform`)."""
    return [{**run, "source": index, "platform": platform(data.get("machine") or {})}
            for index, data in enumerate(files) for run in data.get("training_runs", [])]


def platform(machine: dict[str, Any]) -> tuple[Any, ...]:
    """The parts of a machine record that decide a run's floating-point results: the CPU
    model and torch's version and CPU kernels (``None`` where a record lacks them)."""
    torch_info = machine.get("torch") or {}
    return machine.get("cpu"), torch_info.get("version"), torch_info.get("cpu_capability")


def metric_gap(run: dict[str, Any], dense: dict[str, Any]) -> float:
    """Points of accuracy, or percent of dense's perplexity; negative = worse."""
    value, ref = run["curve"][-1][run["metric"]], dense["curve"][-1][dense["metric"]]
    if run["metric"] == "perplexity":
        return 100.0 * (ref - value) / ref
    if run["direction"] == "max":
        return 100.0 * (value - ref)
    return 100.0 * (ref - value)


def _recipe(describe: dict[str, Any], momentum: float) -> dict[str, Any]:
    """A strategy's ``describe()`` with the optimizer's momentum in place of
    ``momentum_correction="optimizer"`` (what the strategy records once it has taken the
    momentum over; nothing when the optimizer has none)."""
    out = dict(describe)
    if out.get("momentum_correction") == "optimizer":
        if momentum > 0:
            out["momentum_correction"] = momentum
        else:
            out.pop("momentum_correction")
            out.pop("momentum_masking", None)
    return out


#: Recipe entries a run records only when its strategy took the optimizer's momentum
#: over (:func:`_recipe`): their absence is a fact about the run, not an older record.
_MOMENTUM_KEYS = ("momentum_correction", "momentum_masking")


def _option_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of ``cls``'s constructor."""
    return {name: p.default for name, p in inspect.signature(cls).parameters.items()
            if p.default is not inspect.Parameter.empty}


def stale_default(run: dict[str, Any], density: float | None = None
                  ) -> dict[str, tuple[Any, Any]]:
    """For a run labelled by a sparsifier's name alone (``gtopk``) or with options on its
    default (``gtopk:flush_every=100``): every entry of the recipe in which what the run
    recorded (``extra.describe``, taken at its end) differs from what the label builds
    now, as ``{entry: (ran, now)}``. Empty when they agree, for other labels and for runs
    that recorded no recipe. A non-empty answer means the defaults changed after the run:
    its label no longer says what it ran. An option the record lacks was added after the
    run: it counts as the class's own default for it, the behaviour from before it
    existed. ``density``: the run's density where its record holds none (a file-wide
    setting)."""
    label = run["label"]
    named = named_options(label)
    if label not in BASES and (named is None or named[0] not in BASES):
        return {}
    ran = (run.get("extra") or {}).get("describe")
    if not ran:
        return {}
    momentum = float((run.get("config") or {}).get("momentum") or 0.0)
    density = run.get("density") or density or 0.01
    strategy = label_strategy(label, density=density).strategy
    now = strategy.describe()
    added = {k: v for k, v in _option_defaults(type(strategy)).items()
             if k in now and k not in ran and k not in _MOMENTUM_KEYS}
    ran, now = _recipe({**added, **ran}, momentum), _recipe(now, momentum)
    return {k: (ran.get(k), now.get(k)) for k in sorted(set(ran) | set(now))
            if ran.get(k) != now.get(k)}


def check_labels(runs: Sequence[dict[str, Any]], density: float | None = None,
                 where: str = "") -> None:
    """:class:`UsageError` naming every run of ``runs`` whose label no longer builds what
    it ran (:func:`stale_default`; ``density`` for runs that record none, ``where`` names
    their file)."""
    stale = [(r, diff) for r in runs if (diff := stale_default(r, density))]
    if stale:
        lines = [f"  {r['label']} ({r.get('workload')}, {r.get('ranks')} ranks, density "
                 f"{r.get('density') or density}, seed {r.get('seed')}, {r.get('steps')} "
                 "steps): "
                 + ", ".join(f"{k} ran {x!r}, now {y!r}" for k, (x, y) in diff.items())
                 for r, diff in stale]
        raise UsageError(f"{where + ': ' if where else ''}runs labelled by a default that "
                         "has changed since they ran; relabel them with the recipe they "
                         "ran:\n" + "\n".join(lines))


def collect(runs: Sequence[dict[str, Any]], *, steps: bool = False
            ) -> list[dict[str, Any]]:
    """One row (:data:`ROW_KEYS`) per non-dense run that has a dense run of the same
    workload, rank count, seed and number of steps: the one of its own file (the
    ``source`` key of :func:`runs_by_file`) if there is one, else the last one read of
    the same ``platform``, else the last one read. A run cut short is never compared
    with a full-length dense run, and a run is compared with a dense run of another job
    only when its own job ran none: the same code can end a language-model run a point
    of perplexity apart on machines whose arithmetic differs. ``steps=True`` adds the
    run's step count to each row (a ``steps`` key, which the rows file does not hold), so
    that :func:`medians` keeps short and full-length runs of one label apart.
    :class:`UsageError` naming every run whose label no longer builds what it ran
    (:func:`check_labels`): such a run is never counted as today's default; relabel it
    with the recipe it ran."""
    check_labels(runs)
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["workload"], r["ranks"], r["seed"], r["steps"]

    def choices(r: dict[str, Any]) -> tuple[tuple[Any, ...], ...]:
        return (("file", r.get("source"), *key(r)), ("platform", r.get("platform"), *key(r)),
                key(r))

    dense = {choice: r for r in runs if r["label"] == "dense" for choice in choices(r)}
    rows = []
    for r in runs:
        ref = next((dense[c] for c in choices(r) if c in dense), None)
        if r["label"] == "dense" or ref is None:
            continue
        rows.append({"workload": r["workload"], "strategy": r["label"],
                     "density": r.get("density"), "ranks": r["ranks"], "seed": r["seed"],
                     "metric_gap": round(metric_gap(r, ref), 4),
                     "bytes_vs_dense": round(ref["sent_bytes_total"]
                                             / r["sent_bytes_total"], 3)
                     if r["sent_bytes_total"] else None,
                     **({"steps": r["steps"]} if steps else {})})
    rows.sort(key=lambda row: (row["workload"], row["ranks"], row["strategy"],
                               row["density"] or 0.0, row["seed"]))
    return rows


def is_rows(data: Any) -> bool:
    """``data`` is a rows file's content: a non-empty list of dicts with :data:`ROW_KEYS`."""
    return isinstance(data, list) and bool(data) and all(
        isinstance(row, dict) and tuple(row) == ROW_KEYS for row in data)


def write_rows(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """The rows file: a JSON list of rows with exactly :data:`ROW_KEYS`."""
    for row in rows:
        assert tuple(row) == ROW_KEYS, row
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(list(rows), f, indent=1)
        f.write("\n")


def medians(rows: Sequence[dict[str, Any]], metrics: dict[str, str] | None = None
            ) -> list[dict[str, Any]]:
    """Per (workload, ranks, strategy, density, and the step count where the rows hold
    one): the seeds, the median gap and bytes ratio, the worst seed's gap, and whether
    :data:`GAP_BOUND` and :data:`BYTES_TARGET` hold for the medians (``metrics``:
    workload -> its metric, default by name)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["workload"], row["ranks"], row["strategy"], row["density"],
               row.get("steps"))
        groups.setdefault(key, []).append(row)
    out = []
    for (workload, ranks, strategy, density, steps), mine in groups.items():
        metric = (metrics or {}).get(workload) or (
            "perplexity" if "lm" in workload else "accuracy")
        gap = statistics.median(r["metric_gap"] for r in mine)
        ratios = [r["bytes_vs_dense"] for r in mine if r["bytes_vs_dense"] is not None]
        ratio = statistics.median(ratios) if ratios else math.nan
        target = BYTES_TARGET.get(density) if density is not None else None
        met = gap >= -GAP_BOUND[metric] and (target is None or ratio >= target)
        out.append({"workload": workload, "ranks": ranks, "strategy": strategy,
                    "density": density, "seeds": len(mine), "metric_gap": gap,
                    "worst_gap": min(r["metric_gap"] for r in mine),
                    "bytes_vs_dense": ratio, "bytes_target": target,
                    "met": "yes" if met else "no",
                    **({"steps": steps} if steps is not None else {})})
    return out
