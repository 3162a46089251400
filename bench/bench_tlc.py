"""Benchmark: run_tlc overhead over bare TLC, and TLC-output parser throughput.

Prints numbers only (no timed assertions). Run: python bench/bench_tlc.py
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvspec.jar import jar_path, java_path
from kvspec.tlc import parse_messages, parse_trace, run_tlc
from kvspec.tlcvalue import ModelValue, Record, Value, state_to_tla

SPEC = """---- MODULE BenchSmall ----
EXTENDS Naturals
VARIABLE x
Init == x = 0
Next == x < 200 /\\ x' = x + 1
====
"""
CFG = "INIT Init\nNEXT Next\n"
REPEATS = 5
N_STATES = 10_000


def median_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_overhead(workdir: Path) -> tuple[float, float]:
    (workdir / "BenchSmall.tla").write_text(SPEC)
    (workdir / "BenchSmall.cfg").write_text(CFG)
    java, jar = java_path(), str(jar_path())
    counter = iter(range(1_000_000))

    def bare() -> None:
        md = workdir / f"md{next(counter)}"
        subprocess.run(
            [java, "-XX:+UseParallelGC", "-cp", jar, "tlc2.TLC", "-deadlock", "-metadir",
             str(md), "BenchSmall.tla"],
            cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300,
            check=False,
        )  # fmt: skip

    def wrapped() -> None:
        r = run_tlc(workdir / "BenchSmall.tla", deadlock=False, log_dir=workdir / "runs")
        assert r.verdict == "holds", r.error

    bare()  # warm the page cache / CDS archive once for both
    return median_time(bare), median_time(wrapped)


def synthetic_trace_output(n: int) -> str:
    """A -tool trace of ``n`` states with records, sets, sequences and model values."""
    parts = []
    for i in range(1, n + 1):
        state: dict[str, Value] = {
            "step": i,
            "req": Record.of({"id": i, "owner": ModelValue(f"w{i % 4}"), "done": i % 2 == 0}),
            "pending": frozenset(range(i % 7)),
            "log": tuple(f"ev{j}" for j in range(i % 5)),
        }
        header = (
            "<Initial predicate>"
            if i == 1
            else "<Next line 5, col 9 to line 5, col 27 of module M>"
        )
        parts.append(
            f"@!@!@STARTMSG 2217:4 @!@!@\n{i}: {header}\n{state_to_tla(state)}\n\n"
            "@!@!@ENDMSG 2217 @!@!@\n"
        )
    return "".join(parts)


def bench_parser() -> tuple[float, int]:
    text = synthetic_trace_output(N_STATES)

    def parse() -> int:
        messages, _ = parse_messages(text)
        trace = parse_trace(messages)
        assert trace is not None
        return len(trace.states)

    seconds = median_time(parse, 3)
    return seconds, len(text)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvspec-bench-") as tmp:
        bare, wrapped = bench_overhead(Path(tmp))
    parse_s, size = bench_parser()
    rows = [
        ("bare java tlc2.TLC (median of 5)", f"{bare:.3f} s"),
        ("run_tlc (median of 5)", f"{wrapped:.3f} s"),
        ("overhead ratio run_tlc / bare", f"{wrapped / bare:.3f}x"),
        (f"parse {N_STATES} trace states ({size / 1e6:.1f} MB)", f"{parse_s:.3f} s"),
        ("parser throughput", f"{N_STATES / parse_s:,.0f} states/s"),
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="kvspec TLC wrapper benchmark")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    except ImportError:
        for name, value in rows:
            print(f"{name:50} {value}")


if __name__ == "__main__":
    main()
