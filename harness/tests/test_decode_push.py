"""Push mode on the decode side (spec/Decode.tla's Transfer = "push", DecodeTrace.tla):
a real push D (conformance/recorded/pd-push, vLLM 0.32's NixlPushConnector) posts no
READ, registers its blocks once its handshake with P returns and reports both receives
one step later, when P's WRITEs have landed. Admitted by 0.32's design; the same log read
as pull (D would READ after the handshake) is rejected at that report, and so is the
report moved before D's handshake returned (nothing could have been registered)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from decode_checks import decode_verdict
from kvspec.decode import PUSH_BUGS
from kvspec.record.decode_mapping import DecodeMapped, map_decode
from kvspec.record.log import Event, read_dir
from kvspec.validate_decode import constants

RUN = Path(__file__).resolve().parents[2] / "conformance" / "recorded" / "pd-push"


def _report(m: DecodeMapped) -> int:
    """The log index of D's step that reports both receives."""
    return next(n for n, e in enumerate(m.log) if e.a == "execute" and any(e.out))


def _sorted(events: list[Event]) -> list[Event]:
    return sorted(events, key=lambda e: (e.t_ns, e.pid, e.seq))  # read_dir's order


def test_a_push_d_maps_with_push_constants_and_no_read() -> None:
    m = map_decode(read_dir(RUN))
    c = constants(m, "none")
    assert (c["Transfer"], c["PushHandshakeFail"], c["Composition"]) == ('"push"', "TRUE",
                                                                        '"nixl"')  # fmt: skip
    assert not any(any(e.reads) for e in m.log)
    hs = next(n for n, e in enumerate(m.log) if e.a == "hs")
    assert hs < _report(m)



def test_the_push_designs_are_the_ones_decode_tla_assumes_for_push() -> None:
    # kvspec.decode.PUSH_BUGS against the spec's own ASSUME (a push design the spec
    # refuses would be a TLC error per design, not a verdict)
    import re

    from kvspec.decode import DECODE

    text = DECODE.spec.read_text()
    m = re.search(r'Transfer = "push" =>.*?Bug \\in \{([^}]*)\}', text, re.S)
    assert m is not None
    assert set(PUSH_BUGS) == {b.strip().strip('"') for b in m.group(1).split(",")}


@pytest.mark.slow  # an admitted side: make test-full
def test_the_real_push_ds_run_is_admitted(tmp_path: Path) -> None:
    m = map_decode(read_dir(RUN))
    assert decode_verdict(m, tmp_path) == ("admitted", len(m.log))


def test_negative_control_the_same_log_read_as_pull_is_rejected_at_the_report(
    tmp_path: Path,
) -> None:
    events = [dataclasses.replace(e, result={**e.result, "connector": "NixlConnector"})
              if e.call == "start" else e for e in read_dir(RUN)]  # fmt: skip
    m = map_decode(events)
    assert constants(m, "none")["Transfer"] == '"pull"'
    # a pulling D posts its READs after the handshake; the recording has none
    assert decode_verdict(m, tmp_path) == ("rejected", _report(m))


def test_negative_control_a_report_before_ds_handshake_is_rejected_there(
    tmp_path: Path,
) -> None:
    events = read_dir(RUN)
    hs = next(e for e in events if e.engine == "D" and e.call == "handshake")
    report = next(e for e in events if e.engine == "D" and e.ids("finished_recving"))
    # the handshake now returns after the report: nothing was registered with P before it
    late = dataclasses.replace(hs, t_ns=report.t_ns + 1)
    m = map_decode(_sorted([late if e is hs else e for e in events]))
    assert decode_verdict(m, tmp_path) == ("rejected", _report(m))


LATE = RUN.parent / "pd-push-late"


def test_a_push_request_reaching_d_after_ps_lease_is_never_received_and_stays_held() -> None:
    """pd-push-late (real 0.32 engines): P freed both requests at its lease before D got
    them; D registered, was never written, and kept both aborted requests' blocks to the
    end of the run: the prefix of Decode.tla's push-p1-d1-late-arrival-abort
    counterexample (HeldReleased)."""
    events = read_dir(LATE)
    p_free = max(e.t_ns for e in events if e.engine == "P" and e.call == "free_blocks")
    d_add = min(e.t_ns for e in events if e.engine == "D" and e.call == "add_request")
    assert p_free < d_add  # P's lease freed them before D had them
    m = map_decode(events)
    # both aborted (vLLM's finish_requests runs twice per abort: the second a no-op),
    # neither ever received
    assert {e.r for e in m.log if e.a == "abort"} == {1, 2}
    assert not any(e.recv for e in m.log if e.a == "update")
    pd = set(m.requests)
    d_sched = [e for e in events if e.engine == "D" and e.role == "scheduler"]
    assert not any(set(e.reqs) & pd for e in d_sched if e.call == "free_blocks")
    base = next(e.result["free"] for e in d_sched if e.call == "add_request")
    end = [e.result["free"] for e in d_sched if e.call == "free_blocks"][-1]
    assert base - end == 4  # expect.json's d_blocks_held: two requests of two blocks


@pytest.mark.slow  # an admitted side: make test-full
def test_the_late_push_ds_run_is_admitted(tmp_path: Path) -> None:
    m = map_decode(read_dir(LATE))
    assert decode_verdict(m, tmp_path) == ("admitted", len(m.log))


def test_push_actions_of_a_counterexample_are_named() -> None:
    # kvspec.decode_traces reads each step's action off its state change (report lanes,
    # counterexample traces); push's and the proposed watchdog's included
    from kvspec.decode_traces import action_of

    def h(x: str) -> dict[int, dict[int, dict[int, str]]]:
        return {0: {1: {0: x}}}

    assert action_of("push_write", {"h": h("reg")}, {"h": h("proc")}) == "push_write(0, 1, 0)"
    assert action_of("push_lost", {"h": h("reg")}, {"h": h("lost")}) == "push_lost(0, 1, 0)"
    off, on = {"hbOff": frozenset()}, {"hbOff": frozenset({2})}
    assert action_of("watchdog", off, on) == "watchdog(2)"
    before, after = {"hfl": {0: frozenset()}}, {"hfl": {0: frozenset({2})}}
    assert action_of("watchdog_fail", before, after) == "watchdog_fail(2)"
