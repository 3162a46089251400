"""Parser and printer for TLC's value syntax (the text TLC prints for states).

Why hand-written: modelator-py 0.2.6 is broken as shipped (returns null traces and
no lassos) and tlaplus-state-graph-utils needs Python 3.12 + graphviz and fails on
sets, sequences and model values. TLC's printed value language is tiny, so a
standard-library parser is cheaper than either.

Representation (all values are hashable, so sets of records/functions work):

* integers -> ``int`` (arbitrary size), ``TRUE``/``FALSE`` -> ``bool``
* strings -> ``str``
* model values (bare identifiers) -> ``ModelValue(name)``, never a ``str``
* sets ``{...}`` -> ``frozenset``; intervals ``a..b`` -> ``frozenset`` of the range
* sequences/tuples ``<<...>>`` -> ``tuple`` (TLC cannot tell them apart)
* records ``[a |-> 1]`` -> ``Record`` (fields kept sorted by name)
* functions ``(k :> v @@ ...)`` -> ``Fn`` (pairs kept in canonical order)

Functions are normalised the way TLC itself prints them (see ``make_fn``): a function
whose domain is ``1..n`` (or empty) is a ``tuple``, one whose domain is a non-empty
set of strings is a ``Record``. So a parsed value compares equal to the value TLC meant.

Caveat: Python's ``True == 1``; TLC never mixes booleans and integers in one set or
function domain, so this does not arise for values TLC prints.

The parser and printer use explicit stacks, not recursion: a function with thousands
of ``:>``/``@@`` pairs or deep nesting never raises RecursionError.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias, Union

Value: TypeAlias = Union[
    bool, int, str, "ModelValue", "Record", "Fn", frozenset["Value"], tuple["Value", ...]
]


class TLCValueError(ValueError):
    """Raised for text that is not a TLC value."""


@dataclass(frozen=True, order=True)
class ModelValue:
    """A TLC model value (an uninterpreted constant, e.g. ``m1``)."""

    name: str


@dataclass(frozen=True)
class Record:
    """A TLA+ record; ``fields`` is sorted by field name (as TLC normalises records)."""

    fields: tuple[tuple[str, Value], ...]

    def __post_init__(self) -> None:
        ordered = tuple(sorted(dict(self.fields).items()))
        if len(ordered) != len(self.fields):
            raise TLCValueError("duplicate record field")
        object.__setattr__(self, "fields", ordered)

    @classmethod
    def of(cls, mapping: dict[str, Value]) -> Record:
        return cls(tuple(mapping.items()))

    def as_dict(self) -> dict[str, Value]:
        return dict(self.fields)

    def __getitem__(self, name: str) -> Value:
        return self.as_dict()[name]


@dataclass(frozen=True)
class Fn:
    """A TLA+ function that is neither a sequence nor a record; pairs in canonical order."""

    pairs: tuple[tuple[Value, Value], ...]

    def __post_init__(self) -> None:
        seen: dict[Value, Value] = {}
        for k, v in self.pairs:
            seen.setdefault(k, v)  # `f @@ g` keeps f's value on a shared key
        ordered = tuple(sorted(seen.items(), key=lambda kv: sort_key(kv[0])))
        object.__setattr__(self, "pairs", ordered)

    def as_dict(self) -> dict[Value, Value]:
        return dict(self.pairs)

    def __getitem__(self, key: Value) -> Value:
        return self.as_dict()[key]


def make_fn(pairs: Iterable[tuple[Value, Value]]) -> Value:
    """Build a function value normalised like TLC prints it (sequence / record / Fn)."""
    merged: dict[Value, Value] = {}
    for k, v in pairs:
        merged.setdefault(k, v)
    keys = list(merged)
    if not keys:
        return ()
    if all(type(k) is int for k in keys) and set(keys) == set(range(1, len(keys) + 1)):
        return tuple(merged[i] for i in range(1, len(keys) + 1))
    if all(isinstance(k, str) for k in keys):
        return Record(tuple((str(k), v) for k, v in merged.items()))
    return Fn(tuple(merged.items()))


# ---------------------------------------------------------------- ordering

_RANK = {bool: 0, int: 1, str: 2, ModelValue: 3, tuple: 4, Record: 5, Fn: 6, frozenset: 7}


def sort_key(value: Value) -> tuple[int, int, str]:
    """A total order over values, used to print sets and functions deterministically."""
    rank = _RANK.get(type(value))
    if rank is None:
        raise TLCValueError(f"not a TLC value: {value!r}")
    if type(value) is bool:
        return (rank, int(value), "")
    if type(value) is int:
        return (rank, value, "")
    if isinstance(value, str):
        return (rank, 0, value)
    if isinstance(value, ModelValue):
        return (rank, 0, value.name)
    return (rank, 0, to_tla(value))


# ---------------------------------------------------------------- printer

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\f": "\\f"}


def _quote(s: str) -> str:
    return '"' + "".join(_ESCAPES.get(c, c) for c in s) + '"'


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Lit(str):
    """Marks printer stack items that are already text (as opposed to values)."""


def to_tla(value: Value) -> str:
    """Print ``value`` in TLC's syntax; sets/functions in a deterministic order."""
    out: list[str] = []
    stack: list[Value | _Lit] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Lit):
            out.append(item)
        elif type(item) is bool:
            out.append("TRUE" if item else "FALSE")
        elif type(item) is int:
            out.append(str(item))
        elif isinstance(item, str):
            out.append(_quote(item))
        elif isinstance(item, ModelValue):
            out.append(item.name)
        else:
            stack.extend(reversed(_expand(item)))
    return "".join(out)


def _expand(value: Value) -> list[Value | _Lit]:
    """One level of a composite value as a list of literal pieces and child values."""
    parts: list[Value | _Lit] = []
    if isinstance(value, tuple):
        parts.append(_Lit("<<"))
        for i, v in enumerate(value):
            parts.extend([_Lit(", ")] if i else [])
            parts.append(v)
        parts.append(_Lit(">>"))
    elif isinstance(value, frozenset):
        parts.append(_Lit("{"))
        for i, v in enumerate(sorted(value, key=sort_key)):
            parts.extend([_Lit(", ")] if i else [])
            parts.append(v)
        parts.append(_Lit("}"))
    elif isinstance(value, Record):
        if not value.fields:
            return [_Lit("<<>>")]  # the empty function prints as the empty sequence
        if not all(_IDENT.fullmatch(name) for name, _ in value.fields):
            # A string-domain function whose keys are not identifiers cannot be written
            # as a record literal; use the equivalent :>/@@ form (it parses back equal).
            return _expand(Fn(tuple(value.fields)))
        parts.append(_Lit("["))
        for i, (name, v) in enumerate(value.fields):
            parts.append(_Lit((", " if i else "") + f"{name} |-> "))
            parts.append(v)
        parts.append(_Lit("]"))
    elif isinstance(value, Fn):
        if not value.pairs:
            return [_Lit("<<>>")]
        parts.append(_Lit("("))
        for i, (k, v) in enumerate(value.pairs):
            parts.extend([_Lit(" @@ ")] if i else [])
            parts.extend([k, _Lit(" :> "), v])
        parts.append(_Lit(")"))
    else:
        raise TLCValueError(f"not a TLC value: {value!r}")
    return parts


def state_to_tla(state: dict[str, Value]) -> str:
    """Print a state the way TLC does (``/\\ x = ...`` lines, variables sorted)."""
    if len(state) == 1:
        ((name, v),) = state.items()
        return f"{name} = {to_tla(v)}"
    return "\n".join(f"/\\ {k} = {to_tla(v)}" for k, v in sorted(state.items()))


# ---------------------------------------------------------------- tokenizer

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<int>-?\d+)
  | (?P<punct><<|>>|\|->|:>|@@|\.\.|/\\|[{}\[\](),=])
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    """,
    re.VERBOSE | re.DOTALL,
)
_UNESCAPE = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r", "f": "\f"}
_ESC_RE = re.compile(r"\\(.)", re.DOTALL)

# Token kinds: "s" string, "i" int, "p" punctuation, "n" identifier.
_Tok = tuple[str, str, int]


def _tokens(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    n = len(text)
    while pos < n:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise TLCValueError(f"unexpected character {text[pos]!r} at offset {pos}")
        kind = m.lastgroup
        if kind != "ws":
            toks.append(({"str": "s", "int": "i", "punct": "p"}.get(kind or "", "n"), m[0], pos))
        pos = m.end()
    return toks


def _unquote(tok: str, pos: int) -> str:
    def repl(m: re.Match[str]) -> str:
        c = m[1]
        if c not in _UNESCAPE:
            raise TLCValueError(f"unknown string escape \\{c} at offset {pos}")
        return _UNESCAPE[c]

    return _ESC_RE.sub(repl, tok[1:-1])


# ---------------------------------------------------------------- parser


@dataclass
class _Frame:
    kind: str  # "{", "<<", "[", "("
    items: list[Value]
    pairs: list[tuple[Value, Value]]
    key: Value = ()
    has_key: bool = False


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def _err(self, what: str) -> TLCValueError:
        if self.i < len(self.toks):
            _, tok, pos = self.toks[self.i]
            return TLCValueError(f"{what}, found {tok!r} at offset {pos}")
        return TLCValueError(f"{what}, found end of input")

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def next(self) -> _Tok:
        if self.i >= len(self.toks):
            raise self._err("unexpected end of value")
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expect(self, text: str) -> None:
        if self.peek() != text:
            raise self._err(f"expected {text!r}")
        self.i += 1

    def ident(self) -> str:
        if self.i >= len(self.toks) or self.toks[self.i][0] != "n":
            raise self._err("expected an identifier")
        self.i += 1
        return self.toks[self.i - 1][1]

    def atom(self, tok: _Tok) -> Value:
        kind, text, pos = tok
        if kind == "s":
            return _unquote(text, pos)
        if kind == "i":
            if self.peek() == "..":
                self.i += 1
                hi = self.next()
                if hi[0] != "i":
                    raise self._err("expected an integer after '..'")
                return frozenset(range(int(text), int(hi[1]) + 1))
            return int(text)
        if kind == "n":
            if text == "TRUE":
                return True
            if text == "FALSE":
                return False
            return ModelValue(text)
        self.i -= 1
        raise self._err("expected a value")

    def value(self) -> Value:
        """Parse one value starting at the current token, using an explicit stack."""
        stack: list[_Frame] = []
        while True:
            # State A: expecting the start of a value.
            kind, text, _ = tok = self.next()
            result: Value
            if text == "{" and kind == "p":
                if self.peek() == "}":
                    self.i += 1
                    result = frozenset()
                else:
                    stack.append(_Frame("{", [], []))
                    continue
            elif text == "<<" and kind == "p":
                if self.peek() == ">>":
                    self.i += 1
                    result = ()
                else:
                    stack.append(_Frame("<<", [], []))
                    continue
            elif text == "[" and kind == "p":
                name = self.ident()
                self.expect("|->")
                stack.append(_Frame("[", [], [], name, True))
                continue
            elif text == "(" and kind == "p":
                stack.append(_Frame("(", [], []))
                continue
            else:
                result = self.atom(tok)
            # State B: a value is complete; attach it to enclosing frames, closing them.
            while True:
                if not stack:
                    return result
                f = stack[-1]
                sep = self.next()[1]
                if f.kind in ("{", "<<"):
                    f.items.append(result)
                    if sep == ",":
                        break
                    if sep != ("}" if f.kind == "{" else ">>"):
                        self.i -= 1
                        raise self._err("expected ',' or closing bracket")
                    stack.pop()
                    result = frozenset(f.items) if f.kind == "{" else tuple(f.items)
                elif f.kind == "[":
                    f.pairs.append((f.key, result))
                    if sep == ",":
                        f.key = self.ident()
                        self.expect("|->")
                        break
                    if sep != "]":
                        self.i -= 1
                        raise self._err("expected ',' or ']'")
                    stack.pop()
                    fields: dict[str, Value] = {}
                    for k, v in f.pairs:
                        if str(k) in fields:
                            raise TLCValueError(f"duplicate record field {k}")
                        fields[str(k)] = v
                    result = Record.of(fields)
                else:  # "(": either a function (k :> v @@ ...) or plain grouping (v)
                    if not f.has_key:
                        if sep == ":>":
                            f.key, f.has_key = result, True
                            break
                        if sep == ")" and not f.pairs:
                            stack.pop()
                            continue
                        self.i -= 1
                        raise self._err("expected ':>'")
                    f.pairs.append((f.key, result))
                    f.key, f.has_key = (), False
                    if sep == "@@":
                        break
                    if sep != ")":
                        self.i -= 1
                        raise self._err("expected '@@' or ')'")
                    stack.pop()
                    result = make_fn(f.pairs)


def parse_value(text: str) -> Value:
    """Parse one TLC value (whitespace and newlines allowed anywhere between tokens)."""
    p = _Parser(text)
    v = p.value()
    if p.peek() is not None:
        raise p._err("trailing text after value")
    return v


def parse_state(text: str) -> dict[str, Value]:
    """Parse a TLC state block: ``/\\ x = v`` lines, or ``x = v`` for one variable."""
    p = _Parser(text)
    state: dict[str, Value] = {}
    if p.peek() is None:
        return state
    while p.peek() is not None:
        if p.peek() == "/\\":
            p.i += 1
        name = p.ident()
        p.expect("=")
        if name in state:
            raise TLCValueError(f"variable {name} assigned twice")
        state[name] = p.value()
    return state
