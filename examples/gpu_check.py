"""Every check that needs a GPU machine, in one command (``make gpu-check``).

    python3 examples/gpu_check.py --out gpu-results [--wheels DIR] [--ranks 2,4]

Runs, each step logged to ``OUT/logs/<step>.txt`` and summarized in
``OUT/gpu_check.json`` (a suite result: ``python -m mpicomm.bench report`` renders it):

1. ``pytest -m "gpu and not mpi"`` (serial) and ``mpiexec -n N pytest --with-mpi -m "gpu
   and mpi"`` for every ``--ranks`` N: every CUDA case of the suite;
2. ``python -m mpicomm.bench selection --device cuda`` (top-k selection against
   ``torch.topk``), ``mpiexec -n 2 python -m mpicomm.bench fusion`` (the host data path),
   ``mpiexec -n 2 python -m mpicomm.bench staging`` (staged CUDA collectives against the
   host ones of the same bytes, per chunk size), ``mpiexec -n 2 python
   examples/overlap_bench.py``;
3. ``mpiexec -n N python examples/gpu_e2e.py`` for every N (GradientSync strategies
   against DDP over gloo, one GPU shared by the ranks);
4. ``python -m mpicomm.bench report --results OUT --out OUT/BENCHMARKS.md``.

A failing step is recorded and the next one runs; the exit status is 1 if any failed.
It needs nothing beyond the project's runtime (torch, mpi4py, numpy; cupy optional): no
network, no virtual environment. Where pytest is not installed, ``--wheels DIR`` takes a
folder of wheels (pytest, pluggy, iniconfig, packaging, pygments, pytest-mpi,
pytest-timeout, ...): they are unpacked (a wheel is a zip of importable files) into
``OUT/site`` and put on ``PYTHONPATH`` after the project root, for this script's children
and theirs (``tests/launch.py`` keeps an inherited ``PYTHONPATH``). The launcher is
``MPICOMM_MPIEXEC``, else the ``mpiexec`` beside the Python, else the one on ``PATH``;
Open MPI's run-as-root and oversubscription variables are set (MPICH ignores them).

``--device cpu --only e2e,report`` is the CPU smoke run the test suite does;
``--dry-run`` prints the commands without running them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("pytest", "selection", "fusion", "staging", "overlap", "e2e", "report")
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu-results", help="results folder")
    ap.add_argument("--wheels", default=None, help="folder of wheels to put on PYTHONPATH")
    ap.add_argument("--ranks", default="2,4", help="rank counts for the MPI steps")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--only", default=",".join(STEPS),
                    help=f"steps to run, comma-separated, of: {', '.join(STEPS)}")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per step")
    ap.add_argument("--e2e-args", default="",
                    help="extra arguments for examples/gpu_e2e.py (e.g. a small model)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    args.ranks = [int(n) for n in args.ranks.split(",") if n]
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(STEPS))
    if unknown or not args.only:
        ap.error(f"--only: unknown step(s) {', '.join(unknown)}; choose from "
                 f"{', '.join(STEPS)}")
    if not args.ranks or min(args.ranks) < 1:
        ap.error("--ranks: positive rank counts, comma-separated")
    return args


def find_mpiexec() -> str:
    given = os.environ.get("MPICOMM_MPIEXEC")
    if given:
        return given
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("no mpiexec: set MPICOMM_MPIEXEC or put one on PATH")
    return found


def unpack_wheels(wheels: Path, site: Path) -> list[str]:
    """Unpack every ``*.whl`` of ``wheels`` into ``site``; returns their names."""
    names = sorted(p.name for p in wheels.glob("*.whl"))
    if not names:
        raise SystemExit(f"--wheels {wheels}: no .whl files there")
    site.mkdir(parents=True, exist_ok=True)
    for name in names:
        with zipfile.ZipFile(wheels / name) as z:
            z.extractall(site)
    return names


def environment(site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(ROOT)] + ([str(site)] if site else [])
    parts += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in parts]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in OPEN_MPI_ENV.items():
        env.setdefault(k, v)
    return env


def has_module(name: str, env: dict[str, str]) -> bool:
    probe = [sys.executable, "-c", f"import importlib.util as u, sys; "
             f"sys.exit(u.find_spec({name!r}) is None)"]
    return subprocess.run(probe, env=env, cwd=ROOT).returncode == 0


def plan(args: argparse.Namespace, out: Path, env: dict[str, str]) -> list[tuple[str, list[str]]]:
    """``(step name, command)`` in order."""
    py, mpi = sys.executable, find_mpiexec()
    steps: list[tuple[str, list[str]]] = []
    if "pytest" in args.only:
        pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "tests"]
        if has_module("pytest_timeout", env):
            pytest += ["--timeout=600", "--timeout-method=thread"]
        steps.append(("pytest-serial", [*pytest, "-m", "gpu and not mpi"]))
        for n in args.ranks:
            steps.append((f"pytest-{n}ranks", [mpi, "-n", str(n), *pytest, "--with-mpi",
                                               "-m", "gpu and mpi"]))
    bench = [py, "-m", "mpicomm.bench"]
    if "selection" in args.only:
        steps.append(("selection", [*bench, "selection", "--device", args.device, "--json",
                                    str(out / f"selection-{args.device}.json")]))
    if "fusion" in args.only:
        steps.append(("fusion", [mpi, "-n", "2", *bench, "fusion", "--json",
                                 str(out / "fusion-2.json")]))
    if "staging" in args.only:
        steps.append(("staging", [mpi, "-n", "2", *bench, "staging", "--json",
                                  str(out / "staging-2.json")]))
    if "overlap" in args.only:
        steps.append(("overlap", [mpi, "-n", "2", py, "examples/overlap_bench.py", "--json",
                                  str(out / "overlap-2.json")]))
    if "e2e" in args.only:
        extra = args.e2e_args.split()
        for n in args.ranks:
            steps.append((f"e2e-{n}ranks", [mpi, "-n", str(n), py, "examples/gpu_e2e.py",
                                            "--device", args.device, *extra, "--json",
                                            str(out / f"gpu_e2e-{n}.json")]))
    if "report" in args.only:
        steps.append(("report", [*bench, "report", "--results", str(out), "--out",
                                 str(out / "BENCHMARKS.md"), "--plots", str(out)]))
    return steps


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def last_line(text: str) -> str:
    """The last non-blank line of a step's output, without terminal colour codes."""
    lines = [ln for ln in ANSI_ESCAPE.sub("", text).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    site = None
    if args.wheels and not args.dry_run:
        site = out / "site"
        print("unpacked:", ", ".join(unpack_wheels(Path(args.wheels), site)))
    env = environment(site)
    steps = plan(args, out, env)
    if args.dry_run:
        for name, cmd in steps:
            print(f"{name}: {' '.join(cmd)}")
        return 0
    (out / "logs").mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name, cmd in steps:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
            rc, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            rc = 124
            text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) \
                else (exc.stdout or "")
            text += f"\ntimed out after {args.timeout:g} s"
        (out / "logs" / f"{name}.txt").write_text(f"$ {' '.join(cmd)}\n{text}")
        row = {"step": name, "rc": rc, "seconds": round(time.monotonic() - start, 1),
               "last_line": last_line(text)}
        rows.append(row)
        print(f"   rc={rc} in {row['seconds']} s: {row['last_line']}", flush=True)
        failed = [r["step"] for r in rows if r["rc"] != 0]
        summary = {"suite": "gpu_check", "device": args.device, "ranks": max(args.ranks),
                   "machine": {"python": sys.version.split()[0],
                               "host": os.uname().nodename, "cpus": os.cpu_count()},
                   "rows": rows, "summary": {"failed": failed or "none"}}
        # rewritten after every step, so the report step renders the steps before it
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    failed = [r["step"] for r in rows if r["rc"] != 0]
    print("failed steps:", ", ".join(failed) if failed else "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
