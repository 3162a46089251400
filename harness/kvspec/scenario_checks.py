"""The end-state checks `kvspec scenario` reads off a recording (pure: events in, a Check
out): which attention backend each engine ran, whether D received the KV bytes P
computed, and what the prefix cache did (a local hit on D, a block P's requests share)."""

from __future__ import annotations

from kvspec.record.log import Event
from kvspec.scenario_flows import Check, producer_ids


def backend_check(events: list[Event], engines: list[str]) -> Check:
    """The attention backend each engine's workers ran, as recorded at registration (the
    recorder's kv_caches event: vLLM's own pick for the host, nothing pinned), and that P
    and D ran the same one, as NIXL's handshake needs of CPU_ATTN (base_worker.py:
    2520-2521)."""
    seen = {eid: sorted({f"{e.result.get('backend')} (kernel block "
                         f"{e.result.get('kernel_block')}, {e.result.get('dtype')})"
                         for e in events if e.engine == eid and e.call == "kv_caches"})
            for eid in engines}  # fmt: skip
    ok = all(len(v) == 1 for v in seen.values()) and len({v[0] for v in seen.values()}) == 1
    return Check(
        "every engine ran one attention backend, the same",
        ok,
        "; ".join(f"{eid} {', '.join(v) or 'not recorded'}" for eid, v in seen.items()),
    )


def digest_pairs(events: list[Event]) -> list[tuple[str, Event, Event]]:
    """(producer request less vLLM's random suffix, P's "sent" kv_digest, D's "received"
    one) for every request both recorded, engines of one rank only (with more, each rank
    holds its share of the heads). D's request is paired through `producer_ids`. A failed
    receive's blocks were never written: recorders before 2026-12-07 digested it (0.32
    reports it in finished_recving too), and 0.29 names it only by its load errors."""
    failed = {r for e in events if e.call == "get_transfer_results"
              for r in e.ids("failed_recving")} | {
        r for e in events if e.call == "load_errors" for r in e.reqs}  # fmt: skip
    kv = [e for e in events if e.call == "kv_digest" and e.reqs and e.world == 1
          and e.reqs[0] not in failed]  # fmt: skip
    remote = producer_ids(events)
    sent = {e.reqs[0].rsplit("-", 1)[0]: e for e in kv if e.result.get("side") == "sent"}
    return [(r, sent[r], e) for e in kv if e.result.get("side") == "received"
            and (r := remote.get(e.reqs[0], e.reqs[0]).rsplit("-", 1)[0]) in sent]  # fmt: skip


def kv_bytes_check(events: list[Event], reused: bool) -> Check | None:
    """The KV D received against the KV P computed, request by request (`digest_pairs`:
    P's "sent" at its finish, D's "received" at its report). None where nothing pairs or
    an engine has several ranks. `reused`: P reused the freed blocks before its late
    WRITEs, so every pair must differ."""
    if any(e.world > 1 for e in events if e.call == "kv_digest"):
        return None
    pairs = digest_pairs(events)
    if not pairs:
        return None
    same = [same_kv(s, d) for _, s, d in pairs]
    detail = "; ".join(f"{r}: P {_shown(s, d)}, D {d.result.get('digest')}" for r, s, d in pairs)
    if reused:
        return Check(
            "D received other prompts' KV (P's digest at its finish differs from "
            "D's at its receive, every request)",
            not any(same),
            detail,
        )
    return Check(
        "D received the KV bytes P computed (digest at P's finish = at D's receive, every request)",
        all(same),
        detail,
    )


def prefix_hit_check(events: list[Event]) -> Check:
    """pd-d-prefix-hit: D held request 1's first block in its prefix cache, so it received
    one block fewer than P computed for request 1 (p0), and all of request 2's (p1)."""
    got = {r: (_blocks(s), _blocks(d)) for r, s, d in digest_pairs(events)}
    ok = (set(got) == {"p0", "p1"} and got["p0"][1] == got["p0"][0] - 1
          and got["p1"][1] == got["p1"][0])  # fmt: skip
    return Check(
        "D received only the blocks its prefix cache lacked (request 1: one "
        "fewer than P computed; request 2: all)",
        ok,
        ", ".join(f"{r}: P {n}, D {m}" for r, (n, m) in sorted(got.items())),
    )


def shared_block_check(events: list[Event]) -> Check:
    """pd-shared-prefix: P's two requests ended holding the same first block (request 2
    took it from P's prefix cache) and each a second block of its own (request_finished's
    block_ids, recorded since 2026-12-07)."""
    ids = [
        list(e.result.get("block_ids") or [])
        for e in events
        if e.engine == "P"
        and e.role == "scheduler"
        and e.call == "request_finished"
        and e.result.get("delay")
    ]
    ok = len(ids) == 2 and all(len(b) == 2 for b in ids) and ids[0][0] == ids[1][0] \
        and ids[0][1] != ids[1][1]  # fmt: skip
    return Check(
        "P held one block for both requests' READs (request 2's first block is "
        "request 1's, from P's prefix cache)",
        ok,
        f"P's blocks per request {ids}",
    )


def _blocks(e: Event) -> int:
    return int(e.result.get("blocks", 0))


def _tail(sent: Event, got: Event) -> list[str | None] | None:
    """P's per-block digests of the blocks D received, where D received fewer than P
    computed (a local prefix hit: D reads only the blocks after it,
    base_worker.py:3333-3337); None where D received them all."""
    if _blocks(got) >= _blocks(sent):
        return None
    each = list(sent.result.get("per_block") or [])
    return each[len(each) - _blocks(got) :]


def same_kv(sent: Event, got: Event) -> bool:
    """Did D receive the bytes P computed? All of them, or after a local prefix hit the
    last ones, block by block (`_tail`). An unknown digest (None) is never the same KV."""
    tail = _tail(sent, got)
    if tail is not None:
        mine = list(got.result.get("per_block") or [])
        return bool(mine) and None not in mine and tail == mine
    return sent.result.get("digest") is not None and sent.result.get("digest") == got.result.get(
        "digest"
    )


def _shown(sent: Event, got: Event) -> str | None:
    """P's digest as the check shows it: of the blocks D received (the tail, marked)."""
    tail = _tail(sent, got)
    return f"last {len(tail)} blocks {tail}" if tail else sent.result.get("digest")


def heartbeat_chances(events: list[Event], producer: str, lease_s: float) -> int | None:
    """How many steps `producer`'s worker took between the first heartbeat a decode
    engine delivered to it (a `heartbeat_send` whose `sent` names an agent of the
    producer) and the end of its first lease (its first delayed request_finished plus
    `lease_s`); with TP > 1, its slowest rank's count. A heartbeat extends a lease only
    when the worker reads it in a step (pull: `_get_new_notifs` in get_transfer_results,
    pull_worker.py:642-659; push: the writer thread drains NIXL at one step's wake and the
    main thread handles it at the next, push_worker.py:277-283, 747-764, 810-814). None:
    the producer held no request (no delayed request_finished)."""
    sent = [e.t_ns for e in events if e.call == "heartbeat_send"
            and e.result.get("remote_engine") == producer and e.result.get("sent")]  # fmt: skip
    fin = [e.t_ns for e in events if e.engine == producer and e.role == "scheduler"
           and e.call == "request_finished" and e.result.get("delay")]  # fmt: skip
    if not fin:
        return None
    if not sent:
        return 0
    lo, hi = min(sent), min(fin) + int(lease_s * 1e9)
    steps = [e for e in events if e.engine == producer and e.role == "worker"
             and e.call == "get_transfer_results"]  # fmt: skip
    ranks = {e.rank for e in steps}
    return min((sum(1 for e in steps if e.rank == r and lo < e.t_ns < hi) for r in ranks),
               default=0)  # fmt: skip
