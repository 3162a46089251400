"""kvspec: TLA+ specification and conformance suite for vLLM's KV-connector completion protocol."""

__version__ = "0.1.0"
