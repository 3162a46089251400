"""DecodeBlocks' offload child (spec/DecodeBlocks.tla `Offload`; vLLM #46951): the kept
counterexample of 0.32's design is exactly the race step drivers.offload_fence drives; on
the real classes the installed 0.32 child does not flush the pending store before the READ
(the bug, live in 0.32), and with 0.33's fix applied in memory it does (the negative
control, which the probe must tell apart); `kvspec blocks --offload-probe` says so, exits 1
when the matrix's design for the release differs, and never turns an undecided probe into
a design."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from kvspec import blocks_traces
from kvspec.blocks import BLOCKS
from kvspec.blocks_traces import REGRESSIONS, offload_fence_of, why_not_driven
from kvspec.cli import main
from kvspec.sweep import load_sweep_matrix

ROWS = {r.name: r for r in load_sweep_matrix(BLOCKS)}
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")
KEPT = REGRESSIONS / "sync-offload-0.32-stop-NoStoreOfReusedBlock.itf.json"


def _set(v: Any) -> set[int]:
    return set(v["#set"])


def test_the_kept_counterexample_is_the_race_the_probe_drives() -> None:
    states = json.loads(KEPT.read_text())["states"]
    assert [s["#meta"]["action"] for s in states[1:]] == [
        "schedule", "execute", "update", "schedule", "execute"]  # fmt: skip
    done, admitted, race = states[3], states[4], states[5]
    assert done["st"][0] == "done" and _set(done["sto"][0])  # 1 stopped, its store pending
    step = admitted["steps"][-1]
    assert admitted["st"][1] == "wfrk" and _set(step["recv"]) == {2}
    assert _set(admitted["dst"][1]) & _set(admitted["sto"][0])  # 2's READ fills 1's block
    assert _set(step["fl"]) == set()  # 0.32's child did not see that allocation
    assert race["clob"] is True and admitted["clob"] is False  # the READ is posted: clobbered


def test_the_matrix_gives_each_release_its_fence() -> None:
    assert offload_fence_of("0.32.0") == "fence-scheduled"
    assert offload_fence_of("0.33.0") == offload_fence_of("0.34.0") == "fence-all"
    offload = {n: r for n, r in ROWS.items() if r.consts["Offload"] != "none"}
    assert offload
    for name, row in offload.items():
        release = "0.32.0" if "-0.32-" in name else "0.33.0"
        assert row.consts["Offload"] == offload_fence_of(release), name
        violated = row.expect.get("NoStoreOfReusedBlock") == "violated"
        # the bug needs a READ into the freed block: a remote request
        assert violated == (row.consts["Offload"] == "fence-scheduled"
                            and row.requests > int(row.consts["NLocal"])), name  # fmt: skip
        if int(row.consts["Batches"]) != 1 or row.consts["Grow"]:
            assert "--offload-probe" in str(why_not_driven(row, "0.32.0"))
        else:  # replayed where the row's fence is the release's
            mine = "0.32.0" if "-0.32-" in name else "0.34.0"
            other = "0.34.0" if mine == "0.32.0" else "0.32.0"
            assert why_not_driven(row, mine) is None
            assert "offload child is" in str(why_not_driven(row, other))


@pytest.mark.vllm
def test_the_real_032_child_does_not_flush_and_the_fix_does() -> None:
    from kvspec.conform import installed_vllm
    from kvspec.drivers.offload_fence import probe

    for batches, caching in ((1, False), (2, True)):  # sync; vLLM's defaults
        got = probe(batches=batches, prefix_caching=caching)
        assert got.store_blocks & got.load_blocks  # the READ's block is the pending store's
        assert got.design == offload_fence_of(installed_vllm())
        fixed = probe(fixed=True, batches=batches, prefix_caching=caching)  # fix-46951
        assert fixed.flushed and fixed.design == "fence-all"


@pytest.mark.vllm
def test_the_cli_says_which_design_and_exits_1_when_the_matrix_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "probe.json"
    assert main(["blocks", "--offload-probe", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["design"] == doc["expected"] and "as the matrix says" in capsys.readouterr().out
    assert set(doc["engines"]) == {"sync", "async+prefix-caching"}
    other = "fence-all" if doc["design"] == "fence-scheduled" else "fence-scheduled"
    monkeypatch.setattr(blocks_traces, "offload_fence_of", lambda version: other)
    # the same real outcome again, without building the engines a second time
    from kvspec.drivers import offload_fence

    seen = offload_fence.FenceProbe(frozenset({1}), frozenset({1}), doc["design"] == "fence-all")
    monkeypatch.setattr(offload_fence, "probe", lambda **_: seen)
    assert main(["blocks", "--offload-probe"]) == 1
    assert f"the matrix says {other!r}" in capsys.readouterr().out


def test_an_undecided_probe_is_no_design(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    from kvspec import conform
    from kvspec.drivers import offload_fence
    from kvspec.drivers.vllm_env import DriverUnavailable

    def undecided(batches: int = 1, **_: Any) -> Any:
        if batches == 1:  # one engine decides, the other cannot: still no design
            return offload_fence.FenceProbe(frozenset({1}), frozenset({1}), False)
        raise DriverUnavailable("undecided: request 2 got another block")

    monkeypatch.setattr(conform, "installed_vllm", lambda: "0.32.0")
    monkeypatch.setattr(offload_fence, "probe", undecided)
    out = tmp_path / "probe.json"
    assert main(["blocks", "--offload-probe", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["design"] is None and "another block" in doc["undecided"]
    assert "undecided" in capsys.readouterr().out


def _offload_driver(fixed: bool) -> Any:
    from kvspec.drivers.blocks_offload import OffloadBlocksDriver

    patch = "fix-46951" if fixed else None
    return lambda row, plan: OffloadBlocksDriver(row, prompts=plan.prompts, impl_patch=patch)


@pytest.mark.vllm
@needs_java
@pytest.mark.parametrize("layout", ["stop", "pd"])
def test_the_offload_rows_replay_on_the_real_child_and_the_fix_is_told_apart(
    tmp_path: Path, layout: str
) -> None:
    """Every edge-covering trace of the one-batch rows on 0.32's real scheduler and
    MultiConnector(NIXL, OffloadingConnector) ("stop": a local request's block reused;
    "pd": every request P/D, with the child's default prompt-only stores): 0.32's row
    conforms (the race replayed: most traces end clobbered); with fix-46951 applied its
    traces diverge at the flush and the 0.33 row conforms instead; the shipped 0.32 child
    diverges from the 0.33 row (the negative controls). One TLC run per row serves both
    drivers."""
    from kvspec.blocks_traces import replay_row
    from kvspec.lease_traces import _edges, edge_traces, lease_graph

    def traces(name: str) -> tuple[Any, list[Any], int]:
        g = lease_graph(BLOCKS, ROWS[name], tmp_path / name)
        return ROWS[name], edge_traces(g, ROWS[name]), len(_edges(g))

    row32, docs32, edges32 = traces(f"sync-offload-0.32-{layout}")
    res = replay_row(row32, docs32, edges32, _offload_driver(False))
    assert res.conforming >= 10 and res.divergences == [], res.divergences
    assert sum(d["states"][-1]["clob"] for d in docs32) >= 5  # the race, replayed
    fixed = replay_row(row32, docs32, edges32, _offload_driver(True))
    assert len(fixed.divergences) > fixed.conforming
    assert all("fl: spec" in d for d in fixed.divergences), fixed.divergences
    row33, docs33, edges33 = traces(f"sync-offload-0.33-{layout}")
    ok = replay_row(row33, docs33, edges33, _offload_driver(True))
    assert ok.conforming >= 3 and ok.divergences == [], ok.divergences
    shipped = replay_row(row33, docs33, edges33, _offload_driver(False))
    assert shipped.divergences


@pytest.mark.vllm
def test_the_kept_counterexample_replays_to_the_race_on_032() -> None:
    from kvspec.blocks_traces import replay_regression

    got = replay_regression(KEPT, ROWS)
    assert got.divergence is None and got.steps == 5
    fixed = replay_regression(KEPT, ROWS, _offload_driver(True))
    assert fixed.steps == 4 and "fl: spec (frozenset(),), vLLM (frozenset({1}),)" in str(
        fixed.divergence)  # fmt: skip


@pytest.mark.vllm
@needs_java
def test_the_campaign_kills_the_offload_fence_mutant() -> None:
    """A child that forgets the scheduled requests' blocks (the scheduled twin of #46951)
    no longer flushes where 0.32 does, at a promotion: the one-batch 0.32 row's traces
    catch it."""
    from kvspec.mutants import run_mutant
    from kvspec.mutations.catalogue import MUTANTS

    out = run_mutant(MUTANTS["offload-scheduled-unseen"])
    assert out.killed and out.trace is not None, out
    assert out.trace.startswith("sync-offload-0.32-stop/"), out.trace
