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
from kvspec.record.mapping import MappingError, Sides, validation_sides
from kvspec.validate import validate_events
from kvspec.validate_clock import validate_clock
from kvspec.validate_decode import validate_decode

RECORDED = Path(__file__).resolve().parents[1] / "conformance" / "recorded"


def _rows(events: list[Event], name: str, s: Sides, work: Path) -> list[dict[str, object]]:
    """One producer's sides (mapping.validation_sides): its producer side, its clock (per
    decode engine's share where it feeds several), each decode engine's share of it."""
    rows: list[dict[str, object]] = []
    t = time.perf_counter()
    v = validate_events(events, work / "p", producer=s.producer)
    rows.append({"recording": name, "side": "producer", "events": len(v.mapped.log),
                 "designs": len(v.designs), "s": time.perf_counter() - t,
                 "admitted": v.admitted})  # fmt: skip
    for c in s.clocks:
        side = f"clock {c}" if c else "clock"
        t = time.perf_counter()
        try:  # the clock needs the lease, recorded since 2026-12-03
            cv = validate_clock(events, work / "c" / (c or ""), producer=s.producer, consumer=c)
            rows.append({"recording": name, "side": side, "events": len(cv.mapped.log),
                         "designs": len(cv.designs), "s": time.perf_counter() - t,
                         "admitted": [f"{x.design.variant} ({x.safe})" for x in cv.designs
                                      if x.design.verdict == "admitted"]})  # fmt: skip
        except MappingError as exc:
            rows.append({"recording": name, "side": side, "events": 0, "designs": 0,
                         "s": 0.0, "admitted": [f"not mapped: {exc}"[:60]]})  # fmt: skip
    for c in s.decodes:
        side = "decode" if len(s.decodes) == 1 else f"decode {c}"
        t = time.perf_counter()
        try:
            dv = validate_decode(events, work / "d" / c, engine=c, producer=s.producer)
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
            for s in validation_sides(events):  # xPyD: each producer on its own
                rows += _rows(events, f"{d.name}:{s.name}" if s.producer else d.name, s,
                              Path(tmp) / d.name / s.name)  # fmt: skip
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
