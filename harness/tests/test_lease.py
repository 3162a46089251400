"""The lease-clock sweep (spec/LeaseClock.tla, kvspec.lease): the matrix loads, bad input
is one line and exit 2, and TLC's verdicts on a safe and an unsafe row are the expected
ones (the unsafe one is the negative control: the checker does find a free under a READ)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvspec.cli import main
from kvspec.lease import MATRIX, LeaseMatrixError, check_lease_row, load_lease_matrix

ROWS = {r.name: r for r in load_lease_matrix()}


def test_matrix_rows_cover_the_sweep_and_fast_rows_exist() -> None:
    assert {"wait80s-hb-ok", "wait80s-3-lost", "two-leases-early-break"} <= set(ROWS)
    assert any(r.tier == "fast" for r in ROWS.values())
    # vLLM's ratios: heartbeat every lease/6, extension 2/3 of the lease (base_worker.py:532)
    for r in ROWS.values():
        assert r.ints["HbEvery"] * 6 == r.ints["Lease"]
        assert r.ints["Extend"] * 3 == r.ints["Lease"] * 2


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[[row]]\nname = "a"\nqmax = -1\n', "qmax must be a non-negative integer"),
        ('[[row]]\nname = "a"\nqmax = 1\nbogus = 1\n', "unknown key(s) bogus"),
        ("[[row]]\nqmax = 1\n", "needs a name"),
        ('[[row]]\nname = "a"\nqmax = 1\nrmax = 1\nexpect = {Foo = "holds"}\n', "expect {'Foo'"),
    ],
)
def test_bad_matrix_is_one_line_and_exit_2(
    tmp_path: Path, text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    head = MATRIX.read_text().split("[[row]]")[0]
    bad = tmp_path / "m.toml"
    bad.write_text(head + text)
    with pytest.raises(LeaseMatrixError, match=None) as exc:
        load_lease_matrix(bad)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert main(["lease", "--matrix", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err


@pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")
@pytest.mark.parametrize("name", ["wait80s-hb-ok", "wait80s-3-lost"])
def test_tlc_verdicts_are_the_expected_ones(name: str, tmp_path: Path) -> None:
    row = ROWS[name]
    res = check_lease_row(row, tmp_path)
    assert res.unexpected == [], res.verdicts
    if res.verdicts["NoFreeUnderRead"] == "violated":
        # the shortest counterexample: the lease expires and P frees while D has yet to
        # read (#21570: D then reads freed blocks) or is reading
        doc = json.loads((tmp_path / name / "NoFreeUnderRead.itf.json").read_text())
        last = doc["states"][-1]
        assert last["#meta"]["action"] == "reap"
        assert last["p"] == ["freed"] and last["d"][0] in ("queued", "reading")


def test_a_tlc_timeout_is_inconclusive_never_a_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvspec import sweep
    from kvspec.tlc import TLCResult

    def timed_out(*_a: object, **_k: object) -> TLCResult:  # a TLC that ran out of time
        return TLCResult("timeout", None, None, None, None, 300.0, None, tmp_path, None)

    monkeypatch.setattr(sweep, "run_tlc", timed_out)
    res = check_lease_row(ROWS["wait80s-3-lost"], tmp_path)
    assert set(res.verdicts.values()) == {"timeout"}
    assert res.unexpected == [] and sorted(res.inconclusive) == sorted(res.verdicts)
