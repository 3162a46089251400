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
from kvspec.record.decode_mapping import map_decode, producers_of
from kvspec.record.log import Event
from kvspec.record.mapping import (
    MappingError,
    consumer_engines,
    map_recording,
    producer_engines,
    validation_sides,
)

_EMPTY_KEYS = ("new", "finished_sending", "finished_recving", "failed_recving")


def _empty(e: Event) -> bool:
    return not any(e.result.get(k) for k in _EMPTY_KEYS)


_STEP_CALLS = ("schedule", "update_from_output", "get_transfer_results")


def _decode_drops(events: list[Event]) -> dict[str, set[int]]:
    """Each decode engine's idle steps (kvspec.record.decode_mapping): for a D that read
    from several producers (xPyD), the steps idle in every producer's projection. A
    decode engine the decode side cannot map (recorded before `remote_prefill`) is left
    out: it keeps only its non-empty step events."""
    out: dict[str, set[int]] = {}
    for d in consumer_engines(events):
        ps = [x for x in producers_of(events, d) if x]
        try:
            maps = [map_decode(events, d, p) for p in (ps if len(ps) > 1 else [None])]
            sets = [dm.dropped_steps - dm.held_steps for dm in maps]
        except MappingError:
            continue
        out[d] = set.intersection(*sets)
    return out


def _producer_drops(events: list[Event]) -> dict[str, set[int]]:
    """Each producer's idle steps, less those the clock's mapping keeps (a few per tick,
    in each decode engine's share) where it can map the run (not without a recorded
    lease), and less the steps another event of either log falls inside
    (steps_holding_events): each log of the compacted recording is the original's."""
    out: dict[str, set[int]] = {}
    for s in validation_sides(events):
        m = map_recording(events, producer=s.producer)
        out[s.name] = m.dropped_steps - m.held_steps
        for c in s.clocks:
            try:
                cm = map_clock(events, producer=s.producer, consumer=c)
            except MappingError:
                continue
            out[s.name] &= cm.dropped_steps - cm.held_steps
    return out


def compact(events: list[Event]) -> list[Event]:
    """Drop each engine's idle steps: the k-th schedule, update_from_output and each
    rank's get_transfer_results are step k, as kvspec.record.mapping (producer) and
    kvspec.record.decode_mapping (decode engine) count them. Another consumer keeps only
    its non-empty step events (its own steps are not mapped: its reads and reports are)."""
    if not producer_engines(events):
        map_recording(events)  # the one-line MappingError: no producer
    drops = _decode_drops(events) | _producer_drops(events)
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
