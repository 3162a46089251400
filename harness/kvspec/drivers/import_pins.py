"""Drop the tracebacks of import errors that vLLM keeps at module level, so that they pin
no frame of ours.

vLLM 0.32 keeps the error of an optional import for a later `raise ... from` (e.g.
`vllm/multimodal/media/audio.py:40-45`, `_torchcodec_import_exc`: the Makefile removes
torchcodec, so it is always set). The error's traceback holds the frame that imported the
module, and through `f_back` every frame that was on the stack at vLLM's first import,
each with the locals it held when it returned. In a harness process that is
`build_cluster`'s frame with its last decode worker `cw`: that worker's NIXL agent was
never destroyed, and its progress thread (NIXL sets `pthrDelay = 0`) spun one core for the
rest of the process (measured 2026-12-03: one busy thread per process after
`shutdown_pool`, found by walking `gc.get_referrers` from the surviving worker).

Only `__traceback__` is dropped: the error's type, message and cause stay, so vLLM's
`raise ImportError(...) from exc` still names what was missing.
"""

from __future__ import annotations

import sys


def unpin_import_tracebacks(prefix: str = "vllm") -> int:
    """Clear the traceback of every exception kept as a module global of a loaded module
    named `prefix` or `prefix.*`. Returns how many were cleared."""
    cleared = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            if isinstance(value, BaseException) and value.__traceback__ is not None:
                value.__traceback__ = None
                cleared += 1
    return cleared
