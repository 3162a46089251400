"""A recording (kvspec.record.log events of every process) as spec/KVTrace.tla's Log: which
engine produced, which request is spec request r, which producer rank w, and one spec
event per observable step. Pure: no vLLM, no TLC.

Producer steps are numbered by the recording scheduler (`schedule` events); a worker's
k-th `get_transfer_results` ran step k (the executor hands every worker every step in
order, an empty one included: kv_connector_model_runner_mixin.py:kv_connector_no_forward).
A step's execute event is placed when its last rank reported, which is before the
scheduler's update_from_output of that step (the update waits for those outputs).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from kvspec.record.log import Event


class MappingError(ValueError):
    """The recording cannot be read as one producer (message says what to pass or fix)."""


@dataclass(frozen=True)
class SpecEvent:
    """One KVTrace Log record and the recorded event it came from."""

    a: str
    r: int = 0
    w: int = 0
    batch: frozenset[int] = frozenset()
    out: tuple[frozenset[int], ...] = ()
    freed: frozenset[int] = frozenset()
    fin: frozenset[int] = frozenset()
    source: Event | None = field(default=None, compare=False)

    def describe(self) -> str:
        parts = [self.a]
        if self.a in PER_REQUEST:
            parts.append(f"r={self.r}")
        if self.a in ("read", "coread", "write"):
            parts.append(f"w={self.w}")
        if self.a == "schedule":
            parts.append(f"batch={sorted(self.batch)}")
        if self.a == "execute":
            parts.append("out=" + str([sorted(o) for o in self.out]))
        if self.a == "update":
            parts.append(f"finished_sending={sorted(self.freed)} fin={sorted(self.fin)}")
        return " ".join(parts)


# KVTrace's events about one request (the others are about steps)
PER_REQUEST = ("arrive", "abort", "read", "coread", "recv", "write")


def transfer(start: dict[str, Any]) -> str:
    """KVCompletion's Transfer: "push" where the recorded connector is NixlPushConnector
    (the producer WRITEs into D's registered blocks), "pull" otherwise."""
    return "push" if start.get("connector") == "NixlPushConnector" else "pull"


def _pushed_to(events: list[Event], consumers: list[str], producer: str) -> dict[str, str]:
    """Push mode: each consumer request id -> the producer's, as D's add_request names it
    (D posts no READ to name it by)."""
    return {e.reqs[0]: str(e.result["remote_request_id"]) for e in events
            if e.engine in consumers and e.call == "add_request" and e.reqs
            and e.result.get("remote_prefill") and "remote_request_id" in e.result
            and e.result.get("remote_engine", "") in ("", producer)}  # fmt: skip


@dataclass
class Mapped:
    producer: str
    consumers: list[str]
    requests: dict[str, int]  # producer request id -> spec r
    world: int
    start: dict[str, Any]  # the producer scheduler's "start" event result
    log: list[SpecEvent]
    dropped_steps: set[int] = field(default_factory=set)  # idle producer steps, 1-based
    # KVCompletion's Capacity as the recorded pool gives it (kv_capacity); None: unknown
    capacity: int | None = None
    held_steps: set[int] = field(default_factory=set)  # steps_holding_events: kept
    # a projection's steps after its last request was freed (project_log): not in `log`
    cut_steps: set[int] = field(default_factory=set)


def kv_capacity(p_sched: list[Event]) -> int | None:
    """How many requests the producer's recorded pool holds at once: its free blocks at
    the first add_request (the whole pool, null block excluded) over the blocks each
    request held at its end (`request_finished` `blocks`). None (one slot per request)
    where either is not recorded, or where requests held different numbers of blocks: a
    bound in requests is then not one the real pool keeps. Exact for requests of one size
    with no shared prefix blocks (the recorder's scenarios: distinct prompts, prefix
    caching off); `map_recording` drops it where the log refutes it (shared blocks)."""
    pool = next((e.result.get("free") for e in p_sched if e.call == "add_request"), None)
    held = {int(e.result.get("blocks", -1)) for e in p_sched if e.call == "request_finished"}
    if not isinstance(pool, int) or len(held) != 1 or min(held) <= 0:
        return None
    return pool // min(held)


def most_holding(log: list[SpecEvent]) -> int:
    """The most requests the producer held blocks for at once in the log (scheduled,
    not yet freed): a Capacity below it is refuted by the run itself."""
    holding: set[int] = set()
    most = 0
    for e in log:
        if e.a == "schedule":
            holding |= e.batch
        elif e.a == "update":
            holding -= e.freed
        most = max(most, len(holding))
    return most


def consumer_engines(events: list[Event]) -> list[str]:
    """Engines that READ, or were handed a request with do_remote_prefill."""
    takers = {e.engine for e in events
              if e.call == "add_request" and e.result.get("remote_prefill")}  # fmt: skip
    return sorted({e.engine for e in events if e.call == "read"} | takers)


def producer_engines(events: list[Event]) -> list[str]:
    """Engines whose scheduler stepped and that are no consumer."""
    readers = set(consumer_engines(events))
    return sorted({e.engine for e in events if e.call == "schedule"} - readers)


def engines_of(events: list[Event], producer: str | None = None) -> tuple[str, list[str]]:
    """(the producer, the consumers that read from it): an engine that READ, or whose
    scheduler was handed a request with do_remote_prefill, is a consumer, also one that
    never READ because its handshake with the producer failed (recorded:
    handshake-failed-lease). Several producers (xPyD: pd-2p1d): `producer` names the one
    to map; each producer's completion is its own (no vLLM state spans P engines)."""
    readers = consumer_engines(events)
    scheds = producer_engines(events)
    if producer is None and len(scheds) != 1:
        raise MappingError(
            f"found {len(scheds)} producer engines ({', '.join(scheds) or 'none'}): pass "
            "--producer NAME (a recording holds producers' schedulers and their consumers)"
        )
    p = scheds[0] if producer is None else producer
    if p not in scheds:
        raise MappingError(f"{p} is no producer engine here; producers: "
                           f"{', '.join(scheds) or 'none'}")  # fmt: skip
    # a consumer of p: one that READ from it or was handed a request naming it (recordings
    # before `remote_engine` name none: every consumer is then p's)
    named = {e.engine for e in events
             if e.engine in readers and (e.call == "read" or (e.call == "add_request"
                                         and e.result.get("remote_prefill")))
             and e.result.get("remote_engine", "") in ("", p)}  # fmt: skip
    return p, [c for c in readers if c in named]


@dataclass(frozen=True)
class Sides:
    """What is validated of one producer: its KVTrace log, its clock once per entry of
    `clocks` (a decode engine's share, mapping.project_log; None: the whole producer, fed
    by at most one decode engine: KVClock has one), and each decode engine's share of it."""

    producer: str | None  # the `producer` argument of the mappings: None if the only one
    name: str  # its engine
    clocks: tuple[str | None, ...]
    decodes: tuple[str, ...]


def validation_sides(events: list[Event]) -> list[Sides]:
    """Each recorded producer's Sides (xPyD: several; each producer's completion is its
    own). Used by kvspec validate, the scenarios, the compaction and bench/validate.py."""
    ps = producer_engines(events)
    out = []
    for p in ps:
        which = p if len(ps) > 1 else None
        ds = tuple(engines_of(events, which)[1])
        out.append(Sides(which, p, ds if len(ds) > 1 else (None,), ds))
    return out


def _rank_steps(events: list[Event], producer: str) -> dict[tuple[int, int], Event]:
    """(rank, step) -> that rank's get_transfer_results, by order within the rank."""
    count: dict[int, int] = defaultdict(int)
    out: dict[tuple[int, int], Event] = {}
    for e in sorted(events, key=lambda e: (e.rank, e.pid, e.seq)):
        if e.engine == producer and e.role == "worker" and e.call == "get_transfer_results":
            count[e.rank] += 1
            out[(e.rank, count[e.rank])] = e
    return out


def map_recording(events: list[Event], *, drop: bool = True, producer: str | None = None,
                  consumer: str | None = None) -> Mapped:  # fmt: skip
    """The producer's KVTrace log; `drop=False` keeps every idle step (the clock's mapping,
    kvspec.record.clock_mapping, drops its own). `producer`: which one, where the
    recording has several (kvspec validate --producer); READs from others are theirs.
    `consumer`: only the requests that decode engine took (project_log)."""
    producer, consumers = engines_of(events, producer)
    if consumer is not None and consumer not in consumers:
        raise MappingError(f"{consumer} is no decode engine of {producer}; its decode "
                           f"engines: {', '.join(consumers) or 'none'}")  # fmt: skip
    p_sched = [e for e in events if e.engine == producer and e.role == "scheduler"]
    start = next((e.result for e in p_sched if e.call == "start"), {})
    world = max((e.world for e in events if e.engine == producer), default=1)
    reqs: dict[str, int] = {}
    for e in p_sched:
        if e.call == "add_request":
            reqs.setdefault(e.reqs[0], len(reqs) + 1)

    def r_of(rid: str) -> int:
        if rid not in reqs:
            raise MappingError(f"request {rid} was never added to producer {producer}")
        return reqs[rid]

    def rs(ids: Any) -> frozenset[int]:
        return frozenset(r_of(str(x)) for x in ids if str(x) in reqs)

    per_rank = _rank_steps(events, producer)
    stray = sorted({w for w, _ in per_rank if w >= world})
    if stray:
        raise MappingError(f"producer {producer} rank {stray[0]} reported, but its world "
                           f"is {world} ranks (0..{world - 1})")  # fmt: skip
    # Step k's execute event sits at its last rank's report (recorded after it returns).
    exec_at: dict[tuple[int, int], SpecEvent] = {}
    k = 1
    while all((w, k) in per_rank for w in range(world)):
        last = max((per_rank[(w, k)] for w in range(world)), key=lambda e: (e.t_ns, e.pid, e.seq))
        out = tuple(rs(per_rank[(w, k)].ids("finished_sending")) for w in range(world))
        exec_at[(last.pid, last.seq)] = SpecEvent("execute", out=out, source=last)
        k += 1

    # a consumer's request id -> the producer's (pull: named by its READ)
    d_to_p = _pushed_to(events, consumers, producer) if transfer(start) == "push" else {}
    written: set[tuple[str, int]] = set()  # push: (producer request, rank) WRITEs posted
    read_by: dict[tuple[str, int], set[tuple[str, int]]] = {}  # (r, w) -> (engine, D rank)
    log: list[SpecEvent] = []
    finishing: set[int] = set()
    arrived: set[int] = set()
    for e in events:
        key = (e.pid, e.seq)
        if key in exec_at:
            log.append(exec_at[key])
        if e.engine == producer and e.role == "scheduler":
            if e.call == "add_request":
                arrived.add(r_of(e.reqs[0]))
                log.append(SpecEvent("arrive", r=r_of(e.reqs[0]), source=e))
            elif e.call == "schedule":
                finishing = set()
                log.append(SpecEvent("schedule", batch=rs(e.ids("new")), source=e))
            elif e.call == "request_finished" and e.result.get("status") != "FINISHED_ABORTED":
                finishing |= rs(e.reqs)
            elif e.call == "update_from_output":
                fs = rs(e.ids("finished_sending"))
                log.append(SpecEvent("update", freed=fs, fin=frozenset(finishing), source=e))
                finishing = set()
            elif e.call == "finish_requests" and e.result.get("status") == "FINISHED_ABORTED":
                # finish_requests skips ids it does not hold (scheduler.py:2678-2681): a
                # client abort that overtook its add_request is no step (recorded:
                # pd-abort, the abort reached the engine core first)
                log += [SpecEvent("abort", r=reqs[rid], source=e) for rid in e.reqs
                        if rid in reqs and reqs[rid] in arrived]  # fmt: skip
        elif e.engine == producer and e.call == "write" and e.result.get("posted", True):
            # push: rank w's writer thread posted r's WRITE (push_worker.py _xfer_blocks).
            # KVCompletion has one WRITE per (r, w), done when all its handles are: a
            # request's WRITEs to several D ranks are that one (the first is the post)
            if (e.reqs[0], e.rank) not in written:
                written.add((e.reqs[0], e.rank))
                log.append(SpecEvent("write", r=r_of(e.reqs[0]), w=e.rank, source=e))
        elif e.engine in consumers and e.role == "worker":
            if e.call == "read" and e.result.get("remote_engine", producer) != producer:
                continue  # another producer's (xPyD)
            if e.call == "read" and not reached_producer(e):
                continue
            if e.call == "read":
                prid = str(e.result.get("remote_request_id", ""))
                d_to_p[e.reqs[0]] = prid
                w = int(e.result.get("remote_rank", -1))
                if not 0 <= w < world:
                    raise MappingError(f"{e.engine} rank {e.rank} read from producer rank "
                                       f"{w}, outside 0..{world - 1}")  # fmt: skip
                # D TP > P TP: several D ranks READ their heads of r from rank w, and w
                # frees r at the last "r:n" (pull_worker.py:_get_new_notifs, 0.32).
                # KVCompletion has one consumer per producer rank (n = 1): its READ of
                # (r, w) is the first D rank's, the others are "coread"s that KVTrace
                # requires while that READ is in flight (its notification is the last).
                # (a D rank's own second READ, or another engine's, is a READ: rejected)
                readers = read_by.setdefault((prid, w), set())
                sibling = bool(readers) and (e.engine, e.rank) not in readers and all(
                    eng == e.engine for eng, _ in readers)
                readers.add((e.engine, e.rank))
                log.append(SpecEvent("coread" if sibling else "read", r=r_of(prid), w=w,
                                     source=e))  # fmt: skip
            elif e.call == "get_transfer_results":
                for rid in sorted(e.ids("finished_recving")):
                    if rid in d_to_p:
                        log.append(SpecEvent("recv", r=r_of(d_to_p[rid]), source=e))
    cap = kv_capacity(p_sched)
    if cap is not None and most_holding(log) > cap:  # e.g. requests shared prefix blocks
        cap = None
    cut: set[int] = set()
    if consumer is not None and len(consumers) > 1:
        log, reqs, cut = project_log(log, reqs, taken_by(events, consumer, producer))
        consumers, cap = [consumer], None  # the pool is shared with the others' requests
    kept, dropped = drop_idle_steps(log) if drop else (log, set())
    return Mapped(producer, consumers, reqs, world, dict(start), kept, dropped | cut, cap,
                  steps_holding_events(log), cut)  # fmt: skip


def reached_producer(e: Event) -> bool:
    """A decode worker's recorded READ reached the producer: not one whose posting failed
    (`_read_blocks` returned False, recorded posted=false: transfer_setup_failed,
    pull_worker.py:561-575; recorded: a READ of a crashed producer). D reports such a
    receive failed; the decode side maps it as a failed READ."""
    return e.result.get("posted") is not False


def taken_by(events: list[Event], consumer: str, producer: str) -> set[str]:
    """The producer's request ids a decode engine took: named by its add_request
    (remote_request_id) or its READs."""
    return {str(e.result["remote_request_id"]) for e in events
            if e.engine == consumer and e.call in ("add_request", "read")
            and e.result.get("remote_request_id")
            and e.result.get("remote_engine", producer) == producer}  # fmt: skip


def project_log(log: list[SpecEvent], reqs: dict[str, int], keep: set[str]
                ) -> tuple[list[SpecEvent], dict[str, int], set[int]]:  # fmt: skip
    """The log of the producer's requests in `keep` only, renumbered 1.. in arrival order,
    and the steps cut from it: one decode engine's share of a producer that feeds several
    (xPyD). Sound for KVCompletion and KVClock because a producer keeps no completion
    state across requests but its pool (Capacity: unknown in a projection) and its
    stepping: each request's aggregator entry, notifications, lease and heartbeats are its
    own (a D engine heartbeats only its own requests, nixl/base_worker.py
    _send_heartbeats). The engine steps while any request is held (has_requests), so the
    steps scheduled once the share's last request was freed, which the others' requests
    kept going, are cut (kept, KVCompletion's schedule would reject the first: measured
    on pd-1p2d's clock)."""
    new = {rid: n for n, rid in enumerate(sorted((x for x in reqs if x in keep),
                                                 key=lambda x: reqs[x]), start=1)}  # fmt: skip
    old_to_new = {reqs[rid]: n for rid, n in new.items()}

    def rs(xs: frozenset[int]) -> frozenset[int]:
        return frozenset(old_to_new[r] for r in xs if r in old_to_new)

    out: list[SpecEvent] = []
    for e in log:
        if e.a in PER_REQUEST:
            if e.r in old_to_new:
                out.append(replace(e, r=old_to_new[e.r]))
        else:
            out.append(replace(e, batch=rs(e.batch), out=tuple(rs(o) for o in e.out),
                               freed=rs(e.freed), fin=rs(e.fin)))  # fmt: skip
    out, cut = _cut_after_last_free(out, set(new.values()))
    return out, new, cut


def _cut_after_last_free(log: list[SpecEvent],
                         rs: set[int]) -> tuple[list[SpecEvent], set[int]]:  # fmt: skip
    """project_log's cut: the steps (1-based) whose schedule follows the update that freed
    the last of `rs`; their schedule, execute and update leave the log."""
    freed: set[int] = set()
    end = len(log)
    for n, e in enumerate(log):
        if e.a == "update":
            freed |= e.freed
            if rs and rs <= freed:
                end = n
                break
    count = {k: 0 for k in STEP_KINDS}
    first_cut = 1 + sum(1 for e in log[:end] if e.a == "schedule")
    out: list[SpecEvent] = []
    cut: set[int] = set()
    for e in log:
        if e.a in STEP_KINDS:
            count[e.a] += 1
            if count[e.a] >= first_cut:
                cut.add(count[e.a])
                continue
        out.append(e)
    return out, cut


# A producer waiting for READs busy-loops empty steps (scheduler.has_requests counts
# delayed frees): thousands of schedule/execute/update triples that admit, report and emit
# nothing. After KEEP_IDLE of them in a row (enough to flush reqs_to_send and
# reqs_not_processed through a pipeline of depth 2) another idle step changes no spec
# variable, so it is dropped; any other event ends the run.
KEEP_IDLE = 2


def _idle(e: SpecEvent) -> bool:
    return (
        (e.a == "schedule" and not e.batch)
        or (e.a == "execute" and not any(e.out))
        or (e.a == "update" and not e.freed and not e.fin)
    )


class _Event(Protocol):
    @property
    def a(self) -> str: ...


E = TypeVar("E", bound=_Event)
STEP_KINDS = ("schedule", "execute", "update")


def idle_steps(log: Sequence[E], idle: Callable[[E], bool],
               breaks: Callable[[E, E], bool] | None = None) -> set[int]:  # fmt: skip
    """Steps (1-based, in the order of their schedule events; execute and update follow
    their step's order) to drop: idle ones past KEEP_IDLE in a row. A step is idle when its
    schedule, execute and update all are (`idle`); any other event between two steps ends
    the run, and so does `breaks(previous step's schedule, this one's)` where given (the
    clock's mapping: a new tick). Used for the producer's log and the decode engine's
    (decode_mapping)."""
    at: dict[str, list[int]] = {k: [] for k in STEP_KINDS}
    for n, e in enumerate(log):
        if e.a in STEP_KINDS:
            at[e.a].append(n)
    drop: set[int] = set()
    run, prev_end = 0, -1
    for s in range(min(len(v) for v in at.values())):
        idx = [at[k][s] for k in STEP_KINDS]
        other = any(log[n].a not in STEP_KINDS for n in range(prev_end + 1, min(idx)))
        if breaks is not None and s > 0 and breaks(log[at["schedule"][s - 1]], log[idx[0]]):
            other = True
        prev_end = max(idx)
        if not all(idle(log[n]) for n in idx):
            run = 0
            continue
        run = 1 if other else run + 1
        if run > KEEP_IDLE:
            drop.add(s + 1)
    return drop


def steps_holding_events(log: Sequence[E]) -> set[int]:
    """Steps (1-based, as idle_steps counts them) with another event between their
    schedule and their update: dropping such a step would move that event between two
    steps, where it ends a run of idle ones, so compaction keeps it (the compacted
    recording then maps to the same log: kvspec.record.compact)."""
    at: dict[str, list[int]] = {k: [] for k in STEP_KINDS}
    for n, e in enumerate(log):
        if e.a in STEP_KINDS:
            at[e.a].append(n)
    out = set()
    for s in range(min(len(v) for v in at.values())):
        idx = [at[k][s] for k in STEP_KINDS]
        if any(log[n].a not in STEP_KINDS for n in range(min(idx), max(idx))):
            out.add(s + 1)
    return out


def drop_idle_steps(log: Sequence[E], idle: Callable[[E], bool] = _idle,  # type: ignore[assignment]
                    breaks: Callable[[E, E], bool] | None = None
                    ) -> tuple[list[E], set[int]]:  # fmt: skip
    drop = idle_steps(log, idle, breaks)
    count = {k: 0 for k in STEP_KINDS}
    kept = []
    for e in log:
        if e.a in STEP_KINDS:
            count[e.a] += 1
            if count[e.a] in drop:
                continue
        kept.append(e)
    return kept, drop
