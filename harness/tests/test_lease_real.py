"""LeaseClock's counterexamples replayed on vLLM's real classes (drivers.lease_driver): the
violations `kvspec lease` finds happen in the installed code, step for step, and the
0.29/0.30 reaper's (#58222) is exactly what the early-break mutant brings back."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvspec.drivers.base import MissingAction, WaitTimeout  # noqa: E402
from kvspec.drivers.lease_driver import LeaseDriver  # noqa: E402
from kvspec.lease_replay import overtakes, replay_lease  # noqa: E402
from kvspec.mutations import Base, patched  # noqa: E402
from kvspec.mutations.catalogue import MUTANTS  # noqa: E402

REGRESSIONS = Path(__file__).resolve().parents[2] / "conformance" / "lease"
FREE_UNDER_READ = sorted(REGRESSIONS.glob("*-NoFreeUnderRead.itf.json"))
EARLY_BREAK = REGRESSIONS / "two-leases-early-break-ExpiredReapedAtOnce.itf.json"


def _doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _reqs(doc: dict[str, Any]) -> int:
    return len(doc["states"][0]["p"])


def _replayed(doc: dict[str, Any], d: LeaseDriver) -> Any:
    """The replay; a wait that expired makes the test inconclusive (skipped), never a
    verdict either way."""
    res = replay_lease(doc, d)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    return res


@pytest.mark.parametrize("path", FREE_UNDER_READ, ids=lambda p: p.name.split("-NoFree")[0])
def test_the_free_under_a_read_happens_in_vllm(path: Path) -> None:
    doc = _doc(path)
    with LeaseDriver(_reqs(doc), notif_first=overtakes(doc)) as d:
        res = _replayed(doc, d)
        assert res.divergence is None, res
        # the last step: vLLM's worker freed r (lease reaped, or an overtaking notification
        # counted) while D still waits or reads
        (p, _, dr) = d.observe()[1]
        assert p == "freed" and dr in ("queued", "reading")


OVERTAKING = REGRESSIONS / "notif-before-read-done-NoFreeUnderRead.itf.json"


def test_an_overtaking_notification_frees_then_the_read_runs() -> None:
    # nixl#252's order injected at D's NIXL seam: P's _get_new_notifs counts "r:1" and
    # frees r with no regard for the READ (P cannot see it); the READ, posted only now,
    # still completes, reading blocks P has already released.
    doc = _doc(OVERTAKING)
    assert overtakes(doc)
    with LeaseDriver(_reqs(doc), notif_first=True) as d:
        assert _replayed(doc, d).divergence is None
        try:
            d.read_done(1)
        except WaitTimeout as exc:
            pytest.skip(f"inconclusive: {exc}")
        assert d.observe()[1] == ("freed", None, "done")


def test_negative_control_without_the_seam_nothing_overtakes() -> None:
    # NIXL's own order (the notification rides on the READ): the step cannot be taken.
    doc = _doc(OVERTAKING)
    with LeaseDriver(_reqs(doc)) as d:
        res = _replayed(doc, d)
    assert res.divergence is not None and "vLLM cannot" in res.divergence


def test_early_break_is_the_0_30_reaper_not_0_32s() -> None:
    doc = _doc(EARLY_BREAK)
    with LeaseDriver(_reqs(doc)) as d:  # 0.32 as installed: full scan
        assert _replayed(doc, d).divergence is None
        d.reap()  # the spec's early-break cannot reap here; 0.32 does
        assert "freed" in {p for p, _, _ in d.observe().values()}
    with patched(Base("v0.30-shipped"), MUTANTS["reaper-early-break"].patch):
        with LeaseDriver(_reqs(doc)) as d:
            assert _replayed(doc, d).divergence is None
            with pytest.raises(MissingAction):
                d.reap()  # stuck behind the live head, as the spec says


def test_negative_control_a_wrong_ttl_diverges() -> None:
    doc = copy.deepcopy(_doc(REGRESSIONS / "wait30s-hb-lost-NoFreeUnderRead.itf.json"))
    doc["states"][2]["ttl"] = [t + 1 for t in doc["states"][2]["ttl"]]
    with LeaseDriver(_reqs(doc)) as d:
        res = _replayed(doc, d)
    assert res.divergence is not None and res.divergence.startswith("step 2")


LATE_HEARTBEAT = REGRESSIONS / "wait80s-d-late-15s-ReachLateHeartbeat.itf.json"


def test_a_heartbeat_after_the_reap_is_ignored_and_the_mutant_reinstalls() -> None:
    # The spec's heartbeat extends only leased requests (base_worker.py:3052): 0.32 ignores
    # a heartbeat naming the reaped request; the mutant re-arms it (negative control).
    doc = _doc(LATE_HEARTBEAT)
    with LeaseDriver(_reqs(doc)) as d:
        res = _replayed(doc, d)
        assert res.divergence is None, res
        assert d.observe()[1][0] == "freed"
    with patched(Base("v0.30-shipped"), MUTANTS["heartbeat-installs-lease"].patch):
        with LeaseDriver(_reqs(doc)) as d:
            res = _replayed(doc, d)
    last = len(doc["states"]) - 1
    assert res.divergence is not None and res.divergence.startswith(f"step {last}")


def _evicts_p_after(d: LeaseDriver, ticks: int) -> bool:
    """Whether the decode worker's engine-TTL sweep drops P after `ticks` lease ticks of
    silence (base_worker.py _evict_stale_engines; it runs before every handshake check)."""
    for _ in range(ticks):
        d.tick()
    w = d.vd.c.consumers[0].connector_worker
    w._evict_stale_engines()
    return d.vd.c.engine_id not in w._remote_agents


def test_engine_ttl_keeps_vllms_ratio_to_the_stretched_lease() -> None:
    # 80 s of silence at the default 30 s lease is 16 ticks: P stays registered, as with
    # vLLM's defaults (engine_ttl 3600 s = 720 ticks); the heartbeat then arrives.
    with LeaseDriver(1) as d:
        assert not _evicts_p_after(d, 16)
        try:
            d.heartbeat(True)
        except WaitTimeout as exc:  # a loaded machine: inconclusive, never a verdict
            pytest.skip(f"inconclusive: {exc}")


def test_negative_control_the_unscaled_engine_ttl_evicts_p() -> None:
    # The fixture before the fix: engine_ttl 3600 s against a 3600 s lease (600 s ticks):
    # after 7 ticks D's worker evicted P and re-handshook (wait80s-d-late-15s, trace 162).
    with LeaseDriver(1) as d:
        d.vd.c.consumers[0].connector_worker._engine_ttl = 3600.0
        assert _evicts_p_after(d, 7)
