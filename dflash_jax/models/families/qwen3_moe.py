"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention, softmax-routed experts on the layers its
sparse schedule names."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import (
    REQUIRED, ExpertsConfig, TargetFields, bool_field, int_field, require, rope_to_hf,
)
from dflash_jax.models.families.common import (
    check_silu, dense_only_layers, no_sliding_window, num_experts, sparse_layers, top_k,
)


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Layer i routes through experts iff it is not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0``."""
    check_silu(cfg, source)
    no_sliding_window(cfg, source)
    experts = num_experts(cfg, source)
    expert_layers = sparse_layers(cfg, source, num_layers)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    return dict(
        # The dense layers' width; a config whose every layer is sparse may omit it.
        intermediate_size=int_field(cfg, "intermediate_size", source,
                                    REQUIRED if len(expert_layers) < num_layers else 1),
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True,
        experts=ExpertsConfig(
            num_experts=experts, top_k=top_k(cfg, source, experts),
            intermediate_size=require(cfg, "moe_intermediate_size", source),
            routing="softmax_topk", norm_topk_prob=bool_field(cfg, "norm_topk_prob", source, False)),
        expert_layers=expert_layers,
    )


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    e = config.experts
    out.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.intermediate_size,
               norm_topk_prob=e.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense_only_layers(config))
    return {**out, **rope_to_hf(config.rope)}
