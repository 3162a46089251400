"""The recording connector's bookkeeping, without vLLM: what a Recorder writes, and one
`request_finished` event per finish where MultiConnector's request_finished_all_groups
calls its own request_finished (a child without HMA, multi_connector.py:595-607)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvspec.record.connectors import _Recording
from kvspec.record.log import Recorder


def _lines(d: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for f in sorted(d.glob("*.ndjson")) for x in f.read_text().splitlines()]


def test_sets_are_written_sorted_and_lists_in_their_order(tmp_path: Path) -> None:
    rec = Recorder("P", "kv_both", "scheduler", 0, 1, tmp_path)
    rec.emit("start", children=["NixlPullConnector", "ExampleConnector"], ids={"b", "a"})
    got = _lines(tmp_path)[0]["result"]
    assert got == {"children": ["NixlPullConnector", "ExampleConnector"], "ids": ["a", "b"]}


class _Multi:
    """MultiConnector's shape: all groups falls back to request_finished."""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return True, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return self.request_finished(request, block_ids[0])


class _RecordedMulti(_Recording, _Multi):
    def __init__(self, rec: Recorder) -> None:  # no vLLM config: the recorder only
        self._kvspec_rec = rec


class _Req:
    request_id = "r1"
    status = None


def test_a_finish_through_all_groups_is_recorded_once(tmp_path: Path) -> None:
    conn = _RecordedMulti(Recorder("P", "kv_both", "scheduler", 0, 1, tmp_path))
    assert conn.request_finished_all_groups(_Req(), ([1, 2],)) == (True, None)
    conn.request_finished(_Req(), [3])  # a direct call is recorded too
    finished = [e for e in _lines(tmp_path) if e["call"] == "request_finished"]
    assert [(e["reqs"], e["result"]["blocks"]) for e in finished] == [(["r1"], 2), (["r1"], 1)]


def test_a_read_spec_without_local_blocks_is_notify_only() -> None:
    from types import SimpleNamespace

    from kvspec.record.connectors import _notify_only

    assert _notify_only(SimpleNamespace(local_block_ids=[[], []])) is True  # every group empty
    assert _notify_only(SimpleNamespace(local_block_ids=[[3, 4], []])) is False
    assert _notify_only([]) is True and _notify_only([7, 8]) is False  # one flat group
    assert _notify_only(object()) is None  # the release's arguments do not say


class _Nixl029:
    """0.29's worker shape: get_finished pops the receives it reports; a failed one's
    blocks come back from get_block_ids_with_load_errors (base_worker.py:2218-2228)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        meta = SimpleNamespace
        self.connector_worker = SimpleNamespace(
            _read_blocks=None,
            _recving_metadata={"d1": meta(local_block_ids=([1, 2],)),
                               "d2": meta(local_block_ids=([3],)),
                               "d3": meta(local_block_ids=([5],))},  # fmt: skip
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        md = self.connector_worker._recving_metadata
        md.pop("d1"), md.pop("d2")
        return set(), {"d1", "d2"}

    def get_block_ids_with_load_errors(self) -> set[int]:
        return {2}


class _Recorded029(_Recording, _Nixl029):
    def __init__(self, rec: Recorder) -> None:
        _Nixl029.__init__(self)
        self._kvspec_rec = rec


def test_a_load_error_names_the_receive_whose_blocks_it_holds(tmp_path: Path) -> None:
    """d1 failed (its block 2 is invalid), d2 did not, d3 is still loading; get_finished
    popped d1 before the runner asked for the invalid blocks."""
    conn = _Recorded029(Recorder("D", "kv_both", "worker", 0, 1, tmp_path))
    assert conn.get_finished(set()) == (set(), {"d1", "d2"})
    assert conn.get_block_ids_with_load_errors() == {2}
    got = {e["call"]: e for e in _lines(tmp_path)}
    assert got["get_transfer_results"]["result"]["failed_recving"] == []  # 0.29: none
    assert (got["load_errors"]["reqs"], got["load_errors"]["result"]) == (
        ["d1"], {"block_ids": [2]})  # fmt: skip


def test_load_failed_reads_failed_recving_and_the_invalid_blocks() -> None:
    from kvspec.drivers.vllm_adapters import TransferResults, load_failed

    blocks = {"d1": frozenset({1, 2}), "d2": frozenset({3})}
    res029 = TransferResults(set(), {"d1", "d2"}, set())
    assert load_failed(res029, blocks, {2}) == {"d1"}
    assert load_failed(res029, blocks, set()) == set()  # no invalid block: both received
    res032 = TransferResults(set(), {"d1", "d2"}, {"d2"})
    assert load_failed(res032, blocks, set()) == {"d2"}


class _Worker:
    """A NIXL worker's shape for the handshake wrapper: `_read_blocks` marks it, and its
    `_nixl_handshake` succeeds or raises as vLLM's does on a dead side channel."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def _read_blocks(self) -> None: ...

    def _nixl_handshake(self, host: str, port: int, tp: int, expected_engine_id: str) -> str:
        if self.fail:
            raise TimeoutError("Resource temporarily unavailable")
        return "agents"


def test_a_handshake_is_recorded_with_its_outcome_and_its_error_still_raised(
    tmp_path: Path,
) -> None:
    """The recorder's `handshake` event (what scenario._handshake_timed_out reads): the
    wrapped call returns and raises exactly as vLLM's; the event says which."""
    from types import SimpleNamespace

    import pytest
    from kvspec.record.connectors import _wrap_handshakes

    rec = Recorder("D", "kv_consumer", "worker", 1, 2, tmp_path)
    ok, bad = _Worker(False), _Worker(True)
    _wrap_handshakes(SimpleNamespace(connector_worker=ok), rec)
    _wrap_handshakes(SimpleNamespace(connector_worker=bad), rec)
    assert ok._nixl_handshake("h", 1, 1, "P") == "agents"
    with pytest.raises(TimeoutError):
        bad._nixl_handshake("h", 1, 1, expected_engine_id="P2")
    got = [(e["result"]["remote_engine"], e["result"]["ok"], "error" in e["result"])
           for e in _lines(tmp_path)]  # fmt: skip
    assert got == [("P", True, False), ("P2", False, True)]


class _PushWorker:
    """A push producer worker's shape (push_worker.py): `_xfer_blocks` marks it; it posts a
    WRITE (a handle) or submits nothing (None)."""

    def _xfer_blocks(self, read_spec: object, dst_engine_id: str, request_id: str,
                     remote_request_id: str) -> int | None:  # fmt: skip
        return None if request_id == "empty" else 7


def test_a_push_write_is_recorded_and_its_handle_returned(tmp_path: Path) -> None:
    """Push mode: `write` per `_xfer_blocks` call, the handle passed back unchanged;
    `posted` false where vLLM submitted nothing. A pull worker gets `read` instead."""
    from types import SimpleNamespace

    from kvspec.record.connectors import _wrap_reads

    rec = Recorder("P", "kv_producer", "worker", 0, 1, tmp_path)
    w = _PushWorker()
    _wrap_reads(SimpleNamespace(connector_worker=w), rec)
    spec = SimpleNamespace(remote_rank=1)
    assert w._xfer_blocks(spec, "D", "a", "d-a") == 7
    assert w._xfer_blocks(spec, "D", "empty", "d-e") is None
    got = [(e["call"], e["reqs"], e["result"]["remote_rank"], e["result"]["posted"])
           for e in _lines(tmp_path)]  # fmt: skip
    assert got == [("write", ["a"], 1, True), ("write", ["empty"], 1, False)]


class _NixlWorkerShape:
    """The NIXL worker's fields the kv_caches event reads (base_worker.py:855, :964)."""

    backend_name = "AMX_MLA"
    block_size = 32

    def _read_blocks(self) -> None: ...


class _Registers:
    def __init__(self) -> None:
        self.registered: dict[str, Any] = {}
        self.connector_worker = _NixlWorkerShape()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.registered = kv_caches


class _RecordedRegisters(_Recording, _Registers):
    def __init__(self, rec: Recorder) -> None:
        _Registers.__init__(self)
        self._kvspec_rec = rec


def test_the_registered_caches_name_the_attention_backend(tmp_path: Path) -> None:
    """vLLM's registration runs first; the event then names the backend, the kernel block
    and the caches' dtype. Negative control: a worker without NIXL's fields is recorded as
    unknown ("?", -1), and nothing is raised into vLLM."""
    from types import SimpleNamespace

    conn = _RecordedRegisters(Recorder("P", "kv_both", "worker", 0, 1, tmp_path))
    caches = {"layer0": SimpleNamespace(dtype="torch.bfloat16")}  # a tensor's str(dtype)
    conn.register_kv_caches(caches)
    assert conn.registered is caches
    got = next(e for e in _lines(tmp_path) if e["call"] == "kv_caches")["result"]
    assert got == {"backend": "AMX_MLA", "kernel_block": 32, "dtype": "torch.bfloat16"}
    bare = _RecordedRegisters(Recorder("D", "kv_both", "worker", 0, 1, tmp_path / "bare"))
    bare.connector_worker = None  # type: ignore[assignment]
    bare.register_kv_caches({})
    got = next(e for e in _lines(tmp_path / "bare") if e["call"] == "kv_caches")["result"]
    assert got == {"backend": "?", "kernel_block": -1, "dtype": "?"}


class _PushShape(_Registers):
    """A push connector's shape: metadata bound by the runner, a report per step."""

    def __init__(self) -> None:
        super().__init__()
        self._connector_metadata: Any = None
        self.connector_worker.num_blocks = 4  # type: ignore[attr-defined]

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None: ...

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from types import SimpleNamespace

        self.connector_worker._recving_metadata = {}  # type: ignore[attr-defined]
        return SimpleNamespace(finished_sending=set(), finished_recving={"p0-d"},
                               failed_recving=set(self.failed))  # fmt: skip

    failed: frozenset[str] = frozenset()  # 0.32 reports a failed receive in both sets


class _RecordedPush(_Recording, _PushShape):
    def __init__(self, rec: Recorder) -> None:
        _PushShape.__init__(self)
        self._kvspec_rec = rec


def test_p_digests_what_it_finished_and_d_what_it_received(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """P's worker digests each request the scheduler hands it as finished (push metadata's
    push_finished_blocks), D's each request it reports received, from the blocks
    registered for it before the report popped them: the same bytes give the same
    digest, and only where asked (kv_digest.DIGEST_ENV: a user's recording pays nothing).
    Negative controls: D's block 2 holding other bytes gives another digest; unasked,
    no digest is taken."""
    import pytest

    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from kvspec.record.kv_digest import DIGEST_ENV

    monkeypatch.delenv(DIGEST_ENV, raising=False)
    off = _RecordedPush(Recorder("P", "kv_both", "worker", 0, 1, tmp_path / "off"))
    off.register_kv_caches({"l0": torch.zeros(4, 8)})
    off._connector_metadata = SimpleNamespace(push_finished_blocks={"p0-a": ([1, 2],)})
    off.start_load_kv(None)
    assert not [e for e in _lines(tmp_path / "off") if e["call"] == "kv_digest"]
    monkeypatch.setenv(DIGEST_ENV, "1")

    caches = {"l0": torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)}
    p = _RecordedPush(Recorder("P", "kv_both", "worker", 0, 1, tmp_path / "p"))
    p.register_kv_caches(caches)
    p._connector_metadata = SimpleNamespace(push_finished_blocks={"p0-a": ([1, 2],)})
    p.start_load_kv(None)
    d = _RecordedPush(Recorder("D", "kv_both", "worker", 0, 1, tmp_path / "d"))
    d.register_kv_caches({"l0": caches["l0"].clone()})
    d.connector_worker._recving_metadata = {  # type: ignore[attr-defined]
        "p0-d": SimpleNamespace(local_block_ids=([1, 2],))}  # fmt: skip
    d.get_transfer_results(set())
    (sent,) = [e for e in _lines(tmp_path / "p") if e["call"] == "kv_digest"]
    (got,) = [e for e in _lines(tmp_path / "d") if e["call"] == "kv_digest"]
    assert (sent["result"]["side"], got["result"]["side"]) == ("sent", "received")
    assert sent["result"]["digest"] == got["result"]["digest"] is not None
    d2 = _RecordedPush(Recorder("D", "kv_both", "worker", 0, 1, tmp_path / "d2"))
    d2.register_kv_caches({"l0": caches["l0"].clone().index_fill_(0, torch.tensor([2]), 0.0)})
    d2.connector_worker._recving_metadata = {  # type: ignore[attr-defined]
        "p0-d": SimpleNamespace(local_block_ids=([1, 2],))}  # fmt: skip
    d2.get_transfer_results(set())
    (other,) = [e for e in _lines(tmp_path / "d2") if e["call"] == "kv_digest"]
    assert other["result"]["digest"] != sent["result"]["digest"]


def test_d_digests_no_receive_that_failed(tmp_path: Path, monkeypatch: Any) -> None:
    """0.32 reports a failed receive in finished_recving and failed_recving (measured:
    pd-handshake-fail): its blocks were never written, so no "received" digest. Negative
    control: the same report without the failure digests it (the test above)."""
    import pytest

    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from kvspec.record.kv_digest import DIGEST_ENV

    monkeypatch.setenv(DIGEST_ENV, "1")
    d = _RecordedPush(Recorder("D", "kv_both", "worker", 0, 1, tmp_path / "d"))
    d.failed = frozenset({"p0-d"})
    d.register_kv_caches({"l0": torch.zeros(4, 8)})
    d.connector_worker._recving_metadata = {  # type: ignore[attr-defined]
        "p0-d": SimpleNamespace(local_block_ids=([1, 2],))}  # fmt: skip
    d.get_transfer_results(set())
    calls = [e["call"] for e in _lines(tmp_path / "d")]
    assert "kv_digest" not in calls and "get_transfer_results" in calls


def test_a_heartbeat_call_to_two_producers_gives_each_its_own_sends() -> None:
    """pd-p-restart, make e2e 2026-12-07: D heartbeated the crashed P and its replacement
    P2 in one `_send_heartbeats`; P's failed send was written as P2's too ("?"), and the
    clock refused P2's log. Negative control: a send to an agent no engine has is still
    written "?" (for every engine: whose it was is unknown)."""
    from types import SimpleNamespace

    from kvspec.record.connectors import _emit_sends

    class _Rec:
        def __init__(self) -> None:
            self.got: dict[str, dict[str, Any]] = {}

        def emit(self, call: str, **kw: Any) -> None:
            self.got[kw["remote_engine"]] = {"sent": kw["sent"], "failed": kw["failed"]}

    w = SimpleNamespace(_remote_agents={"P": {(0, 0): "agent-p"}, "P2": {(0, 0): "agent-p2"}})
    by = {"P": SimpleNamespace(req_ids={"p1"}), "P2": SimpleNamespace(req_ids={"q0"})}
    rec = _Rec()
    _emit_sends(rec, w, by, [("agent-p", False), ("agent-p2", True)], 0)  # type: ignore[arg-type]
    assert rec.got == {"P": {"sent": [], "failed": ["0:0"]},
                       "P2": {"sent": ["0:0"], "failed": []}}  # fmt: skip
    _emit_sends(rec, w, by, [("gone", True)], 0)  # type: ignore[arg-type]
    assert rec.got == {"P": {"sent": ["?"], "failed": []}, "P2": {"sent": ["?"], "failed": []}}
