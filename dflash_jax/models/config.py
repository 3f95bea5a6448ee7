"""Target model configuration, parsed from a Hugging Face ``config.json``.

One decoder implementation covers LLaMA-2/3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, gpt-oss, the hybrid
Qwen3-Next / Qwen3.5 / Qwen3.6, MiniMax-M2, Gemma 4's and Muse Glimmer's text decoders, DeepSeek-V3 / Kimi
K2.5-K2.7 (multi-head latent attention) and GLM-5 / GLM-5.1 (latent attention with DeepSeek's sparse-attention
indexer; DeepSeek-V4 is not supported). A family is a small set of differences from the dense decoder:
attention flags, a per-layer plan (which layers mix tokens by softmax attention, by Gated DeltaNet linear
attention or by multi-head latent attention, which route through experts, which attend through a sliding
window), an :class:`ExpertsConfig`, a :class:`GatedDeltaNetConfig` and an :class:`MLAConfig`.

:class:`TargetConfig` reads the fields every family shares, and hands the rest to the family's module
(``models/families``, one row per ``model_type`` in ``families.FAMILIES``), which turns its Hugging Face fields
into those differences and writes them back. Anything this implementation does not compute exactly is refused
with an error that names the file and the field, because a silently different model would break losslessness
downstream. The shared dataclasses and field readers live in ``models/config_fields`` (below the families) and
are importable from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from dflash_jax.models import families
from dflash_jax.models.config_fields import (  # noqa: F401  (re-exported: the names the library imports from here)
    MAX_INT32, MAX_LAYERS, SUPPORTED_ROPE_TYPES, ConfigError, ExpertsConfig, GatedDeltaNetConfig, MLAConfig,
    RopeConfig, TargetFields, attention_shape, bool_field, float_field, int_field, parse_rope, read_config_json,
    read_json_object, require, rope_to_hf, token_ids_field, yarn_get_mscale,
)
from dflash_jax.models.families import (  # noqa: F401  (re-exported)
    ARCHITECTURES, FAMILIES, NESTED_TEXT_CONFIGS, SUPPORTED_MODEL_TYPES,
)
from dflash_jax.models.families.muse_glimmer import MUSE_GLIMMER_TEXT  # noqa: F401  (re-exported)
from dflash_jax.models.quantization_schemes import (
    QuantizationConfigError, UnsupportedScheme, parse_scheme, quantization_config_of,
)


class TargetConfig(TargetFields):
    """Everything the target decoder needs (:class:`TargetFields`), read from and written to a Hugging Face
    ``config.json``; hashable so it can be a static argument of ``jax.jit``."""

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config") -> "TargetConfig":
        raw, raw_source = cfg, source
        cfg, source = families.text_config(cfg, source)
        model_type = cfg.get("model_type")
        family = families.family_of(model_type, source)
        if family.prepare is not None:
            cfg = family.prepare(cfg, source)
        if int_field(cfg, "pretraining_tp", source, 1) != 1:
            raise ConfigError(f"{source}: pretraining_tp != 1 is not supported")
        hidden, heads, kv_heads, head_dim = attention_shape(cfg, source)
        vocab = require(cfg, "vocab_size", source)
        num_layers = int_field(cfg, "num_hidden_layers", source, maximum=MAX_LAYERS)
        base = dict(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True, below=1.0),
            rope=parse_rope(cfg, source),
            max_position_embeddings=require(cfg, "max_position_embeddings", source)
            if "max_position_embeddings" in cfg else 4096,
            tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", source, False),
            bos_token_id=int_field(cfg, "bos_token_id", source, None, minimum=0, maximum=vocab - 1),
            eos_token_ids=token_ids_field(cfg, "eos_token_id", source, vocab),
        )
        base.update(family.read(cfg, source, num_layers))
        base["quantization"] = _quantization_scheme(raw, raw_source, model_type)
        return cls(**base)

    @classmethod
    def from_json(cls, path: str | Path) -> "TargetConfig":
        path, cfg = read_config_json(path, "config")
        return cls.from_dict(cfg, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict for this model (4.x rope layout, readable by 4.x and 5.x): the
        fields every family shares, then the family's own (``families.FAMILIES[model_type].to_hf``)."""
        shared: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "attention_bias": self.qkv_bias,
        }
        return FAMILIES[self.model_type].to_hf(self, shared)


def _quantization_scheme(cfg: Mapping[str, Any], source: str, model_type: str) -> Any:
    """The weight quantisation a config.json declares (its own ``quantization_config`` or its text config's), as
    ``models/quantization_schemes`` parses it; None for float weights. An unsupported method or a bad field is an
    ``UnsupportedScheme`` holding the error that names the file and the field: a config alone describes the
    model's shapes (plans, layouts) without the weights, which are what cannot be read."""
    if not isinstance(cfg, Mapping):
        return None
    q = quantization_config_of(cfg)
    if q is None:
        return None
    try:
        return parse_scheme(q, source, model_type)
    except QuantizationConfigError as err:  # raised when the weights are read or kept packed
        return UnsupportedScheme(str(err))
