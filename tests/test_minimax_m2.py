"""MiniMax-M2 targets (``model_type: minimax_m2``) vs transformers' own ``MiniMaxM2ForCausalLM``.

The reference is a tiny random model built here from a ``MiniMaxM2Config`` (hidden 64, 3 layers, 4/2 heads of
16, 8 experts top-2, partial_rotary_factor 0.5, vocab 300, fp32), saved with ``save_pretrained`` (per-expert
``block_sparse_moe.experts.{j}.w1/w3/w2``) and loaded with ``load_target``. Every weight is drawn away from its
init, the RMSNorm weights (the whole-projection q/k norms included) around 1 and the selection-only
``e_score_correction_bias`` (a buffer, zero at init) with a spread of 0.5, comparable to the sigmoid scores
it shifts: ``test_the_fixture_exercises_each_difference`` checks that ignoring the bias, either q/k norm or
the partial rotary changes the logits by far more than the tolerance (mutation checks also run by hand on
the code: ``route`` ignoring the bias, the q/k norms per head, full rotary: the parity test fails).

Tolerances (fp32, CPU): logits and every layer's feature within 1e-4 of transformers' (absolute, times the
reference's largest magnitude where it exceeds 1; ``hidden_states[i + 1]`` for layer ``i``, the last one
after the final norm, SPEC 11.0); greedy continuations and DFlash (random draft) vs autoregressive decoding
identical token for token; a save/load round trip through transformers within 1e-5.
"""

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax.checkpoints.hf_target import load_target, save_target  # noqa: E402
from dflash_jax.checkpoints.official_draft import init_draft_params  # noqa: E402
from dflash_jax.engine.decoder import Decoder  # noqa: E402
from dflash_jax.models.config import ConfigError, TargetConfig  # noqa: E402
from dflash_jax.models.draft_config import DraftConfig  # noqa: E402
from draft_tiny import official_config  # noqa: E402
from hf_tiny import (  # noqa: E402
    batched_forward, hf_forward, overridden, prompts, randomise, scaled_error, worst_errors,
)

TOL = 1e-4
VOCAB = 300
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=256,
            rms_norm_eps=1e-6, partial_rotary_factor=0.5, bos_token_id=0, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def make_hf_minimax(out_dir, seed=0):
    cfg = transformers.MiniMaxM2Config(**TINY)
    torch.manual_seed(seed)
    model = randomise(transformers.MiniMaxM2ForCausalLM(cfg).eval())  # the selection bias is a buffer
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("minimax_m2")
    hf_model = make_hf_minimax(out)
    config, params = load_target(out)
    return out, hf_model, config, params


def test_config_reads_the_family(pair):
    _, _, config, params = pair
    assert config.model_type == "minimax_m2" and config.qk_norm and config.qk_norm_scope == "projection"
    assert config.rotary_dims == 8 and config.rope.theta == 10000.0
    e = config.experts
    assert (e.routing, e.norm_topk_prob, e.selection_bias, e.shared_intermediate_size) == ("sigmoid_topk", True,
                                                                                         True, 0)
    assert config.expert_layers == (0, 1, 2) and e.intermediate_size == 32
    attn, mlp = params["layers_0"]["self_attn"], params["layers_0"]["mlp"]
    assert attn["q_norm"]["weight"].shape == (64,) and attn["k_norm"]["weight"].shape == (32,)
    assert mlp["e_score_correction_bias"].shape == (8,) and mlp["gate"]["kernel"].shape == (64, 8)


def test_logits_and_every_layer_match_transformers(pair):
    _, hf_model, config, params = pair
    worst_logit, worst_feat = worst_errors(config, params, hf_model, prompts(VOCAB))
    print(f"minimax_m2: logits vs hf {worst_logit:.2e}, features {worst_feat:.2e}")
    assert worst_logit <= TOL and worst_feat <= TOL


def _no_bias(config, params):
    p = {**params, **{f"layers_{i}": {**params[f"layers_{i}"], "mlp": {
        **params[f"layers_{i}"]["mlp"], "e_score_correction_bias": 0 * params[f"layers_{i}"]["mlp"][
            "e_score_correction_bias"]}} for i in range(config.num_hidden_layers)}}
    return config, p


def _unit_norm(which):
    def mutate(config, params):
        layers = {}
        for i in range(config.num_hidden_layers):
            attn = params[f"layers_{i}"]["self_attn"]
            attn = {**attn, which: {"weight": 0 * attn[which]["weight"] + 1}}
            layers[f"layers_{i}"] = {**params[f"layers_{i}"], "self_attn": attn}
        return config, {**params, **layers}
    return mutate


def _full_rotary(config, params):
    return dataclasses.replace(config, rotary_dim=0), params


@pytest.mark.parametrize("mutation", ["no_correction_bias", "unit_q_norm", "unit_k_norm", "full_rotary"])
def test_the_fixture_exercises_each_difference(pair, mutation):
    """A loader or decoder that ignored one of the family's differences would fail the parity test above: each
    mutation moves the logits far past its tolerance."""
    _, hf_model, config, params = pair
    mutate = {"no_correction_bias": _no_bias, "unit_q_norm": _unit_norm("q_norm"),
              "unit_k_norm": _unit_norm("k_norm"), "full_rotary": _full_rotary}[mutation]
    row = prompts(VOCAB)[2]
    logits, _ = batched_forward(*mutate(config, params), [row])
    assert scaled_error(logits[0], hf_forward(hf_model, row)[0]) > 100 * TOL


def test_greedy_continuation_matches_generate(pair):
    _, hf_model, config, params = pair
    batch = prompts(VOCAB, seed=2)
    ours = Decoder(config, params).generate(batch, 24, baseline=True).tokens
    for prompt, row in zip(batch, ours):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor(prompt)[None], max_new_tokens=24, do_sample=False,
                                    min_new_tokens=24, pad_token_id=0)
        assert row == ref[0, len(prompt):].tolist()


def test_dflash_with_a_random_draft_equals_autoregressive_decoding(pair):
    _, _, config, params = pair
    draft_config = DraftConfig.from_dict(official_config(
        vocab_size=VOCAB, block_size=8, num_target_layers=config.num_hidden_layers,
        dflash_config={"target_layer_ids": [0, 1], "mask_token_id": VOCAB - 1}))
    decoder = Decoder(config, params, draft_config, init_draft_params(draft_config, seed=1))
    batch = [p.tolist() for p in prompts(VOCAB, seed=3)]
    ar = decoder.generate(batch, 24, baseline=True)
    out = decoder.generate(batch, 24)
    assert out.tokens == ar.tokens


def test_save_target_round_trips_through_transformers(pair, tmp_path):
    """``save_target`` writes the names transformers writes (block_sparse_moe, w1/w3/w2 per expert, the
    selection bias) and a config it reads back to the same model."""
    from safetensors import safe_open

    out, hf_model, config, params = pair
    save_target(config, params, tmp_path)
    with safe_open(str(out / "model.safetensors"), "np") as a, safe_open(str(tmp_path / "model.safetensors"),
                                                                          "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == "MiniMaxM2ForCausalLM"
    assert TargetConfig.from_json(tmp_path) == config
    row = prompts(VOCAB)[1]
    with torch.no_grad():
        ref = hf_model(torch.tensor(row)[None]).logits
        again = reloaded(torch.tensor(row)[None]).logits
    assert float((ref - again).abs().max()) <= 1e-5


def _config(**overrides):
    cfg = {"model_type": "minimax_m2", **TINY, "rope_parameters": dict(TINY["rope_parameters"])}
    cfg.pop("partial_rotary_factor")
    return overridden(cfg, **overrides)


@pytest.mark.parametrize("overrides, field", [
    # rotary_dim must agree with partial_rotary_factor (transformers reads the factor, MiniMax's code rotary_dim)
    (dict(rotary_dim=16), "rotary_dim"),
    (dict(rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rotary_dim"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(use_routing_bias=False), "use_routing_bias"),
    (dict(qk_norm_type="per_head"), "qk_norm_type"),
    (dict(shared_intermediate_size=64), "shared_intermediate_size"),
    (dict(attn_type_list=[1, 0, 1]), "attn_type_list"),
    (dict(head_dim=None), "head_dim"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_configs_it_cannot_compute_exactly_are_refused(overrides, field):
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_dict(_config(**overrides), "mm2/config.json")


def test_agreeing_rotary_fields_and_released_extras_are_accepted():
    cfg = _config(rotary_dim=8, scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
                  qk_norm_type="per_layer", shared_intermediate_size=0, attn_type_list=[1, 1, 1], use_mtp=True)
    assert TargetConfig.from_dict(cfg).rotary_dims == 8
    top_level = _config(rope_parameters=None, rope_theta=None, partial_rotary_factor=0.25)
    parsed = TargetConfig.from_dict(json.loads(json.dumps(top_level)))
    assert parsed.rotary_dims == 4 and parsed.rope.theta == 5e6  # MiniMaxM2Config.default_theta
