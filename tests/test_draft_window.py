"""The draft's bounded context: ring caches for sliding layers and ``--draft-window`` (issue: long context).

A layer that sees only the last ``bound`` context positions keeps them in a ring of ``bound`` slots. Checked
against the float64 NumPy reference (tests/reference_draft_numpy.py, which never heard of rings: it attends
over the whole context with the window rule): context written round by round in uneven pieces of a batch
whose rows have different lengths, and a long prefill that wraps the ring several times in ONE write, at
``1e-5 * max(1, max |logit|)``. ``draft_window`` N on full layers is the reference's bidirectional sliding
window of N (a block of B <= N keeps its whole block). In the engine: tokens equal plain decoding, and a window
at least as large as the cache changes nothing (same proposals, same acceptance lengths).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.checkpoints.official_draft import load_draft
from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer
from dflash_jax.errors import UserError
from dflash_jax.models.draft import DraftModel, SharedHead, context_cache_sizes, init_draft_cache, shared_head
from draft_tiny import HIDDEN, VOCAB, official_config, write_official_draft
from engine_tiny import tiny_draft, tiny_target
from reference_draft_numpy import draft_forward_reference

B, SLOTS = 8, 64
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)


@pytest.fixture(scope="module", params=["sliding", "draft_window"])
def bundle(request, tmp_path_factory):
    cfg = official_config(**(SLIDING if request.param == "sliding" else {}))
    path = tmp_path_factory.mktemp("window") / request.param
    weights = write_official_draft(path, cfg, seed=5)
    config, params = load_draft(path)
    window = None if request.param == "sliding" else 9
    # What the reference computes: the sliding config as it is; a draft window as every layer sliding by 9,
    # bidirectional (the block's own 8 keys all lie inside 9).
    ref_cfg = cfg if window is None else {**cfg, "layer_types": ["sliding_attention"] * 2, "sliding_window": window,
                                          "is_causal": False}
    rng = np.random.default_rng(7)
    embed = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    head = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    shared = SharedHead(jnp.asarray(embed), jnp.asarray(head.T))
    ref = lambda ctx, blk, start: draft_forward_reference(weights, ref_cfg, embed, head, ctx, blk, start)  # noqa
    return config, params, DraftModel(config, draft_window=window), shared, ref, window


def assert_close(got, want):
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= 1e-5 * max(1.0, np.abs(want).max()), err


def test_cache_sizes():
    sliding = tiny_draft()[0].__class__.from_dict(official_config(**SLIDING))
    assert context_cache_sizes(sliding, SLOTS) == (5, SLOTS)  # the sliding layer keeps a ring of its window
    assert context_cache_sizes(sliding, SLOTS, draft_window=3) == (3, 3)
    assert context_cache_sizes(sliding, 4, draft_window=30) == (4, 4)  # never more than the cache itself
    with pytest.raises(UserError, match="draft window must be a positive"):
        DFlashProposer(sliding, B, draft_window=0)


def test_ring_written_round_by_round_equals_reference(bundle):
    """Two rows of different lengths, context in uneven pieces (as accepted tokens arrive), a draft after every
    piece: the ring wraps many times while each row's block sees exactly its window."""
    config, params, model, shared, ref, _ = bundle
    rng = np.random.default_rng(0)
    pieces = [(7, 3), (1, 8), (4, 2), (8, 8), (3, 5), (6, 1)]
    total = np.sum(pieces, axis=0)
    feats = rng.standard_normal((2, int(total.max()), 2 * HIDDEN)).astype(np.float32)
    apply = jax.jit(model.apply)
    cache = init_draft_cache(config, 2, SLOTS, draft_window=model.draft_window)
    assert min(k.shape[2] for k in cache.keys) < 10  # a real ring
    start = np.zeros(2, np.int32)
    for piece in pieces:
        n = np.asarray(piece)
        ctx = np.zeros((2, B, 2 * HIDDEN), np.float32)
        for r in range(2):
            ctx[r, :n[r]] = feats[r, start[r]:start[r] + n[r]]
        ctx_pos = start[:, None] + np.arange(B, dtype=np.int32)[None]
        blk = np.full((2, B), config.mask_token_id, np.int32)
        blk[:, 0] = rng.integers(0, VOCAB - 1, 2)
        anchor = start + n
        out = apply({"params": params}, blk, anchor[:, None] + np.arange(B, dtype=np.int32)[None], ctx, ctx_pos,
                    np.arange(B)[None] < n[:, None], cache, shared)
        cache = out.cache
        start = anchor
        for r in range(2):
            assert_close(out.logits[r], ref(feats[r, :start[r]], blk[r], int(start[r])))


def test_long_prefill_wraps_the_ring_in_one_write(bundle):
    config, params, model, shared, ref, _ = bundle
    rng = np.random.default_rng(1)
    t = 37  # one write of 37 positions into rings of 5 or 9 slots
    feats = rng.standard_normal((1, t, 2 * HIDDEN)).astype(np.float32)
    blk = np.full((1, B), config.mask_token_id, np.int32)
    blk[0, 0] = 3
    cache = init_draft_cache(config, 1, SLOTS, draft_window=model.draft_window)
    out = model.apply({"params": params}, blk, t + np.arange(B, dtype=np.int32)[None], feats,
                      np.arange(t, dtype=np.int32)[None], np.ones((1, t), bool), cache, shared)
    assert_close(out.logits[0], ref(feats[0], blk[0], t))


@pytest.fixture(scope="module")
def engine():
    tc, tp = tiny_target()
    dc, dp = tiny_draft(block=B)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in (5, 30, 12)]
    settings = DecodeSettings(max_new_tokens=40, record_drafts=True)
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings)

    def run(window):
        prop = DFlashProposer(dc, B, draft_window=window)
        slots = 32 + 40 + B
        return generate(tc, tp, prompts, prop, prop.init(dp, shared_head(tp, False), len(prompts), slots), settings)

    return ar, run


def test_engine_with_a_draft_window_is_lossless(engine):
    ar, run = engine
    small = run(6)
    assert small.tokens == ar.tokens


def test_a_window_larger_than_the_context_changes_nothing(engine):
    """75 > the longest context (30 + 40 tokens) but < the 80 cache slots: rings of 75 slots that never wrap."""
    ar, run = engine
    plain, wide = run(None), run(75)
    assert wide.tokens == plain.tokens == ar.tokens
    assert wide.accept_lengths == plain.accept_lengths
    for a, b in zip(wide.drafts, plain.drafts):
        np.testing.assert_array_equal(a, b)
