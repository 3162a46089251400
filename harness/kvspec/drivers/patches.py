"""In-memory patches of the installed vLLM, applied by the vLLM driver on request.

A patch alters one vLLM function for the lifetime of a driver (`VllmDriver(...,
impl_patch=NAME)`): `apply()` installs it and returns the function that undoes it. The
driver applies it at start and undoes it at close, so a process can replay traces against
the shipped code and a patched one in turn.

`PATCHES` is the registry: name -> `Patch`. Positive controls (the intended upstream fix) and,
later, mutants for a mutation campaign are added here; each must name the vLLM function it
alters in `target` ("module:Class.method") so reports can say what was changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Patch:
    name: str
    description: str
    target: str  # the vLLM function it alters, "module:Qualified.name"
    apply: Callable[[], Callable[[], None]]  # installs the patch; returns the undo


def replace_attr(owner: Any, attr: str, new: Any) -> Callable[[], None]:
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


def _fix_53903() -> Callable[[], None]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
    )

    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        # As shipped, minus the filter that clears finished_sending on replicated
        # PCP ranks > 0: their _replicated_pcp_done_sending queue now reaches the
        # aggregator as soon as the metadata arrives (the intent of #53903).
        assert self.connector_worker is not None
        return self.connector_worker.get_transfer_results()

    return replace_attr(NixlBaseConnector, "get_transfer_results", get_transfer_results)


PATCHES: dict[str, Patch] = {
    "fix-53903": Patch(
        name="fix-53903",
        description=(
            "remove the pcp_rank > 0 filter in NixlBaseConnector.get_transfer_results, so "
            "replicated PCP ranks report their queued sends (positive control, variant fixed)"
        ),
        target=(
            "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector:"
            "NixlBaseConnector.get_transfer_results"
        ),
        apply=_fix_53903,
    ),
}


def get_patch(name: str) -> Patch:
    try:
        return PATCHES[name]
    except KeyError:
        raise KeyError(
            f"unknown impl patch {name!r}; known: {', '.join(sorted(PATCHES))}"
        ) from None
