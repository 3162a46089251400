"""One test per conformance trace (generated under build/traces/, plus the committed
regressions under conformance/regressions/): replay it on the selected driver and compare
every observed state with the trace's.

A failure names its class (missing action / unexpected action / incorrect state), the
step, the action, the differing variables and a one-line replay command.

A trace whose wait expired (a READ or notification slower than the driver's limit, e.g. on
a loaded machine) is replayed again with longer waits; if every attempt times out the test
is SKIPPED, its reason naming the wait: a timeout is neither a pass nor a divergence.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from conftest import layout_refusal, replay_extra
from kvspec.conform import DriverFactory, replay_retrying
from kvspec.replay import load_trace, replay_command
from kvspec.traces import sample_per_model, trace_files

BIG, KEEP = 500, 100


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "trace_path" not in metafunc.fixturenames:
        return
    paths = trace_files(metafunc.config.getoption("--variant"))
    per_model = metafunc.config.getoption("--per-model")
    if per_model is not None:
        paths = sample_per_model(paths, per_model)
    # A model with more than BIG traces (the two-request rows) keeps an even sample of
    # KEEP in `make test`; the rest are marked slow (`make test-full`, nightly).
    sizes = Counter(p.parent for p in paths)
    big = [p for p in paths if sizes[p.parent] > BIG]
    fast = set(sample_per_model(big, KEEP)) | {p for p in paths if sizes[p.parent] <= BIG}
    params = [p if p in fast else pytest.param(p, marks=pytest.mark.slow) for p in paths]
    ids = [f"{p.parent.name}/{p.name.removesuffix('.itf.json')}" for p in paths]
    metafunc.parametrize("trace_path", params, ids=ids)


def test_trace(
    trace_path: Path, make_driver: DriverFactory, driver_name: str, request: pytest.FixtureRequest
) -> None:
    trace = load_trace(trace_path)
    refusal = layout_refusal(request.config, trace.row)
    if refusal is not None:
        pytest.skip(refusal)
    result = replay_retrying(make_driver, trace)
    if result.timeout is not None:
        # Neither a pass nor a failure: the clock, not vLLM's state, stopped every attempt.
        pytest.skip(f"{result.timeout.format(trace.name)} ({result.attempts} attempts)")
    if result.failure is not None:
        cmd = replay_command(trace.name, driver_name, replay_extra(request.config))
        pytest.fail(result.failure.format(trace.name, cmd), pytrace=False)
