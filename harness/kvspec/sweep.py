"""A sweep: one TLA+ module checked over a TOML matrix of its constants, each row with the
verdicts it must get. `kvspec lease` (spec/LeaseClock.tla) and `kvspec decode`
(spec/Decode.tla) are sweeps; `kvspec check` (KVCompletion.tla) is not, its rows carry a
topology and its own planner (kvspec.check).

Per row TLC decides the invariants and the vacuity guards the row names in one run
(-continue: every violated invariant with its shortest counterexample, again without them
for the invariants it did not name: TLC explores no successor of a violating state), and the
liveness properties in a second run. A timed-out or failed run leaves its properties
"timeout" / "error": inconclusive, never a verdict. Bad input is one line (file, row, fix).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.table import Table

from kvspec.itf import JSON, trace_to_itf
from kvspec.tlc import TLCResult, run_tlc
from kvspec.tools import QUICK_JVM

VERDICTS = ("holds", "violated")
TIERS = ("fast", "full")
Value = int | bool | str


class SweepMatrixError(ValueError):
    """A bad sweep matrix: the message is one line naming the file, the row and the fix."""


@dataclass(frozen=True)
class Const:
    """A constant of the module, set from a matrix key: an int >= 0, a bool, or one of
    `choices` (a string)."""

    name: str
    key: str
    kind: Literal["int", "bool", "str"]
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sweep:
    command: str
    spec: Path
    matrix: Path
    consts: tuple[Const, ...]
    invariants: tuple[str, ...]
    reach: tuple[str, ...]  # vacuity guards: checked only in rows that name them
    liveness: tuple[str, ...]
    columns: tuple[str, ...]  # constants shown in the table
    title: str
    max_requests: int = 3
    modules: tuple[Path, ...] = ()  # modules the spec EXTENDS or INSTANCEs (copied beside it)
    timeout_s: float = 300  # per TLC run; expiring is a timeout (inconclusive), never a verdict

    @property
    def properties(self) -> tuple[str, ...]:
        return self.invariants + self.reach + self.liveness

    @property
    def keys(self) -> set[str]:
        return {c.key for c in self.consts} | {"requests", "tier", "expect", "name"}


@dataclass(frozen=True)
class SweepRow:
    name: str
    consts: dict[str, Value]
    requests: int
    tier: str
    expect: dict[str, str] = field(default_factory=dict)

    @property
    def ints(self) -> dict[str, int]:
        return {k: v for k, v in self.consts.items() if type(v) is int}

    @property
    def bools(self) -> dict[str, bool]:
        return {k: v for k, v in self.consts.items() if isinstance(v, bool)}

    def cfg_text(self, invariants: Sequence[str], properties: Sequence[str]) -> str:
        def tla(v: Value) -> str:
            if isinstance(v, bool):
                return "TRUE" if v else "FALSE"
            return str(v) if isinstance(v, int) else f'"{v}"'

        consts = [f"  {k} = {tla(v)}" for k, v in self.consts.items()]
        consts += [f"  Reqs = {{{', '.join(str(r) for r in range(1, self.requests + 1))}}}"]
        lines = ["CONSTANTS", *consts, "SPECIFICATION Spec"]
        lines += ["INVARIANTS TypeOK " + " ".join(invariants)] if invariants else []
        lines += ["PROPERTIES " + " ".join(properties)] if properties else []
        return "\n".join(lines) + "\n"


def _value(c: Const, v: object, where: str) -> Value:
    if c.kind == "int":
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SweepMatrixError(f"{where}: {c.key} must be a non-negative integer, got {v!r}")
        return v
    if c.kind == "bool":
        if not isinstance(v, bool):
            raise SweepMatrixError(f"{where}: {c.key} must be true or false, got {v!r}")
        return v
    if v not in c.choices:
        raise SweepMatrixError(f"{where}: {c.key} must be one of {list(c.choices)}, got {v!r}")
    return str(v)


def _row(sweep: Sweep, raw: dict[str, object], defaults: dict[str, object], where: str) -> SweepRow:
    unknown = sorted(set(raw) - sweep.keys)
    if unknown:
        raise SweepMatrixError(
            f"{where}: unknown key(s) {', '.join(unknown)}; use {sorted(sweep.keys)}"
        )
    merged = {**defaults, **raw}
    consts = {c.name: _value(c, merged.get(c.key), where) for c in sweep.consts}
    requests = merged.get("requests")
    top = sweep.max_requests
    if not isinstance(requests, int) or isinstance(requests, bool) or not 1 <= requests <= top:
        raise SweepMatrixError(f"{where}: requests must be 1 to {top}, got {requests!r}")
    tier = merged.get("tier")
    if tier not in TIERS:
        raise SweepMatrixError(f'{where}: tier must be "fast" or "full", got {tier!r}')
    d_expect = defaults.get("expect", {})
    r_expect = raw.get("expect", {})
    if not isinstance(d_expect, dict) or not isinstance(r_expect, dict):
        raise SweepMatrixError(f'{where}: expect must be a table {{Property = "holds"}}')
    expect = {str(k): str(v) for k, v in {**d_expect, **r_expect}.items()}
    bad = {k: v for k, v in expect.items() if k not in sweep.properties or v not in VERDICTS}
    if bad:
        raise SweepMatrixError(
            f"{where}: expect {bad} unknown; properties {sweep.properties}, verdicts {VERDICTS}"
        )
    return SweepRow(str(raw.get("name")), consts, requests, str(tier), expect)


def load_sweep_matrix(sweep: Sweep, path: Path | None = None) -> list[SweepRow]:
    path = sweep.matrix if path is None else path
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SweepMatrixError(f"{path}: {exc}; fix the TOML syntax") from None
    defaults = data.get("defaults", {})
    rows: list[SweepRow] = []
    for i, raw in enumerate(data.get("row", [])):
        where = f"{path}: row {raw.get('name', f'#{i + 1}')!r}"
        if "name" not in raw:
            raise SweepMatrixError(f"{where}: needs a name")
        rows.append(_row(sweep, raw, defaults, where))
    names = [r.name for r in rows]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SweepMatrixError(f"{path}: row names {dup} appear twice; rename one")
    return rows


@dataclass
class SweepResult:
    row: SweepRow
    verdicts: dict[str, str]  # property -> holds | violated | timeout | error
    states: int
    seconds: float
    cex_steps: dict[str, int]

    @property
    def inconclusive(self) -> list[str]:
        """Properties TLC did not decide (timed out or failed): never a verdict."""
        return [p for p, v in self.verdicts.items() if v not in VERDICTS]

    @property
    def unexpected(self) -> list[str]:
        return [
            p for p, v in self.row.expect.items()
            if self.verdicts.get(p) != v and p not in self.inconclusive
        ]  # fmt: skip

    def to_json(self) -> dict[str, JSON]:
        return {
            "name": self.row.name,
            "constants": dict(self.row.consts),
            "requests": self.row.requests,
            "verdicts": dict(self.verdicts),
            "expect": dict(self.row.expect),
            "unexpected": list(self.unexpected),
            "inconclusive": list(self.inconclusive),
            "distinct_states": self.states,
            "seconds": round(self.seconds, 2),
            "counterexample_steps": dict(self.cex_steps),
        }


def _tlc(sweep: Sweep, row: SweepRow, work: Path, tag: str, inv: Sequence[str],
         props: Sequence[str], extra: tuple[str, ...]) -> TLCResult:  # fmt: skip
    d = work / row.name / tag
    d.mkdir(parents=True, exist_ok=True)
    for module in (sweep.spec, *sweep.modules):
        shutil.copy(module, d / module.name)
    cfg = d / sweep.spec.with_suffix(".cfg").name
    cfg.write_text(row.cfg_text(inv, props))
    # A fast row explores in seconds: C1 alone (QUICK_JVM) halves the CPU of make test's
    # sweep rows; a full row may explore for minutes, where C2 pays for itself.
    return run_tlc(
        d / sweep.spec.name, cfg, extra_args=extra, timeout_s=sweep.timeout_s, log_dir=d / "tlc",
        jvm_flags=QUICK_JVM if row.tier == "fast" else None,
    )


def _safety(sweep: Sweep, row: SweepRow, work: Path, res: SweepResult) -> None:
    pending = sweep.invariants + tuple(p for p in sweep.reach if p in row.expect)
    inv: TLCResult | None = None
    for attempt in range(len(pending)):
        inv = _tlc(sweep, row, work, f"safety{attempt or ''}", pending, (), ("-continue",))
        res.seconds += inv.seconds
        res.states = max(res.states, inv.distinct_states or 0)
        named = tuple(p for p in pending if p in inv.violations)
        for prop in named:
            res.verdicts[prop] = "violated"
            trace = inv.violations[prop]
            if trace is not None:
                res.cex_steps[prop] = len(trace.states)
                doc = trace_to_itf(trace, source=str(sweep.spec), description=f"{row.name}: {prop}")
                (work / row.name / f"{prop}.itf.json").write_text(json.dumps(doc, indent=1))
        pending = tuple(p for p in pending if p not in named)
        if not named or not pending:
            break
    for prop in pending:
        if inv is not None and (inv.verdict == "holds" or (inv.complete and not inv.violations)):
            res.verdicts[prop] = "holds"
        else:
            v = inv.verdict if inv is not None else "error"
            res.verdicts[prop] = v if v in ("timeout", "error") else "error"


def check_sweep_row(sweep: Sweep, row: SweepRow, work: Path) -> SweepResult:
    res = SweepResult(row, {}, 0, 0.0, {})
    _safety(sweep, row, work, res)
    if not sweep.liveness:
        return res
    live = _tlc(sweep, row, work, "liveness", (), sweep.liveness, ())
    res.seconds += live.seconds
    res.states = max(res.states, live.distinct_states or 0)
    if live.verdict == "violated" and len(sweep.liveness) > 1:
        # TLC does not say which temporal property a lasso violates: one run each.
        for prop in sweep.liveness:
            one = _tlc(sweep, row, work, f"liveness-{prop}", (), (prop,), ())
            res.seconds += one.seconds
            res.verdicts[prop] = _live_verdict(one, prop)
        return res
    for prop in sweep.liveness:
        res.verdicts[prop] = _live_verdict(live, prop)
    return res


def _live_verdict(live: TLCResult, prop: str) -> str:
    if live.verdict == "holds":
        return "holds"
    if live.verdict == "violated" and live.violated_property in (prop, None):
        return "violated"
    return live.verdict if live.verdict in ("timeout", "error") else "error"


def print_table(sweep: Sweep, results: list[SweepResult], console: Console) -> None:
    t = Table(title=sweep.title)
    for col in ("row", *sweep.columns, "reqs", *sweep.properties, "states", "s"):
        t.add_column(col)
    for r in results:
        cells = [
            f"[red]{r.verdicts.get(p, '-')}[/red]" if p in r.unexpected
            else r.verdicts.get(p, "-")
            for p in sweep.properties
        ]  # fmt: skip
        consts = [str(r.row.consts[c]) for c in sweep.columns]
        t.add_row(r.row.name, *consts, str(r.row.requests), *cells, str(r.states),
                  f"{r.seconds:.1f}")  # fmt: skip
    console.print(t)


def add_sweep_arguments(sweep: Sweep, p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", type=Path, default=sweep.matrix)
    p.add_argument("--tier", choices=TIERS, default="full")
    p.add_argument("--only", action="append", default=[], help="row name (repeatable)")
    p.add_argument("--out", type=Path, default=Path("build") / sweep.command)
    p.add_argument("--json", type=Path, default=None)


def conform_command(
    sweep: Sweep, what: str, conform: str
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """(add_arguments, run) of a sweep command with `--conform` (help `what`): run runs the
    sweep, or with --conform `conform` ("module:function", imported only then: it pulls
    in the drivers) on (sweep, args)."""

    def add_arguments(p: argparse.ArgumentParser) -> None:
        add_sweep_arguments(sweep, p)
        p.add_argument("--conform", action="store_true", help=what)

    def run(args: argparse.Namespace) -> int:
        if not args.conform:
            return run_sweep(sweep, args)
        module, _, func = conform.partition(":")
        result: int = getattr(importlib.import_module(module), func)(sweep, args)
        return result

    return add_arguments, run


def run_sweep(sweep: Sweep, args: argparse.Namespace) -> int:
    console = Console(width=180)  # the table is wide; never squeeze its columns
    try:
        rows = load_sweep_matrix(sweep, args.matrix)
    except (SweepMatrixError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.only:
        missing = sorted(set(args.only) - {r.name for r in rows})
        if missing:
            print(f"error: {args.matrix}: no row named {missing}; see `kvspec {sweep.command}`",
                  file=sys.stderr)  # fmt: skip
            return 2
        rows = [r for r in rows if r.name in args.only]
    elif args.tier == "fast":
        rows = [r for r in rows if r.tier == "fast"]
    results: list[SweepResult] = []
    for i, row in enumerate(rows, 1):
        console.print(f"[{i}/{len(rows)}] {row.name}", highlight=False)
        results.append(check_sweep_row(sweep, row, args.out))
    print_table(sweep, results, console)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    bad = [r.row.name for r in results if r.unexpected]
    undecided = [r.row.name for r in results if r.inconclusive]
    console.print(
        f"{len(results)} rows, {len(bad)} with an unexpected verdict, "
        f"{len(undecided)} inconclusive (TLC timed out or failed: rerun)",
        highlight=False,
    )
    return 1 if bad or undecided else 0
