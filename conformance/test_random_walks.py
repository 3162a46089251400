"""Hypothesis random walks: random spec actions, then fair steps until quiescent.

A walk is drawn over the reference model's enabled actions (so every step is one the spec
allows), then completed with the fair actions the engine and the world must eventually
take (schedule, execute_model, update_from_output, store_complete, lease_expire,
consumer_get_finished) until the fair-only run revisits a state (quiescence: nothing but
empty engine steps is left). The walk is then replayed on the selected driver with the
same comparison as the trace suite. Examples persist in the repo's .hypothesis/ and
generation uses a fixed seed, so a failure reproduces on the next run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DriverFactory, layout_refusal
from hypothesis import HealthCheck, given, reject, seed, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action, Model, initial_state
from kvspec.replay import replay, trace_from_actions

REPO = Path(__file__).resolve().parents[1]
# Priority order of the fair completion: the world first (reads complete, stores finish,
# leases run out), then the engine loop; an engine cycle that changes nothing revisits a
# state, which is how quiescence is detected.
FAIR = ("consumer_get_finished", "store_complete", "lease_expire", "schedule", "execute_model",
        "update_from_output")  # fmt: skip
MAX_RANDOM = 25
MAX_FAIR = 60

D, U = "multi-nixl-hf3fs", "multi-nixl-offload-upstream"
ROWS = [
    ModelRow("walk-fixed-delaying-pcp2", "fixed", D, Topology(1, 1, 2), 2, 1, False),
    ModelRow("walk-shipped-nixl-pcp2", "v0.30-shipped", "nixl", Topology(1, 1, 2), 2, 1, False),
    ModelRow("walk-fixed-delaying-async", "fixed", D, Topology(1, 1, 1), 2, 1, True),
    ModelRow("walk-naive-upstream-pcp2", "naive-replicas", U, Topology(1, 1, 2), 2, 2, True),
    ModelRow("walk-v029-nixl-tp2-pcp2", "v0.29", "nixl", Topology(2, 1, 2), 1, 1, False),
    ModelRow("walk-shipped-delaying-pcp2", "v0.30-shipped", D, Topology(1, 1, 2), 2, 1, False),
    ModelRow("walk-shipped-upstream-tp2-async", "v0.30-shipped", U, Topology(2, 1, 1), 2, 1, True),
    ModelRow("walk-fixed-nixl-tp2-pcp2", "fixed", "nixl", Topology(2, 1, 2), 1, 1, False),
]


def fair_completion(model: Model, actions: list[Action]) -> list[Action]:
    """Fair steps after `actions` until the fair-only run revisits a state."""
    s = initial_state(model.row)
    for a in actions:
        nxt = model.apply(s, a)
        assert nxt is not None
        s = nxt
    seen = {s}
    tail: list[Action] = []
    for _ in range(MAX_FAIR):
        fair = [(a, t) for a, t in model.successors(s) if a.name in FAIR]
        if not fair:
            break
        # Deterministic priority: the first fair action in FAIR order, then by parameters.
        a, s = min(fair, key=lambda at: (FAIR.index(at[0].name), at[0]))
        tail.append(a)
        if s in seen:
            break
        seen.add(s)
    return tail


@st.composite
def walks(
    draw: st.DrawFn, rows: tuple[ModelRow, ...] = tuple(ROWS)
) -> tuple[ModelRow, list[Action]]:
    row = draw(st.sampled_from(rows))
    model = Model(row)
    s = initial_state(row)
    actions: list[Action] = []
    for _ in range(draw(st.integers(0, MAX_RANDOM))):
        succ = model.successors(s)
        if not succ:
            break
        a, s = draw(st.sampled_from(succ))
        actions.append(a)
    return row, actions + fair_completion(model, actions)


def _settings(request_driver: str) -> settings:
    return settings(
        # A fixed seed (below) rather than derandomize: derandomize disables the database.
        database=DirectoryBasedExampleDatabase(str(REPO / ".hypothesis" / "examples")),
        max_examples=10 if request_driver == "vllm" else 200,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def test_random_walks(
    make_driver: DriverFactory, driver_name: str, pytestconfig: pytest.Config
) -> None:
    # An implementation conforms to one design at a time: with --variant, walk only its
    # models (the vllm driver runs the installed vLLM, which follows one variant).
    variant = pytestconfig.getoption("--variant")
    rows = tuple(
        r
        for r in ROWS
        if (variant is None or r.variant == variant) and layout_refusal(pytestconfig, r) is None
    )
    if not rows:
        pytest.skip(f"no random-walk model of variant {variant} that --layout lays out")

    @seed(20260601)
    @_settings(driver_name)
    @given(walks(rows))
    def check(walk: tuple[ModelRow, list[Action]]) -> None:
        row, actions = walk
        trace = trace_from_actions(row, actions, f"{row.name}/walk")
        with make_driver(row) as driver:
            result = replay(driver, trace)
        if result.timeout is not None:  # a wait expired: this walk decides nothing
            timeouts.append(f"{result.timeout.what} ({result.timeout.limit_s}s)")
            reject()
        assert result.failure is None, result.failure.format(
            trace.name + " [" + ", ".join(map(str, actions)) + "]"
        )

    timeouts: list[str] = []
    check()
    if timeouts:
        pytest.skip(f"{len(timeouts)} walks inconclusive (waits expired): {timeouts[0]}")


def test_walks_reach_quiescence_and_free_requests() -> None:
    """The fair completion is not vacuous: on the fixed design every request ends freed."""
    row = ROWS[0]
    model = Model(row)
    tail = fair_completion(model, [])
    s = initial_state(row)
    for a in tail:
        nxt = model.apply(s, a)
        assert nxt is not None
        s = nxt
    assert s.req == ("freed", "freed")


@pytest.mark.parametrize("bad", ["drop-rank"])
def test_random_walks_negative_control(bad: str) -> None:
    """A broken driver fails some drawn walk (the walks exercise multi-rank reporting)."""
    from kvspec.drivers.broken import DropRankDriver

    failures: list[str] = []

    @settings(derandomize=True, max_examples=50, deadline=None, database=None)
    @given(walks())
    def check(walk: tuple[ModelRow, list[Action]]) -> None:
        row, actions = walk
        d = DropRankDriver(row)
        r = replay(d, trace_from_actions(row, actions, "neg"))
        if r.failure is not None:
            failures.append(r.failure.cls)

    check()
    assert failures and set(failures) == {"incorrect state"}
