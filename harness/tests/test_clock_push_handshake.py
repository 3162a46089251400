"""Push mode with P's handshake with D pending (KVClock PHsMax > 0): the writer parks a
matched request's blocks on the handshake future and, when it completes, WRITEs them with
no look at the lease (push_worker.py:247-252, 457-481). TLC's counterexample (hand-off 25 s,
a 5 s handshake: the lease runs out meanwhile, P frees r, then WRITEs r's freed blocks into
D) replays step for step on vLLM 0.32's NixlPushConnector (test_clock_real.py replays every
kept counterexample); here, where the freed block was reused, D receives the other
request's bytes as r's KV. Negative controls: a reaper that never reaps cannot free, so the
replay diverges; the proposed fix drops the WRITE. The new rows' TLC verdicts (the control
row's and the fix's "holds" among them) are checked by `kvspec clock --tier full` (make
review), not here: each takes 1-3 min of TLC."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from kvspec.clock import CLOCK
from kvspec.clock_traces import CLOCK_REGRESSIONS, regression_row, replay_regression
from kvspec.sweep import load_sweep_matrix

ROWS = {r.name: r for r in load_sweep_matrix(CLOCK)}
KEPT = CLOCK_REGRESSIONS / "push-tp1-handoff25s-hb-ok-p-handshake-5s-NoWriteFromFreed.itf.json"
SCRIBBLE = 7.0  # what the request that reused the freed block wrote into it


@functools.cache
def _kept() -> tuple[dict[str, Any], list[str]]:
    """The kept counterexample and its actions, one per state (the first: the initial)."""
    doc = json.loads(KEPT.read_text())
    return doc, [str(s["#meta"]["action"]) for s in doc["states"]]


def test_the_kept_counterexample_posts_a_write_after_the_free() -> None:
    from kvspec.clock_traces import step_of
    from kvspec.itf import value_from_itf

    doc, actions = _kept()
    states = [{k: value_from_itf(v) for k, v in s.items() if k != "#meta"} for s in doc["states"]]
    i, j = actions.index("push_match"), actions.index("push_handshake_done")
    k = actions.index("push_deferred")
    # the free (update_from_output) comes between the match and the WRITE
    freed = next(n for n, s in enumerate(states) if s["req"][0] == "freed")
    assert i < freed < k and j < k
    # the spec's record of the WRITE posted after the free
    assert states[-1]["late"] == frozenset({(1, 0)})
    # the replay maps the three new actions onto driver calls with their arguments
    assert step_of(states[i - 1], states[i], "push_match", frozenset({0})) == ("push_match", (1, 0))
    assert step_of(states[j - 1], states[j], "push_handshake_done", frozenset({0})) == (
        "push_handshake_done", (0,),
    )  # fmt: skip
    assert step_of(states[k - 1], states[k], "push_deferred", frozenset({0})) == (
        "push_deferred", (1, 0),
    )  # fmt: skip


def _replay(make_driver: Any = None) -> Any:
    pytest.importorskip("nixl")
    row = regression_row(KEPT, ROWS)
    res = (
        replay_regression(KEPT, row)
        if make_driver is None
        else replay_regression(KEPT, row, make_driver)
    )
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    return res


@pytest.mark.vllm
def test_negative_control_a_reaper_that_never_reaps_cannot_free() -> None:
    from kvspec.mutations import Base, patched
    from kvspec.mutations.catalogue import MUTANTS

    with patched(Base("v0.30-shipped"), MUTANTS["lease-never-expires"].patch):
        res = _replay()
    # it diverges at the reaper's step: P's first step after the match, where the spec reaps
    _, actions = _kept()
    reaper = actions.index("execute_model", actions.index("push_match"))
    assert res.divergence is not None
    assert res.divergence.startswith(f"step {reaper}: expired"), res.divergence


@pytest.mark.vllm
def test_d_receives_the_bytes_of_whatever_reused_the_freed_block() -> None:
    from kvspec.drivers.clock_driver import ClockDriver
    from kvspec.drivers.vllm_caches import logical_block
    from kvspec.drivers.vllm_inbox import DEFAULT_WAITS

    seen: dict[str, Any] = {}

    class Reused(ClockDriver):
        """Before the handshake completes, another request reuses r's freed block."""

        def push_deferred(self, r: int, w: int) -> None:
            c = self.vd.c
            assert self.vd._status(r) == "freed"  # the scheduler freed it already
            block = int(self.vd.params[r]["remote_block_ids"][0][0])
            for name, cache in c.caches[w].items():
                blk = logical_block(cache, block)
                seen.setdefault("kv", {})[name] = blk.clone()
                blk.fill_(SCRIBBLE)
            super().push_deferred(r, w)

        def push_write_done(self, r: int, w: int) -> None:
            super().push_write_done(r, w)  # (checks D's block equals P's block now)
            c = self.vd.c
            d = c.consumers_caches[c.consumer_of(w)]
            seen["got"] = {name: logical_block(cache, r).clone() for name, cache in d.items()}

    def make(row: Any, patch: str | None, scale: float) -> Any:
        return Reused(row, impl_patch=patch, waits=DEFAULT_WAITS.scaled(scale))

    res = _replay(make)
    assert res.divergence is None, res.divergence
    torch = pytest.importorskip("torch")
    assert seen["got"].keys() == seen["kv"].keys()
    for name, got in seen["got"].items():
        assert torch.all(got == SCRIBBLE), name  # D holds the reuser's bytes as r's KV
        assert not torch.equal(got, seen["kv"][name])  # not r's


@pytest.mark.vllm
def test_the_proposed_fix_drops_the_write_of_a_reported_request() -> None:
    """Positive control of the fix (patch push-lease-check, KVClock PushLeaseCheck): the
    same trace on the patched writer diverges where the writer re-drives the parked request
    (push_deferred): the shipped one posts the WRITE, the patched one drops it (rd stays
    "none")."""
    from kvspec.clock_traces import _vllm_clock_driver

    def make(row: Any, patch: str | None, scale: float) -> Any:
        assert patch is None  # the kept counterexample's design: the shipped one
        return _vllm_clock_driver(row, "push-lease-check", scale)

    res = _replay(make)
    done = _kept()[1].index("push_deferred")
    assert res.divergence is not None
    assert res.divergence.startswith(f"step {done}: rd: spec"), res.divergence


def test_the_fix_row_is_driven_with_the_fix() -> None:
    from kvspec.clock_traces import patch_for

    assert patch_for(ROWS["push-tp1-handoff25s-hb-ok-p-handshake-5s-lease-check"]) == (
        "push-lease-check"
    )
    assert patch_for(ROWS["push-tp1-handoff25s-hb-ok-p-handshake-5s"]) is None


def _parked_writes_queued(release: bool) -> list[Any]:
    """Replay the kept counterexample up to its push_match, then release the handshake
    (push_handshake_done) or close the driver; what vLLM's _on_handshake queued for the
    writer (`_deferred_push_inbox.put`), counted once every callback of the handshake's
    future ran (ours is attached last)."""
    import threading

    from kvspec.clock_traces import _vllm_clock_driver, model_row, replay_clock
    from kvspec.drivers.base import WaitTimeout

    doc, actions = _kept()
    prefix = {**doc, "states": doc["states"][: actions.index("push_match") + 1]}
    queued: list[Any] = []
    settled = threading.Event()
    with _vllm_clock_driver(model_row(regression_row(KEPT, ROWS)), None, 1.0) as driver:
        res = replay_clock(prefix, driver)
        if res.timeout is not None:
            pytest.skip(f"inconclusive: {res.timeout}")
        assert res.divergence is None, res.divergence
        nw = driver.vd.c.nixl_worker(0)
        fut = nw._handshake_futures[driver.vd._push().engine_id]
        fut.add_done_callback(lambda _f: settled.set())
        inbox = nw._deferred_push_inbox
        inbox.put = lambda item, *a, _put=inbox.put, **k: (queued.append(item), _put(item))
        try:
            if release:
                driver.push_handshake_done(0)
            else:
                driver.close()  # (the with's exit closes it again: a no-op)
        except WaitTimeout as exc:
            pytest.skip(f"inconclusive: {exc}")
        finally:
            del inbox.put
    if not settled.is_set():
        pytest.skip("inconclusive: the handshake's callbacks never ran")
    return queued


@pytest.mark.vllm
def test_a_trace_ending_with_the_handshake_pending_leaves_no_write_behind() -> None:
    """The pooled cluster serves the next trace: a driver closed while P's handshake with D
    is pending fails it, so vLLM's _on_handshake queues none of the parked WRITEs. Control:
    the same prefix, released instead, queues the WRITE."""
    pytest.importorskip("nixl")
    assert len(_parked_writes_queued(release=True)) == 1
    assert _parked_writes_queued(release=False) == []


def test_a_real_push_run_matched_with_3_s_of_lease_left_and_wrote_at_the_handshakes_end() -> None:
    """The window, seen on real engines (conformance/recorded/pd-push-tp2, P at TP 2,
    a 120 s lease that no heartbeat extended): each P rank handshook D lazily, its two
    parked WRITEs were posted within 20 ms of the handshake's end, and rank 0's handshake
    started 2.9 s before the lease's deadline; no P step reported the requests before the
    WRITEs. A handshake 3 s longer would have outlived the lease: P's next step reaps and
    frees, and the WRITEs follow (this file's counterexample)."""
    from kvspec.record.log import read_dir

    events = read_dir(CLOCK_REGRESSIONS.parent / "recorded" / "pd-push-tp2")
    p = [e for e in events if e.engine == "P"]
    assert not any("heartbeat" in e.call for e in p)  # nothing extended the lease
    lease_s = next(e.result["lease"] for e in p if e.call == "start")
    finished = [e.t_ns for e in p if e.call == "request_finished"]
    deadline = max(finished) + lease_s * 10**9
    for rank in (0, 1):
        (hs,) = [e for e in p if e.call == "handshake" and e.rank == rank]
        writes = [e.t_ns for e in p if e.call == "write" and e.rank == rank]
        assert hs.result["ok"] and len(writes) == 2
        assert all(0 <= t - hs.t_ns < 20_000_000 for t in writes)  # parked, then posted
        reported = [e.t_ns for e in p if e.call == "get_transfer_results" and e.rank == rank
                    and e.result.get("finished_sending")]  # fmt: skip
        assert min(reported) > max(writes)
    (hs0,) = [e for e in p if e.call == "handshake" and e.rank == 0]
    margin_s = (deadline - hs0.result["started_ns"]) / 1e9
    assert 2.5 < margin_s < 3.5, margin_s


def test_the_held_inbox_gives_the_writer_only_what_the_driver_released() -> None:
    """The seam behind push_deferred, on a stand-in for the writer's queue: the handshake's
    callbacks put as vLLM's do; the writer's drain (`get_nowait` until Empty) gets nothing
    until the driver releases an entry, then that entry alone; restore gives the real
    queue back and drops what is still held."""
    import queue
    import threading
    from types import SimpleNamespace

    from kvspec.drivers.push_seams import HeldInbox
    from kvspec.drivers.vllm_inbox import DEFAULT_WAITS

    real: queue.Queue[Any] = queue.Queue()
    nw = SimpleNamespace(_deferred_push_inbox=real, _push_writer_wake=threading.Event())
    inbox = HeldInbox(nw, DEFAULT_WAITS)
    for rid in ("a", "b"):
        nw._deferred_push_inbox.put((rid, [1], {}))
    inbox.await_queued(["a", "b"], "both queued")

    def drain() -> list[str]:
        got = []
        while True:
            try:
                got.append(nw._deferred_push_inbox.get_nowait()[0])
            except queue.Empty:
                return got

    assert drain() == []  # held: the writer's drain finds nothing
    inbox.release("b")
    assert nw._push_writer_wake.is_set()
    assert drain() == ["b"]
    assert inbox.held() == ["a"]
    inbox.restore()
    assert nw._deferred_push_inbox is real and real.empty()


def _prefix_driver(upto: str) -> Any:
    """A clock driver that replayed the kept counterexample up to its first `upto` step."""
    from kvspec.clock_traces import _vllm_clock_driver, model_row, replay_clock

    doc, actions = _kept()
    prefix = {**doc, "states": doc["states"][: actions.index(upto) + 1]}
    driver = _vllm_clock_driver(model_row(regression_row(KEPT, ROWS)), None, 1.0)
    res = replay_clock(prefix, driver)
    if res.timeout is not None:
        driver.close()
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is None, res.divergence
    return driver


@pytest.mark.vllm
def test_the_writer_posts_a_parked_write_only_when_the_spec_drains_it() -> None:
    """Between push_handshake_done and push_deferred (P's step runs there in the kept
    trace's neighbours) vLLM's writer holds r on its inbox: no WRITE handle, until the
    spec's push_deferred. Negative control: without the inbox seam, releasing the same
    handshake makes vLLM's writer post the WRITE at once."""
    pytest.importorskip("nixl")
    from kvspec.drivers.base import WaitTimeout
    from kvspec.drivers.push_side import write_handles
    from kvspec.drivers.vllm_view import req_id

    rid = req_id(1)
    try:
        with _prefix_driver("push_handshake_done") as driver:
            nw = driver.vd.c.nixl_worker(0)
            assert write_handles(nw, rid) == [] and driver.vd.lazy[0].inbox.held() == [rid]
            driver.push_deferred(1, 0)
            assert write_handles(nw, rid)
        with _prefix_driver("push_match") as driver:
            nw = driver.vd.c.nixl_worker(0)
            driver.vd.lazy[0].inbox.restore()  # the writer's own queue: no seam
            driver.vd.lazy[0].held.release()
            driver.waits.until(lambda: bool(write_handles(nw, rid)), "the ungated WRITE")
    except WaitTimeout as exc:
        pytest.skip(f"inconclusive: {exc}")
