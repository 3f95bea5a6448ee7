"""The hybrid Gated DeltaNet decoders: Qwen3-Next, Qwen3.5 and Qwen3.6 (dense and MoE).

Gated DeltaNet layers with a full-attention layer every ``full_attention_interval``; the full layers gate their
output per head and rotate a part of each head; every RMSNorm but the DeltaNet's output norm is zero-centred.
FFN: dense (Qwen3.5), experts with a shared expert on every layer (Qwen3.5-MoE) or by
``decoder_sparse_step``/``mlp_only_layers`` (Qwen3-Next)."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import (
    REQUIRED, ConfigError, ExpertsConfig, GatedDeltaNetConfig, TargetFields, attention_shape, bool_field,
    float_field, int_field, require, rope_to_hf,
)
from dflash_jax.models.families.common import (
    FULL, check_silu, dense_only_layers, partial_rope_to_hf, partial_rotary_dim, sparse_layers, top_k,
)

LINEAR = "linear_attention"


def _layer_types(cfg: Mapping[str, Any], source: str, num_layers: int) -> list[str]:
    """``layer_types`` (or, absent, every ``full_attention_interval``-th layer full)."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int_field(cfg, "full_attention_interval", source, 4)
        return [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not all(
            isinstance(t, str) and t in (LINEAR, FULL) for t in types):
        raise ConfigError(f"{source}: field 'layer_types' must list 'linear_attention' or 'full_attention' for "
                          f"each of the {num_layers} layers, got {types!r}")
    return types


def _linear_attention(cfg: Mapping[str, Any], source: str, hidden: int) -> GatedDeltaNetConfig:
    nk = int_field(cfg, "linear_num_key_heads", source)
    nv = int_field(cfg, "linear_num_value_heads", source)
    if nv % nk:
        raise ConfigError(f"{source}: linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads "
                          f"({nk})")
    return GatedDeltaNetConfig(
        hidden_size=hidden, num_k_heads=nk, num_v_heads=nv,
        head_k_dim=int_field(cfg, "linear_key_head_dim", source),
        head_v_dim=int_field(cfg, "linear_value_head_dim", source),
        conv_kernel=int_field(cfg, "linear_conv_kernel_dim", source, 4, minimum=2, maximum=64),
        eps=float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True, below=1.0))


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    model_type = cfg["model_type"]
    check_silu(cfg, source)
    types = _layer_types(cfg, source, num_layers)
    hidden, _, _, head_dim = attention_shape(cfg, source)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    out: dict[str, Any] = dict(
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True,
        linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
        linear_attention=_linear_attention(cfg, source, hidden),
        attention_output_gate=True, rotary_dim=partial_rotary_dim(cfg, source, head_dim),
        zero_centered_norms=True,
    )
    routed = model_type != "qwen3_5_text" and int_field(cfg, "num_experts", source, 0, minimum=0) > 0
    expert_layers: tuple[int, ...] = ()
    if routed:
        num_experts = int_field(cfg, "num_experts", source)
        if model_type == "qwen3_next":
            expert_layers = sparse_layers(cfg, source, num_layers)
        else:  # Qwen3.5-MoE: every layer
            expert_layers = tuple(range(num_layers))
        out["experts"] = ExpertsConfig(
            num_experts=num_experts, top_k=top_k(cfg, source, num_experts),
            intermediate_size=require(cfg, "moe_intermediate_size", source), routing="softmax_topk",
            # Qwen3.5-MoE's router always renormalises its top-k (it has no norm_topk_prob field).
            norm_topk_prob=bool_field(cfg, "norm_topk_prob", source, True) if model_type == "qwen3_next" else True,
            shared_intermediate_size=int_field(cfg, "shared_expert_intermediate_size", source, 0, minimum=0))
    out["expert_layers"] = expert_layers
    out["intermediate_size"] = int_field(cfg, "intermediate_size", source,
                                         REQUIRED if len(expert_layers) < num_layers else 1)
    return out


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    la, e = config.linear_attention, config.experts
    out.update(layer_types=[LINEAR if config.is_linear_layer(i) else FULL for i in range(config.num_hidden_layers)],
               linear_num_key_heads=la.num_k_heads, linear_num_value_heads=la.num_v_heads,
               linear_key_head_dim=la.head_k_dim, linear_value_head_dim=la.head_v_dim,
               linear_conv_kernel_dim=la.conv_kernel, partial_rotary_factor=config.rotary_dims / config.head_dim)
    if e is not None:
        out.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.intermediate_size,
                   norm_topk_prob=e.norm_topk_prob, shared_expert_intermediate_size=e.shared_intermediate_size)
    if config.model_type == "qwen3_next":
        out.update(decoder_sparse_step=1, mlp_only_layers=dense_only_layers(config))
    return partial_rope_to_hf(config, {**out, **rope_to_hf(config.rope)})
