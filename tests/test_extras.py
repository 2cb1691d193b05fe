"""Each extra of setup.cfg installs what its code imports, and nothing it does not.

The third-party imports of the benchmark suites, the workloads, the examples and the plot
code are read from their source (``import``/``from`` statements, and the module names
given to ``require(...)`` / ``importlib.import_module(...)``) and compared with the
extras that promise to run them. An import inside ``try: ... except ImportError`` is
optional (the code runs without it) and needs no extra. Packages that only some runs
need (progress bars, data sets, plots) must not be imported at module level: a run that
does not use them must not need them.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .launch import ROOT

CFG = configparser.ConfigParser()
CFG.read(ROOT / "setup.cfg")


def requirements(text: str) -> set[str]:
    names = set()
    for line in text.strip().splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)", line)
        if match:
            names.add(match.group(1).lower().replace("_", "-"))
    return names


BASE = requirements(CFG["options"]["install_requires"])
EXTRAS = {name: requirements(value) for name, value in CFG["options.extras_require"].items()}

# what an extra promises to run: the files whose imports it must cover
SCOPES = {
    "bench": ["mpicomm/bench", "mpicomm/workloads", "mpicomm/observe/plot.py"],
    "workloads": ["mpicomm/workloads"],
    "examples": ["examples", "mpicomm/workloads", "mpicomm/bench/harness.py",
                 "mpicomm/bench/sync.py", "mpicomm/bench/train.py"],
    "plot": ["mpicomm/observe/plot.py"],
}
# the examples' sibling modules
LOCAL = {"mpicomm", "train", "summary_text", "recipe_options", "tests"}
DYNAMIC = ("require", "import_module")


def sources(scope: list[str]) -> Iterator[Path]:
    for entry in scope:
        path = ROOT / entry
        yield from (sorted(path.rglob("*.py")) if path.is_dir() else [path])


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a ``try`` whose handlers catch ImportError (or a subclass of it)."""
    child, node = node, parents.get(node)
    while node is not None:
        if isinstance(node, ast.Try) and child in node.body:
            for handler in node.handlers:
                names = ast.unparse(handler.type) if handler.type is not None else ""
                if "ImportError" in names or "ModuleNotFoundError" in names:
                    return True
        child, node = node, parents.get(node)
    return False


def imports(path: Path) -> Iterator[tuple[str, bool, bool, int]]:
    """``(top-level module, at module level, optional, line)`` for each import."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in DYNAMIC):
            names = [node.args[0].value]
        for name in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in LOCAL or top == "__future__":
                continue
            module_level = all(not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))
                               for p in _ancestors(node, parents))
            yield top, module_level and not isinstance(node, ast.Call), \
                _guarded(node, parents), node.lineno


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> Iterator[ast.AST]:
    while node in parents:
        node = parents[node]
        yield node


DISTRIBUTIONS = importlib.metadata.packages_distributions()


def distribution(module: str) -> str:
    found = DISTRIBUTIONS.get(module)
    assert found, f"module {module!r} comes from no installed distribution"
    return found[0].lower().replace("_", "-")


@pytest.mark.parametrize("extra", sorted(SCOPES))
def test_extra_covers_its_imports_and_no_more(extra):
    needed: dict[str, str] = {}
    for path in sources(SCOPES[extra]):
        for module, _, optional, line in imports(path):
            if not optional:
                needed.setdefault(distribution(module), f"{path.relative_to(ROOT)}:{line}")
    missing = {d: where for d, where in needed.items() if d not in EXTRAS[extra] | BASE}
    assert not missing, f"[{extra}] does not install what this code imports: {missing}"
    unused = EXTRAS[extra] - set(needed)
    assert not unused, f"[{extra}] installs what none of {SCOPES[extra]} imports: {unused}"


def test_optional_packages_are_imported_where_used():
    """Nothing beyond install_requires at module level: e.g. ``train.py --no-progress``
    must run without tqdm, ``bench sparse`` without scikit-learn."""
    scanned = {p for scope in SCOPES.values() for p in sources(scope)}
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {m}"
                 for p in sorted(scanned) for m, module_level, optional, line in imports(p)
                 if module_level and not optional and distribution(m) not in BASE]
    assert not offenders, offenders


def test_the_scan_sees_nested_dynamic_and_guarded_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import numpy\n"
                      "def f():\n    from sklearn import datasets\n"
                      "    require('mnist1d.data', 'x')\n"
                      "try:\n    import matplotlib\nexcept ImportError:\n    pass\n")
    assert sorted(imports(sample)) == [("matplotlib", True, True, 6), ("mnist1d", False, False, 4),
                                       ("numpy", True, False, 1), ("sklearn", False, False, 3)]


_WITHOUT = """
import runpy, sys
for name in {blocked!r}:
    sys.modules[name] = None   # import raises ModuleNotFoundError, as if not installed
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_train_without_progress_bar_runs_without_tqdm():
    import subprocess

    argv = ["examples/train.py", "--epochs", "1", "--no-progress", "--threads", "1"]
    proc = subprocess.run([sys.executable, "-c", _WITHOUT.format(blocked={"tqdm"}, argv=argv)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "test accuracy" in proc.stdout
