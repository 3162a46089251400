"""run_tlc against real TLC on the fixture specs in harness/tests/specs/."""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import pytest
from kvspec.tlc import TLCResult, Trace, cfg_properties, interpret, parse_messages, run_tlc
from kvspec.tlc_continue import complete_reports, reported
from kvspec.tlcvalue import Fn, ModelValue, Record

SPECS = Path(__file__).parent / "specs"

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")


def tlc(name: str, tmp_path: Path, **kw: object) -> TLCResult:
    result = run_tlc(SPECS / f"{name}.tla", log_dir=tmp_path, **kw)  # type: ignore[arg-type]
    assert result.log_path.is_file()
    if result.error is not None:
        assert "\n" not in result.error and str(result.log_path) in result.error
    return result


def test_invariant_violation(tmp_path: Path) -> None:
    r = tlc("Counter", tmp_path)
    assert (r.verdict, r.violated_property, r.exit_code) == ("violated", "Small", 12)
    assert r.counterexample is not None
    states = r.counterexample.states
    assert [s.values for s in states] == [{"x": 0}, {"x": 1}, {"x": 2}, {"x": 3}]
    assert [s.action for s in states] == ["Initial predicate", "Incr", "Incr", "Incr"]
    assert states[1].action_location == "line 5, col 9 to line 5, col 18 of module Counter"
    assert r.counterexample.loop_index is None and not r.counterexample.stuttering
    assert (r.distinct_states, r.generated_states) == (4, 4)
    assert r.tlc_version == "2.15 (rev d5b5a7f)"
    assert r.error is None


def test_lasso_loop_index(tmp_path: Path) -> None:
    r = tlc("Lasso", tmp_path)
    assert (r.verdict, r.violated_property, r.exit_code) == ("violated", "Reach9", 13)
    assert r.counterexample is not None
    assert [s.values["x"] for s in r.counterexample.states] == [0, 1, 2, 3]
    assert r.counterexample.loop_index == 1  # 3 -> back to the state x = 1
    assert not r.counterexample.stuttering


def test_stuttering(tmp_path: Path) -> None:
    r = tlc("Stutter", tmp_path, deadlock=False)
    assert (r.verdict, r.violated_property) == ("violated", "Done")
    assert r.counterexample is not None and r.counterexample.stuttering
    assert r.counterexample.loop_index is None
    assert r.counterexample.states[-1].values == {"x": 1, "y": "a"}


def test_deadlock_and_no_deadlock(tmp_path: Path) -> None:
    r = tlc("Deadlock", tmp_path)
    assert (r.verdict, r.exit_code) == ("deadlock", 11)
    assert r.counterexample is not None
    assert [s.values["x"] for s in r.counterexample.states] == [0, 1, 2]
    ok = tlc("Deadlock", tmp_path, deadlock=False)
    assert (ok.verdict, ok.exit_code, ok.error) == ("holds", 0, None)
    assert ok.distinct_states == 3


def test_values_in_initial_state_violation(tmp_path: Path) -> None:
    r = tlc("Values", tmp_path)
    assert (r.verdict, r.violated_property) == ("violated", "Never")
    assert r.counterexample is not None and len(r.counterexample.states) == 1
    v = r.counterexample.states[0].values
    m1, m2 = ModelValue("m1"), ModelValue("m2")
    assert v["f"] == Fn(((m1, "x"), (m2, (1, -2))))
    assert v["r"] == Record.of({"a": 1, "b": frozenset({m1, m2})})
    assert v["str"] == 'q"uo\\te' and v["mv"] == m1 and v["big"] == -(2**30)


def test_syntax_error_location(tmp_path: Path) -> None:
    r = tlc("SyntaxError", tmp_path)
    assert (r.verdict, r.exit_code) == ("error", 150)
    assert r.error is not None
    assert r.error.startswith(f"{SPECS / 'SyntaxError.tla'}:5:20: parse error")


def test_undefined_identifier_location(tmp_path: Path) -> None:
    r = tlc("Undefined", tmp_path)
    assert (r.verdict, r.exit_code) == ("error", 150)
    assert r.error is not None
    assert r.error.startswith(f"{SPECS / 'Undefined.tla'}:5:18: Unknown operator: `y'.")


def test_unknown_name_in_cfg(tmp_path: Path) -> None:
    r = tlc("UnknownName", tmp_path)
    assert (r.verdict, r.exit_code) == ("error", 151)
    assert r.error is not None
    assert r.error.startswith(f"unknown name in cfg {SPECS / 'UnknownName.cfg'}: NoSuchInvariant")


def test_missing_cfg(tmp_path: Path) -> None:
    r = tlc("Counter", tmp_path, config=tmp_path / "nope.cfg")
    assert (r.verdict, r.exit_code) == ("error", 255)
    assert r.error is not None and r.error.startswith("bad or missing cfg")


def test_assert_failed(tmp_path: Path) -> None:
    r = tlc("AssertFail", tmp_path)
    assert (r.verdict, r.exit_code) == ("error", 75)
    assert r.error is not None
    assert r.error.startswith(f'{SPECS / "AssertFail.tla"}:5:12: Assert failed: "x got too big"')


def test_assume_false(tmp_path: Path) -> None:
    r = tlc("AssumeFalse", tmp_path)
    assert (r.verdict, r.exit_code) == ("error", 10)
    assert r.error is not None and r.error.startswith(f"{SPECS / 'AssumeFalse.tla'}:4:8:")


def test_bad_option(tmp_path: Path) -> None:
    r = tlc("Counter", tmp_path, extra_args=["-bogus"])
    assert (r.verdict, r.exit_code) == ("error", 1)
    assert r.error is not None and "-bogus" in r.error


FOREVER = """---- MODULE Forever ----
EXTENDS Naturals
VARIABLE x
Init == x = 0
Next == x' = x + 1
====
"""


def test_timeout_kills(tmp_path: Path) -> None:
    # An unbounded state space: TLC never finishes, so the timeout decides, however fast
    # or loaded the machine is; the process group is killed (SIGKILL), not waited for.
    (tmp_path / "Forever.tla").write_text(FOREVER)
    (tmp_path / "Forever.cfg").write_text("INIT Init\nNEXT Next\n")
    r = run_tlc(tmp_path / "Forever.tla", log_dir=tmp_path / "runs", timeout_s=1)
    assert (r.verdict, r.exit_code) == ("timeout", -signal.SIGKILL)
    assert r.error == f"TLC timed out after {r.seconds:.1f}s; raw log: {r.log_path}"


def test_simulation(tmp_path: Path) -> None:
    r = tlc("Counter", tmp_path, simulate=(3, 5))
    assert (r.verdict, r.violated_property) == ("violated", "Small")
    ok = tlc("Deadlock", tmp_path, simulate=(3, 5), deadlock=False)
    assert ok.verdict == "holds"


def test_dump_dot(tmp_path: Path) -> None:
    dot = tmp_path / "g.dot"
    r = tlc("Deadlock", tmp_path, deadlock=False, dump_dot=dot)
    assert r.verdict == "holds"
    text = dot.read_text()
    assert 'label="x = 2"' in text and 'label="Next"' in text


def test_concurrent_runs_do_not_collide(tmp_path: Path) -> None:
    results: list[TLCResult] = []
    threads = [
        threading.Thread(target=lambda: results.append(tlc("Counter", tmp_path))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [r.verdict for r in results] == ["violated"] * 3
    assert len({r.log_path for r in results}) == 3


# ---------------------------------------------------------------- pure parsing


def _msg(code: int, body: str, level: int = 0) -> str:
    return f"@!@!@STARTMSG {code}:{level} @!@!@\n{body}\n@!@!@ENDMSG {code} @!@!@\n"


def test_exit_zero_without_success_is_not_holds(tmp_path: Path) -> None:
    text = _msg(2262, "TLC2 Version 2.15 of Day Month 20?? (rev: d5b5a7f)") + _msg(
        3002, "Parsing or semantic analysis failed.", 1
    )
    r = interpret(text, 0, SPECS / "X.tla", SPECS / "X.cfg", tmp_path / "log", 0.1)
    assert r.verdict == "error"


def test_killed_by_signal_and_oom(tmp_path: Path) -> None:
    log = tmp_path / "tlc.log"
    r = interpret("", -9, SPECS / "X.tla", SPECS / "X.cfg", log, 1.0)
    assert r.verdict == "error" and r.error == f"TLC was killed by signal 9; raw log: {log}"
    oom = "Exception in thread main java.lang.OutOfMemoryError: Java heap space\n"
    r = interpret(oom, 1, SPECS / "X.tla", SPECS / "X.cfg", log, 1.0)
    assert r.error == (f"TLC ran out of memory (raise -Xmx via KVSPEC_TLC_XMX); raw log: {log}")


def test_nested_messages() -> None:
    text = (
        "@!@!@STARTMSG 1000:1 @!@!@\nouter\n: @!@!@STARTMSG 2132:0 @!@!@\ninner\n"
        "@!@!@ENDMSG 2132 @!@!@\n@!@!@ENDMSG 1000 @!@!@\nloose\n"
    )
    msgs, loose = parse_messages(text)
    assert [(m.code, m.body) for m in msgs] == [(1000, "outer\n: "), (2132, "inner\n")]
    assert loose == "loose\n"


def test_temporal_name_needs_single_property() -> None:
    assert cfg_properties("SPECIFICATION Spec\nPROPERTY P \\* c\n") == ["P"]
    assert cfg_properties("PROPERTIES P Q\nINVARIANT I") == ["P", "Q"]


# ---------------------------------------------------------------- -continue and stop

GRID = """---- MODULE Grid ----
EXTENDS Naturals
VARIABLES x, y
Init == x = 0 /\\ y = 0
Next == /\\ x + y < {bound}
        /\\ \\/ x' = x + 1 /\\ y' = y
           \\/ y' = y + 1 /\\ x' = x
SmallX == x < 2
SmallY == y < 3
Fresh == x + y < 1
Moved == x + y > 0
Right == x > 0
====
"""


def grid(tmp_path: Path, invariants: str, bound: str = "4", **kw: object) -> TLCResult:
    """Grid.tla (x, y count up; `bound` caps x + y, "9999999" leaves it unbounded for
    TLC) with these invariants, under -continue."""
    (tmp_path / "Grid.tla").write_text(GRID.format(bound=bound))
    (tmp_path / "Grid.cfg").write_text(f"INIT Init\nNEXT Next\nINVARIANTS {invariants}\n")
    kw.setdefault("extra_args", ["-continue"])
    return run_tlc(tmp_path / "Grid.tla", log_dir=tmp_path / "runs", deadlock=False, **kw)  # type: ignore[arg-type]


def xy(trace: Trace | None) -> list[tuple[object, object]]:
    assert trace is not None
    return [(s.values["x"], s.values["y"]) for s in trace.states]


def test_continue_reports_each_invariant_once_with_its_first_trace(tmp_path: Path) -> None:
    r = grid(tmp_path, "SmallX SmallY")
    # Exit code 0 and the success message despite the violations: the verdict comes from
    # the violation reports; the whole state space was explored.
    assert (r.verdict, r.exit_code, r.error, r.complete) == ("violated", 0, None, True)
    assert list(r.violations) == ["SmallX", "SmallY"] and r.violated_property == "SmallX"
    assert xy(r.violations["SmallX"]) == [(0, 0), (1, 0), (2, 0)]  # BFS: a shortest one
    assert xy(r.violations["SmallY"]) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert r.counterexample == r.violations["SmallX"]
    # One report (with a whole trace) per violating state: x >= 2 or y >= 3, x + y <= 4.
    reports = [m for m in parse_messages(r.log_path.read_text())[0] if m.code == 2110]
    assert len(reports) == 9


def test_continue_names_a_state_after_its_first_violated_invariant(tmp_path: Path) -> None:
    # Every state but the initial one violates Fresh, so SmallX (listed after it) is
    # never named although it is violated: a missing name is no verdict.
    r = grid(tmp_path, "Fresh SmallX")
    assert (r.verdict, list(r.violations), r.complete) == ("violated", ["Fresh"], True)


def test_continue_initial_state_reports_every_violated_invariant(tmp_path: Path) -> None:
    r = grid(tmp_path, "Moved Right SmallX", stop=reported(["Moved", "Right"]))
    assert list(r.violations)[:2] == ["Moved", "Right"]
    assert xy(r.violations["Moved"]) == xy(r.violations["Right"]) == [(0, 0)]


def test_stop_ends_an_endless_run_once_each_invariant_is_reported(tmp_path: Path) -> None:
    # Unbounded: TLC would run until the timeout; only the stop predicate can end it, so
    # the outcome does not depend on how fast the machine is.
    r = grid(tmp_path, "SmallX SmallY", bound="9999999", timeout_s=120,
             stop=reported(["SmallX", "SmallY"]))  # fmt: skip
    assert (r.verdict, r.error, r.complete) == ("violated", None, False)
    assert xy(r.violations["SmallX"]) == [(0, 0), (1, 0), (2, 0)]
    assert xy(r.violations["SmallY"]) == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_complete_means_every_state_was_checked(tmp_path: Path) -> None:
    # A temporal violation found in the complete graph (-lncheck final: only there) comes
    # after a BFS that checked every invariant; an invariant violation stops the BFS.
    lasso = tlc("Lasso", tmp_path, extra_args=["-lncheck", "final"])
    assert (lasso.verdict, lasso.complete, lasso.violations) == ("violated", True, {})
    counter = tlc("Counter", tmp_path)
    assert (counter.verdict, counter.complete, list(counter.violations)) == (
        "violated", False, ["Small"],
    )  # fmt: skip
    assert tlc("Deadlock", tmp_path, deadlock=False).complete


def test_stopped_run_keeps_only_complete_reports(tmp_path: Path) -> None:
    state = "/\\ x = {}\n"
    text = (
        _msg(2110, "Invariant A is violated.", 1)
        + _msg(2217, "1: <Initial predicate>\n" + state.format(0))
        + _msg(2217, "2: <Next line 1, col 1 to line 1, col 2 of module M>\n" + state.format(1))
        + _msg(2110, "Invariant B is violated.", 1)
        + _msg(2217, "1: <Initial predicate>\n" + state.format(0))
    )  # B's trace may go on: TLC was killed while printing it
    r = interpret(text, -9, SPECS / "X.tla", SPECS / "X.cfg", tmp_path / "log", 1.0, stopped=True)
    assert (r.verdict, r.error, list(r.violations)) == ("violated", None, ["A"])
    assert [s.values for s in r.violations["A"].states] == [{"x": 0}, {"x": 1}]  # type: ignore[union-attr]
    assert complete_reports(text) == ["A"]
    assert complete_reports(text + _msg(2199, "counts")) == ["A", "B"]


def test_reported_waits_for_every_name_or_runs_out_of_patience() -> None:
    def reports(*names: str) -> str:
        return "".join(_msg(2110, f"Invariant {n} is violated.", 1) for n in names) + _msg(
            2186, "Finished"
        )

    assert not reported(["A", "B"])(reports("A"))
    assert reported(["A", "B"])(reports("A", "B"))
    assert reported(["A", "B"], patience=2)(reports("A", "A", "A"))  # B: masked or rare
    assert not reported(["A", "B"], patience=2)(reports("A", "A"))
    assert not reported(["A"])("")
