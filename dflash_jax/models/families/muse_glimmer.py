"""Muse Glimmer's text decoder (Muse-Glimmer-30B; transformers' ``MuseGlimmerTextConfig``), nested under the
``text_config`` of a ``muse_glimmer`` config.json, which is also what an export writes."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import (
    ConfigError, TargetFields, bool_field, float_field, int_field, require, rope_parameters,
)
from dflash_jax.models.families.common import FULL, SLIDING, sliding_layer_types, windows, windows_to_hf

MUSE_GLIMMER_TEXT = "muse_glimmer_text"  # the text decoder's model_type
# The vision tower written into an exported ``muse_glimmer`` config.json: transformers has no text-only LM class
# for the family, so an export is a ``MuseGlimmerForConditionalGeneration`` whose (absent) vision weights it
# initialises; the smallest tower keeps that cheap. Text generation never reads it.
MUSE_GLIMMER_EXPORT_VISION = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                              "num_attention_heads": 1, "pos_emb_height": 2, "pos_emb_width": 2}


def read(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Muse Glimmer's text decoder, from the Qwen3 decoder: a weightless RMSNorm after the embedding lookup (no
    sqrt(H)); Gemma's four-norm sandwich in (1 + w) form, the post norms with their own ``post_norm_eps``; a
    final norm in ``w`` form; one weightless q/k RMSNorm per head, q then times ``qk_scale_factor``; the output
    gated by sigmoid(gate_proj(x)); sliding layers (window ``sliding_window``) and full layers as
    ``layer_types`` says (default: every 4th counted back from the last is full); no RoPE where
    ``layer_rope_theta`` is 0 (default: the full layers; a non-zero entry is only a flag: those layers use the
    global theta, as transformers does); SwiGLU; logits times ``output_multiplier``, then soft-capped."""
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "silu"))
    if act != "silu":
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (only 'silu')")
    # transformers' default: full iff (L - 1 - i) % 4 == 0, the last layer full
    types = sliding_layer_types(cfg, source, num_layers,
                                [FULL if (num_layers - 1 - i) % 4 == 0 else SLIDING for i in range(num_layers)])
    window = int_field(cfg, "sliding_window", source, 2048)
    thetas = cfg.get("layer_rope_theta")
    if thetas is None:
        nope = tuple(i for i in range(num_layers) if (num_layers - 1 - i) % 4 == 0)
    elif (not isinstance(thetas, list) or len(thetas) != num_layers
          or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in thetas)):
        raise ConfigError(f"{source}: field 'layer_rope_theta' must list a number >= 0 (0: no RoPE) for each of "
                          f"the {num_layers} layers, got {thetas!r}")
    else:
        nope = tuple(i for i, v in enumerate(thetas) if v == 0)
    cap = float_field(cfg, "final_logit_softcapping", source, 20.0, positive=True)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    eps = float_field(cfg, "rms_norm_eps", source, 1e-5, positive=True, below=1.0)
    return dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", source, False),
        rms_norm_eps=eps,
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, qk_norm_weight=False,
        query_scale=float_field(cfg, "qk_scale_factor", source, 3.87, positive=True),
        attention_gate_proj=True, embed_norm=True, sandwich_norms=True, zero_centered_norms=True,
        final_norm_plain=True, norm_weight_in_float32=True,
        post_norm_eps=float_field(cfg, "post_norm_eps", source, 1e-8, positive=True, below=1.0),
        layer_windows=windows(types, window), nope_layers=nope,
        final_logit_softcapping=cap,
        output_multiplier=float_field(cfg, "output_multiplier", source, 0.19611613513818404, positive=True),
    )


def to_hf(config: TargetFields, text: dict[str, Any]) -> dict[str, Any]:
    """``TargetConfig.to_hf_dict`` of a Muse Glimmer target: a ``muse_glimmer`` config.json whose
    ``text_config`` holds the language model (``MUSE_GLIMMER_EXPORT_VISION``: why a vision tower is named)."""
    out_architectures = text["architectures"]  # the family table's: MuseGlimmerForConditionalGeneration
    text = {k: v for k, v in text.items() if k not in ("architectures", "hidden_act")}
    text.update(
        hidden_activation="silu",
        **windows_to_hf(config),
        layer_rope_theta=[0 if i in config.nope_layers else config.rope.theta
                          for i in range(config.num_hidden_layers)],
        rope_parameters=rope_parameters(config.rope), qk_scale_factor=config.query_scale,
        post_norm_eps=config.post_norm_eps, output_multiplier=config.output_multiplier,
        final_logit_softcapping=config.final_logit_softcapping)
    return {"architectures": out_architectures, "model_type": "muse_glimmer",
            "text_config": text, "vision_config": dict(MUSE_GLIMMER_EXPORT_VISION),
            "out_hidden_size": 4 * MUSE_GLIMMER_EXPORT_VISION["hidden_size"],  # after its 2 x 2 patch merge
            "projector_hidden_size": MUSE_GLIMMER_EXPORT_VISION["hidden_size"]}

