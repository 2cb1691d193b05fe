"""The one-command GPU check (examples/gpu_check.py) and the end-to-end comparison it
runs (examples/gpu_e2e.py), exercised on the CPU: a tiny model at 2 ranks, its JSON, the
report rendering it, and pytest & co. carried as wheels on PYTHONPATH."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from .launch import ROOT, clean_env, load_script
from .test_buffers import HAVE_CUDA, needs_cuda


def _gpu_check() -> ModuleType:
    return load_script("examples/gpu_check.py")


def test_wheels_are_unpacked_onto_the_childrens_path(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "probe_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("probe_pkg_i14/__init__.py", "VALUE = 14\n")
        z.writestr("probe_pkg-1.0.dist-info/METADATA", "Name: probe-pkg\nVersion: 1.0\n")
    site = tmp_path / "site"
    assert gpu_check.unpack_wheels(wheels, site) == ["probe_pkg-1.0-py3-none-any.whl"]
    env = gpu_check.environment(site)
    assert env["PYTHONPATH"].split(":")[:2] == [str(ROOT), str(site)]
    assert gpu_check.has_module("probe_pkg_i14", env)
    assert not gpu_check.has_module("probe_pkg_i14", gpu_check.environment(None))
    with pytest.raises(SystemExit, match="no .whl"):
        gpu_check.unpack_wheels(tmp_path / "site", tmp_path / "again")


def test_plan_covers_every_gpu_step() -> None:
    gpu_check = _gpu_check()
    args = gpu_check.parse_args(["--ranks", "2,4"])
    steps = dict(gpu_check.plan(args, Path("/out"), gpu_check.environment(None)))
    assert list(steps) == ["pytest-serial", "pytest-2ranks", "pytest-4ranks", "selection",
                           "fusion", "staging", "overlap", "e2e-2ranks", "e2e-4ranks",
                           "report"]
    assert steps["pytest-serial"][-2:] == ["-m", "gpu and not mpi"]
    assert steps["pytest-4ranks"][1:3] == ["-n", "4"] and "--with-mpi" in steps["pytest-4ranks"]
    assert steps["selection"][-4:-2] == ["--device", "cuda"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "pytest,nonsense"])


def test_summary_line_drops_terminal_colours() -> None:
    gpu_check = _gpu_check()
    coloured = "collected\n\x1b[32m\x1b[1m1480 passed\x1b[0m, \x1b[33m4 deselected\x1b[0m\n\n"
    assert gpu_check.last_line(coloured) == "1480 passed, 4 deselected"
    assert gpu_check.last_line("  \n") == ""


def test_cpu_smoke_run_writes_json_the_report_renders(tmp_path: Path) -> None:
    out = tmp_path / "results"
    small = ("--width 0.0625 --batch 4 --image 8 --steps 2 --warmup 1 "
             "--strategies dense,artopk")
    proc = subprocess.run(
        [sys.executable, "examples/gpu_check.py", "--device", "cpu", "--only", "e2e,report",
         "--ranks", "2", "--timeout", "150", "--e2e-args", small, "--out", str(out)],
        cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + "".join(
        p.read_text() for p in (out / "logs").glob("*.txt"))
    e2e = json.loads((out / "gpu_e2e-2.json").read_text())
    assert e2e["suite"] == "gpu_e2e" and e2e["ranks"] == 2
    methods = [r["method"] for r in e2e["rows"]]
    assert methods == ["compute only", "GradientSync dense", "GradientSync artopk",
                       "DDP over gloo"]
    assert all(r["step_ms"] > 0 for r in e2e["rows"])
    assert e2e["rows"][0]["x_compute"] == 1.0 and e2e["rows"][-1]["x_ddp"] == 1.0
    assert e2e["summary"]["best_compressed"] == "artopk"
    assert isinstance(e2e["summary"]["dense_at_most_0.8x_ddp"], bool)
    check = json.loads((out / "gpu_check.json").read_text())
    assert [(r["step"], r["rc"]) for r in check["rows"]] == [("e2e-2ranks", 0),
                                                              ("report", 0)]
    report = (out / "BENCHMARKS.md").read_text()
    assert "gpu_e2e" in report and "GradientSync artopk" in report and "gpu_check" in report


@pytest.mark.skipif(HAVE_CUDA, reason="checks the refusal without CUDA")
def test_staging_bench_refuses_without_cuda() -> None:
    import argparse

    from mpicomm.bench import staging

    parser = argparse.ArgumentParser()
    staging.add_arguments(parser)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        staging.run(parser.parse_args([]))
    with pytest.raises(ValueError, match="unknown"):
        staging.run(parser.parse_args(["--collectives", "alltoall"]))


@needs_cuda
def test_staging_bench_on_a_gpu(tmp_path: Path) -> None:
    from .launch import mpiexec

    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpicomm.bench", "staging",
           "--sizes", "1000,4097", "--chunks-mb", "0.001", "--repeats", "1", "--warmup",
           "0", "--json", str(tmp_path / "staging.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(MPICOMM_CUDA_AWARE="0"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout
    result = json.loads((tmp_path / "staging.json").read_text())
    methods = {r["method"] for r in result["rows"]}
    assert methods == {"host", "staged whole", "staged chunk 0.001 MB"}
    assert {r["collective"] for r in result["rows"]} == {"allreduce", "allgather",
                                                         "broadcast"}
