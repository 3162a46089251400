"""Run TLC (``-tool`` mode) and turn its output into a typed ``TLCResult``.

Every run gets its own directory (``mkdtemp`` under ``log_dir``, default ``build/tlc``
or ``$KVSPEC_TLC_DIR``) holding the raw log, the ``-metadir`` and java's tmpdir: TLC
extracts the standard modules (Naturals.tla, ...) into ``java.io.tmpdir`` and deletes
them on exit, and two runs sharing a metadir collide on ``states/<timestamp>``, so
sharing either between concurrent runs breaks them.

The verdict comes from TLC's tagged messages first and the exit code second: TLC 2.15
exits 0 after a violation under ``-continue`` and also when SANY fails to read a standard
module, so exit code 0 alone never means "holds"; a success message (2193) must be seen.

Under ``-continue`` TLC reports every violating state, each with its own trace, naming only
the first invariant (in cfg order) that state violates, and still ends with 2193 and exit
code 0; ``TLCResult.violations`` keeps the first report of each invariant. A ``stop``
predicate (see ``kvspec.tlc_continue``) ends such a run once it has said enough.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvspec.jar import JarError, JavaMissing
from kvspec.tlc_errors import location, module_files, one_line, sany_error
from kvspec.tlc_process import kill_group, tlc_args, wait_tlc
from kvspec.tlcvalue import TLCValueError, Value, parse_state
from kvspec.tools import java_command

Verdict = Literal["holds", "violated", "deadlock", "error", "timeout"]

# TLC -tool message codes (tlc2.output.EC / MP).
MSG_VERSION = 2262
MSG_INIT_DONE = 2190
MSG_FINAL_COUNTS = 2199
MSG_SUCCESS = 2193
MSG_FINISHED = 2186
MSG_TRACE_STATE = 2217
MSG_BACK_TO_STATE = 2122
MSG_STUTTERING = 2218
MSG_INVARIANT_VIOLATED = 2110
MSG_INVARIANT_VIOLATED_INITIAL = 2107
MSG_TEMPORAL_VIOLATED = 2116
MSG_CHECKING_TEMPORAL = 2192
MSG_DEADLOCK = 2114
MSG_ASSUME_FALSE = 2104
MSG_ASSERT_FAILED = 2132
MSG_NESTED_EXPRESSIONS = 2103
MSG_UNEXPECTED_EXCEPTION = 1000
MSG_PARSE_FAILED = 3002
MSG_SIM_PROGRESS = 2209
MSG_SIM_STATES = 2210
MSG_CFG_UNDEFINED = 2229

_MARK = re.compile(r"@!@!@STARTMSG (\d+):(\d+) @!@!@\n?|@!@!@ENDMSG (\d+) @!@!@\n?")


@dataclass(frozen=True)
class Message:
    """One ``-tool`` message; nested messages are listed separately, in start order."""

    code: int
    level: int
    body: str


@dataclass
class TraceState:
    action: str  # operator name; "Initial predicate" for the first state
    action_location: str  # e.g. "line 5, col 9 to line 5, col 18 of module Counter"
    values: dict[str, Value]


@dataclass
class Trace:
    states: list[TraceState] = field(default_factory=list)
    loop_index: int | None = None  # 0-based index of the state a lasso returns to
    stuttering: bool = False  # the behaviour stutters forever after the last state


@dataclass
class TLCResult:
    verdict: Verdict
    violated_property: str | None
    counterexample: Trace | None
    distinct_states: int | None
    generated_states: int | None
    seconds: float
    tlc_version: str | None
    log_path: Path
    exit_code: int | None
    error: str | None = None
    # Every invariant TLC reported violated, first report first, with its counterexample
    # (more than one only under -continue; a timed-out run reports none).
    violations: dict[str, Trace | None] = field(default_factory=dict)
    # TLC explored every reachable state: it reported success, or checked the temporal
    # properties on the complete state space (only after a BFS that found no violation,
    # or under -continue), so every invariant in the cfg was checked in every state.
    complete: bool = False


# ---------------------------------------------------------------- output parsing


def parse_messages(text: str) -> tuple[list[Message], str]:
    """Split ``-tool`` output into messages and the untagged text (SANY's reports).

    Messages may nest (an exception message 1000 wraps e.g. an Assert message 2132).
    """
    messages: list[Message | None] = []
    stack: list[tuple[int, int, int, list[str]]] = []  # (slot, code, level, chunks)
    loose: list[str] = []
    pos = 0
    for m in _MARK.finditer(text):
        chunk = text[pos : m.start()]
        (stack[-1][3] if stack else loose).append(chunk)
        pos = m.end()
        if m.group(1) is not None:
            messages.append(None)
            stack.append((len(messages) - 1, int(m.group(1)), int(m.group(2)), []))
        elif stack:
            slot, code, level, chunks = stack.pop()
            messages[slot] = Message(code, level, "".join(chunks))
    (stack[-1][3] if stack else loose).append(text[pos:])
    for slot, code, level, chunks in stack:  # unterminated (process killed mid-message)
        messages[slot] = Message(code, level, "".join(chunks))
    return [m for m in messages if m is not None], "".join(loose)


_HEADER = re.compile(r"^\s*(\d+): (?:<(.*?)>|Stuttering)\s*$")
_BACK = re.compile(r"^\s*(\d+): Back to state")


def _action(header: str) -> tuple[str, str]:
    if header == "Initial predicate":
        return header, ""
    name, sep, loc = header.partition(" ")
    return name, loc if sep else ""


def parse_trace(messages: Sequence[Message]) -> Trace | None:
    """The first counterexample in the messages (2217 states, 2122 lasso, 2218 stutter)."""
    trace = Trace()
    for msg in messages:
        if msg.code == MSG_INVARIANT_VIOLATED_INITIAL:
            _, _, state = msg.body.partition("\n")
            return Trace([TraceState("Initial predicate", "", parse_state(state))])
        if msg.code == MSG_TRACE_STATE:
            header, _, state = msg.body.partition("\n")
            m = _HEADER.match(header)
            if m is None:
                raise TLCValueError(f"unrecognised trace state header {header!r}")
            if int(m.group(1)) == 1 and trace.states:
                break  # a second trace (-continue); keep the first
            name, loc = _action(m.group(2) or "")
            trace.states.append(TraceState(name, loc, parse_state(state)))
        elif msg.code == MSG_BACK_TO_STATE and trace.states:
            m = _BACK.match(msg.body)
            if m is not None:
                trace.loop_index = int(m.group(1)) - 1
            break
        elif msg.code == MSG_STUTTERING and trace.states:
            trace.stuttering = True
            break
    return trace if trace.states else None


# Messages that start only once the trace printed before them is complete: the next
# violation, success, final counts, finished (not progress: its place is not promised).
TRACE_CLOSERS = frozenset({MSG_INVARIANT_VIOLATED, MSG_INVARIANT_VIOLATED_INITIAL, MSG_SUCCESS,
                           MSG_FINAL_COUNTS, MSG_FINISHED})  # fmt: skip


def _violations(messages: Sequence[Message], stopped: bool) -> dict[str, Trace | None]:
    """The first report (2107 or 2110, with the trace after it) of each violated invariant;
    of a run killed by its ``stop`` predicate, only the reports it completed."""
    found: dict[str, Trace | None] = {}
    closer = max((i for i, m in enumerate(messages) if m.code in TRACE_CLOSERS), default=-1)
    for i, msg in enumerate(messages):
        m = re.search(r"Invariant (\S+) is violated", msg.body)
        if msg.code not in (MSG_INVARIANT_VIOLATED, MSG_INVARIANT_VIOLATED_INITIAL) or m is None:
            continue
        if stopped and i >= (closer if msg.code == MSG_INVARIANT_VIOLATED else len(messages) - 1):
            break
        if m.group(1) not in found:
            first = i if msg.code == MSG_INVARIANT_VIOLATED_INITIAL else i + 1
            found[m.group(1)] = parse_trace(messages[first:])
    return found


def cfg_properties(cfg_text: str) -> list[str]:
    """Names listed under PROPERTY/PROPERTIES in a TLC config file."""
    text = re.sub(r"\(\*.*?\*\)", " ", cfg_text, flags=re.DOTALL)
    text = re.sub(r"\\\*[^\n]*", " ", text)
    keywords = {
        "CONSTANT", "CONSTANTS", "INIT", "NEXT", "SPECIFICATION", "INVARIANT", "INVARIANTS",
        "PROPERTY", "PROPERTIES", "SYMMETRY", "CONSTRAINT", "CONSTRAINTS", "VIEW",
        "ACTION_CONSTRAINT", "ACTION_CONSTRAINTS", "CHECK_DEADLOCK", "POSTCONDITION", "ALIAS",
    }  # fmt: skip
    props: list[str] = []
    section = ""
    for tok in text.split():
        if tok in keywords:
            section = tok
        elif section in ("PROPERTY", "PROPERTIES"):
            props.append(tok)
    return props


def _find(messages: Sequence[Message], code: int) -> Message | None:
    return next((m for m in messages if m.code == code), None)


_INT = re.compile(r"-?\d+")


def _counts(messages: Sequence[Message]) -> tuple[int | None, int | None]:
    """(distinct, generated) from the final counts, else the initial-state count."""
    final = [m for m in messages if m.code == MSG_FINAL_COUNTS]
    if final:
        m = re.search(r"(\d+) states? generated, (\d+) distinct", final[-1].body)
        if m:
            return int(m.group(2)), int(m.group(1))
    sim = [m for m in messages if m.code in (MSG_SIM_STATES, MSG_SIM_PROGRESS)]
    if sim:
        m = re.search(r"(\d+) states generated|states generated: (\d+)", sim[-1].body)
        if m:
            return None, int(m.group(1) or m.group(2))
    init = _find(messages, MSG_INIT_DONE)
    if init:
        m = re.search(r"(\d+) distinct states? generated", init.body)
        if m:
            return int(m.group(1)), int(m.group(1))
    return None, None


def _version(messages: Sequence[Message]) -> str | None:
    msg = _find(messages, MSG_VERSION)
    if msg is None:
        return None
    m = re.search(r"Version (\S+).*?\(rev: (\w+)\)", msg.body)
    return f"{m.group(1)} (rev {m.group(2)})" if m else one_line(msg.body)


def _error_message(rc: int, messages: Sequence[Message], loose: str, spec: Path, cfg: Path) -> str:
    """The one-line reason for an error verdict (without the raw-log suffix)."""
    files = module_files(loose)
    if rc == 150 or _find(messages, MSG_PARSE_FAILED):
        return sany_error(loose, spec) or f"{spec}: parsing or semantic analysis failed"
    if rc == 10 or _find(messages, MSG_ASSUME_FALSE):
        msg = _find(messages, MSG_ASSUME_FALSE)
        where = location(msg.body, files) if msg else None
        return f"{where or spec}: ASSUME is false"
    if rc == 151:
        msg = _find(messages, MSG_CFG_UNDEFINED)
        if msg:
            m = re.search(r"The (?:\w+ )+?(\S+) specified in the configuration file", msg.body)
            if m:
                return f"unknown name in cfg {cfg}: {m.group(1)}"
        errs = [m for m in messages if m.level == 1]
        return f"unknown name in cfg {cfg}: {one_line(errs[0].body) if errs else ''}".strip()
    if rc == 255:
        inner = [m for m in messages if m.code == 5001] or [
            m for m in messages if m.level == 1 and m.code != MSG_UNEXPECTED_EXCEPTION
        ]
        detail = one_line(inner[0].body) if inner else f"cannot read {cfg}"
        return f"bad or missing cfg {cfg}: {detail}"
    if rc == 1:
        errs = [m for m in messages if m.level == 1]
        detail = errs[0].body.strip().splitlines()[0] if errs else "bad command-line option"
        return f"TLC rejected its arguments: {detail}"
    assert_msg = _find(messages, MSG_ASSERT_FAILED)
    nested = _find(messages, MSG_NESTED_EXPRESSIONS)
    where = location(nested.body, files) if nested else None
    if assert_msg:
        what = one_line(assert_msg.body.partition(":")[2]) or one_line(assert_msg.body)
        return f"{where or spec}: Assert failed: {what}"
    exc = _find(messages, MSG_UNEXPECTED_EXCEPTION)
    # The most specific text first: a message nested in the exception, another error, the
    # exception itself.
    inner = [m for m in messages if m.level == 0 and exc and m.body and m.body in exc.body]
    wrappers = (MSG_UNEXPECTED_EXCEPTION, MSG_NESTED_EXPRESSIONS)
    errs = [m for m in messages if m.code not in wrappers and m.level == 1]
    best = next(iter(inner + errs + ([exc] if exc else [])), None)
    detail = one_line(best.body) if best else "no success message"
    prefix = f"{where}: " if where else ""
    return f"{prefix}TLC exited with code {rc}: {detail}"


def _temporal_name(cfg: Path) -> str | None:
    try:
        props = cfg_properties(cfg.read_text())
    except OSError:
        return None
    return props[0] if len(props) == 1 else None


def interpret(
    text: str,
    rc: int | None,
    spec: Path,
    cfg: Path,
    log_path: Path,
    seconds: float,
    *,
    timed_out: bool = False,
    simulate: bool = False,
    stopped: bool = False,
) -> TLCResult:
    """Build a TLCResult from TLC's ``-tool`` output and its exit status: complete, or up
    to where a ``stop`` predicate ended the run (``stopped``: its SIGKILL is no error)."""
    messages, loose = parse_messages(text)
    # A stopped run printed no final counts; its first ones (initial states) would mislead.
    distinct, generated = (None, None) if stopped else _counts(messages)
    suffix = f"; raw log: {log_path}"
    complete = _find(messages, MSG_SUCCESS) is not None or any(
        m.code == MSG_CHECKING_TEMPORAL and " complete state space" in m.body for m in messages
    )

    def result(
        verdict: Verdict, prop: str | None = None, trace: Trace | None = None,
        error: str | None = None,
    ) -> TLCResult:  # fmt: skip
        version = _version(messages)
        return TLCResult(verdict, prop, trace, distinct, generated, seconds, version, log_path,
                         rc, error, complete=complete)  # fmt: skip

    if timed_out:
        return result("timeout", error=f"TLC timed out after {seconds:.1f}s{suffix}")
    if rc is not None and rc < 0 and not stopped:
        return result("error", error=f"TLC was killed by signal {-rc}{suffix}")
    if "java.lang.OutOfMemoryError" in text:
        return result(
            "error", error=f"TLC ran out of memory (raise -Xmx via KVSPEC_TLC_XMX){suffix}"
        )

    def with_trace(verdict: Verdict, prop: str | None) -> TLCResult:
        try:
            return result(verdict, prop, parse_trace(messages))
        except TLCValueError as exc:
            return result(verdict, prop, None, f"cannot parse TLC's counterexample: {exc}{suffix}")

    inv = _find(messages, MSG_INVARIANT_VIOLATED_INITIAL) or _find(messages, MSG_INVARIANT_VIOLATED)
    if inv is not None:
        try:
            found = _violations(messages, stopped)
        except TLCValueError:
            m = re.search(r"Invariant (\S+) is violated", inv.body)
            return with_trace("violated", m.group(1) if m else None)  # says what failed
        prop, trace = next(iter(found.items()), (None, None))
        res = result("violated", prop, trace)
        res.violations = found
        return res
    if _find(messages, MSG_TEMPORAL_VIOLATED) is not None:
        return with_trace("violated", _temporal_name(cfg))
    if _find(messages, MSG_DEADLOCK) is not None:
        return with_trace("deadlock", None)
    ok = _find(messages, MSG_SUCCESS) is not None or (
        simulate
        and _find(messages, MSG_FINISHED) is not None
        and not any(m.level == 1 for m in messages)
    )
    if rc == 0 and ok:
        return result("holds")
    return result("error", error=_error_message(rc or 0, messages, loose, spec, cfg) + suffix)


# ---------------------------------------------------------------- running


# TLC 2.15 resolves -config against the spec's directory when the spec path has one
# (an absolute spec + absolute cfg is "File not found"), so TLC runs in the spec's
# directory with the spec given by file name and everything else absolute.


def run_tlc(
    spec: Path,
    config: Path | None = None,
    *,
    workers: int = 1,
    fp: int = 0,
    seed: int = 0,
    timeout_s: float = 600,
    deadlock: bool = True,
    extra_args: Sequence[str] = (),
    log_dir: Path | None = None,
    simulate: tuple[int, int] | None = None,
    dump_dot: Path | None = None,
    stop: Callable[[str], bool] | None = None,
    poll_s: float = 0.1,
    jvm_flags: Sequence[str] | None = None,
) -> TLCResult:
    """Model-check ``spec`` with TLC and return the parsed result.

    ``config`` defaults to SPEC.cfg; ``deadlock=False`` passes ``-deadlock`` (do not check
    for deadlock); ``simulate=(num, depth)`` runs random simulation. Never hangs: on
    timeout the whole process group is killed and the verdict is "timeout". ``stop`` is
    asked every ``poll_s`` seconds with the log so far (when it grew); once it says yes,
    TLC is killed and the result is read from that log (``kvspec.tlc_continue``).
    ``jvm_flags`` replaces the default JVM flags (``kvspec.tools.QUICK_JVM``: short runs).
    """
    spec = Path(spec).resolve()
    cfg = (Path(config) if config is not None else spec.with_suffix(".cfg")).resolve()
    base = Path(log_dir if log_dir is not None else os.environ.get("KVSPEC_TLC_DIR", "build/tlc"))
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{spec.stem}-", dir=base)).resolve()
    log_path = run_dir / "tlc.log"
    metadir = run_dir / "meta"
    java_tmp = run_dir / "tmp"
    java_tmp.mkdir()
    try:
        args = tlc_args(
            Path(spec.name), cfg, metadir, workers=workers, fp=fp, seed=seed, deadlock=deadlock,
            extra_args=extra_args, simulate=simulate,
            dump_dot=Path(dump_dot).resolve() if dump_dot else None,
        )  # fmt: skip
        cmd = java_command("tlc2.TLC", args, jvm_flags)
    except (JavaMissing, JarError) as exc:
        log_path.write_text(f"{exc}\n")
        error = f"{exc}; raw log: {log_path}"
        return TLCResult("error", None, None, None, None, 0.0, None, log_path, None, error)
    cmd.insert(1, f"-Djava.io.tmpdir={java_tmp}")
    start = time.monotonic()
    with log_path.open("wb") as log:
        # Output goes straight to the file (no pipe to fill up); own session so the
        # whole group can be killed, including anything java forks.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=spec.parent, start_new_session=True
        )
        try:
            rc, timed_out, stopped = wait_tlc(proc, timeout_s, log_path, stop, poll_s)
        except BaseException:
            kill_group(proc)
            raise
    seconds = time.monotonic() - start
    if not os.environ.get("KVSPEC_KEEP_METADIR"):
        shutil.rmtree(metadir, ignore_errors=True)
        shutil.rmtree(java_tmp, ignore_errors=True)
    text = log_path.read_text(errors="replace")
    return interpret(
        text, rc, spec, cfg, log_path, seconds, timed_out=timed_out,
        simulate=simulate is not None, stopped=stopped,
    )  # fmt: skip
