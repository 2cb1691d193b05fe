"""README.md: the code blocks that claim to run do run, and its links resolve.

A fenced block preceded by ``<!-- readme-test: python -->`` is a complete script: it is
written to a file and run at 2 ranks. One preceded by ``<!-- readme-test: shell -->`` is
run line by line with bash from the repository root, as written (when this checkout
has no ``.venv``, its ``.venv/bin/`` commands are those of the running interpreter's
environment). Both are child MPI jobs started from this serial test.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .launch import ROOT, clean_env, mpiexec, run_job

README = ROOT / "README.md"
MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<kind>\w+)\s*-->\s*\n```(?P<lang>\w*)\n"
                    r"(?P<code>.*?)\n```", re.DOTALL)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def marked_blocks(kind: str) -> list[str]:
    return [m.group("code") for m in MARKER.finditer(README.read_text())
            if m.group("kind") == kind]


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"


def test_readme_marks_blocks_of_both_kinds() -> None:
    """The markers are what the tests below run: losing them would test nothing."""
    assert marked_blocks("python"), "no <!-- readme-test: python --> block in README.md"
    assert marked_blocks("shell"), "no <!-- readme-test: shell --> block in README.md"
    kinds = {m.group("kind") for m in MARKER.finditer(README.read_text())}
    assert kinds <= {"python", "shell"}, f"unknown readme-test kinds {kinds}"


def test_readme_first_screen_says_how_to_run_the_venv() -> None:
    """Within the first screen (40 lines): the venv's mpiexec and python, or activate."""
    first = "\n".join(README.read_text().splitlines()[:40])
    assert ".venv/bin/mpiexec" in first and ".venv/bin/python" in first
    assert "source .venv/bin/activate" in first
    assert "make demo" in first and "make test" in first


def test_readme_python_block_runs_at_two_ranks(tmp_path: Path) -> None:
    """Under ``MPICOMM_METRICS``, as the README suggests: the loop's every step is
    recorded with its loss (what the plot's loss panels need)."""
    for i, code in enumerate(marked_blocks("python")):
        script = tmp_path / f"readme_block_{i}.py"
        script.write_text(code + "\n")
        metrics = tmp_path / f"readme_block_{i}.jsonl"
        res = run_job(2, [sys.executable, str(script)], timeout=180,
                      MPICOMM_METRICS=str(metrics))
        assert res.returncode == 0, res.output
        if "training accuracy" in code:  # the training loop: it must learn
            found = re.search(r"training accuracy ([0-9.]+) on 2 ranks", res.output)
            assert found, res.output
            assert float(found.group(1)) > 0.9, res.output
            steps = [json.loads(line) for line in metrics.read_text().splitlines()]
            assert len(steps) == 5 * math.ceil(1797 // 2 / 32), len(steps)  # 5 epochs
            assert all(r["kind"] == "step" and r["loss"] > 0 for r in steps)
            assert f"metrics written to {metrics}" in res.output, res.output


def venv_command(line: str) -> str:
    """``line`` as written, or with ``.venv/bin/`` replaced where this checkout has no
    ``.venv`` (a GPU machine running the suite with its own Python)."""
    if (ROOT / ".venv" / "bin" / "python").exists():
        return line
    line = line.replace(".venv/bin/mpiexec", mpiexec())
    return line.replace(".venv/bin/python", sys.executable)


def test_readme_shell_block_runs() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    for block in marked_blocks("shell"):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if not command:
                continue
            proc = subprocess.run([bash, "-c", venv_command(command)], cwd=ROOT,
                                  env=clean_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=240)
            assert proc.returncode == 0, f"{command}\n{proc.stdout}"
            if "custom_loop.py" in command:
                assert "test accuracy" in proc.stdout, proc.stdout


def local_targets(path: Path) -> list[str]:
    """Relative link targets of a Markdown file (no URLs, no pure anchors)."""
    out = []
    for m in LINK.finditer(path.read_text()):
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target)
    return out


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    found = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            found.add(text.replace(" ", "-"))
    return found


def check_links(path: Path) -> list[str]:
    bad = []
    for target in local_targets(path):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve()
        if not resolved.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            bad.append(f"{path.name}: {target} (no such heading)")
    return bad


def test_readme_links_resolve() -> None:
    targets = local_targets(README)
    assert any(t.startswith("docs/") for t in targets)
    assert check_links(README) == []


def test_every_docs_link_resolves() -> None:
    bad = [b for page in sorted((ROOT / "docs").glob("*.md")) for b in check_links(page)]
    assert bad == []


def test_readme_links_every_topic_guide() -> None:
    """The feature table links a guide per topic, and every guide in docs/ is linked."""
    linked = {t.partition("#")[0] for t in local_targets(README) if t.startswith("docs/")}
    for topic in ("collectives", "compression", "selector", "local-sgd", "parameter-server",
                  "crossover", "emulated-cluster", "gpu", "observability", "testing",
                  "architecture"):
        assert f"docs/{topic}.md" in linked, topic
    guides = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert guides <= linked, sorted(guides - linked)
