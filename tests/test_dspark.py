"""DSpark drafts (DeepSeek's DeepSpec, SPEC section 13): DeepSpec's checkpoint layout, the shifted block, the
Markov head walked inside the round, the confidence head's verify cut, lossless sampling.

References, all independent of the library:

* the NumPy construction of tests/reference_draft_numpy.py (backbone: ``draft_forward_reference``; heads:
  ``dspark_chain_reference``, written from SPEC 13) on a random checkpoint written in DeepSpec's layout and
  loaded through ``load_draft``: base logits, corrected logits, confidence logits at 1e-5 * max(1, |ref|)
  (fp32 against float64), greedy chains equal;
* the engine's own autoregressive decoding (greedy DSpark decoding must give the same tokens, with and without
  a confidence threshold), and a brute-force bigram pair where only a correctly applied Markov head drafts
  whole blocks;
* the exact target distribution over 3-token continuations for sampling (chi-square, as
  tests/test_engine_sampling.py), with a negative control: rejection against the UNcorrected base
  distribution must fail it.

Also compared, outside the suite, with DeepSpec's own ``Qwen3DSparkModel`` and ``generate_decoding_sample``
(deepseek-ai/DeepSpec, torch CPU; docs/dspark.md says what and how).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dflash_jax.checkpoints.official_draft import load_draft, save_draft
from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.engine.decoder import Decoder
from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DSparkProposer
from dflash_jax.engine.sampling import SamplingConfig, probabilities
from dflash_jax.models.config import ConfigError
from dflash_jax.models.draft import DraftModel, SharedHead, init_draft_cache, split_head_copies
from dflash_jax.models.draft_config import DraftConfig
from draft_tiny import HIDDEN, TARGET_LAYERS, VOCAB, official_config
from engine_tiny import tiny_target
from reference_draft_numpy import draft_forward_reference, dspark_chain_reference, random_official_draft_weights

BLOCK, RANK = 7, 8


def deepspec_config(**overrides) -> dict:
    """A tiny ``Qwen3DSparkModel`` config as DeepSpec writes it: the target's Qwen3 config plus its fields."""
    cfg = official_config(block_size=BLOCK, use_sliding_window=False, tie_word_embeddings=False)
    cfg.pop("dflash_config")
    cfg.update(architectures=["Qwen3DSparkModel"], target_layer_ids=[0, 2], mask_token_id=VOCAB - 1,
               num_anchors=16, markov_rank=RANK, markov_head_type="vanilla", enable_confidence_head=True,
               confidence_head_with_markov=True)
    cfg.update(overrides)
    return cfg


def write_deepspec_draft(path, cfg: dict, target_params: dict, seed: int = 0) -> dict:
    """A random DSpark checkpoint in DeepSpec's layout: bare keys, its own copies of the target's embedding
    and head (as DeepSpec's released drafts hold them)."""
    path.mkdir(parents=True, exist_ok=True)
    weights = random_official_draft_weights(cfg, len(cfg["target_layer_ids"]), np.random.default_rng(seed))
    weights["embed_tokens.weight"] = np.asarray(target_params["embed_tokens"]["embedding"])
    weights["lm_head.weight"] = np.ascontiguousarray(np.asarray(target_params["lm_head"]["kernel"]).T)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return weights


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tc, tp = tiny_target(seed=0)
    path = tmp_path_factory.mktemp("dspark")
    weights = write_deepspec_draft(path, deepspec_config(), tp, seed=3)
    config, params = load_draft(path)
    return tc, tp, path, weights, config, params


@functools.partial(jax.jit, static_argnums=(0,))
def backbone(config, params, shared, feats, tokens, start):
    b, t = feats.shape[:2]
    pos = start + jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
    ctx_pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    out = DraftModel(config).apply({"params": params}, tokens, pos, feats, ctx_pos, jnp.ones((b, t), bool),
                                   init_draft_cache(config, b, t + tokens.shape[1]), shared)
    greedy = lambda logits, key: (jnp.argmax(logits, -1).astype(jnp.int32), None)  # noqa: E731
    chain = DraftModel(config).apply({"params": params}, out.logits, out.hidden, tokens[:, 0], greedy,
                                     method=DraftModel.dspark_chain)
    return out.logits, out.hidden, chain


def test_config_reads_and_writes_deepspec_fields(pair):
    _, _, _, _, config, params = pair
    assert config.dspark and config.proposals == BLOCK and config.is_causal is False
    assert (config.markov_rank, config.markov_head_type, config.confidence_head, config.confidence_with_markov,
            config.num_anchors) == (RANK, "vanilla", True, True, 16)
    assert params["markov_head"]["markov_w2"]["kernel"].shape == (RANK, VOCAB)
    assert params["confidence_head"]["proj"]["kernel"].shape == (HIDDEN + RANK, 1)
    written = config.to_official_dict()
    want = deepspec_config()
    for key in ("architectures", "block_size", "target_layer_ids", "mask_token_id", "num_anchors", "markov_rank",
                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_target_layers"):
        assert written[key] == want[key], key
    assert DraftConfig.from_dict(written) == config


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(markov_head_type="rnn"), "markov_head_type 'rnn' is not supported"),
    (lambda c: c.update(markov_rank=0), "confidence_head_with_markov needs a Markov head"),
    (lambda c: c.pop("markov_rank"), "'markov_rank'"),
    (lambda c: c.update(architectures=["Gemma4DSparkModel"]), "Gemma4DSparkModel"),
    (lambda c: c.update(target_layer_ids=[-2, 1]), "-1 .* is the only negative id"),
    (lambda c: c.update(use_sliding_window=True, sliding_window=4), "use_sliding_window"),
])
def test_bad_deepspec_configs_name_the_field(change, match):
    cfg = copy.deepcopy(deepspec_config())
    change(cfg)
    with pytest.raises(ConfigError, match=match):
        DraftConfig.from_dict(cfg, source="draft/config.json")


def test_target_layer_refusals(pair):
    tc = pair[0]
    with pytest.raises(ConfigError, match="target_layer_ids contains 9"):
        DraftConfig.from_dict(deepspec_config(target_layer_ids=[0, 9])).validate_against(tc)
    from dflash_jax.errors import ServingWarning

    with pytest.warns(ServingWarning, match="last layer"):
        DraftConfig.from_dict(deepspec_config(target_layer_ids=[-1, TARGET_LAYERS - 1])).validate_against(tc)


def test_missing_head_tensor_is_named(pair, tmp_path):
    tp = pair[1]
    weights = write_deepspec_draft(tmp_path, deepspec_config(), tp, seed=1)
    del weights["markov_head.markov_w1.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="markov_head.markov_w1.weight"):
        load_draft(tmp_path)


def test_export_and_orbax_round_trips_are_bit_exact(pair, tmp_path):
    from infer.convert import main as convert_main

    _, _, path, weights, config, params = pair
    save_draft(config, params, tmp_path / "out")
    again = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(again) == sorted(weights)
    assert all(again[k].tobytes() == v.tobytes() for k, v in weights.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert convert_main(["--from", str(path), "--to", str(tmp_path / "orbax")]) == 0
    assert convert_main(["--from", str(tmp_path / "orbax"), "--to", str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(weights) and all(back[k].tobytes() == v.tobytes() for k, v in weights.items())


@pytest.mark.parametrize("kind", ["vanilla", "gated", "none"])
def test_backbone_heads_and_chain_equal_the_numpy_construction(pair, tmp_path, kind):
    """Every block position's base logits (the shifted block: all B positions are proposals), the Markov-corrected
    logits along the greedy chain, the chain itself and the confidence logits, against float64 NumPy."""
    tc, tp = pair[0], pair[1]
    extra = dict(markov_head_type=kind) if kind != "none" else dict(markov_rank=0, confidence_head_with_markov=False)
    cfg = deepspec_config(**extra)
    weights = write_deepspec_draft(tmp_path, cfg, tp, seed=7)
    config, params = load_draft(tmp_path)
    backbone_params, own = split_head_copies(params)
    rng = np.random.default_rng(1)
    t = 9
    feats = rng.standard_normal((2, t, 2 * HIDDEN)).astype(np.float32)
    anchors = np.array([5, 41], np.int32)
    tokens = np.concatenate([anchors[:, None], np.full((2, BLOCK - 1), VOCAB - 1, np.int32)], axis=1)
    logits, hidden, chain = backbone(config, backbone_params, own, jnp.asarray(feats), jnp.asarray(tokens), t)
    embed, head = weights["embed_tokens.weight"], weights["lm_head.weight"]
    for row in range(2):
        want, want_hidden = draft_forward_reference(weights, cfg, embed, head, feats[row], tokens[row], t,
                                                    return_hidden=True)
        tol = 1e-5 * max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(np.asarray(logits[row]), want, atol=tol)
        ref_tokens, corrected, confidence = dspark_chain_reference(weights, cfg, want, want_hidden, anchors[row])
        assert list(np.asarray(chain.tokens[row])) == ref_tokens
        np.testing.assert_allclose(np.asarray(chain.confidence[row]), confidence, atol=1e-5)
        # the distributions the engine would sample from, teacher-forced along the same chain
        _, corrected_given, _ = dspark_chain_reference(weights, cfg, want, want_hidden, anchors[row], ref_tokens)
        np.testing.assert_allclose(corrected_given, corrected)
    if kind == "none":
        assert "markov_head" not in params and "confidence_head" in params


def test_head_copies_are_shared_when_equal_and_used_when_not(pair):
    tc, tp, _, _, config, params = pair
    decoder = Decoder(tc, tp, config, dict(params))
    assert decoder.head_source == "shared" and "embed_tokens" not in decoder.draft_params
    other = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 2})
    decoder = Decoder(tc, tp, config, other)
    assert decoder.head_source == "own" and "lm_head" in decoder.draft_params


PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [11, 30, 2, 5, 60, 61, 62, 9, 10]]


def test_greedy_decoding_equals_the_baseline_with_and_without_a_threshold(pair):
    tc, tp, _, _, config, params = pair
    base = Decoder(tc, tp, config, params).generate(PROMPTS, 24, baseline=True)
    full = Decoder(tc, tp, config, params).generate(PROMPTS, 24)
    assert full.tokens == base.tokens
    cut = Decoder(tc, tp, config, params, confidence_threshold=0.5).generate(PROMPTS, 24)
    assert cut.tokens == base.tokens
    # threshold 1: no sigmoid reaches it, every row verifies no draft and commits the target's own token
    none = Decoder(tc, tp, config, params, confidence_threshold=1.0).generate(PROMPTS, 24)
    assert none.tokens == base.tokens and all(a == 1 for row in none.accept_lengths for a in row)
    with pytest.raises(Exception, match="confidence threshold must lie in"):
        Decoder(tc, tp, config, params, confidence_threshold=1.5)


def bigram_pair(scale: float = 50.0):
    """A target whose next token depends on the current token only (attention and MLP outputs zeroed: the
    residual stream is the token's embedding), and a DSpark draft whose Markov head holds that bigram table
    exactly (rank = vocabulary, ``w1`` the identity, ``w2`` a one-hot of the successor times ``scale``) while its
    backbone knows nothing useful. Only the head, applied to the token drafted just before each position,
    drafts the target's greedy continuation."""
    tc, tp = tiny_target(seed=4)
    tp = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if any(getattr(k, "key", "") in ("o_proj", "down_proj") for k in path)
        else x, tp)
    embed = np.asarray(tp["embed_tokens"]["embedding"], np.float64)
    norm = np.asarray(tp["norm"]["weight"], np.float64)
    normed = embed / np.sqrt(np.mean(embed**2, -1, keepdims=True) + 1e-6) * norm
    successor = np.argmax(normed @ np.asarray(tp["lm_head"]["kernel"], np.float64), axis=-1)
    cfg = DraftConfig.from_dict(deepspec_config(markov_rank=VOCAB, enable_confidence_head=False,
                                                confidence_head_with_markov=False))
    from dflash_jax.checkpoints.official_draft import init_draft_params

    params = init_draft_params(cfg, seed=2, head_copies=False)
    params["markov_head"] = {"markov_w1": {"embedding": jnp.eye(VOCAB, dtype=jnp.float32)},
                             "markov_w2": {"kernel": jnp.asarray(np.eye(VOCAB)[successor] * scale, jnp.float32)}}
    return tc, tp, cfg, params, successor


def test_only_a_correct_markov_head_drafts_whole_blocks_of_a_bigram_target():
    tc, tp, cfg, params, successor = bigram_pair()
    base = Decoder(tc, tp, cfg, params).generate(PROMPTS, 30, baseline=True)
    for row, prompt in zip(base.tokens, PROMPTS):  # the target really is that bigram table
        assert row == [int(successor[t]) for t in [prompt[-1]] + row[:-1]]
    out = Decoder(tc, tp, cfg, params).generate(PROMPTS, 30)
    assert out.tokens == base.tokens
    # every round but the last (cut at max_new_tokens) commits the whole block plus the target's token
    assert all(a == BLOCK + 1 for row in out.accept_lengths for a in row[:-1]), out.accept_lengths
    # without the head the same backbone drafts next to nothing
    plain = Decoder(tc, tp, dataclasses.replace(cfg, markov_rank=0),
                    {k: v for k, v in params.items() if k != "markov_head"}).generate(PROMPTS, 30)
    assert plain.tokens == base.tokens and plain.tau < 2.5, plain.tau


# --- sampling ------------------------------------------------------------------------------------------------

SAMPLE_VOCAB, SAMPLE_BLOCK = 8, 3


class BaseDistributionProposer(DSparkProposer):
    """Negative control: drafts as the DSpark proposer does, but hands rejection the backbone's UNcorrected
    distributions, which the drafted tokens were not drawn from."""

    def propose(self, consts, state, ctx, anchor, start, key, sampling, block_len=None):
        tokens, _, new_state = super().propose(consts, state, ctx, anchor, start, key, sampling, block_len)
        b = anchor.shape[0]
        blk = jnp.concatenate([anchor[:, None], jnp.full((b, self.draft_block - 1), self.config.mask_token_id,
                                                          jnp.int32)], axis=1)
        positions = start[:, None] + jnp.arange(self.draft_block)[None]
        out = self.model.apply({"params": consts["params"]}, blk, positions, *ctx, state["cache"], consts["shared"])
        return tokens, probabilities(out.logits, sampling), new_state


def test_sampling_is_lossless_and_rejection_needs_the_corrected_distribution():
    from test_engine_sampling import NEW, PROMPT, SAMPLES, chi_square_p, exact_distribution

    tc, tp = tiny_target(seed=3, vocab=SAMPLE_VOCAB, scale=0.25)
    cfg = DraftConfig.from_dict(deepspec_config(vocab_size=SAMPLE_VOCAB, mask_token_id=SAMPLE_VOCAB - 1,
                                                block_size=SAMPLE_BLOCK, markov_rank=4))
    from dflash_jax.checkpoints.official_draft import init_draft_params

    params = init_draft_params(cfg, seed=5, head_copies=False)
    # a strong Markov term, so that the corrected and the base distributions differ clearly
    params["markov_head"]["markov_w2"]["kernel"] = params["markov_head"]["markov_w2"]["kernel"] * 6.0
    sampling = SamplingConfig(1.0)
    dist = exact_distribution(tc, tp, sampling)
    from dflash_jax.models.draft import shared_head

    results = {}
    for name, cls in (("dspark", DSparkProposer), ("control", BaseDistributionProposer)):
        prop = cls(cfg, SAMPLE_BLOCK)
        state = prop.init(params, shared_head(tp, False), SAMPLES, 16 + NEW + SAMPLE_BLOCK + 1)
        out = generate(tc, tp, [PROMPT] * SAMPLES, prop, state, DecodeSettings(max_new_tokens=NEW, sampling=sampling),
                       seed=21)
        results[name] = (chi_square_p([tuple(t) for t in out.tokens], dist), out)
    p, out = results["dspark"]
    assert p > 1e-3, p
    assert max(a for row in out.accept_lengths for a in row) >= 2  # drafts are accepted: rejection is exercised
    assert results["control"][0] < 1e-3, results["control"][0]


# --- training ------------------------------------------------------------------------------------------------

def deepspec_loss_numpy(weights, cfg, embed, head, features, tokens, loss_mask, anchors, target_hidden,
                        gamma=4.0, alphas=(0.1, 0.9, 1.0)):
    """DeepSpec's DSpark loss (SPEC 13.6) for ONE sequence, in float64, block by block: block ``[token[a], mask
    x (B-1)]`` at ``a .. a+B-1`` sees the context features before ``a``; position k's label is ``token[a+k+1]``,
    valid while every label up to it lies inside the sequence and the loss mask; weights ``exp(-k/gamma)``;
    the Markov head teacher-forced on the true previous tokens; ``p_t`` from the target's final hidden state at
    ``a + k``. Returns (loss, expected acceptance length per valid block)."""
    b = int(cfg["block_size"])
    length = len(tokens)
    ce = l1 = bce = weight = tau = blocks = 0.0
    for a in anchors:
        block = np.array([tokens[a]] + [int(cfg["mask_token_id"])] * (b - 1))
        base, hidden = draft_forward_reference(weights, cfg, embed, head, features[:a], block, a, return_hidden=True)
        labels = [tokens[a + k + 1] if a + k + 1 < length else 0 for k in range(b)]
        valid = np.cumprod([a + k + 1 < length and loss_mask[a + k + 1] for k in range(b)]).astype(bool)
        _, logits, conf = dspark_chain_reference(weights, cfg, base, hidden, tokens[a], labels)
        run, prod = 0.0, 1.0
        for k in range(b):
            if not valid[k]:
                break
            w = np.exp(-k / gamma)
            x = logits[k] - logits[k].max()
            p_d = np.exp(x) / np.exp(x).sum()
            t = target_hidden[a + k] @ head.T
            t = np.exp(t - t.max())
            p_t = t / t.sum()
            dist = np.abs(p_d - p_t).sum()
            accept = min(max(1 - dist / 2, 0.0), 1.0)
            ce += w * (np.log(np.exp(x).sum()) - x[labels[k]])
            l1 += w * dist
            bce += w * (np.log1p(np.exp(-conf[k])) + (1 - accept) * conf[k])
            weight += w
            prod *= accept
            run += prod
        if valid[0]:
            tau, blocks = tau + 1 + run, blocks + 1
    return (alphas[0] * ce + alphas[1] * l1 + alphas[2] * bce) / weight, tau / blocks


def test_training_loss_equals_deepspecs_loss_built_in_numpy(pair, tmp_path):
    """``draft_loss_sums`` of packed DSpark blocks (chunked, rematerialised) against the NumPy construction of
    DeepSpec's loss: relative 1e-5 (fp32 against float64), the expected acceptance metric too."""
    from dflash_jax.training.anchors import block_labels
    from dflash_jax.training.loss import LossSpec, loss_and_metrics
    from dflash_jax.training.step import draft_loss_sums

    tc, tp = pair[0], pair[1]
    cfg = deepspec_config()
    weights = write_deepspec_draft(tmp_path, cfg, tp, seed=11)
    config, params = load_draft(tmp_path)
    backbone_params, own = split_head_copies(params)
    rng = np.random.default_rng(2)
    length = 20
    tokens = rng.integers(0, VOCAB - 1, length).astype(np.int32)
    loss_mask = np.ones(length, bool)
    loss_mask[:4] = False
    loss_mask[15] = False  # a gap: blocks stop at it
    features = rng.standard_normal((length, 2 * HIDDEN)).astype(np.float32)
    target_hidden = rng.standard_normal((length, HIDDEN)).astype(np.float32)
    anchors = np.array([4, 7, 12, 16, 18], np.int32)
    blk, pos, labels, label_mask = block_labels(tokens, loss_mask, length, anchors[None], np.ones((1, 5), bool),
                                                BLOCK + 1, mask_token_id=VOCAB - 1)
    spec = LossSpec(gamma=4.0, dspark_weights=(0.1, 0.9, 1.0))
    sums = jax.jit(lambda p: draft_loss_sums(DraftModel(config), p, jnp.asarray(features)[None], blk[..., :BLOCK],
                                             pos[..., :BLOCK], jnp.ones((1, 5), bool), labels, label_mask, own, spec,
                                             2, jnp.asarray(target_hidden)[None]))(backbone_params)
    loss, metrics = loss_and_metrics(sums, dspark_weights=(0.1, 0.9, 1.0))
    want, tau = deepspec_loss_numpy(weights, cfg, weights["embed_tokens.weight"], weights["lm_head.weight"],
                                    features, tokens, loss_mask, anchors, target_hidden)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["expected_acceptance_length"]), tau, rtol=1e-5)


def test_infer_cli_takes_a_deepspec_checkpoint_with_a_threshold(pair, tmp_path, capsys):
    """``python -m infer --target T --ckpt D``: a checkpoint in DeepSpec's layout, greedy output identical to
    the baseline with and without ``--confidence-threshold``; the shared head said; a threshold on a draft
    without a confidence head is one clear error."""
    from cli_tiny import write_tokenizer
    from dflash_jax.checkpoints.hf_target import save_target
    from infer.__main__ import main

    tc, tp, draft_dir, _, _, _ = pair
    target_dir = tmp_path / "target"
    save_target(tc, tp, target_dir)
    write_tokenizer(target_dir)
    argv = ["--target", str(target_dir), "--ckpt", str(draft_dir), "--prompt", "hello there", "--max-new-tokens",
            "16", "--baseline", "--json"]
    for extra in ([], ["--confidence-threshold", "0.4"]):
        assert main(argv + extra) == 0
        captured = capsys.readouterr()
        doc = json.loads(captured.out)
        assert all(row["matches_baseline"] for row in doc["results"])
        assert "embedding and head copies equal the target's" in captured.err
    plain = tmp_path / "plain"
    write_deepspec_draft(plain, deepspec_config(enable_confidence_head=False, confidence_head_with_markov=False), tp)
    assert main(argv[:3] + [str(plain)] + argv[4:] + ["--confidence-threshold", "0.4"]) == 2
    assert "needs a draft with a confidence head" in capsys.readouterr().err


def test_a_hybrid_moe_target_decodes_dspark_exactly_with_cut_rounds():
    """Qwen3-Next (Gated DeltaNet + gated attention + experts): a near-bigram target (every residual branch's
    output projection scaled by 0.01) and a DSpark draft whose Markov head holds the target's one-token
    successor table, with a random confidence head and a threshold: rounds commit from 1 to a whole block, so
    the recurrent states and KV caches roll back to many different prefixes, and the output is the
    autoregressive decode's."""
    from dflash_jax.checkpoints.official_draft import init_draft_params
    from dflash_jax.models.target import TargetModel
    from engine_tiny import tiny_moe_target

    tc, tp = tiny_moe_target("qwen3_next", seed=1)
    tp = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0.01 if any(getattr(k, "key", "") in ("o_proj", "out_proj", "down_proj")
                                        for k in path) else x, tp)
    ids = jnp.arange(VOCAB, dtype=jnp.int32)[:, None]
    logits = TargetModel(tc).apply({"params": tp}, ids, jnp.zeros_like(ids)).logits[:, 0]
    successor = np.asarray(jnp.argmax(logits, -1))
    cfg = DraftConfig.from_dict(deepspec_config(markov_rank=VOCAB))
    params = init_draft_params(cfg, seed=2, head_copies=False)
    params["markov_head"] = {"markov_w1": {"embedding": jnp.eye(VOCAB, dtype=jnp.float32)},
                             "markov_w2": {"kernel": jnp.asarray(np.eye(VOCAB)[successor] * 50.0, jnp.float32)}}
    # confidence logits about N(2, 1.2): under the threshold 0.7 at about one position in six
    params["confidence_head"]["proj"]["kernel"] = jnp.asarray(
        np.random.default_rng(0).standard_normal((HIDDEN + VOCAB, 1)) * 0.15, jnp.float32)
    params["confidence_head"]["proj"]["bias"] = jnp.full((1,), 2.0, jnp.float32)
    base = Decoder(tc, tp, cfg, params).generate(PROMPTS, 40, baseline=True)
    out = Decoder(tc, tp, cfg, params, confidence_threshold=0.7).generate(PROMPTS, 40)
    assert out.tokens == base.tokens
    lengths = {a for row in out.accept_lengths for a in row[:-1]}
    assert max(lengths) >= 4 and len(lengths) >= 3, out.accept_lengths
