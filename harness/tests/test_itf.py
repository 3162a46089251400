"""ITF encoding: exact JSON for each value kind, round trips, determinism."""

from __future__ import annotations

import json

from hypothesis import given, settings
from kvspec.itf import dumps, trace_from_itf, trace_to_itf, value_from_itf, value_to_itf
from kvspec.tlc import Trace, TraceState
from kvspec.tlcvalue import Fn, ModelValue, Record, Value
from tests_values import values


def test_value_encoding() -> None:
    assert value_to_itf(5) == 5
    assert value_to_itf(2**53) == {"#bigint": str(2**53)}
    assert value_to_itf(-(2**53) + 1) == -(2**53) + 1
    assert value_to_itf(frozenset({3, 1})) == {"#set": [1, 3]}
    assert value_to_itf((1, "a")) == [1, "a"]
    assert value_to_itf(Record.of({"b": 1, "a": True})) == {"a": True, "b": 1}
    assert value_to_itf(Fn(((ModelValue("m"), 1),))) == {"#map": [[{"#unserializable": "m"}, 1]]}
    assert value_from_itf({"#tup": [1, 2]}) == (1, 2)
    assert value_from_itf({"#map": [[2, "b"], [1, "a"]]}) == ("a", "b")
    assert value_from_itf({}) == ()
    tagged = Record.of({"#set": 1})  # a string key that looks like an ITF tag
    assert value_to_itf(tagged) == {"#map": [["#set", 1]]}
    assert value_from_itf(value_to_itf(tagged)) == tagged


@settings(max_examples=200)
@given(values)
def test_value_round_trip(v: Value) -> None:
    assert value_from_itf(json.loads(json.dumps(value_to_itf(v)))) == v


def _lasso() -> Trace:
    return Trace(
        [
            TraceState("Initial predicate", "", {"x": 0, "s": frozenset({ModelValue("a")})}),
            TraceState(
                "Step",
                "line 7, col 9 to line 7, col 39 of module Lasso",
                {"x": 1, "s": frozenset()},
            ),
        ],
        loop_index=0,
    )


def test_trace_layout_and_round_trip() -> None:
    doc = trace_to_itf(_lasso(), source="Lasso.tla")
    assert doc["vars"] == ["s", "x"] and doc["loop"] == 0
    assert doc["states"][1]["#meta"] == {
        "index": 1,
        "action": "Step",
        "location": "line 7, col 9 to line 7, col 39 of module Lasso",
    }
    assert doc["states"][0]["s"] == {"#set": [{"#unserializable": "a"}]}
    assert trace_from_itf(json.loads(dumps(doc))) == _lasso()
    assert dumps(doc) == dumps(trace_to_itf(_lasso(), source="Lasso.tla"))  # byte-identical


def test_no_loop_for_finite_traces_and_stutter_is_last_state_loop() -> None:
    t = Trace([TraceState("Initial predicate", "", {"x": 0})])
    assert "loop" not in trace_to_itf(t)
    t.stuttering = True
    doc = trace_to_itf(t)
    assert doc["loop"] == 0 and doc["#meta"]["stuttering"] is True
    assert trace_from_itf(doc) == t
