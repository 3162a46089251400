"""The MultiConnector children's part of RankStep(w, m): what the HF3FS child and the
upstream OffloadingConnector do on one rank in one step (KVCompletion.tla's RankStep, the
`Hf3fs*` and `Offload*` definitions). Kept apart from kvspec.model, which holds one
function per action; these are the per-rank halves of execute_model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec.defs import Defs
from kvspec.vocab import EMPTY, Reqs, State, Step


@dataclass(frozen=True)
class ChildStep:
    """One rank's child state after a step, and what the child reported in it."""

    store: Reqs
    stored: Reqs
    pend: Reqs
    unsub: Reqs
    clobbered: bool  # the step's forward overwrote a block a store has yet to read
    reported: Reqs  # finished_sending (HF3FS)
    ack: Reqs  # completed_jobs in kv_connector_worker_meta (offloading)


def _unchanged(s: State, w: int) -> ChildStep:
    return ChildStep(s.store[w], s.stored[w], s.pend[w], s.unsub[w], False, EMPTY, EMPTY)


def hf3fs_step(d: Defs, s: State, w: int, m: Step) -> ChildStep:
    """HF3FS on rank w in step m. Saves of the step's batch are submitted before
    get_finished (submit_save_operation); _check_completed_saves(finished_req_ids) reports
    pending requests whose saves are done, then each newly finished one whose saves are
    done or that has none, and makes the rest pending (hf3fs_connector.py ~189-225)."""
    if not d.delaying:
        return _unchanged(s, w)
    st1 = s.store[w] | m.batch
    from_pend = s.pend[w] & s.stored[w]
    done_now = m.fin & s.stored[w]
    no_saves = m.fin - (st1 | s.stored[w])
    reported = from_pend | done_now | no_saves
    pend1 = (s.pend[w] - from_pend) | (m.fin & st1)
    return ChildStep(st1, s.stored[w] - reported, pend1, s.unsub[w], False, reported, EMPTY)


def offload_step(d: Defs, s: State, w: int, m: Step) -> ChildStep:
    """The upstream OffloadingConnectorWorker on rank w in step m, in the V2 runner's order
    (v1/worker/gpu/kv_connector.py pre_forward/post_forward):
    1. handle_preemptions (offloading/worker.py:219-244): the jobs in jobs_to_flush are
       submitted (from this metadata's store_jobs or the unsubmitted ones) and waited for,
       so they are complete before the forward;
    2. the forward writes the batch's blocks, among them the freed blocks of `m.reused`:
       a store of one of those not yet done on this rank reads overwritten KV;
    3. start_load_kv -> start_kv_transfers submits the previous step's stores;
    4. wait_for_save -> prepare_store_kv defers this step's store jobs to the next step
       ("so that offloading starts AFTER transfers related to token sampling"); every rank
       writes (replicated_layout is off by default, worker.py:54-58);
    5. get_finished -> the completed jobs, acked in build_connector_worker_meta."""
    if not d.offload:
        return _unchanged(s, w)
    flushed = m.flush & (s.unsub[w] | s.store[w] | m.jobs)
    unsub1 = s.unsub[w] - m.flush
    store1 = s.store[w] - m.flush
    done = s.stored[w] | flushed
    clobbered = bool(m.reused & (unsub1 | store1))
    return ChildStep(
        store=store1 | unsub1,
        stored=EMPTY,
        pend=s.pend[w],
        unsub=m.jobs - m.flush,
        clobbered=clobbered,
        reported=EMPTY,
        ack=done,
    )
