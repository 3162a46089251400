"""No false verdicts under load (issue #15): `pytest conformance --driver vllm` on a sample
of traces while N busy-loop processes saturate the CPU. Every wait that expires must end
as a retry and, failing that, an inconclusive (skipped) trace; never a failure.

    python bench/saturation.py [--busy 8] [--per-model 5] [--variant v0.30-shipped]

Prints a table (traces, conforming, inconclusive, diverging, wall s); exit 1 if any trace
diverged. A busy loop is `while True: pass` in its own process, killed at the end.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--busy", type=int, default=8)
    p.add_argument("--per-model", type=int, default=5)
    p.add_argument("--variant", default="v0.30-shipped")
    p.add_argument("--timeout", type=float, default=3600)
    a = p.parse_args()
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", str(ROOT / "conformance" /
             "test_conformance.py"), "--driver", "vllm", "--variant", a.variant,
             "--per-model", str(a.per_model), "-p", "no:cacheprovider"],
            capture_output=True, text=True, timeout=a.timeout, cwd=ROOT,
        )  # fmt: skip
    finally:
        for lp in loops:
            lp.kill()
            lp.wait()
    wall = time.monotonic() - t0
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""

    def count(word: str) -> int:
        m = re.search(rf"(\d+) {word}", tail)
        return int(m.group(1)) if m else 0

    passed, skipped, failed = count("passed"), count("skipped"), count("failed")
    print(f"{'busy':>4} {'traces':>6} {'conforming':>10} {'inconclusive':>12} {'diverging':>9} "
          f"{'wall s':>7}")
    print(f"{a.busy:4d} {passed + skipped + failed:6d} {passed:10d} {skipped:12d} {failed:9d} "
          f"{wall:7.0f}")
    if failed:
        print(out.stdout[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
