"""MiniMax-M2 (M2, M2.1, M2.5, M2.7): Qwen3-MoE-like, with q/k RMSNorms over the whole projection (before the
head split), partial RoPE (split halves within the rotated dims), full attention, and on every layer experts
chosen by sigmoid scores plus a selection-only correction bias, weighted by their renormalised scores (no shared
expert, no groups, no routed scaling)."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import (
    ConfigError, ExpertsConfig, TargetFields, attention_shape, int_field, parse_rope, present, require, rope_to_hf,
)
from dflash_jax.models.families.common import (
    check_silu, no_sliding_window, num_experts, partial_rope_to_hf, partial_rotary_dim, rope_parameters_of, top_k,
)

# Fields that transformers' MiniMaxM2 does not read (it hard-codes what they describe): released config.json
# files carry them, so a value other than the one computed here is refused, not ignored.
MINIMAX_M2_FIXED = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                    "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "attention_bias": False}
DEFAULT_ROPE_THETA = 5000000.0  # MiniMaxM2Config.default_theta


def _rotary_dim_checked(cfg: Mapping[str, Any], source: str, head_dim: int) -> int:
    """The rotary dims of ``partial_rotary_factor`` (``partial_rotary_dim``), with a ``rotary_dim`` field (as
    MiniMax's own config.json files carry) required to agree: transformers reads only the factor (absent: 1,
    every dim rotates) and ignores ``rotary_dim``, MiniMax's code reads ``rotary_dim``; where they disagree
    the model's rotary size is ambiguous and the config is refused."""
    dim = partial_rotary_dim(cfg, source, head_dim)
    if present(cfg, "rotary_dim"):
        given = int_field(cfg, "rotary_dim", source, maximum=head_dim)
        if given != dim:
            raise ConfigError(
                f"{source}: field 'rotary_dim' ({given}) disagrees with partial_rotary_factor ({dim / head_dim:g}, "
                f"absent means 1), which rotates {dim} of head_dim {head_dim}: transformers reads only the factor, "
                f"MiniMax's own code reads rotary_dim. Set \"partial_rotary_factor\": {given / head_dim:g} (in "
                f"rope_parameters or at the top level) if the model rotates {given} dims, or remove 'rotary_dim'")
    return dim


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    check_silu(cfg, source)
    no_sliding_window(cfg, source)
    for key, value in MINIMAX_M2_FIXED.items():
        if present(cfg, key) and cfg[key] != value:
            raise ConfigError(f"{source}: field {key!r} is {cfg[key]!r}, but transformers' MiniMaxM2 (what this "
                              f"implementation computes) always has {value!r}")
    types = cfg.get("attn_type_list")
    if types is not None and (not isinstance(types, list) or any(t != 1 for t in types)):
        raise ConfigError(f"{source}: field 'attn_type_list' must be all 1 (softmax attention on every layer), "
                          f"got {types!r}")
    if not present(cfg, "head_dim"):  # transformers' class default, not hidden_size / num_attention_heads
        raise ConfigError(f"{source}: a minimax_m2 config needs 'head_dim' (transformers defaults it to 128, not "
                          "to hidden_size / num_attention_heads)")
    _, _, _, head_dim = attention_shape(cfg, source)
    rotary = _rotary_dim_checked(cfg, source, head_dim)
    if not present(cfg, "rope_theta") and not present(rope_parameters_of(cfg), "rope_theta"):
        cfg = {**cfg, "rope_theta": DEFAULT_ROPE_THETA}
    experts = num_experts(cfg, source)
    width = require(cfg, "intermediate_size", source)  # of one expert (every layer routes)
    return dict(
        intermediate_size=width,
        qk_norm=True, qk_norm_scope="projection",
        rotary_dim=rotary if rotary != head_dim else 0,
        rope=parse_rope(cfg, source),
        experts=ExpertsConfig(
            num_experts=experts, top_k=top_k(cfg, source, experts), intermediate_size=width,
            routing="sigmoid_topk", norm_topk_prob=True, selection_bias=True),
        expert_layers=tuple(range(num_layers)),
    )


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    e = config.experts
    del out["attention_bias"]  # always False (MINIMAX_M2_FIXED): not written
    out.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k, intermediate_size=e.intermediate_size)
    return partial_rope_to_hf(config, {**out, **rope_to_hf(config.rope)})
