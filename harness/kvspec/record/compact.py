"""A recording without its idle steps (kvspec.record.mapping.idle_steps; the producer
keeps those the clock's mapping keeps too, a few per tick): what
`kvspec record --compact` writes and what the committed regression recordings are. The
result maps to the same spec log as the original (tested), at a fraction of the size: a
producer holding blocks for a READ busy-loops hundreds of empty steps a second.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from kvspec.record.clock_mapping import map_clock
from kvspec.record.decode_mapping import map_decode
from kvspec.record.log import Event
from kvspec.record.mapping import MappingError, map_recording

_EMPTY_KEYS = ("new", "finished_sending", "finished_recving", "failed_recving")


def _empty(e: Event) -> bool:
    return not any(e.result.get(k) for k in _EMPTY_KEYS)


_STEP_CALLS = ("schedule", "update_from_output", "get_transfer_results")


def _decode_drop(events: list[Event]) -> tuple[str | None, set[int]]:
    """The decode engine's idle steps (kvspec.record.decode_mapping), or (None, set()) for
    a recording the decode side cannot map (no decode engine, recorded before
    `remote_prefill`): its consumers keep only their non-empty step events."""
    try:
        dm = map_decode(events)
    except MappingError:
        return None, set()
    return dm.consumer, dm.dropped_steps


def _clock_drop(events: list[Event], default: set[int]) -> set[int]:
    """The producer's idle steps the clock's mapping drops (it keeps some in each tick), or
    `default` for a recording it cannot map (no lease recorded)."""
    try:
        return map_clock(events).dropped_steps
    except MappingError:
        return default


def compact(events: list[Event]) -> list[Event]:
    """Drop each engine's idle steps: the k-th schedule, update_from_output and each
    rank's get_transfer_results are step k, as kvspec.record.mapping (producer) and
    kvspec.record.decode_mapping (decode engine) count them. Another consumer keeps only
    its non-empty step events (its own steps are not mapped: its reads and reports are)."""
    m = map_recording(events)
    d_engine, d_drop = _decode_drop(events)
    drops = {m.producer: m.dropped_steps & _clock_drop(events, m.dropped_steps)}
    drops |= {d_engine: d_drop} if d_engine else {}
    count: dict[tuple[str, int, int], int] = defaultdict(int)
    kept = []
    for e in sorted(events, key=lambda e: (e.pid, e.seq)):
        if e.engine in drops:
            key = (e.call, e.rank, e.pid)
            if e.call in _STEP_CALLS:
                count[key] += 1
                if count[key] in drops[e.engine]:
                    continue
        elif e.call in _STEP_CALLS and _empty(e):
            continue
        kept.append(e)
    return sorted(kept, key=lambda e: (e.t_ns, e.pid, e.seq))


def write_dir(events: list[Event], out: Path) -> None:
    """One NDJSON file per process, as the recorder names them."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = defaultdict(list)
    for e in sorted(events, key=lambda e: (e.pid, e.seq)):
        raw = {"v": 1, **asdict(e), "reqs": list(e.reqs)}
        name = f"{e.engine}-{e.role}-{e.rank}-{e.pid}.ndjson"
        files[name].append(json.dumps(raw, sort_keys=True))
    for name, lines in files.items():
        (out / name).write_text("\n".join(lines) + "\n")
