"""Conformance replay throughput: traces/s and steps/s per driver, over the conformance traces.

Usage: .venv/bin/python bench/bench_conformance.py [--driver reference|vllm|all] [--limit N]
"""

from __future__ import annotations

import argparse
import time

from kvspec.conform import driver_factory
from kvspec.replay import load_trace, replay_fresh
from kvspec.traces import trace_files


def bench(name: str, limit: int | None) -> tuple[int, int, float, int, int] | str:
    """(traces, steps, seconds, failures, inconclusive): one attempt per trace, no retry,
    so a wait that expired under load shows as inconclusive rather than being hidden."""
    try:
        factory = driver_factory(name)
    except ImportError as exc:
        return f"unavailable: {exc}"
    traces = [load_trace(p) for p in trace_files()][:limit]
    steps = failures = inconclusive = 0
    t0 = time.perf_counter()
    for t in traces:
        r = replay_fresh(factory, t)
        steps += r.steps
        failures += r.failure is not None
        inconclusive += r.timeout is not None
    return len(traces), steps, time.perf_counter() - t0, failures, inconclusive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", choices=("reference", "vllm", "all"), default="all")
    ap.add_argument("--limit", type=int, default=None, help="first N traces only")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    table = Table(title="conformance replay")
    cols = ("driver", "traces", "steps", "seconds", "traces/s", "steps/s", "failures",
            "inconclusive")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "driver" else "right")
    for name in ("reference", "vllm") if args.driver == "all" else (args.driver,):
        res = bench(name, args.limit)
        if isinstance(res, str):
            table.add_row(name, "-", "-", "-", "-", "-", res, "-")
            continue
        n, steps, secs, fails, timeouts = res
        table.add_row(name, str(n), str(steps), f"{secs:.2f}", f"{n / secs:.1f}",
                      f"{steps / secs:.0f}", str(fails), str(timeouts))  # fmt: skip
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
