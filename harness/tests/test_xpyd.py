"""xPyD, as vLLM's P/D proxy deploys it: several producer or decode engines, requests
spread round robin. The recorded real runs (vLLM 0.32 engines, `kvspec scenario`):
conformance/recorded/pd-2p1d (two P engines feed one D) and pd-1p2d (one P feeds two D
engines). Each producer is validated on its own (its requests, the READs of them), and a
decode engine of two producers once per producer (the other's requests are as local
ones): no completion state spans engines in vLLM. Negative controls: a producer that
frees under a READ, and a lost decode report, are rejected in their own engine's
projection, at the doctored event, while the other projection is still admitted."""

from __future__ import annotations

import dataclasses
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from kvspec.record import doctored
from kvspec.record.clock_mapping import map_clock
from kvspec.record.compact import compact
from kvspec.record.decode_mapping import map_decode
from kvspec.record.log import Event, read_dir
from kvspec.record.mapping import MappingError, map_recording
from kvspec.validate import check_design
from kvspec.validate_clock import check_clock
from kvspec.validate_decode import check_bug

RECORDED = Path(__file__).resolve().parents[2] / "conformance" / "recorded"
# pd-2p1d: the producer request ids of each P engine (request n went to P n % 2)
OF_P = {"p1r0-bb61d56f", "p1r1-875f69e4"}
OF_P2 = {"p2r0-af8298df", "p2r1-a4f04139"}
# pd-1p2d: P's requests each decode engine took (request n decoded on D n % 2)
D_OF_1P2D = {"p1r0-a10813e3", "p1r2-beab3c5f"}
D2_OF_1P2D = {"p1r1-8f0fc3b4", "p1r3-8b09c633"}


def _events(name: str) -> list[Event]:
    return read_dir(RECORDED / name)


def _meta(name: str) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((RECORDED / name / "expect.json").read_text())
    return meta


def _producer(events: list[Event], p: str | None, tmp: Path) -> tuple[str, int]:
    v = check_design(map_recording(events, producer=p), "v0.30-shipped", tmp)
    if v.verdict == "inconclusive":  # TLC timed out twice (a loaded machine): no verdict
        pytest.skip(f"inconclusive: {v.detail}")
    return v.verdict, v.explained


def _decode(events: list[Event], d: str, p: str | None, tmp: Path) -> tuple[str, int]:
    v = check_bug(map_decode(events, d, p), "none", tmp)
    if v.verdict == "inconclusive":
        pytest.skip(f"inconclusive: {v.detail}")
    return v.verdict, v.explained


def test_a_recording_of_two_producers_is_mapped_one_producer_at_a_time() -> None:
    events = _events("pd-2p1d")
    with pytest.raises(MappingError, match="found 2 producer engines .*--producer"):
        map_recording(events)
    with pytest.raises(MappingError, match="D is no producer engine here"):
        map_recording(events, producer="D")
    for p, ids in (("P", OF_P), ("P2", OF_P2)):
        m = map_recording(events, producer=p)
        assert (set(m.requests), m.consumers) == (ids, ["D"])
        # D's READs of the other producer's requests are not this producer's
        assert sorted(e.r for e in m.log if e.a == "read") == [1, 2]


def test_a_decode_engine_of_two_producers_is_mapped_once_per_producer() -> None:
    events = _events("pd-2p1d")
    with pytest.raises(MappingError, match="read from 2 producer engines .*--producer"):
        map_decode(events)
    for p in ("P", "P2"):
        dm = map_decode(events, "D", p)
        assert (len(dm.requests), dm.producer_world) == (2, 1)
        # the other producer's requests share D's pool: no bound in this one's requests
        assert dm.capacity is None


def test_two_decode_engines_are_mapped_one_at_a_time() -> None:
    events = _events("pd-1p2d")
    assert map_recording(events).consumers == ["D", "D2"]
    with pytest.raises(MappingError, match="pass --engine NAME"):
        map_decode(events)
    assert [len(map_decode(events, d).requests) for d in ("D", "D2")] == [2, 2]
    # KVClock has one decode engine: the clock takes each D's share of P (project_log)
    with pytest.raises(MappingError, match="KVClock models one; .*--engine NAME: D, D2"):
        map_clock(events)
    for d, ids in (("D", D_OF_1P2D), ("D2", D2_OF_1P2D)):
        cm = map_clock(events, consumer=d)
        assert (set(cm.base.requests), cm.base.consumers, cm.base.capacity) == (ids, [d], None)


def _clock(events: list[Event], d: str, tmp: Path) -> tuple[str, int, str]:
    v = check_clock(map_clock(events, consumer=d), "v0.30-shipped", tmp)
    if "inconclusive" in (v.design.verdict, v.safe):
        pytest.skip(f"inconclusive: {v.design.detail}")
    return v.design.verdict, v.design.explained, v.safe


# D's share is admitted in the negative control below too
# (both in make test-full: an admitted side; D2's share is rejected in a control below)
@pytest.mark.parametrize("d", [pytest.param("D", marks=pytest.mark.slow),
                               pytest.param("D2", marks=pytest.mark.slow)])  # fmt: skip
def test_each_decode_engines_share_of_the_producer_is_admitted_by_the_clock(
    d: str, tmp_path: Path
) -> None:
    events = _events("pd-1p2d")
    assert _meta("pd-1p2d")["clock"] == {"admitted": ["v0.30-shipped"], "reads": "safe"}
    assert _clock(events, d, tmp_path) == ("admitted", len(map_clock(events, consumer=d).log),
                                           "safe")  # fmt: skip


def test_negative_control_a_share_keeping_the_steps_the_others_caused_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # P steps while it holds any request (has_requests): D's share, freed at 25.37 s, is
    # followed by steps that D2's requests kept going, which KVCompletion's schedule
    # refuses once every request it has is freed
    import kvspec.record.mapping as mapping

    events = _events("pd-1p2d")
    monkeypatch.setattr(mapping, "_cut_after_last_free", lambda log, rs: (log, set()))
    log = map_clock(events, consumer="D").log
    last_free = max(n for n, e in enumerate(log) if e.a == "update" and e.freed)
    first_after = next(n for n, e in enumerate(log) if n > last_free and e.a == "schedule")
    assert _clock(events, "D", tmp_path)[:2] == ("rejected", first_after)


def test_a_lost_report_of_d2s_request_is_rejected_in_d2s_share_of_the_clock_only(
    tmp_path: Path,
) -> None:
    # P's worker never reports one of D2's requests: P's free of it is unexplained in
    # D2's share; D's share, whose requests P's workers did report, is still admitted
    rid = sorted(D2_OF_1P2D)[0]
    events = doctored.drop_finished_sending(_events("pd-1p2d"), "P", rid)
    cm = map_clock(events, consumer="D2")
    r = cm.base.requests[rid]
    at = next(n for n, e in enumerate(cm.log) if e.a == "update" and r in e.freed)
    assert _clock(events, "D2", tmp_path / "d2")[:2] == ("rejected", at)
    assert _clock(events, "D", tmp_path / "d")[0] == "admitted"


@pytest.mark.parametrize(
    ("name", "p"),
    # ("pd-2p1d", "P") is admitted in the negative control below too
    [pytest.param("pd-2p1d", "P", marks=pytest.mark.slow), ("pd-2p1d", "P2"),
     pytest.param("pd-1p2d", None, marks=pytest.mark.slow), ("pd-2p1d-tp", "P2")],
)  # fmt: skip
def test_each_producer_of_a_recorded_xpyd_run_is_admitted(
    name: str, p: str | None, tmp_path: Path
) -> None:
    events = _events(name)
    assert "v0.30-shipped" in _meta(name)["admitted"]
    assert _producer(events, p, tmp_path) == (
        "admitted", len(map_recording(events, producer=p).log))  # fmt: skip


@pytest.mark.parametrize(
    ("name", "d", "p"),
    # make test keeps one share of each recording's kind (and the negative controls')
    [pytest.param("pd-2p1d", "D", "P", marks=pytest.mark.slow), ("pd-2p1d", "D", "P2"),
     pytest.param("pd-1p2d", "D", None, marks=pytest.mark.slow), ("pd-1p2d", "D2", None),
     pytest.param("pd-2p1d-tp", "D", "P", marks=pytest.mark.slow), ("pd-2p1d-tp", "D", "P2")],
)  # fmt: skip
def test_each_decode_share_of_a_recorded_xpyd_run_is_0_32s_design(
    name: str, d: str, p: str | None, tmp_path: Path
) -> None:
    events = _events(name)
    assert _meta(name)["decode_admitted_by"] == "none"
    assert _decode(events, d, p, tmp_path) == ("admitted", len(map_decode(events, d, p).log))


@pytest.mark.slow  # an admitted side: make test-full
def test_the_clock_explains_a_producer_whose_decode_engine_also_reads_another(
    tmp_path: Path,
) -> None:
    # D heartbeats each producer only its own requests (heartbeat_by_engine): P's clock
    # sees D's one heartbeat to P, and P2's requests not at all
    cm = map_clock(_events("pd-2p1d"), producer="P")
    meta = _meta("pd-2p1d")
    assert (cm.heartbeats, sorted(cm.base.requests)) == (
        meta["producers"]["P"]["clock_heartbeats"], sorted(OF_P))  # fmt: skip
    v = check_clock(cm, "v0.30-shipped", tmp_path)
    if "inconclusive" in (v.design.verdict, v.safe):
        pytest.skip(f"inconclusive: {v.design.detail}")
    assert (v.design.verdict, v.safe) == ("admitted", meta["clock"]["reads"])


def test_a_producer_freeing_under_a_read_is_rejected_in_its_own_projection_only(
    tmp_path: Path,
) -> None:
    events = doctored.free_before_read(_events("pd-2p1d"), "P2", "p2r0-af8298df")
    log = map_recording(events, producer="P2").log
    at = next(n for n, e in enumerate(log) if e.a == "update" and e.freed)
    assert _producer(events, "P2", tmp_path / "p2") == ("rejected", at)
    assert _producer(events, "P", tmp_path / "p")[0] == "admitted"


def test_a_lost_decode_report_is_rejected_in_its_producers_share_only(tmp_path: Path) -> None:
    events = _events("pd-2p1d")
    hit = next(e for e in events if e.engine == "D" and e.role == "worker"
               and e.call == "get_transfer_results"
               and "d1r1-96f470c8" in e.ids("finished_recving"))  # fmt: skip
    kept = sorted(hit.ids("finished_recving") - {"d1r1-96f470c8"})
    doc = [dataclasses.replace(e, result={**e.result, "finished_recving": kept})
           if e is hit else e for e in events]  # fmt: skip
    # d1r1 is P2's request: the aggregated finished_recving has no worker report behind it
    log = map_decode(doc, "D", "P2").log
    at = next(n for n, e in enumerate(log) if e.a == "update" and e.recv)
    assert _decode(doc, "D", "P2", tmp_path / "p2") == ("rejected", at)
    assert _decode(doc, "D", "P", tmp_path / "p")[0] == "admitted"


def _views(events: list[Event]) -> dict[str, list[str]]:
    """Every log the recording maps to: each producer's KVTrace and clock log, and D's
    decode log once per producer."""
    out = {}
    for p in ("P", "P2"):
        out[f"producer {p}"] = [e.describe() for e in map_recording(events, producer=p).log]
        out[f"clock {p}"] = [f"{e.describe()} t={e.t}"
                             for e in map_clock(events, producer=p).log]  # fmt: skip
        out[f"decode {p}"] = [e.describe() for e in map_decode(events, "D", p).log]
    return out


def _raw(tmp: Path) -> list[Event]:
    """pd-2p1d as recorded, before compaction (1,604 events)."""
    with tarfile.open(Path(__file__).parent / "fixtures" / "pd-2p1d-raw.tgz") as tar:
        tar.extractall(tmp / "raw", filter="data")
    return read_dir(tmp / "raw")


def test_compaction_keeps_every_log_of_a_recorded_xpyd_run(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    kept = compact(raw)
    assert (len(raw), len(kept)) == (1604, len(_events("pd-2p1d")))
    assert _views(kept) == _views(raw)


def test_negative_control_dropping_steps_that_hold_an_event_changes_the_clock_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # D's add_request and READs fell inside one of P's idle steps: the clock dropped that
    # step (the run of idle steps went on through it), KVTrace kept a later one. Dropped
    # anyway, those events end the clock's run in the compacted recording, and the step
    # KVTrace kept is no longer dropped there: one idle step more in P's clock log.
    import kvspec.record.clock_mapping as cmod
    import kvspec.record.decode_mapping as dmod
    import kvspec.record.mapping as mmod

    raw = _raw(tmp_path)
    for mod in (cmod, dmod, mmod):
        monkeypatch.setattr(mod, "steps_holding_events", lambda log: set())
    views, again = _views(raw), _views(compact(raw))
    assert [k for k in views if views[k] != again[k]] == ["clock P"]
    assert len(again["clock P"]) == len(views["clock P"]) + 3


# the validations (4 s) run in make test-full; the refusal below runs in make test
@pytest.mark.slow
def test_the_cli_validates_each_producer_and_names_the_one_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvspec.cli import main

    run = str(RECORDED / "pd-2p1d")
    out = tmp_path / "v.json"
    rc = main(["validate", run, "--side", "producer", "--variant", "v0.30-shipped",
               "--work", str(tmp_path / "w"), "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    said = capsys.readouterr().out
    if "inconclusive" in said:
        pytest.skip("TLC inconclusive on a loaded machine")
    assert (rc, sorted(doc["producers"])) == (0, ["P", "P2"])
    assert [doc["producers"][p]["admitted"] for p in ("P", "P2")] == [["v0.30-shipped"]] * 2
    assert "== producer P2" in said
    # one producer asked: that one alone, as a one-producer recording's document
    rc = main(["validate", run, "--side", "producer", "--variant", "v0.30-shipped",
               "--producer", "P2", "--work", str(tmp_path / "w2"), "--json", str(out)])  # fmt: skip
    assert (rc, json.loads(out.read_text())["producer"]) == (0, "P2")


def test_the_cli_refuses_a_producer_name_that_is_no_producer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvspec.cli import main

    # one line, exit 2, before any TLC run
    assert main(["validate", str(RECORDED / "pd-2p1d"), "--side", "producer", "--producer",
                 "D", "--work", str(tmp_path / "w")]) == 2  # fmt: skip
    assert "D is no producer engine here; producers: P, P2" in capsys.readouterr().err


# pd-p-restart: P killed (SIGKILL) holding an unread request, restarted as P2 on its address
def test_a_producer_crash_leaves_a_read_that_never_reached_it() -> None:
    events = _events("pd-p-restart")
    m = map_recording(events, producer="P")
    # D's READ of request 2 failed to post (the dead peer: NIXL_ERR_REMOTE_DISCONNECT,
    # recorded posted=false): no READ of P; request 1's READ is
    assert (len(m.requests), sorted(e.r for e in m.log if e.a == "read")) == (2, [1])
    assert len(map_recording(events, producer="P2").requests) == 1
    # the clock: D gave request 2 up with no READ posted (abandon), and its heartbeat to
    # the dead P failed (lost at rank 0)
    cm = map_clock(events, producer="P")
    assert [e.a for e in cm.log if e.r == 2 and e.a in ("read", "abandon")] == ["abandon"]
    assert cm.heartbeats == _meta("pd-p-restart")["producers"]["P"]["clock_heartbeats"]


# the TLC runs (7 s) in make test-full; their mapping above and the control below in make test
@pytest.mark.slow
def test_the_crashed_producers_log_and_clock_are_admitted(tmp_path: Path) -> None:
    events = _events("pd-p-restart")
    m = map_recording(events, producer="P")
    assert _producer(events, "P", tmp_path / "p") == ("admitted", len(m.log))
    v = check_clock(map_clock(events, producer="P"), "v0.30-shipped", tmp_path / "c")
    if "inconclusive" in (v.design.verdict, v.safe):
        pytest.skip(f"inconclusive: {v.design.detail}")
    assert (v.design.verdict, v.safe) == ("admitted", "safe")


def test_negative_control_a_failed_post_taken_for_a_read_is_a_read_of_p() -> None:
    """Marked posted, D's failed post of request 2 is a READ of P: on the producer side,
    and in P's clock, where it stays in flight (it failed after P's end, as in
    pd-p-crash-mid-read) instead of D giving the request up."""
    events = [dataclasses.replace(e, result={**e.result, "posted": True})
              if e.call == "read" and e.result.get("posted") is False else e
              for e in _events("pd-p-restart")]  # fmt: skip
    m = map_recording(events, producer="P")
    assert sorted(e.r for e in m.log if e.a == "read") == [1, 2]
    cm = map_clock(events, producer="P")
    assert [e.a for e in cm.log if e.r == 2 and e.a in ("read", "abandon")] == ["read"]


def test_the_crashed_producers_share_of_d_is_0_32s_design_and_not_35943s(tmp_path: Path) -> None:
    events = _events("pd-p-restart")
    dm = map_decode(events, "D", "P")
    assert _decode(events, "D", "P", tmp_path / "ok") == ("admitted", len(dm.log))
    assert _decode(events, "D", "P2", tmp_path / "p2")[0] == "admitted"
    # #35943 (a failed load only logged): rejected at the step that reported it failed
    at = next(n for n, e in enumerate(dm.log) if e.a == "execute" and any(e.fail))
    v = check_bug(dm, "failure-only-logged", tmp_path / "bug")
    if v.verdict == "inconclusive":
        pytest.skip(f"inconclusive: {v.detail}")
    assert (v.verdict, v.explained) == ("rejected", at)


def test_a_decode_engine_keeps_one_tp_mapping_per_producer() -> None:
    # pd-2p1d-tp: P at TP 1, P2 at TP 2; D (TP 1) READs P2's requests from both P2 ranks
    events = _events("pd-2p1d-tp")
    meta = _meta("pd-2p1d-tp")["producers"]
    for p in ("P", "P2"):
        m, dm = map_recording(events, producer=p), map_decode(events, "D", p)
        assert m.world == dm.producer_world == meta[p]["world"]
        reads = sorted((e.r, e.w) for e in m.log if e.a == "read")
        assert reads == [(r, w) for r in (1, 2) for w in range(meta[p]["world"])]
