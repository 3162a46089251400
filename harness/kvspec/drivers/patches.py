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
    ]
}


def get_patch(name: str) -> Patch:
    try:
        return PATCHES[name]
    except KeyError:
        raise KeyError(
            f"unknown impl patch {name!r}; known: {', '.join(sorted(PATCHES))}"
        ) from None
