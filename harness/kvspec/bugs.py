"""`kvspec bugs`: the public completion bugs (the project's bug history) and what in kvspec
catches each one, checked against the matrices so that the index cannot rot.

spec/bugs.toml holds one [[bug]] per bug (or per line of the history): its numbers, side,
root cause, and a status. A "caught" bug names matrix rows of its design whose expected
verdict for a property is "violated" and control rows (the fixed or shipped design) where
the same property "holds" ("analogue": the same, for another engine's or connector's bug
whose shape the rows catch in vLLM's NIXL code). TLC decides those verdicts in `kvspec
check | lease | clock | decode | blocks`, so this command only has to check that every
cited expectation is the one the matrix states. Mutants (kvspec.mutations.catalogue) and
real-engine recordings (conformance/recorded/) are checked to exist. `--history FILE`
also checks that every number in the history has an entry.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "spec" / "bugs.toml"
RECORDED = REPO / "conformance" / "recorded"
STATUSES = ("caught", "analogue", "expressed", "not-modelled", "out-of-scope")
SIDES = ("producer", "decode", "composition", "tool")
_ID = re.compile(r"#\d{4,6}\b")


class BugIndexError(ValueError):
    """Bad input in the index: file, line, what to do."""


@dataclass(frozen=True)
class Evidence:
    """One expectation a matrix states: `row`'s verdict for `property` is `expect`."""

    matrix: str
    row: str
    property: str
    expect: str

    def __str__(self) -> str:
        return f"{self.matrix}:{self.row} {self.property}={self.expect}"


@dataclass
class Bug:
    ids: list[str]
    engine: str
    side: str
    what: str
    status: str
    line: int
    caught: list[Evidence] = field(default_factory=list)
    controls: list[Evidence] = field(default_factory=list)
    mutants: list[str] = field(default_factory=list)
    recorded: list[str] = field(default_factory=list)
    why: str = ""

    @property
    def where(self) -> str:
        return f"{INDEX.name}:{self.line} ({'/'.join(self.ids)})"


# ---------------------------------------------------------------- loading


def _line_of(text: str, first_id: str) -> int:
    """The line of the `ids = [...]` that names `first_id` (tomllib keeps no positions)."""
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("ids") and f'"{first_id}"' in line:
            return i
    return 0


def _evidence(raw: object, where: str) -> list[Evidence]:
    if not isinstance(raw, list):
        raise BugIndexError(f"{where}: must be a list of {{matrix, row, property, expect}}")
    out = []
    for e in raw:
        keys = ("matrix", "row", "property", "expect")
        if not isinstance(e, dict) or sorted(e) != sorted(keys):
            raise BugIndexError(f"{where}: each entry needs exactly {', '.join(keys)}")
        out.append(Evidence(*(str(e[k]) for k in keys)))
    return out


def _strings(raw: object, where: str) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise BugIndexError(f"{where}: must be a list of strings")
    return list(raw)


def parse_index(text: str, path: Path = INDEX) -> list[Bug]:
    """The [[bug]] tables of `text`; a malformed one is a BugIndexError naming its line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BugIndexError(f"{path}: {exc}; fix the TOML syntax") from None
    bugs = []
    for i, raw in enumerate(data.get("bug", []), 1):
        ids = raw.get("ids")
        if not isinstance(ids, list) or not ids or not all(_ID.fullmatch(str(x)) for x in ids):
            raise BugIndexError(f'{path}: bug #{i}: ids must be a list like ["#46240"]')
        line = _line_of(text, str(ids[0]))
        where = f"{path}:{line}"
        for key, allowed in (("status", STATUSES), ("side", SIDES)):
            if raw.get(key) not in allowed:
                raise BugIndexError(f"{where}: {key} must be one of {', '.join(allowed)}")
        unknown = sorted(set(raw) - {f.name for f in Bug.__dataclass_fields__.values()})
        if unknown:
            raise BugIndexError(f"{where}: unknown keys {unknown}; see the file's header")
        bugs.append(Bug(
            ids=[str(x) for x in ids], engine=str(raw.get("engine", "vllm")),
            side=str(raw["side"]), what=str(raw.get("what", "")), status=str(raw["status"]),
            line=line, caught=_evidence(raw.get("caught", []), f"{where}: caught"),
            controls=_evidence(raw.get("controls", []), f"{where}: controls"),
            mutants=_strings(raw.get("mutants", []), f"{where}: mutants"),
            recorded=_strings(raw.get("recorded", []), f"{where}: recorded"),
            why=str(raw.get("why", "")),
        ))  # fmt: skip
    return bugs


def load_index(path: Path = INDEX) -> list[Bug]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise BugIndexError(f"{path}: {exc.strerror}; pass --index FILE") from None
    return parse_index(text, path)


# ---------------------------------------------------------------- the matrices


def _sweep_rows(module: str, attr: str) -> Callable[[], dict[str, dict[str, str]]]:
    def load() -> dict[str, dict[str, str]]:
        import importlib

        from kvspec.sweep import load_sweep_matrix

        sweep = getattr(importlib.import_module(f"kvspec.{module}"), attr)
        return {r.name: r.expect for r in load_sweep_matrix(sweep)}

    return load


def _model_rows(name: str) -> Callable[[], dict[str, dict[str, str]]]:
    def load() -> dict[str, dict[str, str]]:
        from kvspec.matrix import load_matrix

        return {r.name: r.expect for r in load_matrix(REPO / "spec" / name)}

    return load


MATRICES: dict[str, Callable[[], dict[str, dict[str, str]]]] = {
    "check": _model_rows("matrix.toml"),
    "nightly": _model_rows("matrix-nightly.toml"),
    "lease": _sweep_rows("lease", "LEASE"),
    "clock": _sweep_rows("clock", "CLOCK"),
    "decode": _sweep_rows("decode", "DECODE"),
    "blocks": _sweep_rows("blocks", "BLOCKS"),
}


@cache
def matrix_expectations(matrix: str) -> Mapping[str, Mapping[str, str]]:
    """row -> property -> the verdict the matrix expects (defaults applied)."""
    return MATRICES[matrix]()


# ---------------------------------------------------------------- checking


def evidence_problem(
    e: Evidence, rows: Callable[[str], Mapping[str, Mapping[str, str]]]
) -> str | None:
    """Why `e` is not what its matrix states, or None."""
    if e.matrix not in MATRICES:
        return f"{e}: no matrix {e.matrix!r} (one of {', '.join(MATRICES)})"
    got = rows(e.matrix)
    if e.row not in got:
        return f"{e}: the {e.matrix} matrix has no row {e.row!r}"
    stated = got[e.row].get(e.property)
    if stated != e.expect:
        return f"{e}: the matrix expects {stated or 'nothing'} for {e.property}"
    return None


def bug_problems(
    bug: Bug,
    rows: Callable[[str], Mapping[str, Mapping[str, str]]] = matrix_expectations,
    mutants: Iterable[str] | None = None,
    recorded: Path = RECORDED,
) -> list[str]:
    """Everything `bug`'s entry claims that the repository does not back."""
    if mutants is None:
        from kvspec.mutations.catalogue import MUTANTS

        mutants = MUTANTS
    known = set(mutants)
    out = [p for e in [*bug.caught, *bug.controls] if (p := evidence_problem(e, rows))]
    out += [f"no mutant {m!r} in kvspec.mutations.catalogue" for m in bug.mutants
            if m not in known]  # fmt: skip
    out += [f"no recording {r!r} under conformance/recorded" for r in bug.recorded
            if not (recorded / r).is_dir()]  # fmt: skip
    if bug.status in ("caught", "analogue"):
        out += _caught_problems(bug)
    if bug.status in ("not-modelled", "out-of-scope") and not bug.why:
        out.append(f"status {bug.status} needs a why")
    if bug.status == "expressed" and not (bug.caught or bug.controls or bug.recorded
                                          or bug.mutants or bug.why):  # fmt: skip
        out.append("status expressed needs rows, recordings, mutants or a why")
    return [f"{bug.where}: {p}" for p in out]


def _caught_problems(bug: Bug) -> list[str]:
    """A caught bug fails somewhere and its control holds on the same property (the
    negative control), or a mutant of the real code re-introduces it."""
    if bug.mutants and not bug.caught:
        return []
    if not any(e.expect == "violated" for e in bug.caught):
        return [f"status {bug.status} needs a row expecting a property violated, or a mutant"]
    failing = {e.property for e in bug.caught if e.expect == "violated"}
    held = {e.property for e in bug.controls if e.expect == "holds"}
    if not failing & held:
        return [f"no control row where {', '.join(sorted(failing))} holds"]
    return []


def history_ids(text: str) -> set[str]:
    return set(_ID.findall(text))


def missing_from_index(bugs: list[Bug], history: str) -> list[str]:
    have = {i for b in bugs for i in b.ids}
    return sorted(history_ids(history) - have, key=lambda i: int(i[1:]))


# ---------------------------------------------------------------- the report

Observed = Mapping[tuple[str, str, str], str]  # (matrix, row, property) -> TLC's verdict


def observed_verdicts(
    check_results: Iterable[Mapping[str, object]], sweeps: Mapping[str, Mapping[str, object]]
) -> dict[tuple[str, str, str], str]:
    """What this review's TLC runs said: `kvspec check`'s results and the sweeps' rows
    (report_sweeps.sweeps_context), keyed as the index cites them."""
    out = {("check", str(r.get("model")), str(r.get("property"))): str(r.get("verdict"))
           for r in check_results}  # fmt: skip
    for matrix in ("lease", "clock", "decode", "blocks"):
        rows = (sweeps.get(matrix) or {}).get("rows") or []
        for row in rows if isinstance(rows, list) else []:
            for prop, verdict in dict(row.get("verdicts", {})).items():
                out[(matrix, str(row["name"]), str(prop))] = str(verdict)
    return out


def run_says(bug: Bug, observed: Observed) -> str:
    """Whether this run's TLC verdicts back the entry's cited ones: every cited row it ran
    agrees ("confirmed"), one does not ("differs"), or it ran none of them."""
    cited = [*bug.caught, *bug.controls]
    seen = [(e, observed[(e.matrix, e.row, e.property)]) for e in cited
            if (e.matrix, e.row, e.property) in observed]  # fmt: skip
    wrong = [f"{e.matrix}:{e.row} {e.property} {v}" for e, v in seen if v != e.expect]
    if wrong:
        return "differs: " + "; ".join(wrong)
    if not seen:
        return "not in this run" if cited else "-"
    return f"confirmed ({len(seen)} of {len(cited)} cited verdicts)"


def bugs_context(observed: Observed, path: Path = INDEX) -> dict[str, object]:
    """The report's section: each entry with its evidence and what this run says of it, or
    why the index could not be read (never a reason to lose the rest of the report)."""
    try:
        bugs = load_index(path)
    except BugIndexError as exc:
        return {"rows": None, "error": str(exc)}
    rows = [{"ids": " ".join(b.ids), "engine": b.engine, "side": b.side, "status": b.status,
             "what": b.what, "evidence": "; ".join(_evidence_text(b)) or b.why,
             "run": run_says(b, observed)} for b in bugs]  # fmt: skip
    counts = {s: sum(b.status == s for b in bugs) for s in STATUSES}
    return {"rows": rows, "counts": counts, "error": None}


def _evidence_text(b: Bug) -> list[str]:
    return [*(str(e) for e in b.caught), *(f"control {e}" for e in b.controls),
            *(f"mutant {m}" for m in b.mutants), *(f"recorded {r}" for r in b.recorded)]


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", type=Path, default=INDEX)
    p.add_argument("--history", type=Path, default=None,
                   help="the bug history (markdown): every #number in it must have an entry")
    p.add_argument("--status", choices=STATUSES, action="append", default=[],
                   help="only entries of this status (repeatable)")
    p.add_argument("--json", type=Path, default=None)  # fmt: skip


def print_table(bugs: list[Bug]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="public completion bugs and what in kvspec catches them", show_lines=False)
    for col in ("bugs", "side", "status", "what", "evidence"):
        t.add_column(col, overflow="fold")
    for b in bugs:
        t.add_row(" ".join(b.ids), b.side, b.status, b.what,
                  "\n".join(_evidence_text(b)) or b.why)  # fmt: skip
    Console(width=200).print(t)


def run(args: argparse.Namespace) -> int:
    try:
        bugs = load_index(args.index)
        history = args.history.read_text() if args.history else None
    except BugIndexError as exc:
        print(f"kvspec bugs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvspec bugs: {args.history}: {exc.strerror}; pass --history FILE",
              file=sys.stderr)  # fmt: skip
        return 2
    problems = [p for b in bugs for p in bug_problems(b)]
    if history is not None:
        problems += [f"{args.history}: {i} has no entry in {args.index}; add one"
                     for i in missing_from_index(bugs, history)]  # fmt: skip
    shown = [b for b in bugs if not args.status or b.status in args.status]
    print_table(shown)
    counts = {s: sum(b.status == s for b in bugs) for s in STATUSES}
    print(", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({len(bugs)} entries)")
    for p in problems:
        print(f"kvspec bugs: {p}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bugs": [asdict(b) for b in bugs], "counts": counts,
                                         "problems": problems}, indent=1) + "\n")  # fmt: skip
    return 1 if problems else 0
