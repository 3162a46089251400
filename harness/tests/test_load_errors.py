"""A failed load on vLLM 0.29, which has no failed_recving (recorded real run,
conformance/recorded/pd-handshake-fail-v0.29): its worker reports a failed receive in
finished_recving only and marks its blocks invalid (0.29 base_worker.py:2218-2228,
2422-2435). The recorder's `load_errors` event names the receives whose blocks those are,
and the decode and clock mappings read them as failures. So read, 0.29's failed
handshake is 0.32's decode design and KVClock's abandon. The negative controls drop the
load_errors events: the same run is then a successful receive with no READ, which both
specs reject."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from kvspec.record.clock_mapping import map_clock
from kvspec.record.decode_mapping import map_decode
from kvspec.record.log import Event, read_dir
from kvspec.validate_clock import check_clock
from kvspec.validate_decode import check_bug

RUN = Path(__file__).resolve().parents[2] / "conformance" / "recorded" / "pd-handshake-fail-v0.29"
META = json.loads((RUN / "expect.json").read_text())


def _events(load_errors: bool = True) -> list[Event]:
    return [e for e in read_dir(RUN) if load_errors or e.call != "load_errors"]


def _decided(verdict: str, detail: str) -> None:
    if verdict == "inconclusive":  # TLC timed out twice (a loaded machine): no verdict
        pytest.skip(f"inconclusive: {detail}")


def _failed_execute(events: list[Event]) -> int:
    """The execute that reports both receives finished (failed or not)."""
    log = map_decode(events).log
    return next(n for n, e in enumerate(log) if e.a == "execute" and any(e.out))


def test_0_29_reports_the_failure_in_finished_recving_only() -> None:
    ev = _events()
    start = next(e for e in ev if e.engine == "D" and e.call == "start")
    assert start.result["vllm"] == "0.29.0"
    assert not any(e.ids("failed_recving") for e in ev)
    d_reqs = {e.reqs[0] for e in ev if e.engine == "D" and e.call == "add_request"
              and e.result["remote_prefill"]}  # fmt: skip
    errors = [e for e in ev if e.call == "load_errors"]
    assert len(errors) == 1 and set(errors[0].reqs) == d_reqs
    update = next(e for e in ev if e.engine == "D" and e.call == "update_from_output"
                  and e.ids("finished_recving"))  # fmt: skip
    assert update.ids("finished_recving") == d_reqs and update.result["invalid_block_ids"]


def test_the_mappings_read_the_load_errors_as_failed_receives() -> None:
    log = map_decode(_events()).log
    assert [sorted(f) for f in log[_failed_execute(_events())].fail] == [[1, 2]]
    clock = map_clock(_events()).log
    assert sum(1 for e in clock if e.a == "abandon") == META["clock"]["abandoned"]
    assert not any(e.a in ("read", "recv") for e in clock)  # D never READ


def test_negative_control_without_load_errors_they_are_receives_with_no_read() -> None:
    ev = _events(load_errors=False)
    assert [sorted(f) for f in map_decode(ev).log[_failed_execute(ev)].fail] == [[]]
    clock = map_clock(ev).log
    assert [e.a for e in clock if e.a in ("recv", "abandon")] == ["recv", "recv"]


def test_the_decode_side_is_0_32s_design(tmp_path: Path) -> None:
    m = map_decode(_events())
    assert META["decode_admitted_by"] == "none"
    v = check_bug(m, "none", tmp_path)
    _decided(v.verdict, v.detail)
    assert (v.verdict, v.explained) == ("admitted", len(m.log))


def test_negative_control_without_load_errors_0_32s_design_rejects_it(tmp_path: Path) -> None:
    ev = _events(load_errors=False)
    v = check_bug(map_decode(ev), "none", tmp_path)
    _decided(v.verdict, v.detail)
    assert (v.verdict, v.explained) == ("rejected", _failed_execute(ev))


@pytest.mark.slow
@pytest.mark.parametrize("load_errors", [True, False])
def test_the_clock_admits_it_only_with_the_load_errors(load_errors: bool, tmp_path: Path) -> None:
    cm = map_clock(_events(load_errors))
    v = check_clock(cm, "v0.30-shipped", tmp_path)
    _decided(v.design.verdict, v.design.detail)
    if load_errors:
        assert (v.design.verdict, v.design.explained, v.safe) == ("admitted", len(cm.log), "safe")
    else:
        first = next(n for n, e in enumerate(cm.log) if e.a == "recv")
        assert (v.design.verdict, v.design.explained) == ("rejected", first)


def test_an_event_of_another_engine_is_not_a_load_error() -> None:
    """Only D's workers' load errors count: the same event from P changes nothing."""
    ev = [dataclasses.replace(e, engine="P") if e.call == "load_errors" else e
          for e in _events()]  # fmt: skip
    assert not any(any(f) for f in (e.fail for e in map_decode(ev).log if e.a == "execute"))
