"""How a decode ends: stop tokens, the mask token, and the last rounds (corner cases of the newest official code).

Where fewer tokens than a block remain, the official code drafts a SHORTER block (the anchor and the remaining
positions); a bidirectional draft's proposals depend on the block length, so the engine must do the same:
checked against ``draft_logits`` run on a block of exactly that length (no masking involved).

The mask token fills the draft's block, so it must never be mistaken for output: a draft whose
``mask_token_id`` IS a stop token, and outputs that contain the mask id, decode exactly like plain decoding
(the autoregressive baseline on the same engine, which never sees a mask token).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer, draft_logits
from dflash_jax.models.draft import shared_head
from dflash_jax.models.target import TargetModel
from engine_tiny import tiny_draft, tiny_target

BLOCK, MAX_NEW = 8, 40


@pytest.fixture(scope="module")
def setup():
    tc, tp = tiny_target()
    dc, dp = tiny_draft(block=BLOCK)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in (5, 13, 9)]
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=MAX_NEW))
    return tc, tp, dc, dp, prompts, ar


def both(setup, mask_id, stops):
    tc, tp, dc, dp, prompts, _ = setup
    settings = DecodeSettings(max_new_tokens=MAX_NEW, stop_tokens=tuple(stops))
    plain = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings)
    prop = DFlashProposer(dataclasses.replace(dc, mask_token_id=mask_id), BLOCK)
    state = prop.init(dp, shared_head(tp, False), len(prompts), 16 + MAX_NEW + BLOCK)
    return plain, generate(tc, tp, prompts, prop, state, settings)


def produced_late(ar):
    """A token of row 0's output whose first occurrence is past the first few tokens (so a stop there cuts
    the output in the middle)."""
    row = ar.tokens[0]
    return next(t for i, t in enumerate(row) if i >= 5 and t not in row[:i])


def test_mask_id_that_is_a_stop_token_the_target_never_produces(setup):
    ar = setup[-1]
    unused = next(t for t in range(setup[0].vocab_size) if all(t not in row for row in ar.tokens))
    plain, dflash = both(setup, unused, [unused])
    assert dflash.tokens == plain.tokens == ar.tokens  # the block's mask tokens stop nothing
    assert all(len(t) == MAX_NEW for t in dflash.tokens)


def test_mask_id_that_is_a_stop_token_the_target_produces(setup):
    stop = produced_late(setup[-1])
    plain, dflash = both(setup, stop, [stop])
    assert dflash.tokens == plain.tokens
    assert dflash.tokens[0][-1] == stop and len(dflash.tokens[0]) < MAX_NEW
    assert [sum(a) + 1 for a in dflash.accept_lengths] == [len(t) for t in dflash.tokens]


def test_outputs_containing_the_mask_id(setup):
    ar = setup[-1]
    mask = produced_late(ar)
    plain, dflash = both(setup, mask, [])
    assert dflash.tokens == plain.tokens == ar.tokens
    assert mask in dflash.tokens[0]


def test_the_last_rounds_draft_a_shorter_block(setup):
    """Row-by-row proposals of every round whose block would run past max_new_tokens equal the draft run on
    a block of only the remaining length, and decoding stays lossless."""
    tc, tp, dc, dp, prompts, ar = setup
    max_new = 23  # not a whole number of blocks: the last rounds have fewer than 8 positions left
    settings = DecodeSettings(max_new_tokens=max_new, record_drafts=True)
    prop = DFlashProposer(dc, BLOCK)
    out = generate(tc, tp, prompts, prop, prop.init(dp, shared_head(tp, False), len(prompts), 16 + max_new + BLOCK),
                   settings)
    assert out.tokens == [t[:max_new] for t in ar.tokens]
    shared = shared_head(tp, False)
    checked = 0
    # Jitted (one compile per shape): op by op, the loops inside this forward take seconds per call.
    target_features = jax.jit(lambda p, x, pos: TargetModel(tc).apply(
        {"params": p}, x, pos, feature_layers=dc.target_layer_ids, skip_logits=True).features)
    for b, prompt in enumerate(prompts):
        sequence = prompt + out.tokens[b]
        features = target_features(tp, jnp.asarray([sequence]), jnp.arange(len(sequence))[None])
        committed = 1  # the prefill's token
        for r, length in enumerate(out.accept_lengths[b]):
            left = max_new - committed  # tokens this round may still commit
            if left < BLOCK - 1:
                anchor = len(prompt) + committed - 1
                logits = draft_logits(dc, dp, shared, features[:, :anchor], jnp.asarray([sequence[anchor]]), left + 1)
                np.testing.assert_array_equal(out.drafts[b][r][:left], np.asarray(jnp.argmax(logits[0], -1)),
                                              err_msg=f"row {b} round {r}")
                checked += 1
            committed += length
    assert checked >= len(prompts)
