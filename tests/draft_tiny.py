"""A tiny draft/target pairing shared by draft, checkpoint and engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from reference_draft_numpy import random_official_draft_weights

HIDDEN, VOCAB, TARGET_LAYERS = 64, 97, 4


def official_config(**overrides) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "attention_bias": False, "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None, "use_sliding_window": True, "max_position_embeddings": 512, "vocab_size": VOCAB, "hidden_act": "silu",
        "block_size": 8, "num_target_layers": TARGET_LAYERS,
        "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1},
    }
    cfg.update(overrides)
    return cfg


def write_official_draft(out_dir: Path, config: dict, seed: int = 0, dtype=np.float32) -> dict:
    """A random draft in the official on-disk layout (as the reference code would save it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(config["dflash_config"]["target_layer_ids"])
    weights = random_official_draft_weights(config, n, np.random.default_rng(seed), dtype=dtype)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return weights
