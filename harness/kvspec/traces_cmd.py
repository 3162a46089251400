"""`kvspec traces`: generate the conformance traces, check them against their locks.

* default: regenerate `build/traces/` if its inputs changed, print coverage per model;
* `--check`: also fail (exit 1) when a model's trace set differs from its committed lock
  (`conformance/locks/`), or a committed regression trace is no longer a spec path;
* `--lock`: rewrite the locks from the generated set (review their diff);
* `--tlc`: cross-check each row's model graph against TLC's, edge for edge (needs Java);
* `--save-regressions DIR`: keep the counterexamples `kvspec check` saved in DIR for
  conformance rows as committed regression traces.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from kvspec.drivers.reference import ReferenceDriver
from kvspec.itf import dumps
from kvspec.matrix import DEFAULT_TIERS, MatrixError, ModelRow, load_matrix
from kvspec.replay import load_trace, replay
from kvspec.statgraph import DotError, tlc_state_graph
from kvspec.traces import (
    Coverage,
    TraceError,
    generate,
    graph_from_reference,
    graph_from_tlc,
    read_coverage,
    regression_docs,
)
from kvspec.tracestore import (
    CONFORMANCE_MATRIX,
    GENERATED,
    LOCKS,
    REGRESSIONS,
    SUFFIX,
    Lock,
    TraceStoreError,
    ensure_generated,
    lock_mismatches,
    model_dir,
    read_locks,
    set_digest,
    trace_paths,
    write_locks,
)

CHECK_DIR = GENERATED.parent / "check"


def lock_of(row: ModelRow, out: Path) -> tuple[Coverage, Lock]:
    """The lock of a row's generated set, computed from the files on disk."""
    d = model_dir(out, row)
    cov = read_coverage(d)
    files = {p.name: p.read_text() for p in sorted(d.glob(f"*{SUFFIX}"))}
    return cov, Lock(row.name, row.variant, cov.edges, cov.covered, cov.traces, cov.steps,
                     set_digest(files))  # fmt: skip


def tlc_mismatch(row: ModelRow, work: Path) -> str | None:
    """None when TLC's state graph of the row equals the model's, edge for edge."""
    ours = graph_from_reference(row)
    try:
        theirs = graph_from_tlc(row, tlc_state_graph(row, work / row.name))
    except (TraceError, DotError) as exc:
        return str(exc)
    if set(ours.edges) != set(theirs.edges):
        return f"{len(set(ours.edges) ^ set(theirs.edges))} edges differ between model and TLC"
    return None


def bad_regressions(root: Path = REGRESSIONS) -> list[str]:
    """Committed regression traces that are no longer spec paths (the model rejects them)."""
    bad = []
    for p in trace_paths(root):
        try:
            t = load_trace(p)
            with ReferenceDriver(t.row) as d:
                res = replay(d, t)
        except (KeyError, ValueError) as exc:
            bad.append(f"{p}: {exc}")
            continue
        if res.failure is not None:
            bad.append(f"{p}: {res.failure.cls} at step {res.failure.step}")
    return bad


def _table(rows: list[Coverage]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="conformance traces")
    for col in ("model", "reachable edges", "edges covered", "actions covered", "traces",
                "steps"):  # fmt: skip
        t.add_column(col, justify="left" if col == "model" else "right")
    for c in rows:
        if c.skipped:
            t.add_row(c.model, "-", "-", "-", "-", "-")
            continue
        pct = 100.0 * c.covered / c.edges if c.edges else 100.0
        t.add_row(c.model, str(c.edges), f"{c.covered} ({pct:.0f}%)",
                  f"{c.actions}/{c.actions_total}", str(c.traces), str(c.steps))  # fmt: skip
    Console(width=140).print(t)
    for c in rows:
        if c.skipped:
            print(f"skipped {c.model}: {c.skipped}")


def _write_json(path: Path, rows: list[Coverage]) -> None:
    """Coverage per model, read by `kvspec review` (build/traces.json)."""
    models = {
        c.model: {
            "edges_total": c.edges, "edges_covered": c.covered, "actions_covered": c.actions,
            "actions_total": c.actions_total, "traces": c.traces, "steps": c.steps,
            "skipped": c.skipped,
        }
        for c in rows
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"models": models}, indent=1, sort_keys=True) + "\n")


def _save_regressions(rows: list[ModelRow], check_dir: Path) -> int:
    docs, notes = regression_docs(rows, check_dir)
    for note in notes:
        print(note)
    for path, doc in docs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(doc))
        print(f"saved {path.relative_to(REGRESSIONS.parents[1])}")
    if not docs:
        print(f"no counterexamples of conformance rows under {check_dir}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        rows = [r for r in load_matrix(args.matrix) if r.tier in DEFAULT_TIERS]
    except MatrixError as exc:
        print(f"kvspec traces: {exc}", file=sys.stderr)
        return 2
    if args.save_regressions is not None:
        return _save_regressions(rows, args.save_regressions)
    if args.spec_coverage is not None:
        from kvspec.spec_coverage_cmd import run_spec_coverage

        return run_spec_coverage(args.spec_coverage)
    out: Path = args.out
    if args.force and out.exists():
        shutil.rmtree(out)
    ensure_generated(generate, args.matrix, out)
    pairs = [lock_of(r, out) for r in rows]
    _table([c for c, _ in pairs])
    if args.json is not None:
        _write_json(args.json, [c for c, _ in pairs])
    problems: list[str] = []
    if args.tlc:
        work = Path(tempfile.mkdtemp(prefix="kvspec-traces-"))
        try:
            problems += [f"{r.name}: {m}" for r in rows if (m := tlc_mismatch(r, work))]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not problems:
            print(f"model graphs equal TLC's for {len(rows)} rows")
    have = {lk.model: lk for c, lk in pairs if not c.skipped}
    if args.lock:
        write_locks(have.values(), args.locks)
        print(f"wrote {len(have)} locks under {args.locks}")
    elif args.check:
        try:
            problems += lock_mismatches(have, read_locks(args.locks))
        except TraceStoreError as exc:
            print(f"kvspec traces: {exc}", file=sys.stderr)
            return 2
        problems += bad_regressions()
    if problems:
        print(f"{len(problems)} problems; if the change is intended run `kvspec traces --lock`:")
        for line in problems:
            print(f"  {line}")
        return 1
    if args.check:
        print(f"traces match their locks ({len(have)} models) and regressions replay")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", type=Path, default=CONFORMANCE_MATRIX, help="matrix TOML")
    p.add_argument("--out", type=Path, default=GENERATED, help="generated traces directory")
    p.add_argument("--locks", type=Path, default=LOCKS, help="lock files directory")
    p.add_argument("--json", type=Path, default=None, help="write coverage JSON here")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when the traces differ from their locks")  # fmt: skip
    mode.add_argument("--lock", action="store_true", help="rewrite the lock files")
    mode.add_argument("--save-regressions", type=Path, metavar="CHECK_DIR", nargs="?",
                      const=CHECK_DIR, default=None,
                      help="keep counterexamples of conformance rows from CHECK_DIR "
                      "(default build/check) as regression traces")  # fmt: skip
    mode.add_argument("--spec-coverage", type=Path, metavar="JSON", nargs="?",
                      const=Path("build/spec-coverage.json"), default=None,
                      help="per design, the spec matrix's edges the conformance traces "
                      "replay (JSON default build/spec-coverage.json)")  # fmt: skip
    p.add_argument("--tlc", action="store_true", help="cross-check model graphs with TLC's")
    p.add_argument("--force", action="store_true", help="regenerate even if fresh")
