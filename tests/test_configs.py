"""The shipped pairing configs (configs/*.yaml) give the SPEC section 2 shapes; load_pairing errors are clear.

Shapes are checked abstractly (``jax.eval_shape``): no real weights are allocated, even for the 8B pairings.
"""

import re
from functools import lru_cache

import numpy as np
import pytest

from dflash_jax.checkpoints.hf_target import abstract_target_params
from dflash_jax.checkpoints.official_draft import abstract_draft_params
from dflash_jax.checkpoints.safetensors_io import flatten, param_path_to_key
from dflash_jax.configs import CONFIG_DIR, Pairing, available_pairings, load_pairing
from dflash_jax.models.config import ConfigError
from dflash_jax.models.draft_config import DraftConfig, default_target_layer_ids
from draft_tiny import official_config

SHIPPED = ["qwen3-8b-dflash-b16", "qwen3-4b-dflash-b16", "llama3.1-8b-instruct-dflash-b10", "tiny-test",
           "qwen3-coder-30b-a3b-dflash-b16", "gpt-oss-20b-dflash-b8", "gpt-oss-120b-dflash-b10"]
HYBRID = ["qwen3.5-4b-dflash-b16", "qwen3.5-9b-dflash-b16", "qwen3.5-27b-dflash-b16", "qwen3.5-35b-a3b-dflash-b16",
          "qwen3.5-122b-a10b-dflash-b16", "qwen3.5-397b-a17b-dflash-b16", "qwen3.6-27b-dflash-b16",
          "qwen3.6-35b-a3b-dflash-b16", "qwen3-coder-next-dflash-b16"]
SHIPPED += HYBRID


def esc(path) -> str:
    """A filesystem path as a literal regex fragment."""
    return re.escape(str(path))


@lru_cache(maxsize=None)
def shapes(name: str) -> tuple[Pairing, dict, dict]:
    """(pairing, draft param shapes, target param shapes), flat path -> shape."""
    p = load_pairing(name)
    draft = {k: tuple(v.shape) for k, v in flatten(abstract_draft_params(p.draft)).items()}
    target = {k: tuple(v.shape) for k, v in flatten(abstract_target_params(p.target)).items()}
    return p, draft, target


def official_shapes(flat: dict) -> dict:
    """Param shapes as stored in the official/HF files (``[out, in]`` for linear weights)."""
    out = {}
    for path, shape in flat.items():
        key, transpose = param_path_to_key(path)
        out[key] = shape[::-1] if transpose else shape
    return out


def test_every_shipped_config_is_listed_and_loads():
    assert set(SHIPPED) <= set(available_pairings())
    for name in SHIPPED:
        p = load_pairing(name)
        assert p.name == name
        assert p.raw["name"] == name
        assert p.draft.hidden_size == p.target.hidden_size
        assert p.draft.num_target_layers == p.target.num_hidden_layers


@pytest.mark.parametrize("name", available_pairings())
def test_every_pairing_file_loads_validates_and_has_shapes(name):
    """Every file in configs/ (not only the listed ones): parsed, the draft validated against the target
    (load_pairing does it), and both param trees buildable abstractly with the draft reading real layers."""
    p, draft, target = shapes(name)
    p.draft.validate_against(p.target)
    assert draft[("fc", "kernel")] == (p.draft.num_features * p.target.hidden_size, p.draft.hidden_size)
    assert {k[0] for k in target if k[0].startswith("layers_")} == {
        f"layers_{i}" for i in range(p.target.num_hidden_layers)}
    assert all(0 <= i < p.target.num_hidden_layers - 1 for i in p.draft.target_layer_ids)  # servable (SPEC 3)
    assert p.hf_target is None or "/" in p.hf_target


def test_load_by_path_and_by_name_with_suffix_agree():
    by_name = load_pairing("qwen3-8b-dflash-b16")
    assert load_pairing(CONFIG_DIR / "qwen3-8b-dflash-b16.yaml") == by_name
    assert load_pairing(str(CONFIG_DIR / "qwen3-8b-dflash-b16.yaml")) == by_name
    assert load_pairing("qwen3-8b-dflash-b16.yaml") == by_name


def test_hub_ids():
    assert load_pairing("qwen3-8b-dflash-b16").hf_draft == "z-lab/Qwen3-8B-DFlash-b16"
    assert load_pairing("qwen3-4b-dflash-b16").hf_draft == "z-lab/Qwen3-4B-DFlash-b16"
    assert load_pairing("llama3.1-8b-instruct-dflash-b10").hf_draft == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"


def test_qwen3_8b_pairing_matches_spec():
    p, draft, target = shapes("qwen3-8b-dflash-b16")
    d, t = p.draft, p.target
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.intermediate_size, t.vocab_size, t.max_position_embeddings) == (4096, 36, 32, 8, 128, 12288, 151936,
                                                                              40960)
    assert t.rope.theta == 1e6 and t.rms_norm_eps == 1e-6 and not t.tie_word_embeddings and t.qk_norm
    assert (d.hidden_size, d.num_hidden_layers, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
            d.intermediate_size, d.block_size) == (4096, 5, 32, 8, 128, 12288, 16)
    assert d.rope.theta == 1e6 and d.rms_norm_eps == 1e-6
    assert d.target_layer_ids == (1, 9, 17, 25, 33) == default_target_layer_ids(36, 5)
    assert d.mask_token_id == 151669
    # draft params (Flax kernels are [in, out])
    assert draft[("fc", "kernel")] == (5 * 4096, 4096)
    assert draft[("hidden_norm", "weight")] == (4096,) and draft[("norm", "weight")] == (4096,)
    attn = ("layers_0", "self_attn")
    assert draft[attn + ("q_proj", "kernel")] == (4096, 4096)
    assert draft[attn + ("k_proj", "kernel")] == (4096, 1024)
    assert draft[attn + ("v_proj", "kernel")] == (4096, 1024)
    assert draft[attn + ("o_proj", "kernel")] == (4096, 4096)
    assert draft[attn + ("q_norm", "weight")] == (128,) and draft[attn + ("k_norm", "weight")] == (128,)
    assert draft[("layers_0", "mlp", "gate_proj", "kernel")] == (4096, 12288)
    assert draft[("layers_0", "mlp", "up_proj", "kernel")] == (4096, 12288)
    assert draft[("layers_0", "mlp", "down_proj", "kernel")] == (12288, 4096)
    assert {k[0] for k in draft if k[0].startswith("layers_")} == {f"layers_{i}" for i in range(5)}
    # the same in the stored [out, in] layout of SPEC section 7; no embedding and no head
    stored = official_shapes(draft)
    assert stored["fc.weight"] == (4096, 5 * 4096)
    assert stored["layers.4.self_attn.k_proj.weight"] == (1024, 4096)
    assert stored["layers.4.mlp.down_proj.weight"] == (4096, 12288)
    assert len(stored) == 3 + 5 * 11
    assert not any("embed" in k or "lm_head" in k for k in stored)
    # target: untied head, 36 layers
    assert target[("embed_tokens", "embedding")] == (151936, 4096)
    assert target[("lm_head", "kernel")] == (4096, 151936)
    assert {k[0] for k in target if k[0].startswith("layers_")} == {f"layers_{i}" for i in range(36)}
    assert target[("layers_35", "self_attn", "k_proj", "kernel")] == (4096, 1024)
    assert target[("layers_35", "self_attn", "q_norm", "weight")] == (128,)


def test_qwen3_4b_pairing_matches_spec():
    p, draft, target = shapes("qwen3-4b-dflash-b16")
    d, t = p.draft, p.target
    assert t.tie_word_embeddings
    assert not any(k[0] == "lm_head" for k in target)  # tied: the embedding is the head
    assert target[("embed_tokens", "embedding")] == (151936, 2560)
    assert target[("layers_0", "self_attn", "q_proj", "kernel")] == (2560, 32 * 128)
    assert target[("layers_0", "mlp", "gate_proj", "kernel")] == (2560, 9728)
    assert (d.hidden_size, d.intermediate_size, d.num_hidden_layers, d.block_size) == (2560, 9728, 5, 16)
    assert d.target_layer_ids == (1, 9, 17, 25, 33) and d.mask_token_id == 151669
    assert draft[("fc", "kernel")] == (12800, 2560)
    assert official_shapes(draft)["fc.weight"] == (2560, 12800)
    assert draft[("layers_0", "self_attn", "q_proj", "kernel")] == (2560, 4096)
    assert draft[("layers_0", "self_attn", "o_proj", "kernel")] == (4096, 2560)
    assert draft[("layers_0", "mlp", "down_proj", "kernel")] == (9728, 2560)


def test_llama_pairing():
    p, draft, target = shapes("llama3.1-8b-instruct-dflash-b10")
    d, t = p.draft, p.target
    assert t.model_type == "llama" and not t.qk_norm and not t.tie_word_embeddings
    assert (t.hidden_size, t.num_hidden_layers, t.intermediate_size, t.vocab_size, t.head_dim) == (
        4096, 32, 14336, 128256, 128)
    assert t.rope.rope_type == "llama3" and t.rope.theta == 500000.0 and t.rope.factor == 8.0
    assert (t.rope.low_freq_factor, t.rope.high_freq_factor, t.rope.original_max_position_embeddings) == (1, 4, 8192)
    assert t.rms_norm_eps == 1e-5 and t.eos_token_ids == (128001, 128008, 128009)
    assert d.block_size == 10 and d.num_hidden_layers == 5
    assert d.rope == t.rope
    assert d.target_layer_ids == default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert d.mask_token_id == 128002 < t.vocab_size
    assert draft[("fc", "kernel")] == (5 * 4096, 4096)
    assert draft[("layers_0", "mlp", "gate_proj", "kernel")] == (4096, 14336)
    assert target[("lm_head", "kernel")] == (4096, 128256)
    assert not any("q_norm" in k for k in target)


def test_qwen3_coder_moe_pairing():
    p, draft, target = shapes("qwen3-coder-30b-a3b-dflash-b16")
    d, t = p.draft, p.target
    assert t.model_type == "qwen3_moe" and t.qk_norm and not t.tie_word_embeddings and not t.qkv_bias
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.vocab_size, t.max_position_embeddings) == (2048, 48, 32, 4, 128, 151936, 262144)
    e = t.experts
    assert (e.num_experts, e.top_k, e.intermediate_size, e.norm_topk_prob, e.routing) == (
        128, 8, 768, True, "softmax_topk")
    assert t.expert_layers == tuple(range(48)) and t.rope.theta == 1e7 and t.eos_token_ids == (151645,)
    assert target[("layers_47", "mlp", "experts", "gate_proj")] == (128, 2048, 768)
    assert target[("layers_0", "mlp", "experts", "down_proj")] == (128, 768, 2048)
    assert target[("layers_0", "mlp", "gate", "kernel")] == (2048, 128)
    assert (d.num_hidden_layers, d.hidden_size, d.intermediate_size, d.num_attention_heads,
            d.num_key_value_heads, d.head_dim, d.block_size) == (8, 2048, 6144, 32, 4, 128, 16)
    assert d.target_layer_ids == (1, 12, 23, 34, 45) and d.mask_token_id == 151669
    assert draft[("fc", "kernel")] == (5 * 2048, 2048)


@pytest.mark.parametrize("name,layers,experts,block,ids", [
    ("gpt-oss-20b-dflash-b8", 24, 32, 8, (1, 6, 11, 16, 21)),
    ("gpt-oss-120b-dflash-b10", 36, 128, 10, (1, 9, 17, 25, 33)),
])
def test_gpt_oss_pairings(name, layers, experts, block, ids):
    p, draft, target = shapes(name)
    d, t = p.draft, p.target
    assert t.model_type == "gpt_oss" and t.qkv_bias and t.o_bias and t.attention_sinks
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.vocab_size) == (2880, layers, 64, 8, 64, 201088)
    assert t.layer_windows == (128, None) * (layers // 2)  # even layers slide over 128 tokens
    e = t.experts
    assert (e.num_experts, e.top_k, e.intermediate_size, e.routing, e.swiglu_limit) == (
        experts, 4, 2880, "topk_softmax", 7.0)
    r = t.rope
    assert (r.rope_type, r.theta, r.factor, r.beta_fast, r.beta_slow, r.original_max_position_embeddings,
            r.truncate) == ("yarn", 150000.0, 32.0, 32.0, 1.0, 4096, False)
    assert p.raw["target"]["quantization_config"]["quant_method"] == "mxfp4"  # kept verbatim, accepted
    assert target[("layers_0", "mlp", "experts", "gate_proj")] == (experts, 2880, 2880)
    assert target[("layers_0", "self_attn", "sinks")] == (64,)
    assert (d.num_hidden_layers, d.hidden_size, d.intermediate_size, d.num_attention_heads,
            d.num_key_value_heads, d.head_dim, d.block_size, d.attention_bias) == (
        8, 2880, 7680, 64, 8, 64, block, True)
    assert d.target_layer_ids == ids and d.mask_token_id == 200000 and d.rope == t.rope
    assert draft[("fc", "kernel")] == (5 * 2880, 2880)


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_pairings(name):
    """Three Gated DeltaNet layers in four (the last layer full attention), gated attention on a quarter of each
    256-dim head, zero-centred norms; the draft reads neither the last layer nor a missing one."""
    p = load_pairing(name)
    t, d = p.target, p.draft
    n = t.num_hidden_layers
    assert t.linear_layers == tuple(i for i in range(n) if (i + 1) % 4) and t.attention_layers[-1] == n - 1
    assert t.attention_output_gate and t.zero_centered_norms and (t.head_dim, t.rotary_dim) == (256, 64)
    la = t.linear_attention
    assert (la.num_k_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel) == (16, 128, 128, 4)
    assert t.vocab_size == 248320 or name.startswith("qwen3-coder-next")
    assert max(d.target_layer_ids) < n - 1 and d.num_target_layers == n and d.block_size == 16
    if "-a" in name or "next" in name:  # the MoE sizes: experts with a shared expert on every layer
        assert t.experts.shared_intermediate_size > 0 and t.expert_layers == tuple(range(n))
    else:
        assert t.experts is None


def test_qwen3_6_27b_draft_has_four_sliding_layers_and_one_full():
    d = load_pairing("qwen3.6-27b-dflash-b16").draft
    assert d.layer_types == ("sliding_attention",) * 4 + ("full_attention",) and d.sliding_window == 2048


def test_moe_configs_say_what_is_assumed():
    for name in ("qwen3-coder-30b-a3b-dflash-b16", "gpt-oss-20b-dflash-b8", "gpt-oss-120b-dflash-b10", *HYBRID):
        text = (CONFIG_DIR / f"{name}.yaml").read_text()
        assert "ASSUMED" in text and "Sources" in text and "config.json" in text


# The 2026 targets' released pairings (SPEC 9, 11.1, 11.3). Expected values are the released config.json copies and
# the surveys of the drafts' configs that the files' headers cite, not values read back from the loader.
GEMMA4 = {  # name: (model_type, layers, hidden, heads, kv, global_kv, experts, draft heads, draft width, ids)
    "gemma-4-31b-it-dflash-b16": ("gemma4_text", 60, 5376, 32, 16, 4, None, 64, 10752, (1, 12, 23, 35, 46, 57)),
    "gemma-4-26b-a4b-it-dflash-b16": ("gemma4_text", 30, 2816, 16, 8, 2, (128, 8, 704), 32, 5632,
                                      (1, 6, 11, 17, 22, 27)),
    "gemma-4-12b-it-dflash-b16": ("gemma4_unified_text", 48, 3840, 16, 8, 1, None, 32, 7680,
                                  (1, 10, 19, 27, 36, 45)),
}
MINIMAX = ["minimax-m2.5-dflash-b16", "minimax-m2.7-dflash-b16"]


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_pairings(name):
    """5 sliding (1024) layers to 1 full; full layers 512 wide with K = V (no v_proj) and their own KV heads; a
    qwen3-layout draft of 4 sliding (2048) + 1 full layer reading six features; the embedding-scale trap set."""
    import math

    model_type, layers, hidden, heads, kv, global_kv, experts, d_heads, d_width, ids = GEMMA4[name]
    p, draft, target = shapes(name)
    t, d = p.target, p.draft
    assert (t.model_type, t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads,
            t.head_dim, t.global_head_dim, t.global_kv_heads, t.vocab_size) == (
        model_type, layers, hidden, heads, kv, 256, 512, global_kv, 262144)
    assert t.layer_windows == ((1024,) * 5 + (None,)) * (layers // 6)
    assert t.attention_k_eq_v and t.scale_embeddings and t.tie_word_embeddings and t.final_logit_softcapping == 30
    assert (t.rope.theta, t.global_rope.theta, t.global_rope.rope_type) == (10000.0, 1e6, "proportional")
    full = ("layers_5", "self_attn")
    assert target[full + ("k_proj", "kernel")] == (hidden, global_kv * 512)
    assert full + ("v_proj", "kernel") not in target  # V is the raw k_proj output on full layers
    assert target[("layers_0", "self_attn", "v_proj", "kernel")] == (hidden, kv * 256)
    assert target[("layers_0", "layer_scalar")] == (1,) and not any(k[0] == "lm_head" for k in target)
    if experts:
        e = t.experts
        assert (e.num_experts, e.top_k, e.intermediate_size) == experts and t.experts_beside_mlp
        assert target[("layers_29", "moe", "experts", "gate_proj")] == (128, hidden, 704)
    else:
        assert t.experts is None
    assert (d.model_type, d.num_hidden_layers, d.hidden_size, d.intermediate_size, d.num_attention_heads,
            d.num_key_value_heads, d.head_dim, d.block_size, d.mask_token_id) == (
        "qwen3", 5, hidden, d_width, d_heads, 8, 128, 16, 4)
    assert d.layer_types == ("sliding_attention",) * 4 + ("full_attention",) and d.sliding_window == 2048
    assert d.target_layer_ids == ids == default_target_layer_ids(layers, 6)
    assert draft[("fc", "kernel")] == (6 * hidden, hidden)
    # the trap: the target's embedding is times sqrt(H) and its logits soft-capped at 30; the draft embeds the raw
    # table, so its config must carry both (what z-lab's serving code applies from the target)
    assert d.input_embedding_scale == pytest.approx(math.sqrt(hidden), rel=1e-12)
    assert d.final_logit_softcapping == 30.0
    text = (CONFIG_DIR / f"{name}.yaml").read_text()
    assert "THE EMBEDDING-SCALE TRAP" in text and "ASSUMED" in text and "Sources" in text


@pytest.mark.parametrize("name", MINIMAX)
def test_minimax_pairings(name):
    """62 layers of 48/8 heads with whole-projection q/k norms, RoPE on 64 of 128 dims, 256 experts top-8 of 1536
    chosen by sigmoid scores plus a selection-only bias; the draft's shape is assumed and says so."""
    p, draft, target = shapes(name)
    t, d = p.target, p.draft
    assert (t.model_type, t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads,
            t.head_dim, t.vocab_size, t.rotary_dims, t.rope.theta) == (
        "minimax_m2", 62, 3072, 48, 8, 128, 200064, 64, 5e6)
    assert t.qk_norm_scope == "projection" and not t.tie_word_embeddings
    e = t.experts
    assert (e.num_experts, e.top_k, e.intermediate_size, e.routing, e.selection_bias) == (
        256, 8, 1536, "sigmoid_topk", True)
    assert t.expert_layers == tuple(range(62))
    assert target[("layers_61", "self_attn", "q_norm", "weight")] == (48 * 128,)
    assert target[("layers_0", "mlp", "e_score_correction_bias")] == (256,)
    assert d.target_layer_ids == (1, 16, 30, 44, 59) and d.num_target_layers == 62 and d.hidden_size == 3072
    assert d.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    text = (CONFIG_DIR / f"{name}.yaml").read_text()
    assert "GATED" in text and "ASSUMED" in text and "partial_rotary_factor" in text


def test_minimax_config_without_the_rotary_factor_is_refused_naming_the_fix():
    """MiniMax's own config.json files carry rotary_dim 64 and (in several copies) no partial_rotary_factor:
    transformers would rotate all 128 dims, MiniMax's code 64, so load_pairing must refuse rather than guess."""
    import yaml

    raw = yaml.safe_load((CONFIG_DIR / "minimax-m2.7-dflash-b16.yaml").read_text())["target"]
    raw.pop("partial_rotary_factor")
    raw["rope_parameters"].pop("partial_rotary_factor")
    with pytest.raises(ConfigError, match=r"'rotary_dim' \(64\) disagrees .*Set \"partial_rotary_factor\": 0\.5"):
        from dflash_jax.models.config import TargetConfig

        TargetConfig.from_dict(raw, "minimax")


KIMI = {  # name: (draft's YaRN amplitude: set to 0.1 ln 64 + 1 where the header says it is assumed, else 1)
    "kimi-k2.5-dflash-b8": 0.1 * np.log(64.0) + 1,
    "kimi-k2.6-dflash-b8": 0.1 * np.log(64.0) + 1,
    "kimi-k2.7-code-dflash-b8": 1.0,
}


@pytest.mark.parametrize("name", KIMI)
def test_kimi_pairings(name):
    """Kimi K2.5-K2.7 (kimi_k25 around a kimi_k2 decoder): 61 MLA layers (q_lora 1536, kv_lora 512, 128 + 64 query
    dims, values of 128, a 576-wide latent cache), layer 0 dense, then 384 experts top-8 of 2048 in one group plus
    one shared expert, routed scaling 2.827, YaRN x64 whose mscale_all_dim enters the softmax scale; untied head;
    the draft: 6 qwen3 layers of 64/8 heads and width 18432, block 8, features [1, 12, 24, 35, 47, 58]. Expected
    values are the config copies the headers cite (moonshotai/Kimi-K2.5's loaded config, the drafts' metadata)."""
    p, draft, target = shapes(name)
    t, d = p.target, p.draft
    assert (t.model_type, t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.vocab_size,
            t.intermediate_size, t.rms_norm_eps, t.max_position_embeddings) == (
        "kimi_k2", 61, 7168, 64, 163840, 18432, 1e-5, 262144)
    assert not t.tie_word_embeddings and t.eos_token_ids == (163585,)
    m = t.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.cache_width,
            m.rope_interleave) == (1536, 512, 128, 64, 128, 576, True)
    assert m.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(64.0) + 1) ** 2, rel=1e-12)
    r = t.rope
    assert (r.rope_type, r.theta, r.factor, r.original_max_position_embeddings, r.beta_fast, r.beta_slow,
            r.attention_factor) == ("yarn", 50000.0, 64.0, 4096, 32.0, 1.0, 1.0)
    e = t.experts
    assert (e.num_experts, e.top_k, e.intermediate_size, e.shared_intermediate_size, e.n_group, e.topk_group,
            e.routed_scaling_factor, e.routing, e.selection_bias, e.norm_topk_prob) == (
        384, 8, 2048, 2048, 1, 1, 2.827, "sigmoid_topk", True, True)
    assert t.expert_layers == tuple(range(1, 61))
    attn = ("layers_60", "self_attn")
    assert target[attn + ("q_a_proj", "kernel")] == (7168, 1536)
    assert target[attn + ("q_b_proj", "kernel")] == (1536, 64 * 192)
    assert target[attn + ("kv_a_proj_with_mqa", "kernel")] == (7168, 576)
    assert target[attn + ("kv_b_proj", "kernel")] == (512, 64 * 256)
    assert target[attn + ("o_proj", "kernel")] == (64 * 128, 7168)
    assert target[("layers_0", "mlp", "gate_proj", "kernel")] == (7168, 18432)
    assert target[("layers_1", "mlp", "experts", "gate_proj")] == (384, 7168, 2048)
    assert target[("layers_1", "mlp", "e_score_correction_bias")] == (384,)
    assert target[("lm_head", "kernel")] == (7168, 163840)
    qc = p.raw["target"]["quantization_config"]  # kept verbatim; the loader reads the checkpoint's own
    assert (qc["quant_method"], qc["format"], qc["config_groups"]["group_0"]["weights"]["group_size"]) == (
        "compressed-tensors", "pack-quantized", 32)
    assert (d.model_type, d.num_hidden_layers, d.hidden_size, d.intermediate_size, d.num_attention_heads,
            d.num_key_value_heads, d.head_dim, d.block_size, d.mask_token_id, d.num_target_layers) == (
        "qwen3", 6, 7168, 18432, 64, 8, 128, 8, 163838, 61)
    assert d.target_layer_ids == (1, 12, 24, 35, 47, 58) == default_target_layer_ids(61, 6)
    assert (d.rope.rope_type, d.rope.theta, d.rope.factor) == ("yarn", 50000.0, 64.0)
    assert d.rope.attention_factor == pytest.approx(KIMI[name], rel=1e-12)
    assert draft[("fc", "kernel")] == (6 * 7168, 7168)
    # 6.48 GiB of bf16 weights (the released K2.5 / K2.6 drafts): what fixes the width at 18432
    assert 6.47 < 2 * sum(int(np.prod(s)) for s in draft.values()) / 2 ** 30 < 6.49
    text = (CONFIG_DIR / f"{name}.yaml").read_text()
    assert "ASSUMED" in text and "Sources" in text and "YaRN" in text and "AMPLITUDE" in text


def test_glm51_pairing():
    """GLM-5.1 (glm_moe_dsa): 78 MLA layers of 64 heads (q_lora 2048, 192 + 64 query dims, values of 256), an
    indexer on every layer (32 heads of 128, top 2048), 3 dense layers then 256 experts top-8 of 2048 plus one
    shared; the draft's shape is assumed and the file says so."""
    p, draft, target = shapes("glm-5.1-fp8-dflash-b8")
    t, d = p.target, p.draft
    assert (t.model_type, t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.vocab_size,
            t.intermediate_size, t.rms_norm_eps, t.max_position_embeddings, t.rope.theta) == (
        "glm_moe_dsa", 78, 6144, 64, 154880, 12288, 1e-5, 202752, 1e6)
    m = t.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.cache_width,
            m.rope_interleave) == (2048, 512, 192, 64, 256, 576, True)
    assert m.softmax_scale == pytest.approx(256 ** -0.5)
    assert (t.dsa.index_topk, t.dsa.index_n_heads, t.dsa.index_head_dim) == (2048, 32, 128)
    assert t.dsa.layer_types == ("full",) * 78
    e = t.experts
    assert (e.num_experts, e.top_k, e.intermediate_size, e.shared_intermediate_size, e.n_group,
            e.routed_scaling_factor) == (256, 8, 2048, 2048, 1, 2.5)
    assert t.expert_layers == tuple(range(3, 78)) and t.eos_token_ids == (154820, 154827, 154829)
    assert target[("layers_77", "mlp", "experts", "gate_proj")] == (256, 6144, 2048)
    assert target[("layers_0", "self_attn", "kv_b_proj", "kernel")] == (512, 64 * (192 + 256))
    assert p.raw["target"]["quantization_config"]["weight_block_size"] == [128, 128]
    assert (d.hidden_size, d.num_target_layers, d.block_size) == (6144, 78, 8)
    assert d.target_layer_ids == default_target_layer_ids(78, 6)
    text = (CONFIG_DIR / "glm-5.1-fp8-dflash-b8.yaml").read_text()
    assert "NO copy of its config.json" in text and "ASSUMED" in text and "Sources" in text


def test_tiny_pairing_matches_the_test_draft():
    p = load_pairing("tiny-test")
    assert p.draft == DraftConfig.from_dict(official_config())


def test_llama_config_warns_about_unverified_ids():
    text = (CONFIG_DIR / "llama3.1-8b-instruct-dflash-b10.yaml").read_text()
    assert "mask_token_id" in text and "check" in text.lower() and "config.json" in text


# ---------------------------------------------------------------------------------------------- errors


def test_unknown_name_lists_the_available_ones():
    pattern = r"qwen9: no such pairing file or name \(available names: .*qwen3-8b-dflash-b16"
    with pytest.raises(ConfigError, match=pattern):
        load_pairing("qwen9")
    with pytest.raises(ConfigError, match=r"no such pairing file or name"):
        load_pairing("some/dir/missing.yaml")


def write(tmp_path, text, name="pair.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def base_yaml(tmp_path=None):
    return (CONFIG_DIR / "tiny-test.yaml").read_text()


def test_custom_file_loads_and_name_defaults_to_stem(tmp_path):
    text = base_yaml(tmp_path).replace("name: tiny-test\n", "")
    p = load_pairing(write(tmp_path, text, "mine.yaml"))
    assert p.name == "mine"


@pytest.mark.parametrize("drop", ["target", "draft"])
def test_missing_section_names_file_and_key(tmp_path, drop):
    import yaml

    raw = yaml.safe_load(base_yaml(tmp_path))
    raw.pop(drop)
    path = write(tmp_path, yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"{esc(path)}: missing top-level key '{drop}'"):
        load_pairing(path)


def test_yaml_syntax_error_names_the_file(tmp_path):
    path = write(tmp_path, "target: {hidden_size: 64\ndraft: [\n")
    with pytest.raises(ConfigError, match=rf"{esc(path)}: not valid YAML \(.*line"):
        load_pairing(path)


def test_not_a_mapping(tmp_path):
    path = write(tmp_path, "- just\n- a list\n")
    with pytest.raises(ConfigError, match=rf"{esc(path)}: expected a mapping with keys 'target' and 'draft'"):
        load_pairing(path)
    path = write(tmp_path, "target: 3\ndraft: {}\n", "scalar.yaml")
    with pytest.raises(ConfigError, match=rf"{esc(path)}: key 'target' must be a mapping"):
        load_pairing(path)


def test_bad_field_inside_a_section_names_file_section_and_field(tmp_path):
    first = "  model_type: qwen3\n  attention_bias"  # the target's model_type (the first occurrence)
    text = base_yaml(tmp_path).replace(first, first.replace("qwen3", "gpt2"), 1)
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"{esc(path)} \[target\]: model_type 'gpt2' is not supported"):
        load_pairing(path)
    path = write(tmp_path, base_yaml(tmp_path).replace("    mask_token_id: 96\n", ""), "nomask.yaml")
    with pytest.raises(ConfigError, match=rf"{esc(path)} \[draft\]: missing required field 'mask_token_id'"):
        load_pairing(path)


def test_draft_that_does_not_fit_the_target_is_refused(tmp_path):
    path = write(tmp_path, base_yaml(tmp_path).replace("mask_token_id: 96", "mask_token_id: 151669"))
    with pytest.raises(ConfigError, match=rf"{esc(path)} \[draft\]: mask_token_id 151669 is outside .*vocab_size 97"):
        load_pairing(path)
    path = write(tmp_path, base_yaml(tmp_path).replace("target_layer_ids: [0, 2]", "target_layer_ids: [0, 4]"),
                 "ids.yaml")
    pattern = rf"{esc(path)} \[draft\]: target_layer_ids contains 4, outside the target's 4 layers"
    with pytest.raises(ConfigError, match=pattern):
        load_pairing(path)


def test_directory_is_not_a_pairing_file(tmp_path):
    with pytest.raises(ConfigError, match=rf"{esc(tmp_path)}: not a file"):
        load_pairing(tmp_path)


def test_abstract_shapes_allocate_nothing():
    """A vocabulary of 10^8 x 4096 floats (1.6 TB) would fail at once if anything were allocated for real."""
    import dataclasses

    p = load_pairing("qwen3-8b-dflash-b16")
    huge_draft = dataclasses.replace(p.draft, vocab_size=10**8)
    assert flatten(abstract_draft_params(huge_draft))[("fc", "kernel")].shape == (5 * 4096, 4096)
    small_target = dataclasses.replace(p.target, vocab_size=10**8, num_hidden_layers=1)
    assert flatten(abstract_target_params(small_target))[("lm_head", "kernel")].shape == (4096, 10**8)


RUN_CONFIGS = sorted((CONFIG_DIR / "runs").glob("*.yaml"))
# The ablation protocol's base (docs/ablations.md) trains the paper's recipe; every other shipped run config
# names the ablation's winner, a DFlash2 draft.
PAPER_RECIPE_RUNS = {"stories260k-b16.yaml"}
DSPARK_RUNS = {"qwen3-8b-dspark-b7.yaml"}  # DeepSpec's recipe, for the released DSpark drafts' target


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_shipped_run_configs_are_valid_and_name_their_draft_kind(path):
    from dflash_jax.training.run_config import load_run_config

    cfg = load_run_config(path)
    expected = None if path.name in PAPER_RECIPE_RUNS else "dspark" if path.name in DSPARK_RUNS else "dflash2"
    assert cfg["draft"]["architecture"] == expected, path.name


def test_dspark_pairings_match_deepspecs_configs():
    """DeepSpec's released block-7 drafts (SPEC 13.7): DSpark with a rank-256 Markov head and a confidence head
    on [h ; w1[x]], and the shifted DFlash baseline without either; both hold copies of the target's embedding
    and head, as their checkpoints do."""
    p, draft, _ = shapes("qwen3-8b-dspark-b7")
    d = p.draft
    assert d.dspark and (d.block_size, d.proposals, d.markov_rank, d.confidence_head, d.confidence_with_markov) == (
        7, 7, 256, True, True)
    assert p.hf_draft == "deepseek-ai/dspark_qwen3_8b_block7" and d.target_layer_ids == (1, 9, 17, 25, 33)
    assert draft[("markov_head", "markov_w1", "embedding")] == (151936, 256)
    assert draft[("confidence_head", "proj", "kernel")] == (4096 + 256, 1)
    assert draft[("embed_tokens", "embedding")] == (151936, 4096) and draft[("lm_head", "kernel")] == (4096, 151936)
    q, baseline, _ = shapes("qwen3-8b-deepspec-dflash-b7")
    assert q.draft.dspark and q.draft.markov_rank == 0 and not q.draft.confidence_head
    assert not any(k[0] in ("markov_head", "confidence_head") for k in baseline)
    assert load_pairing("qwen3-14b-dspark-b7").draft.target_layer_ids == (1, 10, 19, 28, 37)
