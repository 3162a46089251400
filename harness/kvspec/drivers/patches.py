"""Named, undoable in-memory changes of the installed vLLM.

A `Patch` replaces one vLLM attribute ("module:Class.method") with `make(original)`;
`apply()` installs it and returns the undo, which puts back the exact original object
(nothing is written to site-packages). The vLLM driver applies an impl patch for its
lifetime (`VllmDriver(..., impl_patch=NAME)`), so a process can replay traces against the
shipped code and a patched one in turn; the mutation campaign (`kvspec.mutations`) builds
its mutants from the same type.

`PATCHES` holds the impl patches: positive controls, the intended upstream fixes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Undo = Callable[[], None]


def replace_attr(owner: Any, attr: str, new: Any) -> Undo:
    """Set owner.attr = new; return the undo (restores the exact previous object)."""
    had = attr in vars(owner)
    old = vars(owner).get(attr)
    setattr(owner, attr, new)

    def undo() -> None:
        if had:
            setattr(owner, attr, old)
        else:
            delattr(owner, attr)

    return undo


def target_owner(target: str) -> tuple[Any, str]:
    """The class (or module) that defines a "module:Qualified.name" target, and the
    attribute's name (imports vLLM)."""
    mod, _, qual = target.partition(":")
    obj: Any = importlib.import_module(mod)
    *path, attr = qual.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, attr


@dataclass(frozen=True)
class Patch:
    name: str
    description: str  # one line: what the change does
    target: str  # the vLLM attribute it replaces, "module:Qualified.name"
    origin: str  # the bug number or accounting rule it is about
    make: Callable[[Any], Any]  # original -> replacement

    def apply(self) -> Undo:
        """Install the replacement; return the undo."""
        owner, attr = target_owner(self.target)
        return replace_attr(owner, attr, self.make(getattr(owner, attr)))


NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONNECTOR = f"{NIXL}.connector:NixlBaseConnector"


def _without_replica_filter(orig: Any) -> Any:
    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        # As shipped, minus the filter that clears finished_sending on replicated PCP
        # ranks > 0: their _replicated_pcp_done_sending queue now reaches the aggregator
        # as soon as the metadata arrives (the intent of #53903).
        assert self.connector_worker is not None
        return self.connector_worker.get_transfer_results()

    return get_transfer_results


PUSH_WORKER = f"{NIXL}.push_worker:NixlPushConnectorWorker"


def _lease_checked_push(orig: Any) -> Any:
    def _do_start_push_kv(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        # The proposed fix: a WRITE about to be posted (D's engine handshaken, so no more
        # deferral) of a request this rank no longer tracks, i.e. its reaper reported it
        # and the scheduler frees or freed its blocks, is dropped. Upstream the check and
        # the posting must hold a lock the reaper holds too; the driver steps one thread at
        # a time, so here they cannot interleave.
        reg = args[1] if len(args) > 1 else kwargs["registration_data"]
        tracked = request_id in self._reqs_to_send or request_id in self._reqs_to_process
        if reg["decode_engine_id"] in self._remote_agents and not tracked:
            self.__dict__.setdefault("kvspec_dropped", set()).add(request_id)
            return None
        return orig(self, request_id, *args, **kwargs)

    return _do_start_push_kv


OFFLOADING_SCHED = (
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
    "OffloadingConnectorScheduler"
)


def _alloc_always_recorded(orig: Any) -> Any:
    def update_state_after_alloc(
        self: Any, request: Any, blocks: Any, num_external_tokens: int
    ) -> Any:
        # vllm 0.33.0's fix of #46951 (offloading/scheduler.py:1354-1359): every allocated
        # block is recorded for the reuse fence before 0.32's body, whose early return at
        # num_external_tokens == 0 (1149-1150) skips another child's async load.
        for group_blocks in blocks.blocks:
            self._current_batch_allocated_block_ids.update(
                b.block_id for b in group_blocks if b.block_id != 0
            )
        return orig(self, request, blocks, num_external_tokens)

    return update_state_after_alloc


PATCHES: dict[str, Patch] = {
    p.name: p
    for p in [
        Patch(
            "fix-53903",
            "remove the filter in NixlBaseConnector.get_transfer_results that clears "
            "finished_sending on replicated PCP ranks > 0 (nixl/connector.py:254-259, "
            "kv_role == 'kv_producer' and pcp_rank > 0 and not pcp_dcp_sharded; it "
            "re-entered with PR #53781): positive control, variant fixed",
            f"{CONNECTOR}.get_transfer_results",
            "#53903",
            _without_replica_filter,
        ),
        Patch(
            "push-lease-check",
            "NixlPushConnectorWorker._do_start_push_kv drops a WRITE of a request its "
            "rank's reaper already reported (a WRITE parked on the handshake with D, "
            "push_worker.py:247-252, 457-481, would read freed blocks): proposed fix, "
            "KVClock PushLeaseCheck",
            f"{PUSH_WORKER}._do_start_push_kv",
            "NoWriteFromFreed (kvspec finding, 2026-12-06)",
            _lease_checked_push,
        ),
        Patch(
            "fix-46951",
            "OffloadingConnectorScheduler.update_state_after_alloc records every allocated "
            "block before its early return at 0 external tokens, as vllm 0.33.0 does: "
            "positive control, DecodeBlocks Offload fence-all",
            f"{OFFLOADING_SCHED}.update_state_after_alloc",
            "#46951",
            _alloc_always_recorded,
        ),
    ]
}


def get_patch(name: str) -> Patch:
    try:
        return PATCHES[name]
    except KeyError:
        raise KeyError(
            f"unknown impl patch {name!r}; known: {', '.join(sorted(PATCHES))}"
        ) from None
