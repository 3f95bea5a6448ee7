"""Muse Glimmer targets (``muse_glimmer`` / ``muse_glimmer_text``) vs transformers.

The reference is transformers' own tiny random ``MuseGlimmerForConditionalGeneration`` (with a tiny vision
tower, loaded text-only), built here (hidden 64, vocab 300, fp32, 4 layers: three sliding with window 4, shorter
than every prompt, and the last full, transformers' 3:1 default) with every weight drawn away from its init
(``hf_tiny.randomise``: the four (1 + w) layer norms, the w-form final norm, attention biases, the gate
projection), saved with ``save_pretrained`` and loaded with ``load_target``. ``layer_rope_theta`` is
``[1e4, 0, 5e3, 0]``: no RoPE on the full layer and on one sliding layer, and a non-zero per-layer theta that
transformers reads only as a flag (the global theta applies). The soft-cap is 0.3 so that it bends these
random logits (after the default ``output_multiplier``, about 0.2 x their raw size).

Tolerances (fp32, CPU): logits and every layer's ``hidden_states[i + 1]`` (the last after the final norm)
within 1e-4 of transformers' (``hf_tiny.scaled_error``: absolute, over the reference's magnitude where it
exceeds 1), on a batch of rows of 5, 11 and 17 tokens. Greedy decoding through the engine equals
``generate``; DFlash with a random draft (a rollback in every round) equals autoregressive decoding token for
token, greedy, sampled (top-k 1: the sampling acceptance path, deterministic) and as a verified tree.
``test_the_fixture_exercises_each_difference`` checks that dropping any one of the family's differences moves
the logits far past the tolerance. ``save_target`` writes back exactly the language model transformers saved,
and transformers reads it.
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
from hf_tiny import (  # noqa: E402
    MUSE_TEXT, MUSE_VISION, MUSE_VOCAB, batched_forward, check_greedy_matches_generate, check_lossless,
    decode_with_random_draft, hf_forward, make_hf_muse_glimmer, overridden, prompts, scaled_error, worst_errors,
)

TOL = 1e-4
VOCAB = MUSE_VOCAB
WINDOW = MUSE_TEXT["sliding_window"]
TEXT, VISION = MUSE_TEXT, MUSE_VISION


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("muse_glimmer")
    hf_model = make_hf_muse_glimmer(out)
    return (out, hf_model, *load_target(out))


def test_config_reads_the_family(built):
    _, hf_model, config, params = built
    assert config.model_type == "muse_glimmer_text" and not config.tie_word_embeddings
    assert config.layer_windows == (WINDOW, WINDOW, WINDOW, None) and config.nope_layers == (1, 3)
    assert config.rope.theta == 1e4 and config.embed_norm and config.final_norm_plain
    assert (config.query_scale, config.post_norm_eps, config.rms_norm_eps) == (3.87, 1e-8, 1e-5)
    assert (config.output_multiplier, config.final_logit_softcapping) == (0.19611613513818404, 0.3)
    attn = params["layers_3"]["self_attn"]
    assert "q_norm" not in attn and "k_norm" not in attn  # weightless: nothing to load
    assert attn["gate_proj"]["kernel"].shape == (64, 64) and "bias" not in attn["gate_proj"]
    assert attn["q_proj"]["bias"].shape == (64,)
    assert set(params["layers_0"]) == {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
                                       "pre_feedforward_layernorm", "post_feedforward_layernorm"}
    # transformers' own defaults when the config leaves them out: 3:1 from the last layer, NoPE on the full ones
    default = TargetConfig.from_dict({"model_type": "muse_glimmer_text", **overridden(
        TEXT, num_hidden_layers=8, layer_rope_theta=None, sliding_window=None)})
    assert default.layer_windows == (2048, 2048, 2048, None) * 2 and default.nope_layers == (3, 7)
    hf_default = transformers.MuseGlimmerTextConfig(num_hidden_layers=8)
    assert [t == "full_attention" for t in hf_default.layer_types] == [w is None for w in default.layer_windows]


def test_logits_and_every_layer_match_transformers(built):
    _, hf_model, config, params = built
    worst_logit, worst_feat = worst_errors(config, params, hf_model, prompts(VOCAB))
    print(f"muse_glimmer: logits vs hf {worst_logit:.2e}, features {worst_feat:.2e}")
    assert worst_logit <= TOL and worst_feat <= TOL


def _replace(**kw):
    return lambda c, p: (dataclasses.replace(c, **kw), p)


MUTATIONS = {
    "no_embed_norm": _replace(embed_norm=False),
    "final_norm_one_plus_w": _replace(final_norm_plain=False),
    "layer_norms_w": _replace(zero_centered_norms=False, final_norm_plain=False),
    "query_unscaled": _replace(query_scale=1.0),
    "query_and_key_scaled": lambda c, p: (dataclasses.replace(c, query_scale=c.query_scale ** 0.5,
                                                              attention_scale=c.query_scale / c.head_dim ** 0.5), p),
    "no_gate": _replace(attention_gate_proj=False),
    "rope_everywhere": _replace(nope_layers=()),
    "nope_on_full_layers_only": _replace(nope_layers=(3,)),
    "no_window": lambda c, p: (dataclasses.replace(c, layer_windows=(None,) * c.num_hidden_layers), p),
    "no_output_multiplier": _replace(output_multiplier=1.0),
    "no_softcap": _replace(final_logit_softcapping=None),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_fixture_exercises_each_difference(built, mutation):
    """A loader or decoder that ignored one of the family's differences fails the parity test: each mutation
    moves the logits (or, where the soft-cap hides it, a layer's features) far past the tolerance."""
    _, hf_model, config, params = built
    row = prompts(VOCAB)[2]
    logits, feats = batched_forward(*MUTATIONS[mutation](config, params), [row])
    ref_logits, ref_hidden = hf_forward(hf_model, row)
    errors = [scaled_error(logits[0], ref_logits)] + [
        scaled_error(feats[0, :, i], ref_hidden[i + 1]) for i in range(config.num_hidden_layers)]
    assert max(errors) > 100 * TOL


@pytest.fixture(scope="module")
def decoded(built):
    _, _, config, params = built
    return decode_with_random_draft(config, params, VOCAB, [0, 2], sampled=True)


def test_greedy_continuation_matches_generate(built, decoded):
    check_greedy_matches_generate(built[1], decoded)


def test_dflash_with_a_random_draft_equals_autoregressive_decoding(decoded):
    check_lossless(decoded)  # the tree: sliding rings and the NoPE full layer; sampling at top-k 1


def test_save_target_writes_back_what_transformers_saved(built, tmp_path):
    """The key map both ways: the export holds exactly the checkpoint's language model and head under the
    names transformers gave them, and transformers reads it back to the same logits."""
    out, hf_model, config, params = built
    save_target(config, params, tmp_path)
    with safe_open(str(out / "model.safetensors"), "np") as a, safe_open(str(tmp_path / "model.safetensors"),
                                                                          "np") as b:
        text = [k for k in a.keys() if k.startswith("model.language_model.") or k == "lm_head.weight"]
        assert sorted(b.keys()) == sorted(text)
        for key in text:
            np.testing.assert_array_equal(b.get_tensor(key), a.get_tensor(key), err_msg=key)
    assert TargetConfig.from_json(tmp_path) == config
    reloaded = transformers.MuseGlimmerForConditionalGeneration.from_pretrained(tmp_path).eval()
    row = prompts(VOCAB)[1]
    assert float(np.abs(hf_forward(reloaded, row)[0] - hf_forward(hf_model, row)[0]).max()) <= 1e-6


def test_the_sharding_rules_cover_every_parameter(built):
    params = built[3]
    axes = {"/".join(path): sharding.logical_axes("/".join(path), np.ndim(leaf)) for path, leaf in
            flatten(params).items()}
    assert axes["layers_0/self_attn/gate_proj/kernel"] == ("embed", "heads")
    assert axes["layers_0/pre_feedforward_layernorm/weight"] == ("norm",)


@pytest.mark.parametrize("key", ["model.language_model.layers.1.self_attn.gate_proj.weight",
                                 "model.language_model.layers.3.post_feedforward_layernorm.weight",
                                 "model.language_model.norm.weight", "lm_head.weight"])
def test_a_checkpoint_missing_a_tensor_names_it(built, key, tmp_path):
    out = built[0]
    shutil.copy(out / "config.json", tmp_path / "config.json")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        save_file({k: f.get_tensor(k) for k in f.keys() if k != key}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_target(tmp_path)


def test_a_tensor_of_the_wrong_shape_names_file_and_key(built, tmp_path):
    out = built[0]
    key = "model.language_model.layers.2.self_attn.gate_proj.weight"
    shutil.copy(out / "config.json", tmp_path / "config.json")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = tensors[key][:32]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{key.replace('.', r'[.]')}"):
        load_target(tmp_path)


def _config(**overrides):
    return overridden({"model_type": "muse_glimmer_text", **TEXT}, **overrides)


@pytest.mark.parametrize("overrides, field", [
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]),
     "layer_types"),
    (dict(layer_rope_theta=[1e4, 0]), "layer_rope_theta"),
    (dict(layer_rope_theta=[1e4, -1, 1e4, 0]), "layer_rope_theta"),
    (dict(post_norm_eps=0), "post_norm_eps"),
    (dict(qk_scale_factor="3.87"), "qk_scale_factor"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "rope"),
])
def test_configs_it_cannot_compute_exactly_are_refused(overrides, field):
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_dict(_config(**overrides), "muse/config.json")


def test_the_nested_config_reads_as_its_text_config():
    nested = {"model_type": "muse_glimmer", "text_config": dict(TEXT), "vision_config": dict(VISION)}
    assert TargetConfig.from_dict(nested) == TargetConfig.from_dict(_config())
    with pytest.raises(ConfigError, match="text_config"):
        TargetConfig.from_dict({"model_type": "muse_glimmer", "vision_config": dict(VISION)}, "muse/config.json")


def test_random_params_start_the_final_norm_where_transformers_does(tmp_path):
    """``random_params`` (speed presets, new models) starts the w-form final norm at one, as transformers' own
    init does (reference: an un-randomised transformers model, saved and loaded); at zero every logit would be
    0. The (1 + w) layer norms start at zero, their identity (transformers starts them at one, a scale of 2:
    not copied, checked here so that the choice is deliberate)."""
    import jax

    from dflash_jax.checkpoints.hf_target import abstract_target_params
    from dflash_jax.models.init import random_params

    cfg = transformers.MuseGlimmerConfig(text_config=MUSE_TEXT, vision_config=MUSE_VISION, out_hidden_size=128,
                                         projector_hidden_size=32)
    transformers.MuseGlimmerForConditionalGeneration(cfg).save_pretrained(tmp_path)
    config, reference = load_target(tmp_path)
    drawn = random_params(abstract_target_params(config), zero_centered_norms=config.zero_centered_norms,
                          final_norm_plain=config.final_norm_plain)
    assert jax.tree_util.tree_structure(drawn) == jax.tree_util.tree_structure(reference)
    np.testing.assert_array_equal(np.asarray(drawn["norm"]["weight"]), np.asarray(reference["norm"]["weight"]))
    layer_norms = [leaf for path, leaf in flatten(drawn).items()
                   if path[0].startswith("layers_") and path[-1] == "weight" and leaf.ndim == 1]
    assert len(layer_norms) == 4 * config.num_hidden_layers
    assert all(not np.asarray(leaf).any() for leaf in layer_norms)
