"""How often vLLM's prefix cache hits while DecodeBlocks' traces replay on the real decode
scheduler with prefix caching on (`kvspec blocks --conform --prefix-caching`): per row,
traces, those that conform, and those in which some lookup (`get_computed_blocks`) hit,
with caching on and off. Backs the README's "Decode blocks ... with vLLM's default prefix
caching on" figures: the hits are a preempted request's recompute finding its own block.

    python bench/blocks_prefix_hits.py [--only ROW ...]

Nothing here waits on a clock: the scheduler runs in-process, one step per spec action.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

DEFAULT_ROWS = ("async-defer-preempt", "async-defer-preempt-stop", "v2pp2-defer-preempt")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=list(DEFAULT_ROWS), help="blocks-matrix rows")
    args = ap.parse_args()
    from kvspec.blocks import BLOCKS
    from kvspec.blocks_traces import conform_row, hit_counting_driver
    from kvspec.sweep import load_sweep_matrix

    rows = {r.name: r for r in load_sweep_matrix(BLOCKS)}
    table = Table("row", "caching", "traces", "conform", "traces with a hit", "hits")
    for name in args.only:
        for caching in (True, False):
            hits: list[int] = []
            with tempfile.TemporaryDirectory(prefix="kvspec-hits-") as tmp:
                res = conform_row(BLOCKS, rows[name], Path(tmp), hit_counting_driver(caching, hits))
            table.add_row(name, "on" if caching else "off", str(res.traces),
                          str(res.conforming), str(sum(1 for h in hits if h)),
                          str(sum(hits)))  # fmt: skip
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
