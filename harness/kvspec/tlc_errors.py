"""SANY's and TLC's error texts as one-line ``FILE:LINE:COL: message`` reasons.

Pure text functions (split out of ``kvspec.tlc``, which turns them into error verdicts).
"""

from __future__ import annotations

import re
from pathlib import Path


def one_line(text: str) -> str:
    return " ".join(text.split())


def module_files(loose: str) -> dict[str, str]:
    """Module name -> file path, from SANY's "Parsing file ..." lines."""
    files: dict[str, str] = {}
    for m in re.finditer(r"^Parsing file (.+)$", loose, flags=re.MULTILINE):
        path = m.group(1).strip()
        files.setdefault(Path(path).stem, path)
    return files


def sany_error(loose: str, spec: Path) -> str | None:
    """``FILE:LINE:COL: message`` from SANY's own report of a parse/semantic error."""
    files = module_files(loose)
    m = re.search(
        r"\*\*\*Parse Error\*\*\*\s*(.*?)\n\s*Encountered (.*?) at line (\d+), column (\d+)"
        r"(.*?)\n",
        loose,
        flags=re.DOTALL,
    )
    if m:
        before = loose[: m.start()]
        parsing = re.findall(r"^Parsing file (.+)$", before, flags=re.MULTILINE)
        path = parsing[-1].strip() if parsing else str(spec)
        expecting = one_line(m.group(1))
        msg = one_line(f"Encountered {m.group(2)}{m.group(5)}")
        return f"{path}:{m.group(3)}:{m.group(4)}: parse error: {msg}; {expecting}"
    m = re.search(r"Lexical error at line (\d+), column (\d+)\.(.*?)\n", loose)
    if m:
        parsing = re.findall(r"^Parsing file (.+)$", loose[: m.start()], flags=re.MULTILINE)
        path = parsing[-1].strip() if parsing else str(spec)
        return f"{path}:{m.group(1)}:{m.group(2)}: lexical error:{one_line(m.group(3))}"
    m = re.search(
        r"\*\*\* Errors: \d+\s+line (\d+), col (\d+) to line \d+, col \d+ of module (\w+)"
        r"\s+(.*?)\n\s*\n",
        loose,
        flags=re.DOTALL,
    )
    if m:
        path = files.get(m.group(3), f"{m.group(3)}.tla")
        return f"{path}:{m.group(1)}:{m.group(2)}: {one_line(m.group(4))}"
    m = re.search(r"\*\*\* Abort messages: \d+\s+(.*?)\n\s*\n\s*(.*?)\n\s*\n", loose, re.DOTALL)
    if m:
        where = one_line(m.group(1))
        mod = re.match(r"In module (\w+)", where)
        path = files.get(mod.group(1), str(spec)) if mod else str(spec)
        return f"{path}: {one_line(m.group(2))}"
    return None


POSITION = re.compile(
    r"[Ll]ine (\d+), col(?:umn)? (\d+) to line \d+, col(?:umn)? \d+ (?:in|of module) (\w+)"
)


def location(text: str, files: dict[str, str], last: bool = True) -> str | None:
    found = POSITION.findall(text)
    if not found:
        return None
    line, col, mod = found[-1] if last else found[0]
    return f"{files.get(mod, mod + '.tla')}:{line}:{col}"
