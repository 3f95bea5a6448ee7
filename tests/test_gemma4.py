"""Gemma 4 targets (``gemma4`` / ``gemma4_text``, ``gemma4_unified`` / ``gemma4_unified_text``) vs transformers.

The references are transformers' own tiny random models, built here (hidden 64, vocab 300, fp32) with every
weight drawn away from its init (``hf_tiny.randomise``: the four layer norms, the MoE block's three numbered
norms, q/k norms, attention biases, the router's ``scale`` and ``per_expert_scale``, and the saved
``layer_scalar`` buffers), saved with ``save_pretrained`` and loaded with ``load_target``:

- ``dense``: ``Gemma4ForConditionalGeneration`` with a tiny vision tower (loaded text-only), 4 layers sliding /
  full / sliding / full, window 4 (shorter than every prompt), sliding heads of 16 and full heads of 32 (the
  ``per_layer_config`` transformers writes) with their own ``v_proj``, attention biases, soft-capping 30;
- ``moe``: ``Gemma4ForCausalLM`` with ``attention_k_eq_v`` (full layers: 1 KV head, V from the raw k_proj) and
  the expert block (4 experts, top-2) beside the dense MLP of every layer, as the 26B-A4B;
- ``unified``: ``Gemma4UnifiedForConditionalGeneration``, the 12B's layout (``gemma4_unified``), 3 layers.

Tolerances (fp32, CPU): logits and every layer's ``hidden_states[i + 1]`` (the last after the final norm)
within 1e-5 of transformers' (``hf_tiny.scaled_error``: absolute, over the reference's magnitude where it
exceeds 1; measured: at most about 4e-6), on a batch of rows of 5, 11 and 17 tokens. Greedy decoding through
the engine equals ``generate``, and DFlash with a random draft (a rollback in every round) equals
autoregressive decoding, token for token. ``test_the_fixture_exercises_each_difference`` checks that dropping
any one of the family's differences moves the logits far past the tolerance. ``save_target`` writes back
exactly the tensors transformers saved (text-only for the multimodal ones), and transformers reads them.
"""

import dataclasses
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from dflash_jax import sharding  # noqa: E402
from dflash_jax.checkpoints.hf_target import load_target, save_target  # noqa: E402
from dflash_jax.checkpoints.safetensors_io import CheckpointError, flatten  # noqa: E402
from dflash_jax.models.config import ConfigError, TargetConfig  # noqa: E402
from dflash_jax.models.draft_config import DraftConfig  # noqa: E402
from dflash_jax.models.layers import rope_inv_freq  # noqa: E402
from draft_tiny import official_config  # noqa: E402
from hf_tiny import (  # noqa: E402
    batched_forward, check_greedy_matches_generate, check_lossless, decode_with_random_draft, hf_forward,
    overridden, prompts, randomise, scaled_error, worst_errors,
)

TOL = 1e-5
VOCAB = 300
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=30.0,
            rms_norm_eps=1e-6, eos_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16)
VARIANTS = {  # config class, model class, text config, multimodal
    "dense": ("Gemma4Config", "Gemma4ForConditionalGeneration",
              dict(TEXT, attention_bias=True, hidden_size_per_layer_input=0), True),
    "moe": ("Gemma4TextConfig", "Gemma4ForCausalLM",
            dict(TEXT, attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                 enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32), False),
    "unified": ("Gemma4UnifiedConfig", "Gemma4UnifiedForConditionalGeneration",
                dict(TEXT, num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                     attention_k_eq_v=True, num_global_key_value_heads=1), True),
}


def make_hf_gemma4(variant, out_dir, seed=0):
    cfg_cls, model_cls, text, multimodal = VARIANTS[variant]
    cls = getattr(transformers, cfg_cls)
    cfg = cls(text_config=text, vision_config=VISION, audio_config=None) if multimodal else cls(**text)
    torch.manual_seed(seed)
    model = randomise(getattr(transformers, model_cls)(cfg).eval())
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(variant) -> (directory, transformers model, config, params)``, each made once."""
    made = {}

    def get(variant):
        if variant not in made:
            out = tmp_path_factory.mktemp(variant)
            hf_model = make_hf_gemma4(variant, out)
            made[variant] = (out, hf_model, *load_target(out))
        return made[variant]

    return get


def test_config_reads_the_family(built):
    _, hf_model, config, params = built("moe")
    assert config.model_type == "gemma4_text" and config.tie_word_embeddings
    assert config.layer_windows == (4, None, 4, None) and config.attention_k_eq_v and config.v_norm
    assert config.attention_dims(4)[:2] == (16, 2) and config.attention_dims(None)[:2] == (32, 1)
    assert config.global_rope.rope_type == "proportional" and config.global_rope.theta == 1e6
    assert (config.attention_scale, config.hidden_act, config.final_logit_softcapping) == (1.0, "gelu_tanh", 30.0)
    e = config.experts
    assert (e.num_experts, e.top_k, e.norm_topk_prob, e.router_norm_eps, e.activation) == (4, 2, True, 1e-6,
                                                                                         "gelu_tanh")
    full, sliding = params["layers_1"], params["layers_0"]
    assert "v_proj" not in full["self_attn"] and sliding["self_attn"]["v_proj"]["kernel"].shape == (64, 32)
    assert full["self_attn"]["k_norm"]["weight"].shape == (32,) and full["layer_scalar"].shape == (1,)
    assert full["moe"]["experts"]["gate_proj"].shape == (4, 64, 32)
    assert full["moe"]["router"]["per_expert_scale"].shape == (4,)
    # proportional RoPE on the full layers: 4 of 16 frequencies turn (SPEC 11.1), exactly as transformers has them
    inv = rope_inv_freq(config.global_rope, 32)
    np.testing.assert_array_equal(inv, hf_model.model.rotary_emb.full_attention_inv_freq.numpy())
    assert np.count_nonzero(inv) == 4
    dense = built("dense")[2]  # a multimodal checkpoint's text_config, per_layer_config as transformers writes it
    assert dense.model_type == "gemma4_text" and not dense.attention_k_eq_v and dense.attention_dims(None)[:2] == (
        32, 2) and dense.qkv_bias and dense.experts is None
    assert built("unified")[2].model_type == "gemma4_unified_text"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_every_layer_match_transformers(built, variant):
    _, hf_model, config, params = built(variant)
    worst_logit, worst_feat = worst_errors(config, params, hf_model, prompts(VOCAB))
    print(f"gemma4 {variant}: logits vs hf {worst_logit:.2e}, features {worst_feat:.2e}")
    assert worst_logit <= TOL and worst_feat <= TOL


def _set(params, leaf, value):
    """``params`` with every leaf named ``leaf`` (``layer_scalar``, ``scale``, ...) set to ``value``."""
    if isinstance(params, dict):
        return {k: (np.full(v.shape, value, v.dtype) if k == leaf else _set(v, leaf, value))
                for k, v in params.items()}
    return params


MUTATIONS = {
    "unit_layer_scalar": lambda c, p: (c, _set(p, "layer_scalar", 1.0)),
    "unit_router_scale": lambda c, p: (c, _set(p, "scale", 1.0)),
    "unit_per_expert_scale": lambda c, p: (c, _set(p, "per_expert_scale", 1.0)),
    "no_v_norm": lambda c, p: (dataclasses.replace(c, v_norm=False), p),
    "softmax_scale_1_over_sqrt_d": lambda c, p: (dataclasses.replace(c, attention_scale=None), p),
    "full_layers_default_rope": lambda c, p: (dataclasses.replace(c, global_rope=c.rope), p),
    "unscaled_embeddings": lambda c, p: (dataclasses.replace(c, scale_embeddings=False), p),
    "no_softcap": lambda c, p: (dataclasses.replace(c, final_logit_softcapping=None), p),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_fixture_exercises_each_difference(built, mutation):
    """A loader or decoder that ignored one of the family's differences fails the parity test: each mutation
    moves the logits far past its tolerance."""
    _, hf_model, config, params = built("moe")
    row = prompts(VOCAB)[2]
    logits, _ = batched_forward(*MUTATIONS[mutation](config, params), [row])
    assert scaled_error(logits[0], hf_forward(hf_model, row)[0]) > 100 * TOL


@pytest.fixture(scope="module")
def decoded(built):
    _, _, config, params = built("moe")
    return decode_with_random_draft(config, params, VOCAB, [0, 2], input_embedding_scale=config.hidden_size ** 0.5)


def test_greedy_continuation_matches_generate(built, decoded):
    check_greedy_matches_generate(built("moe")[1], decoded)


def test_dflash_with_a_random_draft_equals_autoregressive_decoding(decoded):
    check_lossless(decoded)  # the tree: sliding rings and full layers of their own shapes


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_target_writes_back_what_transformers_saved(built, variant, tmp_path):
    """The key maps both ways: exported names and tensors equal the checkpoint's own (the language model of
    a multimodal one, under ``model.``), and transformers reads the export back to the same model."""
    out, hf_model, config, params = built(variant)
    save_target(config, params, tmp_path)
    with safe_open(str(out / "model.safetensors"), "np") as a, safe_open(str(tmp_path / "model.safetensors"),
                                                                          "np") as b:
        text = {k.replace("model.language_model.", "model."): k for k in a.keys()
                if k.startswith("model.language_model.") or not VARIANTS[variant][3]}
        assert sorted(b.keys()) == sorted(text)
        for key, stored in text.items():
            np.testing.assert_array_equal(b.get_tensor(key), a.get_tensor(stored), err_msg=key)
    assert TargetConfig.from_json(tmp_path) == config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    row = prompts(VOCAB)[1]
    assert float(np.abs(hf_forward(reloaded, row)[0] - hf_forward(hf_model, row)[0]).max()) <= 1e-5


def test_the_sharding_rules_cover_every_parameter(built):
    params = built("moe")[3]
    axes = {"/".join(path): sharding.logical_axes("/".join(path), np.ndim(leaf)) for path, leaf in
            flatten(params).items()}
    assert axes["layers_0/moe/experts/gate_proj"] == ("experts", "embed", "mlp")
    assert axes["layers_0/moe/router/proj/kernel"] == ("embed", None)
    assert axes["layers_0/post_feedforward_layernorm_2/weight"] == ("norm",)


@pytest.mark.parametrize("key", ["model.layers.1.layer_scalar", "model.layers.0.experts.gate_up_proj",
                                 "model.layers.2.router.per_expert_scale"])
def test_a_checkpoint_missing_a_tensor_names_it(built, key, tmp_path):
    out = built("moe")[0]
    shutil.copy(out / "config.json", tmp_path / "config.json")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        save_file({k: f.get_tensor(k) for k in f.keys() if k != key}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_target(tmp_path)


def _config(**overrides):
    return overridden({"model_type": "gemma4_text", **VARIANTS["moe"][2]}, **overrides)


@pytest.mark.parametrize("overrides, field", [
    (dict(hidden_size_per_layer_input=None), "hidden_size_per_layer_input"),  # absent: transformers' 256, PLE on
    (dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(head_dim=None), "head_dim"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(global_head_dim=None, num_global_key_value_heads=None,
          per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 64}}), "per_layer_config"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope_parameters"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "dynamic"}, "full_attention": {}}), "rope"),
])
def test_configs_it_cannot_compute_exactly_are_refused(overrides, field):
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_dict(_config(**overrides), "gemma4/config.json")


def test_released_config_forms_are_read_alike():
    """``global_head_dim`` / ``num_global_key_value_heads`` (released checkpoints) and ``per_layer_config``
    (what transformers 5.x writes) give the same model; without either the full layers' head_dim is
    transformers' 512; the last layer is always full; a ``gemma4`` config nests its text model."""
    released = TargetConfig.from_dict(_config())
    written = TargetConfig.from_dict(_config(global_head_dim=None, num_global_key_value_heads=None, per_layer_config={
        "1": {"head_dim": 32, "num_key_value_heads": 1}, "3": {"head_dim": 32, "num_key_value_heads": 1}}))
    assert released == written
    assert TargetConfig.from_dict(_config(global_head_dim=None)).attention_dims(None)[0] == 512
    types = ["sliding_attention"] * 4
    assert TargetConfig.from_dict(_config(layer_types=types)).layer_windows == (4, 4, 4, None)
    nested = {"model_type": "gemma4", "text_config": {k: v for k, v in _config().items() if k != "model_type"},
              "vision_config": {}, "tie_word_embeddings": True}
    assert TargetConfig.from_dict(nested) == released


def test_a_draft_reading_unscaled_rows_is_warned(built):
    """Gemma 4 scales its embedding rows by sqrt(H); a DFlash draft reads the raw table times its own
    ``input_embedding_scale``. A draft config without it on a Gemma target is warned about (naming the field
    and the value to set); a new draft shaped by ``for_target`` takes the target's scale and soft-cap, the
    values transformers' own embedding module and head apply (its ``embed_scale``, ``final_logit_softcapping``)."""
    from dflash_jax.errors import ServingWarning

    _, hf_model, config, _ = built("moe")
    unscaled = DraftConfig.from_dict(official_config(vocab_size=VOCAB, block_size=8,
                                                     num_target_layers=config.num_hidden_layers))
    with pytest.warns(ServingWarning, match=r"input_embedding_scale.* 8\b"):
        unscaled.validate_against(config, source="draft/config.json")
    new = DraftConfig.for_target(config, num_layers=1, block_size=8)
    embed = hf_model.get_input_embeddings()
    assert new.input_embedding_scale == float(embed.embed_scale)
    assert new.final_logit_softcapping == hf_model.config.get_text_config().final_logit_softcapping
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ServingWarning)
        new.validate_against(config)
