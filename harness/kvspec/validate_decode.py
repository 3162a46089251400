"""The decode side of `kvspec validate`: is the recorded decode engine's run a behaviour of
Decode.tla, and of which decode-side designs (0.32 as shipped, or a bug of the history)?
The recording is mapped to DecodeTrace.tla's Log (kvspec.record.decode_mapping) and TLC
explores DecodeTrace's TraceSpec once per design, as kvspec.validate does for the producer.
A TLC run that times out or fails is "inconclusive" for that design, never a verdict.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.decode import BUGS, DECODE, DESIGNS, PUSH_BUGS
from kvspec.record.decode_mapping import DecodeEvent, DecodeMapped, map_decode
from kvspec.record.log import Event
from kvspec.record.mapping import MappingError, transfer
from kvspec.validate import (
    DesignVerdict,
    children_of,
    event_line,
    print_designs,
    trace_verdict,
)

TRACE_SPEC = DECODE.spec.parent / "DecodeTrace.tla"
SHOWN_DECODE = ("st", "fRecv", "steps", "reg", "xf", "h", "rem", "hsd", "hsq", "rdy", "hsRec")
CHILDREN = {(): "nixl", ("ExampleConnector",): "multi-nixl-example",
            ("LMCacheMPConnector",): "multi-nixl-lmcache"}  # fmt: skip


def composition(start: dict[str, object]) -> str:
    conn = str(start.get("connector", "NixlConnector"))
    kids = tuple(children_of(start))
    if conn == "NixlPushConnector":
        if start.get("mla"):  # Decode.tla's ASSUME: push without MLA's notify-only path
            raise MappingError("push mode with MLA: Decode.tla models push for MLA = FALSE")
        return "nixl"  # Transfer = "push" (constants)
    if conn == "NixlConnector":
        return "nixl"
    if conn == "MultiConnector" and kids[:1] == ("NixlConnector",) and kids[1:] in CHILDREN:
        return CHILDREN[kids[1:]]
    raise MappingError(f"decode connector {conn}{list(kids) or ''} has no Decode.tla "
                       "composition: NixlConnector, or MultiConnector(NixlConnector, "
                       "ExampleConnector | LMCacheMPConnector)")  # fmt: skip


def constants(m: DecodeMapped, bug: str) -> dict[str, str]:
    """Decode.tla's constants for the recorded engine. A recording may hold any request
    shape: full hits, failed READs and aborts are allowed, the log decides; D's first
    contact with P is allowed (the handshake may also finish before any READ)."""
    if m.world not in (1, 2) or m.producer_world not in (1, 2):
        raise MappingError(f"D TP {m.world}, P TP {m.producer_world}: Decode.tla has 1 or 2")
    policy = str(m.start.get("kv_load_failure_policy", "fail"))
    reqs = ", ".join(str(r) for r in range(1, max(1, len(m.requests)) + 1))
    return {
        "Reqs": "{" + reqs + "}", "DTP": str(m.world), "PTP": str(m.producer_world),
        "MLA": "TRUE" if m.start.get("mla") else "FALSE", "Policy": f'"{policy}"',
        "ReadFail": "TRUE", "FullHit": "TRUE",
        "Abort": "TRUE", "Composition": f'"{composition(m.start)}"',
        "AsyncScheduling": "TRUE" if m.start.get("async_scheduling") else "FALSE",
        "Handshake": "TRUE", "InStepEnd": "TRUE", "Bug": f'"{bug}"',
        # a real handshake may fail (its entries are then reported failed with no READ):
        # what vLLM can do is admitted
        "HandshakeFail": "TRUE",
        # ... and a failed handshake fails its entries one callback at a time while D
        # steps (recorded: pd-tp2-mqa, two steps apart)
        "SplitCallbacks": "TRUE",
        # read only by Spec's fairness, which a trace's check does not use
        "ProducerHangs": "FALSE", "ReadDeadline": "FALSE",
        # NixlPushConnector: D registers its blocks and waits for P's WRITEs; P's handshake
        # with D may fail (what vLLM can do is admitted)
        "Transfer": f'"{transfer(m.start)}"',
        "PushHandshakeFail": "TRUE" if transfer(m.start) == "push" else "FALSE",
        "PushWatchdog": '"none"',
        # vLLM 0.34's --max-num-inflight-kv-loads as the recorder read it (None: unset)
        "LoadCap": str(int(m.start.get("max_num_inflight_kv_loads") or 0)),
        # P's lease run out before D's add_request: D's log cannot see it and it only
        # disables P's WRITEs, so it admits no more runs, and it multiplies the silent
        # interleavings TLC explores (measured: a 1 s trace check took minutes)
        "LateArrival": "FALSE",
        # the recorder wrote D's handshakes: each ends only where the log says
        "HsSeen": "TRUE" if m.hs_recorded else "FALSE",
        # D's pool in requests (decode_mapping.d_capacity); unknown: every request fits
        "TraceCap": str(m.capacity or max(1, len(m.requests))),
    }  # fmt: skip


def _one(x: int | tuple[int, int]) -> str:
    return f"<<{x[0]}, {x[1]}>>" if isinstance(x, tuple) else str(x)


def _set(xs: Iterable[Any]) -> str:
    return "{" + ", ".join(_one(x) for x in sorted(xs)) + "}"


def _seq(xs: tuple[frozenset[Any], ...], world: int) -> str:
    return "<<" + ", ".join(_set(x) for x in (xs or (frozenset(),) * world)) + ">>"


def _record(e: DecodeEvent, world: int) -> str:
    return (f'[a |-> "{e.a}", r |-> {e.r}, batch |-> {_set(e.batch)}, '
            f"out |-> {_seq(e.out, world)}, fail |-> {_seq(e.fail, world)}, "
            f"reads |-> {_seq(e.reads, world)}, recv |-> {_set(e.recv)}, w |-> {e.w}, "
            f"ok |-> {'TRUE' if e.ok else 'FALSE'}]")  # fmt: skip


def trace_module(m: DecodeMapped) -> str:
    body = ",\n    ".join(_record(e, m.world) for e in m.log)
    return ("---- MODULE DecodeTraceRun ----\nEXTENDS DecodeTrace\n"
            f"TheLog == <<\n    {body}\n>>\n====\n")  # fmt: skip


def trace_cfg(consts: dict[str, str]) -> str:
    lines = ["CONSTANTS"] + [f"  {k} = {v}" for k, v in consts.items()]
    lines += ["  Log <- TheLog", "  Arrived <- TraceArrived", "  Busy <- TraceBusy",
              "  DCap <- TraceCap",
              "INIT TraceInit", "NEXT TraceNext", "INVARIANT TraceUnfinished"]  # fmt: skip
    return "\n".join(lines) + "\n"


def check_bug(
    m: DecodeMapped,
    bug: str,
    work: Path,
    timeout_s: float = 300,
    extra: dict[str, str] | None = None,
) -> DesignVerdict:
    """TLC on DecodeTrace for design `bug`; `extra` overrides constants (a model variant,
    e.g. InStepEnd = FALSE: Decode.tla before a recorded real run showed in-step ends)."""
    d = work / bug
    d.mkdir(parents=True, exist_ok=True)
    for f in (DECODE.spec, TRACE_SPEC):
        shutil.copy(f, d / f.name)
    (d / "DecodeTraceRun.tla").write_text(trace_module(m))
    cfg = d / "DecodeTraceRun.cfg"
    cfg.write_text(trace_cfg(constants(m, bug) | (extra or {})))
    return trace_verdict(bug, d / "DecodeTraceRun.tla", cfg, len(m.log), timeout_s)


@dataclass
class DecodeValidation:
    mapped: DecodeMapped
    designs: list[DesignVerdict]

    @property
    def admitted(self) -> list[str]:
        return [d.variant for d in self.designs if d.verdict == "admitted"]


def validate_decode(events: list[Event], work: Path, bugs: tuple[str, ...] = BUGS,
                    engine: str | None = None,
                    producer: str | None = None) -> DecodeValidation:  # fmt: skip
    m = map_decode(events, engine, producer)
    if transfer(m.start) == "push":  # Decode.tla's push designs (its ASSUME)
        bugs = tuple(b for b in bugs if b in PUSH_BUGS)
    return DecodeValidation(m, [check_bug(m, b, work / "decode") for b in bugs])


def print_decode(v: DecodeValidation) -> None:
    m = v.mapped
    print(f"decode engine {m.consumer} (D TP {m.world}, P TP {m.producer_world}); "
          f"{len(m.requests)} P/D requests, {len(m.log)} spec events")  # fmt: skip
    print_designs(v.designs, [event_line(e) for e in m.log], SHOWN_DECODE,
                  lambda b: f"design {DESIGNS[b]}" if b in DESIGNS else f"bug {b}", 32)  # fmt: skip
