"""Replay a LeaseClock trace (an ITF document: a TLC counterexample of `kvspec lease`) on
the real classes through drivers.lease_driver, comparing after every step what the spec
says with what vLLM's worker holds (p, ttl of a leased request, d). The spec's action
labels carry no parameters; each step's request is read off the state change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.drivers.base import MissingAction, WaitTimeout
from kvspec.itf import JSON

Observed = dict[int, tuple[str, int | None, str]]


@dataclass(frozen=True)
class LeaseReplay:
    steps: int  # steps replayed and matched
    divergence: str | None  # None: the real classes followed the whole trace
    timeout: str | None = None  # a wait expired: inconclusive, never a verdict


def expected(state: dict[str, Any]) -> Observed:
    p, ttl, d = state["p"], state["ttl"], state["d"]
    return {
        r: (p[r - 1], ttl[r - 1] if p[r - 1] == "leased" else None, d[r - 1])
        for r in range(1, len(p) + 1)
    }


def _changed(a: dict[str, Any], b: dict[str, Any], var: str) -> int:
    diff = [i + 1 for i, (x, y) in enumerate(zip(a[var], b[var], strict=True)) if x != y]
    if len(diff) != 1:
        raise ValueError(f"{var} changed for {diff}, expected exactly one request")
    return diff[0]


def step_of(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """(driver method, args) for the spec step a -> b."""
    action = str(b["#meta"]["action"])
    if action in ("start_read", "read_done", "abandon"):
        return action, (_changed(a, b, "d"),)
    if action == "deliver":
        new = set(b["notif"]["#set"]) - set(a["notif"]["#set"])
        return "deliver", (new.pop(),)
    if action == "heartbeat":
        if a["hs"] != b["hs"]:
            return "skip", ()  # swallowed by the pending handshake: nothing is sent
        return "heartbeat", (b["lost"] == a["lost"],)
    if action in ("reap", "tick"):
        return action, ()
    raise ValueError(f"unknown LeaseClock action {action!r}")


def overtakes(doc: dict[str, JSON]) -> bool:
    """Whether a notification overtakes its READ in the trace (NotifFirst): a `deliver`
    step after which the READ is still in progress. The lease driver must then inject that
    ordering at its NIXL seam (`LeaseDriver(notif_first=True)`)."""
    raw: Any = doc["states"]
    return any(s["#meta"]["action"] == "deliver" and "reading" in s["d"] for s in list(raw)[1:])


def replay_lease(doc: dict[str, JSON], driver: Any) -> LeaseReplay:
    raw: Any = doc["states"]
    states: list[dict[str, Any]] = list(raw)

    def check(i: int) -> str | None:
        got, want = driver.observe(), expected(states[i])
        return None if got == want else f"step {i}: spec {want}, vLLM {got}"

    if (bad := check(0)) is not None:
        return LeaseReplay(0, bad)
    for i in range(1, len(states)):
        name, args = step_of(states[i - 1], states[i])
        try:
            if name != "skip":
                getattr(driver, name)(*args)
        except MissingAction as exc:
            return LeaseReplay(i - 1, f"step {i} ({name}{args}): vLLM cannot: {exc}")
        except WaitTimeout as exc:
            return LeaseReplay(i - 1, None, f"step {i} ({name}): {exc}")
        if (bad := check(i)) is not None:
            return LeaseReplay(i, bad)
    return LeaseReplay(len(states) - 1, None)


LEASE_REGRESSIONS = Path(__file__).resolve().parents[2] / "conformance" / "lease"


@dataclass(frozen=True)
class LeaseRun:
    """The first lease regression that did not replay: its name, and either the step and
    divergence, a crash of vLLM (detail), or an expired wait (inconclusive)."""

    trace: str | None = None
    step: int | None = None
    divergence: str = ""
    crash: str = ""
    timeout: str = ""


def run_lease_regressions(root: Path = LEASE_REGRESSIONS) -> LeaseRun:
    """Replay every committed LeaseClock counterexample on the real classes (the mutation
    campaign's last traces: mutants of the lease, heartbeat and reaper code)."""
    import json

    from kvspec.drivers.lease_driver import LeaseDriver

    for path in sorted(root.glob("*.itf.json")):
        doc = json.loads(path.read_text())
        name = f"lease/{path.name.removesuffix('.itf.json')}"
        try:
            with LeaseDriver(len(doc["states"][0]["p"]), notif_first=overtakes(doc)) as d:
                res = replay_lease(doc, d)
        except WaitTimeout as exc:
            return LeaseRun(name, timeout=str(exc))
        except Exception as exc:  # a mutant that crashes vLLM
            return LeaseRun(name, crash=f"{type(exc).__name__}: {exc}")
        if res.timeout is not None:
            return LeaseRun(name, timeout=res.timeout)
        if res.divergence is not None:
            return LeaseRun(name, res.steps, res.divergence)
    return LeaseRun()
