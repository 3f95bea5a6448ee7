"""DFlash2 drafts (SPEC section 10): block convolutions in every layer and the candidate selector.

Checked against the independent NumPy construction of tests/reference_draft_numpy.py (the convolution
written element by element, the selector chain position by position), with a random official checkpoint
written to disk and loaded through ``load_draft``: logits and final hidden states at 1e-5 * max(1, |ref|)
(fp32), greedy chains equal, sampling distributions at 1e-5. Then the official layout round trip, bad
configs, and the engine: greedy DFlash2 decoding equals plain decoding, and its sampling is lossless (a
chi-square test against the exact distribution, as tests/test_engine_sampling.py).

Also compared once, outside the suite, with the official ``DFlash2DraftModel`` (z-lab/dflash ``dflash/model.py``
at commit 10129599, transcribed outside the repository, torch CPU) on the checkpoint of ``bundle``'s shape:
logits within 6.0e-6 (largest 10.8) and the same greedy chain (docs/training.md).
"""

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dflash_jax.checkpoints.official_draft import init_draft_params, load_draft, save_draft
from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.models.config import ConfigError
from dflash_jax.models.draft import DraftModel, SharedHead, init_draft_cache, shared_head
from dflash_jax.models.draft_config import DraftConfig
from draft_tiny import HIDDEN, official_config, write_official_draft
from engine_tiny import tiny_target
from reference_draft_numpy import (
    draft_forward_reference, selector_chain_reference, selector_scores_reference,
)

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}
VOCAB, BLOCK = 97, 8


def dflash2_config(**overrides) -> dict:
    cfg = official_config(architectures=["DFlash2DraftModel"], layer_types=["sliding_attention", "full_attention"],
                          sliding_window=6, **overrides)
    cfg["dflash_config"] = {**cfg["dflash_config"], **DFLASH2}
    return cfg


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash2")
    weights = write_official_draft(path, dflash2_config(), seed=3)
    config, params = load_draft(path)
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    head = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    return path, weights, config, params, embed, head


@functools.partial(jax.jit, static_argnums=(0,))
def forward(config, params, shared, feats, tokens, start):
    b, t = feats.shape[:2]
    model = DraftModel(config)
    ctx_pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    pos = start + jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
    out = model.apply({"params": params}, tokens, pos, feats, ctx_pos, jnp.ones((b, t), bool),
                      init_draft_cache(config, b, t + tokens.shape[1]), shared, skip_anchor_logits=True)
    return out.logits, out.hidden


def test_config_reads_and_writes_the_dflash2_fields(bundle):
    path, _, config, params, _, _ = bundle
    assert config.dflash2 and (config.conv_kernel_size, config.conv_group_size, config.selector_rank,
                               config.selector_top_k) == (2, 16, 8, 5)
    official = config.to_official_dict()
    assert official["architectures"] == ["DFlash2DraftModel"]
    assert {k: official["dflash_config"][k] for k in DFLASH2} == DFLASH2
    assert params["layers_0"]["attention_conv"]["base_kernel"].shape == (2, 2, HIDDEN)
    assert params["layers_1"]["mlp_conv"]["kernel_projection"]["kernel"].shape == (HIDDEN, 2 * 2 * HIDDEN // 16)
    assert params["candidate_selector"]["predecessor_codebook"].shape == (VOCAB, 8)
    plain = DraftConfig.from_dict(official_config())
    assert not plain.dflash2 and plain.to_official_dict()["architectures"] == ["DFlashDraftModel"]


@pytest.mark.parametrize("change,match", [
    (lambda c: c["dflash_config"].pop("selector_top_k"), "selector_top_k"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), "conv_group_size 24 does not divide hidden_size 64"),
    (lambda c: c["dflash_config"].update(selector_top_k=VOCAB + 1), "selector_top_k 98 exceeds vocab_size"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=0), "conv_kernel_size"),
])
def test_bad_dflash2_configs_name_the_field(change, match):
    cfg = copy.deepcopy(dflash2_config())
    change(cfg)
    with pytest.raises(ConfigError, match=match):
        DraftConfig.from_dict(cfg, source="draft/config.json")


def test_missing_selector_tensor_is_named(tmp_path):
    weights = write_official_draft(tmp_path, dflash2_config(), seed=1)
    from safetensors.numpy import save_file

    del weights["candidate_selector.successor_codebook"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    from dflash_jax.checkpoints.safetensors_io import CheckpointError

    with pytest.raises(CheckpointError, match="candidate_selector.successor_codebook"):
        load_draft(tmp_path)


def test_export_round_trip_is_exact(bundle, tmp_path):
    path, weights, config, params, _, _ = bundle
    save_draft(config, params, tmp_path / "out")
    again = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(again) == sorted(weights)  # codebooks without ".weight", as the official layout stores them
    for k, v in weights.items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]


def test_convert_to_orbax_and_back_is_bit_exact(bundle, tmp_path, capsys):
    from infer.convert import main as convert_main

    path, weights, _, _, _, _ = bundle
    assert convert_main(["--from", str(path), "--to", str(tmp_path / "orbax")]) == 0
    assert convert_main(["--from", str(tmp_path / "orbax"), "--to", str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(weights) and all(back[k].tobytes() == v.tobytes() for k, v in weights.items())
    assert DraftConfig.from_json(tmp_path / "back" / "config.json").selector_top_k == 5


def test_forward_and_selector_equal_the_numpy_construction(bundle):
    _, weights, config, params, embed, head = bundle
    cfg = dflash2_config()
    rng = np.random.default_rng(1)
    t = 9
    feats = rng.standard_normal((2, t, 2 * HIDDEN)).astype(np.float32)
    anchors = np.array([5, 41], np.int32)
    tokens = np.concatenate([anchors[:, None], np.full((2, BLOCK - 1), VOCAB - 1, np.int32)], axis=1)
    shared = SharedHead(jnp.asarray(embed), jnp.asarray(head.T))
    logits, hidden = forward(config, params, shared, jnp.asarray(feats), jnp.asarray(tokens), t)
    greedy, _ = jax.jit(lambda lg, hd, a: DraftModel(config).apply({"params": params}, lg, hd, a,
                                                                    method=DraftModel.select))(logits, hidden, anchors)
    temperature = 0.7
    sampled, probs = jax.jit(lambda lg, hd, a, k: DraftModel(config).apply(
        {"params": params}, lg, hd, a, temperature, k, method=DraftModel.select))(
        logits, hidden, anchors, jax.random.PRNGKey(4))
    for b in range(2):
        ref_logits, ref_hidden = draft_forward_reference(weights, cfg, embed, head, feats[b], tokens[b], t,
                                                         return_hidden=True)
        scale = max(1.0, float(np.abs(ref_logits).max()))
        np.testing.assert_allclose(logits[b], ref_logits[1:], atol=1e-5 * scale)
        np.testing.assert_allclose(hidden[b], ref_hidden[1:], atol=1e-5 * max(1.0, float(np.abs(ref_hidden).max())))
        assert list(np.asarray(greedy[b])) == selector_chain_reference(weights, cfg, ref_logits[1:], ref_hidden[1:],
                                                                       anchors[b])
        # Sampling: each position's distribution is softmax(score / T) over its candidates, given the token the
        # chain actually drew before it; the drawn token is one of them.
        predecessor = int(anchors[b])
        for i in range(BLOCK - 1):
            cands, scores = selector_scores_reference(weights, cfg, ref_logits[1 + i], ref_hidden[1 + i], predecessor)
            q = np.exp((scores - scores.max()) / temperature)
            expected = np.zeros(VOCAB)
            expected[cands] = q / q.sum()
            np.testing.assert_allclose(probs[b, i], expected, atol=1e-5)
            predecessor = int(sampled[b, i])
            assert predecessor in cands
    # The selector really reorders: without its pairwise term the chain would be the plain argmax.
    assert np.any(np.asarray(greedy) != np.asarray(jnp.argmax(logits, -1)))


# ----------------------------------------------------------------------------------------------- engine
def engine_draft(vocab: int, seed: int):
    """A DFlash2 draft for the tiny target whose convolutions and selector matter (a new draft starts with
    identity convolutions and a faint selector)."""
    cfg = dflash2_config(vocab_size=vocab)
    cfg["dflash_config"]["mask_token_id"] = vocab - 1
    config = DraftConfig.from_dict(cfg)
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.3 * rng.standard_normal(x.shape).astype(x.dtype)
        if any(getattr(k, "key", "") in ("base_kernel", "predecessor_codebook", "successor_codebook") for k in path)
        else x, init_draft_params(config, seed=seed))
    return config, params


def test_greedy_dflash2_equals_plain_decoding():
    tc, tp = tiny_target(seed=2)
    config, params = engine_draft(tc.vocab_size, seed=5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in (5, 11)]
    settings = DecodeSettings(max_new_tokens=24, record_drafts=True)
    prop = DFlashProposer(config, BLOCK)
    out = generate(tc, tp, prompts, prop, prop.init(params, shared_head(tp, False), 2, 16 + 24 + BLOCK), settings)
    base = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings)
    assert out.tokens == base.tokens
    # Each round commits the agreeing prefix of its recorded selector chain with the output, plus one token.
    for row in range(len(prompts)):
        tokens, offset = out.tokens[row], 1  # token 0 came from prefill
        for drafts, committed in zip(out.drafts[row], out.accept_lengths[row]):
            expected = tokens[offset:offset + BLOCK - 1]
            run = next((i for i, (d, t) in enumerate(zip(drafts, expected)) if d != t), len(expected))
            assert committed == min(run + 1, len(tokens) - offset)
            offset += committed


def test_dflash2_sampling_matches_target_distribution():
    """The selector's distributions (over 5 of 8 tokens: the residual must subtract q at the candidates only)
    keep sampling exact: chi-square against the exact distribution (tests/test_engine_sampling.py's
    construction and thresholds)."""
    import test_engine_sampling as ts

    stats = pytest.importorskip("scipy.stats")
    del stats
    tc, tp = tiny_target(seed=3, vocab=ts.VOCAB, scale=0.25)
    config, params = engine_draft(ts.VOCAB, seed=6)
    cfg = SamplingConfig(0.8)
    samples = 3000
    settings = DecodeSettings(max_new_tokens=ts.NEW, sampling=cfg)
    prop = DFlashProposer(config, 4)
    out = generate(tc, tp, [ts.PROMPT] * samples, prop,
                   prop.init(params, shared_head(tp, False), samples, 16 + ts.NEW + 4), settings, seed=21)
    drawn = [tuple(t) for t in out.tokens]
    assert ts.chi_square_p(drawn, ts.exact_distribution(tc, tp, cfg)) > 1e-3
    assert max(a for row in out.accept_lengths for a in row) >= 2  # proposals were accepted, not only rejected
    # The same samples are far from another temperature's distribution: the test can fail.
    assert ts.chi_square_p(drawn, ts.exact_distribution(tc, tp, SamplingConfig(0.4))) < 1e-3


# ----------------------------------------------------------------------------------------------- training
def _training_selector(module, feats, block_tokens, block_positions, valid, shared, predecessors, labels):
    """Inside apply: the packed TRAINING forward's final hidden states and logits, then the selector's
    teacher-forced cross-entropy and picks (exactly what the train step computes per chunk)."""
    from dflash_jax.training.forward import _block_hidden, _context_kv

    x = _block_hidden(module, _context_kv(module, feats), block_tokens, block_positions, valid, shared)
    normed = module.norm(x[:, :, 1:])
    logits = module.normed_logits(normed, shared)
    return module.candidate_selector.teacher_forced(logits, normed, predecessors, labels)


def test_selector_training_scores_equal_inference(bundle):
    """Train == inference for the selector: teacher-forced on the inference chain's own tokens, the training
    path picks every one of them; on other labels (some outside the top-k) its cross-entropy equals the NumPy
    construction over the candidates plus the label."""
    _, weights, config, params, embed, head = bundle
    cfg = dflash2_config()
    rng = np.random.default_rng(2)
    length, anchors = 20, np.array([[6, 13]], np.int32)
    feats = rng.standard_normal((1, length, 2 * HIDDEN)).astype(np.float32)
    anchor_tokens = np.array([[12, 60]], np.int32)
    block_tokens = np.concatenate([anchor_tokens[..., None], np.full((1, 2, BLOCK - 1), VOCAB - 1, np.int32)], -1)
    positions = anchors[..., None] + np.arange(BLOCK)
    shared = SharedHead(jnp.asarray(embed), jnp.asarray(head.T))
    chains, refs = [], []
    for i in range(2):
        a = int(anchors[0, i])
        ref_logits, ref_hidden = draft_forward_reference(weights, cfg, embed, head, feats[0, :a], block_tokens[0, i],
                                                         a, return_hidden=True)
        chains.append(selector_chain_reference(weights, cfg, ref_logits[1:], ref_hidden[1:], anchor_tokens[0, i]))
        refs.append((ref_logits[1:], ref_hidden[1:]))
    run = jax.jit(lambda pred, lab: DraftModel(config).apply(
        {"params": params}, jnp.asarray(feats), jnp.asarray(block_tokens), jnp.asarray(positions),
        jnp.ones((1, 2), bool), shared, pred, lab, method=_training_selector))
    chains = np.array(chains, np.int32)[None]
    predecessors = np.concatenate([anchor_tokens[..., None], chains[..., :-1]], -1)
    _, picked = run(predecessors, chains)
    assert bool(np.all(picked))
    labels = rng.integers(0, VOCAB - 1, size=(1, 2, BLOCK - 1)).astype(np.int32)
    labels[0, 0, :3] = chains[0, 0, :3]  # some labels among the candidates, most outside the top 5 of 97
    predecessors = np.concatenate([anchor_tokens[..., None], labels[..., :-1]], -1)
    ce, picked = run(predecessors, labels)
    missing = 0
    for i in range(2):
        ref_logits, ref_hidden = refs[i]
        for k in range(BLOCK - 1):
            cands, scores = selector_scores_reference(weights, cfg, ref_logits[k], ref_hidden[k], predecessors[0, i, k])
            lab = int(labels[0, i, k])
            if lab not in cands:  # the label joins the candidates with its own score
                missing += 1
                cands = np.append(cands, lab)
                scores = np.append(scores, selector_scores_reference(weights, cfg, ref_logits[k], ref_hidden[k],
                                                                     predecessors[0, i, k], [lab])[1])
            m = scores.max()
            expected = m + np.log(np.exp(scores - m).sum()) - scores[list(cands).index(lab)]
            np.testing.assert_allclose(ce[0, i, k], expected, rtol=1e-5, atol=1e-5)
            assert bool(picked[0, i, k]) == (int(cands[int(np.argmax(scores[:5]))]) == lab)
    assert missing >= 3


def test_teacher_forced_acceptance_walks_the_selector():
    """The replay's teacher-forced acceptance (``infer bench --replay``) of a DFlash2 draft is its selector's
    chain: round for round what the engine accepts (the last round left out: it may run past the answer).
    On the shipped demo pair (a trained DFlash2 draft), whose selector often overrules the argmax."""
    from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET
    from dflash_jax.checkpoints.loading import load_draft_any, load_target_any
    from dflash_jax.evaluation.replay import replay_fixed, teacher_forced_acceptance

    tc, tp = load_target_any(DEMO_TARGET)
    config, params = load_draft_any(DEMO_DRAFT)
    assert config.dflash2
    prompt, new = [1, 403, 261, 378, 280], 60  # BOS and a few story tokens
    settings = DecodeSettings(max_new_tokens=new)
    answer = generate(tc, tp, [prompt], NoProposer(), NoProposer().init(), settings).tokens[0]
    prop = DFlashProposer(config, BLOCK)
    out = generate(tc, tp, [prompt], prop, prop.init(params, shared_head(tp, tc.tie_word_embeddings), 1,
                                                     16 + new + BLOCK), settings)
    acceptance = teacher_forced_acceptance(tc, tp, config, params, prompt, answer, BLOCK)
    lengths = replay_fixed(acceptance, 1.0)[1]
    assert lengths[:-1] == out.accept_lengths[0][:-1] and len(lengths) == len(out.accept_lengths[0])
    assert np.mean(out.accept_lengths[0]) > 2  # a real draft: long accepted runs are compared


def test_tree_over_the_selector_on_the_demo_pair():
    """Tree verification of a DFlash2 draft follows its selector's transition scores (SPEC 12.1.3): on the
    shipped trained pair the tree's output is the target's own, and on this prompt it accepts more per round
    than the selector's chain (a deterministic regression guard: fixed weights, greedy)."""
    from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET
    from dflash_jax.checkpoints.loading import load_draft_any, load_target_any

    tc, tp = load_target_any(DEMO_TARGET)
    config, params = load_draft_any(DEMO_DRAFT)
    prompt, new = [1, 403, 261, 378, 280], 60
    answer = generate(tc, tp, [prompt], NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=new)).tokens
    prop = DFlashProposer(config, config.block_size)
    runs = {}
    for budget in (0, 24):
        inputs = prop.init(params, shared_head(tp, tc.tie_word_embeddings), 1, 256)
        runs[budget] = generate(tc, tp, [prompt], prop, inputs, DecodeSettings(max_new_tokens=new, tree_budget=budget))
        assert runs[budget].tokens == answer, budget
    assert runs[24].tau > runs[0].tau, (runs[24].tau, runs[0].tau)


def test_selector_transitions_equal_pair_scores_per_predecessor():
    """The tree's transition table (``dflash2.select_transitions``) row by row against the chain's own
    ``pair_scores`` for that predecessor (position 0: the anchor), log-softmaxed over the candidates (float32,
    1e-5)."""
    from dflash_jax.assets import DEMO_DRAFT
    from dflash_jax.checkpoints.loading import load_draft_any
    from dflash_jax.models.dflash2 import pair_scores, successor_codes, top_candidates
    from dflash_jax.models.draft import DraftModel

    config, params = load_draft_any(DEMO_DRAFT)
    rng = np.random.default_rng(4)
    b, positions, k = 2, config.block_size - 1, 5
    logits = jnp.asarray(rng.normal(size=(b, positions, config.vocab_size)) * 3, jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(b, positions, config.hidden_size)), jnp.float32)
    anchor = jnp.asarray([7, 300], jnp.int32)
    model = DraftModel(config)
    tokens, trans = model.apply({"params": params}, logits, hidden, anchor, k, method=DraftModel.transitions)
    sel = params["candidate_selector"]
    unary, cand = top_candidates(logits, config.selector_top_k)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(cand[..., :k]))
    projected = np.asarray(hidden) @ np.asarray(sel["hidden_projection"]["kernel"])
    for row in range(b):
        for d in range(positions):
            preds = [int(anchor[row])] if d == 0 else [int(t) for t in cand[row, d - 1, :k]]
            for p_index, pred in enumerate(preds):
                s = pair_scores(sel["predecessor_codebook"], successor_codes(sel["successor_codebook"],
                                cand[row, d, :k]), unary[row, d, :k], jnp.asarray(projected[row, d]), jnp.int32(pred))
                want = np.asarray(jax.nn.log_softmax(s))
                np.testing.assert_allclose(np.asarray(trans[row, d, p_index]), want, atol=1e-5)
            if d == 0:  # every row of position 0 is the anchor's
                np.testing.assert_allclose(np.asarray(trans[row, 0]), np.broadcast_to(want, (k, k)), atol=1e-5)
