"""Synthetic recordings (kvspec.record.log events) of runs the real classes would make, for
trace-validation tests that need no engine: the shapes are copied from recordings of real
vLLM 0.32 engines (conformance/recorded/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvspec.record.log import Event


@dataclass
class Synth:
    world: int = 1
    pcp: int = 1
    d_world: int = 1  # the decode engine's TP
    async_scheduling: bool = False
    events: list[Event] = field(default_factory=list)
    _seq: dict[tuple[str, str, int], int] = field(default_factory=dict)
    _t: int = 0

    def ev(self, engine: str, role: str, rank: int, call: str, reqs: tuple[str, ...] = (),
           step: int | None = None, **result: Any) -> None:  # fmt: skip
        key = (engine, role, rank)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        self._t += 10
        pid = 1000 + 10 * (engine == "D") + (rank + 1 if role == "worker" else 0)
        world = self.world if engine == "P" else self.d_world
        self.events.append(Event(engine, "kv_both", role, rank, world, pid, seq, self._t, call,
                                 step, reqs, result))  # fmt: skip

    def at(self, seconds: float) -> None:
        """The next event happens `seconds` after the recording's start (not earlier than
        the last one)."""
        self._t = max(self._t, int(seconds * 1e9))

    def start(self) -> None:
        self.ev("P", "scheduler", 0, "start", connector="NixlConnector", children=[],
                async_scheduling=self.async_scheduling, tp=self.world // self.pcp, pp=1,
                pcp=self.pcp)  # fmt: skip

    def step(self, n: int, new: tuple[str, ...] = (), outs: dict[int, list[str]] | None = None,
             finished: tuple[str, ...] = (), sending: tuple[str, ...] = ()) -> None:  # fmt: skip
        """Synchronous step n: schedule, every rank's report, request_finished, update."""
        self.ev("P", "scheduler", 0, "schedule", new, n, new=list(new), finished_req_ids=[])
        for w in range(self.world):
            self.ev("P", "worker", w, "get_transfer_results",
                    finished_sending=(outs or {}).get(w, []), finished_recving=[],
                    failed_recving=[])  # fmt: skip
        for r in finished:
            self.ev("P", "scheduler", 0, "request_finished", (r,), delay=True,
                    status="FINISHED_LENGTH_CAPPED")  # fmt: skip
        self.ev("P", "scheduler", 0, "update_from_output", step=n,
                finished_sending=list(sending), finished_recving=[], failed_recving=[])  # fmt: skip
        for r in sending:
            self.ev("P", "scheduler", 0, "free_blocks", (r,), free=10)

    def read(self, rid: str, rank: int = 0, d_rank: int = 0) -> None:
        self.ev("D", "worker", d_rank, "read", (f"d-{rid}",), remote_request_id=rid,
                remote_rank=rank, remote_engine="P", posted=True)  # fmt: skip

    def recv(self, rid: str) -> None:
        self.ev("D", "worker", 0, "get_transfer_results", finished_sending=[],
                finished_recving=[f"d-{rid}"], failed_recving=[])  # fmt: skip


def one_request() -> list[Event]:
    """P TP=1: a prefilled, finished, read by D, reported on P's next step, freed."""
    s = Synth()
    s.start()
    s.ev("P", "scheduler", 0, "add_request", ("a",), free=10)
    s.step(1, new=("a",), finished=("a",))
    s.step(2)
    s.read("a")
    s.recv("a")
    s.step(3, outs={0: ["a"]}, sending=("a",))
    return s.events


def d_tp2_round_trip(second_reader: int = 1, late_sibling: bool = False) -> list[Event]:
    """P TP=1 -> D TP=2 (pd-d-tp2's shape): D ranks 0 and `second_reader` each READ their
    heads of a from producer rank 0 (notifications "a:2"); P reports a after the second.
    `late_sibling`: the second READ is posted after P freed a (a producer that counted one
    notification: #56033's class)."""
    s = Synth(d_world=2)
    s.start()
    s.ev("P", "scheduler", 0, "add_request", ("a",), free=10)
    s.step(1, new=("a",), finished=("a",))
    s.step(2)
    s.read("a", d_rank=0)
    if not late_sibling:
        s.read("a", d_rank=second_reader)
    s.recv("a")
    s.step(3, outs={0: ["a"]}, sending=("a",))
    if late_sibling:
        s.read("a", d_rank=second_reader)
    return s.events


def busy_waiting(idle: int = 30) -> list[Event]:
    """one_request with `idle` empty steps while P waits for the READ (a producer holding
    blocks busy-loops: scheduler.has_requests counts delayed frees)."""
    s = Synth()
    s.start()
    s.ev("P", "scheduler", 0, "add_request", ("a",), free=10)
    s.step(1, new=("a",), finished=("a",))
    for n in range(2, 2 + idle):
        s.step(n)
    s.read("a")
    s.recv("a")
    s.step(2 + idle, outs={0: ["a"]}, sending=("a",))
    return s.events


def pcp2_fixed() -> list[Event]:
    """P PCP=2 as the fixed design runs it: the replica (rank 1) reports a at once from its
    queue (_replicated_pcp_done_sending), rank 0 after the READ's notification."""
    s = Synth(world=2, pcp=2)
    s.start()
    s.ev("P", "scheduler", 0, "add_request", ("a",), free=10)
    s.step(1, new=("a",), finished=("a",))
    s.step(2, outs={1: ["a"]})
    s.read("a")
    s.recv("a")
    s.step(3, outs={0: ["a"]}, sending=("a",))
    return s.events


def heartbeating(lease: int = 12, ticks: int = 10, receipts: bool = True) -> list[Event]:
    """P TP 1 with kv_lease_duration `lease` s (a tick: lease / 6): request a finishes at
    once and D adds it; D's first heartbeat starts the handshake (swallowed), then one per
    tick that P handles (`receipts`) while D waits `ticks` ticks (longer than the lease's 6)
    before its READ; P frees a on the READ's notification. P steps twice in every tick."""
    s = Synth()
    tick = lease / 6
    s.ev("P", "scheduler", 0, "start", connector="NixlConnector", children=[],
         async_scheduling=False, tp=1, pp=1, pcp=1, lease=lease)  # fmt: skip
    s.ev("P", "scheduler", 0, "add_request", ("a",), free=10)
    s.step(1, new=("a",), finished=("a",))
    s.ev("D", "scheduler", 0, "add_request", ("d-a",), free=10, remote_prefill=True)
    s.ev("D", "worker", 0, "heartbeat_send", ("a",), remote_engine="P", sent=[], failed=[])
    n = 2
    for k in range(1, ticks + 1):
        s.at((k + 0.5) * tick)
        s.step(n)
        s.ev("D", "worker", 0, "heartbeat_send", ("a",), remote_engine="P", sent=["0:0"],
             failed=[])  # fmt: skip
        if receipts:
            s.ev("P", "worker", 0, "heartbeat_recv", ("a",), held=["a"])
        s.step(n + 1)
        n += 2
    s.at((ticks + 0.7) * tick)
    s.read("a")
    s.recv("a")
    s.ev("D", "scheduler", 0, "update_from_output", finished_sending=[],
         finished_recving=["d-a"], failed_recving=[])  # fmt: skip
    s.step(n, outs={0: ["a"]}, sending=("a",))
    return s.events
