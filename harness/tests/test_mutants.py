"""The mutation campaign: catalogue, exact undo, no false kill, and known kills."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from kvspec.drivers.patches import PATCHES
from kvspec.mutants import (
    EXTENSIONS,
    FIXED,
    MUTANTS,
    SHIPPED,
    Mutant,
    applied,
    extension_traces,
    run_mutant,
    unmutated,
)
from kvspec.replay import INCORRECT


def _owner(target: str) -> tuple[Any, str]:
    mod, _, qual = target.partition(":")
    obj: Any = importlib.import_module(mod)
    *path, attr = qual.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, attr


def _vllm() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")


def test_catalogue_is_well_formed() -> None:
    assert len(MUTANTS) >= 12
    for name, m in MUTANTS.items():
        assert m.name == name
        assert m.description and "\n" not in m.description
        mod, sep, qual = m.target.partition(":")
        assert sep and mod.startswith("vllm.") and "." in qual, m.target
        assert m.origin
        assert m.base in (SHIPPED, FIXED)
        if m.base[1] is not None:
            assert m.base[1] in PATCHES
    # the bug history the brief names is covered
    origins = " ".join(m.origin for m in MUTANTS.values())
    for bug in ("#58222", "#51786", "#25808", "#52779", "#53903", "#36549"):
        assert bug in origins


@pytest.mark.parametrize("variant", [SHIPPED[0], FIXED[0]])
def test_extension_traces_follow_the_spec(variant: str) -> None:
    traces = extension_traces(variant)  # raises if an action is not enabled in the spec
    assert [t.name.rsplit("/", 1)[1] for t in traces] == list(EXTENSIONS)
    assert all(len(t.states) == len(t.actions) + 1 for t in traces)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_apply_then_undo_restores_the_original(name: str) -> None:
    _vllm()
    m: Mutant = MUTANTS[name]
    owner, attr = _owner(m.target)
    before = vars(owner).get(attr)
    assert before is not None, f"{m.target} is not defined on {owner.__name__}"
    base_targets = [_owner(PATCHES[m.base[1]].target)] if m.base[1] else []
    base_before = [vars(o).get(a) for o, a in base_targets]
    with applied(m):
        assert vars(owner).get(attr) is not before, "the mutant changed nothing"
    assert vars(owner).get(attr) is before
    assert [vars(o).get(a) for o, a in base_targets] == base_before
    # and twice in a row (no state left behind by the first application)
    with applied(m):
        pass
    assert vars(owner).get(attr) is before


@pytest.mark.vllm
@pytest.mark.parametrize("base", [SHIPPED, FIXED], ids=lambda b: str(b[0]))
def test_unmutated_vllm_passes_the_extension_traces(base: tuple[str, str | None]) -> None:
    """No false kill. The committed traces of both bases already run on the unmutated
    vLLM in the conformance suite (make test); the campaign's own extension traces don't."""
    _vllm()
    trace, div, crash = unmutated(base)
    assert (trace, div, crash) == (None, None, ""), f"false kill on {trace}: {div} {crash}"


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("name", "trace_prefix", "step"),
    [
        # extension traces run first: the handshake set differs at Init
        ("handshake-published-by-replicas", "x-v0.30-shipped-nixl-pcp2-2req/", 0),
        # expected = world_size - 1: rank 0's single report frees the request
        ("agg-expected-minus-one", "x-v0.30-shipped-nixl-pcp2-2req/", None),
        # only the async extension trace reaches a read before the lease (#25808)
        ("notif-before-metadata-dropped", "x-v0.30-shipped-nixl-pcp2-async/", None),
    ],
)
def test_mutant_is_killed(name: str, trace_prefix: str, step: int | None) -> None:
    _vllm()
    out = run_mutant(MUTANTS[name])
    assert out.killed, f"{name} survived"
    assert out.failure_class == INCORRECT
    assert out.trace is not None and out.trace.startswith(trace_prefix), out.trace
    if step is not None:
        assert out.step == step
