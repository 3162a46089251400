"""Push mode on the real NixlPushConnector (the spec's Transfer = "push").

In push mode the producer WRITEs into the decode engine (vllm 0.32
`distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py`): the decode worker sends a
PUSH_REG notification naming its blocks (`_send_registration_to_p`, ~319-394), the
producer's `nixl-push-writer` thread matches it with the finished blocks the scheduler
shipped in `push_finished_blocks` (`_push_writer_loop`, ~223-288; `_do_start_push_kv`,
~440-513) and posts the WRITE; the engine's next `get_transfer_results` reports the
request once every WRITE handle is DONE (`_pop_done_transfers`, ~810-849).

What the driver controls, and how (everything else is vLLM's code, unchanged):
- the PUSH_REG's delivery: it reaches the producer agent through the NotifInbox that
  already sits on `nixl_wrapper.get_new_notifs` (the writer thread reads it there), and is
  held until the spec's `push_write` delivers it;
- a WRITE's completion: `HeldWrites` sits on the producer's `nixl_wrapper.check_xfer_state`
  and reports a posted WRITE as "PROC" until the spec's `push_write_done` releases it
  (after the real transfer is DONE and its bytes are checked), so the engine sees the
  completion exactly where the spec puts it. A seam of our own because NIXL has no way
  to hold a finished transfer back.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvspec.drivers.vllm_inbox import Waits

HOST = "127.0.0.1"


class HeldWrites:
    """One producer rank's WRITE handles: "PROC" to vLLM until released."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self._real = wrapper.check_xfer_state  # the real bound method
        self._lock = threading.Lock()
        self.released: set[int] = set()
        wrapper.check_xfer_state = self.check_xfer_state

    def check_xfer_state(self, handle: int) -> str:
        state = str(self._real(handle))
        with self._lock:
            if state == "DONE" and handle not in self.released:
                return "PROC"
        return state

    def real_state(self, handle: int) -> str:
        return str(self._real(handle))

    def release(self, handles: list[int]) -> None:
        with self._lock:
            self.released |= set(handles)

    def reset(self) -> None:
        with self._lock:
            self.released.clear()

    def restore(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.wrapper.check_xfer_state


@dataclass
class PushSide:
    """The decode engine's side channel (so producers can handshake with it before a
    WRITE) and each producer rank's held WRITEs."""

    engine_id: str  # the decode engine's
    port: int
    listener: Any  # scheduler-role NixlPushConnector (kv_consumer) serving D's metadata
    held: list[HeldWrites] = field(default_factory=list)

    def registration(
        self, rid: str, local: tuple[int, ...], producer: str, p_port: int, tp: int
    ) -> dict[str, Any]:
        """What D's push scheduler stages for rid (push_scheduler.py:175-189): D's blocks
        `local`, in token order."""
        return {
            "request_id": rid,
            "decode_engine_id": self.engine_id,
            "decode_host": HOST,
            "decode_port": self.port,
            "decode_tp_size": tp,
            "local_block_ids": (list(local),),
            "remote_engine_id": producer,
            "remote_host": HOST,
            "remote_port": p_port,
            "remote_tp_size": tp,
            "remote_pp_size": 1,
        }

    def shutdown(self) -> None:
        for h in self.held:
            h.restore()
        self.listener.shutdown()


def serve_decode_handshakes(
    api: SimpleNamespace,
    dcfg: Any,
    dkc: Any,
    consumers: list[Any],
    engine_id: str,
    port: int,
    waits: Waits,
) -> Any:
    """D's side channel: a scheduler-role NixlPushConnector publishing each decode rank's
    handshake metadata, as the decode engine's scheduler does (keyed (pp, tp))."""
    saved = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    try:
        with api.set_current_vllm_config(dcfg):
            listener = api.KVConnectorFactory.create_connector(
                config=dcfg, role=api.KVConnectorRole.SCHEDULER, kv_cache_config=dkc
            )
    finally:
        if saved is not None:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = saved
    md = {(0, t): c.get_handshake_metadata() for t, c in enumerate(consumers)}
    from kvspec.drivers.vllm_inbox import serve_handshake_metadata

    serve_handshake_metadata(listener, {k: v for k, v in md.items() if v}, waits)
    return listener


def handshake_decode(nw: Any, side: PushSide, tp: int, waits: Waits) -> None:
    """Producer rank -> decode engine: the real `_ensure_handshake` that
    `_do_start_push_kv` would start lazily (done up front so no WRITE waits on it)."""
    fut = nw._ensure_handshake(side.engine_id, HOST, side.port, tp)

    def done() -> bool:
        if fut is not None and fut.done() and fut.exception() is not None:
            raise RuntimeError(f"NIXL handshake with the decode engine failed: {fut.exception()}")
        return side.engine_id in nw._remote_agents

    waits.until(done, "the producer's NIXL handshake with the decode engine")


def write_handles(nw: Any, rid: str) -> list[int]:
    """The WRITE handles rank nw has posted for rid and not yet popped."""
    with nw._sending_transfers_lock:
        return list(nw._sending_transfers.get(rid, ()))


def reset_producer(nw: Any, held: HeldWrites, waits: Waits) -> None:
    """Forget a trace's push state on one producer rank. WRITEs it left posted are
    released once really DONE (WaitTimeout otherwise); the writer thread's own maps are
    cleared through its eviction channel (`_evict_finished_inbox`), as vLLM clears them."""
    with nw._sending_transfers_lock:
        pending = [h for hs in nw._sending_transfers.values() for h in hs]
    waits.until(
        lambda: all(held.real_state(h) != "PROC" for h in pending),
        "WRITEs a trace left in flight to complete",
    )
    with nw._sending_transfers_lock:
        for h in pending:
            with contextlib.suppress(Exception):
                nw.nixl_wrapper.release_xfer_handle(h)
        nw._sending_transfers.clear()
        nw._send_failures.clear()
    held.reset()
    # The writer thread owns these maps; a snapshot of their keys is enough to evict them.
    for rid in {*tuple(nw._push_finished_blocks), *tuple(nw._pending_d_registrations)}:
        nw._evict_finished_inbox.put(rid)
    nw._push_writer_wake.set()
    waits.until(
        lambda: (
            nw._evict_finished_inbox.empty()
            and not nw._push_finished_blocks
            and not nw._pending_d_registrations
        ),
        "the push writer to drop the previous trace's blocks",
    )


def reset_consumer(cw: Any) -> None:
    """Drop the completion notifications the previous trace's WRITEs left on a decode
    worker (D's own accounting is not the producer spec's)."""
    q: queue.Queue[bytes] = cw._pending_completion_notifs
    with contextlib.suppress(queue.Empty):
        while True:
            q.get_nowait()
    cw.consumer_notification_counts_by_req.clear()


def build(
    api: SimpleNamespace, dcfg: Any, nixl_worker: Any, cluster: Any, waits: Waits
) -> PushSide:
    """The push half of a cluster whose decode workers (NixlPushConnector, kv_consumer)
    have already handshaken with the producer: D's side channel, every published producer
    rank's handshake with D, and the held WRITEs of every producer rank."""
    from kvspec.drivers.vllm_caches import kv_cache_config
    from kvspec.drivers.vllm_env import free_port

    port = free_port()
    engine_id = str(dcfg.kv_transfer_config.engine_id)
    listener = serve_decode_handshakes(
        api, dcfg, kv_cache_config(api, dcfg), cluster.consumers, engine_id, port, waits
    )
    side = PushSide(engine_id, port, listener)
    try:
        tp = cluster.topology.tp
        for w in range(cluster.world_size):
            nw = nixl_worker(w)
            side.held.append(HeldWrites(nw.nixl_wrapper))
            if cluster.workers[w].get_handshake_metadata() is not None:
                handshake_decode(nw, side, tp, waits)
    except BaseException:
        side.shutdown()
        raise
    listener.connector_scheduler._stop_event.set()
    return side


def reset(cluster: Any, waits: Waits) -> None:
    """Between traces: each producer rank's and each decode worker's push state."""
    assert cluster.push is not None
    for w in range(cluster.world_size):
        reset_producer(cluster.nixl_worker(w), cluster.push.held[w], waits)
    for cons in cluster.consumers:
        reset_consumer(cons.connector_worker)
