"""Tiny random Hugging Face targets saved with ``save_pretrained``, used as independent references, and the
helpers that compare our target with them (right-padded batched forward, errors scaled by magnitude)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

PROMPT_LENGTHS = (5, 11, 17)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rms_norm_eps=1e-6)

# Linear-attention sizes of the hybrid variants: 2 key heads shared by 4 value heads.
HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8)

VARIANTS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 routed; renormalised top-2 of 4 experts.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    # A window shorter than the prompts, sinks, biases, YaRN (gpt-oss-20b's rope settings).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=6, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})),
    # Hybrid: three Gated DeltaNet layers and a gated full-attention layer (partial RoPE, zero-centred norms).
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(HYBRID, num_hidden_layers=4)),
    # Experts with a shared expert on every layer.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        HYBRID, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    # Grouped projections, the full layer second and the LAST layer linear; layer 2 dense (mlp_only_layers).
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        HYBRID, num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                  "linear_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[2], norm_topk_prob=True)),
}
HYBRID_VARIANTS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def make_hf_target(variant: str, out_dir: Path, seed: int = 0, **overrides):
    """Build, randomise (norm weights and biases too, so they are exercised) and save a tiny HF model."""
    import torch
    import transformers

    cfg_cls, model_cls, extra = VARIANTS[variant]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = randomise(getattr(transformers, model_cls)(cfg).eval())
    model.save_pretrained(out_dir)
    return model


def randomise(model):
    """Draw every weight of a transformers model away from its init, in place (a loader or decoder that
    ignored one would fail the parity checks): norm weights and scales around their init (1, or 0 for
    zero-centred norms), biases and the rest around 0, attention sinks around 1, and the saved buffers that
    are weights (MiniMax-M2's selection bias, Gemma 4's ``layer_scalar``) too. Returns the model."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"norm(_\d)?\.weight$", name) or name.endswith("scale"):  # Gemma 4: router scales
                p.copy_(p + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):  # large enough to take a real share of each softmax
                p.copy_(1.0 + torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # comparable to the sigmoid scores it shifts
                b.copy_(0.5 * torch.randn_like(b))
            elif name.endswith("layer_scalar"):
                b.copy_(b + 0.3 * torch.randn_like(b))
    return model


def overridden(cfg: dict, **overrides) -> dict:
    """A config dict with ``overrides`` set; a None value removes its field (a config.json without it)."""
    out = dict(cfg)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def prompts(vocab: int, seed: int = 0, lengths=PROMPT_LENGTHS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n) for n in lengths]


def scaled_error(ours, ref) -> float:
    """Max absolute error, relative to the reference's magnitude where that exceeds 1 (float32 rounding grows
    with it: the hybrids' features reach ~10 in these random models)."""
    return float(np.abs(ours - ref).max() / max(1.0, np.abs(ref).max()))


def hf_forward(hf_model, ids):
    """Logits and ``hidden_states`` (index 0 the embedding output, the last entry after the final norm)."""
    import torch

    with torch.no_grad():
        out = hf_model(torch.tensor(ids)[None], output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


def hf_greedy(hf_model, prompt, max_new_tokens: int, pad_token_id: int = 0) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``max_new_tokens`` tokens (no early stop).
    ``pad_token_id`` must not occur in the prompt (generate would mask it out)."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor(prompt)[None], max_new_tokens=max_new_tokens, do_sample=False,
                                min_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
    return out[0, len(prompt):].tolist()


def batched_forward(config, params, rows, apply=None):
    """Our logits ``[B, T, V]`` and every layer's features ``[B, T, L, H]`` for right-padded ``rows`` (one
    forward, padding marked invalid). ``apply``: ``TargetModel(config).apply`` or a jitted form of it."""
    from dflash_jax.models.target import TargetModel

    t = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), t), np.int32)
    valid = np.zeros((len(rows), t), bool)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
        valid[b, : len(r)] = True
    layers = tuple(range(config.num_hidden_layers))
    apply = apply or TargetModel(config).apply
    out = apply({"params": params}, tokens, np.broadcast_to(np.arange(t), tokens.shape), valid=valid,
                feature_layers=layers)
    feats = np.asarray(out.features).reshape(len(rows), t, len(layers), config.hidden_size)
    return np.asarray(out.logits), feats


def worst_errors(config, params, hf_model, rows, apply=None) -> tuple[float, float]:
    """``scaled_error`` of our logits and of every layer's feature (``hidden_states[i + 1]`` for layer ``i``, the
    last after the final norm: SPEC section 3) against transformers', the worst over ``rows``."""
    logits, feats = batched_forward(config, params, rows, apply)
    worst_logit = worst_feat = 0.0
    for b, r in enumerate(rows):
        ref_logits, ref_hidden = hf_forward(hf_model, r)
        assert len(ref_hidden) == config.num_hidden_layers + 1
        worst_logit = max(worst_logit, scaled_error(logits[b, : len(r)], ref_logits))
        for i in range(config.num_hidden_layers):
            worst_feat = max(worst_feat, scaled_error(feats[b, : len(r), i], ref_hidden[i + 1]))
    return worst_logit, worst_feat


# Muse Glimmer (tests/test_muse_glimmer*.py): 4 layers, three sliding (window 4, shorter than the prompts) and the
# last full (transformers' 3:1 default); ``layer_rope_theta`` [1e4, 0, 5e3, 0]: no RoPE on the full layer and on
# one sliding layer, and a per-layer theta that transformers reads only as a flag. A soft-cap of 0.3 bends these
# random logits (after the default output_multiplier they are about 0.2 x their raw size).
MUSE_VOCAB = 300
MUSE_TEXT = dict(vocab_size=MUSE_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                 max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 layer_rope_theta=[1e4, 0, 5e3, 0], attention_bias=True, final_logit_softcapping=0.3,
                 eos_token_id=None, bos_token_id=None, pad_token_id=None)
MUSE_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   pos_emb_height=4, pos_emb_width=4)


def make_hf_muse_glimmer(out_dir: Path, seed: int = 0, **text):
    """transformers' tiny random ``MuseGlimmerForConditionalGeneration`` (a tiny vision tower beside the language
    model), every weight away from its init, saved to ``out_dir``."""
    import torch
    import transformers

    cfg = transformers.MuseGlimmerConfig(text_config={**MUSE_TEXT, **text}, vision_config=MUSE_VISION,
                                         out_hidden_size=128, projector_hidden_size=32)
    torch.manual_seed(seed)
    model = randomise(transformers.MuseGlimmerForConditionalGeneration(cfg).eval())
    model.save_pretrained(out_dir)
    return model


def decode_with_random_draft(config, params, vocab: int, target_layer_ids, *, sampled: bool = False,
                             **dflash_config) -> dict:
    """A family's tiny target decoded four ways on ONE decoder (its programs compile once): autoregressively
    (``ar``), by DFlash with a random block-8 draft (``chain``: most draft tokens are rejected, so rollbacks run
    every round), with a verified tree of 12 nodes (``tree``: one commit of the accepted path per cache kind)
    and, with ``sampled``, through the sampling acceptance path at top-k 1 (deterministic). Prompts of
    :data:`PROMPT_LENGTHS`, 24 new tokens. ``dflash_config`` adds draft fields (e.g. its embedding scale)."""
    from draft_tiny import official_config

    from dflash_jax.checkpoints.official_draft import init_draft_params
    from dflash_jax.engine.decoder import Decoder
    from dflash_jax.engine.sampling import SamplingConfig
    from dflash_jax.models.draft_config import DraftConfig

    draft_config = DraftConfig.from_dict(official_config(
        vocab_size=vocab, block_size=8, num_target_layers=config.num_hidden_layers,
        dflash_config={"target_layer_ids": list(target_layer_ids), "mask_token_id": vocab - 1, **dflash_config}))
    decoder = Decoder(config, params, draft_config, init_draft_params(draft_config, seed=1))
    batch = [p.tolist() for p in prompts(vocab, seed=2)]
    out = {"batch": batch, "ar": decoder.generate(batch, 24, baseline=True), "chain": decoder.generate(batch, 24)}
    if sampled:
        out["sampled"] = decoder.generate(batch, 24, sampling=SamplingConfig(temperature=1.0, top_k=1), seed=3)
    decoder.tree_budget = 12
    out["tree"] = decoder.generate(batch, 24)
    return out


def check_greedy_matches_generate(hf_model, decoded: dict) -> None:
    """Our autoregressive rows of :func:`decode_with_random_draft` equal transformers' ``generate``."""
    for prompt, row in zip(decoded["batch"], decoded["ar"].tokens):
        assert row == hf_greedy(hf_model, prompt, 24)


def check_lossless(decoded: dict) -> None:
    """Every speculative way of :func:`decode_with_random_draft` gives exactly the autoregressive tokens, and the
    random draft really was rejected (the rollback ran)."""
    ar = decoded["ar"].tokens
    assert decoded["chain"].tokens == ar
    assert all(min(row) < 8 for row in decoded["chain"].accept_lengths)  # rejected draft tokens rolled back
    assert decoded["tree"].tokens == ar
    if "sampled" in decoded:
        assert decoded["sampled"].tokens == ar
