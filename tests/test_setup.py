"""The set-up the project documents is the set-up it has: Makefile knobs and targets,
declared dependency floors, and an architecture guide that names every part of the
package (docs/architecture.md) and a README that names every example."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess

import numpy as np
import pytest

from .launch import ROOT

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def make_dry_run(*args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed on this machine")
    proc = subprocess.run(["make", "-n", "-B", *args, "VENV=/nonexistent-venv"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def test_torch_index_knob_default_unchanged():
    plain = [line for line in make_dry_run("install").splitlines() if "torch==" in line]
    assert plain and all("--index-url" not in line for line in plain), plain
    cpu = "https://download.pytorch.org/whl/cpu"
    knob = [line for line in make_dry_run("install", f"TORCH_INDEX={cpu}").splitlines()
            if "torch==" in line]
    assert knob and all(f"--index-url {cpu}" in line for line in knob), knob
    assert "TORCH_INDEX=" in README


def test_make_bench_runs_every_benchmark():
    """Every suite of ``python -m mpicomm.bench`` and every benchmark script the benchmark
    guide lists (docs/benchmarks.md; ``examples/overlap_bench.py`` included)."""
    from mpicomm.bench.__main__ import SUITES

    recipe = make_dry_run("bench")
    # suites that need CUDA run in `make gpu-check` (examples/gpu_check.py), not here
    gpu_only = {"staging"}
    gpu_plan = (ROOT / "examples" / "gpu_check.py").read_text()
    assert "examples/gpu_check.py" in make_dry_run("gpu-check")
    for suite in SUITES:
        if suite in gpu_only:
            assert f'*bench, "{suite}"' in gpu_plan, suite
        else:
            assert f"-m mpicomm.bench {suite}" in recipe, suite
    guide = (DOCS / "benchmarks.md").read_text()
    for suite in SUITES:
        assert f"`{suite}`" in guide, suite
    scripts = set(re.findall(r"examples/\w+\.py", guide))
    assert "examples/overlap_bench.py" in scripts
    for script in scripts:
        assert script in recipe, script


def _floor(requirement: str, name: str) -> tuple[int, ...]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    for line in cfg["options"][requirement].split("\n"):
        match = re.fullmatch(rf"{name}>=([\d.]+)", line.strip())
        if match:
            return tuple(int(x) for x in match.group(1).split("."))
    raise AssertionError(f"no {name}>= floor in setup.cfg {requirement}")


def test_numpy_floor_covers_the_features_the_tests_use():
    """``np.testing.assert_array_equal(..., strict=True)`` (tests/test_collectives.py)
    appeared in numpy 1.24; setup.cfg allowed 1.22."""
    assert _floor("install_requires", "numpy") >= (1, 24)
    uses = (ROOT / "tests" / "test_collectives.py").read_text()
    assert "strict=True" in uses
    assert np.lib.NumpyVersion(np.__version__) >= "1.24.0"
    assert f"numpy>={'.'.join(map(str, _floor('install_requires', 'numpy')))}" in README


def test_architecture_names_every_part_of_the_package():
    """The layer table of docs/architecture.md names every subpackage and every public
    top-level module (as ``mpicomm.name`` or, after the first of a row, ``name``); the
    README names every example."""
    layers = (DOCS / "architecture.md").read_text().split("## The layers", 1)[1]
    layers = layers.split("\n## ", 1)[0]
    package = ROOT / "mpicomm"
    parts = [p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    parts += [p.stem for p in package.glob("*.py") if not p.name.startswith("_")]
    missing = [p for p in parts if f"`mpicomm.{p}`" not in layers and f"`{p}`" not in layers]
    assert not missing, f"docs/architecture.md's layers omit {missing}"
    examples = [f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")]
    assert not [e for e in examples if e not in README], examples


def test_collectives_guide_is_exact_about_auto():
    guide = (DOCS / "collectives.md").read_text()
    assert "`auto` (always `ring`)" in guide  # allgatherv has no cost model
    assert "calibration is not automatic" in guide
    assert "calibrate.measure(comm, store=True)" in guide
