"""A recording without its idle steps (kvspec.record.mapping.idle_steps): what
`kvspec record --compact` writes and what the committed regression recordings are. The
result maps to the same spec log as the original (tested), at a fraction of the size: a
producer holding blocks for a READ busy-loops hundreds of empty steps a second.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from kvspec.record.log import Event
from kvspec.record.mapping import map_recording

_EMPTY_KEYS = ("new", "finished_sending", "finished_recving", "failed_recving")


def _empty(e: Event) -> bool:
    return not any(e.result.get(k) for k in _EMPTY_KEYS)


def compact(events: list[Event]) -> list[Event]:
    """Drop the producer's idle steps (the k-th schedule, update_from_output and each
    rank's get_transfer_results are step k, as kvspec.record.mapping counts them) and the
    consumers' empty step events (their own steps are not mapped: only their reads and
    reports are)."""
    m = map_recording(events)
    drop = m.dropped_steps
    count: dict[tuple[str, int, int], int] = defaultdict(int)
    kept = []
    for e in sorted(events, key=lambda e: (e.pid, e.seq)):
        if e.engine == m.producer:
            key = (e.call, e.rank, e.pid)
            if e.call in ("schedule", "update_from_output", "get_transfer_results"):
                count[key] += 1
                if count[key] in drop:
                    continue
        elif e.call in ("schedule", "update_from_output", "get_transfer_results") and _empty(e):
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
