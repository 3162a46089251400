"""`kvspec decode`: the decode side's round trip (spec/Decode.tla) over
spec/decode-matrix.toml: producer and decode TP, MLA, the load-failure policy, READ
failures, full prefix hits, aborts, the composition, and the bugs of the history each
re-introduced as a design. TLC decides the invariants (one run, -continue) and the
liveness properties (a second run); the machinery is kvspec.sweep's.

`kvspec decode [--tier fast|full] [--only NAME] [--json F] [--out DIR]`; exit 1 when a
verdict differs from its expectation or TLC did not decide it, 2 on a bad matrix.
`kvspec decode --conform [--tier fast|full] [--only NAME]` replays the traces of
conformance/decode.toml (--only: conformance rows by name) on the installed vLLM's
decode engine (kvspec.decode_traces): which decode-side design it implements (DESIGNS:
0.30+'s, 0.29's; every divergence named by trace and step); exit 0 when one design admits
every trace of its rows; vLLM's logs go to build/logs/.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

from kvspec.sweep import Const, Sweep, add_sweep_arguments, run_sweep

REPO = Path(__file__).resolve().parents[2]
BUGS = (
    "none", "abort-frees-at-once", "full-hit-registered", "failure-only-logged",
    "notify-local-id", "count-tp-only", "second-child-recv",
    "v0.29-register-all",  # not a bug: vLLM 0.29's decode design (Decode.tla Registered)
)  # fmt: skip
# The designs Decode.tla has for push mode (its ASSUME): the scheduler's and the base
# worker's bugs; the others are pull's (notify-only, READ counts) or a child's.
PUSH_BUGS = ("none", "abort-frees-at-once", "failure-only-logged")
# The designs conformance/decode.toml's rows name (their Bug): a release's, never a mutant.
DESIGNS = {"none": "0.30+ (0.32 as shipped)", "v0.29-register-all": "0.29"}


def release_design(version: str) -> str:
    """The Bug value of the decode-side design a vLLM release implements (its DESIGNS key):
    0.29 registers every receive entry (pull_worker.py:64-65), 0.30+ only awaited ones."""
    from kvspec.versions import before

    return "v0.29-register-all" if before(version, (0, 30)) else "none"


DECODE = Sweep(
    command="decode",
    spec=REPO / "spec" / "Decode.tla",
    matrix=REPO / "spec" / "decode-matrix.toml",
    consts=(
        Const("DTP", "dtp", "int"),
        Const("PTP", "ptp", "int"),
        Const("MLA", "mla", "bool"),
        Const("Policy", "policy", "str", ("fail", "recompute")),
        Const("ReadFail", "read_fail", "bool"),
        Const("FullHit", "full_hit", "bool"),
        Const("Abort", "abort", "bool"),
        Const(
            "Composition",
            "composition",
            "str",
            ("nixl", "multi-nixl-lmcache", "multi-nixl-example"),
        ),  # fmt: skip
        Const("AsyncScheduling", "async_scheduling", "bool"),
        Const("Handshake", "handshake", "bool"),
        Const("HandshakeFail", "handshake_fail", "bool"),
        Const("SplitCallbacks", "split_callbacks", "bool"),
        Const("ProducerHangs", "producer_hangs", "bool"),
        Const("ReadDeadline", "read_deadline", "bool"),
        Const("Transfer", "transfer", "str", ("pull", "push")),
        Const("PushHandshakeFail", "push_handshake_fail", "bool"),
        Const("LateArrival", "late_arrival", "bool"),
        Const("PushWatchdog", "push_watchdog", "str", ("none", "at-once", "after-lease")),
        Const("LoadCap", "load_cap", "int"),
        Const("InStepEnd", "in_step_end", "bool"),
        Const("Bug", "bug", "str", BUGS),
    ),
    invariants=("DNoFreeUnderRead", "PNoFreeUnderRead", "NoAssertCrash", "ProducerNotified"),
    reach=("ReachReceived", "ReachAbortHeld", "ReachNotified", "ReachHandshakeFailed",
           "ReachWriteLost", "ReachCapFull"),
    liveness=("WaitingLeaves", "HeldReleased", "Admitted"),
    columns=("PTP", "DTP", "MLA", "Policy", "Composition", "Transfer", "AsyncScheduling",
             "Bug"),
    title="decode side (spec/Decode.tla): a P->D round trip",
    max_requests=2,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sweep_arguments(DECODE, p)
    what = "replay conformance/decode.toml's traces on the installed vLLM"
    p.add_argument("--conform", action="store_true", help=what)
    p.add_argument("--verbose", action="store_true", help="leave vLLM's logs on the terminal")
    p.add_argument("--prefix-caching", action="store_true",
                   help="--conform: D runs vLLM's default, prefix caching on")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    return conform(args) if args.conform else run_sweep(DECODE, args)


def conform(args: argparse.Namespace) -> int:
    """Every conformance trace of the tier on the installed vLLM; exit 1 on a divergence
    or an inconclusive trace (timed out twice), 0 when all conform. A replay that raised
    (vLLM or the driver failed) is errored: named, logged, no verdict; the run goes on and
    exits 1."""
    import logging
    from collections import Counter

    from kvspec.decode_traces import driver_for, replay_with_retry, suite
    from kvspec.drivers.base import first_line
    from kvspec.drivers.vllm_env import DriverUnavailable
    from kvspec.drivers.vllm_logging import vllm_logs

    caching = bool(args.prefix_caching)
    counts: Counter[tuple[str, str]] = Counter()
    first: dict[str, str] = {}
    not_driven: dict[str, str] = {}  # a row this vLLM cannot build: no verdict, said so
    design_of: dict[str, str] = {}
    with vllm_logs("decode", args.verbose) as log:
        if log is not None:
            print(f"vLLM's log: {log}")
        for name, row, trace in suite(args.tier, frozenset(args.only)):
            design_of[row.name] = DESIGNS.get(str(row.consts["Bug"]), f"bug {row.consts['Bug']}")
            if row.name in not_driven:
                continue
            try:
                make = driver_for(row, trace, prefix_caching=caching)
                res = replay_with_retry(trace, make)
            except DriverUnavailable as exc:
                not_driven[row.name] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - one replay's failure, named per trace
                logging.getLogger("kvspec.decode").exception("replay of %s raised", name)
                counts[(row.name, "errored")] += 1
                first.setdefault(row.name, f"{name}: errored: {first_line(exc)}")
                continue
            verdict = ("diverges" if res.divergence else
                       "inconclusive" if res.timeout else "conforms")  # fmt: skip
            counts[(row.name, verdict)] += 1
            if verdict != "conforms" and row.name not in first:
                first[row.name] = f"{name}: {res.divergence or res.timeout}"
    rows = sorted({r for r, _ in counts})
    table: dict[str, dict[str, object]] = {}
    for r in rows:
        n = {v: counts[(r, v)] for v in ("conforms", "diverges", "inconclusive", "errored")}
        table[r] = {**n, "first": first.get(r)}
        tail = f"; first: {first[r]}" if r in first else ""
        err = f", {n['errored']} errored (no verdict)" if n["errored"] else ""
        print(f"{r}: {n['conforms']}/{sum(n.values())} conform, {n['diverges']} diverge, "
              f"{n['inconclusive']} inconclusive{err}{tail}")  # fmt: skip
    for r, why in sorted(not_driven.items()):
        print(f"{r}: not driven ({why})")
    per = design_verdicts({r: design_of[r] for r in rows}, counts)
    held = [d for d, v in per.items() if v == "conforms"]
    for d, v in per.items():
        print(f"design {d}: {v}")
    print(_summary(held, per, bool(rows)) + (" (D: prefix caching on)" if caching else ""))
    if args.json is not None:
        verdict = "conforms" if held else "not driven" if not rows else (
            "diverges" if "diverges" in per.values() else "inconclusive")  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"verdict": verdict, "designs": per, "conforms_to": held,
                                         "rows": table, "not_driven": not_driven,
                                         "prefix_caching": caching},
                                        indent=1) + "\n")  # fmt: skip
    if any(counts[(r, "errored")] for r in rows):
        return 1  # a replay raised: the run failed, whatever the verdicts
    return 0 if held or not rows else 1  # nothing driven: said so, and no verdict


def _summary(held: list[str], per: dict[str, str], driven: bool) -> str:
    if held:
        return f"the installed vLLM's decode side conforms to Decode.tla's design {', '.join(held)}"
    if "diverges" in per.values():
        return "no decode-side design of Decode.tla admits every trace (see above)"
    if driven:
        return "no verdict: traces errored or timed out (see above)"
    return "no decode trace was driven here (see above): no verdict"


def design_verdicts(
    design_of: dict[str, str], counts: Mapping[tuple[str, str], int]
) -> dict[str, str]:
    """Per design (the rows' Bug, named by DESIGNS): "conforms" when every trace of its
    rows conforms, "diverges" when one diverges, else "inconclusive" (a wait timed out
    twice) or "errored" (a replay raised): neither is a verdict."""
    out: dict[str, str] = {}
    for d in sorted(set(design_of.values())):
        rows = [r for r, dd in design_of.items() if dd == d]
        n = {v: sum(counts.get((r, v), 0) for r in rows)
             for v in ("diverges", "inconclusive", "errored")}  # fmt: skip
        out[d] = ("diverges" if n["diverges"] else
                  "inconclusive" if n["inconclusive"] else
                  "errored" if n["errored"] else "conforms")  # fmt: skip
    return out
