"""LeaseClock (spec/LeaseClock.tla) on the real classes: a producer rank's NIXL worker, its
lease deadlines against a controlled clock, real heartbeats and real READs.

The cluster is the vLLM driver's (one producer rank, one decode worker, TP 1, PCP 1), its
prompts and prefix caching laid out as `layout` (prefix_layout.py: one block each by
default; `kvspec lease --conform --layout`). The requests reach "lease installed" through
the real Scheduler and worker, with vLLM's `time.perf_counter` replaced, in the four NIXL
modules that stamp and compare deadlines
(`base_scheduler`, `pull_scheduler`: request_finished stamps now + kv_lease_duration,
pull_scheduler.py:255-266; `base_worker`, `pull_worker`), by a clock the driver advances:
`tick` adds kv_lease_duration / 6 seconds, so deadlines and heartbeat extensions (2/3 of the
lease) fall on whole ticks exactly as in the spec. Each spec action calls the real code
that does it, at the spec's granularity:

| spec | real |
|---|---|
| `start_read(r)` | the decode worker's `start_load_kv` posts a NIXL READ of r's block |
| `read_done(r)` | the decode worker's `get_transfer_results` reports it; bytes checked |
| `deliver(r)` | the READ's "r:1" notification is delivered; the producer's `_get_new_notifs` |
| `heartbeat` | the decode worker's `_send_heartbeats`; the producer's `_handle_heartbeat` |
| `reap` | the producer's `_reap_expired_send_leases` |
| `tick` | the clock advances one tick |

A heartbeat the spec loses is dropped at the producer's agent, as a failed send would be.
Observed: `p` (r in the worker's `_reqs_to_send`), `ttl` (its deadline in whole ticks from
now, for a leased r) and `d` (the READ's state, from the decode worker). Not driven: the
handshake-pending first heartbeat (`hs`: at ttl = Lease >= Extend it changes nothing).

A notification overtaking its READ (`NotifFirst`, ai-dynamo/nixl#252) is UCX's ordering,
which real NIXL cannot be told to produce; with `notif_first` the driver injects it at the
NIXL seam of D's agent (`EarlyNotifs`), leaving vLLM's code as it is: D's READ is prepared
without its notification and held unposted; the notification goes out when the spec
delivers it (before the READ, in the overtaking paths) or right after the READ completes
(NIXL's order); the READ is posted and completes at `read_done`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvspec.drivers.base import MissingAction
from kvspec.drivers.prefix_layout import ONE_BLOCK, Layout
from kvspec.drivers.vllm_driver import VllmDriver
from kvspec.drivers.vllm_env import LEASE_SECONDS
from kvspec.drivers.vllm_inbox import DEFAULT_WAITS, Waits
from kvspec.drivers.vllm_view import req_id
from kvspec.matrix import ModelRow, Topology

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
# push mode stamps (push_scheduler.py:270) and rebases (push_worker.py:219) with its own
# module's perf_counter; those modules are 0.32+'s (controlled_clock skips a missing one)
CLOCKED = tuple(
    f"{NIXL}.{m}" for m in ("base_scheduler", "pull_scheduler", "base_worker", "pull_worker",
                            "push_scheduler", "push_worker")
)  # fmt: skip
TICK_S = LEASE_SECONDS / 6  # the spec's tick: kv_lease_duration // 6
START = 1_000_000.0  # whole numbers of seconds: deadlines compare exactly


class _Clock:
    """`time` as the NIXL modules see it: perf_counter is the driver's; the rest real."""

    def __init__(self) -> None:
        self.now = START

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def mark_consumers_active(vd: VllmDriver, now: float) -> None:
    """The decode workers handshook when the (pooled) cluster was built, maybe under the
    real clock: they were active `now` on the controlled one (else their engine-TTL
    eviction, base_worker.py _evict_stale_engines, drops the producer at a heartbeat)."""
    for cons in vd.c.consumers:
        active = cons.connector_worker._engine_last_active
        for eid in active:
            active[eid] = now


@contextlib.contextmanager
def controlled_clock(clock: _Clock, modules: tuple[str, ...] = CLOCKED) -> Iterator[None]:
    import importlib.util

    mods = [importlib.import_module(m) for m in modules if importlib.util.find_spec(m)]
    saved = [m.time for m in mods]
    for m in mods:
        m.time = clock  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, t in zip(mods, saved, strict=True):
            m.time = t  # type: ignore[attr-defined]


class EarlyNotifs:
    """A seam on D's NIXL agent standing for a transport that may deliver a READ's
    notification before its data: `make_prepped_xfer` keeps the notification back
    (vLLM attaches it, pull_worker.py:546-553), `transfer` holds the READ unposted; the
    driver posts each (`post`, `notify`) when the spec says."""

    def __init__(self, wrapper: Any, agent: str) -> None:
        self.wrapper, self.agent = wrapper, agent
        self._make, self._transfer = wrapper.make_prepped_xfer, wrapper.transfer
        self.msg: dict[int, bytes] = {}  # held handle -> its notification
        self.unposted: list[int] = []
        self.notified: set[bytes] = set()
        wrapper.make_prepped_xfer = self.make_prepped_xfer
        wrapper.transfer = self.transfer

    def make_prepped_xfer(self, op: str, *a: Any, notif_msg: bytes = b"", **k: Any) -> Any:
        handle = self._make(op, *a, notif_msg=b"", **k)
        self.msg[handle] = bytes(notif_msg)
        return handle

    def transfer(self, handle: Any, *a: Any, **k: Any) -> str:
        self.unposted.append(handle)
        return "PROC"

    def post(self) -> None:
        """Post every held READ (the real NIXL transfer)."""
        held, self.unposted = self.unposted, []
        for handle in held:
            self._transfer(handle)

    def notify(self, prefix: bytes) -> None:
        """Send the held notification that starts with `prefix`, once."""
        for msg in self.msg.values():
            if msg.startswith(prefix) and msg not in self.notified:
                self.notified.add(msg)
                self.wrapper.send_notif(self.agent, notif_msg=msg)

    def restore(self) -> None:
        self.post()  # nothing is left unposted for the pooled cluster's reset to drain
        for name in ("make_prepped_xfer", "transfer"):
            with contextlib.suppress(AttributeError):
                delattr(self.wrapper, name)


@dataclass
class LeaseDriver:
    requests: int
    waits: Waits = DEFAULT_WAITS
    notif_first: bool = False  # inject NotifFirst's ordering (EarlyNotifs)
    layout: Layout = ONE_BLOCK  # P's prompts and prefix caching (prefix_layout.py)
    clock: _Clock = field(default_factory=_Clock)
    early: EarlyNotifs | None = None
    d: dict[int, str] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __post_init__(self) -> None:
        row = ModelRow(
            "lease", "v0.30-shipped", "nixl", Topology(1, 1, 1), self.requests, self.requests,
            False,
        )  # fmt: skip
        self._stack.enter_context(controlled_clock(self.clock))
        try:
            self.vd = self._stack.enter_context(
                VllmDriver(row, waits=self.waits, layout=self.layout)
            )
            for _ in range(2):  # prefill, then the step whose metadata installs the leases
                for a in ("schedule", "execute_model", "update_from_output"):
                    getattr(self.vd, a)()
        except BaseException:
            self._stack.close()
            raise
        mark_consumers_active(self.vd, self.clock.now)
        self.d = {r: "queued" for r in range(1, self.requests + 1)}
        if self.notif_first:
            cw = self.vd.c.consumer_nixl(0).connector_worker
            agent = cw._remote_agents[self.vd.c.engine_id][(0, 0)]
            self.early = EarlyNotifs(cw.nixl_wrapper, agent)
            self._stack.callback(self.early.restore)
        missing = [r for r in self.d if req_id(r) not in self._nw._reqs_to_send]
        if missing:
            self.close()
            raise MissingAction(f"lease driver set-up: no lease installed for {missing}")

    @property
    def _nw(self) -> Any:
        return self.vd.c.nixl_worker(0)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> LeaseDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ actions
    def start_read(self, r: int) -> None:
        """LeaseClock `start_read(r)`: a real READ of r's block, whatever P's lease says."""
        if self.d[r] != "queued":
            raise MissingAction(f"start_read({r}): {self.d[r]}")
        self.vd.post_read(r, 0)
        self.d[r] = "reading"

    def read_done(self, r: int) -> None:
        """LeaseClock `read_done(r)`: the decode worker reports the READ done."""
        if self.d[r] != "reading":
            raise MissingAction(f"read_done({r}): {self.d[r]}")
        if self.early is not None:
            self.early.post()
        self.vd.await_read(r, 0)
        if self.early is not None:  # NIXL's order: the notification follows the data
            self.early.notify(f"{req_id(r)}:".encode())
        self.d[r] = "done" if r in self.delivered else "notifying"

    def deliver(self, r: int) -> None:
        """LeaseClock `deliver(r)`: "r:1" delivered; the producer's _get_new_notifs. While
        the READ is still in progress only under `notif_first` (the seam sends it now)."""
        early = self.d[r] == "reading" and self.early is not None
        if self.d[r] != "notifying" and not early:
            raise MissingAction(f"deliver({r}): {self.d[r]}")
        if early:
            assert self.early is not None
            self.early.notify(f"{req_id(r)}:".encode())
        self.vd.deliver_notif(r, 0)
        self._nw._get_new_notifs()
        self.delivered.add(r)
        if not early:
            self.d[r] = "done"

    def abandon(self, r: int) -> None:
        """LeaseClock `abandon(r)`: D never reads r (nothing to do on the real side)."""
        if self.d[r] != "queued":
            raise MissingAction(f"abandon({r}): {self.d[r]}")
        self.d[r] = "done"

    def heartbeat(self, delivered: bool) -> None:
        """LeaseClock `heartbeat`: D's _send_heartbeats for the requests it tracks; on
        arrival, the producer's _handle_heartbeat, unless the model lost it."""
        tracked = {req_id(r) for r, s in self.d.items() if s in ("queued", "reading")}
        if not tracked:
            raise MissingAction("heartbeat: D tracks no request")
        api, cons = self.vd.c.api, self.vd.c.consumers[0]
        meta = api.NixlConnectorMetadata()
        meta.heartbeat_by_engine = {
            self.vd.c.engine_id: api.HeartbeatInfo(
                req_ids=tracked, host="127.0.0.1", port=0, tp_size=1
            )
        }
        cons.connector_worker._send_heartbeats(meta)
        _, msg = self.vd.c.inboxes[0].wait_arrived_where(
            lambda m: m.startswith(b"HB:"), "a heartbeat at the producer", self.waits
        )
        if delivered:
            self._nw._handle_heartbeat(msg.decode()[3:])

    def reap(self) -> None:
        """LeaseClock `reap`: one call of the producer's _reap_expired_send_leases."""
        done: set[str] = set()
        self._nw._reap_expired_send_leases(done)
        if not done:
            raise MissingAction("reap: no lease was reaped")

    def tick(self) -> None:
        self.clock.now += TICK_S

    # ------------------------------------------------------------------ observe
    def observe(self) -> dict[int, tuple[str, int | None, str]]:
        """r -> (p, ttl for a leased r else None, d)."""
        out: dict[int, tuple[str, int | None, str]] = {}
        for r, dr in self.d.items():
            dl = self._nw._reqs_to_send.get(req_id(r))
            if dl is None:
                out[r] = ("freed", None, dr)
            else:
                out[r] = ("leased", max(0, math.ceil((dl - self.clock.now) / TICK_S)), dr)
        return out
