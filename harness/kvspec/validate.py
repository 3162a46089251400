"""`kvspec validate TRACE_DIR`: is a recorded run (kvspec record) a behaviour of the spec,
and of which designs? The recording is mapped to KVTrace.tla's Log (kvspec.record.mapping)
and TLC explores KVTrace's TraceSpec once per design: the run is admitted iff a state that
explained every event is reachable. When it is not, the first event no spec step explains
is printed with the spec states that explained everything before it.

A TLC run that times out or fails says nothing about the trace: that design is
"inconclusive", never admitted or rejected.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

from kvspec.matrix import SPEC_FILE, ModelRow, Topology
from kvspec.record.log import Event, RecordError, read_dir
from kvspec.record.mapping import (
    Mapped,
    MappingError,
    Sides,
    SpecEvent,
    engines_of,
    map_recording,
    transfer,
    validation_sides,
)
from kvspec.statgraph import parse_dot
from kvspec.tlc import run_tlc
from kvspec.tlcvalue import Value, to_tla
from kvspec.tools import QUICK_JVM

TRACE_SPEC = SPEC_FILE.parent / "KVTrace.tla"
VARIANTS = ("v0.29", "v0.30-shipped", "fixed", "naive-replicas")
SHOWN = ("req", "steps", "toProcess", "lease", "expired", "notif", "rd", "agg")


@dataclass
class DesignVerdict:
    variant: str
    verdict: str  # "admitted" | "rejected" | "inconclusive"
    explained: int = 0  # events explained (all of them when admitted)
    states: list[dict[str, Value]] = field(default_factory=list)  # at the first unexplained
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "variant": self.variant, "verdict": self.verdict, "explained": self.explained,
            "states": [{k: to_tla(v) for k, v in s.items() if k in SHOWN}
                       for s in self.states],
            "detail": self.detail,
        }  # fmt: skip


# The NIXL pull connector's class names: a MultiConnector child is the factory's class,
# NixlPullConnector in 0.32 (nixl/connector.py), NixlConnector before it.
NIXL_NAMES = ("NixlConnector", "NixlPullConnector")


def children_of(start: dict[str, object]) -> list[str]:
    """The recorded MultiConnector's children in its order, NIXL's named NixlConnector."""
    kids = [str(c) for c in start.get("children", []) or []]  # type: ignore[attr-defined]
    return ["NixlConnector" if c in NIXL_NAMES else c for c in kids]


def composition(start: dict[str, object]) -> str:
    """KVCompletion's Composition for the recorded connector (MappingError otherwise)."""
    conn = str(start.get("connector", "NixlConnector"))
    children = children_of(start)
    if conn in ("NixlConnector", "NixlPushConnector"):
        return "nixl"
    if conn == "MultiConnector" and children[:1] == ["NixlConnector"]:
        rest = children[1:]
        if rest == ["HF3FSKVConnector"]:
            return "multi-nixl-hf3fs"
        if rest == ["OffloadingConnector"]:
            return "multi-nixl-offload-upstream"
        if rest == ["ExampleConnector"]:
            return "multi-nixl-example"
    raise MappingError(
        f"connector {conn}{children or ''} has no KVCompletion composition; the spec knows "
        "NixlConnector and MultiConnector(NixlConnector, HF3FSKVConnector|OffloadingConnector"
        "|ExampleConnector)"
    )


def row_for(m: Mapped, variant: str, timing: str = "guarded") -> ModelRow:
    """The model row of the recorded deployment: its topology, its requests, and as many
    KV slots as the recorded pool holds requests (mapping.kv_capacity), at least one and
    at most one per request (where the recording does not say: one per request).
    `timing`: KVCompletion's Timing; "untimed" drops the guards that a transfer starts
    only on a live lease (a run that broke them is then a behaviour, and a finding)."""
    s = m.start
    n = max(1, len(m.requests))
    cap = n if m.capacity is None else max(1, min(n, m.capacity))
    topo = Topology(int(str(s.get("tp", m.world))), int(str(s.get("pp", 1))),
                    int(str(s.get("pcp", 1))))  # fmt: skip
    return ModelRow(
        name=f"recorded-{variant}", variant=variant, composition=composition(s),
        topology=topo, requests=n, capacity=cap,
        async_scheduling=bool(s.get("async_scheduling", False)), transfer=transfer(s),
        timing=timing,
    )  # fmt: skip


def _record(e: SpecEvent) -> str:
    def st(xs: frozenset[int]) -> str:
        return "{" + ", ".join(str(x) for x in sorted(xs)) + "}"

    out = "<<" + ", ".join(st(o) for o in e.out) + ">>"
    return (f'[a |-> "{e.a}", r |-> {e.r}, w |-> {e.w}, batch |-> {st(e.batch)}, '
            f"out |-> {out}, freed |-> {st(e.freed)}, fin |-> {st(e.fin)}]")  # fmt: skip


def trace_module(log: list[SpecEvent]) -> str:
    body = ",\n    ".join(_record(e) for e in log)
    return ("---- MODULE KVTraceRun ----\nEXTENDS KVTrace\n"
            f"TheLog == <<\n    {body}\n>>\n====\n")  # fmt: skip


def trace_cfg(row: ModelRow) -> str:
    lines = ["CONSTANTS"] + [f"  {k} = {v}" for k, v in row.constants().items()]
    lines += ["  Log <- TheLog", "  Arrived <- TraceArrived", "INIT TraceInit",
              "NEXT TraceNext", "INVARIANT TraceUnfinished"]  # fmt: skip
    return "\n".join(lines) + "\n"


def check_design(m: Mapped, variant: str, work: Path, timeout_s: float = 300,
                 timing: str = "guarded") -> DesignVerdict:  # fmt: skip
    try:
        row = row_for(m, variant, timing)
    except ValueError as exc:  # an ASSUME this design rejects (matrix.py checks them)
        return DesignVerdict(variant, "inconclusive", detail=str(exc))
    d = work / variant
    d.mkdir(parents=True, exist_ok=True)
    for f in (SPEC_FILE, TRACE_SPEC):
        shutil.copy(f, d / f.name)
    (d / "KVTraceRun.tla").write_text(trace_module(m.log))
    cfg = d / "KVTraceRun.cfg"
    cfg.write_text(trace_cfg(row))
    return trace_verdict(variant, d / "KVTraceRun.tla", cfg, len(m.log), timeout_s)


def trace_verdict(name: str, module: Path, cfg: Path, events: int,
                  timeout_s: float) -> DesignVerdict:  # fmt: skip
    """TLC on a trace-validation module (KVTrace or DecodeTrace constrained by a log):
    admitted iff TraceUnfinished is violated; else rejected at the largest logIdx reached,
    with the states there; a TLC run that times out twice or fails is inconclusive."""
    d = module.parent
    dot = d / "states.dot"
    # The log bounds what TLC explores (seconds): C1 alone, QUICK_JVM, not C2's warm-up.
    # A timeout (a loaded machine) is run once more, twice as long.
    for limit in (timeout_s, 2 * timeout_s):
        res = run_tlc(module, cfg, deadlock=False, dump_dot=dot, log_dir=d, timeout_s=limit,
                      jvm_flags=QUICK_JVM)  # fmt: skip
        if res.verdict != "timeout":
            break
    if res.verdict == "violated" and res.violated_property == "TraceUnfinished":
        return DesignVerdict(name, "admitted", events)
    if res.verdict != "holds":
        return DesignVerdict(name, "inconclusive",
                             detail=f"TLC {res.verdict}: {res.error or res.violated_property}; "
                                    f"log {res.log_path}")  # fmt: skip
    graph = parse_dot(dot.read_text())
    reached = max(int(str(s["logIdx"])) for s in graph.states.values())
    at = [s for s in graph.states.values() if s["logIdx"] == reached]
    return DesignVerdict(name, "rejected", reached, at[:3])


@dataclass
class Validation:
    mapped: Mapped
    designs: list[DesignVerdict]

    @property
    def admitted(self) -> list[str]:
        return [d.variant for d in self.designs if d.verdict == "admitted"]


def validate_events(events: list[Event], work: Path,
                    variants: tuple[str, ...] = VARIANTS, producer: str | None = None,
                    timing: str = "guarded") -> Validation:  # fmt: skip
    mapped = map_recording(events, producer=producer)
    return Validation(mapped, [check_design(mapped, v, work, timing=timing) for v in variants])


def validate(trace_dir: Path, work: Path, variants: tuple[str, ...] = VARIANTS) -> Validation:
    return validate_events(read_dir(trace_dir), work, variants)


class _Logged(Protocol):
    @property
    def source(self) -> Event | None: ...

    def describe(self) -> str: ...


def event_line(e: _Logged) -> str:
    """A spec event and the recorded call it came from (either side's log)."""
    src = e.source
    where = f"{src.engine} {src.role} {src.rank} #{src.seq} {src.call}" if src else "?"
    return f"{e.describe()}   <- {where}"


def print_designs(designs: list[DesignVerdict], lines: list[str], shown: tuple[str, ...],
                  label: Callable[[str], str] = str, width: int = 16) -> None:  # fmt: skip
    """One line per design; a rejected one names the first event no spec step explains
    (`lines`: the log's events as event_line) and the first spec state reached there."""
    for d in designs:
        name = label(d.variant)
        if d.verdict == "admitted":
            print(f"  {name:{width}} admitted: all {d.explained} events explained")
        elif d.verdict == "inconclusive":
            print(f"  {name:{width}} inconclusive: {d.detail}")
        else:
            print(f"  {name:{width}} rejected at event {d.explained + 1}/{len(lines)}: "
                  f"{lines[d.explained]}")  # fmt: skip
            for s in d.states[:1]:
                for k in shown:
                    if k in s:
                        print(f"      {k:9} = {to_tla(s[k])}")


def print_validation(v: Validation) -> None:
    m = v.mapped
    print(f"producer {m.producer} (world {m.world}), consumers {', '.join(m.consumers) or '-'};"
          f" {len(m.requests)} requests, {len(m.log)} spec events")  # fmt: skip
    print_designs(v.designs, [event_line(e) for e in m.log], SHOWN)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace_dir", type=Path, help="a kvspec record directory (*.ndjson)")
    p.add_argument("--variant", action="append", choices=VARIANTS,
                   help="only these producer designs (default: all)")  # fmt: skip
    p.add_argument("--side", choices=("producer", "decode", "clock", "both"), default="both",
                   help="KVCompletion (producer), Decode.tla (the decode engine), KVClock "
                        "(the producer against the lease clock, heartbeats and time "
                        "included), or all three (each where the recording allows)")  # fmt: skip
    p.add_argument("--lease", type=int,
                   help="kv_lease_duration in s, for a recording that does not say it")  # fmt: skip
    p.add_argument("--timing", choices=("guarded", "untimed"), default="guarded",
                   help="the producer side's Timing: 'untimed' drops KVCompletion's guards "
                        "that a transfer starts on a live lease (a run that broke them, "
                        "e.g. a WRITE after the free, is then admitted: a finding)")  # fmt: skip
    p.add_argument("--engine", help="only this decode engine (default: each)")
    p.add_argument("--producer", help="only this producer engine (default: each; a "
                   "recording of xPyD engines has several)")
    p.add_argument("--json", type=Path, help="write the verdicts as JSON here")
    p.add_argument("--work", type=Path, default=Path("build/validate"))


def _where_mapped(args: argparse.Namespace, side: str, label: str,
                  check: Callable[[], dict[str, object]]) -> dict[str, object] | None:  # fmt: skip
    """A side validated where the recording allows it: its verdicts as JSON, or None (said
    on the terminal) when the recording cannot be mapped for it, unless that side alone
    was asked for (then the MappingError is the answer: exit 2)."""
    try:
        return check()
    except MappingError as exc:
        if args.side == side:
            raise
        print(f"{label}: not validated: {exc}")
        return None


def _decode_side(events: list[Event], args: argparse.Namespace, engine: str | None,
                 producer: str | None, work: Path) -> dict[str, object]:  # fmt: skip
    from kvspec.validate_decode import print_decode, validate_decode

    dv = validate_decode(events, work, engine=engine, producer=producer)
    print_decode(dv)
    return {"engine": dv.mapped.consumer, "events": len(dv.mapped.log),
            "log": [event_line(e) for e in dv.mapped.log],
            "designs": [d.to_json() for d in dv.designs], "admitted": dv.admitted}  # fmt: skip


def _clock_side(events: list[Event], args: argparse.Namespace, producer: str | None,
                consumer: str | None, work: Path) -> dict[str, object]:  # fmt: skip
    from kvspec.validate_clock import print_clock, validate_clock

    cv = validate_clock(events, work, tuple(args.variant or VARIANTS), args.lease, producer,
                        consumer, with_fix=True)  # fmt: skip
    print_clock(cv)
    return {"lease_s": cv.mapped.lease_s, "heartbeats": cv.mapped.heartbeats,
            "events": len(cv.mapped.log), "log": [event_line(e) for e in cv.mapped.log],
            "designs": [d.design.to_json() | {"reads": d.safe, "writes": d.writes}
                        for d in cv.designs],
            "admitted": cv.admitted}  # fmt: skip


Side = Callable[[str | None, Path], dict[str, object]]  # (decode engine, work) -> document


def _per_engine(args: argparse.Namespace, side: str, label: str, ds: list[str | None],
                work: Path, ok: list[bool], check: Side) -> object | None:  # fmt: skip
    """`side` validated once per decode engine in ds (None: the recording's only one):
    its document, or {engine: document} for several; None where none could be mapped."""
    got: dict[str, dict[str, object]] = {}
    for d in ds:
        at = work if len(ds) == 1 else work / str(d)
        x = _where_mapped(args, side, label if len(ds) == 1 else f"{label} ({d})",
                          partial(check, d, at))  # fmt: skip
        if x is not None:
            got[str(d)] = x
            ok.append(bool(x["admitted"]))
    if not got:
        return None
    return got[str(ds[0])] if len(ds) == 1 else got


def _one_producer(events: list[Event], args: argparse.Namespace, s: Sides, work: Path,
                  ok: list[bool]) -> dict[str, object] | None:  # fmt: skip
    """Every asked side of one producer (mapping.validation_sides, narrowed by --engine);
    None where the producer side is inconclusive and admits nothing (exit 2)."""
    producer = s.producer
    doc: dict[str, object] = {}
    if args.side in ("producer", "both"):
        v = validate_events(events, work, tuple(args.variant or VARIANTS), producer,
                            args.timing)  # fmt: skip
        print_validation(v)
        doc |= {"producer": v.mapped.producer, "events": len(v.mapped.log),
                "log": [event_line(e) for e in v.mapped.log],
                "designs": [d.to_json() for d in v.designs],
                "admitted": v.admitted}  # fmt: skip
        if any(d.verdict == "inconclusive" for d in v.designs) and not v.admitted:
            return None
        ok.append(bool(v.admitted))
    ds: list[str | None] = [args.engine] if args.engine else [*s.decodes]
    if args.side in ("decode", "both"):
        # none: validate_decode says why, in one line
        dec = _per_engine(args, "decode", "decode side", ds or [None], work, ok,
                          lambda d, at: _decode_side(events, args, d, producer, at))  # fmt: skip
        if dec is not None:
            doc["decode"] = dec
    if args.side in ("clock", "both"):
        # KVClock has one decode engine: a producer of several is validated once per D
        cs: list[str | None] = [args.engine] if args.engine else [*s.clocks]
        clk = _per_engine(args, "clock", "clock", cs, work, ok,
                          lambda c, at: _clock_side(events, args, producer, c, at))  # fmt: skip
        if clk is not None:
            doc["clock"] = clk
    return doc


def run(args: argparse.Namespace) -> int:
    doc: dict[str, object] = {}
    ok: list[bool] = []
    try:
        events = read_dir(args.trace_dir)
        # each producer's completion is its own (xPyD: no vLLM state spans P engines)
        plan = [s for s in validation_sides(events) if args.producer in (None, s.name)]
        if not plan:  # no producer, or not the one asked: engines_of says so in one line
            engines_of(events, args.producer)
        for s in plan:
            if len(plan) > 1:
                print(f"== producer {s.name}")
            got = _one_producer(events, args, s, args.work / s.name if len(plan) > 1
                                else args.work, ok)  # fmt: skip
            if got is None:
                return 2
            if len(plan) > 1:
                doc.setdefault("producers", {})[s.name] = got  # type: ignore[index]
            else:
                doc = got
    except (RecordError, MappingError) as exc:
        print(f"kvspec validate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))
    return 0 if ok and all(ok) else 1
