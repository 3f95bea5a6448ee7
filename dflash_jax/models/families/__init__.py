"""The target families: one module each, one row each in ``FAMILIES``.

A family is a small set of differences from the dense decoder. Its module reads the Hugging Face fields that
say them into :class:`~dflash_jax.models.config_fields.TargetFields` (``read``: the fields that differ from the
shared ones ``TargetConfig.from_dict`` reads for every family), refusing anything this implementation does not
compute exactly with an error naming the file and the field, and writes them back into a ``config.json``
(``to_hf``: the shared fields in, the family's ``config.json`` out). Adding a family is one module and one row
per ``model_type`` it reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from dflash_jax.models.config_fields import ConfigError, TargetFields
from dflash_jax.models.families import (
    deepseek_v3, dense, gemma4, glm_moe_dsa, gpt_oss, minimax_m2, muse_glimmer, qwen3_moe, qwen3_next,
)
from dflash_jax.models.families.muse_glimmer import MUSE_GLIMMER_TEXT

Fields = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``model_type``'s reader and writer."""

    read: Callable[[Mapping[str, Any], str, int], Fields]  # (config.json fields, source, layers) -> differences
    to_hf: Callable[[TargetFields, Fields], Fields]  # (config, the shared config.json fields) -> its config.json
    architecture: str  # ``architectures`` of an exported config.json
    # The ``model_type`` of a multimodal config.json that nests this decoder under ``text_config`` (its vision
    # and audio towers are not read: their weights are skipped at load), and that config's quirks, if any:
    # ``(top-level fields, text_config fields, source) -> text_config fields``.
    multimodal: str | None = None
    read_multimodal: Callable[[Mapping[str, Any], Fields, str], Fields] | None = None
    # Rewrites the fields before the shared readers see them (multi-head latent attention: the head size and KV
    # heads the decoder computes with are derived, not given).
    prepare: Callable[[Mapping[str, Any], str], Fields] | None = None


# In the order an unsupported model_type's error lists them.
FAMILIES: dict[str, Family] = {
    "llama": Family(dense.read, dense.to_hf, "LlamaForCausalLM"),
    "mistral": Family(dense.read, dense.to_hf, "MistralForCausalLM"),
    "qwen2": Family(dense.read, dense.to_hf, "Qwen2ForCausalLM"),
    "qwen3": Family(dense.read, dense.to_hf, "Qwen3ForCausalLM"),
    "qwen3_moe": Family(qwen3_moe.read, qwen3_moe.to_hf, "Qwen3MoeForCausalLM"),
    "gpt_oss": Family(gpt_oss.read, gpt_oss.to_hf, "GptOssForCausalLM"),
    "qwen3_next": Family(qwen3_next.read, qwen3_next.to_hf, "Qwen3NextForCausalLM"),
    "qwen3_5_text": Family(qwen3_next.read, qwen3_next.to_hf, "Qwen3_5ForCausalLM", multimodal="qwen3_5"),
    "qwen3_5_moe_text": Family(qwen3_next.read, qwen3_next.to_hf, "Qwen3_5MoeForCausalLM",
                               multimodal="qwen3_5_moe"),
    "minimax_m2": Family(minimax_m2.read, minimax_m2.to_hf, "MiniMaxM2ForCausalLM"),
    "gemma4_text": Family(gemma4.read, gemma4.to_hf, "Gemma4ForCausalLM", multimodal="gemma4"),
    "gemma4_unified_text": Family(gemma4.read, gemma4.to_hf, "Gemma4UnifiedForCausalLM",
                                  multimodal="gemma4_unified"),
    MUSE_GLIMMER_TEXT: Family(muse_glimmer.read, muse_glimmer.to_hf, "MuseGlimmerForConditionalGeneration",
                              multimodal="muse_glimmer"),
    "deepseek_v3": Family(deepseek_v3.read, deepseek_v3.to_hf, "DeepseekV3ForCausalLM",
                          prepare=deepseek_v3.prepare),
    "kimi_k2": Family(deepseek_v3.read, deepseek_v3.to_hf, "DeepseekV3ForCausalLM", multimodal="kimi_k25",
                      read_multimodal=deepseek_v3.kimi_text_config, prepare=deepseek_v3.prepare),
    "glm_moe_dsa": Family(glm_moe_dsa.read, glm_moe_dsa.to_hf, "GlmMoeDsaForCausalLM",
                          prepare=glm_moe_dsa.prepare),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
ARCHITECTURES = {model_type: family.architecture for model_type, family in FAMILIES.items()}
# Multimodal checkpoints whose language model is nested under ``text_config`` (the model_type it takes).
NESTED_TEXT_CONFIGS = {f.multimodal: model_type for model_type, f in FAMILIES.items() if f.multimodal}


def family_of(model_type: Any, source: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def text_config(cfg: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], str]:
    """The language model's config of a multimodal checkpoint (``NESTED_TEXT_CONFIGS``) with the source its
    errors name, else ``cfg`` itself."""
    model_type = cfg.get("model_type")
    if model_type not in NESTED_TEXT_CONFIGS:
        return cfg, source
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"{source}: a {model_type!r} config needs a 'text_config' object (the language model); "
                          "got " + ("none: a vision-only directory?" if text is None else repr(text)))
    nested = NESTED_TEXT_CONFIGS[model_type]
    merged = dict(text)
    merged["model_type"] = text.get("model_type") or nested
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # sometimes given at the top only
        if key not in merged and key in cfg:
            merged[key] = cfg[key]
    quirks = FAMILIES[nested].read_multimodal
    return (merged if quirks is None else quirks(cfg, merged, source)), f"{source} (text_config)"
