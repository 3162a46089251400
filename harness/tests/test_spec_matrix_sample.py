"""A sample of the spec matrix's own traces on the real vLLM (issue #15, item 3).

The committed conformance rows cover a few percent of the spec matrix's edges per design
(`kvspec traces --spec-coverage`: fixed 3.8 %, v0.30-shipped 23.2 % on 2026-12-02); the
nightly job replays every spec-matrix trace. `make test` replays an even sample of a few
rows those conformance traces do not cover at all, one per composition the installed
designs run: generated from the model at test time (a second per row), not committed.
"""

from __future__ import annotations

import json

import pytest
from kvspec.conform import driver_factory, replay_retrying
from kvspec.matrix import DEFAULT_MATRIX, ModelRow, load_matrix
from kvspec.replay import SpecTrace, trace_from_doc
from kvspec.traces import generate_row

pytest.importorskip("vllm")
pytest.importorskip("nixl")

pytestmark = pytest.mark.vllm

PER_ROW = 8
# (spec/matrix.toml row, vLLM driver patch): the designs the installed 0.32 is (as shipped)
# and becomes with the #53903 fix; rows none of whose edges a conformance trace replays
# (2026-12-02), one per composition and shape.
ROWS = (
    ("pcp1-tp1-v0.30-shipped-nixl", None),
    ("pcp1-tp1-v0.30-shipped-offload-upstream", None),
    ("pcp1-tp2-v0.30-shipped-nixl", None),
    ("pcp2-v0.30-shipped-nixl", None),
    ("pcp1-tp1-fixed-nixl-sync", "fix-53903"),
    ("pcp2-tp1-fixed-hf3fs", "fix-53903"),
    ("pcp2-fixed-nixl-push", "fix-53903"),
    ("pcp2-tp2-fixed-nixl", "fix-53903"),
)


def _row(name: str) -> ModelRow:
    return next(r for r in load_matrix(DEFAULT_MATRIX) if r.name == name)


def _even(items: list[str], n: int) -> list[str]:
    return items if len(items) <= n else [items[i * len(items) // n] for i in range(n)]


def _sample(name: str) -> list[SpecTrace]:
    row = _row(name)
    cov, files = generate_row(row)
    assert cov.skipped is None and cov.covered == cov.edges  # the whole row's edges
    return [trace_from_doc(json.loads(files[f]), f"{name}/{f}")
            for f in _even(sorted(files), PER_ROW)]  # fmt: skip


@pytest.mark.parametrize(("name", "patch"), ROWS, ids=[r for r, _ in ROWS])
def test_a_sample_of_the_spec_rows_traces_conforms(name: str, patch: str | None) -> None:
    make = driver_factory("vllm", impl_patch=patch)
    inconclusive: list[str] = []
    for trace in _sample(name):
        got = replay_retrying(make, trace)
        if got.timeout is not None:  # the clock stopped it: no verdict either way
            inconclusive.append(got.timeout.format(trace.name))
            continue
        assert got.failure is None, got.failure.format(trace.name, "")
    if inconclusive:
        pytest.skip(f"inconclusive: {inconclusive[0]}")


def test_negative_control_the_fixed_rows_sample_diverges_on_0_32_as_shipped() -> None:
    # Without fix-53903, 0.32's PCP replicas report as v0.30-shipped: the sample of a
    # fixed PCP 2 row must not all replay (the sample can tell the designs apart).
    make = driver_factory("vllm")
    for trace in _sample("pcp2-tp1-fixed-nixl"):
        got = replay_retrying(make, trace)
        if got.failure is not None:
            return
    pytest.fail("every sampled fixed trace replayed on the unpatched vLLM")
