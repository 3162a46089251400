"""`kvspec lease --conform`: the LeaseClock rows' edge-covering traces on vLLM's real lease
code (kvspec.lease_traces), one table row per matrix row; vLLM's log goes to a file."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from kvspec.drivers.vllm_env import vllm_logs
from kvspec.lease_traces import LeaseConformance, conform_row
from kvspec.statgraph import DotError
from kvspec.sweep import Sweep, SweepMatrixError, SweepRow, load_sweep_matrix


def _rows(sweep: Sweep, args: argparse.Namespace) -> list[SweepRow]:
    rows = load_sweep_matrix(sweep, args.matrix)
    if args.only:
        missing = sorted(set(args.only) - {r.name for r in rows})
        if missing:
            raise SweepMatrixError(f"{args.matrix}: no row named {missing}; see `kvspec lease`")
        return [r for r in rows if r.name in args.only]
    return [r for r in rows if args.tier == "full" or r.tier == "fast"]


def print_results(
    results: list[LeaseConformance],
    console: Console,
    title: str = "LeaseClock traces on vLLM's real lease code",
) -> None:
    table = Table(title=title)
    cols = ("row", "edges", "traces", "conforming", "inconclusive", "diverging", "not driven")
    for col in cols:
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in results:
        table.add_row(
            r.row, str(r.edges), str(r.traces), str(r.conforming),
            str(len(r.inconclusive)), str(len(r.divergences)), str(len(r.not_driven)),
        )  # fmt: skip
    console.print(table)
    for r in results:
        for line in r.divergences[:3] + r.inconclusive[:3]:
            console.print(f"  {line}", highlight=False)


def run_lease_conform(sweep: Sweep, args: argparse.Namespace) -> int:
    try:
        rows = _rows(sweep, args)
    except (SweepMatrixError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console = Console(width=140)
    results: list[LeaseConformance] = []
    with vllm_logs("lease-conform", False) as log:
        console.print(f"vLLM's log: {log}", highlight=False)
        for i, row in enumerate(rows, 1):
            console.print(f"[{i}/{len(rows)}] {row.name}", highlight=False)
            try:
                results.append(conform_row(sweep, row, args.out / "conform"))
            except DotError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
    print_results(results, console)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    return 1 if any(r.divergences for r in results) else 0
