"""Edge-covering paths through a finite state graph: the selection behind every generated
conformance trace (KVCompletion's in kvspec.traces, Decode's in kvspec.decode_traces).

Generic over the state and action types (anything hashable and orderable): paths start at
the initial state, each begins with the BFS path to the first uncovered edge, then extends
greedily through uncovered edges (walking at most `hop` covered steps to reach one) up to
`max_len` steps; together they cover every edge. Deterministic: the graph's `out` lists
are in a fixed order and so is the result.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

S = TypeVar("S", bound=Hashable)
A = TypeVar("A", bound=Hashable)
Out = Mapping[S, Sequence[tuple[A, S]]]


def bfs_order(init: S, out: Mapping[S, Sequence[tuple[A, S]]]) -> list[S]:
    order = [init]
    seen = {init}
    for s in order:  # the list grows while we iterate: BFS
        for _, t in out.get(s, []):
            if t not in seen:
                seen.add(t)
                order.append(t)
    return order


def _bfs_paths(init: S, out: Mapping[S, Sequence[tuple[A, S]]]) -> dict[S, tuple[S, A] | None]:
    parent: dict[S, tuple[S, A] | None] = {init: None}
    q = deque([init])
    while q:
        s = q.popleft()
        for a, t in out.get(s, []):
            if t not in parent:
                parent[t] = (s, a)
                q.append(t)
    return parent


def _path_to(parent: dict[S, tuple[S, A] | None], s: S) -> list[tuple[S, A, S]]:
    path: list[tuple[S, A, S]] = []
    while (p := parent[s]) is not None:
        path.append((p[0], p[1], s))
        s = p[0]
    return path[::-1]


def _walk_to_uncovered(
    out: Mapping[S, Sequence[tuple[A, S]]], start: S, uncovered: set[tuple[S, A, S]], hop: int
) -> list[tuple[S, A, S]]:
    """Shortest walk (<= hop steps) from start to a state with an uncovered out-edge."""
    prev: dict[S, tuple[S, A, S] | None] = {start: None}
    q = deque([(start, 0)])
    while q:
        s, d = q.popleft()
        if d and any((s, a, t) in uncovered for a, t in out.get(s, [])):
            walk: list[tuple[S, A, S]] = []
            while (e := prev[s]) is not None:
                walk.append(e)
                s = e[0]
            return walk[::-1]
        if d == hop:
            continue
        for a, t in out.get(s, []):
            if t not in prev:
                prev[t] = (s, a, t)
                q.append((t, d + 1))
    return []


def cover_edges(
    init: S, out: Mapping[S, Sequence[tuple[A, S]]], *, max_len: int, hop: int
) -> list[list[tuple[S, A, S]]]:
    """Paths from init that together cover every reachable edge, shortest first."""
    parent = _bfs_paths(init, out)
    edges = [(s, a, t) for s in bfs_order(init, out) for a, t in out.get(s, [])]
    uncovered = set(edges)
    traces: list[list[tuple[S, A, S]]] = []
    for e in edges:
        if e not in uncovered:
            continue
        path = [*_path_to(parent, e[0]), e]
        uncovered.difference_update(path)
        cur = e[2]
        while len(path) < max_len:
            nxt = next(((cur, a, t) for a, t in out.get(cur, []) if (cur, a, t) in uncovered), None)
            if nxt is not None:
                step = [nxt]
            else:
                step = _walk_to_uncovered(out, cur, uncovered, hop)
                if not step or len(path) + len(step) >= max_len:
                    break
            path += step
            uncovered.difference_update(step)
            cur = path[-1][2]
        traces.append(path)
    return traces
