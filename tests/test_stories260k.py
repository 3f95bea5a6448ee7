"""The real model: llama2.c's stories260K, converted to a Hugging Face directory and loaded by OUR loader,
reproduces llama2.c's expected greedy text byte for byte through our target model and decode engine, and
DFlash with an untrained draft (tau ~ 1) gives the identical text. Skipped when ../shared/data is absent."""

import numpy as np
import pytest

from conftest import shared_file
from dflash_jax.checkpoints.hf_target import load_target
from dflash_jax.checkpoints.llama2c import convert_llama2c
from dflash_jax.checkpoints.loading import load_tokenizer
from dflash_jax.checkpoints.official_draft import init_draft_params
from dflash_jax.engine.decoder import Decoder
from dflash_jax.models.draft_config import DraftConfig

FIRST_20 = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
BOS = 1


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    bin_path = shared_file("stories260K", "stories260K.bin")
    out = convert_llama2c(bin_path, shared_file("stories260K", "tok512.model"), tmp_path_factory.mktemp("s260k"))
    config, params = load_target(out)
    expected = shared_file("stories260K", "expected_greedy_200.txt").read_bytes()
    return out, config, params, expected


def test_greedy_200_through_our_model_matches_llama2c(stories):
    out, config, params, expected = stories
    # llama2.c's `-n 200` prints the tokens chosen at positions 0..199 after BOS: 200 new tokens.
    result = Decoder(config, params).generate([[BOS]], 200, baseline=True)
    tokens = result.tokens[0]
    assert tokens[:20] == FIRST_20
    assert len(tokens) == 200
    text = load_tokenizer(out).decode(tokens, skip_special_tokens=True)
    assert text.encode("utf-8") == expected


def test_dflash_with_untrained_draft_gives_the_same_text(stories):
    out, config, params, expected = stories
    draft = DraftConfig.for_target(config, num_layers=2, block_size=8, mask_token_id=0)
    decoder = Decoder(config, params, draft, init_draft_params(draft, seed=0))
    result = decoder.generate([[BOS], [BOS] + FIRST_20[:5]], 200)
    text = load_tokenizer(out).decode(result.tokens[0], skip_special_tokens=True)
    assert text.encode("utf-8") == expected
    assert result.tokens[1][:15] == FIRST_20[5:20]
    taus = np.concatenate([np.asarray(a) for a in result.accept_lengths])
    assert 1 <= taus.mean() < 1.5  # an untrained draft is (almost) never accepted
