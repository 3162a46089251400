"""run_tlc against real TLC on the fixture specs in harness/tests/specs/."""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import pytest
from kvspec.tlc import TLCResult, cfg_properties, interpret, parse_messages, run_tlc
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
