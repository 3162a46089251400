"""The scenario fixtures' seeded weights: the same bytes on every run, written once per
config, loaded instead of vLLM's dummy weights (whose decode tokens ignore the KV: see
kvspec.scenario_weights). Negative control: another config gets other weights, and a
model directory without them loads dummy ones."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvspec.scenario_catalogue import MODEL_CONFIGS  # noqa: E402
from kvspec.scenario_weights import STAMP, WEIGHTS, load_format, write_checkpoint  # noqa: E402


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_weights_are_seeded_and_written_once(tmp_path: Path) -> None:
    assert load_format(tmp_path / "a") == "dummy"
    a = write_checkpoint(tmp_path / "a", MODEL_CONFIGS["llama"])
    b = write_checkpoint(tmp_path / "b", MODEL_CONFIGS["llama"])
    assert _sha(a) == _sha(b) and load_format(tmp_path / "a") == "safetensors"
    mtime = a.stat().st_mtime_ns
    assert write_checkpoint(tmp_path / "a", MODEL_CONFIGS["llama"]) == a
    assert a.stat().st_mtime_ns == mtime  # the stamp matched: not generated again
    c = write_checkpoint(tmp_path / "a", MODEL_CONFIGS["mqa"])  # another config
    assert _sha(c) != _sha(b) and (tmp_path / "a" / STAMP).exists()
    assert (tmp_path / "a" / WEIGHTS) == c
