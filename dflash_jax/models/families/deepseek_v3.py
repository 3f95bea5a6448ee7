"""Multi-head latent attention decoders: DeepSeek-V3 and Kimi K2 / K2.5-K2.7's text decoder (``kimi_k2``, which
transformers reads as a DeepseekV3Config; ``kimi_k25`` nests it under ``text_config``). GLM-5 (``glm_moe_dsa``)
builds on this module."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import (
    ConfigError, ExpertsConfig, MLAConfig, TargetFields, bool_field, float_field, int_field, parse_rope, present,
    require, rope_to_hf, yarn_get_mscale,
)
from dflash_jax.models.families.common import check_silu, rope_parameters_of

KIMI_TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")  # what a kimi_k25 text_config may say

# Fields of DeepSeek's own config.json that transformers does not read (it hard-codes what they describe):
# a value other than the one computed here is refused, not ignored.
DEEPSEEK_V3_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def _head_dims(cfg: Mapping[str, Any], source: str) -> tuple[int, int]:
    """``qk_nope_head_dim, qk_rope_head_dim`` (transformers' defaults 128 and 64)."""
    return (int_field(cfg, "qk_nope_head_dim", source, 128),
            int_field(cfg, "qk_rope_head_dim", source, 64))


def prepare(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """An MLA config with the generic attention fields as the decoder reads them. transformers derives
    ``head_dim`` from ``qk_rope_head_dim`` (the RoPE size) and uses ``num_key_value_heads`` only to repeat the
    expanded keys, one per query head already (its sdpa path ignores it; 5.x writes the class default, 128, for
    any head count): neither is read. Here: one key head per query head, of the query-key size."""
    nope, rope = _head_dims(cfg, source)
    if rope % 2 or nope % 2:
        raise ConfigError(f"{source}: fields 'qk_nope_head_dim' ({nope}) and 'qk_rope_head_dim' ({rope}) must be "
                          "even (RoPE turns pairs; the head sizes of every released model are)")
    heads = require(cfg, "num_attention_heads", source)
    return {**cfg, "num_key_value_heads": heads, "head_dim": nope + rope}


def kimi_text_config(top: Mapping[str, Any], text: dict[str, Any], source: str) -> dict[str, Any]:
    """The text decoder of a ``kimi_k25`` config.json (``text``: its ``text_config`` as read)."""
    # Its text_config says kimi_k2 (released) or deepseek_v3 (transformers 5.x writes what it maps it to).
    if text["model_type"] not in KIMI_TEXT_MODEL_TYPES:
        raise ConfigError(f"{source} (text_config): model_type {text['model_type']!r} is not a Kimi text "
                          f"decoder (expected 'kimi_k2' or 'deepseek_v3')")
    # transformers ties the head by the TOP-LEVEL flag, whose class default is True, whatever text_config
    # says (5.x writes False there); released configs set it at the top level.
    return {**text, "model_type": "kimi_k2",
            "tie_word_embeddings": bool_field(top, "tie_word_embeddings", source, True)}


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """DeepSeek-V3 and Kimi K2's text decoder (transformers' DeepseekV3): multi-head latent attention on every
    layer (``MLAConfig``, SPEC 11.4), dense SwiGLU layers first (``first_k_dense_replace``), then experts chosen
    by sigmoid scores plus a selection-only correction bias within the best ``topk_group`` of ``n_group`` groups,
    weighted by their renormalised scores times ``routed_scaling_factor``, plus ungated shared experts. The
    multi-token-prediction layer (``model.layers.{num_hidden_layers}``) is not part of the decoder."""
    check_silu(cfg, source)
    for key, value in DEEPSEEK_V3_FIXED.items():
        if present(cfg, key) and cfg[key] != value:
            raise ConfigError(f"{source}: field {key!r} is {cfg[key]!r}, but transformers' DeepseekV3 (what this "
                              f"implementation computes) always has {value!r}")
    for key in ("n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace"):
        if key in cfg and cfg[key] is None:  # transformers would fail on these, not default them
            raise ConfigError(f"{source}: field {key!r} must be an integer, got null")
    nope, rope_dim = _head_dims(cfg, source)
    rope = parse_rope(cfg, source)
    if rope.rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: rope type {rope.rope_type!r} is not supported for multi-head latent attention "
                          "(only 'default' and 'yarn')")
    for where in (cfg, rope_parameters_of(cfg)):
        if present(where, "partial_rotary_factor") and where["partial_rotary_factor"] != 1:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' is {where['partial_rotary_factor']!r}; "
                              "multi-head latent attention rotates all of qk_rope_head_dim (only 1)")
    scale = (nope + rope_dim) ** -0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:  # transformers' yarn_apply_mscale, in the same order
        mscale = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    q_lora = 0 if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None else int_field(cfg, "q_lora_rank", source, 1536)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    mla = MLAConfig(q_lora_rank=q_lora, kv_lora_rank=int_field(cfg, "kv_lora_rank", source, 512),
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                    v_head_dim=int_field(cfg, "v_head_dim", source, 128),
                    rope_interleave=bool_field(cfg, "rope_interleave", source, True), softmax_scale=scale,
                    attention_bias=attention_bias)

    key = "n_routed_experts" if present(cfg, "n_routed_experts") or not present(cfg, "num_local_experts") \
        else "num_local_experts"  # transformers' attribute_map: num_local_experts is n_routed_experts
    num_experts = int_field(cfg, key, source, 256)
    top_k = int_field(cfg, "num_experts_per_tok", source, 8, maximum=num_experts)
    n_group = int_field(cfg, "n_group", source, 8, maximum=num_experts)
    topk_group = int_field(cfg, "topk_group", source, 4, maximum=n_group)
    per_group = num_experts // n_group
    if num_experts % n_group or per_group < 2:
        raise ConfigError(f"{source}: n_routed_experts ({num_experts}) must split into n_group ({n_group}) equal "
                          "groups of at least 2 experts (a group scores the sum of its two best experts)")
    if topk_group * per_group < top_k:
        raise ConfigError(f"{source}: topk_group ({topk_group}) groups of {per_group} experts cannot hold "
                          f"num_experts_per_tok ({top_k}) experts")
    first_dense = int_field(cfg, "first_k_dense_replace", source, 3, minimum=0, maximum=num_layers)
    width = int_field(cfg, "moe_intermediate_size", source, 2048)
    shared = int_field(cfg, "n_shared_experts", source, 1, minimum=0)
    return dict(
        intermediate_size=int_field(cfg, "intermediate_size", source, 18432),
        rope=rope, mla=mla, qkv_bias=False, o_bias=attention_bias,
        experts=ExpertsConfig(
            num_experts=num_experts, top_k=top_k, intermediate_size=width, routing="sigmoid_topk",
            norm_topk_prob=bool_field(cfg, "norm_topk_prob", source, True), selection_bias=True,
            shared_intermediate_size=width * shared, shared_expert_gate=False, n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float_field(cfg, "routed_scaling_factor", source, 2.5, positive=True),
            norm_eps=1e-20),
        expert_layers=tuple(range(first_dense, num_layers)),
    )


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    """A ``DeepseekV3ForCausalLM`` config.json (Kimi K2's text decoder too: transformers has no text-only Kimi
    class, its language model is a DeepseekV3 model)."""
    m, e = config.mla, config.experts
    out = {k: v for k, v in out.items() if k != "head_dim"}  # transformers sets it to qk_rope_head_dim
    if config.model_type == "kimi_k2":  # transformers has no kimi_k2 config class: it reads it as this one
        out["model_type"] = "deepseek_v3"
    out.update(
        attention_bias=m.attention_bias,
        q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave,
        n_routed_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.intermediate_size,
        n_shared_experts=e.shared_intermediate_size // e.intermediate_size, n_group=e.n_group,
        topk_group=e.topk_group, norm_topk_prob=e.norm_topk_prob, routed_scaling_factor=e.routed_scaling_factor,
        first_k_dense_replace=min(config.expert_layers, default=config.num_hidden_layers),
        num_nextn_predict_layers=0)
    out.update(rope_to_hf(config.rope))
    return out

