"""KVClock (spec/KVClock.tla, `kvspec clock`): KVCompletion's producer engine against a
lease clock. The matrix keeps vLLM's ratios; TLC's verdicts on a safe and an unsafe fast row
are the expected ones (the unsafe one is the negative control: without heartbeats getting
through, the checker does find P freeing while D has yet to read); the trace-step decoder
reads each step's request and rank off the state change."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from kvspec.clock import CLOCK
from kvspec.clock_traces import step_of, why_not_driven
from kvspec.sweep import check_sweep_row, load_sweep_matrix
from sweep_checks import assert_bad_matrix_is_one_line_and_exit_2

ROWS = {r.name: r for r in load_sweep_matrix(CLOCK)}


def test_matrix_keeps_vllms_ratios_and_has_fast_rows() -> None:
    assert any(r.tier == "fast" for r in ROWS.values())
    for r in ROWS.values():
        assert r.ints["HbEvery"] * 6 == r.ints["Lease"]  # heartbeat every lease / 6
        assert r.ints["Extend"] * 3 == r.ints["Lease"] * 2  # extension 2/3 lease
    assert why_not_driven(ROWS["tp1-wait80s-hb-ok"]) is None
    assert why_not_driven(ROWS["tp1-notif-before-read-done"]) is not None


def test_bad_matrix_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = '[[row]]\nname = "a"\ntp = -2\n'
    needle = "tp must be a non-negative integer"
    assert_bad_matrix_is_one_line_and_exit_2(CLOCK, row, needle, tmp_path, capsys)


@pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")
@pytest.mark.parametrize(
    ("name", "live"),
    [
        # the good row and the harmless lost-heartbeat row: 44 s + 29 s of TLC, make
        # test-full (the nightly clock sweep decides every row)
        pytest.param("tp1-wait80s-hb-ok", True, marks=pytest.mark.slow),
        # known bad: NoFreeUnderRead violated. make test checks its safety properties
        # (5 s of TLC); the liveness run (30 s more) is make test-full's and the sweep's
        ("tp1-wait30s-hb-lost", False),
        pytest.param("tp1-wait30s-hb-lost", True, marks=pytest.mark.slow),
        pytest.param("tp1-wait25s-hb-lost", True, marks=pytest.mark.slow),
        # D's side ending early (issue #16's recordings): safety in make test (4 s and
        # 7 s of TLC), liveness (22 s and 60 s more) in make test-full and the sweep
        ("tp1-read-fails", False),
        pytest.param("tp1-read-fails", True, marks=pytest.mark.slow),
        ("tp1-d-finish", False),
        pytest.param("tp1-d-finish", True, marks=pytest.mark.slow),
        # push mode: the step-gap finding (P frees under its own WRITE after a long step:
        # the heartbeats that came during it are handled after the reaper), safety in make
        # test; its control (P steps every 5 s) and the lost-heartbeat row in make test-full
        ("push-tp1-wait80s-hb-ok", False),
        pytest.param("push-tp1-wait80s-hb-ok-p-step-5s", True, marks=pytest.mark.slow),
        pytest.param("push-tp1-wait30s-hb-lost", False, marks=pytest.mark.slow),
    ],
)
def test_tlc_verdicts_are_the_expected_ones(name: str, live: bool, tmp_path: Path) -> None:
    sweep = CLOCK if live else dataclasses.replace(CLOCK, liveness=())
    res = check_sweep_row(sweep, ROWS[name], tmp_path)
    if res.inconclusive:  # TLC timed out on a loaded machine: no verdict either way
        pytest.skip(f"inconclusive: {res.inconclusive}")
    unexpected = [p for p in res.unexpected if p in sweep.properties]
    assert unexpected == [], res.verdicts
    if name == "tp1-d-finish":
        # P frees r under a READ D still has in flight, of a request D finished (its
        # heartbeats stopped at request_finished): the lease ran out under that READ
        doc = json.loads((tmp_path / name / "ReachFreeUnderFinishedRead.itf.json").read_text())
        last = doc["states"][-1]
        assert last["req"] == ["freed"] and last["gone"] == {"#set": [1]}
        assert last["land"] == {"#set": []} and last["failed"] == {"#set": []}
    if name == "tp1-wait25s-hb-lost":
        # the finding of the split: the fused property's alarm is a free after the READ
        # landed, whose notification came late
        assert res.verdicts["NoFreeUnderRead"] == "holds"
        assert res.verdicts["FusedNoFreeWhileInFlight"] == "violated"
        doc = json.loads((tmp_path / name / "FusedNoFreeWhileInFlight.itf.json").read_text())
        last = doc["states"][-1]
        assert last["req"] == ["freed"] and last["land"] == {"#set": [[1, 0]]}  # <<1, 0>>
    if res.verdicts["NoFreeUnderRead"] == "violated":
        # the shortest counterexample: no heartbeat got through, the deadline passes at a
        # tick, P's next step reaps the lease and update_from_output frees the blocks
        # while D has yet to land its READ
        doc = json.loads((tmp_path / name / "NoFreeUnderRead.itf.json").read_text())
        last, states = doc["states"][-1], doc["states"]
        assert last["req"] == ["freed"] and last["land"] == {"#set": []}
        assert any(s["#meta"].get("action") == "tick" and s["expired"]["#map"][0][1]["#set"]
                   for s in states)  # fmt: skip
    if name.startswith("push-") and res.verdicts["NoFreeUnderRead"] == "violated":
        # push: P's writer posted the WRITE, and the reaper frees the blocks under it
        assert res.verdicts.get("ReachFreeUnderWrite", "violated") == "violated"
        states = json.loads((tmp_path / name / "NoFreeUnderRead.itf.json").read_text())[
            "states"]
        assert states[-1]["rd"][0]["#map"][0][1] == "inflight"
        if name == "push-tp1-wait80s-hb-ok":
            # every heartbeat got through, but the one P's step found at its agent (not
            # yet forwarded by the writer thread) is handled after that step's reaper
            reap = states[-2]
            assert reap["#meta"]["action"] == "execute_model"
            assert states[-3]["hbq"]["#map"][0][1]["#set"] == [1]
            assert reap["hbf"]["#map"][0][1]["#set"] == [1]


def _st(**kw: Any) -> dict[str, Any]:
    from kvspec.tlcvalue import make_fn

    base: dict[str, Any] = {
        "hs": "done", "lost": 0, "land": frozenset(), "gone": frozenset(),
        "atD": frozenset({1}), "seen": frozenset(), "req": ("sending",),
        "lease": make_fn([(0, frozenset({1})), (1, frozenset({1}))]),
        "expired": make_fn([(0, frozenset()), (1, frozenset())]),
        "ttl": make_fn([(0, (2,)), (1, (2,))]),
    }  # fmt: skip
    return {**base, **kw}


BOTH = frozenset({0, 1})  # D reads and heartbeats producer ranks 0 and 1


def _step(a: dict[str, Any], b: dict[str, Any], action: str) -> tuple[str, tuple[Any, ...]]:
    return step_of(a, b, action, BOTH)


def test_step_of_reads_the_request_and_rank_off_the_change() -> None:
    from kvspec.tlcvalue import make_fn

    rd0 = (make_fn([(0, "none"), (1, "none")]),)
    rd1 = (make_fn([(0, "none"), (1, "inflight")]),)
    assert _step(_st(rd=rd0), _st(rd=rd1), "consumer_start_load_kv") == (
        "consumer_start_load_kv", (1, 1),
    )  # fmt: skip
    a, b = _st(), _st(land=frozenset({(1, 0)}))
    assert _step(a, b, "consumer_read_done") == ("consumer_read_done", (1, 0))
    assert _step(_st(hs="none"), _st(hs="pending"), "heartbeat") == ("heartbeat_swallowed", ())
    # a heartbeat while the handshake is pending is swallowed too (hs does not change)
    pending = _st(hs="pending")
    assert _step(pending, pending, "heartbeat") == ("heartbeat_swallowed", ())
    assert _step(pending, _st(), "handshake_done") == ("handshake_done", ())
    assert _step(_st(atD=frozenset()), _st(), "consumer_add_request") == (
        "consumer_add_request", (1,),
    )  # fmt: skip
    assert _step(_st(), _st(seen=frozenset({1})), "consumer_update") == ("consumer_update", (1,))
    # D's side ending early: a failed READ, D finishing r, D's failed receive
    a, b = _st(failed=frozenset()), _st(failed=frozenset({(1, 0)}))
    assert _step(a, b, "consumer_read_fails") == ("consumer_read_fails", (1, 0))
    assert _step(_st(), _st(gone=frozenset({1})), "consumer_finish") == ("consumer_finish", (1,))
    done = _st(seen=frozenset({1}), gone=frozenset({1}))
    assert _step(_st(), done, "consumer_fail") == ("consumer_fail", (1,))
    # push: P's writer posts rank 0's WRITE of r 1; it ends (landed and P's report)
    rd2 = (make_fn([(0, "inflight"), (1, "none")]),)
    assert _step(_st(rd=rd0), _st(rd=rd2), "push_write") == ("push_write", (1, 0))
    rd3 = (make_fn([(0, "done"), (1, "none")]),)
    assert _step(_st(rd=rd2), _st(rd=rd3), "push_write_done") == ("push_write_done", (1, 0))
    # push: rank 1's writer thread forwards the heartbeat waiting at its agent
    at1 = make_fn([(0, frozenset()), (1, frozenset({1}))])
    none = make_fn([(0, frozenset()), (1, frozenset())])
    assert _step(_st(hbq=at1), _st(hbq=none), "writer_poll") == ("writer_poll", (1,))


def test_a_heartbeats_lost_messages_are_read_off_its_effect() -> None:
    from kvspec.tlcvalue import make_fn

    none = make_fn([(0, frozenset()), (1, frozenset())])
    # a delivered message waits at its rank (hbq) for P's next step; a lost one does not
    one = _st(hbq=make_fn([(0, frozenset({1})), (1, frozenset())]), lost=1)
    assert _step(_st(hbq=none), one, "heartbeat") == ("heartbeat", (frozenset({1}),))
    lost2 = _st(hbq=none, lost=2)
    assert _step(_st(hbq=none), lost2, "heartbeat") == ("heartbeat", (frozenset({0, 1}),))
    both = _st(hbq=make_fn([(0, frozenset({1})), (1, frozenset({1}))]))
    assert _step(_st(hbq=none), both, "heartbeat") == ("heartbeat", (frozenset(),))
    # every tracked request waits at both ranks already: delivered and lost are one step
    assert _step(both, both, "heartbeat") == ("heartbeat", (frozenset(),))
