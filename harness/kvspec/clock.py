"""`kvspec clock`: KVCompletion's producer engine against a discrete clock (spec/KVClock.tla,
issue #13). The timing guards of KVCompletion's "guarded" rows are gone; each row of
spec/clock-matrix.toml sets the lease constants (vLLM's ratios: lease 6 ticks, heartbeat
every tick, extension 4), the decode side's bounds (queue wait, READ, notification), the
heartbeat channel's losses and D's lateness, on a producer topology and design; TLC decides
NoFreeUnderRead (and KVCompletion's safety properties, and GuardsHold: whether the guards
the guarded rows assume are true at these ratios) in one run, the liveness properties in
a second, and each verdict is compared with the row's expectation (kvspec.sweep).

`kvspec clock [--tier fast|full] [--only NAME] [--json F] [--out DIR]`; exit 1 when a
verdict differs from its expectation or TLC did not decide it, 2 on a bad matrix.
`kvspec clock --conform` replays every row's edge-covering traces on the real classes
(kvspec.clock_traces): the producer engine, its NIXL workers against a controlled
perf_counter, D's real heartbeats, READs and notifications as separate steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvspec.drivers.prefix_layout import add_layout_argument
from kvspec.sweep import Const, Sweep, conform_command

REPO = Path(__file__).resolve().parents[2]
_INTS = {
    "TP": "tp", "PP": "pp", "PCP": "pcp", "DCP": "dcp", "Capacity": "capacity",
    "Lease": "lease", "HbEvery": "hb_every", "Extend": "extend", "AMax": "amax",
    "QMax": "qmax",
    "RMax": "rmax", "NMax": "nmax", "MaxLost": "max_lost", "DStall": "dstall", "HsMax": "hs_max",
    "PStep": "pstep", "PHsMax": "phs_max",
}  # fmt: skip
_BOOLS = {
    "AsyncScheduling": "async_scheduling", "Swallow": "swallow", "NotifFirst": "notif_first",
    "Abandon": "abandon", "ShipLate": "ship_late", "DFinish": "d_finish",
    "ReadFails": "read_fails", "PushLeaseCheck": "push_lease_check",
}  # fmt: skip
CLOCK = Sweep(
    command="clock",
    spec=REPO / "spec" / "KVClock.tla",
    matrix=REPO / "spec" / "clock-matrix.toml",
    consts=(
        Const("Variant", "variant", "str", ("v0.29", "v0.30-shipped", "fixed", "naive-replicas")),
        Const(
            "Composition",
            "composition",
            "str",
            ("nixl", "multi-nixl-offload-upstream", "multi-nixl-hf3fs"),
        ),  # fmt: skip
        Const("Runner", "runner", "str", ("v1", "v2")),
        Const("Reaper", "reaper", "str", ("full-scan", "early-break")),
        Const("Transfer", "transfer", "str", ("pull", "push")),
        *(Const(n, k, "int") for n, k in _INTS.items()),
        *(Const(n, k, "bool") for n, k in _BOOLS.items()),
    ),
    invariants=("NoFreeUnderRead", "NoLateFinish", "AtMostOnceEmit", "NoWriteFromFreed"),
    # checked only in rows that name them: GuardsHold and the vacuity guard everywhere
    # (defaults), the fused-READ property where a row compares it with NoFreeUnderRead
    reach=("GuardsHold", "ReachReadThenFreed", "FusedNoFreeWhileInFlight",
           "ReachFreeUnderFinishedRead", "ReachFailedThenFreed", "ReachFreeUnderWrite"),
    liveness=("EveryRequestDone", "DelayedEventuallyFreed"),
    columns=("Variant", "Transfer", "TP", "PCP", "AMax", "QMax", "RMax", "MaxLost", "DStall",
             "HsMax", "PStep", "PHsMax", "NotifFirst"),
    title="producer engine against a lease clock (spec/KVClock.tla; ticks of lease / 6)",
    max_requests=2,
    modules=(REPO / "spec" / "KVCompletion.tla",),
    # the liveness runs of the TP 2 and two-request rows with heartbeats waiting at P (hbq)
    # took more than 300 s
    timeout_s=900,
)


_add_arguments, run = conform_command(
    CLOCK, "replay every row's edge-covering traces on the real classes",
    "kvspec.clock_traces:run_clock_conform",
)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_arguments(p)
    add_layout_argument(p, "--conform")
