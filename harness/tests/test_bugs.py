"""`kvspec bugs`: the bug index (spec/bugs.toml) is checked against the matrices it cites,
so a claim "row X catches bug Y" is the matrix's own expected verdict (which TLC decides in
the sweeps' tests); doctored entries are refused, each for its own reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvspec.bugs import (
    INDEX,
    REPO,
    Bug,
    BugIndexError,
    Evidence,
    bug_problems,
    bugs_context,
    load_index,
    missing_from_index,
    observed_verdicts,
    parse_index,
    run_says,
)
from kvspec.cli import main

ROWS = {"decode": {"bug-x": {"P": "violated"}, "fixed": {"P": "holds"}}}
HISTORY = REPO.parent / "shared" / "docs" / "bug-history.md"


def _rows(matrix: str) -> dict[str, dict[str, str]]:
    return ROWS[matrix]


def _bug(**kw: object) -> Bug:
    base: dict[str, object] = dict(
        ids=["#1234"], engine="vllm", side="decode", what="w", status="caught", line=3,
        caught=[Evidence("decode", "bug-x", "P", "violated")],
        controls=[Evidence("decode", "fixed", "P", "holds")])  # fmt: skip
    return Bug(**{**base, **kw})  # type: ignore[arg-type]


def _problems(bug: Bug, tmp: Path) -> list[str]:
    return bug_problems(bug, _rows, mutants=["m1"], recorded=tmp)


def test_the_committed_index_backs_every_claim_with_its_matrix() -> None:
    bugs = load_index()
    assert not [p for b in bugs for p in bug_problems(b)]
    assert {b.status for b in bugs} <= {"caught", "analogue", "expressed", "not-modelled",
                                        "out-of-scope"}  # fmt: skip
    assert sum(b.status == "caught" for b in bugs) >= 10  # most of the history fails a row


def test_every_number_of_the_bug_history_has_an_entry() -> None:
    if not HISTORY.is_file():
        pytest.skip(f"{HISTORY} is not on this machine (the index is checked above)")
    assert missing_from_index(load_index(), HISTORY.read_text()) == []


def test_a_sound_entry_has_no_problem(tmp_path: Path) -> None:
    assert _problems(_bug(), tmp_path) == []
    (tmp_path / "pd-x").mkdir()
    assert _problems(_bug(status="expressed", caught=[], controls=[], recorded=["pd-x"]),
                     tmp_path) == []  # fmt: skip


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"controls": [Evidence("decode", "fixed", "P", "violated")]},
         "the matrix expects holds for P"),
        ({"caught": [Evidence("decode", "nope", "P", "violated")]}, "has no row 'nope'"),
        ({"caught": [Evidence("nope", "bug-x", "P", "violated")]}, "no matrix 'nope'"),
        ({"controls": []}, "no control row where P holds"),
        ({"caught": [Evidence("decode", "fixed", "P", "holds")]}, "needs a row expecting"),
        ({"mutants": ["m2"]}, "no mutant 'm2'"),
        ({"recorded": ["pd-gone"]}, "no recording 'pd-gone'"),
        ({"status": "not-modelled", "caught": [], "controls": []}, "needs a why"),
        ({"status": "expressed", "caught": [], "controls": []}, "needs rows, recordings"),
    ],
)  # fmt: skip
def test_a_doctored_entry_is_refused_for_its_reason(
    change: dict[str, object], says: str, tmp_path: Path
) -> None:
    """Negative controls: each claim the index makes is one the repository must back."""
    got = _problems(_bug(**change), tmp_path)
    assert any(says in p for p in got)
    assert all(p.startswith("bugs.toml:3 (#1234): ") for p in got)


def test_a_mutant_alone_makes_a_bug_caught(tmp_path: Path) -> None:
    assert _problems(_bug(caught=[], controls=[], mutants=["m1"]), tmp_path) == []


def test_a_malformed_entry_names_its_line() -> None:
    text = '[[bug]]\nids = ["#1"]\n'
    with pytest.raises(BugIndexError, match="ids must be a list like"):
        parse_index(text)
    text = '\n[[bug]]\nids = ["#12345"]\nside = "decode"\nstatus = "fixed"\n'
    with pytest.raises(BugIndexError, match=r"bugs.toml:3: status must be one of caught"):
        parse_index(text)
    text = '[[bug]]\nids = ["#12345"]\nside = "decode"\nstatus = "caught"\nrow = "x"\n'
    with pytest.raises(BugIndexError, match=r"unknown keys \['row'\]"):
        parse_index(text)


def test_the_command_exits_2_on_bad_input_and_1_on_a_missing_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bugs.toml"
    bad.write_text("[[bug]\n")
    assert main(["bugs", "--index", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fix the TOML syntax" in err[0]
    history = tmp_path / "history.md"
    history.write_text("- #46240 / #99999: a bug nobody indexed\n")
    out = tmp_path / "bugs.json"
    assert main(["bugs", "--index", str(INDEX), "--history", str(history),
                 "--json", str(out)]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "#99999 has no entry" in err and "#46240" not in err
    assert out.is_file()  # the results are written whatever the exit


def test_the_run_column_says_whether_this_runs_tlc_verdicts_back_the_entry() -> None:
    bug = _bug()
    assert run_says(bug, {}) == "not in this run"
    seen = {("decode", "bug-x", "P"): "violated"}
    assert run_says(bug, seen) == "confirmed (1 of 2 cited verdicts)"
    # Negative control: TLC saying otherwise of a cited row is shown, never hidden.
    seen[("decode", "fixed", "P")] = "violated"
    assert run_says(bug, seen) == "differs: decode:fixed P violated"
    assert run_says(_bug(caught=[], controls=[], mutants=["m1"]), seen) == "-"


def test_the_report_lists_the_index_against_the_reviews_verdicts(tmp_path: Path) -> None:
    import json

    from kvspec.report import build_report
    from kvspec.report_sweeps import sweeps_context

    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps([{"name": "p1-d1-lmcache-no-abort-2req",
                                   "verdicts": {"NoAssertCrash": "holds"}}]))  # fmt: skip
    none = tmp_path / "none.json"
    sweeps = sweeps_context(none, decode, tmp_path, none, none, none, none)
    obs = observed_verdicts([{"model": "m", "property": "NoStall", "verdict": "holds"}], sweeps)
    assert obs[("check", "m", "NoStall")] == "holds"
    build_report({"tlc": "x", "results": []}, None, None, None, {}, tmp_path, sweeps)
    md = (tmp_path / "REPORT.md").read_text()
    assert "## Public completion bugs" in md and "| #46240 #56089 | vllm | decode | caught |" in md
    # the doctored sweep (the finding row holding) shows as a difference on #46240's line
    line = next(x for x in md.splitlines() if x.startswith("| #46240 #56089 |"))
    assert "differs: decode:p1-d1-lmcache-no-abort-2req NoAssertCrash holds" in line
    assert "Public completion bugs" in (tmp_path / "index.html").read_text()


def test_an_unreadable_index_costs_the_report_only_its_section(tmp_path: Path) -> None:
    bad = tmp_path / "bugs.toml"
    bad.write_text("[[bug]\n")
    got = bugs_context({}, bad)
    assert got["rows"] is None and "fix the TOML syntax" in str(got["error"])


def _readme_counts(text: str) -> dict[str, int]:
    """README's status table ("| caught | 16 | ...") as status -> count."""
    import re

    rows = re.finditer(r"^\| (caught|analogue|expressed|not modelled)[^|]*\| (\d+) \|", text, re.M)
    return {m[1].replace("not modelled", "not-modelled"): int(m[2]) for m in rows}


def test_the_readme_counts_are_the_index_counts() -> None:
    """README's status table says what the index says: a bug moved between statuses (as
    #46951 was, to caught) must move there too. Negative control: a README whose caught
    count is one off is told apart."""
    readme = (REPO / "README.md").read_text()
    table = _readme_counts(readme)
    assert set(table) == {"caught", "analogue", "expressed", "not-modelled"}
    bugs = load_index()
    assert table == {s: sum(b.status == s for b in bugs) for s in table}
    n = table["caught"]
    doctored = readme.replace(f"| caught | {n} |", f"| caught | {n + 1} |", 1)
    assert doctored != readme and _readme_counts(doctored) != table
