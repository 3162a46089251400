"""An experiment, not a fix: put this directory on PYTHONPATH of `kvspec scenario` and every
engine process re-checks vLLM's shm message queue every 100 ms instead of 5 s
(`device_communicators/shm_broadcast.py:72`, SHM_READER_RECHECK_INTERVAL_MS). On 2 shared
cores it turns the decode engine's 8-12 s stalls into <= 1 s (README, "Real engines").

    PYTHONPATH=bench/shm_recheck kvspec scenario pd-queued-heartbeats
"""

import sys

_ENGINE = ("scenario_engine", "multiprocessing")
if any(k in a for a in sys.argv for k in _ENGINE) or sys.argv[:1] == ["-c"]:
    try:
        import vllm.distributed.device_communicators.shm_broadcast as _shm

        _shm.SHM_READER_RECHECK_INTERVAL_MS = 100
    except Exception as exc:  # noqa: BLE001 - an experiment must not stop the engine
        print(f"kvspec shm_recheck: not applied: {exc!r}", file=sys.stderr)
