"""The GitHub workflows: every `run:` command starts with something that exists.

For each command of each `run:` script (lines split at `&&`, `||`, `;` and `|`):
* `make T...`: every T is a Makefile target;
* `kvspec ...` (or `.venv/bin/kvspec`): the arguments parse with `kvspec.cli.build_parser()`,
  so the subcommand and its options exist;
* `.venv/bin/X`: X is a console script of pyproject.toml or a dev tool of the venv;
* anything else: a shell builtin, an executable on PATH here, or a tool only the runner
  has (RUNNER_TOOLS).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvspec.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
BUILTINS = {"set", "cd", "echo", "export", "test", "[", "printf", "true", "false", "exit"}
RUNNER_TOOLS = {"nvidia-smi"}  # present on the self-hosted GPU runner only
VENV_TOOLS = {"python", "python3", "pip", "ruff", "mypy", "pytest"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
REGISTRY_HINTS = ("pypi", "pythonhosted", "pytorch.org", "npmjs", "index-url", "conda.")


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))
    for line in re.findall(r"^\.PHONY\s*:(.*)$", text, re.M):
        targets.update(line.split())
    return targets


def _scripts() -> set[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(data["project"]["scripts"])


def _subcommands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


def commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script (continuations joined, comments dropped)."""
    out: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for tok in lexer:
            if tok in SEPARATORS:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(tok)
        if current:
            out.append(current)
    return out


def run_steps(doc: dict[Any, Any]) -> list[tuple[str, str]]:
    steps = []
    for job_name, job in doc["jobs"].items():
        for i, step in enumerate(job.get("steps", [])):
            if "run" in step:
                steps.append((f"{job_name}[{i}] {step.get('name', '')}".strip(), step["run"]))
    return steps


def check_command(words: list[str]) -> str | None:
    """None when the command's first word exists, else why not."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]  # VAR=value prefixes
    if not words:
        return None
    first, args = words[0], words[1:]
    name = Path(first).name
    if first in BUILTINS:
        return None
    if first == "make":
        targets = _make_targets()
        wanted = [a for a in args if not a.startswith("-") and "=" not in a]
        missing = [t for t in wanted if t not in targets]
        return f"make targets {missing} not in the Makefile" if missing else None
    if name == "kvspec" and first in ("kvspec", ".venv/bin/kvspec"):
        if not args or args[0] not in _subcommands():
            return f"`kvspec {args[0] if args else ''}` is not a kvspec subcommand"
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(args)
        except SystemExit:
            return f"`kvspec {' '.join(args)}` does not parse: {err.getvalue().strip()}"
        return None
    if first.startswith(".venv/bin/"):
        if name in _scripts() or name in VENV_TOOLS:
            return None
        return f"{first}: not a console script of pyproject.toml nor a venv tool"
    if shutil.which(first) or first in RUNNER_TOOLS:
        return None
    return f"{first}: no such executable"


def test_there_are_workflows() -> None:
    assert {p.name for p in WORKFLOWS} >= {"tlc.yml", "nightly.yml", "conformance-gpu.yml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_run_commands_exist(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    problems = []
    for where, script in run_steps(doc):
        for words in commands(script):
            why = check_command(words)
            if why:
                problems.append(f"{path.name} {where}: {why}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_structure_and_no_registry_hosts(path: Path) -> None:
    text = path.read_text()
    doc = yaml.safe_load(text)
    triggers = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` as true
    assert triggers, f"{path.name}: no triggers"
    for name, job in doc["jobs"].items():
        assert job.get("runs-on"), f"{path.name}: job {name} has no runs-on"
        assert job.get("timeout-minutes"), f"{path.name}: job {name} has no timeout"
    lowered = text.lower()
    assert not [h for h in REGISTRY_HINTS if h in lowered]


def _load(name: str) -> dict[Any, Any]:
    doc: dict[Any, Any] = yaml.safe_load((REPO / ".github" / "workflows" / name).read_text())
    return doc


def test_tlc_workflow() -> None:
    doc = _load("tlc.yml")
    paths = doc[True]["pull_request"]["paths"]
    assert "spec/**" in paths and "harness/**" in paths
    scripts = " ".join(s for _, s in run_steps(doc))
    assert "kvspec check --json build/check/results.json" in scripts
    uploads = [s for s in doc["jobs"]["check"]["steps"] if "upload-artifact" in s.get("uses", "")]
    assert uploads and uploads[0]["with"]["path"] == "build/check"


def test_nightly_workflow() -> None:
    doc = _load("nightly.yml")
    assert doc[True]["schedule"]
    scripts = " ".join(s for _, s in run_steps(doc))
    assert "--matrix spec/matrix-nightly.toml" in scripts
    assert "tlc -simulate" in scripts
    assert "make test-full" in scripts  # every conformance trace on the real vLLM, nightly


def test_gpu_workflow() -> None:
    doc = _load("conformance-gpu.yml")
    (job,) = doc["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "gpu"]
    scripts = " ".join(s for _, s in run_steps(doc))
    assert "kvspec conform --driver vllm --device cuda --json build/conform-cuda.json" in scripts
    assert "kvspec review" in scripts and "--no-index" in scripts
    # A runner without a usable GPU fails before conformance instead of skipping to green.
    assert scripts.index("kvspec doctor --require vllm-cuda") < scripts.index("kvspec conform")
    assert "conformance/test_vllm_device.py conformance/test_vllm_verdicts.py --device cuda" in (
        scripts
    )


def test_gpu_check_script() -> None:
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", "bench/gpu_check.sh"], cwd=REPO).returncode == 0
    kvspec = [w[w.index("kvspec") :] for w in commands(script) if "kvspec" in w]
    assert [c[:2] for c in kvspec] == [
        ["kvspec", "doctor"],
        ["kvspec", "conform"],
    ], kvspec
    for words in kvspec:
        assert check_command(words) is None, words
    assert "--require" in kvspec[0] and ["--device", "cuda"] == kvspec[1][4:6]


def test_checker_catches_mistakes() -> None:
    assert check_command(["make", "no-such-target"]) is not None
    assert check_command([".venv/bin/kvspec", "no-such-subcommand"]) is not None
    assert check_command(["kvspec", "review", "--no-such-option"]) is not None
    assert check_command(["surely-not-a-real-binary-kvspec"]) is not None
    assert check_command(["FOO=1", "make", "venv"]) is None
    assert commands("a && b | c; d # e\nf \\\n  g") == [["a"], ["b"], ["c"], ["d"], ["f", "g"]]
