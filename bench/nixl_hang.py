"""What a NIXL READ does while the agent it reads from hangs, and once that agent dies:
two bare NIXL agents (UCX backend, DRAM), no vLLM. The target agent runs in a child
process; after one READ that completes, the child is stopped (SIGSTOP) and a second READ
is posted and polled for `--hang-s` seconds, then the child is killed (SIGKILL) and the
READ polled again. Backs Decode.tla's ProducerHangs (spec/README.md, "The decode side").

    python bench/nixl_hang.py [--hang-s 10] [--transports default,tcp] [--size 65536]

One row per transport (UCX_TLS; "default": UCX's own choice): the state of the READ after
the hang, and what polling it said after the kill. Every wait has a deadline; a child
that never answers ends the run with exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

# The target agent: registers a buffer, prints its agent metadata and descriptors as one
# JSON line, then waits (its NIXL agent's progress thread serves READs) until killed.
TARGET = r"""
import base64, json, sys, time
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
size = int(sys.argv[1])
a = nixl_agent("P", nixl_agent_config(backends=["UCX"]))
buf = np.ones(size, dtype=np.uint8)
a.register_memory(a.get_reg_descs([(buf.ctypes.data, size, 0, "")], "DRAM"))
xd = a.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
print(json.dumps({"meta": base64.b64encode(a.get_agent_metadata()).decode(),
                  "descs": base64.b64encode(a.get_serialized_descs(xd)).decode()}), flush=True)
while True:
    time.sleep(0.01)
    a.get_new_notifs()
"""


def _poll(agent: Any, handle: Any, for_s: float) -> str:
    """Poll a READ until it leaves PROC or for_s passes; its state, or the exception."""
    deadline = time.monotonic() + for_s
    try:
        state = str(agent.check_xfer_state(handle))
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = str(agent.check_xfer_state(handle))
        return state
    except Exception as exc:  # NIXL reports a dead peer by raising
        return type(exc).__name__


def one(transport: str, hang_s: float, size: int) -> dict[str, object]:
    import base64

    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    # this process runs one transport (main starts one per row): both agents' UCX
    # contexts read UCX_TLS from the environment they start with
    child = subprocess.Popen([sys.executable, "-c", TARGET, str(size)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        got = json.loads(_readline(child, 120))
        d = nixl_agent("D", nixl_agent_config(backends=["UCX"]))
        name = d.add_remote_agent(base64.b64decode(got["meta"]))
        buf = np.zeros(size, dtype=np.uint8)
        d.register_memory(d.get_reg_descs([(buf.ctypes.data, size, 0, "")], "DRAM"))
        local = d.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
        remote = d.deserialize_descs(base64.b64decode(got["descs"]))
        warm = d.initialize_xfer("READ", local, remote, name, b"warm")
        d.transfer(warm)
        first = _poll(d, warm, 30)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.5)  # SIGSTOP lands asynchronously
        h = d.initialize_xfer("READ", local, remote, name, b"hung")
        d.transfer(h)
        hung = _poll(d, h, hang_s)
        child.kill()
        child.wait(30)
        after = _poll(d, h, 30)
        return {"transport": transport, "first_read": first, "hang_s": hang_s,
                "while_hung": hung, "after_kill": after}  # fmt: skip
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)


def _readline(child: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The child's first stdout line that is a JSON object (NIXL logs to stdout too), or
    exit 2 if none comes in timeout_s. A reader thread, so the wait has a deadline."""
    import queue
    import threading

    assert child.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    out = child.stdout

    def read() -> None:
        for raw in out:
            lines.put(raw.decode(errors="replace"))
        lines.put("")  # EOF

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while (line := lines.get(timeout=max(0.0, deadline - time.monotonic()))) != "":
            if line.startswith("{"):
                return line
    except queue.Empty:
        pass
    child.kill()
    print(f"bench/nixl_hang.py: the target agent said nothing in {timeout_s:.0f} s",
          file=sys.stderr)  # fmt: skip
    sys.exit(2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hang-s", type=float, default=10.0)
    p.add_argument("--transports", default="default,tcp")
    p.add_argument("--size", type=int, default=65536)
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row, in a process of its own
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.hang_s, a.size)), flush=True)
        return 0
    print(f"{'UCX_TLS':10} {'first READ':10} {'while hung':>18} {'after the kill':>28}")
    for t in a.transports.split(","):
        env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
        if t != "default":
            env["UCX_TLS"] = t
        out = subprocess.run([sys.executable, __file__, "--one", t, "--hang-s", str(a.hang_s),
                              "--size", str(a.size)], env=env, capture_output=True,
                             timeout=a.hang_s + 300)  # fmt: skip
        rows = [x for x in out.stdout.decode().splitlines() if x.startswith("{")]
        if out.returncode != 0 or not rows:
            print(f"bench/nixl_hang.py: the {t} row failed (exit {out.returncode})",
                  file=sys.stderr)  # fmt: skip
            return 2
        row = json.loads(rows[-1])
        hung = f"{row['while_hung']} after {a.hang_s:g} s"
        print(f"{t:10} {row['first_read']!s:10} {hung:>18} {row['after_kill']!s:>28}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
