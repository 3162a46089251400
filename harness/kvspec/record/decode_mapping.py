"""A recording's decode engine as spec/DecodeTrace.tla's Log: which engine read, which of
its requests are P/D ones (spec requests r = 1, 2, ... in add_request order), and one spec
event per observable step of it. Pure: no vLLM, no TLC.

D's steps are numbered by its recording scheduler (`schedule`); a worker's k-th
`get_transfer_results` ran step k (every worker gets every step), and the READs it posted
since its previous one were posted by that step's `start_load_kv`. A step's execute event
sits at its last rank's report, before the scheduler's update_from_output of the step.
Requests without `do_remote_prefill` (a local run on the same engine) are not spec
requests: their steps still count, their ids are left out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvspec.record.log import Event
from kvspec.record.mapping import (
    MappingError,
    drop_idle_steps,
    kv_capacity,
    steps_holding_events,
)

STOPPED = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass(frozen=True)
class DecodeEvent:
    """One DecodeTrace Log record and the recorded event it came from."""

    a: str
    r: int = 0
    batch: frozenset[int] = frozenset()
    out: tuple[frozenset[int], ...] = ()
    fail: tuple[frozenset[int], ...] = ()
    reads: tuple[frozenset[tuple[int, int]], ...] = ()
    recv: frozenset[int] = frozenset()
    w: int = 0  # "hs": the D worker's rank
    ok: bool = True  # "hs": the handshake succeeded
    source: Event | None = field(default=None, compare=False)

    def describe(self) -> str:
        if self.a == "hs":
            outcome = "done" if self.ok else "failed"
            return f"D rank {self.w}'s handshake with the producer {outcome}"
        if self.a in ("arrive", "abort", "complete"):
            return f"{self.a} r={self.r}"
        if self.a == "schedule":
            return f"schedule runs={sorted(self.batch)}"
        if self.a == "execute":
            reads = [sorted(x) for x in self.reads]
            return (f"execute reads={reads} finished_recving={[sorted(o) for o in self.out]}"
                    f" failed_recving={[sorted(f) for f in self.fail]}")  # fmt: skip
        return f"update finished_recving={sorted(self.recv)}"

    @property
    def idle(self) -> bool:
        return (self.a == "schedule" and not self.batch) or (
            self.a == "execute" and not any(self.out) and not any(self.fail)
            and not any(self.reads)
        ) or (self.a == "update" and not self.recv)  # fmt: skip


@dataclass
class DecodeMapped:
    consumer: str
    world: int  # D's workers (TP)
    producer_world: int  # the producer ranks D reads from (P TP)
    requests: dict[str, int]  # D request id -> spec r
    start: dict[str, Any]  # D's scheduler "start" event result
    log: list[DecodeEvent]
    dropped_steps: set[int] = field(default_factory=set)
    # D's pool in requests as recorded (d_capacity); None: unknown, every request fits
    capacity: int | None = None
    held_steps: set[int] = field(default_factory=set)  # steps_holding_events: kept
    hs_recorded: bool = False  # the recorder wrote D's handshakes: DecodeTrace's HsSeen


def _takers(events: list[Event]) -> dict[str, set[str]]:
    """Engine -> the producer engines named by the do_remote_prefill requests its scheduler
    was handed ("" where the recording predates `remote_engine`): a decode engine, even
    one that never READ (its handshake with the producer failed)."""
    out: dict[str, set[str]] = defaultdict(set)
    for e in events:
        if e.call == "add_request" and e.result.get("remote_prefill"):
            out[e.engine].add(str(e.result.get("remote_engine", "")))
    return out


def _consumer(events: list[Event], engine: str | None) -> str:
    readers = sorted({e.engine for e in events if e.call == "read"} | set(_takers(events)))
    with_sched = [x for x in readers if any(e.engine == x and e.role == "scheduler"
                                            for e in events)]  # fmt: skip
    if engine is not None:
        if engine not in with_sched:
            found = ", ".join(with_sched) or "none"
            raise MappingError(f"engine {engine} took no P/D request or has no scheduler "
                               f"recording; decode engines here: {found}")  # fmt: skip
        return engine
    if len(with_sched) != 1:
        raise MappingError(f"found {len(with_sched)} decode engines with a scheduler recording "
                           f"({', '.join(with_sched) or 'none'}): pass --engine NAME")  # fmt: skip
    return with_sched[0]


def producers_of(events: list[Event], d: str) -> list[str]:
    """The producer engines decode engine d read from or was handed requests of ("" for a
    recording that predates `remote_engine`)."""
    reads = [e for e in events if e.engine == d and e.call == "read"]
    p_engines = {str(e.result.get("remote_engine", "")) for e in reads}
    return sorted(p_engines | (_takers(events).get(d, set()) - {""}))


def _producer(events: list[Event], d: str, producer: str | None) -> str:
    """The one producer engine whose requests are the spec's ("" where the recording
    predates `remote_engine`)."""
    p_engines = [producer] if producer is not None else producers_of(events, d)
    if len(p_engines) != 1:
        raise MappingError(f"decode engine {d} read from {len(p_engines)} producer engines "
                           f"({', '.join(p_engines)}): pass --producer NAME (Decode.tla "
                           "has one: each producer's requests are validated apart)")  # fmt: skip
    return p_engines[0]


def _producer_world(events: list[Event], d: str, producer: str | None, p: str) -> int:
    """Producer p's TP (p: _producer's answer for the `producer` argument)."""
    reads = [e for e in events if e.engine == d and e.call == "read"
             and e.result.get("remote_engine", producer) == producer]  # fmt: skip
    start = next((e.result for e in events if e.engine == p and e.call == "start"), None)
    if start is not None:
        return int(start.get("tp", 1))
    if not reads:
        raise MappingError(f"decode engine {d} posted no READ and producer {p} is not "
                           "recorded: its TP is unknown; record the producer too")  # fmt: skip
    return 1 + max(int(e.result.get("remote_rank", 0)) for e in reads)


def _requests(sched: list[Event], d: str, producer: str | None) -> dict[str, int]:
    """D's P/D requests (of `producer` only, where given) -> spec r, in arrival order."""
    adds = [e for e in sched if e.call == "add_request"]
    if adds and all("remote_prefill" not in e.result for e in adds):
        raise MappingError(f"{d}'s add_request events do not say which requests are P/D ones "
                           "(remote_prefill): record again with this kvspec")  # fmt: skip
    reqs: dict[str, int] = {}
    for e in adds:
        if producer is not None and e.result.get("remote_engine", producer) != producer:
            continue  # another producer's request: as a local one (its steps still count)
        if e.result.get("remote_prefill"):
            reqs.setdefault(e.reqs[0], len(reqs) + 1)
    return reqs


def map_decode(events: list[Event], engine: str | None = None,
               producer: str | None = None) -> DecodeMapped:  # fmt: skip
    """D's DecodeTrace log. A D that reads from several producers (xPyD) is validated once
    per producer: that producer's requests are the spec requests and the others' are as
    local ones. Sound because D keeps no completion state across producer engines: the
    handshake, the READs, the notifications and the heartbeats are per engine
    (nixl/base_worker.py _handshake_futures, _send_heartbeats' heartbeat_by_engine);
    their shared pool only makes the capacity unknown (d_capacity)."""
    d = _consumer(events, engine)
    sched = [e for e in events if e.engine == d and e.role == "scheduler"]
    start = next((e.result for e in sched if e.call == "start"), {})
    if int(start.get("pp", 1)) != 1 or int(start.get("pcp", 1)) != 1:
        raise MappingError(f"decode engine {d} runs PP or PCP > 1; Decode.tla models TP only")
    world = max(e.world for e in events if e.engine == d)
    reqs = _requests(sched, d, producer)

    def rs(ids: Any) -> frozenset[int]:
        return frozenset(reqs[str(x)] for x in ids if str(x) in reqs)

    # (rank, step) -> that rank's report; the READs it posted in that step
    report: dict[tuple[int, int], Event] = {}
    reads: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
    # the receives a rank reported a load error for by its k-th report (0.29 reports a
    # failed load only so: in finished_recving, its blocks invalid, no failed_recving)
    errored: dict[tuple[int, int], frozenset[str]] = defaultdict(frozenset)
    count: dict[int, int] = defaultdict(int)
    for e in sorted((e for e in events if e.engine == d and e.role == "worker"),
                    key=lambda e: (e.rank, e.pid, e.seq)):  # fmt: skip
        # a notify-only "read" (no local block: nothing is read) is no READ in Decode.tla
        if e.call == "read" and e.reqs and e.reqs[0] in reqs and not e.result.get("notify_only"):
            reads[(e.rank, count[e.rank] + 1)].add(
                (reqs[e.reqs[0]], int(e.result.get("remote_rank", 0)))
            )
        elif e.call == "get_transfer_results":
            count[e.rank] += 1
            report[(e.rank, count[e.rank])] = e
            errored[(e.rank, count[e.rank])] = errored[(e.rank, count[e.rank] - 1)]
        elif e.call == "load_errors":  # after its step's report (the runner's order)
            errored[(e.rank, count[e.rank])] |= set(e.reqs)
    exec_at: dict[tuple[int, int], DecodeEvent] = {}
    k = 1
    while all((w, k) in report for w in range(world)):
        last = max((report[(w, k)] for w in range(world)), key=lambda e: (e.t_ns, e.pid, e.seq))
        exec_at[(last.pid, last.seq)] = DecodeEvent(
            "execute",
            out=tuple(rs(report[(w, k)].ids("finished_recving")) for w in range(world)),
            fail=tuple(rs(_failed(report[(w, k)], errored[(w, k)])) for w in range(world)),
            reads=tuple(frozenset(reads[(w, k)]) for w in range(world)), source=last,
        )  # fmt: skip
        k += 1

    log: list[DecodeEvent] = []
    arrived: set[int] = set()
    p = _producer(events, d, producer)
    for e in events:
        if (e.pid, e.seq) in exec_at:
            log.append(exec_at[(e.pid, e.seq)])
        if _is_handshake(e, d, p):
            log.append(DecodeEvent("hs", w=e.rank, ok=bool(e.result.get("ok")), source=e))
        if e.engine != d or e.role != "scheduler":
            continue
        if e.call == "add_request" and e.reqs and e.reqs[0] in reqs:
            arrived.add(reqs[e.reqs[0]])
            log.append(DecodeEvent("arrive", r=reqs[e.reqs[0]], source=e))
        elif e.call == "schedule":
            log.append(DecodeEvent("schedule", batch=rs(e.ids("new")), source=e))
        elif e.call == "update_from_output":
            log.append(DecodeEvent("update", recv=rs(e.ids("finished_recving")), source=e))
        elif e.call == "request_finished" and e.result.get("status") in STOPPED:
            log += [DecodeEvent("complete", r=reqs[x], source=e) for x in e.reqs if x in reqs]
        elif e.call == "finish_requests" and e.result.get("status") == "FINISHED_ABORTED":
            log += [DecodeEvent("abort", r=reqs[x], source=e) for x in e.reqs
                    if x in reqs and reqs[x] in arrived]  # fmt: skip
    kept, dropped = _drop_idle(log)
    return DecodeMapped(d, world, _producer_world(events, d, producer, p), reqs, dict(start),
                        kept, dropped, d_capacity(sched, reqs, log),
                        steps_holding_events(log),
                        any(_is_handshake(e, d, None) for e in events))  # fmt: skip


def _is_handshake(e: Event, d: str, producer: str | None) -> bool:
    """A `handshake` event of decode engine d's workers (with `producer` where given: a
    D of several producers handshakes with each, and only this one's is the spec's)."""
    return (e.engine == d and e.role == "worker" and e.call == "handshake"
            and producer in (None, str(e.result.get("remote_engine", ""))))  # fmt: skip


def _failed(report: Event, errored: frozenset[str]) -> frozenset[str]:
    """A rank's failed receives in one report: failed_recving, and (0.29) the finished
    ones it reported a load error for."""
    return report.ids("failed_recving") | (report.ids("finished_recving") & errored)


def d_capacity(sched: list[Event], reqs: dict[str, int], log: list[DecodeEvent]) -> int | None:
    """Decode.tla's DCap as D's recorded pool gives it: kvspec.record.mapping.kv_capacity
    (free blocks at the first add_request // the blocks each request held at its end).
    None where that is unknown or not a bound in P/D requests: a local request (not a spec
    request) arrived before the last P/D one finished and shared the pool, or the log holds
    more P/D requests at once than the bound (shared prefix blocks)."""
    cap = kv_capacity(sched)
    ends = [n for n, e in enumerate(sched) if e.call == "request_finished"
            and any(x in reqs for x in e.reqs)]  # fmt: skip
    local = [n for n, e in enumerate(sched) if e.call == "add_request"
             and e.reqs and e.reqs[0] not in reqs]  # fmt: skip
    if cap is None or (ends and local and min(local) < max(ends)):
        return None
    return cap if most_held_at_d(log) <= cap else None


def most_held_at_d(log: list[DecodeEvent]) -> int:
    """The most P/D requests the log shows D holding blocks for at once: from the first
    READ it posts for r, or r's first run, to r's completion or abort. A lower bound of
    what D held (a request holds its blocks from its admission, which the log does not
    show): a DCap below it is refuted by the run."""
    holding: set[int] = set()
    most = 0
    for e in log:
        if e.a == "execute":
            holding |= {r for rank in e.reads for r, _p in rank}
        elif e.a == "schedule":
            holding |= e.batch
        elif e.a in ("complete", "abort"):
            holding.discard(e.r)
        most = max(most, len(holding))
    return most


def _drop_idle(log: list[DecodeEvent]) -> tuple[list[DecodeEvent], set[int]]:
    """Without the idle steps past two in a row (kvspec.record.mapping's rule): D's engine
    steps for every decoded token and idles hundreds of steps while a READ runs."""
    return drop_idle_steps(log, lambda e: e.idle)
