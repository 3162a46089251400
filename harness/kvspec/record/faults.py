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
"""

from __future__ import annotations

from typing import Any

from kvspec.record import connectors as _recording

# push mode: vLLM 0.32+ (kvspec.record.connectors defines it only there)
_RecordedPush: Any = getattr(_recording, "NixlPushConnector", None)

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


if _RecordedPush is not None:

    class NixlPushConnector(_RecordedPush):  # type: ignore[misc]
        """The recording NixlPushConnector whose producer cannot handshake D (this
        module is the producer engine's only: its processes build producer workers)."""

        def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
                NixlPushConnectorWorker,
            )

            refuse_handshakes(NixlPushConnectorWorker)
            super().__init__(vllm_config, role, *args, **kwargs)
