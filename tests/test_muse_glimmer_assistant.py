"""Meta's DFlash drafter for Muse Glimmer (``muse_glimmer_assistant`` / ``MuseGlimmerAssistantModel``) as a draft.

The references are transformers' own: a tiny random Muse Glimmer target (``hf_tiny.make_hf_muse_glimmer``: sliding
window 4, NoPE layers) and a tiny random ``MuseGlimmerAssistantModel`` (2 layers, window 6 shorter than the
prompts and the generated text, block 4, every weight away from its init), both saved with
``save_pretrained``. transformers' native DFlash generation (``generate(..., assistant_model=...,
speculation_type="dflash")``, batch 1, greedy) is recorded round by round (its proposals and the number it
accepted) and compared with this project's engine reading the same two directories (the drafter through
``load_draft``, a batch of prompts of mixed lengths): the same committed tokens, the same proposals in every
round (the draft forward itself: features, positions, the inclusive window edge, the cache of context keys)
and the same acceptance lengths. Conversions: Meta -> DFlash layout (with the target's layer count and
vocabulary) -> Meta gives back the same tensors and settings, and transformers reads the written drafter to
the same outputs; drafts with no exact form in Meta's layout are refused naming why. ``draft.init`` of a run
config starts fine-tuning from the drafter.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from dflash_jax.checkpoints.hf_target import load_target  # noqa: E402
from dflash_jax.checkpoints.official_draft import load_draft, save_draft  # noqa: E402
from dflash_jax.engine.generate import DecodeSettings, generate  # noqa: E402
from dflash_jax.engine.proposers import DFlashProposer  # noqa: E402
from dflash_jax.models.config import ConfigError  # noqa: E402
from dflash_jax.models.draft import shared_head  # noqa: E402
from dflash_jax.models.draft_config import MUSE_ASSISTANT, DraftConfig  # noqa: E402
from draft_tiny import official_config  # noqa: E402
from hf_tiny import MUSE_VOCAB, hf_greedy, make_hf_muse_glimmer, randomise  # noqa: E402

BLOCK = 4
WINDOW = 6  # Meta's (inclusive) window: shorter than every prompt plus its continuation
MAX_NEW = 20
PROMPT_LENGTHS = (9, 14, 5)
# generate's pad id: one the prompts never hold (it masks every occurrence out of the drafter's attention)
PAD = MUSE_VOCAB - 1
ASSISTANT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, block_size=BLOCK,
                 mask_token_id=MUSE_VOCAB - 1, target_layer_ids=[0, 2], max_position_embeddings=256)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, drafter dir, transformers target, transformers drafter)."""
    root = tmp_path_factory.mktemp("muse_pair")
    target = make_hf_muse_glimmer(root / "target", seed=3)
    torch.manual_seed(4)
    drafter = randomise(transformers.MuseGlimmerAssistantModel(
        transformers.MuseGlimmerAssistantConfig(**ASSISTANT)).eval())
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter", target, drafter


def hf_dflash(target, drafter, prompt):
    """transformers' native DFlash generation of ``prompt``: its tokens, and per round the proposals and how many
    the target accepted."""
    from transformers.generation import candidate_generator

    cls = candidate_generator.DFlashTokenCandidateGenerator
    rounds, original = [], cls.get_candidates

    def recording(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw):
        if rounds:  # the previous round's acceptance, now known
            rounds[-1][1] = int(n_last_matches)
        ids, logits = original(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches,
                               **kw)
        if not is_first_iteration and ids.shape[1] > input_ids.shape[1]:
            rounds.append([ids[0, input_ids.shape[1]:].tolist(), None])
        return ids, logits

    cls.get_candidates = recording
    try:
        with torch.no_grad():
            out = target.generate(torch.tensor(prompt)[None], assistant_model=drafter, speculation_type="dflash",
                                  do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    finally:
        cls.get_candidates = original
    return out[0, len(prompt):].tolist(), rounds


@pytest.fixture(scope="module")
def ours(pair):
    """This project's engine on the same two directories: a batch of prompts of mixed lengths, proposals
    recorded."""
    target_dir, drafter_dir, _, _ = pair
    tc, tp = load_target(target_dir)
    dc, dp = load_draft(drafter_dir, dtype="float32")
    dc.validate_against(tc)
    rng = np.random.default_rng(5)
    batch = [rng.integers(0, MUSE_VOCAB - 1, n).tolist() for n in PROMPT_LENGTHS]
    proposer = DFlashProposer(dc, BLOCK)
    state = proposer.init(dp, shared_head(tp, tc.tie_word_embeddings), len(batch), 64)
    out = generate(tc, tp, batch, proposer, state, DecodeSettings(max_new_tokens=MAX_NEW, record_drafts=True))
    return batch, out


def test_the_drafter_config_reads_as_a_dflash_draft(pair):
    dc = DraftConfig.from_json(pair[1] / "config.json")
    assert dc.layout == MUSE_ASSISTANT and (dc.block_size, dc.mask_token_id, dc.target_layer_ids) == (
        BLOCK, MUSE_VOCAB - 1, (0, 2))
    # every layer bidirectional, |q - k| <= 6 (transformers' inclusive edge) is this project's strict 7
    assert dc.layer_types == ("sliding_attention",) * 2 and dc.sliding_window == WINDOW + 1
    assert dc.layer_causal == (False, False) and dc.rope.theta == 500000.0 and dc.rms_norm_eps == 1e-5
    assert (dc.num_target_layers, dc.vocab_size) == (0, 0)  # not recorded by Meta's config
    assert (dc.input_embedding_scale, dc.output_multiplier, dc.final_logit_softcapping) == (1.0, 1.0, None)


def test_native_dflash_generation_matches_round_by_round(pair, ours):
    _, _, target, drafter = pair
    batch, out = ours
    for row, prompt in enumerate(batch):
        tokens, rounds = hf_dflash(target, drafter, prompt)
        assert tokens == hf_greedy(target, prompt, MAX_NEW, PAD)  # transformers' own DFlash is lossless here
        assert out.tokens[row] == tokens
        drafts = np.asarray(out.drafts[row])
        # Rounds with the whole block: near max_new_tokens the engine drafts a shorter block (the tokens it could
        # still commit; the bidirectional draft then sees fewer mask positions), transformers the whole one.
        committed = 1 + np.cumsum([0] + out.accept_lengths[row])
        whole = [i for i, (proposals, accepted) in enumerate(rounds)
                 if accepted is not None and MAX_NEW - committed[i] + 1 >= BLOCK]
        assert len(whole) >= len(rounds) - 3 >= 8
        for i in whole:
            proposals, accepted = rounds[i]
            assert drafts[i, : BLOCK - 1].tolist() == proposals, f"row {row} round {i}"
            assert out.accept_lengths[row][i] == accepted + 1, f"row {row} round {i}"
