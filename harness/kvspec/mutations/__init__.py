"""Mutants: small, named bugs put into the installed vLLM to see if the traces catch them.

A `Mutant` is a `Patch` (kvspec.drivers.patches: one vLLM attribute replaced in memory,
undone exactly) plus its base design: the spec variant the unmutated code conforms to and
the impl patch that makes it so. The installed 0.32.0 conforms to `v0.30-shipped` as is;
mutants that only make sense once replicated PCP ranks report (e.g. "a replica reports
twice") use the base `fixed` under `fix-53903`.

The catalogue is `kvspec.mutations.catalogue.MUTANTS`; the replacement functions live in
`nixl` (the NIXL connector's worker, facade and scheduler side) and `engine` (the
scheduler, the output aggregator, MultiConnector). Mutants are drawn from the public bug
history of KV-send completion (/work/shared/docs/vllm-kv-completion.md) and from the
accounting rules the spec encodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvspec.drivers.patches import Patch, get_patch


@dataclass(frozen=True)
class Base:
    """The design a mutant is measured against: a spec variant and the impl patch under
    which the unmutated vLLM conforms to it (None: the installed code as is)."""

    variant: str
    impl_patch: str | None = None

    @property
    def name(self) -> str:
        return self.variant if self.impl_patch is None else f"{self.variant}+{self.impl_patch}"


SHIPPED = Base("v0.30-shipped")
FIXED = Base("fixed", "fix-53903")


@dataclass(frozen=True)
class Mutant:
    patch: Patch
    base: Base = SHIPPED
    # Set when no trace of the suite can kill it: why it is equivalent for this suite and
    # which spec/trace extension would kill it.
    equivalent_because: str | None = None
    # The traces that measure it: "producer" (KVCompletion's, then LeaseClock's, then
    # Decode's), "decode" (Decode.tla's only: a decode-side bug) or "blocks"
    # (DecodeBlocks.tla's: the decode scheduler's block frees).
    family: str = "producer"
    # The decode conformance rows that measure a decode mutant (empty: the fast tier),
    # for a bug only a shape outside it shows (hetero TP: conf-decode-p1-d2-fail).
    decode_rows: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.patch.name


@contextmanager
def patched(base: Base, mutant: Patch | None = None) -> Iterator[None]:
    """The base's impl patch, then the mutant's; undone in reverse order."""
    undo_base = get_patch(base.impl_patch).apply() if base.impl_patch else None
    try:
        undo = mutant.apply() if mutant is not None else None
        try:
            yield
        finally:
            if undo is not None:
                undo()
    finally:
        if undo_base is not None:
            undo_base()
