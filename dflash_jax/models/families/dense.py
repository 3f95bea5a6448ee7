"""LLaMA-2/3.x, Mistral, Qwen2/2.5 and Qwen3: the dense decoder every other family differs from.

Their differences are the attention biases (Qwen2: always on q/k/v, never on o; the others: ``attention_bias``
on all four), LLaMA's ``mlp_bias`` and Qwen3's per-head q/k RMSNorm."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import ConfigError, TargetFields, bool_field, require, rope_to_hf
from dflash_jax.models.families.common import check_silu, no_sliding_window


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """LLaMA, Mistral, Qwen2 and Qwen3."""
    model_type = cfg["model_type"]
    check_silu(cfg, source)
    no_sliding_window(cfg, source)
    if model_type == "mistral" and cfg.get("sliding_window") is not None:
        # Mistral applies its window whenever the field is set (Qwen gate it behind use_sliding_window).
        raise ConfigError(f"{source}: Mistral sliding_window={cfg['sliding_window']} is not supported "
                          "(set it to null only if the model was trained without a window)")
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    return dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        # Qwen2 always has q/k/v bias and no o bias; LLaMA/Qwen3 use attention_bias for all four.
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool_field(cfg, "mlp_bias", source, False),
        qk_norm=model_type == "qwen3",
    )


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    if config.model_type == "qwen2":  # its biases are fixed: Qwen2Config has no attention_bias
        del out["attention_bias"]
    if config.model_type == "llama":
        out["mlp_bias"] = config.mlp_bias
    return {**out, **rope_to_hf(config.rope)}
