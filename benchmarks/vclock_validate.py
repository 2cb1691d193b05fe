"""Validate the virtual clock: closed forms at P = 2..16, and load independence.

``python benchmarks/vclock_validate.py [--ranks 2-16] [--out benchmarks/results]``

1. The cost table is measured once (8 ranks taking turns): ``vclock-costs.json``.
2. For every P: ``mpiexec -n P python -m mpicomm.bench vclock --nets NETS --sizes SIZES
   --costs vclock-costs.json`` (``vclock-P.json``): ping-pong, ring and
   recursive-doubling allreduce, ring allgather and gTop-k against their closed forms.
3. Load: the 8-rank run again with two CPU hogs (``while True: pass``) beside it
   (``vclock-8-hogs.json``): its virtual times against the quiet run's; and the cost
   table measured again under the same hogs (``vclock-costs-hogs.json``) against the
   quiet one.
4. ``vclock-validation.json``: per P and case the worst deviation from the closed form,
   the largest relative difference of the loaded run's times, and per table entry the
   loaded / quiet ratio of ``per_unit``, ``per_call`` and the cost at the kernel's larger
   calibration size. ``--load-only`` redoes step 1 and 3 only.

Virtual times do not depend on the machine's load, so this may run on a busy machine;
the load averages are recorded. Run it under ``nice -n 10`` on a shared machine (the
hogs inherit the niceness).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOG = "while True: pass"


def _mpiexec() -> str:
    sys.path.insert(0, str(ROOT))
    from mpicomm.cli import find_mpiexec

    return find_mpiexec()


def _run(ranks: int, args: list[str], timeout: float) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("MPICOMM_CLOCK", None)
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpicomm.bench", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=timeout)


def _ranks(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def _worst(results: list[dict]) -> dict:
    """Per case, the deviation of the network-only virtual time from the closed form."""
    out: dict[str, dict] = {}
    for r in results:
        if not r.get("model_s"):
            continue
        dev = r["virtual_s"] / r["model_s"] - 1
        cur = out.setdefault(r["case"], {"max_dev": 0.0, "min_ratio": 9.0, "max_ratio": 0.0})
        cur["max_dev"] = max(cur["max_dev"], abs(dev))
        cur["min_ratio"] = min(cur["min_ratio"], 1 + dev)
        cur["max_ratio"] = max(cur["max_ratio"], 1 + dev)
    return out


def _relative(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / abs(x) for x, y in zip(a, b) if x), default=0.0)


def _table_ratios(quiet: dict, loaded: dict) -> dict[str, dict[str, float | None]]:
    """Per entry, loaded / quiet: ``per_unit``, ``per_call`` and the cost charged at the
    kernel's larger calibration size (what a large operation is charged)."""
    sys.path.insert(0, str(ROOT))
    from mpicomm import compress, costtable, sparse  # noqa: F401  (register the kernels)

    sizes = {op: k.sizes[1] for op, k in costtable.kernels().items()}
    out: dict[str, dict[str, float | None]] = {}
    for op, q in sorted(quiet.items()):
        h = loaded[op]
        n = sizes.get(op, 1)
        at_q, at_h = q["per_call"] + q["per_unit"] * n, h["per_call"] + h["per_unit"] * n
        out[op] = {"per_unit": h["per_unit"] / q["per_unit"] if q["per_unit"] else None,
                   "per_call": h["per_call"] / q["per_call"] if q["per_call"] else None,
                   "size": n, "at_size": at_h / at_q if at_q else None}
    return out


def _table_options(args: argparse.Namespace) -> list[str]:
    """The ``bench costs`` options of every table this script measures."""
    return ([*(["--turns", args.turns] if args.turns else []),
             *(["--repeats", str(args.repeats)] if args.repeats else [])])


def _table_pairs(args: argparse.Namespace, out: Path) -> list[dict]:
    """``--table-pairs`` (quiet, hogs) cost tables measured back to back, each pair's
    per-entry ratios: the hogs' effect with the shared machine's load about the same."""
    options = _table_options(args)
    pairs = []
    for i in range(args.table_pairs):
        paths = [out / f"vclock-costs-pair{i}-{kind}.json" for kind in ("quiet", "hogs")]
        pair: dict = {"loadavg": [os.getloadavg()]}
        _run(args.load_ranks, ["costs", *options, "--json", str(paths[0])], args.timeout)
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
        try:
            time.sleep(2)
            pair["loadavg"].append(os.getloadavg())
            _run(args.load_ranks, ["costs", *options, "--json", str(paths[1])], args.timeout)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        pair["loadavg"].append(os.getloadavg())
        a, b = (json.loads(p.read_text())["ops"] for p in paths)
        pair["ratios"] = _table_ratios(a, b)
        pair["max_dev_at_size"] = max(abs(r["at_size"] - 1) for r in pair["ratios"].values()
                                      if r["at_size"] is not None)
        pairs.append(pair)
    return pairs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2-16", help="rank counts, e.g. 2-16 or 8")
    ap.add_argument("--nets", default="1gbit:100us,10gbit:50us,100mbit:1ms")
    ap.add_argument("--sizes", default="1e4,1e6")
    ap.add_argument("--load-ranks", type=int, default=8)
    ap.add_argument("--load-only", action="store_true",
                    help="only step 3 (the closed-form files of step 2 are read as they are)")
    ap.add_argument("--table-pairs", type=int, default=0,
                    help="then N more (quiet, hogs) table pairs back to back: the hogs' "
                         "effect apart from the shared machine's drifting load")
    ap.add_argument("--turns", default=None, help="ranks that measure each table")
    ap.add_argument("--repeats", type=int, default=None,
                    help="samples per kernel, size and turn of each table (default: the "
                         "suite's)")
    ap.add_argument("--pairs-only", action="store_true",
                    help="only the --table-pairs, added to the existing summary")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.load_ranks not in _ranks(args.ranks):
        ap.error(f"--ranks must include --load-ranks {args.load_ranks}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.pairs_only:
        summary = json.loads((out / "vclock-validation.json").read_text())
        summary["load"]["table_pairs"] = _table_pairs(args, out)
        (out / "vclock-validation.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary["load"]["table_pairs"], indent=2))
        return 0
    costs = out / "vclock-costs.json"
    loads = {"start": os.getloadavg()}
    _run(args.load_ranks, ["costs", *_table_options(args), "--json", str(costs)],
         args.timeout)
    loads["quiet_costs"] = os.getloadavg()
    common = ["vclock", "--nets", args.nets, "--sizes", args.sizes, "--costs", str(costs)]
    summary: dict = {"nets": args.nets, "sizes": args.sizes, "per_ranks": {}}
    for p in _ranks(args.ranks):
        path = out / f"vclock-{p}.json"
        if not args.load_only:
            _run(p, [*common, "--json", str(path)], args.timeout)
        summary["per_ranks"][p] = _worst(json.loads(path.read_text())["results"])
    loads["before_hogs"] = os.getloadavg()
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    try:
        time.sleep(5)                     # let the load average see them
        loads["with_hogs"] = os.getloadavg()
        loaded = out / f"vclock-{args.load_ranks}-hogs.json"
        _run(args.load_ranks, [*common, "--json", str(loaded)], args.timeout)
        loaded_costs = out / "vclock-costs-hogs.json"
        _run(args.load_ranks, ["costs", *_table_options(args), "--json", str(loaded_costs)],
             args.timeout)
        loads["hogs_costs"] = os.getloadavg()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    quiet = json.loads((out / f"vclock-{args.load_ranks}.json").read_text())
    hot = json.loads(loaded.read_text())
    q_ops = json.loads(costs.read_text())["ops"]
    h_ops = json.loads(loaded_costs.read_text())["ops"]
    ratios = _table_ratios(q_ops, h_ops)
    summary["load"] = {
        "ranks": args.load_ranks, "hogs": 2, "nice": os.nice(0), "loadavg": loads,
        "max_rel_diff_virtual_times": _relative(quiet["signature"], hot["signature"]),
        "cost_table_rel_diff": {op: (h_ops[op]["per_unit"] - e["per_unit"]) / e["per_unit"]
                                for op, e in q_ops.items() if e["per_unit"] > 0},
        "cost_table_ratios": ratios,
        "cost_table_max_dev_at_size": max(abs(r["at_size"] - 1) for r in ratios.values()
                                          if r["at_size"] is not None),
    }
    pairs = _table_pairs(args, out)
    if pairs:
        summary["load"]["table_pairs"] = pairs
    (out / "vclock-validation.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
