"""`kvspec versions --scenario`: a release's real-engine scenarios are run in its venv and
read back from `kvspec scenario --json`; a run that outlives its bound is inconclusive,
one that wrote no JSON says why. Fake interpreters stand in for the release's python
(no vLLM, no engines); the timeout is decided by a fake that blocks, not by a race."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest
from kvspec.versions import scenarios


def _fake_python(tmp: Path, body: str) -> Path:
    py = tmp / "python"
    py.write_text("#!/bin/sh\n" + body + "\n")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def test_each_scenarios_verdict_is_read_from_the_releases_run(tmp_path: Path) -> None:
    doc = [{"name": "pd-basic", "verdict": "pass", "seconds": 91.0,
            "admitted": ["v0.29", "fixed"]},
           {"name": "pd-decode-kv-pressure", "verdict": "fail", "seconds": 68.0,
            "admitted": []}]  # fmt: skip
    # the fake writes the JSON where --json says (its last argument)
    py = _fake_python(tmp_path, f"for a; do last=$a; done; echo '{json.dumps(doc)}' > $last")
    got = scenarios(py, tmp_path, ["pd-basic", "pd-decode-kv-pressure"])
    assert got == {"pd-basic": "pass in 91.0 s, admitted by v0.29, fixed",
                   "pd-decode-kv-pressure": "fail in 68.0 s, admitted by none"}  # fmt: skip


def test_a_release_whose_run_blocks_is_inconclusive(tmp_path: Path) -> None:
    py = _fake_python(tmp_path, "exec sleep 600")
    got = scenarios(py, tmp_path, ["pd-basic"], timeout_s=0.2)
    assert got == {"pd-basic": "inconclusive: timed out after 0 s"}


def test_a_release_whose_run_breaks_is_a_failure_that_says_why(tmp_path: Path) -> None:
    py = _fake_python(tmp_path, "echo 'No module named vllm._C' >&2; exit 1")
    got = scenarios(py, tmp_path, ["pd-basic"])
    assert got == {"pd-basic": "failed (exit 1): No module named vllm._C"}


def test_the_decode_side_and_conform_share_the_runner(tmp_path: Path) -> None:
    """decode_side and conform go through the same runner: a blocking release is
    inconclusive, one that wrote no JSON says why, one that did gives its verdict."""
    from kvspec.versions import conform, decode_side

    blocks = _fake_python(tmp_path, "exec sleep 600")
    assert decode_side(blocks, tmp_path, timeout_s=0.2) == (
        "inconclusive: timed out after 0 s", None)  # fmt: skip
    dies = _fake_python(tmp_path, "echo 'Traceback: KeyError' >&2; exit 3")
    assert decode_side(dies, tmp_path) == ("failed (exit 3): Traceback: KeyError", None)
    got = conform("r", dies, tmp_path)
    assert (got.rc, got.error) == (3, "failed (exit 3): Traceback: KeyError")
    # exit 2 is the command's refusal (its driver cannot be built there): not driven
    refuses = _fake_python(tmp_path, "echo 'the vllm driver is unavailable' >&2; exit 2")
    assert decode_side(refuses, tmp_path) == ("not driven: the vllm driver is unavailable", None)
    doc = {"verdict": "conforms", "rows": {"a": 1}}
    says = _fake_python(tmp_path, f"for a; do last=$a; done; echo '{json.dumps(doc)}' > $last")
    assert decode_side(says, tmp_path) == ("conforms", {"a": 1})
    # It names the Decode.tla design(s) that admit every trace (0.29's is not 0.30+'s).
    doc = {"verdict": "conforms", "conforms_to": ["0.29"], "rows": {}}
    says = _fake_python(tmp_path, f"for a; do last=$a; done; echo '{json.dumps(doc)}' > $last")
    assert decode_side(says, tmp_path) == ("conforms to 0.29", {})


def test_the_blocks_side_names_the_first_divergence_or_the_traces_that_conform(
    tmp_path: Path,
) -> None:
    """`kvspec blocks --conform` in a release's venv (added when 0.34's replay found 0.33's
    running-loop change): its first divergence, else how many traces conform in which
    rows; a blocking release is inconclusive, never a verdict."""
    from kvspec.versions import blocks_side

    rows = [{"row": "async-defer-stop", "conforming": 15, "divergences": [],
             "inconclusive": []},
            {"row": "v2pp2-defer-preempt-priority", "conforming": 1933,
             "divergences": ["v2pp2-defer-preempt-priority/3914: step 18: batches"],
             "inconclusive": []}]  # fmt: skip
    says = _fake_python(tmp_path, f"for a; do last=$a; done; echo '{json.dumps(rows)}' > $last")
    assert blocks_side(says, tmp_path) == (
        "diverges: v2pp2-defer-preempt-priority/3914: step 18: batches")  # fmt: skip
    ok = _fake_python(tmp_path, f"for a; do last=$a; done; echo '{json.dumps(rows[:1])}' > $last")
    assert blocks_side(ok, tmp_path) == "conforms: 15 traces (async-defer-stop)"
    hangs = _fake_python(tmp_path, "exec sleep 600")
    assert blocks_side(hangs, tmp_path, timeout_s=0.2) == "inconclusive: timed out after 0 s"


def test_the_offload_side_says_the_real_childs_fence_or_why_there_is_none(
    tmp_path: Path,
) -> None:
    """`kvspec blocks --offload-probe` in a release's venv: the real child's fence and
    whether the matrix gives the release that design; an undecided probe or a blocking run
    is inconclusive, a refusal not driven, never a design."""
    from kvspec.versions import offload_side

    def says(doc: dict[str, object]) -> Path:
        return _fake_python(tmp_path, f"for a; do last=$a; done; echo '{json.dumps(doc)}' > $last")

    ok = {"design": "fence-all", "expected": "fence-all", "flushed": True}
    assert offload_side(says(ok), tmp_path) == "fence-all (as the matrix says)"
    off = {"design": "fence-all", "expected": "fence-scheduled"}
    assert offload_side(says(off), tmp_path) == (
        "differs: the real child is fence-all, the matrix says fence-scheduled")  # fmt: skip
    undecided = {"design": None, "expected": "fence-all", "undecided": "another block"}
    assert offload_side(says(undecided), tmp_path) == "inconclusive: another block"
    refuses = _fake_python(tmp_path, "echo 'no vLLM installed here' >&2; exit 2")
    assert offload_side(refuses, tmp_path) == "not driven: no vLLM installed here"
    hangs = _fake_python(tmp_path, "exec sleep 600")
    assert offload_side(hangs, tmp_path, timeout_s=0.2) == "inconclusive: timed out after 0 s"


def test_a_release_is_told_from_its_version_in_one_place() -> None:
    # versions.before: decode.release_design and blocks_traces.self_preempt_of use it; what
    # is not a release number is today's code, never older.
    from kvspec.blocks_traces import self_preempt_of
    from kvspec.decode import release_design
    from kvspec.versions import before

    assert before("0.29.0", (0, 30)) and not before("0.30.0", (0, 30))
    assert not before("not installed", (0, 30)) and not before("main", (0, 33))
    assert release_design("0.29.0") == "v0.29-register-all" and release_design("?") == "none"
    assert self_preempt_of("0.32.0") == "stop" and self_preempt_of("0.34.0") == "continue"


def test_versions_exits_1_when_a_run_breaks_and_0_when_a_release_diverges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A divergence is the command's report (0.29 diverges from 0.30+'s design); a side
    that broke (a traceback, a failed install) must turn the nightly red, a timeout not.
    Negative control: the same run with every side refusing or diverging exits 0."""
    import argparse

    from kvspec import versions

    doc = {"summary": ["v0.29: 3 diverging"], "variants": {}, "verdict": "diverges",
           "rows": {}}  # fmt: skip
    blocks = [{"row": "async-defer-stop", "conforming": 1, "divergences": []}]
    scen = [{"name": "pd-basic", "verdict": "pass", "seconds": 1.0, "admitted": []}]
    # $3 is the kvspec command (python -m kvspec.cli CMD ...): each reads its own JSON shape
    probe = {"design": "fence-scheduled", "expected": "fence-scheduled"}
    writes = (f"for a; do last=$a; done; case $3$4 in blocks--offload-probe) "
              f"echo '{json.dumps(probe)}';; blocks*) echo '{json.dumps(blocks)}';; "
              f"scenario*) echo '{json.dumps(scen)}';; *) echo '{json.dumps(doc)}';; esac > $last")
    args = argparse.Namespace(releases=["r"], out=tmp_path / "o", json=tmp_path / "v.json",
                              scenario=["pd-basic"], skip_conform=False)  # fmt: skip

    def run_with(body: str) -> tuple[int, list[dict[str, object]]]:
        py = _fake_python(tmp_path, body)
        monkeypatch.setattr(versions, "layered_venv", lambda *_a, **_k: py)
        return versions.run(args), json.loads(args.json.read_text())

    rc, rows = run_with(writes)
    assert rc == 0 and rows[0]["decode"] == "diverges"
    assert rows[0]["offload"] == "fence-scheduled (as the matrix says)"
    rc, rows = run_with("exit 2")
    assert rc == 0 and rows[0]["decode"] == "not driven: "
    rc, rows = run_with("echo 'Segmentation fault' >&2; exit 139")
    assert rc == 1 and rows[0]["scenarios"] == {"pd-basic": "failed (exit 139): Segmentation fault"}

    def no_install(*_a: object, **_k: object) -> Path:
        raise subprocess.CalledProcessError(1, ["pip"])

    monkeypatch.setattr(versions, "layered_venv", no_install)
    assert versions.run(args) == 1
    assert str(json.loads(args.json.read_text())[0]["error"]).startswith("failed (install)")
