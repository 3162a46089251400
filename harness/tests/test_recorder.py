"""The recording connector's bookkeeping, without vLLM: what a Recorder writes, and one
`request_finished` event per finish where MultiConnector's request_finished_all_groups
calls its own request_finished (a child without HMA, multi_connector.py:595-607)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvspec.record.connectors import _Recording
from kvspec.record.log import Recorder


def _lines(d: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for f in sorted(d.glob("*.ndjson")) for x in f.read_text().splitlines()]


def test_sets_are_written_sorted_and_lists_in_their_order(tmp_path: Path) -> None:
    rec = Recorder("P", "kv_both", "scheduler", 0, 1, tmp_path)
    rec.emit("start", children=["NixlPullConnector", "ExampleConnector"], ids={"b", "a"})
    got = _lines(tmp_path)[0]["result"]
    assert got == {"children": ["NixlPullConnector", "ExampleConnector"], "ids": ["a", "b"]}


class _Multi:
    """MultiConnector's shape: all groups falls back to request_finished."""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return True, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return self.request_finished(request, block_ids[0])


class _RecordedMulti(_Recording, _Multi):
    def __init__(self, rec: Recorder) -> None:  # no vLLM config: the recorder only
        self._kvspec_rec = rec


class _Req:
    request_id = "r1"
    status = None


def test_a_finish_through_all_groups_is_recorded_once(tmp_path: Path) -> None:
    conn = _RecordedMulti(Recorder("P", "kv_both", "scheduler", 0, 1, tmp_path))
    assert conn.request_finished_all_groups(_Req(), ([1, 2],)) == (True, None)
    conn.request_finished(_Req(), [3])  # a direct call is recorded too
    finished = [e for e in _lines(tmp_path) if e["call"] == "request_finished"]
    assert [(e["reqs"], e["result"]["blocks"]) for e in finished] == [(["r1"], 2), (["r1"], 1)]


def test_a_read_spec_without_local_blocks_is_notify_only() -> None:
    from types import SimpleNamespace

    from kvspec.record.connectors import _notify_only

    assert _notify_only(SimpleNamespace(local_block_ids=[[], []])) is True  # every group empty
    assert _notify_only(SimpleNamespace(local_block_ids=[[3, 4], []])) is False
    assert _notify_only([]) is True and _notify_only([7, 8]) is False  # one flat group
    assert _notify_only(object()) is None  # the release's arguments do not say
