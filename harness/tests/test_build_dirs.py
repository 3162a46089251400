"""The generated sets under build/ stay whole when two processes write them at once (make
test runs pytest in two pytest-xdist workers): trace sets are renamed into place, and each
process generates decode traces in a TLC folder of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvspec import decode_traces
from kvspec.matrix import ModelRow, Topology
from kvspec.tracestore import STAMP, write_generated

ROW = ModelRow("t-shipped-nixl", "v0.30-shipped", "nixl", Topology(1, 1, 1), 1, 1, False)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_rewrite_replaces_the_set_whole_and_leaves_no_scratch(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    write_generated(out, "k1", [(ROW, {"a.itf.json": "1", "b.itf.json": "1"})])
    write_generated(out, "k2", [(ROW, {"a.itf.json": "2"})])
    assert _files(out) == [STAMP, "v0.30-shipped/t-shipped-nixl/a.itf.json"]
    assert (out / STAMP).read_text() == "k2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["traces"]  # no .new-/.old- folder left


@pytest.mark.parametrize(("key", "kept"), [("k1", True), ("k2", False)])
def test_a_set_another_process_put_in_place_stays(tmp_path: Path, key: str, kept: bool) -> None:
    # kept: the same inputs (the same key) were written meanwhile, so that set is not swapped
    # under its readers; the negative control, a new key, replaces it.
    out = tmp_path / "traces"
    write_generated(out, "k1", [(ROW, {"a.itf.json": "1"})])
    first = out.stat().st_ino
    write_generated(out, key, [(ROW, {"a.itf.json": "1"})])
    assert (out.stat().st_ino == first) is kept
    assert [p.name for p in tmp_path.iterdir()] == ["traces"]


def test_decode_traces_are_generated_in_a_folder_of_the_process_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    works: list[Path] = []

    def generate(row: Any, work: Path) -> list[Any]:
        works.append(work)
        (work / "graph.dot").write_text("digraph {}")
        if len(works) == 2:
            raise RuntimeError("TLC failed; log in " + str(work))
        return [[("init", {})]]

    monkeypatch.setattr(decode_traces, "generate", generate)
    row: Any = type("Row", (), {"name": "conf-x"})()
    assert decode_traces._generate_once(row, tmp_path) == [[("init", {})]]
    with pytest.raises(RuntimeError):
        decode_traces._generate_once(row, tmp_path)
    assert works[0] != works[1] and all(w.parent == tmp_path for w in works)
    assert works[0].name.startswith("conf-x-")
    assert not works[0].exists()  # read, then removed
    assert (works[1] / "graph.dot").exists()  # kept for the failure's log
