"""`kvspec check`: model-check every matrix row and compare each verdict with its expectation.

Per row, TLC runs as few times as the verdicts allow:
* joint: one run with every invariant expected to hold and every temporal property expected
  to hold, or, where none is, the first one expected to be violated. A liveness run
  explores the whole state graph anyway, so checking the invariants in it costs almost
  nothing and saves a JVM and a second exploration. It runs with `-lncheck final`: the
  temporal properties are checked once, on the complete state space, after a BFS in which
  every invariant was checked in every state. So it decides all of them when it passes,
  and also when the one property expected to be violated is (`TLCResult.complete`). Any
  other outcome decides them all again the per-property way below, so an unexpected
  verdict is always found by a run of its own (a timeout is the exception: the temporal
  properties keep it, and only the invariants are run again);
* safety: one run with every invariant expected to hold and still undecided; a violated one
  is recorded (with its counterexample) and dropped, and TLC runs again until the rest hold;
* violations: one `-continue` run with every invariant expected to be violated (vacuity
  guards, known-bad designs), stopped as soon as TLC has reported each of them with a
  counterexample (`kvspec.tlc_continue`: TLC names a violating state after the first of
  the cfg's invariants it violates, so one not named by a finished run is run again).
  Invariants expected to hold stay out of it: deciding them needs the whole state space,
  where `-continue` prints a trace for every violating state (most states, for a guard);
* liveness: one run with every temporal property expected to hold (if it passes, all
  hold); TLC 2.15 does not name the temporal property it refutes, so a property expected
  to be violated, or a joint run that fails, is checked on its own.
Rows start longest first, two runs at a time (2 cores here). One failing row never hides
the others: an error is a verdict of its own and the table still prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvspec import itf
from kvspec.codec import from_itf
from kvspec.diagram import render_steps
from kvspec.itf import JSON
from kvspec.matrix import (
    DEFAULT_MATRIX,
    INVARIANTS,
    REACHABILITY,
    SPEC_FILE,
    TEMPORAL,
    MatrixError,
    ModelRow,
    load_matrix,
)
from kvspec.model import Model, pipeline_depth
from kvspec.tlc import TLCResult, Trace, run_tlc
from kvspec.tlc_continue import reported
from kvspec.tools import QUICK_JVM

REPO = SPEC_FILE.parents[1]
DEFAULT_OUT = REPO / "build" / "check"
TIMEOUT_S = float(os.environ.get("KVSPEC_CHECK_TIMEOUT", "600"))


@dataclass
class PropertyResult:
    model: ModelRow
    prop: str
    expected: str
    verdict: str  # holds | violated | error | timeout
    distinct_states: int | None
    seconds: float
    counterexample: dict[str, JSON] | None = None
    error: str | None = None
    log_path: str | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == self.expected

    def to_json(self) -> dict[str, JSON]:
        return {
            **self.model.to_meta(),
            "property": self.prop,
            "expected": self.expected,
            "verdict": self.verdict,
            "distinct_states": self.distinct_states,
            "seconds": round(self.seconds, 2),
            "counterexample": self.counterexample,
            "error": self.error,
            "log": self.log_path,
        }


class Runner(Protocol):
    """One TLC run of `row` with these invariants and temporal properties, its cfg and logs
    under `work`; `every_violation`: in `-continue` mode, stopped once each invariant has
    been reported violated (`TLCResult.violations`). A parameter of every check function
    so that tests decide TLC's verdicts (a timeout, say) by construction."""

    def __call__(
        self, row: ModelRow, invariants: list[str], properties: list[str], work: Path,
        *, every_violation: bool = False,
    ) -> TLCResult: ...  # fmt: skip


@dataclass(frozen=True)
class TLCRunner:
    """The `Runner` that model-checks."""

    timeout_s: float = TIMEOUT_S
    jvm_flags: tuple[str, ...] | None = QUICK_JVM

    def __call__(
        self, row: ModelRow, invariants: list[str], properties: list[str], work: Path,
        *, every_violation: bool = False,
    ) -> TLCResult:  # fmt: skip
        work.mkdir(parents=True, exist_ok=True)
        tag = ("joint" if properties else "safety") if invariants else "-".join(properties)
        tag = "violations" if every_violation else tag
        cfg = work / f"{tag}.cfg"
        cfg.write_text(row.cfg_text(invariants, properties))
        # Joint runs check liveness once, on the complete graph (-lncheck final): a temporal
        # violation is then found only after the BFS checked every invariant everywhere
        # (check_joint relies on it), and no time goes to checks of partial graphs.
        joint = ["-lncheck", "final"] if invariants and properties else []
        extra = ["-continue"] if every_violation else joint
        return run_tlc(
            SPEC_FILE, cfg, deadlock=False, timeout_s=self.timeout_s, log_dir=work / "tlc",
            fp=0, seed=0, extra_args=extra, stop=reported(invariants) if every_violation else None,
            jvm_flags=self.jvm_flags,
        )  # fmt: skip


TLC = TLCRunner()


def _counterexample(row: ModelRow, trace: Trace | None, prop: str) -> dict[str, JSON] | None:
    """TLC's counterexample as ITF, self-describing: the row's constants and the property
    in `#meta`, and each step's action instance ("lease_expire(1, 0)"), which TLC 2.15
    does not print (it names the operator only; `Model.label_path` recovers the rest)."""
    if trace is None:
        return None
    doc = itf.trace_to_itf(trace, source=str(SPEC_FILE.relative_to(REPO)), description=prop)
    doc["#meta"].update(row.to_meta(), property=prop)
    states = doc["states"]
    names = [str(st["#meta"]["action"]) for st in states[1:]]
    try:
        labels = Model(row).label_path([from_itf(row, st) for st in states], names)
    except ValueError:
        # The model cannot explain a step (it disagrees with the spec, which
        # test_reference_graph would catch): keep TLC's operator names, still a verdict.
        labels = []
    for st, a in zip(states[1:], labels, strict=False):
        st["#meta"]["action"] = str(a)
    states[0]["#meta"]["action"] = "init"
    return doc


def _decided(
    row: ModelRow, props: Sequence[str], res: TLCResult, verdict: str,
    cex: dict[str, JSON] | None = None,
) -> list[PropertyResult]:  # fmt: skip
    """`props` got `verdict` from TLC's run `res` (holds, or violated with counterexample)."""
    return [
        PropertyResult(row, p, row.expect[p], verdict, res.distinct_states, res.seconds,
                       counterexample=cex, log_path=str(res.log_path))
        for p in props
    ]  # fmt: skip


def _failed(row: ModelRow, props: Sequence[str], res: TLCResult) -> list[PropertyResult]:
    """`props` got no verdict from `res` (an error or timeout, or one TLC cannot name)."""
    verdict = res.verdict if res.verdict in ("error", "timeout") else "error"
    error = res.error or f"TLC verdict {res.verdict}; raw log: {res.log_path}"
    return [
        PropertyResult(row, p, row.expect[p], verdict, res.distinct_states, res.seconds,
                       error=error, log_path=str(res.log_path))
        for p in props
    ]  # fmt: skip


def _expected(row: ModelRow, props: Sequence[str], verdict: str) -> list[str]:
    return [p for p in props if row.expect.get(p) == verdict]


def check_joint(
    row: ModelRow, work: Path, run: Runner = TLC
) -> tuple[list[PropertyResult], list[str]]:
    """The joint run (module docstring): its results, and the properties still to decide."""
    every = [p for p in INVARIANTS + REACHABILITY + TEMPORAL if p in row.expect]
    invariants = _expected(row, INVARIANTS + REACHABILITY, "holds")
    hold = _expected(row, TEMPORAL, "holds")
    temporal = hold or _expected(row, TEMPORAL, "violated")[:1]
    if not invariants or not temporal:
        return [], every
    res = run(row, invariants, temporal, work)
    rest = [p for p in every if p not in invariants + temporal]
    if res.verdict == "timeout":
        # Checking the temporal properties alone costs at least what the joint run did, so
        # running them again would only double the wait: they time out here, and only the
        # invariants (a cheaper safety run) are decided again.
        return _failed(row, temporal, res), invariants + rest
    if res.verdict == "holds":
        return _decided(row, invariants + temporal, res, "holds"), rest
    if not hold and res.verdict == "violated" and res.complete and not res.violations:
        # The one temporal property (expected violated) is, in the complete state space:
        # TLC got there after a BFS that found no invariant violated (-lncheck final).
        cex = _counterexample(row, res.counterexample, temporal[0])
        return _decided(row, invariants, res, "holds") + _decided(
            row, temporal, res, "violated", cex
        ), rest
    return [], every


def check_safety(
    row: ModelRow, work: Path, only: Sequence[str] | None = None, run: Runner = TLC
) -> list[PropertyResult]:
    props = [p for p in INVARIANTS + REACHABILITY if p in row.expect]
    props = [p for p in props if only is None or p in only]
    hold, bad = _expected(row, props, "holds"), _expected(row, props, "violated")
    return _check_hold(row, hold, work, run) + _check_violated(row, bad, work, run)


def _check_hold(row: ModelRow, pending: list[str], work: Path, run: Runner) -> list[PropertyResult]:
    """The safety run (module docstring), again after each violation."""
    out: list[PropertyResult] = []
    while pending:
        res = run(row, pending, [], work)
        if res.verdict == "holds":
            return out + _decided(row, pending, res, "holds")
        prop = res.violated_property
        if res.verdict != "violated" or prop is None or prop not in pending:
            return out + _failed(row, pending, res)
        cex = _counterexample(row, res.counterexample, prop)
        out += _decided(row, [prop], res, "violated", cex)
        pending = [p for p in pending if p != prop]
    return out


def _check_violated(
    row: ModelRow, pending: list[str], work: Path, run: Runner
) -> list[PropertyResult]:
    """The violations run (module docstring), again for any invariant it did not name."""
    out: list[PropertyResult] = []
    while pending:
        res = run(row, pending, [], work, every_violation=True)
        if res.verdict == "holds":  # a finished run that reported nothing: none is violated
            return out + _decided(row, pending, res, "holds")
        named = [p for p in res.violations if p in pending]
        if res.verdict != "violated" or not named:
            return out + _failed(row, pending, res)
        for prop in named:
            cex = _counterexample(row, res.violations[prop], prop)
            out += _decided(row, [prop], res, "violated", cex)
        # Each run names at least one more, so this ends; a name missing from a finished
        # run may be violated only where an invariant listed before it also is.
        pending = [p for p in pending if p not in named]
    return out


def _temporal_one(row: ModelRow, prop: str, work: Path, run: Runner) -> PropertyResult:
    res = run(row, [], [prop], work)
    if res.verdict == "holds":
        return _decided(row, [prop], res, "holds")[0]
    if res.verdict == "violated":
        cex = _counterexample(row, res.counterexample, prop)
        return _decided(row, [prop], res, "violated", cex)[0]
    return _failed(row, [prop], res)[0]


def check_liveness(
    row: ModelRow, work: Path, only: Sequence[str] | None = None, run: Runner = TLC
) -> list[PropertyResult]:
    props = [p for p in TEMPORAL if p in row.expect and (only is None or p in only)]
    hold = [p for p in props if row.expect[p] == "holds"]
    out: list[PropertyResult] = []
    if len(hold) > 1:
        res = run(row, [], hold, work)
        if res.verdict == "holds":
            out += _decided(row, hold, res, "holds")
            hold = []
        elif res.verdict != "violated":
            out += _failed(row, hold, res)
            hold = []
    for prop in props:
        if prop in hold or row.expect[prop] == "violated":
            out.append(_temporal_one(row, prop, work, run))
    return out


def check_row(row: ModelRow, out_dir: Path, run: Runner = TLC) -> list[PropertyResult]:
    work = out_dir / row.name
    joint, rest = check_joint(row, work, run)
    results = joint + check_safety(row, work, rest, run) + check_liveness(row, work, rest, run)
    order = {p: i for i, p in enumerate(INVARIANTS + TEMPORAL + REACHABILITY)}
    return sorted(results, key=lambda r: order[r.prop])


def save_counterexamples(results: list[PropertyResult], out_dir: Path) -> None:
    for res in results:
        if res.counterexample is not None:
            path = out_dir / res.model.name / f"{res.prop}.itf.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(itf.dumps(res.counterexample))


# Measured: the delaying child (HF3FS) multiplies the states of a NIXL row by 3 to 80 (its
# store tables); the upstream child's job accounting by ~12 (1,423 vs 117 reachable edges
# for the one-request PCP 2 conformance rows).
_COMPOSITION_COST = {
    "nixl": 1.0,
    "multi-nixl-offload-upstream": 12.0,
    "multi-nixl-hf3fs": 20.0,
}


def estimated_cost(row: ModelRow) -> float:
    """A rough relative cost of checking `row`, for scheduling only. Two TLC jobs on two
    cores finish when the longest row does; started last in matrix order, the TP2 x PCP2
    delaying row alone kept the default matrix ~20 s over its target, so rows are started
    longest first (LPT). Measured: state counts grow with ranks, requests, the delaying
    child's store tables and each extra pipelined step (async scheduling: 3.5x the states
    of the synchronous twin for NIXL, up to 10x with the delaying child)."""
    ranks = row.topology.tp * row.topology.pp * row.topology.pcp
    comp = _COMPOSITION_COST[row.composition]
    return ranks**2 * comp * row.requests * 3.5 ** (pipeline_depth(row) - 1)


def run_check(
    rows: list[ModelRow],
    *,
    json_out: Path | None = None,
    out_dir: Path = DEFAULT_OUT,
    progress: bool = True,
    jobs: int = 2,
    on_row: Callable[[ModelRow, list[PropertyResult]], None] | None = None,
    run: Runner = TLC,
) -> dict[str, JSON]:
    """Check every row; returns the results JSON (also written to json_out)."""
    from rich.progress import Progress

    out_dir.mkdir(parents=True, exist_ok=True)
    all_results: dict[str, list[PropertyResult]] = {}
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("model checking", total=len(rows))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            longest_first = sorted(rows, key=estimated_cost, reverse=True)
            futures = {pool.submit(check_row, row, out_dir, run): row for row in longest_first}
            for fut in futures:
                row = futures[fut]
                res = fut.result()
                all_results[row.name] = res
                save_counterexamples(res, out_dir)
                if on_row is not None:
                    on_row(row, res)
                bar.advance(task)
    ordered = [r for row in rows for r in all_results[row.name]]
    doc = {"tlc": _tlc_version(ordered), "results": [r.to_json() for r in ordered]}
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def _tlc_version(results: list[PropertyResult]) -> str:
    for res in results:
        if res.log_path:
            try:
                text = Path(res.log_path).read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("TLC2 Version"):
                    return line.strip()
    return "unknown"


def print_table(doc: dict[str, JSON]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvspec check ({doc['tlc']})")
    for col in ("model", "property", "expected", "verdict", "distinct states", "seconds"):
        table.add_column(col, justify="right" if col in ("distinct states", "seconds") else "left")
    for r in doc["results"]:
        mark = "" if r["verdict"] == r["expected"] else " [bold red]MISMATCH[/]"
        style = "green" if r["verdict"] == "holds" else "yellow"
        if r["verdict"] in ("error", "timeout"):
            style = "red"
        table.add_row(
            r["model"],
            r["property"],
            r["expected"],
            f"[{style}]{r['verdict']}[/]{mark}",
            str(r["distinct_states"] if r["distinct_states"] is not None else "-"),
            f"{r['seconds']:.1f}",
        )
    Console(width=140).print(table)


def add_check_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check", help="model-check the matrix against expected verdicts")
    p.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="matrix TOML file")
    p.add_argument("--only", action="append", default=[], help="run only this model (repeat)")
    p.add_argument("--tier", default=None, help="run only rows of this tier (default: all)")
    p.add_argument("--json", type=Path, default=None, help="write results JSON here")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="counterexamples go here")
    p.add_argument("--jobs", type=int, default=2, help="TLC runs at once")
    p.add_argument("--quiet", action="store_true", help="no counterexample renderings")
    p.add_argument(
        "--jit",
        choices=("c1", "c2"),
        default="c1",
        help="JVM compiler: c1 (default, short runs) or c2 (rows that explore for minutes)",
    )
    p.set_defaults(handler=_check_cmd)


def _check_cmd(args: argparse.Namespace) -> int:
    try:
        rows = load_matrix(args.matrix)
        if args.only:
            known = {r.name for r in rows}
            missing = [n for n in args.only if n not in known]
            if missing:
                raise MatrixError(f"{args.matrix}: no model named {missing[0]!r}; see --matrix")
            rows = [r for r in rows if r.name in args.only]
        if args.tier:
            rows = [r for r in rows if r.tier == args.tier]
    except MatrixError as exc:
        print(f"kvspec check: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    doc = run_check(
        rows,
        json_out=args.json or args.out / "results.json",
        out_dir=args.out,
        jobs=args.jobs,
        progress=sys.stderr.isatty(),
        run=TLC if args.jit == "c1" else TLCRunner(jvm_flags=None),
    )
    print_table(doc)
    if not args.quiet:
        for r in doc["results"]:
            if r["counterexample"] is not None:
                print(f"\n{r['model']} / {r['property']} ({r['verdict']}):")
                for line in render_steps(r["counterexample"]):
                    print("  " + line)
    bad = [r for r in doc["results"] if r["verdict"] != r["expected"]]
    errors = [r for r in doc["results"] if r["verdict"] in ("error", "timeout")]
    for r in errors:
        print(f"kvspec check: {r['model']}/{r['property']}: {r['error']}", file=sys.stderr)
    print(
        f"\n{len(doc['results'])} verdicts, {len(bad)} unexpected, "
        f"{time.monotonic() - start:.1f} s wall"
    )
    if errors:
        return 2
    return 1 if bad else 0
