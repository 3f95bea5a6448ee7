"""The 2026 recipe options of ``train fit``: Muon for the draft's matrices (``train.optimizer: muon``) and the
variable-prefix objective (``train.loss_mode: variable_prefix``, D2SD).

References are independent of the code under test: Muon's update and AdamW's written out in NumPy (float64)
from the published recipe (Nesterov momentum, the quintic Newton-Schulz iteration with coefficients
(3.4445, -4.7750, 2.0315), five steps, updates scaled to AdamW's RMS by ``0.2 sqrt(max(fan_in, fan_out))``);
the variable-prefix blocks, labels and weights built by Python loops over rows, anchors and positions; the
prior's draws against its truncated geometric pmf by a chi-square test.

Tolerances: optimizer updates 2e-6 absolute (float32 Newton-Schulz on 8x12 matrices against float64; the
updates are ~1e-3); blocks, masks and prefix draws exact; weights and loss sums 1e-6 relative; the chunked
variable-prefix loss and its gradients against the unchunked forward 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dflash_jax.models.config import ConfigError
from dflash_jax.models.draft import DraftModel, shared_head
from dflash_jax.models.target import TargetModel
from dflash_jax.training.anchors import (block_labels, prefix_pmf, prefix_range, sample_prefix_lengths,
                                         sample_row_anchors, visible_prefix)
from dflash_jax.training.forward import draft_training_logits
from dflash_jax.training.loss import LossSpec, block_loss_sums
from dflash_jax.training.step import StepConfig, batch_loss_sums, is_muon_matrix, make_optimizer
from engine_tiny import tiny_draft, tiny_target
from train_tiny import STEP_KW, tiny_run_config, tiny_tokenized

NS = (3.4445, -4.7750, 2.0315)


# ----------------------------------------------------------------------------------------------- Muon


def np_orthogonalise(g: np.ndarray) -> np.ndarray:
    """Five quintic Newton-Schulz steps on one matrix, as published (Frobenius-normalised first; the wide
    orientation, transposed back)."""
    a, b, c = NS
    x = g.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def np_muon_direction(mu_hat: np.ndarray) -> np.ndarray:
    """Per matrix over the last two axes (leading axes: a stack of matrices), then the RMS scale."""
    fan_in, fan_out = mu_hat.shape[-2:]
    flat = mu_hat.reshape((-1, fan_in, fan_out))
    out = np.stack([np_orthogonalise(m) for m in flat]).reshape(mu_hat.shape)
    return out * 0.2 * np.sqrt(max(fan_in, fan_out))


def np_reference(params: dict, grads: list[dict], muon_leaves: set, lr: float, muon_lr: float, beta: float,
                 wd: float, b1=0.9, b2=0.999, eps=1e-8) -> dict:
    """Parameters after ``len(grads)`` steps: Muon on ``muon_leaves``, AdamW on the rest, constant rates."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            gk = g[k].astype(np.float64)
            if k in muon_leaves:
                mu[k] = beta * mu[k] + (1 - beta) * gk
                # Nesterov look-ahead with bias corrections: beta * mu_t / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t)
                mu_hat = beta * mu[k] / (1 - beta ** (t + 1)) + (1 - beta) * gk / (1 - beta ** t)
                update = np_muon_direction(mu_hat) + wd * p[k]
                p[k] = p[k] - muon_lr * update
            else:
                mu[k] = b1 * mu[k] + (1 - b1) * gk
                nu[k] = b2 * nu[k] + (1 - b2) * gk * gk
                m_hat, v_hat = mu[k] / (1 - b1 ** t), nu[k] / (1 - b2 ** t)
                p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * p[k])
    return p


def flat_tree(flat: dict) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (the Flax layout)."""
    tree: dict = {}
    for key, value in flat.items():
        *outer, last = key.split("/")
        node = tree
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def test_muon_updates_equal_a_numpy_reference():
    """Two steps on a tree with a wide and a tall Dense kernel, a stack of two kernels [2, 8, 12] (each
    orthogonalised on its own: the reference loops over them), a norm weight, a 3-D convolution kernel and
    a codebook (AdamW: not a Dense kernel)."""
    rng = np.random.default_rng(0)
    shapes = {"fc/kernel": (12, 8), "layers_0/mlp/up_proj/kernel": (8, 20), "stack/kernel": (2, 8, 12),
              "layers_0/input_layernorm/weight": (8,), "layers_0/mlp_conv/base_kernel": (2, 2, 8),
              "candidate_selector/successor_codebook": (10, 6)}
    muon_leaves = {"fc/kernel", "layers_0/mlp/up_proj/kernel", "stack/kernel"}
    params = {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(2)]
    lr, muon_lr, beta, wd = 1e-3, 4e-3, 0.9, 0.01
    # min_lr_ratio 1: a flat cosine, so that the reference can use constant rates (warmup 0).
    opt, _ = make_optimizer(lr, total_steps=100, warmup_ratio=0.0, clip_norm=1e9, weight_decay=wd,
                            optimizer="muon", muon_learning_rate=muon_lr, muon_momentum=beta, min_lr_ratio=1.0)
    labels = jax.tree_util.tree_map_with_path(is_muon_matrix, flat_tree(params))
    assert {k for k in shapes if eval_path(labels, k)} == muon_leaves
    p = jax.tree.map(jnp.asarray, flat_tree(params))
    state = opt.init(p)
    update = jax.jit(opt.update)
    for g in grads:
        u, state = update(jax.tree.map(jnp.asarray, flat_tree(g)), state, p)
        p = jax.tree.map(jnp.add, p, u)
    ref = np_reference(params, grads, muon_leaves, lr, muon_lr, beta, wd)
    for key in shapes:
        got = np.asarray(eval_path(p, key))
        np.testing.assert_allclose(got, ref[key], atol=2e-6, err_msg=key)
        assert np.max(np.abs(got - params[key])) > 1e-4, key  # every leaf moved


def eval_path(tree: dict, key: str):
    for part in key.split("/"):
        tree = tree[part]
    return tree


def test_a_stacked_kernel_is_not_orthogonalised_as_one_matrix():
    """The failure the per-matrix rule prevents: orthogonalising the [2, 8, 12] stack reshaped to one 16x12
    matrix gives a different update (so the previous test would catch it)."""
    g = np.random.default_rng(1).standard_normal((2, 8, 12))
    per_matrix = np_muon_direction(g)
    as_one = np_orthogonalise(g.reshape(16, 12)).reshape(2, 8, 12) * 0.2 * np.sqrt(16)
    assert np.max(np.abs(per_matrix - as_one)) > 1e-2


def test_muon_takes_the_drafts_dense_kernels_only():
    """On real draft trees: every Dense kernel (projections, fc, a DFlash2 draft's kernel and selector
    projections) goes to Muon; norms, convolution base kernels and the selector's codebooks to AdamW."""
    from draft_tiny import official_config
    from dflash_jax.checkpoints.official_draft import init_draft_params
    from dflash_jax.models.draft_config import DraftConfig

    dc, _ = tiny_draft()
    dc2 = official_config(architectures=["DFlash2DraftModel"])
    dc2["dflash_config"] |= {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    dc2 = DraftConfig.from_dict(dc2)
    kinds = set()
    for cfg in (dc, dc2):
        for path, leaf in jax.tree_util.tree_flatten_with_path(init_draft_params(cfg, seed=0))[0]:
            name = jax.tree_util.keystr(path)
            assert is_muon_matrix(path, leaf) == name.endswith("['kernel']"), name
            assert not is_muon_matrix(path, leaf) or leaf.ndim == 2, name
            kinds.add((name.split("']['")[-1].rstrip("']"), is_muon_matrix(path, leaf)))
    assert {("successor_codebook", False), ("base_kernel", False), ("weight", False), ("kernel", True)} <= kinds


# ------------------------------------------------------------------------------------ variable prefix


def test_prefix_prior_matches_the_truncated_geometric_pmf():
    """200,000 draws (fixed keys) against ``Pr(l) ~ 0.9**l`` on 2..15 (NeMo's range): chi-square p-value
    above 1e-3; and the pmf itself against its definition written out."""
    assert prefix_range(16) == (1, 15)
    lo, hi = prefix_range(16, prefix_min=2)
    assert (lo, hi) == (2, 15)
    pmf = prefix_pmf(lo, hi, 0.9)
    raw = np.array([0.9 ** l for l in range(2, 16)])
    np.testing.assert_allclose(pmf, raw / raw.sum(), rtol=1e-12)
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    draw = jax.jit(sample_prefix_lengths, static_argnums=(1, 2, 3, 4))
    draws = np.asarray(draw(keys, 500, lo, hi, 0.9)).ravel()
    assert draws.min() >= lo and draws.max() <= hi
    counts = np.bincount(draws - lo, minlength=hi - lo + 1)
    chi2 = stats.chisquare(counts, pmf * draws.size)
    assert chi2.pvalue > 1e-3, (counts, chi2)
    # A prior that favours long prefixes, clipped range.
    lo, hi = prefix_range(8, prefix_min=3, prefix_max=6)
    draws = np.asarray(draw(keys[:100], 500, lo, hi, 1.5)).ravel()
    counts = np.bincount(draws - lo, minlength=hi - lo + 1)
    assert stats.chisquare(counts, prefix_pmf(lo, hi, 1.5) * draws.size).pvalue > 1e-3
    assert prefix_range(2) == (1, 1)  # block 2: only the standard block exists


def brute_force_blocks(tokens, loss_mask, lengths, anchors, valid, prefix, block, mask_id, gamma):
    """Loops: block tokens, supervised mask and weights of every (row, anchor) for the given draws."""
    n, a = anchors.shape
    blk = np.full((n, a, block), mask_id, np.int64)
    sup = np.zeros((n, a, block), bool)
    w = np.zeros((n, a, block))
    for i in range(n):
        for j in range(a):
            s, l = int(anchors[i, j]), int(prefix[i, j])
            blk[i, j, 0] = tokens[i, s]
            for k in range(1, block):
                # label k exists iff the anchor is valid and positions s+1..s+k are inside and trained
                ok = valid[i, j] and all(s + m < lengths[i] and loss_mask[i, s + m] for m in range(1, k + 1))
                if ok and k < l:
                    blk[i, j, k] = tokens[i, s + k]  # visible real token
                if ok and k >= l:
                    sup[i, j, k] = True
                    w[i, j, k] = np.exp(-(k - l) / gamma)
    return blk, sup, w


@pytest.fixture(scope="module")
def vp_setup():
    tc, tp = tiny_target()
    dc, dp = tiny_draft()
    data = tiny_tokenized(rows=4)
    batch = {k: jnp.asarray(v) for k, v in data.padded_rows().items()}
    return tc, tp, dc, dp, batch


def test_variable_prefix_blocks_equal_brute_force(vp_setup):
    """Fixed draws (anchors and prefixes from three keys, and hand-picked extremes: prefix 1 = the standard
    block, B-1, a block crossing the row's end): the device's blocks, label mask and loss sums equal the
    loops'. The loss sums come from random logits: ce, weights, normaliser, acceptance metrics."""
    _, _, _, _, batch = vp_setup
    tokens, loss_mask, lengths = (np.asarray(batch[k]) for k in ("tokens", "loss_mask", "lengths"))
    block, mask_id, gamma = 8, 96, 4.0
    n = tokens.shape[0]

    @jax.jit
    def device(anchors, valid, prefix, logits):
        blk, _, labels, lmask = block_labels(batch["tokens"], batch["loss_mask"], batch["lengths"], anchors, valid,
                                             block, mask_token_id=mask_id)
        vblk, vmask = visible_prefix(blk, labels, lmask, prefix)
        return vblk, vmask, labels, block_loss_sums(logits, labels, vmask, LossSpec(gamma), prefix=prefix)

    for seed in range(3):
        row_keys = jax.random.split(jax.random.PRNGKey(seed), n)
        anchors, valid = sample_row_anchors(row_keys, batch["loss_mask"], batch["lengths"], 6)
        prefix = sample_prefix_lengths(row_keys, 6, *prefix_range(block), 0.9)
        if seed == 0:  # extremes
            prefix = prefix.at[0, 0].set(1).at[0, 1].set(block - 1)
            last = int(lengths[1]) - 3
            anchors = anchors.at[1, 0].set(last)
            valid = valid.at[1, 0].set(bool(loss_mask[1, last] and loss_mask[1, last + 1]))
        logits = jax.random.normal(jax.random.PRNGKey(10 + seed), (n, 6, block - 1, 97)) * 3
        vblk, vmask, labels, sums = device(anchors, valid, prefix, logits)
        ref_blk, ref_sup, ref_w = brute_force_blocks(tokens, loss_mask, lengths, np.asarray(anchors),
                                                     np.asarray(valid), np.asarray(prefix), block, mask_id, gamma)
        np.testing.assert_array_equal(np.asarray(vblk), ref_blk)
        np.testing.assert_array_equal(np.asarray(vmask), ref_sup)
        assert ref_sup.any() and (np.asarray(vblk)[..., 1:] != mask_id).any()

        lg = np.asarray(logits, np.float64)
        lab = np.asarray(labels)
        ce = np.log(np.exp(lg).sum(-1)) - np.take_along_axis(lg, lab[..., 1:, None], -1)[..., 0]
        np.testing.assert_allclose(float(sums.weighted_ce), (ref_w[..., 1:] * ce).sum(), rtol=1e-6)
        np.testing.assert_allclose(float(sums.weight), ref_w.sum(), rtol=1e-6)
        # acceptance from the first masked position l: 1 + the run of correct argmaxes from there
        correct = lg.argmax(-1) == lab[..., 1:]
        accepted, blocks = 0.0, 0
        pre = np.asarray(prefix)
        for i in range(n):
            for j in range(6):
                l = int(pre[i, j])
                if not ref_sup[i, j, l]:
                    continue
                run = 0
                for k in range(l, block):
                    if not (ref_sup[i, j, k] and correct[i, j, k - 1]):
                        break
                    run += 1
                accepted, blocks = accepted + 1 + run, blocks + 1
        assert float(sums.blocks) == blocks and blocks > 0
        np.testing.assert_allclose(float(sums.accepted), accepted, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(sums.count), ref_sup.sum((0, 1)))


def test_prefix_one_is_the_standard_loss(vp_setup):
    """Every prefix 1: blocks, weights and every loss sum equal the standard mode's."""
    _, _, _, _, batch = vp_setup
    row_keys = jax.random.split(jax.random.PRNGKey(5), 4)
    anchors, valid = sample_row_anchors(row_keys, batch["loss_mask"], batch["lengths"], 6)
    blk, _, labels, lmask = block_labels(batch["tokens"], batch["loss_mask"], batch["lengths"], anchors, valid, 8,
                                         mask_token_id=96)
    ones = jnp.ones(anchors.shape, jnp.int32)
    vblk, vmask = visible_prefix(blk, labels, lmask, ones)
    np.testing.assert_array_equal(vblk, blk)
    np.testing.assert_array_equal(vmask, lmask)
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, 6, 7, 97)) * 3
    a, b = block_loss_sums(logits, labels, lmask, LossSpec(4.0)), block_loss_sums(logits, labels, lmask,
                                                                                    LossSpec(4.0), prefix=ones)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_chunked_variable_prefix_loss_equals_the_unchunked_forward(vp_setup):
    """The train step's path (prefix drawn inside, carried through chunks of 4 anchors, the last one padded) against the dense
    packed forward on blocks built by the loops above, with the loss written out in NumPy-free JAX from the
    loops' weights. Loss 1e-5 relative, gradients 1e-5 absolute."""
    tc, tp, dc, dp, batch = vp_setup
    target, draft = TargetModel(tc), DraftModel(dc)
    key = jax.random.PRNGKey(3)
    n, length = batch["tokens"].shape
    tokens, loss_mask, lengths = (np.asarray(batch[k]) for k in ("tokens", "loss_mask", "lengths"))
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(n))
    anchors, valid = sample_row_anchors(row_keys, batch["loss_mask"], batch["lengths"], 6)
    prefix = sample_prefix_lengths(row_keys, 6, *prefix_range(8), 0.9)
    ref_blk, ref_sup, ref_w = brute_force_blocks(tokens, loss_mask, lengths, np.asarray(anchors), np.asarray(valid),
                                                 np.asarray(prefix), 8, 96, 4.0)
    _, bpos, labels, _ = block_labels(batch["tokens"], batch["loss_mask"], batch["lengths"], anchors, valid, 8,
                                      mask_token_id=96)
    pos = jnp.broadcast_to(jnp.arange(length)[None], (n, length))
    feats = target.apply({"params": tp}, batch["tokens"], pos, valid=pos < batch["lengths"][:, None],
                         feature_layers=dc.target_layer_ids).features

    def ref_loss(p):
        logits = draft_training_logits(draft, p, feats, jnp.asarray(ref_blk, jnp.int32), bpos, valid,
                                       shared_head(tp, False))
        ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
        w = jnp.asarray(ref_w, jnp.float32)
        return jnp.sum(w * ce) / jnp.sum(w)

    ref_value, ref_grads = jax.jit(jax.value_and_grad(ref_loss))(dp)
    cfg = StepConfig(feature_layers=dc.target_layer_ids, **{**STEP_KW, "anchor_chunk": 4},
                     loss_mode="variable_prefix")
    assert cfg.num_anchors % cfg.anchor_chunk  # 6 anchors in chunks of 4: the prefix is padded too

    def loss(p):
        sums = batch_loss_sums(p, tp, batch, key, jnp.arange(n), target, draft, cfg)
        return sums.objective(0.0) / sums.weight

    value, grads = jax.jit(jax.value_and_grad(loss))(dp)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5)


# ------------------------------------------------------------------------------------ config and fit


@pytest.mark.parametrize("train,message", [
    ({"optimizer": "sgd"}, "train.optimizer must be adamw or muon"),
    ({"muon_momentum": 1.0}, "train.muon_momentum must lie in [0, 1)"),
    ({"muon_learning_rate": 0}, "train.muon_learning_rate must be positive"),
    ({"loss_mode": "prefix"}, "train.loss_mode must be standard or variable_prefix"),
    ({"prefix_base": -1}, "train.prefix_base must be positive"),
    ({"prefix_min": 0}, "train.prefix_min must be positive"),
    ({"prefix_min": 4, "prefix_max": 3}, "train.prefix_max 3 is below train.prefix_min 4"),
    ({"loss_mode": "variable_prefix", "position_weights": "dpace"}, "cannot go with train.position_weights dpace"),
])
def test_bad_option_values_name_the_key(tmp_path, train, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        tiny_run_config(tmp_path, tmp_path / "out", train=train)


def test_fit_help_names_both_options(capsys):
    from train.__main__ import main as train_main

    try:
        assert train_main(["fit", "--help"]) == 0
    except SystemExit as e:  # argparse's own exit, where the CLI does not catch it
        assert e.code == 0
    text = capsys.readouterr().out
    for key in ("train.optimizer", "train.muon_learning_rate", "train.muon_momentum", "train.loss_mode",
                "train.prefix_base", "train.prefix_min", "train.prefix_max"):
        assert key in text, key


def test_fit_with_muon_and_variable_prefix_learns_and_resumes(tmp_path):
    """A short run with both options: the loss falls, the metrics are finite, and a second call finds the
    finished run's checkpoint (the partitioned optimizer state restores) and trains no further."""
    import json

    from cli_tiny import write_tiny_pair
    from dflash_jax.training.trainer import fit
    from train_tiny import write_text_rows

    target_dir, _ = write_tiny_pair(tmp_path)
    rows = write_text_rows(tmp_path / "train.jsonl", rows=40)
    cfg = tiny_run_config(target_dir, tmp_path / "run", str(rows), data={"max_length": 48},
                          train={"epochs": 10, "global_batch": 4, "max_steps": 24, "optimizer": "muon",
                                 "loss_mode": "variable_prefix", "learning_rate": 0.003},
                          output={"save_every": 12, "log_every": 1})
    logs = []
    result = fit(cfg, progress=False, log=logs.append)
    assert result.steps == 24
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert all(np.isfinite(losses)) and np.mean(losses[-4:]) < 0.9 * np.mean(losses[:4]), losses
    again = fit(cfg, progress=False, log=logs.append)
    assert again.steps == 24 and any("resumed" in line for line in logs), logs
