"""KVClock traces (spec/KVClock.tla) replayed on the real classes (issue #13).

As for LeaseClock (kvspec.lease_traces, whose graph and edge-cover code this reuses): TLC
dumps a row's state graph, `cover_edges` paths cover every edge, each path is an ITF
document in TLC's counterexample form, and `replay_clock` drives it on a
drivers.clock_driver.ClockDriver, comparing after every step the variables the driver
can see. TLC's action labels carry no parameters: `step_of` reads each step's request and
rank off the state change.

`kvspec clock --conform [--tier fast|full] [--only ROW]`: per row, edges, traces,
conforming / diverging / inconclusive / not driven; exit 1 on a divergence. Rows whose
design the installed vLLM is not (v0.29, naive-replicas, the early-break reaper) or that
need what the driver cannot inject (a notification overtaking its READ) are not driven.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvspec.drivers.base import MissingAction, WaitTimeout
from kvspec.drivers.prefix_layout import LAYOUTS, ONE_BLOCK, Layout, unsupported
from kvspec.itf import JSON, value_from_itf
from kvspec.lease_conform import run_conform_rows
from kvspec.lease_replay import LeaseReplay
from kvspec.lease_traces import (
    TRACES,
    LeaseConformance,
    _edges,
    edge_paths,
    edge_traces,
    lease_graph,
)
from kvspec.matrix import ModelRow, Topology
from kvspec.replay import retry_expired
from kvspec.sweep import Sweep, SweepRow
from kvspec.tlcvalue import Value, make_fn
from kvspec.vocab import VARIABLES

# Designs the installed vLLM can be driven as: as shipped, and #53903's fix by its patch.
PATCH = {"v0.30-shipped": None, "fixed": "fix-53903"}


def patch_for(row: SweepRow) -> str | None:
    """The impl patch a row is driven with: its design's, or the proposed push fix."""
    if row.consts.get("PushLeaseCheck"):
        return "push-lease-check"
    return PATCH[str(row.consts["Variant"])]


def model_row(row: SweepRow) -> ModelRow:
    c = row.consts
    return ModelRow(
        row.name, str(c["Variant"]), str(c["Composition"]),
        Topology(int(c["TP"]), int(c["PP"]), int(c["PCP"])), row.requests,
        int(c["Capacity"]), bool(c["AsyncScheduling"]), runner=str(c["Runner"]),
        reaper=str(c["Reaper"]), transfer=str(c["Transfer"]), timing="untimed",
    )  # fmt: skip


def why_not_driven(row: SweepRow) -> str | None:
    """Why the installed vLLM (0.31+: full-scan reaper) cannot be driven as this row."""
    c = row.consts
    if c["Variant"] not in PATCH:
        return f"design {c['Variant']} is not the installed vLLM's"
    if c["Reaper"] != "full-scan":
        return "the early-break reaper is 0.29/0.30's"
    if c["NotifFirst"]:
        return "a notification overtaking its READ (only the LeaseClock driver injects it)"
    return None


def _decode(state: dict[str, JSON]) -> dict[str, Value]:
    return {k: value_from_itf(v) for k, v in state.items() if not k.startswith("#")}


def _fn(v: Any) -> dict[Any, Any]:
    return v.as_dict() if hasattr(v, "as_dict") else dict(enumerate(v, start=1))


def _rd_change(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int]:
    out = [
        (r, w)
        for r, per in _fn(b["rd"]).items()
        for w, s in _fn(per).items()
        if _fn(_fn(a["rd"])[r])[w] != s
    ]
    if len(out) != 1:
        raise ValueError(f"rd changed at {out}, expected one (request, rank)")
    return out[0]


def _one(new: frozenset[Any], old: frozenset[Any], what: str) -> Any:
    diff = sorted(new - old)
    if len(diff) != 1:
        raise ValueError(f"{what} gained {diff}, expected one")
    return diff[0]


def step_of(
    a: dict[str, Any], b: dict[str, Any], action: str, sources: frozenset[int]
) -> tuple[str, tuple[Any, ...]]:
    """(driver method, args) for the spec step a -> b labelled `action`; `sources`: the
    producer ranks D reads and heartbeats."""
    if action in ("schedule", "execute_model", "update_from_output", "tick", "handshake_done"):
        return action, ()
    if action in ("consumer_start_load_kv", "consumer_get_finished", "push_write",
                  "push_write_done"):
        return action, _rd_change(a, b)
    if action == "consumer_read_done":
        return action, tuple(_one(b["land"], a["land"], "land"))
    if action == "consumer_read_fails":
        return action, tuple(_one(b["failed"], a["failed"], "failed"))
    if action in ("abandon", "consumer_finish"):
        return action, (_one(b["gone"], a["gone"], "gone"),)
    if action == "consumer_fail":
        return action, (_one(b["seen"], a["seen"], "seen"),)
    if action == "consumer_add_request":
        return action, (_one(b["atD"], a["atD"], "atD"),)
    if action == "consumer_update":
        return action, (_one(b["seen"], a["seen"], "seen"),)
    if action == "abort":
        changed = [i for i, (x, y) in enumerate(zip(a["req"], b["req"], strict=True), 1) if x != y]
        return action, (changed[0],)
    if action == "store_complete":
        for w, s in _fn(a["store"]).items():
            gone = s - _fn(b["store"])[w]
            if gone:
                return action, (min(gone), w)
        raise ValueError("store_complete changed no store")
    if action == "push_match":  # push: rank w's writer parks r on its handshake with D
        return action, next(
            (r, w) for w, c in _fn(b["claim"]).items() for r in sorted(c - _fn(a["claim"])[w])
        )
    if action == "push_handshake_done":
        return action, (next(w for w, s in _fn(a["phs"]).items() if s != _fn(b["phs"])[w]),)
    if action == "push_deferred":  # push: rank w's writer re-drives r from its inbox
        return action, next(
            (r, w) for w, d in _fn(a["defer"]).items() for r in sorted(d - _fn(b["defer"])[w])
        )
    if action == "writer_poll":  # push: rank w's writer forwards what its agent holds
        return action, (next(w for w, s in _fn(a["hbq"]).items() if s and not _fn(b["hbq"])[w]),)
    if action == "heartbeat":
        if a["hs"] != "done":
            return "heartbeat_swallowed", ()  # starts or waits for the handshake: not sent
        return action, (_lost(a, b, sources),)
    raise ValueError(f"unknown KVClock action {action!r}")


def _lost(a: dict[str, Any], b: dict[str, Any], sources: frozenset[int]) -> frozenset[int]:
    """The producer ranks whose heartbeat message the step lost, read off its effect (the
    count `lost` says how many, not which): a delivered message adds the requests D tracks
    that P still holds to the rank's waiting heartbeats (hbq), so a rank whose hbq did not
    change lost it; where they were all waiting already, delivered and lost are the same
    step, and the driver delivers."""
    req = _fn(a["req"])
    tracked = {r for r in a["atD"] - a["gone"] - a["seen"] if req[r] == "sending"}
    return frozenset(
        w for w in sources
        if not tracked <= _fn(a["hbq"])[w] and _fn(b["hbq"])[w] == _fn(a["hbq"])[w]
    )  # fmt: skip


def installed_ttl(state: dict[str, Any]) -> Value:
    """`ttl` where a worker holds the lease (r in lease[w]), else 0: what ClockDriver can
    see (before the worker installs it, the deadline is the scheduler's)."""
    lease = _fn(state["lease"])
    return make_fn(
        (w, tuple(t if r in lease[w] else 0 for r, t in sorted(_fn(per).items())))
        for w, per in sorted(_fn(state["ttl"]).items())
    )


def _projection(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: state[k] for k in VARIABLES}  # all of KVCompletion's
    out["ttl"] = installed_ttl(state)
    out["land"] = state["land"]
    out["hbq"] = state["hbq"]
    return out


# A KVClock replay's outcome has the lease replay's shape: steps matched, the divergence,
# or the wait that expired.
ClockReplay = LeaseReplay


def replay_clock(doc: dict[str, JSON], driver: Any) -> ClockReplay:
    raw: Any = doc["states"]
    sources = driver.sources()
    states = [_decode(s) for s in raw]

    def check(i: int) -> str | None:
        got, want = _projection(driver.observe()), _projection(states[i])
        bad = sorted(k for k in want if got[k] != want[k])
        return (
            None
            if not bad
            else f"step {i}: " + "; ".join(f"{k}: spec {want[k]!r}, vLLM {got[k]!r}" for k in bad)
        )

    if (bad := check(0)) is not None:
        return ClockReplay(0, bad)
    for i in range(1, len(states)):
        action = str(raw[i]["#meta"]["action"])
        try:
            name, args = step_of(states[i - 1], states[i], action, sources)
            getattr(driver, name)(*args)
        except MissingAction as exc:
            return ClockReplay(i - 1, f"step {i} ({action}): vLLM cannot: {exc}")
        except WaitTimeout as exc:
            return ClockReplay(i - 1, None, f"step {i} ({action}): {exc}")
        if (bad := check(i)) is not None:
            return ClockReplay(i, bad)
    return ClockReplay(len(states) - 1, None)


DriverFactory = Callable[[ModelRow, str | None, float], Any]


def _vllm_clock_driver(
    row: ModelRow, patch: str | None, wait_scale: float, layout: Layout = ONE_BLOCK
) -> Any:
    from kvspec.drivers.clock_driver import ClockDriver
    from kvspec.drivers.vllm_inbox import DEFAULT_WAITS

    waits = DEFAULT_WAITS.scaled(wait_scale)
    return ClockDriver(row, impl_patch=patch, waits=waits, layout=layout)


def clock_driver_factory(layout: Layout = ONE_BLOCK) -> DriverFactory:
    """The real clock driver with P's prompts and prefix caching laid out as `layout`
    (drivers/prefix_layout.py)."""

    def make(row: ModelRow, patch: str | None, wait_scale: float) -> Any:
        return _vllm_clock_driver(row, patch, wait_scale, layout)

    return make


def replay_retrying(
    doc: dict[str, JSON], mrow: ModelRow, patch: str | None,
    make_driver: DriverFactory = _vllm_clock_driver, attempts: int = 2,
) -> ClockReplay:  # fmt: skip
    """Replay one trace on fresh drivers (replay.retry_expired); a wait that expired, in
    set-up or a step, is retried with longer waits; still expired: a timeout
    (inconclusive), never a divergence."""

    def once(wait_scale: float) -> ClockReplay:
        try:
            with make_driver(mrow, patch, wait_scale) as driver:
                return replay_clock(doc, driver)
        except WaitTimeout as exc:
            return ClockReplay(0, None, str(exc))

    return retry_expired(once, attempts)[0]


def replay_docs(
    row: SweepRow, edges: int, docs: list[dict[str, JSON]],
    make_driver: DriverFactory = _vllm_clock_driver, attempts: int = 2,
) -> LeaseConformance:  # fmt: skip
    """Replay `docs` of `row` (replay_retrying); a trace still timed out is counted
    inconclusive."""
    res = LeaseConformance(row.name, edges, len(docs))
    mrow, patch = model_row(row), patch_for(row)
    for doc in docs:
        got = replay_retrying(doc, mrow, patch, make_driver, attempts)
        why = got.timeout or ""
        res.record(f"{row.name}/{doc['#meta']['trace']}", None if why else got.divergence, why)
    return res


# A row with more edge-covering traces than this replays an even, deterministic sample of
# this many (every k-th in TLC's BFS order): TP 2 with lost messages has ~30,000.
SAMPLE_CAP = 2000


def even_step(total: int, cap: int = SAMPLE_CAP) -> int:
    """k such that every k-th of `total` traces leaves at most `cap` (1: all of them)."""
    return max(1, -(-total // cap))  # ceil


def conform_row(
    sweep: Sweep, row: SweepRow, work: Path,
    make_driver: DriverFactory = _vllm_clock_driver, limit: int | None = None,
) -> LeaseConformance:  # fmt: skip
    """Replay `row`'s edge-covering traces (the first `limit` when given: make test's
    sample; an even sample of SAMPLE_CAP when there are more)."""
    g = lease_graph(sweep, row, work / row.name)
    paths = edge_paths(g)
    total, k = len(paths), even_step(len(paths))
    pick = (lambda n: n < limit) if limit is not None else (lambda n: n % k == 0)
    docs = edge_traces(g, row, pick, paths)
    (work / row.name / TRACES).write_text(json.dumps(docs) + "\n")
    res = replay_docs(row, len(_edges(g)), docs, make_driver)
    res.of = total
    return res


def run_clock_conform(sweep: Sweep, args: argparse.Namespace) -> int:
    """`kvspec clock --conform [--layout L]`: P's prompts and prefix caching laid out as L;
    a row the layout cannot run (DCP > 1) is not driven."""
    layout = args.layout
    make = clock_driver_factory(LAYOUTS[layout])

    def not_driven(row: SweepRow) -> str | None:
        return why_not_driven(row) or unsupported(LAYOUTS[layout], model_row(row))

    return run_conform_rows(
        sweep, args, lambda s, r, w: conform_row(s, r, w, make),
        "KVClock traces on the real classes", not_driven, layout,
    )  # fmt: skip


CLOCK_REGRESSIONS = Path(__file__).resolve().parents[2] / "conformance" / "clock"


def regression_row(path: Path, rows: dict[str, SweepRow]) -> SweepRow:
    """A kept counterexample `<row>-<Property>.itf.json`: its matrix row."""
    stem = path.name.removesuffix(".itf.json")
    name = next((n for n in sorted(rows, key=len, reverse=True) if stem.startswith(n + "-")), None)
    if name is None:
        raise ValueError(f"{path}: names no row of spec/clock-matrix.toml; rename it <row>-<prop>")
    return rows[name]


def replay_regression(
    path: Path, row: SweepRow, make_driver: DriverFactory = _vllm_clock_driver
) -> ClockReplay:
    """Replay one kept KVClock counterexample on the real classes (a timeout retried)."""
    doc = json.loads(path.read_text())
    return replay_retrying(doc, model_row(row), patch_for(row), make_driver)
