"""Decode.tla's traces on vLLM's real decode engine (drivers/decode_driver.py): the
installed 0.32 conforms step for step, a corrupted trace diverges where it was corrupted
(the negative control of the comparison), and each decode-side bug of the history,
re-introduced in memory, is killed by a trace."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvspec.decode_traces import replay, replay_with_retry, suite  # noqa: E402
from kvspec.drivers.decode_driver import DecodeDriver  # noqa: E402
from kvspec.mutants import run_mutant  # noqa: E402
from kvspec.mutations.catalogue import MUTANTS  # noqa: E402

DECODE_MUTANTS = sorted(n for n, m in MUTANTS.items() if m.family == "decode")


def _traces(row: str) -> list[tuple[str, object, list[tuple[str, dict[str, object]]]]]:
    return [t for t in suite("full") if t[0].startswith(f"{row}/")]


@pytest.mark.parametrize(
    "row",
    [
        "conf-decode-d1-fail",
        pytest.param("conf-decode-d1-multi", marks=pytest.mark.slow),
        pytest.param("conf-decode-d1-fail-sync", marks=pytest.mark.slow),
        pytest.param("conf-decode-d1-recompute", marks=pytest.mark.slow),
        pytest.param("conf-decode-d2-fail", marks=pytest.mark.slow),
    ],
)
def test_the_installed_decode_engine_conforms(row: str) -> None:
    traces = _traces(row)
    assert traces
    inconclusive = []
    for name, srow, trace in traces:
        # A wait that expires twice is inconclusive (a loaded machine), never a verdict.
        res = replay_with_retry(trace, lambda srow=srow: DecodeDriver(srow))  # type: ignore[misc]
        assert res.divergence is None, (name, res)
        if res.timeout is not None:
            inconclusive.append(f"{name}: {res.timeout}")
    if inconclusive:
        pytest.skip(f"inconclusive (waits expired): {'; '.join(inconclusive[:3])}")


def test_negative_control_a_wrong_state_diverges() -> None:
    name, row, trace = next(t for t in _traces("conf-decode-d1-fail") if len(t[2]) > 4)
    bad = copy.deepcopy(trace)
    bad[3][1]["crashed"] = True
    with DecodeDriver(row) as d:  # type: ignore[arg-type]
        res = replay(bad, d)
    assert res.divergence is not None and res.divergence.startswith("step 3"), (name, res)


@pytest.mark.parametrize("name", DECODE_MUTANTS)
def test_each_decode_mutant_is_killed(name: str) -> None:
    out = run_mutant(MUTANTS[name])
    assert out.killed and out.failure_class == "incorrect state", out
