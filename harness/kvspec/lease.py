"""`kvspec lease`: the lease-clock sweep. Each row of spec/lease-matrix.toml is a set of
constants for spec/LeaseClock.tla (the producer's send lease against a discrete clock, the
decode side's bounded queue wait and READ, a lossy heartbeat channel); TLC decides
NoFreeUnderRead and ExpiredReapedAtOnce (one run, -continue: every violated invariant with
its shortest counterexample) and EventuallyFreed (a second run), and each verdict is
compared with the row's expectation (the machinery is kvspec.sweep's).

`kvspec lease [--tier fast|full] [--only NAME] [--json F] [--out DIR]`; exit 1 when a
verdict differs from its expectation, 2 on a bad matrix (one line: file, row, what to do).
`kvspec lease --conform ...` replays every row's edge-covering traces on vLLM's real lease
code instead (kvspec.lease_traces); exit 1 on a divergence.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvspec.drivers.prefix_layout import add_layout_argument
from kvspec.sweep import (
    Const,
    Sweep,
    SweepMatrixError,
    SweepResult,
    SweepRow,
    add_sweep_arguments,
    check_sweep_row,
    load_sweep_matrix,
    run_sweep,
)

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "spec" / "LeaseClock.tla"
MATRIX = REPO / "spec" / "lease-matrix.toml"
INVARIANTS = ("NoFreeUnderRead", "ExpiredReapedAtOnce")
# Vacuity guards: checked only in the rows that name them (each row expects them violated).
REACH = ("ReachLateHeartbeat",)
LIVENESS = ("EventuallyFreed",)
PROPERTIES = INVARIANTS + REACH + LIVENESS
# Constant name in LeaseClock.tla <- key in the matrix.
_INTS = {
    "Lease": "lease", "HbEvery": "hb_every", "Extend": "extend", "QMax": "qmax",
    "RMax": "rmax", "NMax": "nmax", "MaxLost": "max_lost", "DStall": "dstall",
}  # fmt: skip
_BOOLS = {"Swallow": "swallow", "NotifFirst": "notif_first", "Abandon": "abandon"}
LEASE = Sweep(
    command="lease",
    spec=SPEC,
    matrix=MATRIX,
    consts=(
        *(Const(n, k, "int") for n, k in _INTS.items()),
        *(Const(n, k, "bool") for n, k in _BOOLS.items()),
        Const("Reaper", "reaper", "str", ("early-break", "full-scan")),
    ),
    invariants=INVARIANTS,
    reach=REACH,
    liveness=LIVENESS,
    columns=("QMax", "RMax", "MaxLost", "DStall", "Reaper"),
    title="lease clock (ticks of kv_lease_duration / 6)",
)

LeaseMatrixError = SweepMatrixError
LeaseRow = SweepRow
LeaseResult = SweepResult


def load_lease_matrix(path: Path = MATRIX) -> list[SweepRow]:
    return load_sweep_matrix(LEASE, path)


def check_lease_row(row: SweepRow, work: Path) -> SweepResult:
    return check_sweep_row(LEASE, row, work)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sweep_arguments(LEASE, p)
    p.add_argument(
        "--conform",
        action="store_true",
        help="replay each row's edge-covering traces on vLLM's real lease code",
    )
    add_layout_argument(p, "--conform")


def run(args: argparse.Namespace) -> int:
    if not args.conform:
        return run_sweep(LEASE, args)
    from kvspec.lease_conform import run_lease_conform

    return run_lease_conform(LEASE, args)
