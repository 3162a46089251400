"""Recording connectors: vLLM's own NixlConnector, NixlPushConnector (0.32+) and
MultiConnector under their own names, each call passed through unchanged and logged
(kvspec.record.log).

Use: `kv_transfer_config = {"kv_connector": "NixlConnector", "kv_connector_module_path":
"kvspec.record.connectors", ...}` and `KVSPEC_RECORD_DIR=DIR` in the engine's
environment. vLLM's factory imports the module path before its registry
(kv_connector/factory.py:get_connector_class), so the engine runs this subclass.

The scheduler's own steps (schedule, update_from_output, add_request, finish_requests,
_free_blocks) are not connector calls; the scheduler-side connector wraps those methods of
vLLM's Scheduler class once per process. Each wrapper calls the original first and records
after it returns, and records only for a scheduler whose connector is a recording one.
Why a patch and not a subclass: the engine builds its Scheduler class from
`scheduler_config.scheduler_cls`, which a connector cannot choose.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector as _VllmMulti,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixl,
)

from kvspec.drivers.vllm_adapters import first_group, recv_block_lists, recv_blocks
from kvspec.record import kv_digest
from kvspec.record.describe import describe
from kvspec.record.log import DIR_ENV, Recorder

try:  # push mode: vLLM 0.32+ (nixl/connector.py NixlPushConnector)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPushConnector as _VllmPush,
    )
except ImportError:  # an older vLLM: no push connector to record
    _VllmPush = None

_PATCHED = "_kvspec_recording"


def _ids(xs: Any) -> set[str]:
    return {str(x) for x in (xs or ())}


def _world(vllm_config: Any) -> int:
    p = vllm_config.parallel_config
    pcp = int(getattr(p, "prefill_context_parallel_size", 1) or 1)
    return int(p.tensor_parallel_size) * int(p.pipeline_parallel_size) * pcp


def _rank(vllm_config: Any) -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no group yet (tests): the config's rank
        return int(getattr(vllm_config.parallel_config, "rank", 0) or 0)


def _make_recorder(vllm_config: Any, role: Any) -> Recorder:
    kv = vllm_config.kv_transfer_config
    is_sched = getattr(role, "name", str(role)).upper().endswith("SCHEDULER")
    return Recorder(
        engine=str(kv.engine_id), kv_role=str(kv.kv_role),
        role="scheduler" if is_sched else "worker",
        rank=0 if is_sched else _rank(vllm_config), world=_world(vllm_config),
        directory=Path(os.environ.get(DIR_ENV, "kvspec-record")),
    )  # fmt: skip


def _rec_of(scheduler: Any) -> Recorder | None:
    return getattr(getattr(scheduler, "connector", None), "_kvspec_rec", None)


def _wrap(cls: type, name: str, after: Any) -> None:
    real = getattr(cls, name)

    @functools.wraps(real)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        rec = _rec_of(self)
        if rec is not None:
            try:
                after(self, rec, out, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM
                rec.emit("recorder_error", where=name, error=repr(exc))
        return out

    setattr(cls, name, wrapper)


def _after_schedule(sched: Any, rec: Recorder, so: Any, *a: Any, **k: Any) -> None:
    steps: dict[int, int] = sched.__dict__.setdefault("_kvspec_steps", {})
    n = sched.__dict__["_kvspec_n"] = sched.__dict__.get("_kvspec_n", 0) + 1
    steps[id(so)] = n
    new = [r.req_id for r in so.scheduled_new_reqs]
    rec.emit("schedule", step=n, reqs=new, new=_ids(new),
             finished_req_ids=_ids(so.finished_req_ids))  # fmt: skip


def _after_update(sched: Any, rec: Recorder, out: Any, so: Any, mro: Any, *a: Any,
                  **k: Any) -> None:  # fmt: skip
    step = sched.__dict__.get("_kvspec_steps", {}).pop(id(so), None)
    kv = getattr(mro, "kv_connector_output", None)
    rec.emit(
        "update_from_output", step=step,
        finished_sending=_ids(getattr(kv, "finished_sending", None)),
        finished_recving=_ids(getattr(kv, "finished_recving", None)),
        failed_recving=_ids(getattr(kv, "failed_recving", None)),
        invalid_block_ids=sorted(int(b) for b in getattr(kv, "invalid_block_ids", None) or ()),
    )  # fmt: skip


def _after_add(sched: Any, rec: Recorder, out: Any, request: Any, *a: Any, **k: Any) -> None:
    pool = sched.kv_cache_manager.block_pool
    params = getattr(request, "kv_transfer_params", None) or {}
    remote = bool(params.get("do_remote_prefill"))
    # the producer's engine and request id (nixl/metadata.py:333-334): a decode request is
    # mapped to its producer's even when D never READs (a failed handshake)
    where: dict[str, Any] = {}
    if remote:
        where = {
            "remote_engine": str(params.get("remote_engine_id", "")),
            "remote_request_id": str(params.get("remote_request_id", "")),
        }
    rec.emit("add_request", reqs=[request.request_id], free=int(pool.get_num_free_blocks()),
             remote_prefill=remote, **where)  # fmt: skip


def _after_finish(sched: Any, rec: Recorder, out: Any, ids: Any, status: Any, *a: Any,
                  **k: Any) -> None:  # fmt: skip
    ids = [ids] if isinstance(ids, str) else list(ids or ())
    rec.emit("finish_requests", reqs=ids, status=getattr(status, "name", str(status)))


def _after_free(sched: Any, rec: Recorder, out: Any, request: Any, *a: Any, **k: Any) -> None:
    pool = sched.kv_cache_manager.block_pool
    rec.emit("free_blocks", reqs=[request.request_id], free=int(pool.get_num_free_blocks()))


def install_scheduler_hooks() -> None:
    """Wrap vLLM's Scheduler once per process (idempotent)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, _PATCHED, False):
        return
    _wrap(Scheduler, "schedule", _after_schedule)
    _wrap(Scheduler, "update_from_output", _after_update)
    _wrap(Scheduler, "add_request", _after_add)
    _wrap(Scheduler, "finish_requests", _after_finish)
    _wrap(Scheduler, "_free_blocks", _after_free)
    setattr(Scheduler, _PATCHED, True)


def _nixl_worker(connector: Any) -> Any:
    """The NIXL connector worker (pull: `_read_blocks`; push: `_xfer_blocks`) under this
    connector or under one of its children."""
    for c in [connector, *getattr(connector, "_connectors", ())]:
        w = getattr(c, "connector_worker", None)
        if w is not None and (hasattr(w, "_read_blocks") or hasattr(w, "_xfer_blocks")):
            return w
    return None


def _wrap_handshakes(connector: Any, rec: Recorder) -> None:
    """Record each NIXL handshake a worker makes (base_worker.py `_nixl_handshake(host,
    port, remote_tp_size, expected_engine_id, ...)`, run on the handshake executor's
    thread: `_ensure_handshake` submits `self._nixl_handshake`, so an instance attribute
    intercepts it). One `handshake` event at its end: the remote engine, whether it
    succeeded, and the error vLLM's done_callback logs as handshake_setup_failed."""
    worker = _nixl_worker(connector)
    if worker is None or not hasattr(worker, "_nixl_handshake"):
        return
    real = worker._nixl_handshake

    @functools.wraps(real)
    def handshake(*args: Any, **kwargs: Any) -> Any:
        eid = kwargs.get("expected_engine_id", args[3] if len(args) > 3 else "?")
        t0 = time.monotonic_ns()
        try:
            out = real(*args, **kwargs)
        except BaseException as exc:
            rec.emit("handshake", remote_engine=str(eid), ok=False, started_ns=t0,
                     error=repr(exc)[:200])  # fmt: skip
            raise
        rec.emit("handshake", remote_engine=str(eid), ok=True, started_ns=t0)
        return out

    worker._nixl_handshake = handshake


def _wrap_reads(connector: Any, rec: Recorder) -> None:
    """Record each READ the NIXL worker posts (pull_worker.py:_read_blocks(read_spec,
    dst_engine_id, request_id, remote_request_id, ...)), or in push mode each WRITE;
    absent in a vLLM without them."""
    worker = _nixl_worker(connector)
    if worker is None:
        rec.emit("recorder_note", note="no NIXL _read_blocks: READs not recorded")
    elif hasattr(worker, "_xfer_blocks"):
        # Push mode: each WRITE a producer worker posts (push_worker.py `_xfer_blocks`,
        # same arguments, called on the `nixl-push-writer` thread as `self._xfer_blocks`).
        # `posted`: a handle came back (None: nothing submitted, or the submission failed
        # and vLLM released it).
        _wrap_posts(worker, rec, "_xfer_blocks", "write",
                    lambda spec, out: {"posted": out is not None})  # fmt: skip
    else:
        _wrap_posts(worker, rec, "_read_blocks", "read",
                    lambda spec, out: {"posted": bool(out), "notify_only": _notify_only(spec)})


def _wrap_posts(worker: Any, rec: Recorder, name: str, call: str,
                outcome: Callable[[Any, Any], dict[str, Any]]) -> None:  # fmt: skip
    """One `call` event per transfer the worker's method `name(read_spec, dst_engine_id,
    request_id, remote_request_id, ...)` posts (looked up on the instance by its callers,
    so an instance attribute intercepts it)."""
    real = getattr(worker, name)

    @functools.wraps(real)
    def post(read_spec: Any, dst_engine_id: Any, request_id: Any, remote_request_id: Any,
             *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        # Stamped at entry: the transfer (and its notification, and the producer's free)
        # can finish before the call returns.
        t_ns = time.monotonic_ns()
        out = real(read_spec, dst_engine_id, request_id, remote_request_id, *args, **kwargs)
        rec.emit(call, reqs=[request_id], t_ns=t_ns, remote_request_id=str(remote_request_id),
                 remote_rank=int(getattr(read_spec, "remote_rank", -1)),
                 remote_engine=str(dst_engine_id), **outcome(read_spec, out))  # fmt: skip
        return out

    setattr(worker, name, post)


def _notify_only(read_spec: Any) -> bool | None:
    """Whether `_read_blocks` was handed no local block: it then only sends "r:n" to the
    producer and posts no READ (a full hit, or an aborted request's cleanup entry;
    pull_worker.py:444-465). None where the release's arguments do not say."""
    local = getattr(read_spec, "local_block_ids", read_spec)
    if not isinstance(local, (list, tuple)):
        return None
    if local and isinstance(local[0], (list, tuple)):  # one list per KV cache group
        return not any(len(g) > 0 for g in local)
    return not local  # one flat list of block ids (older releases)


def _wrap_heartbeats(connector: Any, rec: Recorder) -> None:
    """Record the lease heartbeats: a decode worker's `_send_heartbeats(metadata)` (which
    producer ranks each "HB:" message went to; an engine with none was swallowed by the
    proactive handshake or failed: base_worker.py:3179-3212) and a producer worker's
    `_handle_heartbeat(payload)` (which of its ids it held: only those are extended,
    base_worker.py:3042-3060). Both are looked up on the instance by their callers
    (pull_worker.py:123, 658), so instance attributes intercept them."""
    worker = _nixl_worker(connector)
    if worker is None or not hasattr(worker, "_handle_heartbeat"):
        return
    sending: list[tuple[Any, bool]] | None = None
    agent = worker.nixl_wrapper
    real_notif = agent.send_notif

    def send_notif(name: Any, *args: Any, **kwargs: Any) -> Any:
        msg = kwargs.get("notif_msg", args[0] if args else b"")
        hb = sending is not None and isinstance(msg, bytes) and msg.startswith(b"HB:")
        try:
            out = real_notif(name, *args, **kwargs)
        except Exception:
            if hb and sending is not None:
                sending.append((name, False))
            raise
        if hb and sending is not None:
            sending.append((name, True))
        return out

    agent.send_notif = send_notif
    real_send = worker._send_heartbeats

    @functools.wraps(real_send)
    def send_heartbeats(metadata: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal sending
        by_engine = dict(getattr(metadata, "heartbeat_by_engine", None) or {})
        if not by_engine:
            return real_send(metadata, *args, **kwargs)
        t_ns, sending = time.monotonic_ns(), []
        try:
            return real_send(metadata, *args, **kwargs)
        finally:
            got, sending = sending, None
            try:
                _emit_sends(rec, worker, by_engine, got, t_ns)
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM
                rec.emit("recorder_error", where="_send_heartbeats", error=repr(exc))

    worker._send_heartbeats = send_heartbeats
    real_handle = worker._handle_heartbeat

    @functools.wraps(real_handle)
    def handle_heartbeat(payload: str, *args: Any, **kwargs: Any) -> Any:
        t_ns = time.monotonic_ns()
        ids = [x for x in str(payload).split(",") if x]
        held = sorted(x for x in ids if x in dict(getattr(worker, "_reqs_to_send", {})))
        out = real_handle(payload, *args, **kwargs)
        rec.emit("heartbeat_recv", reqs=ids, t_ns=t_ns, held=held)
        return out

    worker._handle_heartbeat = handle_heartbeat


def _emit_sends(rec: Recorder, worker: Any, by_engine: dict[Any, Any],
                got: list[tuple[Any, bool]], t_ns: int) -> None:  # fmt: skip
    """One heartbeat_send per producer engine. `_remote_agents[engine]` maps the producer's
    (pp rank, tp rank) to its agent name (base_worker.py:647): the message's rank is the
    pair, written "pp:tp". Each engine gets the sends to its own agents, and those to an
    agent no engine has ("?"): measured, pd-p-restart's D heartbeated the crashed P and its
    replacement P2 in one call, and P's failed send was written as P2's "?" too."""
    agents = {eid: {str(a): f"{k[0]}:{k[1]}" for k, a in
                    dict(worker._remote_agents.get(eid, {})).items()}
              for eid in by_engine}  # fmt: skip
    known = {a for ranks in agents.values() for a in ranks}
    for eid, info in by_engine.items():
        ranks = agents[eid]
        mine = [(str(n), ok) for n, ok in got if str(n) in ranks or str(n) not in known]
        rec.emit("heartbeat_send", reqs=sorted(_ids(info.req_ids)), t_ns=t_ns,
                 remote_engine=str(eid),
                 sent=sorted(ranks.get(n, "?") for n, ok in mine if ok),
                 failed=sorted(ranks.get(n, "?") for n, ok in mine if not ok))  # fmt: skip


class _Recording:
    """The calls recorded on every connector class below (MRO: before vLLM's class)."""

    _kvspec_rec: Recorder

    def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, role, *args, **kwargs)  # type: ignore[call-arg]
        self._kvspec_rec = _make_recorder(vllm_config, role)
        if self._kvspec_rec.role == "scheduler":
            install_scheduler_hooks()
            self._kvspec_rec.emit("start", **describe(self, vllm_config))
        else:
            _wrap_reads(self, self._kvspec_rec)
            try:
                _wrap_heartbeats(self, self._kvspec_rec)
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM
                self._kvspec_rec.emit("recorder_note", note=f"heartbeats not recorded: {exc!r}")
            try:
                _wrap_handshakes(self, self._kvspec_rec)
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM
                self._kvspec_rec.emit("recorder_note", note=f"handshakes not recorded: {exc!r}")

    _kvspec_caches: dict[str, Any] | None = None
    _kvspec_recv: dict[str, list[int]] = {}  # ordered: recv_block_lists

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)  # type: ignore[misc]
        self._kvspec_caches = kv_caches  # the KV digests' bytes (kv_digest)
        try:  # the attention backend vLLM picked for this host, as NIXL registered it
            w = _nixl_worker(self)
            t = next(iter(kv_caches.values()), None)
            self._kvspec_rec.emit("kv_caches", backend=str(getattr(w, "backend_name", "?")),
                                  kernel_block=int(getattr(w, "block_size", -1)),
                                  dtype=str(getattr(t, "dtype", "?")))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - never raise into vLLM
            self._kvspec_rec.emit("recorder_error", where="register_kv_caches", error=repr(exc))

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        super().start_load_kv(*args, **kwargs)  # type: ignore[misc]
        # each request P finished since the last step, with its blocks (kv_digest)
        meta = getattr(self, "_connector_metadata", None)
        for rid, blocks in kv_digest.finished_blocks(meta).items():
            kv_digest.emit(self._kvspec_rec, _nixl_worker(self), self._kvspec_caches,
                           str(rid), blocks, "sent")  # fmt: skip

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        kv_digest.attach(self, meta)  # pull: the blocks P's worker digests
        return meta

    # MultiConnector.request_finished_all_groups calls self.request_finished when a child
    # lacks HMA (multi_connector.py:595-607): one finish, recorded once, at the outer call.
    _kvspec_finishing = False

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        return self._finish(lambda: super(_Recording, self).request_finished(  # type: ignore[misc]
            request, block_ids), request, [block_ids])  # fmt: skip

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self._finish(lambda: super(_Recording, self).request_finished_all_groups(  # type: ignore[misc]
            request, block_ids), request, block_ids)  # fmt: skip

    def _finish(self, call: Any, request: Any, groups: Any) -> Any:
        nested = self._kvspec_finishing
        self._kvspec_finishing = True
        try:
            out = call()
        finally:
            self._kvspec_finishing = nested
        if not nested:
            self._record_finished(request, out, groups)
        return out

    def _record_finished(self, request: Any, out: Any, groups: Any) -> None:
        status = getattr(getattr(request, "status", None), "name", "?")
        try:  # the blocks it holds at its end, every KV cache group's (one pool), and the
            # first group's ids: which blocks two requests share (a prefix-cache hit)
            blocks, ids = sum(len(g) for g in groups or ()), first_group(groups)
        except (TypeError, ValueError):
            blocks, ids = -1, []
        self._kvspec_rec.emit("request_finished", reqs=[request.request_id],
                              delay=bool(out[0]), status=status, blocks=blocks,
                              block_ids=ids)  # fmt: skip
        kv_digest.note_finished(self, str(request.request_id), groups, bool(out[0]))

    # the receives registered on this rank at its last report (get_finished pops the ones
    # it reports): which request a load error's blocks belong to
    _kvspec_blocks: dict[str, frozenset[int]] = {}

    def _snapshot_blocks(self) -> None:
        try:
            self._kvspec_blocks = recv_blocks(_nixl_worker(self))
            if kv_digest.enabled():  # (nothing kept where no digest is asked for)
                self._kvspec_recv = {**self._kvspec_recv,
                                     **recv_block_lists(_nixl_worker(self))}
        except Exception as exc:  # noqa: BLE001 - never raise into vLLM
            self._kvspec_rec.emit("recorder_error", where="_recving_metadata", error=repr(exc))

    def get_block_ids_with_load_errors(self) -> set[int]:
        # the runner calls it after the step's report (kv_connector_model_runner_mixin.py:100)
        out: set[int] = super().get_block_ids_with_load_errors()  # type: ignore[misc]
        if out:
            try:
                known = {**self._kvspec_blocks, **recv_blocks(_nixl_worker(self))}
                bad = {int(b) for b in out}
                self._kvspec_rec.emit("load_errors", reqs=[r for r, b in known.items() if b & bad],
                                      block_ids=sorted(bad))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - never raise into vLLM
                self._kvspec_rec.emit("recorder_error", where="load_errors", error=repr(exc))
        return out

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        self._snapshot_blocks()
        out = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        # the KV this rank received, as it landed; not a failed receive, which 0.32 reports
        # in finished_recving too (measured: pd-handshake-fail), its blocks never written
        failed = _ids(getattr(out, "failed_recving", None))
        for rid in _ids(out.finished_recving):
            blocks = self._kvspec_recv.pop(rid, [])
            if rid not in failed:
                kv_digest.emit(self._kvspec_rec, _nixl_worker(self), self._kvspec_caches, rid,
                               [blocks], "received")  # fmt: skip
        for rid in failed:
            self._kvspec_recv.pop(rid, None)
        self._kvspec_rec.emit(
            "get_transfer_results",
            finished_sending=_ids(out.finished_sending),
            finished_recving=_ids(out.finished_recving),
            failed_recving=_ids(getattr(out, "failed_recving", None)),
        )  # fmt: skip
        return out

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        if not hasattr(super(), "get_transfer_results"):
            self._snapshot_blocks()
        out = super().get_finished(finished_req_ids)  # type: ignore[misc]
        # vLLM 0.29 has no get_transfer_results: its runner calls get_finished (a tuple).
        if not hasattr(super(), "get_transfer_results"):
            sending, recving = out
            self._kvspec_rec.emit("get_transfer_results", finished_sending=_ids(sending),
                                  finished_recving=_ids(recving), failed_recving=set())  # fmt: skip
        return out


class NixlConnector(_Recording, _VllmNixl):  # type: ignore[misc]
    """vLLM's NixlConnector, recorded."""


class MultiConnector(_Recording, _VllmMulti):  # type: ignore[misc]
    """vLLM's MultiConnector, recorded (its children are vLLM's own)."""


if _VllmPush is not None:

    class NixlPushConnector(_Recording, _VllmPush):  # type: ignore[misc]
        """vLLM's NixlPushConnector, recorded (push mode: the producer WRITEs)."""
