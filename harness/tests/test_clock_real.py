"""KVClock's kept counterexamples (conformance/clock/) replayed on the real classes: in
vLLM 0.32 the producer engine frees a request's blocks while D has yet to READ them, step
for step as TLC found it (three heartbeat messages lost, #21570; TP 2 with every message
lost; PCP 2 with #53903's fix); in push mode (NixlPushConnector) it frees them under
its own WRITE of them, still in flight (every heartbeat lost, D's wait 30 s). Each also
with vLLM's prefix caching on and a prompt block shared (drivers/prefix_layout.py). Negative
control, in the one-block and the shared layout: where the reaper never reaps (mutant
`lease-never-expires`), the free at the trace's end cannot happen. A replay whose wait still
expires after its retry (clock_traces.replay_retrying) is skipped as inconclusive."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvspec.clock import CLOCK
from kvspec.clock_traces import (
    CLOCK_REGRESSIONS,
    clock_driver_factory,
    regression_row,
    replay_regression,
)
from kvspec.drivers.prefix_layout import LAYOUTS
from kvspec.sweep import load_sweep_matrix

ROWS = {r.name: r for r in load_sweep_matrix(CLOCK)}
KEPT = sorted(CLOCK_REGRESSIONS.glob("*.itf.json"))


def test_every_kept_counterexample_names_a_row() -> None:
    assert len(KEPT) >= 3
    for path in KEPT:
        assert regression_row(path, ROWS).expect["NoFreeUnderRead"] == "violated"


@pytest.mark.vllm
@pytest.mark.parametrize(
    "layout",
    # P laid out as vLLM runs by default (drivers/prefix_layout.py: prefix caching on, a
    # shared block) does not hide them; d-hit's nine replays (~12 s) run in make test-full
    ["one-block", "shared-prefix", pytest.param("shared-prefix-d-hit", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("path", KEPT, ids=lambda p: p.name.removesuffix(".itf.json"))
def test_the_free_before_the_read_happens_in_vllm(path: Path, layout: str) -> None:
    pytest.importorskip("nixl")
    make = clock_driver_factory(LAYOUTS[layout])
    res = replay_regression(path, regression_row(path, ROWS), make)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is None, res.divergence


@pytest.mark.vllm
@pytest.mark.parametrize("layout", ["one-block", "shared-prefix"])  # each layout's own control
@pytest.mark.parametrize("prefix", ["tp1-", "push-tp1-wait30s-"])
def test_negative_control_a_reaper_that_never_reaps_cannot_free(prefix: str, layout: str) -> None:
    pytest.importorskip("nixl")
    from kvspec.mutations import Base, patched
    from kvspec.mutations.catalogue import MUTANTS

    # the shipped design's, pull and push (push: the free under P's own WRITE)
    path = next(p for p in KEPT if p.name.startswith(prefix))
    make = clock_driver_factory(LAYOUTS[layout])
    with patched(Base("v0.30-shipped"), MUTANTS["lease-never-expires"].patch):
        res = replay_regression(path, regression_row(path, ROWS), make)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is not None
