"""The house rule "no module over 500 lines" (README, How we write code), checked on every
Python file of the pipeline, so that a module grows into a split instead of past the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("harness/kvspec", "harness/tests", "conformance", "bench")
MAX_LINES = 500


def oversized(root: Path, trees: tuple[str, ...], limit: int) -> list[str]:
    """`path: N lines` for each .py file under `trees` longer than `limit` lines."""
    out = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root)}: {n} lines")
    return out


def test_no_module_is_over_500_lines() -> None:
    assert oversized(ROOT, TREES, MAX_LINES) == []


@pytest.mark.parametrize(("lines", "flagged"), [(MAX_LINES, False), (MAX_LINES + 1, True)])
def test_the_rule_flags_the_501st_line(tmp_path: Path, lines: int, flagged: bool) -> None:
    # The negative control: the check above would see a module that broke the rule.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * lines, encoding="utf-8")
    found = oversized(tmp_path, ("pkg",), MAX_LINES)
    assert found == ([f"pkg/big.py: {lines} lines"] if flagged else [])
