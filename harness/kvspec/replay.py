"""Replay spec traces on a driver and classify the first divergence (pure; no pytest).

A trace is a path of the spec's state graph: states[0] is Init and actions[i] leads from
states[i] to states[i + 1]. `replay` drives the implementation through the same actions
and compares `observe()` with the trace after every step (ITF JSON on both sides).

Failure classes (the vocabulary of Mocket-style conformance testing):

* ``missing action``: the trace's next action is not in the driver's `enabled()`, or the
  driver raised `MissingAction` when asked to take it. The implementation cannot do a
  step the spec allows.
* ``unexpected action``: the implementation did something the spec does not allow here:
  either `enabled()` offers an action the spec's guards reject at this state (checked
  before stepping when ``strict_enabled``; a driver computing `enabled()` from its real
  state thus exposes extra behaviour even on paths the trace does not take), or, after
  the step, the observed state is the spec successor of a *different* action than the
  trace's (the implementation took another transition, e.g. the wrong rank).
* ``incorrect state``: the step was taken but the observed state is no spec successor of
  the previous state at all. The diff lists only the variables that differ.

A third outcome is neither: **inconclusive**. The driver raised `WaitTimeout` (a wait for
the implementation's asynchronous work expired), so the clock, not the implementation's
state, stopped the replay. `retry_timeouts` re-runs such a trace with longer waits and
reports it inconclusive only if every attempt timed out.

Used by the pytest suite (conformance/), `kvspec conform` and mutation testing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvspec.codec import to_itf
from kvspec.drivers.base import Driver, MissingAction, WaitTimeout
from kvspec.itf import JSON, value_to_itf
from kvspec.matrix import ModelRow
from kvspec.model import Action, Model, State, initial_state
from kvspec.tlcvalue import Value

MISSING = "missing action"
UNEXPECTED = "unexpected action"
INCORRECT = "incorrect state"
FAILURE_CLASSES = (MISSING, UNEXPECTED, INCORRECT)
# A trace that timed out is replayed this many times in all, each wait limit WAIT_GROWTH
# times the previous one (e.g. 120 s, 240 s, 480 s for the vLLM driver).
ATTEMPTS = 3
WAIT_GROWTH = 2.0


@dataclass(frozen=True)
class SpecTrace:
    """One trace to replay. `states` are ITF-encoded variable maps (no `#meta`)."""

    name: str  # "<model>/<stem>", the pytest id
    row: ModelRow
    states: list[dict[str, JSON]]
    actions: list[Action]
    expect_quiescent: frozenset[int] | None = None
    meta: dict[str, JSON] = field(default_factory=dict)


@dataclass(frozen=True)
class Divergence:
    cls: str  # one of FAILURE_CLASSES
    step: int  # index of the trace state that was expected (0 = init)
    action: str  # the trace action of that step ("init" for step 0)
    diff: dict[str, tuple[JSON, JSON]]  # variable -> (expected, observed), differing only
    detail: str = ""

    def to_json(self) -> dict[str, JSON]:
        return {
            "class": self.cls,
            "step": self.step,
            "action": self.action,
            "diff": {k: {"expected": e, "observed": o} for k, (e, o) in self.diff.items()},
            "detail": self.detail,
        }

    def format(self, trace: str, replay_cmd: str | None = None) -> str:
        lines = [f"{trace}: {self.cls} at step {self.step} ({self.action})"]
        if self.detail:
            lines.append(f"  {self.detail}")
        for var, (exp, obs) in self.diff.items():
            lines.append(f"  {var}: expected {_compact(exp)}")
            lines.append(f"  {' ' * len(var)}  observed {_compact(obs)}")
        if replay_cmd:
            lines.append(f"  replay: {replay_cmd}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Timeout:
    """Where a replay stopped because a wait expired (an inconclusive replay)."""

    step: int  # index of the trace state being reached (0 = building the driver)
    action: str  # the trace action of that step ("setup" for step 0)
    what: str  # what was waited for
    limit_s: float  # the limit that expired

    @classmethod
    def of(cls, exc: WaitTimeout, step: int, action: str) -> Timeout:
        return cls(step, action, exc.what, exc.limit_s)

    def to_json(self) -> dict[str, JSON]:
        return {"step": self.step, "action": self.action, "what": self.what,
                "limit_s": self.limit_s}  # fmt: skip

    def format(self, trace: str) -> str:
        return (
            f"{trace}: inconclusive at step {self.step} ({self.action}): "
            f"{self.what} did not happen in {self.limit_s}s"
        )


@dataclass(frozen=True)
class ReplayResult:
    trace: str
    steps: int  # actions executed and matched
    failure: Divergence | None
    timeout: Timeout | None = None  # inconclusive: a wait expired (never with a failure)
    attempts: int = 1  # replays it took (retry_timeouts)

    @property
    def ok(self) -> bool:
        """The implementation conformed: no divergence and no expired wait."""
        return self.failure is None and self.timeout is None


def _compact(v: JSON) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def encode(state: Mapping[str, Value]) -> dict[str, JSON]:
    return {k: value_to_itf(v) for k, v in state.items()}


def diff_states(expected: Mapping[str, JSON], observed: Mapping[str, JSON]) -> dict[str, Any]:
    """Variables whose values differ (a variable missing on one side shows as None)."""
    keys = sorted(set(expected) | set(observed))
    return {
        k: (expected.get(k), observed.get(k)) for k in keys if expected.get(k) != observed.get(k)
    }


def trace_from_doc(doc: Mapping[str, JSON], name: str) -> SpecTrace:
    """An ITF document written by `kvspec traces` as a SpecTrace."""
    meta = dict(doc["#meta"])
    states = [{k: v for k, v in st.items() if not k.startswith("#")} for st in doc["states"]]
    actions = [Action.parse(str(st["#meta"]["action"])) for st in doc["states"][1:]]
    quiet = meta.get("expect_quiescent")
    return SpecTrace(
        name=name,
        row=ModelRow.from_meta(meta),
        states=states,
        actions=actions,
        expect_quiescent=frozenset(int(r) for r in quiet) if quiet is not None else None,
        meta=meta,
    )


def load_trace(path: Path) -> SpecTrace:
    """`.../<model>/<stem>.itf.json` -> SpecTrace named `<model>/<stem>` (the pytest id)."""
    doc = json.loads(path.read_text())
    return trace_from_doc(doc, f"{path.parent.name}/{path.name.removesuffix('.itf.json')}")


def trace_from_actions(row: ModelRow, actions: list[Action], name: str) -> SpecTrace:
    """Run `actions` on the reference model (each must be enabled) and record the states."""
    model = Model(row)
    s = initial_state(row)
    states = [to_itf(row, s)]
    for a in actions:
        nxt = model.apply(s, a)
        if nxt is None:
            raise ValueError(f"{name}: {a} is not enabled after {len(states) - 1} steps")
        s = nxt
        states.append(to_itf(row, s))
    return SpecTrace(name, row, states, list(actions))


def _explain(model: Model, prev: State, action: Action, obs: Mapping[str, JSON]) -> str | None:
    """Which other action's spec successor the observed state is, if any (divergences only:
    successors are computed and encoded only to explain a failure)."""
    succ = model.successors(prev)
    others = sorted(a for a, t in succ if a != action and to_itf(model.row, t) == obs)
    if others:
        return f"the observed state is the spec successor of {others[0]}, not of {action}"
    return None


def replay(driver: Driver, trace: SpecTrace, *, strict_enabled: bool = True) -> ReplayResult:
    """Drive `driver` through `trace`; stop at the first divergence. Does not close it.

    The model state is carried along the trace (one `apply` per step), so a step costs one
    observation and one encoding; the trace's states are what the observation must equal.
    """
    model = Model(trace.row)
    s = initial_state(trace.row)
    obs = encode(driver.observe())
    d = diff_states(trace.states[0], obs)
    if d:
        return ReplayResult(trace.name, 0, Divergence(INCORRECT, 0, "init", d))
    for i, action in enumerate(trace.actions, 1):
        expected = trace.states[i]
        enabled = driver.enabled()
        if action not in enabled:
            why = f"{action} not in the driver's enabled() = [{', '.join(map(str, enabled))}]"
            return ReplayResult(trace.name, i - 1, Divergence(MISSING, i, str(action), {}, why))
        extra = [a for a in enabled if model.apply(s, a) is None] if strict_enabled else []
        if extra:
            why = "enabled() offers actions the spec forbids here: " + ", ".join(map(str, extra))
            return ReplayResult(trace.name, i - 1, Divergence(UNEXPECTED, i, str(action), {}, why))
        nxt = model.apply(s, action)
        if nxt is None:
            raise ValueError(f"{trace.name}: step {i} ({action}) is not a spec step")
        try:
            driver.step(action)
        except MissingAction as exc:
            return ReplayResult(
                trace.name, i - 1, Divergence(MISSING, i, str(action), {}, f"driver: {exc}")
            )
        except WaitTimeout as exc:
            return ReplayResult(trace.name, i - 1, None, Timeout.of(exc, i, str(action)))
        obs = encode(driver.observe())
        diff = diff_states(expected, obs)
        if diff:
            other = _explain(model, s, action, obs)
            cls = UNEXPECTED if other else INCORRECT
            div = Divergence(cls, i, str(action), diff, other or "")
            return ReplayResult(trace.name, i - 1, div)
        s = nxt
    n = len(trace.actions)
    if trace.expect_quiescent is not None:
        # A lasso's unrolled tail: these requests must still be unfreed (no progress).
        req = obs.get("req", [])
        freed = sorted(r for r in trace.expect_quiescent if r <= len(req) and req[r - 1] == "freed")
        if freed:
            why = f"requests {freed} were freed; the spec says no further progress"
            return ReplayResult(trace.name, n, Divergence(INCORRECT, n, "quiescent", {}, why))
    return ReplayResult(trace.name, n, None)


def replay_fresh(make: Callable[[ModelRow], Driver], trace: SpecTrace) -> ReplayResult:
    """Replay `trace` on a driver built for it, then closed. A wait that expires while the
    driver is built (a handshake, a pooled cluster's drain) is inconclusive at step 0."""
    try:
        driver = make(trace.row)
    except WaitTimeout as exc:
        return ReplayResult(trace.name, 0, None, Timeout.of(exc, 0, "setup"))
    with driver:
        return replay(driver, trace)


class _Timed(Protocol):
    @property
    def timeout(self) -> object: ...


R = TypeVar("R", bound=_Timed)


def retry_expired(
    run_once: Callable[[float], R], attempts: int = ATTEMPTS, growth: float = WAIT_GROWTH
) -> tuple[R, int]:
    """Call `run_once(wait_scale)` with wait_scale 1, growth, growth**2, ... until its
    result has no timeout, at most `attempts` times; the last result and the attempts it
    took. The one retry rule of every replay (producer, lease clock, KVClock).

    Only a timeout is retried: a divergence is the implementation's state, and replaying
    it again could only hide it. `run_once` must use a fresh driver each time."""
    result = run_once(1.0)
    n = 1
    while result.timeout is not None and n < attempts:
        result = run_once(growth**n)
        n += 1
    return result, n


def retry_timeouts(
    run_once: Callable[[float], ReplayResult],
    attempts: int = ATTEMPTS,
    growth: float = WAIT_GROWTH,
) -> ReplayResult:
    """retry_expired for a producer trace: the result records the attempts it took."""
    result, n = retry_expired(run_once, attempts, growth)
    return replace(result, attempts=n)


def replay_command(trace: str, driver: str = "reference", extra: str = "") -> str:
    """One line that replays just this trace in the pytest suite."""
    node = f"conformance/test_conformance.py::test_trace[{trace}]"
    return f".venv/bin/pytest '{node}' --driver {driver} {extra}".rstrip()
