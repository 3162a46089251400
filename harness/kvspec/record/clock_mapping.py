"""A recording (kvspec.record.log events) as spec/ClockTrace.tla's Log: the producer's
KVTrace events (kvspec.record.mapping), the decode engine's add_request and processed
finished_recving, and the heartbeats, each stamped with the tick it happened in. Pure: no
vLLM, no TLC.

Time: a tick is kv_lease_duration / 6 (KVClock's unit), counted from the log's first
event on the host's monotonic clock (one clock for every process on a host). The lease
must be a multiple of 6 s: vLLM's heartbeat interval (lease // 6 s, base_scheduler.py:88)
and extension (lease * 2 // 3 s, base_worker.py:532) are then 1 and 4 ticks exactly.

Heartbeats: a decode worker's `heartbeat_send` to the producer engine that went to no
rank was swallowed by the proactive handshake; one that went out is matched, per producer
rank and in order, with that rank's `heartbeat_recv` of the same payload, and ranks
without one lost it. The spec's heartbeat is placed at D's send: KVClock keeps the
message at the producer rank (hbq) until P's next step, whose `_handle_heartbeat` extends
what the rank then holds, before its reaper, as vLLM's `_get_new_notifs` does (a stalled
P handled six at once in a recorded run).

Idle producer steps are kept up to KEEP_IDLE per tick (not per run, as KVTrace's are):
a lease that expired must be reaped at P's next step, so a step in each tick says whether
P had reaped it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvspec.record.log import Event
from kvspec.record.mapping import (
    Mapped,
    MappingError,
    SpecEvent,
    drop_idle_steps,
    map_recording,
    reached_producer,
    steps_holding_events,
)

TICKS_PER_LEASE = 6


@dataclass(frozen=True)
class ClockEvent:
    """One ClockTrace Log record and the recorded event it came from."""

    a: str
    r: int = 0
    w: int = 0
    t: int = 0
    batch: frozenset[int] = frozenset()
    out: tuple[frozenset[int], ...] = ()
    freed: frozenset[int] = frozenset()
    fin: frozenset[int] = frozenset()
    swallow: bool = False
    lost: frozenset[int] = frozenset()
    names: tuple[int, ...] = ()  # a heartbeat's payload, as spec requests (D's Tracked)
    source: Event | None = field(default=None, compare=False)

    def describe(self) -> str:
        if self.a == "hs":
            return f"t={self.t} D's handshake with the producer done"
        if self.a == "phs":
            return f"t={self.t} producer rank {self.w}'s handshake with D done"
        if self.a == "hb":
            what = "swallowed" if self.swallow else f"lost at {sorted(self.lost)}"
            return f"t={self.t} heartbeat {list(self.names)} {what}"
        if self.a in ("add", "recv", "abandon", "finish", "fail"):
            return f"t={self.t} {self.a} r={self.r}"
        base = SpecEvent(self.a, self.r, self.w, self.batch, self.out, self.freed, self.fin)
        return f"t={self.t} {base.describe()}"


# each clock event with the recorded event where it takes effect (its place in the log)
Placed = list[tuple[Event, ClockEvent]]


@dataclass
class ClockMapped:
    base: Mapped
    lease_s: int
    log: list[ClockEvent]
    swallow_first: bool  # the first heartbeat was swallowed (KVClock's Swallow)
    dropped_steps: set[int] = field(default_factory=set)  # idle producer steps, 1-based
    held_steps: set[int] = field(default_factory=set)  # steps_holding_events: kept
    # the recording records heartbeats (hb_recorded): a heartbeat not in the log was not
    # sent; False: heartbeats are silent steps (a recording from before the recorder)
    hb_recorded: bool = True
    # the recording records D's handshakes (records_handshakes): the handshake ends at
    # its "hs" event only; False: it ends silently, any time
    hs_recorded: bool = False
    # push: the recording records the producer ranks' handshakes with D (the same
    # recorder's `handshake`): each ends at its "phs" event only; False: silently
    phs_recorded: bool = False

    @property
    def heartbeats(self) -> int:
        return sum(1 for e in self.log if e.a == "hb")

    @property
    def max_t(self) -> int:
        return max((e.t for e in self.log), default=0)


def lease_of(start: dict[str, object], override: int | None) -> int:
    lease = override if override is not None else start.get("lease")
    if lease is None:
        raise MappingError("the recording does not say its kv_lease_duration (recorded before "
                           "kvspec recorded it): pass --lease SECONDS")  # fmt: skip
    n = int(str(lease))
    if n <= 0 or n % TICKS_PER_LEASE:
        raise MappingError(
            f"kv_lease_duration {n} s is not a positive multiple of 6: vLLM's heartbeat "
            "interval (lease // 6) and extension (lease * 2 // 3) are then no whole number of "
            "ticks; record with a multiple of 6"
        )
    return n


def _rank(label: str) -> int:
    pp, _, tp = label.partition(":")
    if pp != "0" or not tp.isdigit():
        raise MappingError(f"a heartbeat went to producer agent {label!r}: only PP rank 0 "
                           "agents are mapped (KVClock has no pipeline stages)")  # fmt: skip
    return int(tp)


def _d_heartbeats(events: list[Event], m: Mapped) -> list[list[Event]]:
    """D's heartbeats to the producer, each as the sends of every D rank. D's scheduler
    packages one per interval into the step's metadata (base_scheduler.py:508-512) and
    every D rank sends it from that step's `_send_heartbeats` (base_worker.py:3179-3210),
    so the k-th send of each rank is one KVClock heartbeat (D TP > 1: pd-d-tp2)."""
    sends = [e for e in events if e.role == "worker" and e.call == "heartbeat_send"
             and e.engine in m.consumers
             and e.result.get("remote_engine") == m.producer]  # fmt: skip
    by_rank: dict[tuple[str, int], list[Event]] = defaultdict(list)
    for e in sorted(sends, key=_key):
        by_rank[(e.engine, e.rank)].append(e)
    if len({eng for eng, _ in by_rank}) > 1:
        raise MappingError(f"heartbeats to {m.producer} from {len(by_rank)} decode workers "
                           f"of several engines ({sorted(by_rank)}): KVClock models one "
                           "decode engine's")  # fmt: skip
    groups: list[list[Event]] = []
    for k in range(max((len(v) for v in by_rank.values()), default=0)):
        group = [v[k] for v in by_rank.values() if k < len(v)]
        if len({frozenset(e.reqs) for e in group}) > 1:
            raise MappingError(f"decode ranks' heartbeat #{k + 1} to {m.producer} carry "
                               f"different requests ({[list(e.reqs) for e in group]}): "
                               "they are not one packaged heartbeat")  # fmt: skip
        groups.append(sorted(group, key=_key))
    return groups


def _heartbeats(events: list[Event], m: Mapped) -> Placed:
    """(the recorded event where it takes effect, the spec heartbeat) per D heartbeat:
    swallowed where no D rank's send went out (every rank's handshake pending), else lost
    at the producer ranks none of its sends reached. Receipts carry the payload, not the
    sender: at each producer rank a heartbeat takes the next receipt of its payload, and
    more of them (one per further D rank that sent) only before the next heartbeat's send;
    later ones (a stalled P handling a burst) go to the next heartbeat, which P then
    handled in the same burst."""
    recvs: dict[int, list[Event]] = defaultdict(list)
    # one D engine's share of the producer (project_log): the others' heartbeats name
    # none of its requests
    others = len({e.engine for e in events if e.call == "heartbeat_send"
                  and e.result.get("remote_engine") == m.producer} - set(m.consumers)) > 0
    for e in events:
        if e.engine == m.producer and e.call == "heartbeat_recv":
            if not (others and set(e.reqs).isdisjoint(m.requests)):
                recvs[e.rank].append(e)
    nxt: dict[int, int] = defaultdict(int)
    out: Placed = []
    groups = _d_heartbeats(events, m)
    sends_to: dict[int, int] = defaultdict(int)  # producer rank -> messages D sent it
    payloads_to: dict[int, set[frozenset[str]]] = defaultdict(set)
    for k, group in enumerate(groups):
        s = group[0]
        names = tuple(sorted(m.requests[x] for x in s.reqs if x in m.requests))
        sent = [_rank(str(x)) for e in group for x in e.result.get("sent", []) or []]
        failed = [_rank(str(x)) for e in group for x in e.result.get("failed", []) or []]
        if not sent and not failed:
            out.append((s, ClockEvent("hb", swallow=True, names=names, source=s)))
            continue
        upto = _key(groups[k + 1][0]) if k + 1 < len(groups) else None
        got: list[Event] = []
        for w in sorted(set(sent)):
            sends_to[w] += sent.count(w)
            payloads_to[w].add(frozenset(s.reqs))
            queue = recvs[w]
            for extra in range(sent.count(w)):
                if nxt[w] >= len(queue) or set(queue[nxt[w]].reqs) != set(s.reqs):
                    break
                if extra and upto is not None and _key(queue[nxt[w]]) > upto:
                    break
                got.append(queue[nxt[w]])
                nxt[w] += 1
        lost = frozenset(range(m.world)) - {e.rank for e in got}
        out.append((s, ClockEvent("hb", lost=lost, names=names, source=s)))
    for w, queue in recvs.items():
        for e in queue[nxt[w]:]:  # a late duplicate is fine; a receipt nobody sent is not
            if len(queue) > sends_to[w] or frozenset(e.reqs) not in payloads_to[w]:
                raise MappingError(f"{m.producer} rank {w} handled heartbeat {list(e.reqs)} "
                                   f"(#{e.seq}) that no recorded decode worker sent: record "
                                   "every decode engine that reads from it")  # fmt: skip
    return out


def _decode_events(events: list[Event], m: Mapped) -> Placed:
    """D's add_request of a P/D request, its request_finished before the receive was
    processed (heartbeats stop there), and its scheduler's processed finished_recving.
    A decode request is the producer's request its add_request names, or (a recording
    from before kvspec recorded that) the one its READs name (`read` events)."""
    d_to_p = {e.reqs[0]: str(e.result.get("remote_request_id", "")) for e in events
              if e.engine in m.consumers and e.reqs and e.result.get("remote_request_id")
              and (e.call == "read" or e.call == "add_request")}  # fmt: skip

    def r_of(rid: str) -> int | None:
        return m.requests.get(d_to_p.get(rid, ""))

    read_ids = {e.reqs[0] for e in events if e.engine in m.consumers and e.call == "read"
                and e.reqs and not e.result.get("notify_only")
                and reached_producer(e)}  # fmt: skip

    # the producer's last recorded event: a READ that fails after it failed because P
    # was gone (killed during the READ, pd-p-crash-mid-read), which P's clock cannot see
    p_end = max((e.t_ns for e in events if e.engine == m.producer), default=0)
    inside = _finished_inside_update(events, m)
    out = []
    errored: set[str] = set()  # D's receives a worker reported a load error for
    finished: set[str] = set()  # D's requests finished before their receive was processed
    processed: set[str] = set()  # D's receives its scheduler processed
    for e in events:
        if e.engine in m.consumers and e.call == "load_errors":
            errored |= set(e.reqs)
        if e.engine not in m.consumers or e.role != "scheduler":
            continue
        if e.call == "add_request" and e.result.get("remote_prefill"):
            r = r_of(e.reqs[0])
            if r is not None:
                out.append((e, ClockEvent("add", r=r, source=e)))
        elif e.call == "request_finished" and e.reqs and e.reqs[0] not in finished | processed:
            # request_finished stops r's heartbeats (pull_scheduler.py:215-217): before
            # the update that processes r's receive, D finished r early (an abort; another
            # D rank's failure, d-tp2-split-handshake)
            r = r_of(e.reqs[0])
            if r is not None and (e.engine, e.seq, e.pid) not in inside:
                finished.add(e.reqs[0])
                out.append((e, ClockEvent("finish", r=r, source=e)))
        elif e.call == "update_from_output":
            out += _receives(e, errored | e.ids("failed_recving"), read_ids, finished, p_end,
                             r_of)  # fmt: skip
            processed |= e.ids("finished_recving")
    return out


def _finished_inside_update(events: list[Event], m: Mapped) -> set[tuple[str, int, int]]:
    """D's request_finished events made by the update that processes that request's
    receive (a failed one, finished at once): the scheduler's next update_from_output,
    with no schedule in between, names it in finished_recving. Those stop heartbeats
    with the receive, which the receive's own event says."""
    out: set[tuple[str, int, int]] = set()
    pending: list[Event] = []
    for e in events:
        if e.engine not in m.consumers or e.role != "scheduler":
            continue
        if e.call == "request_finished" and e.reqs:
            pending.append(e)
        elif e.call == "schedule":
            pending = [f for f in pending if f.engine != e.engine]
        elif e.call == "update_from_output":
            recv = e.ids("finished_recving")
            out |= {(f.engine, f.seq, f.pid) for f in pending
                    if f.engine == e.engine and f.reqs[0] in recv}  # fmt: skip
            pending = [f for f in pending if f.engine != e.engine]
    return out



def _receives(e: Event, failed: set[str], read_ids: set[str], finished: set[str],
              p_end: int, r_of: Callable[[str], int | None]) -> Placed:  # fmt: skip
    """The receives D's scheduler processed in update `e` (finished_recving names failed
    receives too, base_worker.py:2881-2889; 0.29 reports a failed load in finished_recving
    only, its blocks invalid, base_worker.py:2218-2228, 2422-2435: a load error is a
    failure too), each as the clock's step:
    - "recv": a receive that did not fail;
    - "fail": a failed receive of a READ D posted (a READ that failed, or another D
      rank's failure after D finished r); one that failed after P's last event is left
      in flight instead: P never acted again, so its end is the clock's (a prefix of a
      run, pd-p-crash-mid-read);
    - "abandon": a failed receive with no READ posted (a failed handshake); none where D
      had finished r already (its heartbeats stopped there)."""
    out: Placed = []
    for rid in sorted(e.ids("finished_recving")):
        r = r_of(rid)
        if r is None:
            continue
        if rid not in failed:
            out.append((e, ClockEvent("recv", r=r, source=e)))
        elif rid in read_ids and e.t_ns > p_end:
            continue
        elif rid in read_ids:
            out.append((e, ClockEvent("fail", r=r, source=e)))
        elif rid not in finished:
            out.append((e, ClockEvent("abandon", r=r, source=e)))
    return out


def _handshake(events: list[Event], m: Mapped) -> Placed:
    """D's handshake with the producer ending (the recorder's `handshake`, ok, since
    2026-12-05): KVClock's handshake_done, observed instead of silent. The first that
    succeeded, of any decode worker: from then a D rank's heartbeats go out (a rank whose
    own handshake failed, d-tp2-split-handshake, is one the message did not reach). None
    where the first heartbeat went out (no handshake pending in KVClock: a READ's
    handshake ended before it)."""
    done = [e for e in events if e.engine in m.consumers and e.call == "handshake"
            and e.result.get("ok") is True
            and e.result.get("remote_engine") == m.producer]  # fmt: skip
    return [(done[0], ClockEvent("hs", source=done[0]))] if done else []


def _p_handshakes(events: list[Event], m: Mapped) -> Placed:
    """Push: each producer rank's first successful handshake with D (the recorder's
    `handshake` on P's worker, which it records at the exchange's end, before vLLM's
    callbacks queue the WRITEs parked on it: push_worker.py:465-478). KVClock's
    push_handshake_done(w). A failed one parks nothing for ever: vLLM's `_on_handshake`
    logs push_handshake_failed and drops the blocks (the TTL reclaims them), which the
    spec explains as no match at all (push_match is optional)."""
    out: Placed = []
    for w in range(m.world):
        done = [e for e in events if e.engine == m.producer and e.rank == w
                and e.call == "handshake" and e.result.get("ok") is True
                and e.result.get("remote_engine") in m.consumers]  # fmt: skip
        out += [(done[0], ClockEvent("phs", w=w, source=done[0]))] if done else []
    return out


def records_handshakes(events: list[Event], m: Mapped) -> bool:
    """Whether the recorder wrote the decode workers' handshakes (since 2026-12-05): then
    the handshake ends only where the log says."""
    return any(e.engine in m.consumers and e.call == "handshake" for e in events)


def _key(e: Event) -> tuple[int, int, int]:
    return (e.t_ns, e.pid, e.seq)


def _mla_notify_only(events: list[Event], producer: str, consumers: Iterable[str]) -> bool:
    """The recording's MLA flag (the recorder's "start") with a D of smaller TP than P.
    Such a D READs one producer rank and, right after posting that READ, sends every other
    producer agent it handshook a notify-only "r:n" (pull_worker.py:369-391, 0.32).
    MappingError where such a D has TP > 1 (KVClock models one decode worker)."""
    starts = {e.engine: e.result for e in events if e.call == "start"}
    p = starts.get(producer, {})
    mla = bool(p.get("mla")) and any(
        int(p.get("tp", 1)) > int(starts.get(c, {}).get("tp", 1)) for c in consumers)
    if mla and any(int(starts.get(c, {}).get("tp", 1)) != 1 for c in consumers):
        raise MappingError("MLA with P TP > D TP > 1: KVClock models one decode worker, "
                           "whose notify-only messages are its READs' (D TP 1 only)")  # fmt: skip
    return mla


def _with_notify_only(log: list[SpecEvent], world: int) -> list[SpecEvent]:
    """KVClock has a READ per producer rank: a notify-only message to rank w is its READ of
    no bytes, posted with the READ D did post (the recording has no event of its own for
    it: send_notif is not wrapped) and free to land at once. The clock's concern stays the
    READ that moves data: no rank frees r before every report, rank 0's after its READ."""
    out: list[SpecEvent] = []
    for e in log:
        out.append(e)
        if e.a == "read":
            out += [replace(e, w=w) for w in range(world) if w != e.w]
    return out


def _records_heartbeats(events: list[Event], m: Mapped) -> bool:
    """Whether the recorder wrote every heartbeat of this run: it records the lease in the
    producer's `start` since it records heartbeats (2026-12-03), and says so where it could
    not wrap a decode worker's `_send_heartbeats` (connectors.py). Then a heartbeat the log
    lacks was not sent (pd-2p1d-tp: D sent P2 none before its READs); read as silent
    instead, TLC explored 208,081 states for that 31-event log, 15,200 so."""
    if "lease" not in m.start:
        return False
    return not any(e.call == "recorder_note" and "heartbeats not recorded" in
                   str(e.result.get("note", "")) for e in events
                   if e.engine in m.consumers)  # fmt: skip


def map_clock(events: list[Event], lease_s: int | None = None, producer: str | None = None,
              consumer: str | None = None) -> ClockMapped:  # fmt: skip
    """The producer's KVClock log (`producer`: which one, xPyD). A D engine heartbeats
    each producer only its own requests (heartbeat_by_engine, base_worker.py
    _send_heartbeats), so a producer's clock sees one D's messages to it alone, and a
    producer that feeds several D engines is validated once per D (`consumer`): that D's
    requests, the heartbeats it sent and P received (mapping.project_log)."""
    m = map_recording(events, drop=False, producer=producer, consumer=consumer)
    lease = lease_of(m.start, lease_s)
    if len(m.consumers) > 1:
        raise MappingError(f"{len(m.consumers)} decode engines read from {m.producer}: "
                           "KVClock models one; validate each one's requests (--engine "
                           f"NAME: {', '.join(m.consumers)})")  # fmt: skip
    base = _with_notify_only(m.log, m.world) if _mla_notify_only(
        events, m.producer, m.consumers) else m.log  # fmt: skip
    placed: list[tuple[tuple[int, int, int], int, ClockEvent]] = []
    for n, e in enumerate(base):
        if e.a == "recv" or e.source is None:  # KVTrace's "READ posted" observation
            continue
        ev = ClockEvent(e.a, e.r, e.w, 0, e.batch, e.out, e.freed, e.fin, source=e.source)
        placed.append((_key(e.source), n, ev))
    hbs_placed = _heartbeats(events, m)
    first_swallowed = bool(hbs_placed) and hbs_placed[0][1].swallow
    extra = _decode_events(events, m) + hbs_placed
    extra += _handshake(events, m) if first_swallowed else []
    extra += _p_handshakes(events, m)
    placed += [(_key(at), len(base) + i, ev) for i, (at, ev) in enumerate(extra)]
    placed.sort(key=lambda x: (x[0], x[1]))
    tick_ns = lease * 1_000_000_000 / TICKS_PER_LEASE
    t0 = placed[0][0][0] if placed else 0
    log = [replace(ev, t=int((k[0] - t0) // tick_ns)) for k, _, ev in placed]
    kept, dropped = drop_idle_steps(log, breaks=lambda a, b: a.t != b.t)
    hbs = [e for e in kept if e.a == "hb"]
    hb_recorded = bool(hbs) or _records_heartbeats(events, m)
    return ClockMapped(m, lease, kept, bool(hbs) and hbs[0].swallow, dropped | m.cut_steps,
                       steps_holding_events(log), hb_recorded,
                       records_handshakes(events, m),
                       any(e.engine == m.producer and e.call == "handshake"
                           for e in events))  # fmt: skip
