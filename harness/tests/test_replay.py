"""A wait that expires is a timeout, never a verdict: replay, retries and `kvspec conform`.

Every timeout here is decided by construction (a fake driver raises WaitTimeout while its
wait limit is below a threshold); nothing races a clock.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvspec.conform import DriverFactory, VariantResult, conform, report, run_conform
from kvspec.drivers.base import Driver, MissingAction, WaitTimeout
from kvspec.drivers.reference import ReferenceDriver
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action
from kvspec.replay import (
    MISSING,
    ReplayResult,
    SpecTrace,
    Timeout,
    replay,
    replay_fresh,
    retry_timeouts,
    trace_from_actions,
)
from kvspec.report import _conform_context

ROW = ModelRow("t-shipped-nixl-pcp2", "v0.30-shipped", "nixl", Topology(1, 1, 2), 1, 1, False)
FIXED = ModelRow("t-fixed-nixl-pcp2", "fixed", "nixl", Topology(1, 1, 2), 1, 1, False)
PREFILL = [Action("schedule"), Action("execute_model"), Action("update_from_output")]
READ = "the READ of req-1 from rank 0 to complete"


def trace(row: ModelRow = ROW, name: str = "t/000") -> SpecTrace:
    return trace_from_actions(row, PREFILL, name)


class SlowRead(ReferenceDriver):
    """execute_model waits for a READ that takes `needs_s`: within a limit below that, the
    wait expires (as vLLM's driver raises WaitTimeout), at or above it, the step runs."""

    base_s = 10.0

    def __init__(self, row: ModelRow, wait_scale: float = 1.0, needs_s: float = 25.0) -> None:
        super().__init__(row)
        self.limit_s = self.base_s * wait_scale
        self.needs_s = needs_s

    def execute_model(self) -> None:
        if self.limit_s < self.needs_s:
            raise WaitTimeout(READ, self.limit_s)
        super().execute_model()


class CannotExecute(ReferenceDriver):
    """Negative control: the implementation's state forbids the step (a false guard)."""

    def execute_model(self) -> None:
        raise MissingAction("execute_model: no scheduled step to run")


def test_an_expired_wait_is_inconclusive_not_a_missing_action() -> None:
    with SlowRead(ROW) as d:
        res = replay(d, trace())
    assert res.failure is None and not res.ok
    assert res.timeout == Timeout(2, "execute_model", READ, 10.0)
    assert res.steps == 1  # schedule matched; execute_model never ran
    assert res.timeout.format("t/000") == (
        f"t/000: inconclusive at step 2 (execute_model): {READ} did not happen in 10.0s"
    )


def test_a_false_guard_is_still_a_missing_action() -> None:
    with CannotExecute(ROW) as d:
        res = replay(d, trace())
    assert res.timeout is None and res.failure is not None
    assert (res.failure.cls, res.failure.step, res.failure.action) == (
        MISSING, 2, "execute_model"
    )  # fmt: skip


def test_a_wait_that_expires_while_the_driver_is_built_is_inconclusive_at_setup() -> None:
    def make(row: ModelRow) -> Driver:
        raise WaitTimeout("the NIXL handshake with the producer", 120.0)

    res = replay_fresh(make, trace())
    assert res.failure is None
    assert res.timeout == Timeout(0, "setup", "the NIXL handshake with the producer", 120.0)


def _timeout(scale: float) -> ReplayResult:
    return ReplayResult("t", 0, None, Timeout(1, "schedule", "x", 10.0 * scale))


def test_retries_grow_the_wait_and_stop_at_the_first_run_that_does_not_time_out() -> None:
    scales: list[float] = []

    def once(scale: float) -> ReplayResult:
        scales.append(scale)
        return _timeout(scale) if scale < 2.0 else ReplayResult("t", 3, None)

    res = retry_timeouts(once, attempts=5, growth=2.0)
    assert scales == [1.0, 2.0]
    assert res.ok and res.attempts == 2


def test_a_trace_that_always_times_out_is_retried_then_left_inconclusive() -> None:
    scales: list[float] = []

    def once(scale: float) -> ReplayResult:
        scales.append(scale)
        return _timeout(scale)

    res = retry_timeouts(once, attempts=3, growth=2.0)
    assert scales == [1.0, 2.0, 4.0]
    assert res.timeout is not None and res.timeout.limit_s == 40.0 and res.attempts == 3


def test_a_divergence_is_not_retried() -> None:
    calls: list[float] = []

    def once(scale: float) -> ReplayResult:
        calls.append(scale)
        with CannotExecute(ROW) as d:
            return replay(d, trace())

    res = retry_timeouts(once)
    assert calls == [1.0] and res.failure is not None and res.attempts == 1


def slow_factory(needs_s: float) -> DriverFactory:
    def make(row: ModelRow, wait_scale: float = 1.0) -> Driver:
        return SlowRead(row, wait_scale, needs_s)

    return make


def test_conform_retries_a_slow_trace_with_longer_waits_until_it_conforms() -> None:
    # Limits 10 s, 20 s, 40 s: the 25 s READ completes on the third attempt.
    res = conform(slow_factory(25.0), [trace()])
    v = res["v0.30-shipped"]
    assert (v.traces, v.conforming, v.inconclusive, v.retries) == (1, 1, 0, 2)


def test_conform_with_only_timeouts_is_inconclusive_never_does_not_conform() -> None:
    traces = [trace(name="t/000"), trace(name="t/001")]
    res = conform(slow_factory(1000.0), traces)
    v = res["v0.30-shipped"]
    assert (v.traces, v.conforming, v.diverging, v.inconclusive, v.retries) == (2, 0, 0, 2, 4)
    assert v.first_divergence is None
    assert v.first_timeout == {
        "trace": "t/000", "attempts": 3, "step": 2, "action": "execute_model", "what": READ,
        "limit_s": 40.0,
    }  # fmt: skip
    lines = report(res, "impl", {})
    assert lines == [
        f"impl conforms to v0.30-shipped on 0 traces, inconclusive on 2 (timeouts; first: "
        f"{READ} did not happen in 40.0s at step 2 (execute_model) of t/000, 3 attempts)"
    ]


def test_a_variant_with_a_divergence_does_not_conform_whatever_timed_out() -> None:
    def make(row: ModelRow, wait_scale: float = 1.0) -> Driver:
        return CannotExecute(row) if row.variant == "fixed" else SlowRead(row, needs_s=1e9)

    traces = [trace(FIXED, "f/000"), trace(name="t/000"), trace(FIXED, "f/001")]
    res = conform(make, traces)
    assert res["fixed"].traces == 1 and res["fixed"].diverging == 1  # stopped at the first
    assert res["v0.30-shipped"].inconclusive == 1
    lines = report(res, "impl", {})
    assert lines[0].startswith("impl conforms to v0.30-shipped on 0 traces, inconclusive on 1")
    assert lines[1] == "impl does not conform to fixed: missing action at step 2 " \
        "(execute_model) of f/000"  # fmt: skip


def test_a_model_the_driver_cannot_build_is_not_driven_never_a_verdict() -> None:
    # The nightly spec-matrix replay met a PCP + DCP row the vLLM driver built without DCP:
    # a divergence "at init" that stopped v0.30-shipped. A row the driver cannot build is
    # now skipped by name; the other models still decide the design.
    from kvspec.drivers.vllm_env import DriverUnavailable

    dcp = ModelRow("t-shipped-dcp2", "v0.30-shipped", "nixl", Topology(1, 1, 2), 1, 1, False)

    def make(row: ModelRow, wait_scale: float = 1.0) -> Driver:
        if row.name == dcp.name:
            raise DriverUnavailable("PCP + DCP sharded mode")
        return ReferenceDriver(row)

    traces = [trace(dcp, "d/000"), trace(name="t/000"), trace(dcp, "d/001")]
    v = conform(make, traces)["v0.30-shipped"]
    assert (v.traces, v.conforming, v.skipped) == (1, 1, 2)
    assert v.first_divergence is None and v.not_driven == {dcp.name: "PCP + DCP sharded mode"}
    lines = report({"v0.30-shipped": v}, "impl", {})
    assert lines[0] == "impl conforms to v0.30-shipped (1 traces)"
    assert lines[1] == (
        "  v0.30-shipped: 2 traces not driven here: t-shipped-dcp2 (PCP + DCP sharded mode)"
    )
    # Negative control: a design none of whose traces could be driven conforms to nothing.
    only = conform(make, [trace(dcp, "d/000")])
    assert report(only, "impl", {})[0] == "impl conforms to no variant"


def itf_doc(t: SpecTrace) -> dict[str, object]:
    """`t` as the ITF document `kvspec traces` writes (what load_trace reads)."""
    actions = ["init", *map(str, t.actions)]
    states = [{**s, "#meta": {"action": a}} for s, a in zip(t.states, actions, strict=True)]
    return {"#meta": t.row.to_meta(), "states": states}


def test_conform_json_and_report_carry_the_inconclusive_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvspec import conform as conform_mod

    root = tmp_path / "traces"
    path = root / ROW.variant / ROW.name / "000.itf.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(itf_doc(trace())))
    monkeypatch.setattr(conform_mod, "driver_factory", lambda *a: slow_factory(1e9))
    out = tmp_path / "conform.json"
    doc = run_conform(driver="reference", traces_dir=root, results_path=tmp_path / "none.json",
                      json_out=out)  # fmt: skip
    v = json.loads(out.read_text())["variants"][ROW.variant]
    assert (v["traces"], v["conforming"], v["diverging"], v["inconclusive"]) == (1, 0, 0, 1)
    assert v["first_timeout"]["what"] == READ and v["first_divergence"] is None
    assert "does not conform" not in " ".join(doc["summary"])
    rows = _conform_context(doc)["variants"]
    assert [(r["name"], r["verdict"], r["ok"]) for r in rows] == [
        (ROW.variant, "inconclusive on 1", False)
    ]


def test_report_verdicts() -> None:
    def ctx(**v: object) -> str:
        doc = {"vllm": "x", "device": "cpu", "variants": {"a": {"first_divergence": None, **v}}}
        return str(_conform_context(doc)["variants"][0]["verdict"])

    assert ctx(traces=3, conforming=3) == "conforms"
    assert ctx(traces=3, conforming=1, inconclusive=2) == "inconclusive on 2"
    assert ctx(traces=3, conforming=2) == "diverges"  # uncounted traces: not inconclusive
    assert VariantResult().to_json()["inconclusive"] == 0


def test_conform_with_a_variant_exits_1_unless_every_driven_trace_conforms() -> None:
    from kvspec.conform import _variant_exit

    def doc(**v: object) -> dict[str, object]:
        base = {"traces": 3, "diverging": 0, "inconclusive": 0}
        return {"variants": {"fixed": {**base, **v}}}

    assert _variant_exit(doc(), "fixed") == 0
    assert _variant_exit(doc(diverging=1), "fixed") == 1
    assert _variant_exit(doc(inconclusive=1), "fixed") == 1
    assert _variant_exit(doc(traces=0), "fixed") == 1
    assert _variant_exit(doc(), "v0.29") == 1


class Raises(ReferenceDriver):
    """A replay that raises what no verdict explains (as a kernel the GPU bundle lacks)."""

    def execute_model(self) -> None:
        raise AttributeError("'_OpNamespace' '_C_cache_ops' object has no attribute 'x'")


def test_a_replay_that_raises_is_errored_and_the_run_goes_on() -> None:
    # On the GPU a stock path's missing kernel stopped the whole `kvspec conform` run; one
    # broken replay now errs alone, is named, and decides nothing.
    def make(row: ModelRow, wait_scale: float = 1.0) -> Driver:
        return Raises(row) if row.variant == "fixed" else ReferenceDriver(row)

    traces = [trace(FIXED, "f/000"), trace(name="t/000"), trace(FIXED, "f/001")]
    res = conform(make, traces)
    f = res["fixed"]
    assert (f.traces, f.errored, f.diverging, f.conforming) == (2, 2, 0, 0)
    assert f.first_error == {
        "trace": "f/000",
        "error": "AttributeError: '_OpNamespace' '_C_cache_ops' object has no attribute 'x'",
    }
    assert res["v0.30-shipped"].conforming == 1  # the next variant still ran
    lines = report(res, "impl", {})
    assert lines[0] == "impl conforms to v0.30-shipped (1 traces)"
    assert "does not conform to fixed" not in " ".join(lines)  # an error is never a verdict
    assert "impl conforms to fixed" not in " ".join(lines)  # nor "conforms" on errors alone
    assert lines[1].startswith("  fixed: 2 traces errored (no verdict; tracebacks in the log)")
    from kvspec import conform as conform_mod

    doc = {"variants": {"fixed": f.to_json()}}
    assert conform_mod._errored(doc) and conform_mod._variant_exit(doc, "fixed") == 1
    rows = _conform_context({"vllm": "x", "device": "cpu", **doc})["variants"]
    assert rows[0]["verdict"] == "errored on 2"
    # Negative control: a driver that only diverges is a verdict, not an error.
    div = conform(lambda row, wait_scale=1.0: CannotExecute(row), [trace(FIXED, "f/000")])
    assert div["fixed"].errored == 0 and div["fixed"].diverging == 1
    assert not conform_mod._errored({"variants": {"fixed": div["fixed"].to_json()}})
