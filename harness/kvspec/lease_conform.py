"""`kvspec lease --conform`: the LeaseClock rows' edge-covering traces on vLLM's real lease
code (kvspec.lease_traces), one table row per matrix row; vLLM's log goes to a file."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvspec.drivers.prefix_layout import LAYOUTS
from kvspec.drivers.vllm_env import DriverUnavailable
from kvspec.drivers.vllm_logging import vllm_logs
from kvspec.lease_traces import LeaseConformance, conform_row, lease_driver_factory
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


Conform = Callable[[Sweep, SweepRow, Path], LeaseConformance]


def run_conform_rows(
    sweep: Sweep,
    args: argparse.Namespace,
    conform: Conform,
    title: str = "LeaseClock traces on vLLM's real lease code",
    not_driven: Callable[[SweepRow], str | None] = lambda _row: None,
    layout: str | None = None,
) -> int:
    """Replay each selected row's traces (`conform`), one line per row as it ends, then
    the table; rows `not_driven` names are listed with the reason and skipped. `layout`
    (the producer's, prefix_layout.py) goes into the title and every JSON row."""
    if layout is not None:
        title += f", {layout} layout"
    try:
        rows = _rows(sweep, args)
    except (SweepMatrixError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console = Console(width=140)
    results: list[LeaseConformance] = []
    with vllm_logs(f"{sweep.command}-conform", False) as log:
        console.print(f"vLLM's log: {log}", highlight=False)
        for i, row in enumerate(rows, 1):
            why = not_driven(row)
            note = f": not driven ({why})" if why else ""
            console.print(f"[{i}/{len(rows)}] {row.name}{note}", highlight=False)
            if why:
                continue
            try:
                got = conform(sweep, row, args.out / "conform")
            except DotError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            except DriverUnavailable as exc:
                console.print(f"  not driven: {exc}", highlight=False)
                continue
            results.append(got)
            console.print(f"  {got.summary()}", highlight=False)
    print_results(results, console, title)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tag = {} if layout is None else {"layout": layout}
        rows_json = [r.to_json() | tag for r in results]
        args.json.write_text(json.dumps(rows_json, indent=1) + "\n")
    return 1 if any(r.divergences for r in results) else 0


def run_lease_conform(sweep: Sweep, args: argparse.Namespace) -> int:
    """`kvspec lease --conform [--layout L]`: P's prompts and prefix caching laid out as L."""
    layout = args.layout
    make = lease_driver_factory(LAYOUTS[layout])
    return run_conform_rows(
        sweep, args, lambda s, r, w: conform_row(s, r, w, make), layout=layout
    )  # fmt: skip
