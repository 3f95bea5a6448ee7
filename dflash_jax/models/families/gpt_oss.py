"""gpt-oss (20b, 120b): experts on every layer (top-k of biased logits, softmax over the k, clamped SwiGLU with
biases); attention with biases and learned sinks; sliding and full layers alternate."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import (
    ConfigError, ExpertsConfig, TargetFields, float_field, int_field, require, rope_to_hf,
)
from dflash_jax.models.families.common import (
    FULL, SLIDING, num_experts, sliding_layer_types, top_k, windows, windows_to_hf,
)


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Its ``hidden_act`` field says "silu" but the experts use the clamped form (not checked here)."""
    experts = num_experts(cfg, source)
    window = int_field(cfg, "sliding_window", source, None)
    # transformers' default: even layers slide
    types = sliding_layer_types(cfg, source, num_layers, [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)])
    if SLIDING in types and window is None:
        raise ConfigError(f"{source}: sliding_attention layers need a 'sliding_window'")
    limit = float_field(cfg, "swiglu_limit", source, 7.0, positive=True)
    return dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        qkv_bias=True, o_bias=True,
        experts=ExpertsConfig(
            num_experts=experts, top_k=top_k(cfg, source, experts),
            intermediate_size=require(cfg, "intermediate_size", source),
            routing="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
            swiglu_limit=limit),
        expert_layers=tuple(range(num_layers)),
        layer_windows=windows(types, window),
        attention_sinks=True,
        norm_weight_in_float32=True,
    )


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    e = config.experts
    out.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k, intermediate_size=e.intermediate_size,
               swiglu_limit=e.swiglu_limit, **windows_to_hf(config))
    return {**out, **rope_to_hf(config.rope)}
