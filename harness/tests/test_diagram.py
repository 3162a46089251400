"""kvspec.counterexample and kvspec.diagram on real TLC counterexamples of spec/KVCompletion.tla.

Fixtures (harness/tests/fixtures/cex/) are TLC counterexamples as `kvspec check` saves them
(each step's action instance in `#meta.action`, the row's constants and the property in the
document's `#meta`):
* cex_live_v030_pcp2: Variant v0.30-shipped, nixl, TP=1 PP=1 PCP=2, NReq=2, Capacity=1,
  PROPERTIES DelayedEventuallyFreed, --no-deadlock: a 12-state lasso back to state 9 in
  which request 1 waits forever for PCP rank 1's finished_sending.
* cex_safety_fixed_hf3fs: Variant fixed, multi-nixl-hf3fs, PCP=1, NReq=1,
  AsyncScheduling, INVARIANTS NoFreeWhileInFlight: 9 states; step 2 was scheduled before
  request 1 finished, so it carries no extra_async_saves, and NIXL's report of the READ
  in it frees request 1 while its HF3FS save is still in flight.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from kvspec.counterexample import analyze, diff_values, rank_name
from kvspec.diagram import render_steps, render_svg
from kvspec.matrix import ModelRow, Topology
from kvspec.tlcvalue import Fn, Record

FIX = Path(__file__).parent / "fixtures" / "cex"
SVG = "{http://www.w3.org/2000/svg}"
PCP2 = {"tp": 1, "pp": 1, "pcp": 2}
PCP1 = {"tp": 1, "pp": 1, "pcp": 1}


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIX / f"{name}.itf.json").read_text())
    return doc


@pytest.fixture
def live() -> dict[str, Any]:
    return load("cex_live_v030_pcp2")


@pytest.fixture
def safe() -> dict[str, Any]:
    return load("cex_safety_fixed_hf3fs")


def groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if cls in (g.get("class") or "").split()]


def texts(el: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in el.iter(f"{SVG}text")]


def row_top(root: ET.Element, step: int) -> float:
    g = next(g for g in groups(root, "step") if g.get("data-step") == str(step))
    bg = next(r for r in g.iter(f"{SVG}rect") if r.get("class") == "row-bg")
    return float(bg.get("y", "nan"))


def test_live_lasso_lanes_rows_loop_and_stuck(live: dict[str, Any]) -> None:
    root = ET.fromstring(render_svg(live, topology=PCP2, prop="DelayedEventuallyFreed"))
    lanes = groups(root, "lane")
    assert [g.get("data-lane") for g in lanes] == [
        "scheduler",
        "aggregator",
        "rank:0",
        "rank:1",
        "consumer",
        "offload",
    ]
    labels = [texts(g)[0] for g in lanes]
    assert "rank 0 (tp0 pp0 pcp0)" in labels and "rank 1 (tp0 pp0 pcp1)" in labels
    steps = groups(root, "step")
    assert [int(g.get("data-step", "-1")) for g in steps] == list(range(len(live["states"])))
    assert len(steps) == 12
    assert [g.get("data-action") for g in steps][:6] == [
        "init",
        "abort",
        "schedule",
        "execute_model",
        "update_from_output",
        "consumer_start_load_kv",
    ]
    (loop,) = groups(root, "loop-marker")
    assert loop.get("data-loop") == str(live["loop"]) == "9"
    assert "loop back to step 9" in texts(loop)
    # the loop band starts at the row of step 9
    band = next(loop.iter(f"{SVG}rect"))
    assert float(band.get("y", "nan")) == row_top(root, 9)
    (stuck,) = groups(root, "stuck-marker")
    assert texts(stuck) == [
        "stuck: req 1 sending, agg remaining=1, waiting: [rank 1 (tp0 pp0 pcp1)]"
    ]
    assert not groups(root, "violation-marker")


def test_execute_model_arrows_from_every_rank(live: dict[str, Any]) -> None:
    root = ET.fromstring(render_svg(live, topology=PCP2))
    step8 = next(g for g in groups(root, "step") if g.get("data-step") == "8")
    arrows = [e for e in step8.iter(f"{SVG}line") if e.get("class") == "arrow"]
    assert len(arrows) == 2  # one per rank, both to the aggregator
    assert "finished_sending {1}" in texts(step8) and "finished_sending {}" in texts(step8)
    step5 = next(g for g in groups(root, "step") if g.get("data-step") == "5")
    assert "READ 1" in texts(step5)
    step6 = next(g for g in groups(root, "step") if g.get("data-step") == "6")
    assert "notif 1:1" in texts(step6)


def test_safety_counterexample_violation_box(safe: dict[str, Any]) -> None:
    root = ET.fromstring(render_svg(safe, topology=PCP1, prop="NoFreeWhileInFlight"))
    assert len(groups(root, "lane")) == 5
    assert len(groups(root, "step")) == 9
    assert not groups(root, "loop-marker") and not groups(root, "stuck-marker")
    (box,) = groups(root, "violation-marker")
    assert texts(box) == [
        "violated: NoFreeWhileInFlight: req 1 freed while its HF3FS save is in flight on "
        "rank 0 (tp0 pp0 pcp0)"
    ]
    step3 = next(g for g in groups(root, "step") if g.get("data-step") == "3")
    assert "save 1 on ranks {0}" in texts(step3)
    step8 = next(g for g in groups(root, "step") if g.get("data-step") == "8")
    assert "free 1" in texts(step8)


def test_render_steps_one_line_per_step(live: dict[str, Any]) -> None:
    lines = render_steps(live, topology=PCP2)
    n = len(live["states"])
    assert len(lines) == n + 2  # + loop line + stuck line
    assert lines[5].split()[:4] == ["5", "consumer_start_load_kv", "r=1", "w=0"]
    assert "rd[1][0]: none -> inflight" in lines[5]
    assert lines[9].startswith("*  9 update_from_output")  # the loop target is starred
    assert lines[n].strip() == "(loop back to step 9)"
    assert lines[n + 1].strip().startswith("stuck: req 1 sending")
    assert all(line.isascii() for line in lines)


def test_action_parameters_come_from_the_annotated_actions(live: dict[str, Any]) -> None:
    a = analyze(live)
    assert (a.steps[5].action, a.steps[5].r, a.steps[5].w) == ("consumer_start_load_kv", 1, 0)
    assert a.steps[5].label == "consumer_start_load_kv(r=1, w=0)"
    assert a.steps[1].label == "abort(r=2)" and a.steps[4].label == "update_from_output"


def test_bare_operator_names_have_no_parameters(live: dict[str, Any]) -> None:
    """TLC's own output (`kvspec tlc --itf`) names the operator only."""
    doc = copy.deepcopy(live)
    for st in doc["states"]:
        st["#meta"]["action"] = st["#meta"]["action"].partition("(")[0]
    a = analyze(doc)
    assert (a.steps[5].action, a.steps[5].r, a.steps[5].w) == ("consumer_start_load_kv", None, None)
    assert [s.action for s in a.steps] == [s.action for s in analyze(live).steps]
    assert a.final == analyze(live).final


def test_topology_and_property_from_meta(live: dict[str, Any], safe: dict[str, Any]) -> None:
    assert render_svg(live) == render_svg(live, topology=PCP2, prop="DelayedEventuallyFreed")
    assert analyze(safe).final[0].startswith("violated: NoFreeWhileInFlight: req 1 freed")
    doc = copy.deepcopy(safe)
    del doc["#meta"]["property"], doc["#meta"]["topology"]
    assert analyze(doc).final[0].startswith("violated: req 1 freed while its HF3FS save")
    assert analyze(doc).final[0].endswith("on rank 0")


def _mutated(base: dict[str, Any], action: str, **changes: Any) -> dict[str, Any]:
    st = copy.deepcopy(base)
    st["#meta"] = {"action": action, "index": 0, "location": ""}
    st.update(changes)
    return st


def test_heartbeat_lease_expire_store_complete_abort(safe: dict[str, Any]) -> None:
    s4 = safe["states"][4]  # req 1 sending, store[0] = {1}, lease empty
    one = {"#map": [[0, {"#set": [1]}]]}
    none = {"#map": [[0, {"#set": []}]]}
    states = [
        s4,
        _mutated(s4, "heartbeat(1)", hb={"#set": [1]}),
        _mutated(s4, "lease_expire(1, 0)", hb={"#set": [1]}, lease=one, expired=one),
        _mutated(
            s4,
            "store_complete(1, 0)",
            hb={"#set": [1]},
            lease=one,
            expired=one,
            store=none,
            stored=one,
        ),
    ]
    doc = {"#meta": {}, "vars": safe["vars"], "states": states}
    a = analyze(doc, topology=PCP1)
    hb, le, sc = a.steps[1], a.steps[2], a.steps[3]
    assert (hb.r, hb.events[0].kind, hb.events[0].src) == (1, "arrow", "consumer")
    assert hb.events[0].text == "HB:1 (all ranks)"
    assert (le.r, le.w, le.events[0].kind, le.events[0].text) == (1, 0, "mark", "lease 1 expired")
    assert (sc.r, sc.w, sc.events[0].src, sc.events[0].text) == (
        1,
        0,
        "rank:0",
        "HF3FS: save 1 done",
    )
    root = ET.fromstring(render_svg(doc, topology=PCP1))
    assert len([p for p in root.iter(f"{SVG}polygon") if p.get("class") == "mark"]) == 1
    # abort of a waiting request
    s0 = safe["states"][0]
    doc2 = {
        "states": [
            s0,
            _mutated(s0, "abort(1)", req=["freed"], notProc={"#set": [1]}),
        ]
    }
    ab = analyze(doc2).steps[1]
    assert (ab.r, ab.events[0].text) == (1, "abort 1")


def test_stuttering_lasso(safe: dict[str, Any]) -> None:
    doc = copy.deepcopy(safe)
    doc["states"] = doc["states"][:5]  # ends with req 1 sending
    doc["loop"] = 4
    doc["#meta"]["stuttering"] = True
    root = ET.fromstring(render_svg(doc, topology=PCP1))
    (loop,) = groups(root, "loop-marker")
    assert "stutters forever at step 4" in texts(loop)
    (stuck,) = groups(root, "stuck-marker")
    assert (
        texts(stuck)[0] == "stuck: req 1 sending, agg: no entry, waiting: [rank 0 (tp0 pp0 pcp0)]"
    )


def test_rank_names_follow_vllm_layout() -> None:
    # TP innermost: tp = w % TP, pcp = (w // TP) % PCP, pp = w // (TP * PCP).
    topo = Topology(tp=2, pp=2, pcp=2)
    assert [rank_name(topo, w) for w in (0, 1, 2, 3, 4, 7)] == [
        "rank 0 (tp0 pp0 pcp0)",
        "rank 1 (tp1 pp0 pcp0)",
        "rank 2 (tp0 pp0 pcp1)",
        "rank 3 (tp1 pp0 pcp1)",
        "rank 4 (tp0 pp1 pcp0)",
        "rank 7 (tp1 pp1 pcp1)",
    ]
    assert rank_name(None, 3) == "rank 3"


def test_diff_values() -> None:
    assert diff_values("s", frozenset({1}), frozenset({2})) == ["s +{2} -{1}"]
    assert diff_values("f", Fn(((0, "a"),)), Fn(((0, "b"),))) == ["f[0]: a -> b"]
    assert diff_values("q", (1,), (1, 2)) == ["q append 2"]
    assert diff_values("q", (1, 2), (2,)) == ["q pop head"]
    assert diff_values("r", Record.of({"x": 1, "y": 2}), Record.of({"x": 1, "y": 3})) == [
        "r.y: 2 -> 3"
    ]
    assert diff_values("b", False, True) == ["b: FALSE -> TRUE"]


def test_svg_is_deterministic_and_escapes(live: dict[str, Any]) -> None:
    assert render_svg(live) == render_svg(live)
    inline = render_svg(live, standalone=False, title="<a & b>")
    assert "xmlns" not in inline and "&lt;a &amp; b&gt;" in inline
    ET.fromstring(render_svg(live, title="<a & b>"))  # well-formed


def test_rejects_non_traces() -> None:
    with pytest.raises(ValueError, match="no 'states'"):
        analyze({"states": []})


@pytest.mark.skipif(shutil.which("java") is None, reason="java not installed (TLC needs it)")
def test_fresh_tlc_lasso_has_loop_and_stuck(tmp_path: Path) -> None:
    """A liveness counterexample straight from TLC (they vary run to run: structure only)."""
    spec = Path(__file__).resolve().parents[2] / "spec" / "KVCompletion.tla"
    (tmp_path / "KVCompletion.tla").write_text(spec.read_text())
    cfg = tmp_path / "live.cfg"
    # The row's own cfg writer, so a new spec constant cannot leave this test behind.
    row = ModelRow("live", "v0.30-shipped", "nixl", Topology(1, 1, 2), 1, 1, False)
    cfg.write_text(row.cfg_text([], ["DelayedEventuallyFreed"]))
    itf = tmp_path / "cex.itf.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvspec.cli",
            "tlc",
            str(tmp_path / "KVCompletion.tla"),
            "--config",
            str(cfg),
            "--no-deadlock",
            "--itf",
            str(itf),
            "--timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=tmp_path,
    )
    if proc.returncode == 2 and "jar" in proc.stderr.lower():
        pytest.skip(f"TLC unavailable: {proc.stderr.strip()}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(itf.read_text())
    root = ET.fromstring(render_svg(doc, topology=PCP2, prop="DelayedEventuallyFreed"))
    assert len(groups(root, "step")) == len(doc["states"])
    (loop,) = groups(root, "loop-marker")
    assert loop.get("data-loop") == str(doc["loop"])
    (stuck,) = groups(root, "stuck-marker")
    assert texts(stuck)[0].startswith("stuck: req 1 sending")
