"""TLC's state-graph dump (`-dump dot,actionlabels FILE`) as a Python graph.

Format (TLC 2.15, see /work/shared/docs/toolchain-facts.md): one line per node,
``FP [label="STATE"]`` (``style = filled`` marks initial states), one line per edge,
``FP -> FP [label="ACTION",...]`` with the operator name only, and stuttering self-loops
drawn ``style="dashed"``. Labels are the state as TLC prints it (``/\\ var = value``
lines) escaped for dot: ``\\n`` newline, ``\\"`` quote, ``\\\\`` backslash. Every node and
edge fits on one line because newlines inside labels are escaped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvspec.itf import value_to_itf
from kvspec.matrix import SPEC_FILE, ModelRow
from kvspec.tlc import run_tlc
from kvspec.tlcvalue import Value, parse_state, parse_value
from kvspec.tools import QUICK_JVM

Edge = tuple[int, str, int]

_NODE = re.compile(r'^(-?\d+) \[label="((?:[^"\\]|\\.)*)"(.*)\];?$')
_EDGE = re.compile(r"^(-?\d+) -> (-?\d+) \[(.*)\];?$")
_ATTR_LABEL = re.compile(r'label="((?:[^"\\]|\\.)*)"')
_DOT_ESC = re.compile(r"\\(.)")


class DotError(ValueError):
    """A line of the dump that is neither a node nor an edge we understand."""


@dataclass
class StateGraph:
    """States by fingerprint, labelled edges (stutter self-loops dropped), initial states."""

    states: dict[int, dict[str, Value]] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    initial: set[int] = field(default_factory=set)

    def state_keys(self) -> set[str]:
        return {state_key(s) for s in self.states.values()}

    def edge_keys(self) -> set[tuple[str, str, str]]:
        """Edges by state content, so graphs with different fingerprints compare equal."""
        keys = {fp: state_key(s) for fp, s in self.states.items()}
        return {(keys[a], name, keys[b]) for a, name, b in self.edges}


def state_key(state: dict[str, Value]) -> str:
    """A canonical text for a state: its ITF JSON with sorted keys."""
    return json.dumps({k: value_to_itf(v) for k, v in state.items()}, sort_keys=True)


def _unescape(label: str) -> str:
    return _DOT_ESC.sub(lambda m: "\n" if m[1] == "n" else m[1], label)


_CONJ = re.compile(r"^/\\ ", re.M)


def _parse_label(label: str, cache: dict[str, Value]) -> dict[str, Value]:
    """parse_state, memoised per `var = value` conjunct: neighbouring states share most
    variables' text, and the value parser dominates the cost of reading a dump."""
    parts = _CONJ.split(label)
    if len(parts) < 2 or parts[0].strip():
        return parse_state(label)  # single-variable specs print `x = v` without /\
    state: dict[str, Value] = {}
    for part in parts[1:]:
        name, eq, text = part.partition(" = ")
        if not eq or name in state:
            return parse_state(label)
        text = text.strip()
        v = cache.get(text)
        if v is None:
            v = cache[text] = parse_value(text)
        state[name] = v
    return state


def parse_dot(text: str) -> StateGraph:
    """Parse a TLC dot dump; the legend cluster (action names as nodes) is skipped."""
    g = StateGraph()
    cache: dict[str, Value] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        m = _EDGE.match(line)
        if m:
            src, dst, attrs = int(m[1]), int(m[2]), m[3]
            if "dashed" in attrs:  # stuttering self-loop, not an action
                continue
            lm = _ATTR_LABEL.search(attrs)
            if lm is None:
                raise DotError(f"line {lineno}: edge without an action label: {line[:80]}")
            g.edges.append((src, _unescape(lm[1]), dst))
            continue
        m = _NODE.match(line)
        if m:
            fp = int(m[1])
            try:
                g.states[fp] = _parse_label(_unescape(m[2]), cache)
            except ValueError as exc:
                raise DotError(f"line {lineno}: state label does not parse: {exc}") from exc
            if "filled" in m[3]:
                g.initial.add(fp)
    unknown = {fp for a, _, b in g.edges for fp in (a, b)} - set(g.states)
    if unknown:
        raise DotError(f"edges mention {len(unknown)} fingerprints with no node line")
    return g


def tlc_state_graph(row: ModelRow, workdir: Path, *, timeout_s: float = 600) -> StateGraph:
    """Run TLC on `row` (no invariants or properties, deadlock off) and parse its dump."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / f"{row.name}.cfg"
    cfg.write_text(row.cfg_text([], []))
    dot = workdir / f"{row.name}.dot"
    # Conformance graphs (at most ~7,000 edges) are seconds of TLC: C1 alone (QUICK_JVM).
    res = run_tlc(
        SPEC_FILE, cfg, deadlock=False, dump_dot=dot, log_dir=workdir, timeout_s=timeout_s,
        jvm_flags=QUICK_JVM,
    )
    if res.verdict != "holds":
        raise DotError(f"TLC on {row.name}: {res.verdict}: {res.error}; log {res.log_path}")
    return parse_dot(dot.read_text())
