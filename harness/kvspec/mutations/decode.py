"""Mutated decode-side code (0.32.0): the bugs of the decode side's history re-introduced in
memory, each a function taking the original attribute and returning its replacement
(`Patch.make`). The decode conformance traces (kvspec.decode_traces) must kill them."""

from __future__ import annotations

from typing import Any


def abort_frees_at_once(orig: Any) -> Any:
    # #32255: finish_requests frees a WAITING_FOR_REMOTE_KVS request's blocks at once,
    # under the READ still writing into them (scheduler.py:2701-2707 keeps them).
    def finish(self: Any, request_ids: Any, finished_status: Any) -> Any:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            rq = self.requests.get(rid)
            if rq is not None and rq.status == type(rq.status).WAITING_FOR_REMOTE_KVS:
                # "the receive already finished": finish_requests then frees at once
                self.finished_recving_kv_req_ids.add(rid)
        return orig(self, request_ids, finished_status)

    return finish


def failure_only_logged(orig: Any) -> Any:
    # #35943: a failed READ is only logged; the request is never reported received, so it
    # stays in WAITING_FOR_REMOTE_KVS (base_worker.py:2883-2919 reports it in both sets).
    def results(self: Any) -> Any:
        res = orig(self)
        failed = set(res.failed_recving)
        res.finished_recving = set(res.finished_recving) - failed
        res.failed_recving = set()
        return res

    return results


def recv_reported_before_reads_end(orig: Any) -> Any:
    # A receive reported done while one of its READs is still in progress (the rule
    # base_worker.py:3109-3113 encodes: done only once no handle is left).
    def pop(self: Any, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = orig(self, transfers)
        early = {rid for rid, hs in transfers.items() if hs}
        return done | early, failed

    return pop


def notif_count_one(orig: Any) -> Any:
    # #56033's class: the count of readers each producer rank waits for is 1, whatever
    # D's TP (utils.py:606: max(1, tp_ratio) local ranks share a remote rank).
    def count(self: Any, remote_tp_size: int, remote_dcp_size: int) -> int:
        orig(self, remote_tp_size, remote_dcp_size)
        return 1

    return count


def notif_before_read_done(orig: Any) -> Any:
    # ai-dynamo/nixl#252's effect, in vLLM's code: the READ's "r:n" reaches the producer
    # before the READ completes, so P may count it and free the blocks under the READ
    # (LeaseClock.tla's NotifFirst). Here D sends it with send_notif as it posts the READ,
    # instead of attaching it to the transfer (pull_worker.py:546-556).
    def read_blocks(self: Any, read_spec: Any, dst_engine_id: str, *a: Any, **k: Any) -> Any:
        wrapper = self.nixl_wrapper
        saved = wrapper.__dict__.get("make_prepped_xfer")
        make = wrapper.make_prepped_xfer
        early: list[bytes] = []

        def eager(op: str, *xa: Any, **xk: Any) -> Any:
            early.append(xk.pop("notif_msg", b""))
            return make(op, *xa, notif_msg=b"", **xk)

        wrapper.make_prepped_xfer = eager
        try:
            posted = orig(self, read_spec, dst_engine_id, *a, **k)
        finally:
            if saved is None:
                del wrapper.make_prepped_xfer
            else:
                wrapper.make_prepped_xfer = saved
        agent = self._remote_agents[dst_engine_id][(0, read_spec.remote_rank)]
        for msg in early:
            if msg:
                wrapper.send_notif(agent, notif_msg=msg)
        return posted

    return read_blocks


def notify_local_id(orig: Any) -> Any:
    # #36958: MLA with P TP > D TP: D READs one producer rank and notifies the others that
    # it has the blocks (pull_worker.py:369-391), but with its own request id instead of
    # meta.remote.request_id; P does not recognise it and holds the blocks until the lease.
    # vLLM's _read_blocks_for_req as is, its standalone send_notif calls (not those inside
    # _read_blocks: a READ's own notification and the empty-slice notify) rewritten.
    def read_for_req(self: Any, req_id: str, meta: Any, *a: Any, **k: Any) -> Any:
        wrapper = self.nixl_wrapper
        saved = wrapper.__dict__.get("send_notif")
        send, inner = wrapper.send_notif, self._read_blocks
        depth = [0]

        def read_blocks(*ra: Any, **rk: Any) -> Any:
            depth[0] += 1
            try:
                return inner(*ra, **rk)
            finally:
                depth[0] -= 1

        def notif(agent: Any, notif_msg: bytes = b"", *na: Any, **nk: Any) -> Any:
            remote = f"{meta.remote.request_id}:".encode()
            if depth[0] == 0 and notif_msg.startswith(remote):
                notif_msg = f"{req_id}:".encode() + notif_msg[len(remote) :]
            return send(agent, *na, notif_msg=notif_msg, **nk)

        wrapper.send_notif, self._read_blocks = notif, read_blocks
        try:
            return orig(self, req_id, meta, *a, **k)
        finally:
            del self._read_blocks
            if saved is None:
                del wrapper.send_notif
            else:
                wrapper.send_notif = saved

    return read_for_req


def handshake_failure_only_logged(orig: Any) -> Any:
    # #35943's class on the handshake path: when the background handshake fails, the
    # deferred entry is only logged, never put on _failed_recv_reqs (base_worker.py:
    # 1353-1360), so its request is never reported and stays in WAITING_FOR_REMOTE_KVS.
    # vLLM's _background_nixl_handshake (1330-1362) with that one line dropped.
    def background(self: Any, req_id: str, remote_engine_id: str, meta: Any) -> None:
        fut = self._ensure_handshake(
            remote_engine_id, meta.remote.host, meta.remote.port, meta.tp_size,
            meta.dcp_size, meta.pp_size,
        )  # fmt: skip
        if fut is None:
            self._ready_requests.put((req_id, meta))
            return

        def request_ready(f: Any, entry: tuple[str, Any] = (req_id, meta)) -> None:
            try:
                f.result()
                self._ready_requests.put(entry)
            except Exception:  # the bug: logged (here: dropped), never reported failed
                pass

        fut.add_done_callback(request_ready)

    return background


def blocks_freed_at_once(orig: Any) -> Any:
    # #45357 undone: a finished or preempted request's blocks go back to the pool at once,
    # though a step still in flight writes them (scheduler.py:2759-2776 defers them).
    def can_be_freed(self: Any, request: Any) -> bool:
        return True

    return can_be_freed


def full_hit_parked(orig: Any) -> Any:
    # #56640/#54714: a full local prefix hit is still loaded "asynchronously": the scheduler
    # parks it in WAITING_FOR_REMOTE_KVS (scheduler.py:1320), nothing is read and no worker
    # ever reports it; 0.32's get_num_new_matched_tokens returns (0, False) for it
    # (pull_scheduler.py:58-65) and the request runs at once.
    def matched(self: Any, request: Any, num_computed_tokens: int) -> Any:
        count, load_async = orig(self, request, num_computed_tokens)
        params = request.kv_transfer_params
        if count == 0 and params is not None and params.get("do_remote_prefill"):
            return 0, True
        return count, load_async

    return matched


def offload_scheduled_unseen(orig: Any) -> Any:
    # #46951's sibling: the offloading scheduler forgets the blocks the step's scheduled
    # requests got (_update_req_states, offloading/scheduler.py:1281-1310), so a pending
    # store on a reused block is not flushed then either; only update_state_after_alloc's
    # blocks stay seen (none for a NIXL load in 0.32).
    def update(self: Any, scheduler_output: Any) -> None:
        before = set(self._current_batch_allocated_block_ids)
        orig(self, scheduler_output)
        self._current_batch_allocated_block_ids = before

    return update
