"""Build the API reference of mpicomm from its docstrings with pdoc (``make docs``).

    python docs/build_api.py [--out build/docs/api] [--check]

The docstrings are written in reStructuredText with NumPy-style sections. pdoc's
``numpy`` docformat converts the sections and the Sphinx roles (``:class:`x```) into
Markdown; this script adds what pdoc leaves as raw markup (:func:`to_markdown`):

* the ``~`` of Sphinx's short-name roles (``:class:`~mpicomm.comm.Communicator```),
  which pdoc would print as ``~mpicomm.comm.Communicator`` and not link;
* simple tables (columns under ``=====  =====`` rules) become Markdown tables;
* a paragraph ending in ``::`` (a literal block follows) ends in ``:``, and a line that is
  only ``::`` is dropped (a directive such as ``.. math::`` keeps its ``::``);
* underlined headings other than the NumPy sections (``How a step flows`` over a line
  of ``-``) become Markdown headings.

After writing the HTML, the script scans it for markup that survived (``:class:```,
``:meth:```, a ``~`` inside a code span that names a module, table rules, double
backquotes, a directive shown as text, a table cell cut inside a code span) and prints
what it found; ``--check`` makes any such finding an error (exit status 1). pdoc's own
warnings are printed as they come and counted in the summary.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "build" / "docs" / "api"

_ROLE = re.compile(r"(:py)?:(mod|func|data|const|class|meth|attr|exc|obj):`~")
_RULE = re.compile(r"^(?P<indent>[ ]*)=+(?:[ ]+=+)+[ ]*$")
_NUMPY_SECTIONS = {"Parameters", "Returns", "Yields", "Receives", "Other Parameters",
                   "Raises", "Warns", "Attributes", "See Also"}


def strip_short_roles(text: str) -> str:
    """``:class:`~a.b.C``` -> ``:class:`a.b.C```: pdoc links the full name."""
    return _ROLE.sub(lambda m: f"{m.group(1) or ''}:{m.group(2)}:`", text)


def _columns(rule: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", rule)]


def _cells(line: str, cols: list[tuple[int, int]]) -> list[str]:
    """Cut ``line`` at the column starts; the last column runs to the end of the line."""
    out = []
    for i, (start, _) in enumerate(cols):
        stop = cols[i + 1][0] if i + 1 < len(cols) else len(line)
        out.append(line[start:stop].strip())
    return out


def _markdown_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def convert_tables(text: str) -> str:
    """Replace every reST simple table (rules of ``=`` around header and rows) by a
    Markdown table. A row whose first cell is empty continues the row above it (the
    cells' text is joined with a space), as in reST."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _RULE.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent, cols = m.group("indent"), _columns(lines[i])
        # the rules of this table: the next lines that are the same rule
        block_rules, rows, j = [i], [], i + 1
        while j < len(lines):
            if _RULE.match(lines[j]) and _columns(lines[j]) == cols:
                block_rules.append(j)
                j += 1
                if len(block_rules) == 3 or not _continues(lines, j, cols):
                    break
                continue
            if not lines[j].strip():
                break
            rows.append((len(block_rules), lines[j]))
            j += 1
        if len(block_rules) < 2:  # a lone rule: not a table
            out.append(lines[i])
            i += 1
            continue
        has_header = len(block_rules) == 3
        header_rows = [line for section, line in rows if section == 1] if has_header else []
        body_rows = [line for section, line in rows if section == (2 if header_rows else 1)]
        table: list[list[str]] = []
        for line in header_rows + body_rows:
            cells = _cells(line, cols)
            if table and not cells[0] and len(table) > (1 if header_rows else 0):
                table[-1] = [f"{a} {b}".strip() for a, b in zip(table[-1], cells)]
            else:
                table.append(cells)
        if header_rows:
            head, body = table[0], table[1:]
        else:  # no header row: an empty one keeps the Markdown table valid
            head, body = [""] * len(cols), table
        out.append("")
        out.append(indent + _markdown_row(head))
        out.append(indent + "|" + "|".join("---" for _ in cols) + "|")
        out.extend(indent + _markdown_row(row) for row in body)
        out.append("")
        i = j
    return "\n".join(out)


def _continues(lines: list[str], j: int, cols: list[tuple[int, int]]) -> bool:
    """After a table's second rule: does a body (rows, then a third rule) follow?"""
    k = j
    while k < len(lines) and lines[k].strip() and not _RULE.match(lines[k]):
        k += 1
    return k > j and k < len(lines) and bool(_RULE.match(lines[k])) and _columns(lines[k]) == cols


_DIRECTIVE = re.compile(r"^[ ]*\.\.[ ]+[\w-]+::")


def convert_literal_markers(text: str) -> str:
    """``text::`` -> ``text:`` and a line that is only ``::`` is dropped (the indented
    block after it is a Markdown code block either way). A directive (``.. math::``,
    ``.. note::``) keeps its ``::``: pdoc renders those itself."""
    text = re.sub(r"^[ ]*::[ ]*\n", "", text, flags=re.MULTILINE)
    return "\n".join(line if _DIRECTIVE.match(line) else re.sub(r"(?<=\S)::[ ]*$", ":", line)
                     for line in text.split("\n"))


def convert_headings(text: str) -> str:
    """Underlined headings (a line of ``-`` or ``~`` as long as the title) that are not
    NumPy sections become ``#####`` headings."""

    def repl(m: re.Match[str]) -> str:
        title = m.group("title")
        if title.strip() in _NUMPY_SECTIONS:
            return m.group(0)
        return f"##### {title.strip()}\n"

    return re.sub(r"^(?P<title>[^\n]*\S[^\n]*)\n[-~]{3,}[ ]*\n", repl, text, flags=re.MULTILINE)


_SECTION = re.compile(r"^([^\n]*\S[^\n]*)\n[-~]{3,}[ ]*$", re.MULTILINE)
_NOT_A_TERM = re.compile(r"^(?:[-*+|]\s|\d+[.)]\s|\.\.\s|>>>)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _definition_lists(chunk: str) -> str:
    """reST definition lists (a term at column 0, its definition indented on the next
    lines) as Markdown list items ``- term: definition``; Markdown would otherwise run
    every term and definition of a list together into one paragraph."""
    lines = chunk.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        is_term = (line.strip() and _indent(line) == 0 and not _NOT_A_TERM.match(line)
                   and i + 1 < len(lines) and lines[i + 1].strip()
                   and _indent(lines[i + 1]) > 0
                   and (i == 0 or not lines[i - 1].strip() or _indent(lines[i - 1]) > 0))
        if not is_term:
            out.append(line)
            i += 1
            continue
        body, j = [], i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > 0):
            body.append(lines[j])
            j += 1
        while body and not body[-1].strip():  # trailing blank lines end the item
            body.pop()
            j -= 1
        depth = min(_indent(b) for b in body if b.strip())
        first, rest = body[0][depth:], [b[depth:] for b in body[1:]]
        out.append(f"- {line.strip()}: {first}")
        out.extend(f"  {r}" if r.strip() else "" for r in rest)
        i = j
    return "\n".join(out)


def _numpy_names(chunk: str) -> str:
    """In a NumPy section, ``name:`` over its indented description is ``name`` (pdoc
    would print the colon and add its own)."""
    return re.sub(r"^(\S[^\n]*?):[ ]*(?=\n[ ]+\S)", r"\1", chunk, flags=re.MULTILINE)


def convert_definition_lists(text: str) -> str:
    """:func:`_definition_lists` outside the NumPy sections (``Parameters`` and the
    like), whose ``name`` / indented description pairs pdoc converts itself."""
    pieces, last, numpy_section = [], 0, False

    def convert(chunk: str) -> str:
        return _numpy_names(chunk) if numpy_section else _definition_lists(chunk)

    for m in _SECTION.finditer(text):
        pieces.append(convert(text[last:m.start()]))
        pieces.append(m.group(0))
        numpy_section = m.group(1).strip() in _NUMPY_SECTIONS
        last = m.end()
    pieces.append(convert(text[last:]))
    return "".join(pieces)


def to_markdown(docstring: str) -> str:
    """The conversions of the module docstring, in the order pdoc needs them."""
    text = strip_short_roles(docstring)
    text = convert_tables(text)
    text = convert_literal_markers(text)
    text = convert_definition_lists(text)
    return convert_headings(text)


# What must not survive into the HTML: reST roles, Sphinx's "~" before a dotted name in
# a code span, simple-table rules, reST's double backquotes (in prose, or in an indented
# block that Markdown shows as code), a directive shown as text, and a backquote left
# over from a table cell cut in the middle of a code span.
LEFTOVERS: dict[str, re.Pattern[str]] = {
    "reST role": re.compile(r":(?:mod|func|data|const|class|meth|attr|exc|obj):`"),
    "short-name tilde": re.compile(r"<code>~[\w.]+"),
    "table rule": re.compile(r"^\s*=+(?:\s+=+)+\s*$", re.MULTILINE),
    "double backquotes": re.compile(r"``[^`\n]+``"),
    "directive as text": re.compile(r"^\s*(?:<p>)?\.\.[ ]+[\w-]+::?", re.MULTILINE),
    "stray backquote": re.compile(r"<td>`|`</td>"),
}


_CODE = re.compile(r'<div class="pdoc-code codehilite">.*?</pre></div>', re.DOTALL)
_SCRIPT = re.compile(r"<script.*?</script>", re.DOTALL)


def leftovers(html_text: str) -> dict[str, list[str]]:
    """Raw markup found in the prose of one rendered page (source listings and code
    blocks are skipped), by kind, a few examples each."""
    found: dict[str, list[str]] = {}
    text = html.unescape(_SCRIPT.sub("", _CODE.sub("", html_text)))
    for kind, pattern in LEFTOVERS.items():
        hits = [m.group(0).strip() for m in pattern.finditer(text)]
        if hits:
            found[kind] = hits[:3]
    return found


def public_modules(package: str = "mpicomm") -> list[str]:
    """Every module of ``package`` whose dotted name has no part starting with ``_``
    (pdoc follows ``__all__``, which lists no submodules, so they are named here)."""
    import importlib
    import pkgutil

    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def roots(names: list[str]) -> list[str]:
    """The modules of ``names`` whose parent package does not list its submodules:
    the top package (its ``__all__`` names none), its direct children and, below them,
    any module a package's ``__all__`` hides from pdoc's walk."""
    import importlib

    keep = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        if not parent or parent == names[0]:
            keep.append(name)
            continue
        exported = getattr(importlib.import_module(parent), "__all__", None)
        if exported is not None and leaf not in exported:
            keep.append(name)
    return keep


def resolve_lazy_exports(names: list[str]) -> None:
    """Load the names a package exports lazily (a module ``__getattr__`` that imports
    on first use) into its namespace, so that pdoc finds the members its ``__all__``
    lists instead of warning that they do not resolve."""
    import importlib

    for name in names:
        module = importlib.import_module(name)
        for member in getattr(module, "__all__", ()):
            if member not in vars(module):
                setattr(module, member, getattr(module, member))


def build(out: Path) -> tuple[int, dict[str, dict[str, list[str]]]]:
    """Render the reference into ``out``; return (pdoc warnings, leftovers by page)."""
    import pdoc
    import pdoc.docstrings
    import pdoc.render

    original: Callable[..., str] = pdoc.docstrings.convert

    def convert(docstring: str, docformat: str, source_file: Path | None) -> str:
        return original(to_markdown(docstring), docformat, source_file)

    pdoc.docstrings.convert = convert  # the renderer looks it up here at call time
    pdoc.render.configure(docformat="numpy", math=True, show_source=True,
                          footer_text="mpicomm API reference (built by make docs)")
    count = 0

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        nonlocal count
        count += 1
        print(f"warning: {category.__name__}: {message}", file=sys.stderr)

    previous = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            modules = public_modules()
            resolve_lazy_exports(modules)
            # pdoc walks a package's submodules itself unless its __all__ leaves them
            # out; name only those it would not reach, or it warns about duplicates
            pdoc.pdoc(*roots(modules), r"!.*\._\w+$", output_directory=out)
    finally:
        warnings.showwarning = previous
        pdoc.docstrings.convert = original
    found = {}
    for page in sorted(out.rglob("*.html")):
        hits = leftovers(page.read_text(encoding="utf-8"))
        if hits:
            found[str(page.relative_to(out))] = hits
    return count, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docs/build_api.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output directory (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when raw markup survives in the HTML")
    args = parser.parse_args(argv)
    count, found = build(args.out)
    pages = len(list(args.out.rglob("*.html")))
    for page, hits in found.items():
        for kind, examples in hits.items():
            print(f"raw markup: {page}: {kind}: {', '.join(examples)}")
    print(f"API reference: {pages} pages in {args.out}/index.html "
          f"({count} pdoc warning(s), raw markup on {len(found)} page(s))")
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
