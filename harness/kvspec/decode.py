"""`kvspec decode`: the decode side's round trip (spec/Decode.tla) over
spec/decode-matrix.toml: producer and decode TP, MLA, the load-failure policy, READ
failures, full prefix hits, aborts, the composition, and the bugs of the history each
re-introduced as a design. TLC decides the invariants (one run, -continue) and the
liveness properties (a second run); the machinery is kvspec.sweep's.

`kvspec decode [--tier fast|full] [--only NAME] [--json F] [--out DIR]`; exit 1 when a
verdict differs from its expectation or TLC did not decide it, 2 on a bad matrix.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvspec.sweep import Const, Sweep, add_sweep_arguments, run_sweep

REPO = Path(__file__).resolve().parents[2]
BUGS = (
    "none", "abort-frees-at-once", "full-hit-registered", "failure-only-logged",
    "notify-local-id", "count-tp-only", "second-child-recv",
)  # fmt: skip
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
        Const("Composition", "composition", "str", ("nixl", "multi-nixl-lmcache")),
        Const("Bug", "bug", "str", BUGS),
    ),
    invariants=("DNoFreeUnderRead", "PNoFreeUnderRead", "NoAssertCrash", "ProducerNotified"),
    reach=("ReachReceived", "ReachAbortHeld", "ReachNotified"),
    liveness=("WaitingLeaves", "HeldReleased"),
    columns=("PTP", "DTP", "MLA", "Policy", "Composition", "Bug"),
    title="decode side (spec/Decode.tla): a P->D round trip",
    max_requests=2,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sweep_arguments(DECODE, p)


def run(args: argparse.Namespace) -> int:
    return run_sweep(DECODE, args)
