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

from kvspec.record.log import read_dir
from kvspec.record.mapping import MappingError
from kvspec.validate import validate_events
from kvspec.validate_clock import validate_clock
from kvspec.validate_decode import validate_decode

RECORDED = Path(__file__).resolve().parents[1] / "conformance" / "recorded"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in sorted(x for x in RECORDED.iterdir() if x.is_dir()):
            events = read_dir(d)
            t = time.perf_counter()
            v = validate_events(events, Path(tmp) / d.name / "p")
            rows.append({"recording": d.name, "side": "producer", "events": len(v.mapped.log),
                         "designs": len(v.designs), "s": time.perf_counter() - t,
                         "admitted": v.admitted})  # fmt: skip
            t = time.perf_counter()
            try:  # the clock needs the lease, recorded since 2026-12-03
                cv = validate_clock(events, Path(tmp) / d.name / "c")
                rows.append({"recording": d.name, "side": "clock", "events": len(cv.mapped.log),
                             "designs": len(cv.designs), "s": time.perf_counter() - t,
                             "admitted": [f"{x.design.variant} ({x.safe})" for x in cv.designs
                                          if x.design.verdict == "admitted"]})  # fmt: skip
            except MappingError as exc:
                rows.append({"recording": d.name, "side": "clock", "events": 0, "designs": 0,
                             "s": 0.0, "admitted": [f"not mapped: {exc}"[:60]]})  # fmt: skip
            t = time.perf_counter()
            try:
                dv = validate_decode(events, Path(tmp) / d.name / "d")
            except MappingError as exc:  # recorded before the decode side could be mapped
                rows.append({"recording": d.name, "side": "decode", "events": 0, "designs": 0,
                             "s": 0.0, "admitted": [f"not mapped: {exc}"[:60]]})  # fmt: skip
                continue
            rows.append({"recording": d.name, "side": "decode", "events": len(dv.mapped.log),
                         "designs": len(dv.designs), "s": time.perf_counter() - t,
                         "admitted": dv.admitted})  # fmt: skip
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
