"""`kvspec blocks --offload-probe [--json F]`: which DecodeBlocks `Offload` design the
installed vLLM's OffloadingConnector implements on a decode engine (vLLM #46951), read off
the real classes by driving the race step of the spec's counterexample
(drivers.offload_fence) in two engines: synchronous with prefix caching off (the kept
counterexample's row) and vLLM's defaults (async scheduling, prefix caching on); and
whether that is the design the matrix gives this release (blocks_traces.offload_fence_of).
Exit 0 when they agree, 1 when they differ or the probe could not decide (never a design
then), 2 when no vLLM is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

# (name, batches in flight, prefix caching): the kept counterexample's engine, and the one
# vLLM runs by default (async scheduling: AsyncScheduler, two batches; prefix caching on)
ENGINES = (("sync", 1, False), ("async+prefix-caching", 2, True))


def run_offload_probe(args: argparse.Namespace) -> int:
    from kvspec.blocks_traces import offload_fence_of
    from kvspec.conform import installed_vllm

    console = Console(highlight=False)
    version = installed_vllm()
    if version == "not installed":
        print("error: no vLLM installed here; run `make venv-vllm` first", file=sys.stderr)
        return 2
    from kvspec.drivers.offload_fence import probe
    from kvspec.drivers.vllm_env import DriverUnavailable
    from kvspec.drivers.vllm_logging import vllm_logs

    want = offload_fence_of(version)
    doc: dict[str, object] = {"vllm": version, "expected": want}
    seen: dict[str, object] = {}
    designs: set[str | None] = set()
    with vllm_logs("offload-probe") as log:
        for name, batches, caching in ENGINES:
            try:
                got = probe(batches=batches, prefix_caching=caching)
            except DriverUnavailable as exc:
                seen[name] = {"design": None, "undecided": str(exc)}
                designs.add(None)
                console.print(f"vLLM {version}, {name}: undecided: {exc}")
                continue
            seen[name] = {"design": got.design, "flushed": got.flushed,
                          "store_blocks": sorted(got.store_blocks),
                          "load_blocks": sorted(got.load_blocks)}  # fmt: skip
            designs.add(got.design)
            console.print(got.line(version, name))
    design = next(iter(designs)) if len(designs) == 1 else None
    doc |= {"design": design, "engines": seen}
    if design is None:
        why = [str(d.get("undecided")) for d in seen.values() if isinstance(d, dict)
               and d.get("undecided")] or [  # fmt: skip
            "the engines disagree: " + ", ".join(
                f"{k}: {d['design']}" for k, d in seen.items() if isinstance(d, dict))]
        doc["undecided"] = "; ".join(why)
    else:
        verdict = "as the matrix says" if design == want else f"the matrix says {want!r}"
        console.print(f"  {verdict}")
    if log is not None:
        console.print(f"  vLLM's log: {log}")
    out: Path | None = args.json
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if design == want else 1
