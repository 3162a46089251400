"""Seams the decode driver (drivers/decode_driver.py) puts on D's NIXL worker, so that a
transfer or a handshake ends when the spec says: vLLM's own code runs on each side of them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from kvspec.drivers.base import MissingAction
from kvspec.drivers.vllm_env import DriverUnavailable
from kvspec.drivers.vllm_inbox import Waits


class HeldReads:
    """One decode worker's READ handles: "PROC" to vLLM until the spec ends them, then
    NIXL's own state (ok) or "ERR" (a failed transfer). Each READ's remote side handle is
    noted as it is made: it names the producer rank read (hetero TP reads several). So is
    its notification, which NIXL sends with the READ's completion, and every standalone
    `send_notif` (notify-only messages, heartbeats): what D sent P, to project `pin`."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self._real = wrapper.check_xfer_state
        self._make = wrapper.make_prepped_xfer
        self._send = wrapper.send_notif
        self._lock = threading.Lock()
        self.ended: dict[int, bool] = {}  # handle -> ok
        self.remote_side: dict[int, Any] = {}  # handle -> remote xfer side handle
        self.notif: dict[int, bytes] = {}  # handle -> the notification its completion sends
        self.sent: list[tuple[str, bytes]] = []  # standalone send_notif: (agent, message)
        wrapper.check_xfer_state = self.check_xfer_state
        wrapper.make_prepped_xfer = self.make_prepped_xfer
        wrapper.send_notif = self.send_notif

    def make_prepped_xfer(self, op: str, local: Any, lids: Any, remote: Any, *a: Any,
                          **k: Any) -> Any:  # fmt: skip
        handle = self._make(op, local, lids, remote, *a, **k)
        self.remote_side[handle] = remote
        msg = k.get("notif_msg", a[1] if len(a) > 1 else b"")
        self.notif[handle] = msg.encode() if isinstance(msg, str) else bytes(msg)
        return handle

    def send_notif(self, agent: str, notif_msg: Any, *a: Any, **k: Any) -> Any:
        msg = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        self.sent.append((agent, msg))
        return self._send(agent, notif_msg, *a, **k)

    def check_xfer_state(self, handle: int) -> str:
        with self._lock:
            ok = self.ended.get(handle)
        if ok is None:
            return "PROC"
        return str(self._real(handle)) if ok else "ERR"

    def real_state(self, handle: int) -> str:
        return str(self._real(handle))

    def end(self, handle: int, ok: bool) -> None:
        with self._lock:
            self.ended[handle] = ok

    def restore(self) -> None:
        for name in ("check_xfer_state", "make_prepped_xfer", "send_notif"):
            with contextlib.suppress(AttributeError):
                delattr(self.wrapper, name)


class HeldHandshake:
    """D worker `cw` at its first contact with the producer engine (Decode.tla Handshake):
    the engine is taken out of `_remote_agents`, so vLLM defers each entry to
    `_background_nixl_handshake` (pull_worker.py:145-147); vLLM's own `_ensure_handshake`
    future and callbacks run (base_worker.py:1286-1353), and only the network exchange,
    `_nixl_handshake`, is replaced: it returns the agents the cluster's real handshake
    registered, once the driver releases it (the spec's `handshake_done`)."""

    NEEDS = (
        "_ensure_handshake",
        "_handshake_futures",
        "_ready_requests",
        "_nixl_handshake",
        "_failed_recv_reqs",
    )

    def __init__(self, cw: Any, engine: str, waits: Waits) -> None:
        missing = [n for n in self.NEEDS if not hasattr(cw, n)]
        if missing:  # a release without the background handshake path: not driven here
            raise DriverUnavailable(f"first contact: this vLLM's NIXL worker has no {missing}")
        self.cw, self.engine, self.waits = cw, engine, waits
        self.agents = cw._remote_agents.pop(engine)
        self.offset = cw._engine_clock_offset.get(engine, 0.0)
        self.gate = threading.Event()
        self.failing = False  # the held exchange fails when released (handshake_fail)
        self.deferred = 0  # entries start_load_kv handed to the pending handshake
        cw._nixl_handshake = self._exchange

    def _exchange(self, *a: Any, **k: Any) -> tuple[dict[Any, str], float]:
        # The executor thread waits for the spec; never forever (a closed driver opens it).
        if not self.gate.wait(timeout=3600):
            raise TimeoutError("the driver never released the handshake")
        if self.failing:
            raise ConnectionError("kvspec: the producer's side channel refused the handshake")
        return dict(self.agents), self.offset

    def state(self) -> str:
        if self.engine in self.cw._remote_agents:
            return "done"
        return "pending" if self.engine in self.cw._handshake_futures else "none"

    def start(self, params: dict[str, Any]) -> None:
        """D's proactive handshake (`_ensure_handshake`, as `_send_heartbeats` starts it)."""
        self.cw._ensure_handshake(self.engine, str(params["remote_host"]),
                                  int(params["remote_port"]), int(params["tp_size"]))  # fmt: skip

    def _settle(self, what: str) -> None:
        """Open the held exchange and wait until every callback vLLM attached to its future
        has run (ours is attached last, and a Future runs its callbacks in order): decided
        from the future, not from what the callbacks should have done."""
        settled = threading.Event()
        fut = self.cw._handshake_futures.get(self.engine)
        if fut is None:
            raise MissingAction(f"{what}: no handshake pending")
        fut.add_done_callback(lambda _f: settled.set())
        self.gate.set()
        self.waits.until(settled.is_set, what)
        self.deferred = 0

    def release(self) -> None:
        """The exchange completes; vLLM's callbacks run (the agents registered, every
        deferred entry on `_ready_requests`)."""
        self._settle("the handshake's callbacks")

    def fail(self) -> None:
        """The exchange fails (Decode.tla `handshake_fail`); wait for vLLM's callbacks: the
        future gone, no agents registered, every deferred entry on `_failed_recv_reqs`.
        The next handshake vLLM starts is held again."""
        self.failing = True
        try:
            self._settle("the failed handshake's callbacks")
        finally:
            self.failing = False
            self.gate.clear()

    def failed(self) -> list[str]:
        """`_failed_recv_reqs` (D request ids), without taking them."""
        return [str(rid) for rid in list(self.cw._failed_recv_reqs.queue)]

    def ready(self) -> list[tuple[str, bool]]:
        """`_ready_requests` as (D request id, awaited), without taking them."""
        return [(rid, bool(getattr(meta, "awaiting_kvs", True)))
                for rid, meta in list(self.cw._ready_requests.queue)]  # fmt: skip

    def abandon(self) -> None:
        """End a trace's use of the seam: a still pending exchange fails (so no callback
        acts on a trace that is over: a producer's `_on_handshake` would queue its parked
        WRITE for the writer thread, which races any drain), then `restore`."""
        if self.state() == "pending":
            with contextlib.suppress(Exception):  # closing: best effort, then restore
                self.fail()
        self.restore()

    def restore(self) -> None:
        """Release the exchange, let vLLM's callbacks finish, and leave the worker as the
        pooled cluster expects it: handshaken, nothing queued for its next step."""
        self.gate.set()
        with contextlib.suppress(Exception):  # a closing driver: best effort, then reset
            self.waits.until(lambda: self.engine not in self.cw._handshake_futures,
                             "the handshake's future to complete")  # fmt: skip
        with contextlib.suppress(AttributeError):
            del self.cw._nixl_handshake
        self.cw._remote_agents.setdefault(self.engine, self.agents)
        while not self.cw._ready_requests.empty():  # the next trace starts with none
            self.cw._ready_requests.get_nowait()
