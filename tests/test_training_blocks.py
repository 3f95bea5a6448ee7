"""DFlash training pieces: anchor sampling, packed blocks, the packed training forward and the decayed loss.

The key check: every block of the packed training forward equals the INFERENCE draft forward (the library's
``DraftModel.__call__`` and the independent NumPy reference of SPEC section 4) with context
``features[:anchor]``, at ``1e-5 * max(1, max |logit|)`` in fp32. Everything else is compared with brute-force
plain-Python constructions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.checkpoints.official_draft import load_draft
from dflash_jax.models.draft import DraftModel, SharedHead, init_draft_cache
from dflash_jax.training.anchors import block_labels, eligible_anchors, sample_anchors, sample_row_anchors
from dflash_jax.training.forward import draft_training_logits
from dflash_jax.training.loss import decay_weights, default_gamma, dflash_loss
from draft_tiny import HIDDEN, VOCAB, official_config, write_official_draft
from reference_draft_numpy import draft_forward_reference

L, A, B = 24, 5, 8
LENGTHS = [24, 17]


# ----------------------------------------------------------------------------------------------- anchors
def brute_eligible(loss_mask, length):
    return {a for a in range(len(loss_mask)) if a + 1 < length and loss_mask[a] == 1 and loss_mask[a + 1] == 1}


def random_masks(rng, rows, length, lengths, prompt_max=8):
    masks = np.zeros((rows, length), np.int32)
    for r in range(rows):
        prompt = rng.integers(1, prompt_max)
        masks[r, prompt:lengths[r]] = rng.random(lengths[r] - prompt) < 0.8
    return masks


def test_sample_anchors_distinct_eligible_and_take_all():
    rng = np.random.default_rng(0)
    lengths = np.array([24, 17, 9, 24])
    masks = random_masks(rng, 4, L, lengths)
    masks[2] = 0
    masks[2, [2, 3, 5, 6, 7, 8]] = 1  # length 9: exactly 4 eligible anchors {2, 5, 6, 7} < A
    sample = jax.jit(sample_anchors, static_argnums=3)
    seen = []
    for seed in range(6):
        anchors, valid = map(np.asarray, sample(jax.random.key(seed), masks, lengths, A))
        assert anchors.shape == valid.shape == (4, A) and anchors.dtype == np.int32
        for r in range(4):
            elig = brute_eligible(masks[r], lengths[r])
            chosen = anchors[r][valid[r]]
            assert len(set(chosen.tolist())) == len(chosen), "anchors must be distinct"
            assert set(chosen.tolist()) <= elig
            assert len(chosen) == min(A, len(elig))
            assert list(valid[r]) == sorted(valid[r], reverse=True), "valid anchors come first"
            assert list(chosen) == sorted(chosen)
            if len(elig) <= A:
                assert set(chosen.tolist()) == elig, "fewer eligible than num_anchors: take them all"
        assert set(anchors[2][valid[2]].tolist()) == {2, 5, 6, 7}
        seen.append(tuple(anchors[0]))
    assert len(set(seen)) > 1, "different keys must give different draws"
    np.testing.assert_array_equal(
        np.asarray(eligible_anchors(masks, lengths)),
        [[a in brute_eligible(masks[r], lengths[r]) for a in range(L)] for r in range(4)],
    )


def test_sample_anchors_single_sequence_and_more_anchors_than_positions():
    mask = np.array([0, 0, 1, 1, 1, 0], np.int32)
    anchors, valid = sample_anchors(jax.random.key(1), mask, 5, num_anchors=8)
    assert anchors.shape == (1, 8)
    assert sorted(np.asarray(anchors)[np.asarray(valid)].tolist()) == [2, 3]
    # Roughly uniform: over many keys each of 10 eligible positions is picked ~ A/10 of the time.
    mask = np.ones(11, np.int32)
    draws = jax.vmap(lambda k: sample_anchors(k, mask, 11, 3)[0][0])(jax.random.split(jax.random.key(2), 2000))
    freq = np.bincount(np.asarray(draws).ravel(), minlength=10) / 2000
    np.testing.assert_allclose(freq, 0.3, atol=0.05)


def test_row_anchors_are_each_rows_own_draw():
    """The train step's batched sampler: row i's anchors are sample_anchors of row i alone with key i (the
    result a row gets whatever rows share its batch), also with more anchors than positions and for a row
    with no eligible position."""
    rng = np.random.default_rng(4)
    lengths = np.array([24, 9, 17, 12])
    masks = random_masks(rng, 4, L, lengths)
    masks[3] = 0  # nothing to train: no anchor at all
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(7), jnp.arange(4))
    for num_anchors in (A, L + 5):
        anchors, valid = sample_row_anchors(keys, masks, lengths, num_anchors)
        for r in range(4):
            want_a, want_v = sample_anchors(keys[r], masks[r], lengths[r], num_anchors)
            np.testing.assert_array_equal(np.asarray(anchors[r]), np.asarray(want_a[0]))
            np.testing.assert_array_equal(np.asarray(valid[r]), np.asarray(want_v[0]))
        assert np.asarray(valid).any(axis=1).tolist() == [True, True, True, False]


def test_block_labels_vs_brute_force():
    rng = np.random.default_rng(1)
    lengths = np.array(LENGTHS)
    tokens = rng.integers(0, VOCAB - 1, size=(2, L)).astype(np.int32)
    masks = random_masks(rng, 2, L, lengths)
    anchors, valid = sample_anchors(jax.random.key(3), masks, lengths, A)
    anchors, valid = np.array(anchors), np.array(valid)
    anchors[1, -1], valid[1, -1] = 0, False  # at least one invalid anchor
    mask_id = VOCAB - 1
    got = [np.asarray(x) for x in block_labels(tokens, masks, lengths, anchors, valid, B, mask_token_id=mask_id)]
    want = [np.zeros((2, A, B), np.int32) for _ in range(3)] + [np.zeros((2, A, B), bool)]
    for n in range(2):
        for i in range(A):
            a = anchors[n, i]
            for k in range(B):
                want[0][n, i, k] = tokens[n, a] if k == 0 else mask_id
                want[1][n, i, k] = a + k
                run = all(a + j < lengths[n] and masks[n, a + j] == 1 for j in range(1, k + 1))
                if valid[n, i] and k >= 1 and run:
                    want[2][n, i, k] = tokens[n, a + k]
                    want[3][n, i, k] = True
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------------------------ training forward
def build(tmp_path, name, **overrides):
    cfg = official_config(**overrides)
    weights = write_official_draft(tmp_path / name, cfg, seed=len(name))
    config, params = load_draft(tmp_path / name)
    rng = np.random.default_rng(7)
    embed = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    head = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    shared = SharedHead(jnp.asarray(embed), jnp.asarray(head.T))
    return cfg, weights, config, params, DraftModel(config), shared, embed, head


# Per-layer causality (SPEC 2/4): without is_causal the sliding layer is causal and the full one bidirectional;
# is_causal false is the older two-sided window; is_causal true makes the full layers causal too.
LAYOUTS = {
    "full": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),  # window 5 < B = 8
    "sliding_bidirectional": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                                  is_causal=False),
    "causal": dict(is_causal=True),
    # DFlash2: the convolutions run along each packed block on its own (zero before its anchor).
    "dflash2": dict(architectures=["DFlash2DraftModel"], layer_types=["sliding_attention", "full_attention"],
                    sliding_window=5, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1,
                                                     "conv_kernel_size": 2, "conv_group_size": 16,
                                                     "selector_rank": 8, "selector_top_k": 5}),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def bundle(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("train"), request.param, **LAYOUTS[request.param])


# Row 0 covers a = 0 (empty context) and a block running past the end; row 1 (length 17) has invalid anchors.
ANCHORS = np.array([[0, 4, 11, 12, 22], [2, 9, 15, 0, 0]], np.int32)
VALID = np.array([[True] * 5, [True, True, True, False, False]])


def packed_inputs(config, seed=0):
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((2, L, 2 * HIDDEN)).astype(np.float32)
    for n, length in enumerate(LENGTHS):
        feats[n, length:] = 0.0
    tokens = rng.integers(0, VOCAB - 1, size=(2, L)).astype(np.int32)
    masks = np.ones((2, L), np.int32)
    blk, pos, labels, label_mask = block_labels(tokens, masks, np.array(LENGTHS), ANCHORS, VALID, B,
                                                mask_token_id=config.mask_token_id)
    return feats, blk, pos, labels, label_mask


def training_fn(model, shared):
    return jax.jit(lambda p, f, t, pos, v: draft_training_logits(model, p, f, t, pos, v, shared))


def inference_blocks(model, params, shared, feats_row, blk_row, pos_row):
    """The inference forward for every anchor of one sequence at once (one cache row per anchor)."""
    anchors = pos_row[:, 0]
    rows = len(anchors)
    ctx = np.broadcast_to(feats_row, (rows,) + feats_row.shape)
    ctx_pos = np.broadcast_to(np.arange(L, dtype=np.int32), (rows, L))
    ctx_valid = ctx_pos < anchors[:, None]
    cache = init_draft_cache(model.config, rows, L + 8)
    out = jax.jit(model.apply)({"params": params}, blk_row, pos_row, ctx, ctx_pos, ctx_valid, cache, shared)
    return np.asarray(out.logits)


def test_training_logits_equal_inference_forward(bundle):
    cfg, weights, config, params, model, shared, embed, head = bundle
    feats, blk, pos, _, _ = packed_inputs(config)
    logits = np.asarray(training_fn(model, shared)(params, feats, blk, pos, VALID))
    assert logits.shape == (2, A, B, VOCAB) and np.isfinite(logits).all()
    worst = 0.0
    for n in range(2):
        infer = inference_blocks(model, params, shared, feats[n], np.asarray(blk[n]), np.asarray(pos[n]))
        for i in np.flatnonzero(VALID[n]):
            a = int(ANCHORS[n, i])
            ref = draft_forward_reference(weights, cfg, embed, head, feats[n, :a], np.asarray(blk[n, i]), a)
            tol = 1e-5 * max(1.0, np.abs(ref).max())
            err_ref = np.abs(logits[n, i] - ref).max()
            err_inf = np.abs(logits[n, i] - infer[i]).max()
            assert err_ref <= tol and err_inf <= tol, (n, a, err_ref, err_inf)
            worst = max(worst, err_ref, err_inf)
    print(f"training vs inference: max err {worst:.2e}")


def test_block_does_not_see_its_own_anchor_feature(bundle):
    _, _, config, params, model, shared, _, _ = bundle
    feats, blk, pos, _, _ = packed_inputs(config)
    fn = training_fn(model, shared)
    base = np.asarray(fn(params, feats, blk, pos, VALID))
    poked = feats.copy()
    poked[0, 11] += 5.0  # the feature AT anchor 11 (row 0, anchor index 2)
    after = np.asarray(fn(params, poked, blk, pos, VALID))
    np.testing.assert_array_equal(after[0, :3], base[0, :3])  # anchors 0, 4, 11: unchanged
    for i in (3, 4):  # anchors 12 and 22 see position 11 (through the full-attention layer)
        assert np.abs(after[0, i] - base[0, i]).max() > 1e-3
    np.testing.assert_array_equal(after[1], base[1])  # the other sequence is untouched


# ------------------------------------------------------------------------------------------------- loss
def test_decay_weights_and_default_gamma():
    w = decay_weights(16, 7.0)
    assert w.shape == (16,) and w[0] == 0.0 and w[1] == 1.0
    np.testing.assert_allclose(w[1:], np.exp(-np.arange(15) / 7.0), rtol=1e-6)
    np.testing.assert_allclose(w[2], np.exp(-1 / 7), rtol=1e-6)
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7, 5, 4)
    with pytest.raises(ValueError, match="block_size 12"):
        default_gamma(12)


def test_dflash_loss_vs_numpy():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((2, A, B, 11)).astype(np.float32) * 3
    labels = rng.integers(0, 11, size=(2, A, B)).astype(np.int32)
    # Make some predictions right so that the acceptance estimate is non-trivial.
    labels = np.where(rng.random(labels.shape) < 0.5, logits.argmax(-1), labels).astype(np.int32)
    mask = rng.random(labels.shape) < 0.8
    mask[..., 0] = False
    mask[1, 3:] = False
    loss, metrics = jax.jit(dflash_loss, static_argnums=3)(logits, labels, mask, 4.0)

    num = den = 0.0
    correct_k, count_k, acc_lens = np.zeros(B), np.zeros(B), []
    for idx in np.ndindex(2, A):
        run, running = 0, True
        for k in range(B):
            ok = mask[idx][k] and logits[idx][k].argmax() == labels[idx][k]
            if mask[idx][k]:
                x = logits[idx][k].astype(np.float64)
                ce = np.log(np.exp(x - x.max()).sum()) + x.max() - x[labels[idx][k]]
                w = np.exp(-(k - 1) / 4.0)
                num, den = num + w * ce, den + w
                correct_k[k] += ok
                count_k[k] += 1
            if k >= 1:
                running = running and ok
                run += running
        if mask[idx][1]:
            acc_lens.append(1 + run)
    np.testing.assert_allclose(loss, num / den, rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy_per_position"], correct_k / np.maximum(count_k, 1), rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], correct_k.sum() / count_k.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["acceptance_length"], np.mean(acc_lens), rtol=1e-6)
    assert metrics["num_labels"] == mask.sum()
    assert np.mean(acc_lens) > 1.0


def brute_block_loss(logits, target_logits, labels, mask, a, temperature, weights, gamma=4.0, alpha=0.5):
    """Plain-Python float64 loss of blocks ``[..., B]``: per position ``(1 - a) ce + a KL(p_T || q)``, weighted by
    the decay or by D-PACE written from its definition (w_j = sum over labelled m >= j of the product over
    labelled i <= m of (1 - alpha) q_i + alpha, q_i = the draft's probability of the label)."""
    def log_softmax(x):
        x = x.astype(np.float64)
        return x - x.max() - np.log(np.exp(x - x.max()).sum())

    num = norm = 0.0
    for idx in np.ndindex(*labels.shape[:-1]):
        ks = [k for k in range(1, labels.shape[-1]) if mask[idx][k]]
        ce = {k: -log_softmax(logits[idx][k])[labels[idx][k]] for k in ks}
        if weights == "dpace":
            w = {j: sum(np.prod([(1 - alpha) * np.exp(-ce[i]) + alpha for i in ks if i <= m]) for m in ks if m >= j)
                 for j in ks}
            norm += 1.0 if ks else 0.0
        else:
            w = {k: np.exp(-(k - 1) / gamma) for k in ks}
            norm += sum(w.values())
        for k in ks:
            log_q, log_p = log_softmax(logits[idx][k]), log_softmax(target_logits[idx][k] / temperature)
            kl = float(np.sum(np.exp(log_p) * (log_p - log_q)))
            num += w[k] * ((1 - a) * ce[k] + a * kl)
    return num / norm


@pytest.mark.parametrize("kl_weight,temperature,weights", [(1.0, 1.0, "decay"), (0.3, 0.7, "decay"),
                                                           (0.0, 1.0, "dpace"), (0.5, 2.0, "dpace")])
def test_kl_and_dpace_losses_vs_brute_force(kl_weight, temperature, weights):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((2, A, B, 11)).astype(np.float32) * 3
    target_logits = rng.standard_normal((2, A, B, 11)).astype(np.float32) * 3
    labels = np.where(rng.random((2, A, B)) < 0.5, logits.argmax(-1), rng.integers(0, 11, (2, A, B))).astype(np.int32)
    mask = rng.random(labels.shape) < 0.8  # holes inside blocks: D-PACE's product skips them
    mask[..., 0] = False
    mask[1, 3:] = False  # whole blocks without labels add nothing to either normaliser
    fn = jax.jit(functools.partial(dflash_loss, gamma=4.0, kl_weight=kl_weight, temperature=temperature,
                                   position_weights=weights, dpace_alpha=0.5))
    loss, metrics = fn(logits, labels, mask, target_logits=target_logits)
    np.testing.assert_allclose(loss, brute_block_loss(logits, target_logits, labels, mask, kl_weight, temperature,
                                                      weights), rtol=1e-5)
    if kl_weight > 0:  # the two terms are reported apart and mix to the loss
        np.testing.assert_allclose((1 - kl_weight) * metrics["ce"] + kl_weight * metrics["kl"], loss, rtol=1e-5)
        assert float(metrics["kl"]) > 0


def test_kl_gradient_equals_autodiff_of_the_plain_formula():
    """The KL's hand-written backward (softmax(draft) - softmax(target/T)) against autodiff of the textbook
    expression, with a weight per position."""
    from dflash_jax.training.loss import forward_kl

    rng = np.random.default_rng(8)
    zt = jnp.asarray(rng.standard_normal((3, 5, 11)) * 3, jnp.float32)
    zd = jnp.asarray(rng.standard_normal((3, 5, 11)) * 3, jnp.float32)
    w = jnp.asarray(rng.random((3, 5)), jnp.float32)

    def plain(d):
        log_p, log_q = jax.nn.log_softmax(zt / 0.7), jax.nn.log_softmax(d)
        return jnp.sum(w * jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1))

    np.testing.assert_allclose(jnp.sum(w * forward_kl(zt, zd, 0.7)), plain(zd), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda d: jnp.sum(w * forward_kl(zt, d, 0.7)))(zd), jax.grad(plain)(zd),
                               atol=1e-6)


def test_kl_of_the_draft_equal_to_the_target_is_zero_and_its_gradient_vanishes():
    rng = np.random.default_rng(6)
    z = jnp.asarray(rng.standard_normal((3, B, 11)).astype(np.float32))
    labels, mask = jnp.zeros((3, B), jnp.int32), jnp.ones((3, B), bool)

    def kl(x):
        return dflash_loss(x, labels, mask, 4.0, target_logits=z, kl_weight=1.0)[0]

    assert abs(float(kl(z))) < 1e-6
    assert float(jnp.max(jnp.abs(jax.grad(kl)(z)))) < 1e-6
    assert float(kl(z + jnp.asarray(rng.standard_normal(z.shape), jnp.float32))) > 1e-2
    with pytest.raises(ValueError, match="target's logits"):
        dflash_loss(z, labels, mask, 4.0, kl_weight=1.0)


def test_gradient_flows_to_draft_params_only(bundle):
    _, _, config, params, model, shared, _, _ = bundle
    feats, blk, pos, labels, label_mask = packed_inputs(config)

    def loss_fn(p, sh):
        logits = draft_training_logits(model, p, feats, blk, pos, VALID, sh)
        return dflash_loss(logits, labels, label_mask)[0]

    grads, shared_grads = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(params, shared)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert all(np.isfinite(np.asarray(g)).all() for _, g in leaves)
    for path in [("fc", "kernel"), ("hidden_norm", "weight"), ("norm", "weight"),
                 ("layers_0", "self_attn", "k_proj", "kernel"), ("layers_0", "self_attn", "q_proj", "kernel"),
                 ("layers_1", "mlp", "down_proj", "kernel")]:
        g = functools.reduce(lambda d, k: d[k], path, grads)
        assert np.abs(np.asarray(g)).max() > 0, path
    assert not np.asarray(shared_grads.embedding).any() and not np.asarray(shared_grads.head_kernel).any()


def test_uniform_anchors_vs_brute_force():
    from dflash_jax.training.anchors import uniform_anchors

    rng = np.random.default_rng(5)
    lengths = np.array([24, 17, 9, 24])
    masks = random_masks(rng, 4, L, lengths)
    masks[3] = 0
    for block, num in ((4, 3), (3, 8), (8, 2)):
        anchors, valid = map(np.asarray, jax.jit(uniform_anchors, static_argnums=(2, 3))(masks, lengths, num, block))
        for r in range(4):
            elig = brute_eligible(masks[r], lengths[r])
            want = []
            if elig:
                p = min(elig)
                want = [p + block * j for j in range(num) if p + block * j in elig]
            assert anchors[r][valid[r]].tolist() == want, (r, block, num)
            assert not anchors[r][~valid[r]].any()
