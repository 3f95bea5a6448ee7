"""Tiny random Hugging Face targets saved with ``save_pretrained``, used as independent references."""

from __future__ import annotations

from pathlib import Path

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
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # around the init: 1, or 0 for zero-centred norms (1 + w)
                p.copy_(p + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):  # large enough to take a real share of each softmax
                p.copy_(1.0 + torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model
