"""`kvspec lease`: the lease-clock sweep. Each row of spec/lease-matrix.toml is a set of
constants for spec/LeaseClock.tla (the producer's send lease against a discrete clock, the
decode side's bounded queue wait and READ, a lossy heartbeat channel); TLC decides
NoFreeUnderRead and ExpiredReapedAtOnce (one run, -continue: every violated invariant with
its shortest counterexample) and EventuallyFreed (a second run), and each verdict is
compared with the row's expectation.

`kvspec lease [--tier fast|full] [--only NAME] [--json F] [--out DIR]`; exit 1 when a
verdict differs from its expectation, 2 on a bad matrix (one line: file, row, what to do).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvspec.itf import JSON, trace_to_itf
from kvspec.tlc import TLCResult, run_tlc

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "spec" / "LeaseClock.tla"
MATRIX = REPO / "spec" / "lease-matrix.toml"
INVARIANTS = ("NoFreeUnderRead", "ExpiredReapedAtOnce")
LIVENESS = ("EventuallyFreed",)
PROPERTIES = INVARIANTS + LIVENESS
# Constant name in LeaseClock.tla <- key in the matrix (ints; booleans and strings below).
INTS = {
    "Lease": "lease", "HbEvery": "hb_every", "Extend": "extend", "QMax": "qmax",
    "RMax": "rmax", "NMax": "nmax", "MaxLost": "max_lost", "DStall": "dstall",
}  # fmt: skip
BOOLS = {"Swallow": "swallow", "NotifFirst": "notif_first", "Abandon": "abandon"}
KEYS = {*INTS.values(), *BOOLS.values(), "reaper", "requests", "tier", "expect", "name"}
VERDICTS = ("holds", "violated")


class LeaseMatrixError(ValueError):
    """A bad lease matrix: the message is one line naming the file, the row and the fix."""


@dataclass(frozen=True)
class LeaseRow:
    name: str
    ints: dict[str, int]
    bools: dict[str, bool]
    reaper: str
    requests: int
    tier: str
    expect: dict[str, str] = field(default_factory=dict)

    def cfg_text(self, invariants: tuple[str, ...], properties: tuple[str, ...]) -> str:
        consts = [f"  {k} = {v}" for k, v in self.ints.items()]
        consts += [f"  {k} = {'TRUE' if v else 'FALSE'}" for k, v in self.bools.items()]
        consts += [f'  Reaper = "{self.reaper}"']
        consts += [f"  Reqs = {{{', '.join(str(r) for r in range(1, self.requests + 1))}}}"]
        lines = ["CONSTANTS", *consts, "SPECIFICATION Spec"]
        lines += ["INVARIANTS TypeOK " + " ".join(invariants)] if invariants else []
        lines += ["PROPERTIES " + " ".join(properties)] if properties else []
        return "\n".join(lines) + "\n"


def _row(raw: dict[str, object], defaults: dict[str, object], where: str) -> LeaseRow:
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise LeaseMatrixError(f"{where}: unknown key(s) {', '.join(unknown)}; use {sorted(KEYS)}")
    merged = {**defaults, **raw}
    ints: dict[str, int] = {}
    for const, key in INTS.items():
        v = merged.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise LeaseMatrixError(f"{where}: {key} must be a non-negative integer, got {v!r}")
        ints[const] = v
    bools: dict[str, bool] = {}
    for const, key in BOOLS.items():
        b = merged.get(key)
        if not isinstance(b, bool):
            raise LeaseMatrixError(f"{where}: {key} must be true or false, got {b!r}")
        bools[const] = b
    reaper = merged.get("reaper")
    if reaper not in ("early-break", "full-scan"):
        raise LeaseMatrixError(f'{where}: reaper must be "early-break" or "full-scan"')
    requests = merged.get("requests")
    if not isinstance(requests, int) or isinstance(requests, bool) or not 1 <= requests <= 3:
        raise LeaseMatrixError(f"{where}: requests must be 1, 2 or 3, got {requests!r}")
    tier = merged.get("tier")
    if tier not in ("fast", "full"):
        raise LeaseMatrixError(f'{where}: tier must be "fast" or "full", got {tier!r}')
    d_expect = defaults.get("expect", {})
    r_expect = raw.get("expect", {})
    if not isinstance(d_expect, dict) or not isinstance(r_expect, dict):
        raise LeaseMatrixError(f"{where}: expect must be a table {{Property = \"holds\"}}")
    expect = {str(k): str(v) for k, v in {**d_expect, **r_expect}.items()}
    bad = {k: v for k, v in expect.items() if k not in PROPERTIES or v not in VERDICTS}
    if bad:
        raise LeaseMatrixError(
            f"{where}: expect {bad} unknown; properties {PROPERTIES}, verdicts {VERDICTS}"
        )
    return LeaseRow(str(raw.get("name")), ints, bools, str(reaper), requests, str(tier), expect)


def load_lease_matrix(path: Path = MATRIX) -> list[LeaseRow]:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise LeaseMatrixError(f"{path}: {exc}; fix the TOML syntax") from None
    defaults = data.get("defaults", {})
    rows: list[LeaseRow] = []
    for i, raw in enumerate(data.get("row", [])):
        where = f"{path}: row {raw.get('name', f'#{i + 1}')!r}"
        if "name" not in raw:
            raise LeaseMatrixError(f"{where}: needs a name")
        rows.append(_row(raw, defaults, where))
    names = [r.name for r in rows]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise LeaseMatrixError(f"{path}: row names {dup} appear twice; rename one")
    return rows


@dataclass
class LeaseResult:
    row: LeaseRow
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
            "constants": {**self.row.ints, **self.row.bools},
            "reaper": self.row.reaper,
            "requests": self.row.requests,
            "verdicts": dict(self.verdicts),
            "expect": dict(self.row.expect),
            "unexpected": list(self.unexpected),
            "inconclusive": list(self.inconclusive),
            "distinct_states": self.states,
            "seconds": round(self.seconds, 2),
            "counterexample_steps": dict(self.cex_steps),
        }


def _tlc(row: LeaseRow, work: Path, tag: str, inv: tuple[str, ...], props: tuple[str, ...],
         extra: tuple[str, ...]) -> TLCResult:  # fmt: skip
    d = work / row.name / tag
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(SPEC, d / SPEC.name)
    cfg = d / "LeaseClock.cfg"
    cfg.write_text(row.cfg_text(inv, props))
    return run_tlc(d / SPEC.name, cfg, extra_args=extra, timeout_s=300, log_dir=d / "tlc")


def check_lease_row(row: LeaseRow, work: Path) -> LeaseResult:
    """TLC on one row: the invariants in one run (-continue), the liveness property in a
    second. A timed-out or failed run leaves its properties "timeout" / "error", never a
    verdict."""
    verdicts: dict[str, str] = {}
    cex_steps: dict[str, int] = {}
    inv = _tlc(row, work, "safety", INVARIANTS, (), ("-continue",))
    for prop in INVARIANTS:
        if prop in inv.violations:
            verdicts[prop] = "violated"
            trace = inv.violations[prop]
            if trace is not None:
                cex_steps[prop] = len(trace.states)
                doc = trace_to_itf(trace, source=str(SPEC), description=f"{row.name}: {prop}")
                (work / row.name / f"{prop}.itf.json").write_text(json.dumps(doc, indent=1))
        elif inv.verdict == "holds" or inv.complete:
            verdicts[prop] = "holds"
        else:
            verdicts[prop] = inv.verdict if inv.verdict in ("timeout", "error") else "error"
    live = _tlc(row, work, "liveness", (), LIVENESS, ())
    for prop in LIVENESS:
        if live.verdict == "holds":
            verdicts[prop] = "holds"
        elif live.verdict == "violated" and live.violated_property == prop:
            verdicts[prop] = "violated"
        else:
            verdicts[prop] = live.verdict if live.verdict in ("timeout", "error") else "error"
    states = max(inv.distinct_states or 0, live.distinct_states or 0)
    return LeaseResult(row, verdicts, states, inv.seconds + live.seconds, cex_steps)


def print_lease_table(results: list[LeaseResult], console: Console) -> None:
    t = Table(title="lease clock (ticks of kv_lease_duration / 6)")
    for col in ("row", "QMax", "RMax", "MaxLost", "DStall", "reqs", "reaper", *PROPERTIES,
                "states", "s"):  # fmt: skip
        t.add_column(col)
    for r in results:
        cells = [
            f"[red]{r.verdicts.get(p, '-')}[/red]" if p in r.unexpected
            else r.verdicts.get(p, "-")
            for p in PROPERTIES
        ]  # fmt: skip
        i = r.row.ints
        t.add_row(r.row.name, str(i["QMax"]), str(i["RMax"]), str(i["MaxLost"]),
                  str(i["DStall"]), str(r.row.requests), r.row.reaper, *cells,
                  str(r.states), f"{r.seconds:.1f}")  # fmt: skip
    console.print(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", type=Path, default=MATRIX)
    p.add_argument("--tier", choices=("fast", "full"), default="full")
    p.add_argument("--only", action="append", default=[], help="row name (repeatable)")
    p.add_argument("--out", type=Path, default=Path("build/lease"))
    p.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    console = Console(width=160)  # the table has 12 columns; never squeeze them
    try:
        rows = load_lease_matrix(args.matrix)
    except (LeaseMatrixError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.only:
        missing = sorted(set(args.only) - {r.name for r in rows})
        if missing:
            print(f"error: {args.matrix}: no row named {missing}; see `kvspec lease`",
                  file=sys.stderr)  # fmt: skip
            return 2
        rows = [r for r in rows if r.name in args.only]
    elif args.tier == "fast":
        rows = [r for r in rows if r.tier == "fast"]
    results: list[LeaseResult] = []
    for i, row in enumerate(rows, 1):
        console.print(f"[{i}/{len(rows)}] {row.name}", highlight=False)
        results.append(check_lease_row(row, args.out))
    print_lease_table(results, console)
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
