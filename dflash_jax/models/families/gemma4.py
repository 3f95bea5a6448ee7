"""Gemma 4's text decoders: ``gemma4_text`` (31B dense, 26B-A4B MoE, and the E-series this reader refuses) and
``gemma4_unified_text`` (12B: the same layer without MoE and per-layer embeddings)."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import (
    ConfigError, ExpertsConfig, TargetFields, attention_shape, bool_field, float_field, int_field, parse_rope,
    present, require, rope_parameters,
)
from dflash_jax.models.families.common import FULL, SLIDING, sliding_layer_types, windows, windows_to_hf

DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},  # transformers' default
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}


def _layer_types(cfg: Mapping[str, Any], source: str, num_layers: int) -> list[str]:
    """``layer_types`` (absent: every 6th layer full); transformers forces the last layer to full attention."""
    types = sliding_layer_types(cfg, source, num_layers, [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    return types[:-1] + [FULL]


def _full_layer_shape(cfg: Mapping[str, Any], source: str, types: list[str], head_dim: int, kv_heads: int,
                       k_eq_v: bool) -> tuple[int, int]:
    """The full layers' (head_dim, KV heads). transformers 5.x writes ``per_layer_config`` (``{"<layer>":
    {"head_dim": .., "num_key_value_heads": ..}}``); without it the layer reads ``global_head_dim`` (default
    512, not ``head_dim``) and, only with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        dim = int_field(cfg, "global_head_dim", source, 512)
        kv = int_field(cfg, "num_global_key_value_heads", source, None) if k_eq_v else None
        return dim, kv or kv_heads
    if not isinstance(per_layer, Mapping):
        raise ConfigError(f"{source}: field 'per_layer_config' must be an object, got {per_layer!r}")
    shapes = {}
    for key, value in per_layer.items():
        where = f"{source} (per_layer_config[{key!r}])"
        if not str(key).isdigit() or int(key) >= len(types) or not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a layer index in 0..{len(types) - 1} and an object")
        if set(value) - {"head_dim", "num_key_value_heads"}:
            raise ConfigError(f"{where}: only 'head_dim' and 'num_key_value_heads' may differ per layer, got "
                              f"{sorted(value)}")
        shapes[int(key)] = (int_field(value, "head_dim", where, head_dim),
                            int_field(value, "num_key_value_heads", where, kv_heads))
    of = {t: {shapes.get(i, (head_dim, kv_heads)) for i, u in enumerate(types) if u == t} for t in set(types)}
    if len(of[FULL]) != 1 or of.get(SLIDING, {(head_dim, kv_heads)}) != {(head_dim, kv_heads)}:
        raise ConfigError(f"{source}: field 'per_layer_config' must give every full_attention layer the same "
                          f"head_dim and num_key_value_heads and leave the sliding ones at the top-level values; "
                          f"got {dict(per_layer)!r}")
    return next(iter(of[FULL]))


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Gemma 4's text decoder (``gemma4_text``: 31B dense, 26B-A4B MoE; ``gemma4_unified_text``: 12B), from the
    Qwen3 decoder: embeddings times sqrt(H); four RMSNorms per layer (``w * x``, the weight applied in
    float32) and a stored ``layer_scalar``; sliding (``head_dim``, default RoPE) and full layers (their own
    head size and KV heads, proportional RoPE, with ``attention_k_eq_v`` V from the raw k_proj); a
    weightless V norm, softmax scale 1; GeGLU; optional final logit soft-capping; with ``enable_moe_block``
    (gemma4_text) an expert block beside the dense MLP of every layer. Per-layer embeddings and KV sharing
    (the E-series) are refused."""
    unified = cfg["model_type"] == "gemma4_unified_text"
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):  # "vision" changes image tokens only
        raise ConfigError(f"{source}: use_bidirectional_attention={cfg['use_bidirectional_attention']!r} is not "
                          "supported (a target decodes causally; null or 'vision' only)")
    ple = 0 if unified else int_field(cfg, "hidden_size_per_layer_input", source, 256, minimum=0)
    if ple:
        raise ConfigError(f"{source}: field 'hidden_size_per_layer_input' is {ple} (per-layer embeddings, PLE; "
                          "transformers' default when the field is absent is 256): not implemented, only 0")
    shared = int_field(cfg, "num_kv_shared_layers", source, 0, minimum=0)
    if shared:
        raise ConfigError(f"{source}: field 'num_kv_shared_layers' is {shared} (layers reusing an earlier "
                          "layer's keys and values): not implemented, only 0")
    if not present(cfg, "head_dim"):  # transformers' class default, not hidden_size / num_attention_heads
        raise ConfigError(f"{source}: a {cfg['model_type']} config needs 'head_dim' (transformers defaults it "
                          "to 256, not to hidden_size / num_attention_heads)")
    _, heads, kv_heads, head_dim = attention_shape(cfg, source)
    types = _layer_types(cfg, source, num_layers)
    k_eq_v = bool_field(cfg, "attention_k_eq_v", source, False)
    global_dim, global_kv = _full_layer_shape(cfg, source, types, head_dim, kv_heads, k_eq_v)
    if global_dim % 2 or heads % global_kv:
        raise ConfigError(f"{source}: the full layers' head_dim ({global_dim}) must be even and their KV heads "
                          f"({global_kv}) must divide num_attention_heads ({heads})")
    params = cfg.get("rope_parameters") or DEFAULT_ROPE
    ropes = {}
    for kind in (SLIDING, FULL):
        if not isinstance(params, Mapping) or not isinstance(params.get(kind), Mapping):
            raise ConfigError(f"{source}: field 'rope_parameters' must hold a {kind!r} object, got {params!r}")
        ropes[kind] = parse_rope({"rope_parameters": params[kind]}, f"{source} (rope_parameters.{kind})")
    window = int_field(cfg, "sliding_window", source, 1024 if unified else 512)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    eps = float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True, below=1.0)
    out: dict[str, Any] = dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", source, True),
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, norm_weight_in_float32=True,
        layer_windows=windows(types, window),
        rope=ropes[SLIDING], global_rope=ropes[FULL],
        global_head_dim=global_dim, global_kv_heads=global_kv, attention_k_eq_v=k_eq_v, v_norm=True,
        attention_scale=1.0, hidden_act="gelu_tanh", scale_embeddings=True, sandwich_norms=True, layer_scalar=True,
        final_logit_softcapping=float_field(cfg, "final_logit_softcapping", source, None, positive=True),
    )
    if not unified and bool_field(cfg, "enable_moe_block", source, False):
        num_experts = int_field(cfg, "num_experts", source)
        out.update(experts=ExpertsConfig(
            num_experts=num_experts, top_k=int_field(cfg, "top_k_experts", source, maximum=num_experts),
            intermediate_size=require(cfg, "moe_intermediate_size", source), routing="softmax_topk",
            norm_topk_prob=True, router_norm_eps=eps, activation="gelu_tanh"),
            expert_layers=tuple(range(num_layers)), experts_beside_mlp=True)
    return out


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    """A ``Gemma4TextConfig`` / ``Gemma4UnifiedTextConfig``: two RoPEs in 5.x form, one per kind of layer."""
    e = config.experts
    del out["hidden_act"]  # hidden_activation, below
    out.update(
        hidden_activation="gelu_pytorch_tanh", num_kv_shared_layers=0, **windows_to_hf(config),
        rope_parameters={SLIDING: rope_parameters(config.rope), FULL: rope_parameters(config.global_rope)},
        global_head_dim=config.global_head_dim, attention_k_eq_v=config.attention_k_eq_v,
        final_logit_softcapping=config.final_logit_softcapping)
    if config.attention_k_eq_v:
        out["num_global_key_value_heads"] = config.global_kv_heads
    if config.model_type == "gemma4_text":
        out.update(hidden_size_per_layer_input=0, enable_moe_block=e is not None)
    if e is not None:
        out.update(num_experts=e.num_experts, top_k_experts=e.top_k, moe_intermediate_size=e.intermediate_size)
    return out
