"""Driver throughput: steps/s, setup seconds per trace, peak RSS (printed table, no asserts).

Runs random walks (actions chosen from the reference model's enabled set, so both drivers
take the same steps) on a few matrix-like rows, for the reference and the vLLM driver.
Usage: python bench/bench_drivers.py [--walks N] [--depth D]
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from kvspec.drivers.base import Driver
from kvspec.drivers.reference import ReferenceDriver
from kvspec.matrix import ModelRow, Topology

ROWS = [
    ("nixl", 1, 2, 1, "v0.30-shipped", None),
    ("nixl", 2, 3, 2, "v0.30-shipped", None),
    ("multi-nixl-hf3fs", 2, 2, 2, "fixed", "fix-53903"),
]


def _row(comp: str, pcp: int, n: int, cap: int, variant: str) -> ModelRow:
    return ModelRow("bench", variant, comp, Topology(1, 1, pcp), n, cap, False)


def _walk(rw: ModelRow, d: Driver, seed: int, depth: int) -> int:
    ref = ReferenceDriver(rw)
    rng = random.Random(seed)
    n = 0
    for _ in range(depth):
        acts = ref.enabled()
        if not acts:
            break
        a = rng.choice(acts)
        ref.step(a)
        if d is not ref:
            d.step(a)
        d.observe()
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--walks", type=int, default=20)
    ap.add_argument("--depth", type=int, default=30)
    args = ap.parse_args()
    from kvspec.drivers.vllm_logging import vllm_logs

    # vLLM's and NIXL's own log lines go to build/logs/bench-<time>.log, as for conform.
    with vllm_logs("bench") as log:
        print(f"vLLM's log: {log}")
        _bench(args.walks, args.depth)


def _bench(walks: int, depth: int) -> None:
    from kvspec.drivers.vllm_driver import VllmDriver

    print("first setup of the first vllm row includes importing vLLM (once per process);")
    print("vllm steps/s includes stepping the reference that picks the actions")
    print(f"{'driver':10} {'row':42} {'first setup s':>13} {'setup s/trace':>13} {'steps/s':>9}")
    for comp, pcp, n, cap, variant, patch in ROWS:
        rw = _row(comp, pcp, n, cap, variant)
        label = f"{comp} pcp={pcp} n={n} cap={cap}" + (f" +{patch}" if patch else "")
        for kind in ("reference", "vllm"):
            setups: list[float] = []
            steps, run_s = 0, 0.0
            for seed in range(walks):
                t = time.perf_counter()
                d: Driver = (
                    ReferenceDriver(rw) if kind == "reference" else VllmDriver(rw, impl_patch=patch)
                )
                setups.append(time.perf_counter() - t)
                t = time.perf_counter()
                steps += _walk(rw, d, seed, depth)
                run_s += time.perf_counter() - t
                d.close()
            later = setups[1:] or setups
            print(
                f"{kind:10} {label:42} {setups[0]:13.3f} {sum(later) / len(later):13.4f}"
                f" {steps / run_s:9.0f}"
            )
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {rss_mb:.0f} MiB")


if __name__ == "__main__":
    main()
