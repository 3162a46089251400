"""A decode engine's KV blocks under asynchronous scheduling (spec/DecodeBlocks.tla,
kvspec.blocks; vLLM #45357): the matrix covers both designs, both policies and every
scheduling depth; bad input is one line and exit 2; TLC's verdicts on the fast rows are the
expected ones (0.32's deferred frees hold, freeing at once under async scheduling fails:
the negative control), and a mutated fence in the spec flips a verdict."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from kvspec.blocks import BLOCKS
from kvspec.sweep import Sweep, check_sweep_row, load_sweep_matrix
from sweep_checks import assert_bad_matrix_is_one_line_and_exit_2

ROWS = {r.name: r for r in load_sweep_matrix(BLOCKS)}
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")


def test_the_matrix_has_each_design_at_each_depth_and_known_bad_rows_fail() -> None:
    seen = {(r.consts["Design"], r.consts["Batches"]) for r in ROWS.values()}
    assert {("defer", 2), ("at-once", 1), ("at-once", 2), ("at-once", 3), ("defer", 3)} <= seen
    assert {r.consts["Policy"] for r in ROWS.values()} == {"fcfs", "priority"}
    for r in ROWS.values():
        if r.consts["Design"] == "defer":  # 0.32 as shipped holds everywhere
            assert r.expect["NoStaleWriteUnderRead"] == "holds", r.name
    bad = [r for r in ROWS.values() if r.expect["NoStaleWriteUnderRead"] == "violated"]
    assert bad and all(r.consts["Design"] == "at-once" and r.consts["Batches"] > 1 for r in bad)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[[row]]\nname = "a"\ndesign = "nope"\n', "design must be one of"),
        ('[[row]]\nname = "a"\nrequests = 4\n', "requests must be 1 to 3"),
        ('[[row]]\nname = "a"\ngrow = 1\n', "grow must be true or false"),
    ],
)
def test_bad_matrix_is_one_line_and_exit_2(
    tmp_path: Path, text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_bad_matrix_is_one_line_and_exit_2(BLOCKS, text, needle, tmp_path, capsys)


@needs_java
@pytest.mark.parametrize("name", sorted(n for n, r in ROWS.items() if r.tier == "fast"))
def test_fast_rows_get_their_expected_verdicts(name: str, tmp_path: Path) -> None:
    res = check_sweep_row(BLOCKS, ROWS[name], tmp_path)
    assert res.inconclusive == [] and res.unexpected == [], res.verdicts


@needs_java
def test_the_at_once_counterexample_is_45357s_race(tmp_path: Path) -> None:
    # Step k+1 (scheduled before step k's output) still writes request 1's block when
    # step k's output finishes request 1; its block goes at once to remote request 2.
    res = check_sweep_row(BLOCKS, ROWS["async-at-once-stop"], tmp_path)
    assert res.verdicts["NoStaleWriteUnderRead"] == "violated"
    doc = json.loads((tmp_path / "async-at-once-stop" / "NoStaleWriteUnderRead.itf.json")
                     .read_text())  # fmt: skip
    acts = [s["#meta"].get("action") for s in doc["states"]]
    assert acts[-3:] == ["execute", "update", "schedule"] and acts.count("schedule") == 3
    last = doc["states"][-1]
    assert last["st"] == ["done", "wfrk"] and len(last["steps"]) == 2


@needs_java
def test_a_fence_dropped_from_the_spec_is_caught(tmp_path: Path) -> None:
    # Negative control of the shipped design: _request_blocks_can_be_freed without its
    # fence (always true) frees at once; the shipped row must then fail.
    text = BLOCKS.spec.read_text()
    fence = "now == {r \\in fin : ~Defer \\/ \\A j \\in Tokens(2) : r \\notin steps[j].batch}"
    assert fence in text
    spec = tmp_path / "spec" / BLOCKS.spec.name
    spec.parent.mkdir()
    spec.write_text(text.replace(fence, "now == fin"))
    sweep = replace(BLOCKS, spec=spec)
    assert isinstance(sweep, Sweep)
    row = replace(ROWS["async-defer-stop"], expect={"NoStaleWriteUnderRead": "holds"})
    res = check_sweep_row(sweep, row, tmp_path / "out")
    assert res.verdicts["NoStaleWriteUnderRead"] == "violated"
