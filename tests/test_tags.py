"""The tag registry: disjoint ranges, every named tag inside its subsystem's range."""

import pytest

from mpicomm import tags


def test_ranges_are_disjoint_and_in_bounds():
    tags.check_registry()


def test_named_tags_are_unique_and_registered():
    named = {name: value for name, value in vars(tags).items() if name.startswith("TAG_")}
    assert len(set(named.values())) == len(named), named
    for name, value in named.items():
        assert any(start <= value < stop for start, stop in tags.RANGES.values()), name


def test_tag_rejects_out_of_range_offsets():
    start, stop = tags.RANGES["ps"]
    assert tags.tag("ps", 0) == start
    with pytest.raises(ValueError, match="outside"):
        tags.tag("ps", stop - start)
    with pytest.raises(ValueError, match="unknown tag subsystem"):
        tags.tag("nope", 0)


def test_overlap_is_detected(monkeypatch):
    monkeypatch.setitem(tags.RANGES, "clash", (15, 25))
    with pytest.raises(AssertionError, match="overlap"):
        tags.check_registry()


def test_no_module_defines_its_own_numeric_tag():
    """Tags come from the registry: no ``_TAG = 97`` or ``tag=97`` beside it."""
    import re
    from pathlib import Path

    root = Path(tags.__file__).parent
    pattern = re.compile(r"^\s*_?TAG\w*\s*=\s*\d+|\btag\s*=\s*\d+", re.MULTILINE)
    found = [f"{p.relative_to(root)}: {m.group(0).strip()}"
             for p in root.rglob("*.py") if p.name != "tags.py"
             for m in pattern.finditer(p.read_text())]
    assert not found, found
