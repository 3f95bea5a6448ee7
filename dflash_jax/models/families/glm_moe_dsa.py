"""GLM-5 / GLM-5.1 (``glm_moe_dsa``, SPEC 11.5): DeepSeek-V3's decoder (``families/deepseek_v3``) with GLM's
defaults, and DeepSeek's sparse-attention indexer (``models/dsa_indexer``) choosing the keys each query sees."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import ConfigError, TargetFields, int_field
from dflash_jax.models.dsa_indexer import DSAConfig, indexer_layer_types
from dflash_jax.models.families import deepseek_v3

# transformers' GlmMoeDsaConfig defaults where they differ from DeepSeek-V3's (a config.json that leaves a field
# out gets these).
GLM_MOE_DSA_DEFAULTS = dict(q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                            v_head_dim=256, intermediate_size=12288, moe_intermediate_size=2048, n_group=1,
                            topk_group=1, rms_norm_eps=1e-5, index_topk=2048, index_head_dim=128, index_n_heads=32)


def prepare(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V3's attention fields, from GLM's own class defaults (before anything reads them)."""
    return deepseek_v3.prepare({**GLM_MOE_DSA_DEFAULTS, **cfg}, source)


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """GLM-5 / GLM-5.1: DeepSeek-V3's decoder (MLA, its router with ``n_group = topk_group = 1`` by default, shared
    experts, dense first layers) with three differences: the low-rank query path always (transformers has no
    ``q_proj`` form: its indexer reads the query residual), RoPE always interleaved (no flag), the dense/sparse
    plan from ``mlp_layer_types`` when given; plus DeepSeek's sparse-attention indexer (``models/dsa_indexer``)."""
    if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
        raise ConfigError(f"{source}: field 'q_lora_rank' is null, but GLM-MoE-DSA always uses the low-rank query "
                          "path (its indexer reads the query residual)")
    out = deepseek_v3.read({**cfg, "rope_interleave": True}, source, num_layers)
    if cfg.get("mlp_layer_types") is not None:
        types = cfg["mlp_layer_types"]
        if not isinstance(types, (list, tuple)) or len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise ConfigError(f"{source}: field 'mlp_layer_types' must give 'dense' or 'sparse' for each of the "
                              f"{num_layers} layers, got {types!r}")
        out["expert_layers"] = tuple(i for i, kind in enumerate(types) if kind == "sparse")
    rope_dim = out["mla"].qk_rope_head_dim
    heads = int_field(cfg, "index_n_heads", source, 32)
    dim = int_field(cfg, "index_head_dim", source, 128)
    if dim < rope_dim or dim % 2:
        raise ConfigError(f"{source}: field 'index_head_dim' ({dim}) must be even and at least qk_rope_head_dim "
                          f"({rope_dim}): the indexer rotates its first qk_rope_head_dim dims")
    out["dsa"] = DSAConfig(index_topk=int_field(cfg, "index_topk", source, 2048), index_n_heads=heads,
                           index_head_dim=dim, rope_dim=rope_dim,
                           layer_types=indexer_layer_types(cfg, num_layers, source))
    return out


def to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    """A ``GlmMoeDsaForCausalLM`` config.json: DeepSeek-V3's fields, then GLM's own."""
    d, out = config.dsa, deepseek_v3.to_hf(config, out)
    for key in ("rope_interleave", "num_nextn_predict_layers"):  # not GLM fields
        out.pop(key, None)
    out.update(index_topk=d.index_topk, index_n_heads=d.index_n_heads, index_head_dim=d.index_head_dim,
               indexer_types=list(d.layer_types),
               mlp_layer_types=["sparse" if config.is_expert_layer(i) else "dense"
                                for i in range(config.num_hidden_layers)])
    return out

