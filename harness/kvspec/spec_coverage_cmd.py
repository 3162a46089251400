"""`kvspec traces --spec-coverage`: the table and JSON of kvspec.spec_coverage."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvspec.matrix import load_matrix
from kvspec.replay import load_trace
from kvspec.spec_coverage import by_design, row_coverage
from kvspec.traces import trace_files


def run_spec_coverage(json_out: Path) -> int:
    cov = row_coverage(load_matrix(), [load_trace(p) for p in trace_files()])
    table = Table(title="spec matrix edges (rows with <= 2 requests) replayed by conformance")
    for col in ("design", "rows", "rows fully covered", "edges", "covered", "%"):
        table.add_column(col, justify="left" if col == "design" else "right")
    designs = by_design(cov)
    for d, (rows, full, edges, covered) in designs.items():
        pct = f"{100 * covered / edges:.1f}" if edges else "-"
        table.add_row(d, str(rows), str(full), str(edges), str(covered), pct)
    Console(width=120).print(table)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"rows": [c.to_json() for c in cov],
           "designs": {d: dict(zip(("rows", "full", "edges", "covered"), v, strict=True))
                       for d, v in designs.items()}}  # fmt: skip
    json_out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
