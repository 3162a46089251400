"""Trace validation of the committed real-engine recordings (conformance/recorded/), the
producer, decode and clock sides, as a table: spec events per side, seconds of mapping +
TLC per design, spec events validated per second, the designs that admit each side (the
clock's: and whether the run kept every READ safe). No engine runs.

    python bench/validate.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvspec.record.log import Event, read_dir
from kvspec.record.mapping import MappingError, producer_engines
from kvspec.validate import validate_events
from kvspec.validate_clock import validate_clock
from kvspec.validate_decode import validate_decode

RECORDED = Path(__file__).resolve().parents[1] / "conformance" / "recorded"


def _sides(events: list[Event], name: str, p: str | None, work: Path) -> list[dict[str, object]]:
    """The producer side of producer p (None: the recording's only one), its clock, and
    each decode engine that read from it."""
    rows: list[dict[str, object]] = []
    t = time.perf_counter()
    v = validate_events(events, work / "p", producer=p)
    rows.append({"recording": name, "side": "producer", "events": len(v.mapped.log),
                 "designs": len(v.designs), "s": time.perf_counter() - t,
                 "admitted": v.admitted})  # fmt: skip
    ds = v.mapped.consumers
    for c in ds if len(ds) > 1 else [None]:  # KVClock has one D: each one's share of p
        side = f"clock {c}" if c else "clock"
        t = time.perf_counter()
        try:  # the clock needs the lease, recorded since 2026-12-03
            cv = validate_clock(events, work / "c" / (c or ""), producer=p, consumer=c)
            rows.append({"recording": name, "side": side, "events": len(cv.mapped.log),
                         "designs": len(cv.designs), "s": time.perf_counter() - t,
                         "admitted": [f"{x.design.variant} ({x.safe})" for x in cv.designs
                                      if x.design.verdict == "admitted"]})  # fmt: skip
        except MappingError as exc:
            rows.append({"recording": name, "side": side, "events": 0, "designs": 0,
                         "s": 0.0, "admitted": [f"not mapped: {exc}"[:60]]})  # fmt: skip
    for c in ds:
        side = "decode" if len(ds) == 1 else f"decode {c}"
        t = time.perf_counter()
        try:
            dv = validate_decode(events, work / "d" / c, engine=c, producer=p)
        except MappingError as exc:  # recorded before the decode side could be mapped
            rows.append({"recording": name, "side": side, "events": 0, "designs": 0,
                         "s": 0.0, "admitted": [f"not mapped: {exc}"[:60]]})  # fmt: skip
            continue
        rows.append({"recording": name, "side": side, "events": len(dv.mapped.log),
                     "designs": len(dv.designs), "s": time.perf_counter() - t,
                     "admitted": dv.admitted})  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in sorted(x for x in RECORDED.iterdir() if x.is_dir()):
            events = read_dir(d)
            ps = producer_engines(events)
            for p in ps:  # xPyD: each producer, and each decode engine's share of it
                which = p if len(ps) > 1 else None
                rows += _sides(events, f"{d.name}:{p}" if which else d.name, which,
                               Path(tmp) / d.name / p)  # fmt: skip
    print(f"{'recording':26} {'side':9} {'events':>6} {'designs':>7} {'s':>6} {'ev*des/s':>9}"
          "  admitted by")
    for r in rows:
        s, n, k = float(r["s"]), int(str(r["events"])), int(str(r["designs"]))
        rate = n * k / s if s else 0.0
        print(f"{r['recording']:26} {r['side']:9} {n:6d} {k:7d} {s:6.1f} {rate:9.0f}  "
              f"{', '.join(str(x) for x in r['admitted']) or '-'}")  # type: ignore[attr-defined]
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
