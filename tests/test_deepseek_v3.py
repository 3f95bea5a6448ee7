"""DeepSeek-V3 (``deepseek_v3``) and Kimi K2.5-K2.7 (``kimi_k25``, text ``kimi_k2``) targets vs transformers.

The references are transformers' own tiny random models, built here (hidden 64, vocab 300, 4 heads, fp32): multi-
head latent attention with kv_lora_rank 32, qk_nope 16, qk_rope 8, v_head_dim 16; layer 0 dense
(``first_k_dense_replace`` 1), then 8 experts top-2 in 2 groups of which 1 is kept (``n_group`` 2, ``topk_group``
1), renormalised and scaled by ``routed_scaling_factor`` 2.5, plus one ungated shared expert. Every weight is
drawn away from its init (``hf_tiny.randomise``: the layer norms and both latent norms around 1, the router's
``e_score_correction_bias``, a buffer that is zero at init, with a spread of 0.5, comparable to the sigmoid
scores it shifts), saved with ``save_pretrained`` and loaded with ``load_target``. Variants:

- ``lora``: the low-rank query path (q_lora_rank 24), interleaved RoPE (the default, as released);
- ``direct``: ``q_proj`` (q_lora_rank null), split-halves RoPE (``rope_interleave`` false);
- ``yarn``: YaRN (factor 4 over 32 original positions, so the ramp and the scales matter at these lengths) with
  ``mscale`` 1 and ``mscale_all_dim`` 0.5: the cos/sin factor is their ratio of magnitude scales and the
  softmax scale gains get_mscale(4, 0.5)^2; attention biases on;
- ``kimi``: ``Kimi_K25ForConditionalGeneration`` with a tiny vision tower (skipped at load), untied head, saved
  as transformers 5.x writes it (``language_model.model.blocks.N``, ``language_model.lm_head``).

Tolerances (fp32, CPU): logits and every layer's feature within 1e-4 of transformers' (``hf_tiny.scaled_error``:
absolute, over the reference's magnitude where it exceeds 1; ``hidden_states[i + 1]`` for layer i, the last
after the final norm); measured about 1e-6 to 3e-6. The cached (absorbed, latent-cache) forward equals the
expanded one within 1e-5. Greedy decoding through the engine equals ``generate``; DFlash with a random draft
(the latent cache rolled back every round) and a verified tree of 12 nodes equal autoregressive decoding,
token for token. ``test_the_fixture_exercises_each_difference``: ignoring the correction bias, the group limit,
the routed scaling, the shared expert, the interleaving or the mscale moves the logits far past the tolerance.
"""

import dataclasses
import json
import logging
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from dflash_jax.checkpoints.hf_target import load_target, save_target  # noqa: E402
from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft  # noqa: E402
from dflash_jax.checkpoints.safetensors_io import CheckpointError, flatten  # noqa: E402
from dflash_jax.models.config import ConfigError, TargetConfig  # noqa: E402
from dflash_jax.models.draft_config import DraftConfig  # noqa: E402
from dflash_jax.models.target import TargetModel, init_cache  # noqa: E402
from draft_tiny import official_config  # noqa: E402
from hf_tiny import (  # noqa: E402
    batched_forward, check_greedy_matches_generate, check_lossless, decode_with_random_draft, hf_forward, overridden,
    prompts, randomise, scaled_error, worst_errors,
)

TOL = 1e-4
VOCAB = 300
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = {
    "lora": {},
    "direct": dict(q_lora_rank=None, rope_interleave=False),
    "yarn": dict(rope_parameters=YARN, attention_bias=True),
    "kimi": {},
}
KIMI_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, pos_emb_height=4,
                   pos_emb_width=4, pos_emb_time=2, patch_size=14)


def make_hf(variant, out_dir, seed=0):
    torch.manual_seed(seed)
    text = {**TEXT, **VARIANTS[variant]}
    if variant == "kimi":
        cfg = transformers.Kimi_K25Config(text_config={**text, "model_type": "kimi_k2"}, vision_config=KIMI_VISION,
                                          projection_hidden_size=32, tie_word_embeddings=False)
        model = transformers.Kimi_K25ForConditionalGeneration(cfg)
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**text))
    model = randomise(model.eval())
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(variant):
        if variant not in cache:
            out = tmp_path_factory.mktemp(variant)
            hf_model = make_hf(variant, out)
            config, params = load_target(out)
            cache[variant] = (out, hf_model, config, params)
        return cache[variant]

    return get


def test_config_reads_the_family(built):
    _, _, config, params = built("lora")
    m, e = config.mla, config.experts
    assert config.model_type == "deepseek_v3" and (m.q_lora_rank, m.kv_lora_rank, m.cache_width) == (24, 32, 40)
    assert m.rope_interleave and m.softmax_scale == pytest.approx(24 ** -0.5)
    assert (e.routing, e.selection_bias, e.n_group, e.topk_group, e.routed_scaling_factor) == ("sigmoid_topk", True,
                                                                                            2, 1, 2.5)
    assert e.shared_intermediate_size == 32 and not e.shared_expert_gate and config.expert_layers == (1, 2)
    attn, moe = params["layers_0"]["self_attn"], params["layers_1"]["mlp"]
    assert attn["kv_a_proj_with_mqa"]["kernel"].shape == (64, 40) and attn["kv_b_proj"]["kernel"].shape == (32, 128)
    assert attn["q_a_layernorm"]["weight"].shape == (24,) and "gate_proj" in params["layers_0"]["mlp"]
    assert moe["e_score_correction_bias"].shape == (8,) and moe["shared_experts"]["up_proj"]["kernel"].shape == (64, 32)
    yarn = built("yarn")[2]
    mscale = 0.1 * 0.5 * np.log(4.0) + 1
    assert yarn.mla.softmax_scale == pytest.approx(24 ** -0.5 * mscale ** 2)
    assert yarn.rope.attention_factor == pytest.approx((0.1 * np.log(4.0) + 1) / mscale)
    kimi = built("kimi")[2]
    assert kimi.model_type == "kimi_k2" and not kimi.tie_word_embeddings and built("direct")[2].mla.q_lora_rank == 0


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_every_layer_match_transformers(built, variant):
    _, hf_model, config, params = built(variant)
    worst_logit, worst_feat = worst_errors(config, params, hf_model, prompts(VOCAB))
    print(f"{variant}: logits vs hf {worst_logit:.2e}, features {worst_feat:.2e}")
    assert worst_logit <= TOL and worst_feat <= TOL


@pytest.mark.parametrize("variant", ["direct", "yarn"])
def test_the_absorbed_latent_cache_forward_equals_the_expanded_one(built, variant):
    """A prefill through the latent cache (absorbed form, two chunks: the second attends to the cached first)
    gives the plain forward's logits; the cache holds [normed latent | roped shared key] per token."""
    _, _, config, params = built(variant)
    rows = prompts(VOCAB)
    expanded, _ = batched_forward(config, params, rows)
    cut = 9  # two chunks of the same width (one compile), the second attending to the cached first
    tokens = np.zeros((len(rows), 2 * cut), np.int32)
    valid = np.zeros((len(rows), 2 * cut), bool)
    for b, r in enumerate(rows):
        tokens[b, :len(r)], valid[b, :len(r)] = r, True
    positions = np.broadcast_to(np.arange(2 * cut), tokens.shape)
    cache = init_cache(config, len(rows), 32)
    assert cache.keys[0].shape == (3, 1, 32, 40) and cache.values[0].shape == (3, 1, 32, 0)
    apply = jax.jit(TargetModel(config).apply)
    first = apply({"params": params}, tokens[:, :cut], positions[:, :cut], cache=cache, valid=valid[:, :cut])
    second = apply({"params": params}, tokens[:, cut:], positions[:, cut:], cache=first.cache, valid=valid[:, cut:])
    cached = np.concatenate([np.asarray(first.logits), np.asarray(second.logits)], axis=1)
    for b, r in enumerate(rows):
        assert scaled_error(cached[b, :len(r)], expanded[b, :len(r)]) <= 1e-5
    assert list(np.asarray(second.cache.lengths)) == [len(r) for r in rows]


def _layers(params, config, first, change):
    return {**params, **{f"layers_{i}": change(params[f"layers_{i}"]) for i in range(first, config.num_hidden_layers)}}


MUTATIONS = {
    "no_correction_bias": lambda c, p: (c, _layers(p, c, 1, lambda layer: {**layer, "mlp": {
        **layer["mlp"], "e_score_correction_bias": 0 * layer["mlp"]["e_score_correction_bias"]}})),
    "no_group_limit": lambda c, p: (dataclasses.replace(c, experts=dataclasses.replace(c.experts, topk_group=2)), p),
    "no_routed_scaling": lambda c, p: (dataclasses.replace(
        c, experts=dataclasses.replace(c.experts, routed_scaling_factor=1.0)), p),
    "no_shared_expert": lambda c, p: (dataclasses.replace(
        c, experts=dataclasses.replace(c.experts, shared_intermediate_size=0)), p),
    "split_halves_rope": lambda c, p: (dataclasses.replace(c, mla=dataclasses.replace(c.mla, rope_interleave=False)),
                                       p),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS) + ["no_mscale"])
def test_the_fixture_exercises_each_difference(built, mutation):
    """A loader or decoder that ignored one of the family's differences would fail the parity test: each mutation
    moves the logits far past its tolerance."""
    _, hf_model, config, params = built("yarn" if mutation == "no_mscale" else "lora")
    if mutation == "no_mscale":
        config = dataclasses.replace(config, mla=dataclasses.replace(config.mla, softmax_scale=24 ** -0.5))
    else:
        config, params = MUTATIONS[mutation](config, params)
    row = prompts(VOCAB)[2]
    logits, _ = batched_forward(config, params, [row])
    assert scaled_error(logits[0], hf_forward(hf_model, row)[0]) > 100 * TOL


@pytest.fixture(scope="module")
def decoded(built):
    _, _, config, params = built("lora")
    return decode_with_random_draft(config, params, VOCAB, [0, 1])


def test_greedy_continuation_matches_generate(built, decoded):
    check_greedy_matches_generate(built("lora")[1], decoded)


def test_dflash_with_a_random_draft_equals_autoregressive_decoding(decoded):
    check_lossless(decoded)  # the tree: the latent cache's accepted slots moved by one commit


def test_save_target_round_trips_through_transformers(built, tmp_path):
    """``save_target`` writes the names transformers writes (the router bias inside the router, experts one by
    one, shared experts) and a config it reads back to the same model."""
    out, hf_model, config, params = built("yarn")
    save_target(config, params, tmp_path)
    with safe_open(str(out / "model.safetensors"), "np") as a, safe_open(str(tmp_path / "model.safetensors"),
                                                                          "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    assert TargetConfig.from_json(tmp_path) == config
    row = prompts(VOCAB)[1]
    with torch.no_grad():
        ref = hf_model(torch.tensor(row)[None]).logits
        again = reloaded(torch.tensor(row)[None]).logits
    assert float((ref - again).abs().max()) <= 1e-5


def _rewrite(src, dst, rename=lambda k: k, extra=None, config=None, drop=()):
    """A copy of checkpoint ``src`` with its keys renamed, tensors added or dropped and its config.json replaced."""
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), "np") as f:
        tensors = {rename(k): f.get_tensor(k) for k in f.keys() if k not in drop}
    save_file({**tensors, **(extra or {})}, str(dst / "model.safetensors"))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_kimi_loads_the_released_layout_and_skips_the_towers(built, tmp_path, caplog):
    """Released Kimi checkpoints name the text layers ``language_model.model.layers.N`` (transformers' save writes
    ``blocks``): both load to the same params, the vision tower and projector are skipped with a log line."""
    out, _, config, params = built("kimi")
    released = _rewrite(out, tmp_path / "released", lambda k: k.replace("language_model.model.blocks.",
                                                                         "language_model.model.layers."))
    with caplog.at_level(logging.INFO, logger="dflash_jax.checkpoints.hf_target"):
        again_config, again = load_target(released)
    assert again_config == config
    assert all(np.array_equal(again_leaf, flatten(params)[path]) for path, again_leaf in flatten(again).items())
    assert "vision tower" in caplog.text and "multimodal projector" in caplog.text


def test_kimi_reads_its_tie_flag_from_the_top_level(built, tmp_path):
    """transformers ties Kimi's head by the top-level flag (class default true), not text_config's: without the
    flag the model is tied, and a checkpoint that stores a separate head is then refused naming the flag."""
    out = built("kimi")[0]
    cfg = json.loads((out / "config.json").read_text())
    assert TargetConfig.from_dict(cfg).tie_word_embeddings is False
    untold = {k: v for k, v in cfg.items() if k != "tie_word_embeddings"}
    assert cfg["text_config"]["tie_word_embeddings"] is False and TargetConfig.from_dict(untold).tie_word_embeddings
    dst = _rewrite(out, tmp_path / "untold", config=untold)
    with pytest.raises(CheckpointError, match=r"config\.json: the output head is tied.*tie_word_embeddings"):
        load_target(dst)


def test_the_mtp_layer_is_skipped_with_a_log_line(built, tmp_path, caplog):
    out, _, config, params = built("direct")
    mtp = {"model.layers.3.embed_tokens.weight": np.zeros((VOCAB, 64), np.float32),
           "model.layers.3.eh_proj.weight": np.zeros((64, 128), np.float32)}
    dst = _rewrite(out, tmp_path / "mtp", extra=mtp)
    with caplog.at_level(logging.INFO, logger="dflash_jax.checkpoints.hf_target"):
        assert load_target(dst)[0] == config
    assert "skipping 2 tensor(s) of the multi-token prediction layer" in caplog.text


def test_a_missing_latent_norm_is_named(built, tmp_path):
    out = built("direct")[0]
    key = "model.layers.0.self_attn.kv_a_layernorm.weight"
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): '{key}'"):
        load_target(_rewrite(out, tmp_path / "broken", drop=(key,)))


def _config(**overrides):
    return overridden({"model_type": "deepseek_v3", **TEXT}, **overrides)


@pytest.mark.parametrize("overrides, field", [
    (dict(topk_method="greedy"), "topk_method"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope type 'linear'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "topk_group"),
    (dict(n_group=None), "n_group"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_configs_it_cannot_compute_exactly_are_refused(overrides, field):
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_dict(_config(**overrides), "ds/config.json")


def test_released_config_fields_are_accepted():
    """DeepSeek-V3's released config.json (4.x layout: top-level rope_scaling with ``type``, its own routing
    fields, 128 KV heads) reads as the model transformers builds."""
    cfg = _config(rope_parameters=None, rope_theta=10000.0, topk_method="noaux_tc", scoring_func="sigmoid",
                  moe_layer_freq=1, num_key_value_heads=128, num_nextn_predict_layers=1, ep_size=1,
                  rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})
    config = TargetConfig.from_json(_write(cfg))
    assert config.num_key_value_heads == 4 and config.rope.attention_factor == 1.0
    assert config.mla.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)


def _write(cfg):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_python_m_infer_runs_on_a_tiny_deepseek_dir(built, tmp_path, capsys):
    """``python -m infer --target DIR --baseline`` on a tiny DeepSeek-V3 directory (with a tokenizer), with and
    without a random DFlash draft: DFlash matches the baseline."""
    from cli_tiny import write_tokenizer
    from infer.__main__ import main

    out, _, config, _ = built("lora")
    target = shutil.copytree(out, tmp_path / "target")
    write_tokenizer(target)
    draft_config = DraftConfig.from_dict(official_config(
        vocab_size=VOCAB, block_size=8, num_target_layers=config.num_hidden_layers,
        dflash_config={"target_layer_ids": [0, 1], "mask_token_id": VOCAB - 1}))
    save_draft(draft_config, init_draft_params(draft_config, seed=1), tmp_path / "draft")
    common = ["--target", str(target), "--prompt", "hello there", "--max-new-tokens", "12", "--baseline", "--json",
              "--no-chat-template"]
    assert main(common) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(common + ["--ckpt", str(tmp_path / "draft")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"][0]["matches_baseline"] is True
    assert doc["results"][0]["tokens"] == alone["results"][0]["tokens"]
