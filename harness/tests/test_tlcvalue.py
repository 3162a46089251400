"""TLC value parser/printer: exact parses of TLC output, round trips, big inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvspec.tlcvalue import (
    Fn,
    ModelValue,
    Record,
    TLCValueError,
    Value,
    make_fn,
    parse_state,
    parse_value,
    state_to_tla,
    to_tla,
)

# Verbatim from TLC 2.15 (harness/tests/specs/Values.tla, initial-state violation).
TLC_STATE = r"""/\ str = "q\"uo\\te"
/\ mv = m1
/\ f = (m1 :> "x" @@ m2 :> <<1, -2>>)
/\ q = <<>>
/\ r = [a |-> 1, b |-> {m1, m2}]
/\ s = {[k |-> 1], [k |-> 2]}
/\ big = -1073741824
"""


def test_parse_tlc_state() -> None:
    m1, m2 = ModelValue("m1"), ModelValue("m2")
    assert parse_state(TLC_STATE) == {
        "str": 'q"uo\\te',
        "mv": m1,
        "f": Fn(((m1, "x"), (m2, (1, -2)))),
        "q": (),
        "r": Record.of({"a": 1, "b": frozenset({m1, m2})}),
        "s": frozenset({Record.of({"k": 1}), Record.of({"k": 2})}),
        "big": -1073741824,
    }


def test_single_variable_state_without_conjunction() -> None:
    assert parse_state("x = 3\n") == {"x": 3}
    assert state_to_tla({"x": 3}) == "x = 3"


def test_model_value_is_not_a_string() -> None:
    v = parse_value("m1")
    assert isinstance(v, ModelValue) and v != "m1"


def test_scalars() -> None:
    assert parse_value("TRUE") is True
    assert parse_value("FALSE") is False
    assert parse_value("-12345678901234567890123") == -12345678901234567890123
    assert parse_value(r'"a\nb\tc\"d\\e"') == 'a\nb\tc"d\\e'
    assert parse_value("1..3") == frozenset({1, 2, 3})
    assert parse_value("{}") == frozenset()


def test_function_normalisation_matches_tlc() -> None:
    # TLC prints functions on 1..n as sequences and on strings as records.
    assert parse_value('(1 :> "a" @@ 2 :> "b")') == ("a", "b")
    assert parse_value('("a" :> 1)') == Record.of({"a": 1})
    assert make_fn([]) == ()
    # @@ is left-biased: the first mapping of a key wins.
    assert parse_value("(3 :> 1 @@ 3 :> 2)") == Fn(((3, 1),))


def test_whitespace_and_newlines_anywhere() -> None:
    text = "[ a\n |->\n  << 1 ,\n 2 >> ,\n b |-> { }\n ]"
    assert parse_value(text) == Record.of({"a": (1, 2), "b": frozenset()})


@pytest.mark.parametrize(
    "bad", ["", "{1,", "<<1 2>>", "[a 1]", "(1 :> )", '"\\q"', "1 2", "[a |-> 1, a |-> 2]", "#"]
)
def test_rejects_malformed(bad: str) -> None:
    with pytest.raises(TLCValueError):
        parse_value(bad)


def test_5000_pair_function_and_set() -> None:
    n = 5000
    text = "(" + " @@ ".join(f"{-i} :> <<{i}>>" for i in range(n)) + ")"
    fn = parse_value(text)
    assert isinstance(fn, Fn) and len(fn.pairs) == n and fn[-4999] == (4999,)
    assert parse_value(to_tla(fn)) == fn
    s = parse_value("{" + ", ".join(str(i) for i in range(n)) + "}")
    assert s == frozenset(range(n))


def test_deep_nesting_is_not_recursive() -> None:
    depth = 3000  # deeper than Python's default recursion limit
    text = "<<" * depth + "1" + ">>" * depth
    v = parse_value(text)
    assert to_tla(v) == text


def test_printer_is_deterministic() -> None:
    v = frozenset({ModelValue("b"), ModelValue("a")})
    assert to_tla(v) == "{a, b}"
    assert to_tla(frozenset({10, 2, -3})) == "{-3, 2, 10}"
    assert to_tla(Record.of({"z": 1, "a": 2})) == "[a |-> 2, z |-> 1]"


# ---------------------------------------------------------------- round trips

from tests_values import ident, values  # noqa: E402


@settings(max_examples=300)
@given(values)
def test_round_trip(v: Value) -> None:
    assert parse_value(to_tla(v)) == v


@settings(max_examples=100)
@given(st.dictionaries(ident, values, min_size=1, max_size=4))
def test_state_round_trip(state: dict[str, Value]) -> None:
    assert parse_state(state_to_tla(state)) == state
