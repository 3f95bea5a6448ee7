"""A tiny random target (no torch needed) and a tiny draft for engine tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints.hf_target import abstract_target_params
from dflash_jax.checkpoints.official_draft import init_draft_params
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.models.target import TargetModel
from draft_tiny import HIDDEN, TARGET_LAYERS, VOCAB, official_config


def tiny_target(seed: int = 0, vocab: int = VOCAB, scale: float = 0.3, tied: bool = False):
    config = TargetConfig.from_dict(dict(
        model_type="qwen3", vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=tied,
    ))
    # Random N(0, scale) matrices (norms at one): larger than Flax's default init so that greedy choices are
    # well separated, and drawn with NumPy because op-by-op JAX init takes seconds.
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape) * scale if len(x.shape) > 1 else np.ones(x.shape), x.dtype),
        abstract_target_params(config),
    )
    return config, params


MOE_FAMILIES = {
    # Layer 1 dense among routed layers; renormalised top-2 of 4 experts.
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1]),
    # Sliding window 6 on even layers, sinks, biases, YaRN; top-2 of 4 experts.
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=32, sliding_window=6, rope_parameters={
                        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
}


_LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, partial_rotary_factor=0.25, intermediate_size=128)
HYBRID_FAMILIES = {
    # Layers 0-2 Gated DeltaNet, layer 3 gated full attention (the default interval of 4).
    "qwen3_5": dict(model_type="qwen3_5_text", **_LINEAR),
    # Experts with a shared expert on every layer.
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48, **_LINEAR),
    # The full layer second, the last one linear; layer 2 dense.
    "qwen3_next": dict(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[2], layer_types=[
                           "linear_attention", "full_attention", "linear_attention", "linear_attention"],
                       **_LINEAR),
}


def tiny_moe_target(family: str, seed: int = 0, vocab: int = VOCAB, scale: float = 0.3):
    """A tiny random target of a mixture-of-experts (``MOE_FAMILIES``) or hybrid (``HYBRID_FAMILIES``)
    ``family`` (4 layers, 4 experts), random like ``tiny_target``; gpt-oss's sinks are drawn around one so
    that they take a real share of the softmax; zero-centred norms around zero (a scale of ``1 + w``)."""
    fields = {**MOE_FAMILIES, **HYBRID_FAMILIES}[family]
    config = TargetConfig.from_dict(dict(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512, **fields))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name, parent = path[-1].key, path[-2].key if len(path) > 1 else ""
        if name == "sinks":
            return jnp.asarray(1.0 + rng.standard_normal(x.shape), x.dtype)
        if name.endswith("bias"):
            return jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
        if name == "weight" and len(x.shape) == 1:  # RMSNorm weights
            centre = 0.0 if config.zero_centered_norms and not (parent == "norm" and len(path) > 2
                                                                and path[-3].key == "linear_attn") else 1.0
            return jnp.asarray(centre + 0.1 * rng.standard_normal(x.shape), x.dtype)
        if name in ("A_log", "dt_bias"):  # decays exp(-exp(A_log) softplus(a + dt_bias)) spread over (0, 1)
            return jnp.asarray(0.5 * rng.standard_normal(x.shape), x.dtype)
        return jnp.asarray(rng.standard_normal(x.shape) * scale if len(x.shape) > 1 else np.ones(x.shape), x.dtype)

    return config, jax.tree_util.tree_map_with_path(draw, abstract_target_params(config))


def tiny_draft(vocab: int = VOCAB, block: int = 8, seed: int = 1):
    cfg = official_config(vocab_size=vocab, block_size=block,
                          dflash_config={"target_layer_ids": [0, 2], "mask_token_id": vocab - 1})
    config = DraftConfig.from_dict(cfg)
    return config, init_draft_params(config, seed=seed)


def planted_schedule(prompts, continuations, schedules, block: int, width: int):
    """``(reference, errors)`` for ``OracleProposer``: the rows' prompts + greedy continuations by position, and
    an error right after each round's accepted part, so that row b's rounds commit ``schedules[b]`` tokens in
    turn (``block`` = the whole block accepted)."""
    reference = np.zeros((len(prompts), width), np.int32)
    errors = np.zeros((len(prompts), width), bool)
    for b, (prompt, gen) in enumerate(zip(prompts, continuations)):
        seq = list(prompt) + list(gen)
        reference[b, : len(seq)] = seq
        start = len(prompt)
        for length in schedules[b]:
            if length < block:
                errors[b, start + length] = True
            start += length
    return reference, errors


def padded_features(tc, tp, sequences, layer_ids):
    """The target's features of every token sequence in ONE forward (op by op on XLA:CPU, so one call rather
    than one per row), rows right-padded: the target is causal, so a row's features do not see its padding."""
    width = max(map(len, sequences))
    padded = np.zeros((len(sequences), width), np.int32)
    for b, sequence in enumerate(sequences):
        padded[b, : len(sequence)] = sequence
    return TargetModel(tc).apply({"params": tp}, jnp.asarray(padded), jnp.broadcast_to(jnp.arange(width), padded.shape),
                                 feature_layers=layer_ids, skip_logits=True).features
