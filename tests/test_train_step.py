"""The train step: the chunked, rematerialised loss equals the unchunked packed forward + ``dflash_loss``
(which tests/test_training_blocks.py ties to the inference forward), and the globally normalised loss does
not depend on how the global batch is split over devices or accumulation micro-steps.

Tolerances (fp32, CPU, highest matmul precision): chunked vs unchunked loss 1e-5 relative and gradients
1e-5 absolute; 1 device vs 8 devices vs 4 micro-steps: loss 1e-6 relative, gradients 1e-6 absolute,
updated params 1e-5 absolute.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models.draft import DraftModel, shared_head
from dflash_jax.models.target import TargetModel
from dflash_jax.training.anchors import block_labels, sample_anchors
from dflash_jax.training.forward import draft_training_logits
from dflash_jax.training.loss import dflash_loss
from dflash_jax.training.step import StepConfig, batch_loss_sums
from engine_tiny import tiny_draft, tiny_target
from train_tiny import STEP_KW, tiny_tokenized

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def setup():
    tc, tp = tiny_target()
    dc, dp = tiny_draft()
    data = tiny_tokenized(rows=4)
    batch = {k: jnp.asarray(v) for k, v in data.padded_rows().items()}
    return tc, tp, dc, dp, batch


def unchunked_loss(tc, tp, dc, dp, batch, key, cfg):
    """The reference: anchors drawn the same way, then the dense packed forward and ``dflash_loss``."""
    target, draft = TargetModel(tc), DraftModel(dc)
    n, length = batch["tokens"].shape
    pos = jnp.broadcast_to(jnp.arange(length)[None], (n, length))
    out = target.apply({"params": tp}, batch["tokens"], pos, valid=pos < batch["lengths"][:, None],
                       feature_layers=dc.target_layer_ids)
    feats = out.features
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(n))
    anchors, valid = jax.vmap(lambda k, m, le: sample_anchors(k, m, le, cfg.num_anchors))(
        keys, batch["loss_mask"], batch["lengths"])
    anchors, valid = anchors[:, 0], valid[:, 0]
    blk, bpos, labels, lmask = block_labels(batch["tokens"], batch["loss_mask"], batch["lengths"], anchors, valid,
                                            cfg.block_size, mask_token_id=cfg.mask_token_id)

    # The target's logits predicting block position k come from its full forward at position anchor + k - 1.
    at = jnp.clip(bpos - 1, 0, length - 1)
    target_logits = jnp.take_along_axis(out.logits[:, None], at[..., None], axis=2)
    spec = cfg.loss_spec

    def loss(p):
        logits = draft_training_logits(draft, p, feats, blk, bpos, valid, shared_head(tp, False))
        return dflash_loss(logits, labels, lmask, cfg.gamma, target_logits, kl_weight=spec.kl_weight,
                           temperature=spec.temperature, position_weights=spec.position_weights,
                           dpace_alpha=spec.dpace_alpha)[0]

    return jax.jit(jax.value_and_grad(loss))(dp)


@pytest.mark.parametrize("chunk,loss_kw", [
    (6, {}), (4, {}), (1, {}),
    (4, {"loss": "kl", "temperature": 0.8}),
    (1, {"loss": "ce+kl", "kl_weight": 0.3, "position_weights": "dpace", "dpace_alpha": 0.4}),
], ids=["ce-6", "ce-4", "ce-1", "kl-4", "ce+kl-dpace-1"])
def test_chunked_loss_and_gradients_equal_unchunked(setup, chunk, loss_kw):
    """Also for the KL losses (the target's logits formed chunk by chunk from its final hidden states vs its
    own full forward's logits) and D-PACE (weights from each chunk's own cross-entropies)."""
    tc, tp, dc, dp, batch = setup
    cfg = StepConfig(feature_layers=dc.target_layer_ids, **{**STEP_KW, "anchor_chunk": chunk, **loss_kw})
    key = jax.random.PRNGKey(3)
    ref_loss, ref_grads = unchunked_loss(tc, tp, dc, dp, batch, key, cfg)
    target, draft = TargetModel(tc), DraftModel(dc)

    def loss(p):
        sums = batch_loss_sums(p, tp, batch, key, jnp.arange(4), target, draft, cfg)
        return sums.objective(cfg.kl_share) / sums.weight

    value, grads = jax.jit(jax.value_and_grad(loss))(dp)
    np.testing.assert_allclose(value, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5)
    assert float(np.max(np.abs(jax.tree.leaves(grads)[0]))) > 0


def test_anchor_logits_are_never_computed():
    """The chunk's head sees only the B-1 mask positions: no [.., B, V] logits exist in the step's HLO."""
    tc, tp = tiny_target()
    dc, dp = tiny_draft()
    cfg = StepConfig(feature_layers=dc.target_layer_ids, **STEP_KW)
    data = tiny_tokenized(rows=2)
    batch = data.padded_rows()
    fn = jax.jit(lambda p: batch_loss_sums(p, tp, batch, jax.random.PRNGKey(0), jnp.arange(2), TargetModel(tc),
                                           DraftModel(dc), cfg).weighted_ce)
    hlo = fn.lower(dp).as_text()
    chunk, vocab = cfg.anchor_chunk, tc.vocab_size
    assert f"x{chunk}x{cfg.block_size - 1}x{vocab}x" in hlo  # StableHLO spells shapes tensor<2x4x7x97xf32>
    assert f"x{chunk}x{cfg.block_size}x{vocab}x" not in hlo


def test_sharded_and_accumulated_steps_equal_one_device():
    """8 fake CPU devices (data=2, fsdp=2, tensor=2; fsdp=8), alone and with 4 accumulation micro-steps, against
    1 device, for the cross-entropy and for ce+kl with D-PACE's weights on a DFlash2 draft;
    on the 8-device meshes no collective outside the frozen target moves activations of the whole batch (on
    an fsdp mesh XLA otherwise lays the draft's activations out like the fsdp-split weights, computes every
    row on every device and all-reduces the chunk logits: 61 such collectives on fsdp=8 without the
    constraints)."""
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, str(TESTS / "sharded_step_check.py")], capture_output=True, text=True,
                          env=env, timeout=1200)  # ~5 min quiet on 2 cores; a loaded machine doubled it
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == [1, 8]
    assert any("tensor" in s for s in out["sharded_specs"]) and any("fsdp" in s for s in out["sharded_specs"])
    assert out["full_batch_collectives"] == {"data=2,fsdp=2,tensor=2": [], "fsdp=8": []}, out
    for name in ("devices8", "devices8_accum4", "fsdp8"):
        assert out[name]["loss"] <= 1e-6 * abs(out["loss"]), (name, out)
        assert out[name]["grads"] <= 1e-6, (name, out)
        assert out[name]["params"] <= 1e-5, (name, out)
    # The ce+kl / D-PACE loss: loss 1e-6 relative, params 1e-5 absolute; gradients 1e-5 of the largest one.
    # D-PACE's weights are not normalised (up to B-1 per position over a block count), so the DFlash2 run's
    # gradients reach ~6 where the cross-entropy's stay below 1; measured: 1.4e-5 absolute at a scale of 6.0,
    # every leaf within 2.5e-6 of its own largest entry.
    mixed = out["ce+kl,dpace/devices8_accum4"]
    assert mixed["loss"] <= 1e-6, out
    assert mixed["grads"] <= 1e-5 * max(1.0, mixed["grad_scale"]), out
    assert mixed["params"] <= 1e-5, out
