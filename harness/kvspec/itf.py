"""TLC traces <-> ITF JSON (the Informal Trace Format of Apalache and Quint).

Value mapping (TLC -> ITF):

* integers: JSON numbers when ``|n| < 2**53``, else ``{"#bigint": "123"}``
* booleans and strings: JSON booleans and strings
* ``<<a, b>>``: a JSON array. TLC cannot distinguish sequences from tuples, and ITF
  uses plain arrays for sequences and ``{"#tup": [...]}`` for tuples; we always emit the
  array (sequence). Reading accepts both.
* sets: ``{"#set": [...]}``, elements in ``tlcvalue.sort_key`` order (deterministic)
* records: JSON objects with sorted keys (a field named ``#...`` makes it a ``#map``)
* other functions: ``{"#map": [[k, v], ...]}`` in canonical key order
* model values: ITF has none; we use ITF's escape hatch ``{"#unserializable": "NAME"}``
  (just the name), and read it back as ``ModelValue(NAME)``.

Reading normalises functions like TLC does (``tlcvalue.make_fn``): a ``#map`` whose
keys are ``1..n`` becomes a sequence and an empty object/map becomes ``<<>>``.

Trace layout: ``{"#meta": {...}, "vars": [...sorted...], "states": [...], "loop": k}``.
Each state is ``{"#meta": {"index": i, "action": NAME, "location": LOC}, var: value...}``;
the action sits in ``#meta`` because ITF readers treat every other key as a variable.
``loop`` (0-based) is present only for lassos. A trace that ends by stuttering forever
is a lasso on its last state: ``loop = len(states) - 1`` and ``#meta.stuttering`` is true.

Output is byte-for-byte deterministic (sorted keys, canonical element order).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvspec.tlc import Trace, TraceState
from kvspec.tlcvalue import Fn, ModelValue, Record, Value, make_fn, sort_key

JSON = Any  # a JSON-compatible Python value (json.loads result)

_MAX_SAFE = 2**53


class ITFError(ValueError):
    """Raised for JSON that is not an ITF value or trace."""


def value_to_itf(value: Value) -> JSON:
    """One TLC value as an ITF JSON value."""
    if type(value) is bool or isinstance(value, str):
        return value
    if type(value) is int:
        return value if abs(value) < _MAX_SAFE else {"#bigint": str(value)}
    if isinstance(value, ModelValue):
        return {"#unserializable": value.name}
    if isinstance(value, tuple):
        return [value_to_itf(v) for v in value]
    if isinstance(value, frozenset):
        return {"#set": [value_to_itf(v) for v in sorted(value, key=sort_key)]}
    if isinstance(value, Record) and not any(k.startswith("#") for k, _ in value.fields):
        return {k: value_to_itf(v) for k, v in value.fields}
    if isinstance(value, Record | Fn):
        # A string-keyed function whose keys look like ITF tags ("#set") cannot be a JSON
        # object; as a #map it reads back as the same Record (make_fn).
        pairs = value.fields if isinstance(value, Record) else value.pairs
        return {"#map": [[value_to_itf(k), value_to_itf(v)] for k, v in pairs]}
    raise ITFError(f"not a TLC value: {value!r}")


def value_from_itf(data: JSON) -> Value:
    """One ITF JSON value as a TLC value (inverse of ``value_to_itf``)."""
    if isinstance(data, bool | str):
        return data
    if isinstance(data, int):
        return data
    if isinstance(data, list):
        return tuple(value_from_itf(v) for v in data)
    if isinstance(data, dict):
        if "#bigint" in data:
            return int(data["#bigint"])
        if "#set" in data:
            return frozenset(value_from_itf(v) for v in data["#set"])
        if "#tup" in data:
            return tuple(value_from_itf(v) for v in data["#tup"])
        if "#map" in data:
            return make_fn((value_from_itf(k), value_from_itf(v)) for k, v in data["#map"])
        if "#unserializable" in data:
            return ModelValue(str(data["#unserializable"]))
        if any(k.startswith("#") for k in data):
            raise ITFError(f"unknown ITF tag in {sorted(data)}")
        if not data:
            return ()
        return Record(tuple((k, value_from_itf(v)) for k, v in data.items()))
    raise ITFError(f"not an ITF value: {data!r}")


def trace_to_itf(trace: Trace, *, source: str = "", description: str = "") -> dict[str, JSON]:
    """A TLC trace as an ITF document (see the module docstring for the layout)."""
    names: set[str] = set()
    for st in trace.states:
        names.update(st.values)
    meta: dict[str, JSON] = {
        "format": "ITF",
        "format-description": "https://apalache-mc.org/docs/adr/015adr-trace.html",
        "source": source,
        "description": description or "TLC counterexample (kvspec)",
    }
    if trace.stuttering:
        meta["stuttering"] = True
    states = []
    for i, st in enumerate(trace.states):
        item: dict[str, JSON] = {
            "#meta": {"index": i, "action": st.action, "location": st.action_location}
        }
        item.update({k: value_to_itf(v) for k, v in st.values.items()})
        states.append(item)
    doc: dict[str, JSON] = {"#meta": meta, "vars": sorted(names), "states": states}
    loop = trace.loop_index
    if loop is None and trace.stuttering and trace.states:
        loop = len(trace.states) - 1
    if loop is not None:
        doc["loop"] = loop
    return doc


def trace_from_itf(doc: Mapping[str, JSON]) -> Trace:
    """An ITF document as a Trace (action names come from each state's ``#meta``)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("states"), list):
        raise ITFError("not an ITF trace: no 'states' list")
    states = []
    for item in doc["states"]:
        meta = item.get("#meta", {})
        values = {k: value_from_itf(v) for k, v in item.items() if not k.startswith("#")}
        states.append(
            TraceState(str(meta.get("action", "")), str(meta.get("location", "")), values)
        )
    stuttering = bool(doc.get("#meta", {}).get("stuttering", False))
    loop = doc.get("loop")
    if stuttering and loop == len(states) - 1:
        loop = None  # a stutter is recorded as a flag, not as a one-state loop
    return Trace(states, loop if isinstance(loop, int) else None, stuttering)


def dumps(doc: JSON) -> str:
    """Deterministic JSON text (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
