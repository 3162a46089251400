"""Doctored recordings: a real run with one thing made wrong, the way a broken connector
would have made it. `kvspec validate` must reject each at the doctored event; the tests
use them as the negative controls of trace validation.
"""

from __future__ import annotations

from dataclasses import replace

from kvspec.record.log import Event


def _first(events: list[Event], pred: object) -> int:
    for n, e in enumerate(events):
        if pred(e):  # type: ignore[operator]
            return n
    raise ValueError("the recording has no event to doctor")


def drop_finished_sending(events: list[Event], producer: str, rid: str) -> list[Event]:
    """The first producer worker report of `rid` never names it (a lost notification or a
    filter that clears it): the scheduler's later finished_sending is then unexplained."""
    n = _first(events, lambda e: e.engine == producer and e.role == "worker"
               and e.call == "get_transfer_results"
               and rid in e.ids("finished_sending"))  # fmt: skip
    e = events[n]
    sending = sorted(e.ids("finished_sending") - {rid})
    return [*events[:n], replace(e, result={**e.result, "finished_sending": sending}),
            *events[n + 1:]]  # fmt: skip


def free_before_read(events: list[Event], producer: str, rid: str) -> list[Event]:
    """The producer's step that freed `rid` (its update_from_output with rid finished and
    the free) happens just before the consumer's READ of rid: blocks freed under a READ."""
    read = _first(events, lambda e: e.call == "read" and e.result.get("remote_request_id") == rid)
    t = events[read].t_ns - 1
    moved = [replace(e, t_ns=t) for e in events
             if e.engine == producer and e.role == "scheduler"
             and ((e.call == "update_from_output" and rid in e.ids("finished_sending"))
                  or (e.call == "free_blocks" and rid in e.reqs))]  # fmt: skip
    if not moved:
        raise ValueError(f"{rid} was never freed")
    keys = {(e.pid, e.seq) for e in moved}
    rest = [e for e in events if (e.pid, e.seq) not in keys]
    return sorted(rest + moved, key=lambda e: (e.t_ns, e.pid, e.seq))


def report_on_rank(events: list[Event], producer: str, rid: str, src: int, dst: int) -> list[Event]:
    """Producer rank `dst` reports `rid` in the step where rank `src` did, and `src` does
    not: a report from a rank that was never read from (or never notified)."""
    n = _first(events, lambda e: e.engine == producer and e.role == "worker" and e.rank == src
               and e.call == "get_transfer_results"
               and rid in e.ids("finished_sending"))  # fmt: skip
    k = sum(1 for e in events[:n] if e.engine == producer and e.rank == src
            and e.call == "get_transfer_results")  # fmt: skip
    ranks_dst = [i for i, e in enumerate(events) if e.engine == producer and e.rank == dst
                 and e.role == "worker" and e.call == "get_transfer_results"]  # fmt: skip
    m = ranks_dst[k]
    out = list(events)
    e = out[n]
    out[n] = replace(
        e, result={**e.result, "finished_sending": sorted(e.ids("finished_sending") - {rid})}
    )
    f = out[m]
    out[m] = replace(
        f, result={**f.result, "finished_sending": sorted(f.ids("finished_sending") | {rid})}
    )
    return out


def claim_lease(events: list[Event], producer: str, lease_s: int) -> list[Event]:
    """The producer's `start` says another kv_lease_duration: under a longer one, the
    reaper's free of the real run came before the lease ran out."""
    n = _first(events, lambda e: e.engine == producer and e.call == "start")
    e = events[n]
    return [*events[:n], replace(e, result={**e.result, "lease": lease_s}), *events[n + 1:]]


def drop_heartbeat_receipts(events: list[Event], producer: str) -> list[Event]:
    """The producer's `_handle_heartbeat` never ran (the heartbeats were lost, or a
    handler that ignores them): yet P did not reap the leases when they ran out."""
    return [e for e in events if not (e.engine == producer and e.call == "heartbeat_recv")]


def sibling_read_after_free(events: list[Event], producer: str, rid: str) -> list[Event]:
    """D TP > P TP: the last D rank's READ of `rid` is posted just after the producer freed
    it, as under a producer that frees at the first of the D ranks' "r:n" (one consumer
    counted: #56033's class): that D rank READs freed blocks."""
    reads = [e for e in events if e.call == "read" and e.result.get("remote_request_id") == rid]
    if len({(e.engine, e.rank) for e in reads}) < 2:
        raise ValueError(f"{rid} was read by one decode rank: no sibling READ to move")
    free = events[_first(events, lambda e: e.engine == producer and e.call == "free_blocks"
                         and rid in e.reqs)]  # fmt: skip
    last = reads[-1]
    rest = [e for e in events if e is not last]
    return sorted([*rest, replace(last, t_ns=free.t_ns + 1)],
                  key=lambda e: (e.t_ns, e.pid, e.seq))  # fmt: skip


def free_at(events: list[Event], producer: str, rid: str, t_ns: int) -> list[Event]:
    """The producer frees `rid` in a step at `t_ns`: its worker reports it finished_sending,
    its scheduler frees the blocks. Built from the producer's last step (schedule, worker
    report, update) as vLLM records one; a step scheduled and not yet run (a producer
    stopped during it) is the one that frees."""
    mine = [e for e in events if e.engine == producer]

    def last(call: str) -> Event:
        return max((e for e in mine if e.call == call), key=lambda e: (e.t_ns, e.seq))

    sched, report = last("schedule"), last("get_transfer_results")
    update = last("update_from_output")
    s_seq, w_seq = sched.seq + 1000, report.seq + 1000
    step = [
        replace(report, seq=w_seq, t_ns=t_ns + 1,
                result={**report.result, "finished_sending": [rid]}),
        replace(update, call="free_blocks", seq=s_seq + 1, t_ns=t_ns + 2, reqs=(rid,),
                result={"free": 0}),
        replace(update, seq=s_seq + 2, t_ns=t_ns + 3,
                result={**update.result, "finished_sending": [rid]}),
    ]  # fmt: skip
    if update.t_ns > sched.t_ns:  # the last step ran: a new one
        step.append(replace(sched, seq=s_seq, t_ns=t_ns,
                            result={"finished_req_ids": [], "new": []}))  # fmt: skip
    return sorted([*events, *step], key=lambda e: (e.t_ns, e.pid, e.seq))


def unwritten(events: list[Event], producer: str, rid: str) -> list[Event]:
    """Push mode: the producer never WRITEs `rid` (its writer posts nothing, and D never
    receives it) and still reports it sent where it did: a report with no WRITE behind it,
    which only the lease running out explains."""
    d_ids = {e.reqs[0] for e in events if e.call == "add_request" and e.reqs
             and e.result.get("remote_request_id") == rid}  # fmt: skip
    if not any(e.engine == producer and e.call == "write" and rid in e.reqs for e in events):
        raise ValueError(f"the producer never wrote {rid}")

    def without(e: Event) -> Event:
        got = e.ids("finished_recving")
        if not got & d_ids:
            return e
        return replace(e, result={**e.result, "finished_recving": sorted(got - d_ids)})

    return [without(e) for e in events
            if not (e.engine == producer and e.call == "write" and rid in e.reqs)]


def handshake_done_at(events: list[Event], producer: str, t_ns: int) -> list[Event]:
    """Push mode: the producer rank's failed handshake with D (a recording whose staged
    fault refused it) instead succeeds at `t_ns`, and the writer re-drives every request
    the rank had parked on it (those D registered: D's add_request names them), as vLLM's
    `_on_handshake` and the writer's inbox do (push_worker.py:247-252, 465-478): a WRITE
    of each, 1 ms apart. `t_ns` after the producer freed them is the WRITE from freed
    blocks (a handshake that outlived the lease); before, the same WRITEs from blocks P
    still held."""
    n = _first(events, lambda e: e.engine == producer and e.call == "handshake"
               and e.result.get("ok") is False)  # fmt: skip
    hs = events[n]
    d = str(hs.result.get("remote_engine"))
    parked = [(str(e.result["remote_request_id"]), e.reqs[0]) for e in events
              if e.engine == d and e.call == "add_request" and e.reqs
              and e.result.get("remote_engine") == producer]  # fmt: skip
    done = replace(hs, t_ns=t_ns, result={**hs.result, "ok": True})
    writes = [  # (seq past the file's own: an event is known by its pid and seq)
        replace(hs, call="write", seq=hs.seq + 100_000 + k, t_ns=t_ns + (k + 1) * 1_000_000,
                reqs=(rid,), result={"posted": True, "remote_engine": d,
                                     "remote_rank": 0, "remote_request_id": d_rid})
        for k, (rid, d_rid) in enumerate(parked)
    ]  # fmt: skip
    rest = [*events[:n], *events[n + 1:]]
    return sorted([*rest, done, *writes], key=lambda e: (e.t_ns, e.pid, e.seq))
