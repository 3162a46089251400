"""Faults a scenario stages inside a real engine (`kvspec scenario`, never `kvspec record`:
a user's recording must change nothing). Loaded as the engine's
`kv_connector_module_path` instead of kvspec.record.connectors; its class is the
recording one, so the run is recorded as any other.

`NixlPushConnector`: the producer's handshakes with decode engines fail. Push mode's
producer handshakes D only to WRITE (push_worker.py `_do_start_push_kv` ->
`_ensure_handshake`); the exchange itself (`_nixl_handshake`, run on vLLM's handshake
executor) raises here, as a side channel nobody answers does after vLLM's 5 s receive
timeout (base_worker.py:1043-1047), and everything after it is vLLM's: the handshake
future fails, `_ensure_handshake`'s callback logs `handshake_setup_failed`, the writer's
`_on_handshake` logs `push_handshake_failed` and returns ("The engine reclaims the
blocks via the TTL so we dont free here", push_worker.py:465-478). The recorder wraps the
failing exchange as it wraps a real one: a `handshake` event with ok false. Why a fault of
our own: D's side-channel address, which P dials, is the one D listens on (its
VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, push_scheduler.py:180-181), so no proxy-side change can
make that handshake fail (pd-handshake-fail's dead port only reaches D's handshake with P).

With `FAULT_ENV` set to `late:<lease s>`, the producer's handshakes with D are held, not
refused, and D's heartbeats are lost at P (pd-push-p-handshake-late): each exchange waits
until the rank's reaper reported every request it held (`_reqs_to_send` empty, at least a
lease after it started), 2 s more for P's scheduler to free them, then runs. vLLM runs
handshakes on one executor thread (`_handshake_initiation_executor`, max_workers=1,
base_worker.py:828-832), so a real one waits behind every exchange queued before it.
Heartbeats lost: the writer forwards D's notifications to P's step on
`_pending_completion_notifs` (push_worker.py:278-284); the fault's queue drops those
starting "HB:", as a D whose `send_notif` failed (logged at debug, base_worker.py
3203-3211) would have them dropped. Nothing else changes: the parked WRITE is vLLM's.
With `late:<lease s>:<file>` (pd-push-p-handshake-late-reuse) the exchange ends once the
scenario created the file (after P reused the freed blocks) instead (`late_go_file`).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvspec.record import connectors as _recording
from kvspec.record.log import FAULT_ENV
from kvspec.scenario_flows import wait_until

# push mode: vLLM 0.32+ (kvspec.record.connectors defines it only there)
_RecordedPush: Any = getattr(_recording, "NixlPushConnector", None)

HOLD_CAP_S = 300.0  # the held handshake's own bound (every wait has one)
REFUSED = "kvspec fault: the producer's handshake with the decode engine is refused"


class HandshakeRefused(ConnectionRefusedError):
    """What the staged handshake raises (vLLM logs it as the handshake's error)."""


def _refused(self: Any, host: str, port: int, *args: Any, **kwargs: Any) -> Any:
    raise HandshakeRefused(f"{REFUSED} ({host}:{port})")


def refuse_handshakes(worker_class: Any) -> None:
    """Make every handshake exchange of `worker_class`'s workers in this process fail.
    On the class, not the instance: the recorder wraps each worker's bound
    `_nixl_handshake` right after vLLM built it (connectors._wrap_handshakes), so the
    fault sits under the recorder, which then records the failure as a real one."""
    worker_class._nixl_handshake = _refused


def late_lease_s() -> float | None:
    """The lease the held handshake outwaits, or None: refuse (FAULT_ENV)."""
    v = os.environ.get(FAULT_ENV, "")
    return float(v.split(":")[1]) if v.startswith("late:") else None


def late_go_file() -> Path | None:
    """FAULT_ENV "late:<lease s>:<file>": the held handshake ends once the scenario created
    the file (pd-push-p-handshake-late-reuse: after P reused the freed blocks), not 2 s
    after the reaper's report; None without one."""
    parts = os.environ.get(FAULT_ENV, "").split(":", 2)
    return Path(parts[2]) if parts[0] == "late" and len(parts) == 3 else None


def hold_handshakes(worker_class: Any, lease_s: float, sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic,
                    go: Path | None = None) -> None:  # fmt: skip
    """Hold every handshake exchange of `worker_class`'s workers until the rank's reaper
    reported all its requests (at least `lease_s` after the exchange began; `HOLD_CAP_S`
    at most), then 2 s for the scheduler's free, then run the real exchange; with `go`,
    from `lease_s` on until that file exists instead (the reaper's report is then the
    scenario's to see: requests P takes after the free fill `_reqs_to_send` again).
    Idempotent: the class is patched once per process."""
    real = worker_class._nixl_handshake
    if getattr(real, "_kvspec_held", False):
        return

    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        sleep(lease_s)
        if go is not None:
            wait_until(go.exists, HOLD_CAP_S - lease_s, clock=clock, sleep=sleep)
            return real(self, *args, **kwargs)
        wait_until(lambda: not self._reqs_to_send, HOLD_CAP_S - lease_s, clock=clock,
                   sleep=sleep)  # fmt: skip
        sleep(2.0)
        return real(self, *args, **kwargs)

    held._kvspec_held = True  # type: ignore[attr-defined]
    worker_class._nixl_handshake = held


class LosesHeartbeats(queue.Queue[bytes]):
    """`_pending_completion_notifs` with D's heartbeats lost: `put` drops "HB:" ones."""

    def put(self, item: bytes, block: bool = True, timeout: float | None = None) -> None:
        if not item.startswith(b"HB:"):
            super().put(item, block, timeout)


if _RecordedPush is not None:

    class NixlPushConnector(_RecordedPush):  # type: ignore[misc]
        """The recording NixlPushConnector whose producer cannot handshake D, or (FAULT_ENV
        "late:") handshakes it only after its lease freed the requests and loses D's
        heartbeats (this module is the producer engine's only: its processes build
        producer workers)."""

        def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
                NixlPushConnectorWorker,
            )

            lease = late_lease_s()
            if lease is None:
                refuse_handshakes(NixlPushConnectorWorker)
            else:
                hold_handshakes(NixlPushConnectorWorker, lease, go=late_go_file())
            super().__init__(vllm_config, role, *args, **kwargs)
            worker = getattr(self, "connector_worker", None)
            if lease is not None and worker is not None:  # the worker role's
                worker._pending_completion_notifs = LosesHeartbeats()
