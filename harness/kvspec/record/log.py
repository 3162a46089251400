"""The recording's NDJSON schema (one file per process: engine, role, rank, pid), its
writer, which never raises into the engine, and its reader, which names the file and line
of anything it cannot read.

Schema version 1; one JSON object per line:

| field    | type            | meaning                                                     |
|----------|-----------------|-------------------------------------------------------------|
| `v`      | int             | schema version (1)                                          |
| `engine` | str             | `kv_transfer_config.engine_id`                              |
| `kv_role`| str             | `kv_producer`, `kv_consumer` or `kv_both`                   |
| `role`   | str             | `scheduler` or `worker`                                     |
| `rank`   | int             | the worker's rank in its engine's world (0 for scheduler)   |
| `world`  | int             | the engine's world size (TP x PP x PCP)                     |
| `pid`    | int             | the process                                                 |
| `seq`    | int             | the event's index in its file                               |
| `t_ns`   | int             | `time.monotonic_ns()` at the call's return (one clock for   |
|          |                 | every process on a host); a `read` at its call's entry      |
| `call`   | str             | see below                                                   |
| `step`   | int or null     | the engine step (`Scheduler.schedule` count from 1)         |
| `reqs`   | list[str]       | request ids the call is about                               |
| `result` | object          | the call's outcome (per call, below)                        |

Calls: scheduler side `add_request` (`result.remote_prefill`: the request asks for its KV
from a producer, `do_remote_prefill`; then `result.remote_engine` and
`result.remote_request_id`: the producer's engine and request id; `result.free`),
`schedule` (`result.new`: newly scheduled ids),
`update_from_output` (`result.finished_sending`, `finished_recving`, `failed_recving`,
`invalid_block_ids`: the aggregated connector output, empty when the step had none),
`finish_requests`
(`result.status`), `request_finished` (`result.delay`, `result.status`, `result.blocks`:
the KV blocks it holds then, every group's; `result.block_ids`: the first group's ids,
in order, since 2026-12-07), `free_blocks`
(`result.free`: free blocks after it); worker side `get_transfer_results` (the rank's
finished_sending / finished_recving / failed_recving), `load_errors` (the rank's
`get_block_ids_with_load_errors`, when not empty: `result.block_ids`, and `reqs` the
receives registered on the rank, then or at its last report, that hold one of those blocks;
0.29 reports a failed load this way only, in finished_recving with no failed_recving),
`read` (a NIXL READ posted:
`result.remote_request_id`, `result.remote_rank`, `result.notify_only`: it had no local
block, so it only notified the producer: a full hit or an aborted request's cleanup),
`write` (push mode, a producer worker's NIXL WRITE posted by its writer thread,
`_xfer_blocks`, stamped at entry: `reqs` the producer's id, `result.remote_request_id`,
`result.remote_rank`: the decode rank written to, `result.remote_engine`, `result.posted`:
a handle came back; since 2026-12-05),
`heartbeat_send` (a decode worker's
`_send_heartbeats` for one producer engine, stamped at entry: `reqs` the producer's ids,
`result.remote_engine`, `result.sent` / `result.failed`: producer ranks whose "HB:" message
went out / raised; neither: swallowed by the proactive handshake) and `heartbeat_recv` (a
producer worker's `_handle_heartbeat`, stamped at entry: `reqs` the payload,
`result.held`: the ids it held a lease for, the ones it extends) and `handshake` (a
worker's NIXL handshake with a remote engine, `_nixl_handshake`, stamped at its end, on
the handshake thread: `result.remote_engine`, `result.ok`, `result.started_ns`, and
`result.error` where it raised: vLLM then logs handshake_setup_failed and fails the
requests waiting on it; since 2026-12-05) and `kv_caches` (a worker's
`register_kv_caches`: the attention backend vLLM picked for the host as NIXL saw it,
`result.backend`, `kernel_block`: its block size after the kernel sync, `dtype`: the
caches'; since 2026-12-06) and, where `KVSPEC_KV_DIGEST=1` (kvspec scenario sets it),
`kv_digest` (`result.side`: "sent", a push producer worker's blocks of a request the
scheduler handed it as finished, or "received", a worker's blocks of a request it reports
received; `result.digest`: sha256 of those blocks' bytes in every layer, 16 hex digits,
null where the layout is unknown; `result.blocks`; `result.per_block`: each block's
digest, in order, since 2026-12-07; kvspec.record.kv_digest). The
scheduler's `start`
event describes the deployment (`result.connector`, `children`: MultiConnector's children
in their order, `tp`, `pp`, `pcp`, `async_scheduling`, `vllm`, `lease`: kv_lease_duration
in s, `kv_load_failure_policy`, `mla`, `prefix_caching`: since 2026-12-07,
`max_num_inflight_kv_loads`: vLLM 0.34's load cap, null where unset; since 2026-12-07). Sets of ids
are written sorted; lists keep their order.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

SCHEMA_VERSION = 1
DIR_ENV = "KVSPEC_RECORD_DIR"
# the producer fault kvspec.record.faults stages: unset, refuse; "late:<lease s>", hold
FAULT_ENV = "KVSPEC_P_FAULT"
FIELDS = ("v", "engine", "kv_role", "role", "rank", "world", "pid", "seq", "t_ns", "call")


@dataclass(frozen=True)
class Event:
    engine: str
    kv_role: str
    role: str
    rank: int
    world: int
    pid: int
    seq: int
    t_ns: int
    call: str
    step: int | None = None
    reqs: tuple[str, ...] = ()
    result: dict[str, Any] = field(default_factory=dict)

    def ids(self, key: str) -> frozenset[str]:
        return frozenset(str(x) for x in self.result.get(key, ()) or ())


class RecordError(ValueError):
    """A recording file that is not schema-v1 NDJSON (message: file:line: what to do)."""


def _sorted(xs: Iterable[object]) -> list[str]:
    return sorted(str(x) for x in xs)


@dataclass
class Recorder:
    """Writes one process's events. Every failure is swallowed after one line on stderr:
    a recorder that raises would change the engine it watches."""

    engine: str
    kv_role: str
    role: str
    rank: int
    world: int
    directory: Path
    _seq: int = 0
    _out: IO[str] | None = None
    _broken: bool = False
    # the handshake event is written from vLLM's handshake thread: one writer at a time,
    # so `seq` stays the file's order
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _file(self) -> IO[str]:
        if self._out is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            name = f"{self.engine}-{self.role}-{self.rank}-{os.getpid()}.ndjson"
            self._out = (self.directory / name).open("a", buffering=1)
        return self._out

    def emit(self, call: str, *, step: int | None = None, reqs: Iterable[object] = (),
             t_ns: int | None = None, **result: Any) -> None:  # fmt: skip
        with self._lock:
            self._emit(call, step, reqs, t_ns, result)

    def _emit(self, call: str, step: int | None, reqs: Iterable[object], t_ns: int | None,
              result: dict[str, Any]) -> None:  # fmt: skip
        if self._broken:
            return
        try:
            rec = {
                "v": SCHEMA_VERSION, "engine": self.engine, "kv_role": self.kv_role,
                "role": self.role, "rank": self.rank, "world": self.world,
                "pid": os.getpid(), "seq": self._seq,
                "t_ns": time.monotonic_ns() if t_ns is None else t_ns,
                "call": call, "step": step, "reqs": _sorted(reqs),
                # sets sorted (a deterministic file); lists keep their order (MultiConnector's
                # children: the first that loads a request wins)
                "result": {k: _sorted(v) if isinstance(v, (set, frozenset)) else
                           list(v) if isinstance(v, tuple) else v
                           for k, v in result.items()},
            }  # fmt: skip
            self._file().write(json.dumps(rec, sort_keys=True) + "\n")
            self._seq += 1
        except Exception as exc:  # noqa: BLE001 - never raise into vLLM
            self._broken = True
            print(f"kvspec record: recording stopped: {exc!r}", file=sys.stderr)


def _event(raw: object, where: str) -> Event:
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: not a JSON object; is this a kvspec recording?")
    missing = [k for k in FIELDS if k not in raw]
    if missing:
        raise RecordError(f"{where}: missing {', '.join(missing)}; record with kvspec record")
    if raw["v"] != SCHEMA_VERSION:
        raise RecordError(f"{where}: schema v{raw['v']}, this kvspec reads v{SCHEMA_VERSION}")
    try:
        return Event(
            engine=str(raw["engine"]), kv_role=str(raw["kv_role"]), role=str(raw["role"]),
            rank=int(raw["rank"]), world=int(raw["world"]), pid=int(raw["pid"]),
            seq=int(raw["seq"]), t_ns=int(raw["t_ns"]), call=str(raw["call"]),
            step=None if raw.get("step") is None else int(raw["step"]),
            reqs=tuple(str(r) for r in raw.get("reqs", ())),
            result=dict(raw.get("result", {})),
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise RecordError(f"{where}: {exc}; fix or drop the line") from exc


def read_file(path: Path) -> list[Event]:
    events = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            # A process killed mid-write leaves a torn last line: say so, keep the rest.
            raise RecordError(f"{path}:{n}: not JSON ({exc.msg}); drop the line") from exc
        events.append(_event(raw, f"{path}:{n}"))
    return events


def read_dir(directory: Path) -> list[Event]:
    """Every event of every `*.ndjson` in `directory`, in monotonic-time order (ties: file
    order, which keeps one process's events in its own order)."""
    files = sorted(directory.glob("*.ndjson"))
    if not files:
        raise RecordError(f"{directory}: no *.ndjson files; record with kvspec record first")
    events = [e for f in files for e in read_file(f)]
    return sorted(events, key=lambda e: (e.t_ns, e.pid, e.seq))
