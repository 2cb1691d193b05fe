"""docs/ and README.md against the code: names that exist, tables that are complete.

* every ``mpicomm.x.y`` name the pages mention resolves (module, then attributes), and
  every repository path they mention exists;
* docs/environment.md lists exactly the ``MPICOMM_*`` variables the code reads;
* docs/compression.md has a row for every strategy name with each of its constructor's
  options, and docs/selector.md every option of ``strategy="auto"``;
* the pages hold no project history and cite no file outside the repository;
* the API reference builder's Markdown conversions (docs/build_api.py; pdoc itself is
  only installed by ``make docs``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from .launch import ROOT, load_script

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"(?<![\w/.-])mpicomm(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])((?:mpicomm|examples|launchers|tests|benchmarks|docs)/"
                  r"[\w./-]*\w)")


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def resolve(name: str) -> bool:
    """Import the longest module prefix of ``name``, then follow the attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except (ImportError, ValueError):
            continue
        obj = importlib.import_module(module_name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_exists() -> None:
    missing = sorted({f"{page.name}: {name}" for page in PAGES
                      for name in DOTTED.findall(text(page)) if not resolve(name)})
    assert missing == []


def test_every_repository_path_exists() -> None:
    missing = sorted({f"{page.name}: {path}" for page in PAGES
                      for path in PATH.findall(text(page))
                      if not (ROOT / path).exists() and not path.startswith("docs/api")})
    assert missing == []


def variables_in_code() -> set[str]:
    found: set[str] = set()
    sources = [*ROOT.joinpath("mpicomm").rglob("*.py"), *ROOT.joinpath("launchers").iterdir(),
               ROOT / "Makefile"]
    for path in sources:
        if path.is_file():
            body = path.read_text(encoding="utf-8", errors="replace")
            # a name, not a prefix pattern such as MPICOMM_EMU_*
            found |= set(re.findall(r"MPICOMM_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)", body))
    return found


def test_environment_table_matches_the_code() -> None:
    page = text(ROOT / "docs" / "environment.md")
    documented = set(re.findall(r"^\| `(MPICOMM_[A-Z0-9_]+)` \|", page, flags=re.MULTILINE))
    code = variables_in_code()
    assert code - documented == set(), "read by the code, missing from docs/environment.md"
    assert documented - code == set(), "in docs/environment.md, read nowhere"


COMMON = {"comm", "fusion_bytes", "schedule", "momentum_correction", "momentum_masking",
          "clip_norm"}


def test_strategy_table_lists_every_name_and_option() -> None:
    from mpicomm import strategies

    page = text(ROOT / "docs" / "compression.md")
    common_documented = all(f"`{o}" in page for o in COMMON)
    assert common_documented
    for name in strategies.available():
        row = re.search(rf"^\| `{name}` \|.*$", page, flags=re.MULTILINE)
        assert row, f"no row for strategy {name!r} in docs/compression.md"
        if name == "auto":
            continue
        cls = type(strategies.make(name))
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        cells = row.group(0)
        for option in params:
            if option == "comm" or (option in COMMON and "common" in cells):
                continue
            assert f"`{option}" in cells, f"{name}: option {option!r} not in its row"


def test_selector_table_lists_every_auto_option() -> None:
    from mpicomm import strategies

    page = text(ROOT / "docs" / "selector.md")
    config = getattr(strategies, "AutoConfig", None)
    if config is not None:  # the options live in a validated dataclass
        options = [f.name for f in dataclasses.fields(config)]
    else:
        options = list(inspect.signature(type(strategies.make("auto")).__init__).parameters)
    assert len(options) > 10
    for option in options:
        if option in ("self", "comm", "config", "options"):
            continue
        assert f"`{option}`" in page, f"auto option {option!r} not in docs/selector.md"


HISTORY = [r"\bissue\s+\d+", r"\bthis round\b", r"\bprevious rounds?\b", r"\bsession\b",
           r"what changed", r"tried and not kept", r"\b20\d\d-\d\d-\d\d\b",
           r"\bshared/", r"\bseeds?/", r"research/algorithms"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_hold_no_history(page: Path) -> None:
    body = text(page)
    hits = [m.group(0) for pattern in HISTORY for m in re.finditer(pattern, body, re.I)]
    assert hits == []


# ---------------------------------------------------------------- docs/build_api.py
def builder():
    return load_script("docs/build_api.py")


def test_api_builder_converts_simple_tables() -> None:
    rst = ("Intro.\n\n"
           "=====  ===========\n"
           "name   meaning\n"
           "=====  ===========\n"
           "``a``  first line\n"
           "       continued\n"
           "b      x | y\n"
           "=====  ===========\n\n"
           "After.")
    md = builder().to_markdown(rst)
    assert "| name | meaning |" in md
    assert "| ``a`` | first line continued |" in md
    assert "| b | x \\| y |" in md
    assert "=====" not in md and md.rstrip().endswith("After.")


def test_api_builder_converts_a_table_without_header() -> None:
    md = builder().to_markdown("==  ==\nx   1\ny   2\n==  ==\n")
    assert "| x | 1 |" in md and "| y | 2 |" in md and "==" not in md


def test_api_builder_strips_short_roles_and_literal_markers() -> None:
    b = builder()
    md = b.to_markdown("See :class:`~mpicomm.comm.Communicator` and :meth:`~.x.y`::\n\n"
                       "    code()\n\nA line.\n\n::\n\n    more()\n")
    assert ":class:`mpicomm.comm.Communicator`" in md and ":meth:`.x.y`" in md
    assert "~" not in md and "::" not in md and "    code()" in md


def test_api_builder_turns_underlined_titles_into_headings() -> None:
    md = builder().to_markdown("How it works\n------------\ntext\n\nParameters\n----------\nx:\n")
    assert "##### How it works" in md
    assert "Parameters\n----------" in md  # left to pdoc's NumPy-section conversion


def test_api_builder_finds_raw_markup() -> None:
    b = builder()
    page = ('<div class="docstring"><p>see :class:`x` and <code>~mpicomm.comm</code></p>'
            '<div class="pdoc-code codehilite"><pre>:meth:`in source`</pre></div></div>')
    found = b.leftovers(page)
    assert set(found) == {"reST role", "short-name tilde"}
    assert found["reST role"] == [":class:`"]


def test_api_builder_converts_definition_lists_outside_numpy_sections() -> None:
    rst = ("Algorithms:\n\n"
           "``ring``\n    Ring passes.\n    Large messages.\n"
           "``mpi``\n    The library's own.\n\n"
           "Example::\n\n    for x in data:\n        step(x)\n\n"
           "Parameters\n----------\nmodel:\n    The module.\n")
    md = builder().to_markdown(rst)
    assert "- ``ring``: Ring passes.\n  Large messages.\n- ``mpi``: The library's own." in md
    assert "    for x in data:\n        step(x)" in md  # a code block is not a list
    assert "Parameters\n----------\nmodel\n    The module." in md


def test_api_builder_keeps_directives_and_finds_what_pdoc_leaves() -> None:
    b = builder()
    md = b.to_markdown("The period is::\n\n    tau\n\n.. math::\n    \\tau_l = 1\n")
    assert "The period is:\n" in md and ".. math::\n" in md
    page = ('<p>.. note:\n    x</p><pre><code>``q_i = 1``</code></pre>'
            '<td>`<code>MPICOMM_X</code></td><td>` ... y</td>'
            '<script>var a = "``x``";</script>')
    found = b.leftovers(page)
    assert set(found) == {"directive as text", "double backquotes", "stray backquote"}
    assert found["double backquotes"] == ["``q_i = 1``"]
