"""Hypothesis strategies for TLC values, shared by the value and ITF tests."""

from __future__ import annotations

from hypothesis import strategies as st
from kvspec.tlcvalue import ModelValue, Record, Value, make_fn

ident = st.from_regex(r"[a-z][a-zA-Z0-9_]{0,6}", fullmatch=True).filter(
    lambda s: s not in ("TRUE", "FALSE")
)
_text = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126)
    | st.sampled_from(["\n", "\t", "\\", '"']),
    max_size=12,
)
_ints = st.integers(min_value=-(2**70), max_value=2**70)
_models = ident.map(ModelValue)


def _values(children: st.SearchStrategy[Value]) -> st.SearchStrategy[Value]:
    # Set elements and function keys are kept to one kind, as in TLC (and because
    # Python's True == 1 would merge them).
    keys: st.SearchStrategy[Value] = st.one_of(_ints, _text, _models)
    return st.one_of(
        st.lists(children, max_size=4).map(tuple),
        st.frozensets(_ints, max_size=4),
        st.frozensets(_models, max_size=4),
        st.frozensets(children, max_size=3),
        st.dictionaries(ident, children, min_size=1, max_size=3).map(Record.of),
        st.lists(st.tuples(keys, children), max_size=4).map(make_fn),
    )


values: st.SearchStrategy[Value] = st.recursive(
    st.one_of(st.booleans(), _ints, _text, _models), _values, max_leaves=12
)
