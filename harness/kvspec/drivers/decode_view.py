"""How the decode driver (drivers/decode_driver.py) reads the real objects as Decode.tla's
variables (`DecodeView.observe`): D's Scheduler and workers, the aggregator, the seams'
records of READs and notifications, and the producer ranks' leases. Read-only: no wait, no
call that changes vLLM's state."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvspec.drivers.decode_seams import HeldHandshake, HeldReads
from kvspec.drivers.vllm_adapters import aborted_kv_loads, awaits, remote_rank
from kvspec.drivers.vllm_consumers import nixl_of
from kvspec.drivers.vllm_driver import VllmDriver
from kvspec.drivers.vllm_view import req_id


def dreq(r: int) -> str:
    return f"dreq-{r}"


@dataclass
class DStep:
    so: Any
    outputs: list[Any] = field(default_factory=list)
    failed: list[set[str]] = field(default_factory=list)  # per rank: vllm_adapters.load_failed
    ran: bool = False


class DecodeView:
    """The read side of DecodeDriver: the state its actions leave, projected on the spec."""

    d: Any  # D's Scheduler (or AsyncScheduler)
    p: VllmDriver  # the producer engine and the cluster's D workers
    agg: Any  # D's KVOutputAggregator
    N: int
    T: int  # D's ranks
    PT: int  # P's ranks
    comp: str  # D's connector composition
    steps: deque[DStep]
    crashed: bool
    pst: dict[tuple[int, int], str]  # (p, r) -> notified | expired
    handles: dict[int, dict[int, tuple[int, int]]]  # w -> READ handle -> (r, p)
    results: dict[int, tuple[int, bool]]  # handle -> (w, ok) once ended
    delivered: dict[tuple[int, int], int]  # (p, r) -> notifications delivered
    held: list[HeldReads]
    hs: list[HeldHandshake]

    def _status(self, r: int) -> str:
        rq = self.d.requests.get(dreq(r))
        if rq is None:
            return "gone"
        rs = self.p.c.api.RequestStatus
        if rs.is_finished(rq.status):
            return "fin"
        if rq.status == rs.WAITING_FOR_REMOTE_KVS:
            return "wfrk"
        if rq.status == rs.RUNNING:
            return "running"
        return "new" if (rq.kv_transfer_params or {}).get("do_remote_prefill") else "waiting"

    def _h(self, w: int, r: int, p: int) -> str:
        """h[w][r][p]: the READ's state until r is reported. vLLM keeps only in-progress
        handles: an ended one is released at the poll (_pop_done_transfers, BW:3083-3107)
        while r waits for its other READs (hetero TP: one per producer rank), its failure
        kept in _recv_failures (BW:2862-2889); the spec keeps it "done"/"err" meanwhile."""
        cw = self.p.c.consumer_nixl(w).connector_worker
        live = cw._recving_transfers.get(dreq(r))
        if live is None:
            return "none"
        for hd, rp in self.handles[w].items():
            if rp != (r, p):
                continue
            res = self.results.get(hd)
            if hd in live:
                return "proc" if res is None else ("done" if res[1] else "err")
            if res is not None:  # ended and released, r still waiting for a sibling
                if res[1]:
                    return "done"
                return "err" if dreq(r) in getattr(cw, "_recv_failures", ()) else "none"
        return "none"

    def _pin(self) -> dict[tuple[int, int], int]:
        """pin[p][r]: the "r:n" D sent producer rank p and the driver has not delivered.
        Sent: each standalone send_notif (notify-only, BW/PW), and each READ that ended
        well with a notification attached (NIXL sends it with the completion, PW:546-553);
        a failed READ sends none. Read off D's own calls, not P's agent, so no wait."""
        sent: dict[tuple[int, int], int] = {}

        def add(p: int, msg: bytes) -> None:
            rid, sep, _ = msg.decode(errors="replace").partition(":")
            if sep and rid.startswith("req-") and rid[4:].isdigit():
                key = (p, int(rid[4:]))
                sent[key] = sent.get(key, 0) + 1

        for t, held in enumerate(self.held):
            agents = self.p.c.consumer_nixl(t).connector_worker._remote_agents
            rank = {name: remote_rank(k) for k, name in agents.get(self.p.c.engine_id, {}).items()}
            for agent, msg in held.sent:
                if agent in rank:
                    add(rank[agent], msg)
            for hd, (_, ok) in self.results.items():
                if ok and hd in self.handles[t] and held.notif.get(hd):
                    add(self.handles[t][hd][1], held.notif[hd])
        return {k: n - self.delivered.get(k, 0) for k, n in sent.items()}

    def observe(self) -> dict[str, object]:
        """The spec's variables as vLLM holds them (Decode.tla names; r, w, p as in the
        spec). Not observed: failed (history, not state), echo, sendPend and sendDone
        (composition nixl: always empty); abl (_aborted_kv_loads) only where the release
        has it (0.34+): decode_traces.differences compares what both sides hold."""
        reqs = range(1, self.N + 1)
        ranks, pranks = range(self.T), range(self.PT)

        def rs(ids: object) -> frozenset[int]:
            return frozenset(int(str(x).split("-")[1]) for x in ids)  # type: ignore[attr-defined]

        sched = nixl_of(self.d.connector, self.comp).connector_scheduler

        def step_view(st: DStep) -> dict[str, object]:
            meta = VllmDriver._nixl_meta(st.so.kv_connector_metadata, self.comp).reqs_to_recv
            kv = [o.kv_connector_output for o in st.outputs]
            none: dict[int, frozenset[int]] = {w: frozenset() for w in ranks}
            return {
                "recv": rs(meta), "aw": rs(k for k, m in meta.items() if awaits(m)),
                "ran": st.ran,
                "out": {w: rs(kv[w].finished_recving or ()) for w in ranks} if kv else none,
                "fail": {w: rs(st.failed[w]) for w in ranks} if kv else none,
                "send": none,
            }  # fmt: skip

        pin = self._pin()
        p_held = {(p, r): req_id(r) in self.p.c.nixl_worker(p)._reqs_to_send for p in pranks
                  for r in reqs}  # fmt: skip
        return {
            "st": {r: self._status(r) for r in reqs},
            "fRecv": rs(self.d.finished_recving_kv_req_ids),
            "fFail": rs(self.d.failed_recving_kv_req_ids),
            "crashed": self.crashed,
            "steps": {i: step_view(st) for i, st in enumerate(self.steps, start=1)},
            "cleanup": rs(sched._reqs_need_recv),
            "reg": {
                w: rs(self.p.c.consumer_nixl(w).connector_worker._recving_metadata) for w in ranks
            },  # fmt: skip
            "xf": {
                w: rs(self.p.c.consumer_nixl(w).connector_worker._recving_transfers) for w in ranks
            },  # fmt: skip
            "h": {w: {r: {p: self._h(w, r, p) for p in pranks} for r in reqs} for w in ranks},
            "rem": {r: self.agg._recv_remaining_count.get(dreq(r), 0) for r in reqs},
            "hsd": {w: self.hs[w].state() if self.hs else "done" for w in ranks},
            "rdy": {
                w: frozenset((int(rid.split("-")[1]), aw) for rid, aw in self.hs[w].ready())
                if self.hs
                else frozenset()
                for w in ranks
            },  # fmt: skip
            "hfl": {
                w: frozenset(int(rid.split("-")[1]) for rid in self.hs[w].failed())
                if self.hs
                else frozenset()
                for w in ranks
            },  # fmt: skip
            "pin": {p: {r: pin.get((p, r), 0) for r in reqs} for p in pranks},
            "pst": {
                p: {r: "held" if p_held[(p, r)] else self.pst.get((p, r), "?") for r in reqs}
                for p in pranks
            },  # fmt: skip
        } | ({} if (abl := aborted_kv_loads(self.d)) is None else {"abl": rs(abl)})
