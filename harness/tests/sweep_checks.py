"""Checks every kvspec.sweep command's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvspec.cli import main
from kvspec.sweep import Sweep, SweepMatrixError, load_sweep_matrix


def assert_bad_matrix_is_one_line_and_exit_2(
    sweep: Sweep, text: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sweep's matrix head plus `text` (a bad row): one-line error naming the file and
    `needle`, and `kvspec <command>` exits 2 with one line on stderr."""
    bad = tmp_path / "m.toml"
    bad.write_text(sweep.matrix.read_text().split("[[row]]")[0] + text)
    with pytest.raises(SweepMatrixError) as exc:
        load_sweep_matrix(sweep, bad)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert main([sweep.command, "--matrix", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err
