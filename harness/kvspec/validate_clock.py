"""`kvspec validate TRACE_DIR --side clock`: is a recorded run a behaviour of the producer
engine against the lease clock (spec/KVClock.tla), heartbeats and time included? The
recording is mapped to ClockTrace.tla's Log (kvspec.record.clock_mapping) and TLC explores
ClockTrace's TraceNext once per producer design, as kvspec.validate does with KVTrace. An
admitted run is checked once more: does some explanation of it free a request before D's
READs of it landed (NoFreeUnderRead, #21570)?

D's bounds (hand-off, queue, READ, notification, lateness, handshake) are left open, to
the end of the log: the recording bounds them. Heartbeats and the lease are what is
checked: a heartbeat no sooner than its interval after the last, a lease extended only by
a heartbeat P received, reaped at P's first step after it ran out and not before.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from kvspec.matrix import SPEC_FILE
from kvspec.record.clock_mapping import ClockEvent, ClockMapped, map_clock
from kvspec.record.log import Event
from kvspec.record.mapping import transfer
from kvspec.tlc import run_tlc
from kvspec.tools import QUICK_JVM
from kvspec.validate import VARIANTS, DesignVerdict, event_line, print_designs, row_for
from kvspec.validate import trace_verdict as _verdict

SPECS = [SPEC_FILE, SPEC_FILE.parent / "KVClock.tla", SPEC_FILE.parent / "ClockTrace.tla"]
SLACK = 1  # ticks: an event's place inside its tick, and report delays, are not modelled
SHOWN = ("req", "lease", "expired", "ttl", "sent", "atD", "hs", "hbAge", "now", "rd", "land")


# The proposed fix for push's WRITE from freed blocks (KVClock PushLeaseCheck), checked
# as a design of its own on push recordings: does the run need the shipped writer?
LEASE_CHECK = "+push-lease-check"


@dataclass
class ClockVerdict:
    design: DesignVerdict
    safe: str = ""  # admitted runs: "safe" | "unsafe" | "inconclusive"
    writes: str = ""  # admitted push runs, NoWriteFromFreed: as `safe`


@dataclass
class ClockValidation:
    mapped: ClockMapped
    designs: list[ClockVerdict]

    @property
    def admitted(self) -> list[str]:
        return [d.design.variant for d in self.designs if d.design.verdict == "admitted"]


def _set(xs: frozenset[int]) -> str:
    return "{" + ", ".join(str(x) for x in sorted(xs)) + "}"


def _record(e: ClockEvent) -> str:
    out = "<<" + ", ".join(_set(o) for o in e.out) + ">>"
    swallow = "TRUE" if e.swallow else "FALSE"
    return (f'[a |-> "{e.a}", r |-> {e.r}, w |-> {e.w}, t |-> {e.t}, batch |-> {_set(e.batch)}, '
            f"out |-> {out}, freed |-> {_set(e.freed)}, fin |-> {_set(e.fin)}, "
            f"swallow |-> {swallow}, lost |-> {_set(e.lost)}, "
            f"names |-> {_set(frozenset(e.names))}]")  # fmt: skip


def trace_module(log: list[ClockEvent]) -> str:
    body = ",\n    ".join(_record(e) for e in log)
    head = "---- MODULE ClockTraceRun ----\nEXTENDS ClockTrace\n"
    return f"{head}TheLog == <<\n    {body}\n>>\n====\n"


def _bool(b: bool) -> str:
    return "TRUE" if b else "FALSE"


def constants(cm: ClockMapped, variant: str, sub_tick: bool = True,
              lease_check: bool = False) -> dict[str, str]:  # fmt: skip
    """KVClock's constants for the recorded deployment: KVCompletion's from its topology,
    vLLM's lease ratios in ticks, D's bounds open to the end of the log (push: P's lazy
    handshake with D too); `sub_tick`: deadlines inside ticks (False: KVClock's
    tick-aligned ones, a negative control); `lease_check`: the proposed fix
    (KVClock's PushLeaseCheck)."""
    row = row_for(cm.base, variant)
    push = row.transfer == "push"
    c = {k: v for k, v in row.constants().items() if k not in ("NReq", "Timing")}
    open_ = str(cm.max_t + SLACK + 1)
    reqs = "{" + ", ".join(str(r) for r in range(1, row.requests + 1)) + "}"
    c |= {
        "Reqs": reqs, "Lease": "6", "HbEvery": "1", "Extend": "4",
        "AMax": open_, "QMax": open_, "RMax": open_, "NMax": open_, "DStall": open_,
        "HsMax": open_, "PStep": "99", "PHsMax": open_ if push else "0",
        "PushLeaseCheck": _bool(lease_check), "MaxLost": "99",
        "Swallow": "TRUE" if cm.swallow_first else "FALSE",
        "NotifFirst": "FALSE", "Abandon": _bool(any(e.a == "abandon" for e in cm.log)),
        "DFinish": _bool(any(e.a == "finish" for e in cm.log)),
        "ReadFails": _bool(any(e.a == "fail" for e in cm.log)),
        "ShipLate": "TRUE", "Slack": str(SLACK),
        "MaxNow": str(cm.max_t + SLACK), "HbSeen": _bool(cm.hb_recorded),
        "HsSeen": _bool(cm.hs_recorded), "PHsSeen": _bool(cm.phs_recorded),
        "SubTick": _bool(sub_tick),
    }  # fmt: skip
    return c


def trace_cfg(consts: dict[str, str], invariant: str) -> str:
    lines = ["CONSTANTS"] + [f"  {k} = {v}" for k, v in consts.items()]
    lines += ["  Log <- TheLog", "  Arrived <- [KVCompletion] TraceArrived"]
    if consts.get("SubTick") == "TRUE":  # deadlines inside ticks (spec/ClockTrace.tla)
        lines.append("  ExpiresAtTick <- TraceExpiresAtTick")
    lines += ["INIT TraceInit", "NEXT TraceNext", f"INVARIANT {invariant}"]
    return "\n".join(lines) + "\n"


def _holds(module: Path, cfg: Path, d: Path, timeout_s: float) -> str:
    # A log-bounded run of seconds (kvspec.validate.trace_verdict): C1 alone.
    res = run_tlc(module, cfg, deadlock=False, log_dir=d, timeout_s=timeout_s, jvm_flags=QUICK_JVM)
    return {"holds": "safe", "violated": "unsafe"}.get(res.verdict, "inconclusive")


def check_clock(cm: ClockMapped, variant: str, work: Path, timeout_s: float = 300,
                sub_tick: bool = True, lease_check: bool = False) -> ClockVerdict:  # fmt: skip
    name = variant + (LEASE_CHECK if lease_check else "")
    try:
        consts = constants(cm, variant, sub_tick, lease_check)
    except ValueError as exc:  # an ASSUME this design rejects
        return ClockVerdict(DesignVerdict(name, "inconclusive", detail=str(exc)))
    d = work / f"clock-{name}"
    d.mkdir(parents=True, exist_ok=True)
    for f in SPECS:
        shutil.copy(f, d / f.name)
    module = d / "ClockTraceRun.tla"
    module.write_text(trace_module(cm.log))
    cfg = d / "ClockTraceRun.cfg"
    cfg.write_text(trace_cfg(consts, "TraceUnfinished"))
    verdict = ClockVerdict(_verdict(name, module, cfg, len(cm.log), timeout_s))
    if verdict.design.verdict == "admitted":
        safe = d / "ClockTraceSafe.cfg"
        safe.write_text(trace_cfg(consts, "RunKeepsReadsSafe"))
        verdict.safe = _holds(module, safe, d, 2 * timeout_s)
        if consts["PHsMax"] != "0":  # push: P's lazy handshake, a parked WRITE
            writes = d / "ClockTraceWrites.cfg"
            writes.write_text(trace_cfg(consts, "RunWritesNoFreed"))
            verdict.writes = _holds(module, writes, d, 2 * timeout_s)
    return verdict


def validate_clock(events: list[Event], work: Path, variants: tuple[str, ...] = VARIANTS,
                   lease_s: int | None = None, producer: str | None = None,
                   consumer: str | None = None,
                   with_fix: bool = False) -> ClockValidation:  # fmt: skip
    """`with_fix`: a push recording is checked against the proposed fix too (a design
    named v0.30-shipped+push-lease-check): does the run need the shipped writer?"""
    cm = map_clock(events, lease_s, producer, consumer)
    designs = [check_clock(cm, v, work) for v in variants]
    if with_fix and transfer(cm.base.start) == "push" and "v0.30-shipped" in variants:
        designs.append(check_clock(cm, "v0.30-shipped", work, lease_check=True))
    return ClockValidation(cm, designs)


def print_clock(v: ClockValidation) -> None:
    cm = v.mapped
    print(f"clock: lease {cm.lease_s} s (a tick is {cm.lease_s / 6:g} s), {cm.max_t + 1} ticks, "
          f"{cm.heartbeats} heartbeats, {len(cm.log)} spec events")  # fmt: skip
    print_designs([d.design for d in v.designs], [event_line(e) for e in cm.log], SHOWN)
    for d in v.designs:
        if d.safe:
            print(f"  {d.design.variant:16} reads: {d.safe} (NoFreeUnderRead on the run)")
        if d.writes:
            said = {"safe": "no WRITE from blocks P freed",
                    "unsafe": "a WRITE read blocks P had freed"}.get(d.writes, "no verdict")
            print(f"  {d.design.variant:16} writes: {d.writes} (NoWriteFromFreed on the run: "
                  f"{said})")  # fmt: skip
