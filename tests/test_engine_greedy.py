"""Greedy losslessness of the decode engine, per-row statistics and the compiled loop's HLO.

DFlash output must equal the autoregressive output token for token (same target, same engine).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine import adaptive
from dflash_jax.engine.decoder import Decoder
from dflash_jax.engine.generate import DecodeSettings, jitted_functions, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer, OracleProposer
from dflash_jax.models.draft import shared_head
from engine_tiny import padded_features, tiny_draft, tiny_target

BLOCK = 8
PROMPT_LENGTHS = (5, 13, 9)
MAX_NEW = 40


@pytest.fixture(scope="module")
def setup():
    tc, tp = tiny_target()
    dc, dp = tiny_draft(block=BLOCK)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in PROMPT_LENGTHS]
    settings = DecodeSettings(max_new_tokens=MAX_NEW, record_drafts=True)
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings)
    return tc, tp, dc, dp, prompts, settings, ar


def test_random_draft_is_lossless(setup):
    tc, tp, dc, dp, prompts, settings, ar = setup
    prop = DFlashProposer(dc, BLOCK)
    state = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), len(prompts), 16 + MAX_NEW + BLOCK)
    out = generate(tc, tp, prompts, prop, state, settings)
    assert out.tokens == ar.tokens
    assert all(len(t) == MAX_NEW for t in out.tokens)
    assert [sum(a) + 1 for a in out.accept_lengths] == [len(t) for t in out.tokens]
    # Only the loop state is donated: the caller's params are intact and reusable.
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((tp, dp)))
    assert generate(tc, tp, prompts, prop, prop.init(dp, shared_head(tp, False), len(prompts), 16 + MAX_NEW + BLOCK),
                    settings).tokens == ar.tokens


def test_streaming_in_chunks_gives_the_same_tokens(setup):
    tc, tp, dc, dp, prompts, settings, ar = setup
    seen = []
    out = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings, on_tokens=seen.append, chunk_rounds=7)
    assert out.tokens == ar.tokens
    assert len(seen) >= MAX_NEW // 7
    # Each chunk only extends what was shown before.
    for before, after in zip(seen, seen[1:]):
        assert all(a[: len(b)] == b for a, b in zip(after, before))


def recompute_acceptance(drafts: np.ndarray, tokens: list[int]) -> list[int]:
    """From the committed tokens alone: round r's acceptance is 1 + the number of its proposals that match
    the output from its first proposed position on."""
    lengths, offset = [], 1  # token 0 came from prefill
    for proposal in drafts:
        a = 0
        while a < len(proposal) and offset + a < len(tokens) and proposal[a] == tokens[offset + a]:
            a += 1
        lengths.append(min(a + 1, len(tokens) - offset))  # a round commits at most what is left
        offset += a + 1
    return lengths


def planted(schedule: list[int], max_new: int) -> list[int]:
    """The acceptance lengths a planted schedule gives: rounds commit their length until max_new_tokens cuts
    the last one (the first token came from the prefill)."""
    out, left = [], max_new - 1
    for length in schedule:
        if left <= 0:
            break
        out.append(min(length, left))
        left -= out[-1]
    return out


def oracle_run(setup, schedules, stop_tokens=(), max_new=MAX_NEW, adaptive=(), costs=()):
    """Plant errors so each row's rounds accept exactly ``schedules[row]`` (acceptance lengths)."""
    tc, tp, dc, dp, prompts, settings, ar = setup
    width = 16 + max(len(t) for t in ar.tokens) + BLOCK
    reference = np.zeros((len(prompts), width), np.int32)
    errors = np.zeros((len(prompts), width), bool)
    for b, (p, gen) in enumerate(zip(prompts, ar.tokens)):
        seq = p + gen
        reference[b, : len(seq)] = seq
        start = len(p)  # position of the first anchor
        for length in schedules[b]:
            if length < BLOCK:
                errors[b, start + length] = True
            start += length
    prop = OracleProposer(BLOCK, tc.vocab_size)
    s = DecodeSettings(max_new_tokens=max_new, stop_tokens=tuple(stop_tokens), record_drafts=True,
                       adaptive_widths=adaptive, width_costs=costs)
    return generate(tc, tp, prompts, prop, prop.init(jnp.asarray(reference), jnp.asarray(errors)), s)


SCHEDULES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 3],
    [8, 7, 6, 5, 4, 3, 2, 1, 4],
    [4, 8, 1, 8, 2, 6, 3, 7, 1, 5],
]


def test_oracle_every_acceptance_length_is_lossless(setup):
    ar = setup[-1]
    out = oracle_run(setup, SCHEDULES)
    assert out.tokens == ar.tokens
    for b, sched in enumerate(SCHEDULES):
        # The planted schedule is followed until max_new_tokens cuts the last round.
        want = planted(sched, MAX_NEW)
        assert out.accept_lengths[b][:len(want)] == want
    assert set(range(1, BLOCK + 1)) <= {a for row in out.accept_lengths for a in row}
    for b in range(len(SCHEDULES)):
        assert out.accept_lengths[b] == recompute_acceptance(out.drafts[b], out.tokens[b])


LONG = 96


@pytest.fixture(scope="module")
def long_setup(setup):
    """The same models and prompts with a longer baseline output (room for several adaptive phases)."""
    tc, tp, dc, dp, prompts, _, _ = setup
    settings = DecodeSettings(max_new_tokens=LONG, record_drafts=True)
    return tc, tp, dc, dp, prompts, settings, generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings)


def check_widths(out, ar, block=BLOCK):
    """Lossless, every round accepts at most its verify width, and width-1 rounds draft nothing."""
    assert out.tokens == ar.tokens
    for row_widths, row_accept, row_drafts in zip(out.widths, out.accept_lengths, out.drafts):
        assert len(row_widths) == len(row_accept)
        assert all(1 <= a <= w <= block for a, w in zip(row_accept, row_widths)), (row_widths, row_accept)
        assert all((w == 1) == (not d.any()) for w, d in zip(row_widths, row_drafts))


def runs_of(widths):
    """[(width, run length)] of consecutive equal widths."""
    out = []
    for w in widths:
        if out and out[-1][0] == w:
            out[-1][1] += 1
        else:
            out.append([w, 1])
    return [tuple(r) for r in out]


def test_adaptive_block_size_is_lossless_and_follows_acceptance(long_setup):
    """Adaptive widths (2, 4 and the full 8) with rounds costing 0.5 / 0.8 / 1: the opening one-round probe
    verifies the full block (the prior favours it), its rejected first draft and the run of rejections after
    it narrow the width (a round then accepts at most that width even where the proposals would have matched
    further), in whole drafting phases, and once the narrow rounds accept everything the engine goes back to
    the full block."""
    ar = long_setup[-1]
    phase = adaptive.DRAFT_PHASE
    out = oracle_run(long_setup, [[1] * (phase + 4) + [8] * 20] * 3, max_new=LONG, adaptive=(2, 4),
                     costs=(0.5, 0.8, 1.0))
    check_widths(out, ar)
    for widths, accept in zip(out.widths, out.accept_lengths):
        assert widths[0] == 8 and accept[0] == 1, (widths, accept)  # the opening probe
        assert widths[1] < 8 and accept[1] == 1, widths  # rejections of position 1: not worth the whole block
        assert all(n % phase == 0 for _, n in runs_of(widths[1:])[:-1]), widths  # whole drafting phases
        back = widths.index(8, 1)  # the full block again ...
        assert accept[back] == 8, (widths, accept)  # ... accepting all of it


def test_adaptive_autoregressive_phases_are_lossless_and_probe_again(long_setup):
    """With width 1 allowed and a round of the full block costing 3 autoregressive steps: rejected drafts
    switch to autoregressive phases (blocks of rounds with no draft forward, the recorded proposals are
    zeros; the draft's context is filed when drafting resumes). The opening one-round probe fails, so decoding
    goes autoregressive at once; probes come after 1, then 2 autoregressive phases (each failure doubles the
    gap), and once a probe is accepted, drafting comes back up to the full block. The output still equals the
    baseline."""
    ar = long_setup[-1]
    out = oracle_run(long_setup, [[1] * 24 + [8] * 12] * 3, max_new=LONG, adaptive=(1, 2, 4),
                     costs=(1 / 3, 0.5, 0.8, 1.0))
    check_widths(out, ar)
    for widths, accept in zip(out.widths, out.accept_lengths):
        runs = runs_of(widths)
        assert runs[0] == (8, 1), runs  # the opening probe fails: straight to autoregressive rounds
        assert runs[1] == (1, BLOCK) and runs[2][1] == 1 and runs[3] == (1, 2 * BLOCK), runs
        probe = 1 + 3 * BLOCK + 1  # past the rejected stretch (24 one-token rounds)
        assert widths[probe] > 1 and accept[probe] == widths[probe], (widths, accept)
        assert 8 in widths[probe + 1:] and accept[widths.index(8, probe + 1)] == 8, (widths, accept)


def test_draft_context_after_autoregressive_phases_equals_a_fresh_draft_forward(long_setup):
    """After autoregressive stretches of 1, 2 and 4 blocks (AR rounds 100x cheaper than drafting, so every
    probe fails and the gap doubles), each probe's proposals equal the draft run from scratch on the target's
    features of everything before its anchor (``draft_logits``, no caches): the context the engine files
    block by block, around the probes' own rounds, is exactly the verified text."""
    from dflash_jax.engine.proposers import draft_logits

    tc, tp, dc, dp, prompts, _, ar = long_setup
    prop = DFlashProposer(dc, BLOCK)
    shared = shared_head(tp, tc.tie_word_embeddings)
    s = DecodeSettings(max_new_tokens=LONG, record_drafts=True, adaptive_widths=(1, 4), width_costs=(0.01, 0.8, 1.0))
    out = generate(tc, tp, prompts, prop, prop.init(dp, shared, len(prompts), 16 + LONG + BLOCK), s)
    check_widths(out, ar)
    sequences = [prompt + tokens for prompt, tokens in zip(prompts, out.tokens)]
    all_features = padded_features(tc, tp, sequences, dc.target_layer_ids)
    for b, (prompt, widths) in enumerate(zip(prompts, out.widths)):
        runs = runs_of(widths)
        assert [n for w, n in runs if w == 1][:3] == [BLOCK, 2 * BLOCK, 4 * BLOCK], runs
        sequence, features = sequences[b], all_features[b : b + 1]
        offsets = np.cumsum([0] + out.accept_lengths[b])
        probes = [r for r, w in enumerate(widths) if w > 1 and r > 0]
        assert len(probes) >= 3, runs
        for r in probes:
            anchor = len(prompt) + offsets[r]
            logits = draft_logits(dc, dp, shared, features[:, :anchor], jnp.asarray([sequence[anchor]]), BLOCK)
            np.testing.assert_array_equal(out.drafts[b][r], np.asarray(jnp.argmax(logits[0], axis=-1)),
                                          err_msg=f"row {b} round {r}")


def test_adaptive_calibration_measures_every_width(setup):
    """Without given costs the compiled loop times each width on the device (the full block is 1) and the
    output is still the baseline's."""
    tc, tp, dc, dp, prompts, settings, ar = setup
    prop = DFlashProposer(dc, BLOCK)
    state = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), len(prompts), 16 + MAX_NEW + BLOCK)
    s = DecodeSettings(max_new_tokens=MAX_NEW, adaptive_widths=(1, 4))
    out = generate(tc, tp, prompts, prop, state, s)
    assert out.tokens == ar.tokens
    from dflash_jax.engine import generate as engine

    costs = [c for _, _, c, _ in engine._EXECUTABLES.values() if c is not None and len(c) == 3]
    assert costs and costs[-1][-1] == 1.0 and all(0 < c < 10 for c in costs[-1]), costs
    assert costs[-1][0] < 1.0, costs  # an autoregressive round is cheaper than a round of the block


def test_max_new_tokens_cuts_inside_a_block(setup):
    ar = setup[-1]
    # Row 0 commits 1 + (1+2+3+4) = 11 tokens after 4 rounds; round 5 would accept 5: cut it at 13.
    out = oracle_run(setup, SCHEDULES, max_new=13)
    assert [len(t) for t in out.tokens] == [13, 13, 13]
    assert out.tokens == [t[:13] for t in ar.tokens]
    assert out.accept_lengths[0] == [1, 2, 3, 4, 2]  # the cut round counts the tokens it committed


def test_stop_token_inside_an_accepted_block(setup):
    ar = setup[-1]
    # Row 1 accepts 8 tokens in its first round: outputs 1..8 come from accepted drafts. Pick a token whose
    # first occurrence in row 1's output is strictly inside that block.
    gen = ar.tokens[1]
    candidates = [i for i in range(2, 7) if gen[i] not in gen[:i]]
    assert candidates, "tiny model produced no fresh token early on; change the seed"
    cut = candidates[0]
    stop = gen[cut]
    out = oracle_run(setup, SCHEDULES, stop_tokens=[stop])
    ref = DecodeSettings(max_new_tokens=MAX_NEW, stop_tokens=(stop,))
    tc, tp, _, _, prompts, _, _ = setup
    ar_stop = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), ref)
    assert out.tokens == ar_stop.tokens
    assert out.tokens[1] == gen[: cut + 1]
    assert out.accept_lengths[1] == [cut]  # round 1 accepted 8 and committed up to the stop token (output 0
    # came from the prefill)
    for b, row in enumerate(ar.tokens):
        expected = row[: row.index(stop) + 1] if stop in row else row
        assert out.tokens[b] == expected


def test_decode_loop_has_no_full_cache_copies(setup):
    tc, tp, dc, dp, prompts, settings, _ = setup
    prop = DFlashProposer(dc, BLOCK)
    slots = 16 + MAX_NEW + BLOCK
    pre, loop = jitted_functions(tc, prop, settings, slots, jnp.float32)
    tokens = np.zeros((len(prompts), 16), np.int32)
    lengths = np.asarray(PROMPT_LENGTHS, np.int32)
    consts, state = prop.init(dp, shared_head(tp, False), len(prompts), slots)
    shape = jax.eval_shape(pre, tp, consts, state, tokens, lengths, jax.random.PRNGKey(0))
    hlo = loop.lower(tp, consts, shape, jnp.int32(0)).compile().as_text()
    assert "while" in hlo
    # Any copy whose element count equals one layer's cache (target or draft, in any axis order) is a
    # full-cache copy.
    cache_elems = len(prompts) * tc.num_key_value_heads * slots * tc.head_dim
    draft_elems = len(prompts) * dc.num_key_value_heads * slots * dc.head_dim
    copies = re.findall(r"= \w+\[([\d,]*)\][^=]*? copy(?:-start)?\(", hlo)
    sizes = [int(np.prod([int(x) for x in c.split(",") if x])) for c in copies]
    assert copies, "expected some (small) copies in the HLO; did the regex break?"
    assert cache_elems not in sizes and draft_elems not in sizes


def test_bfloat16_engine_runs_and_stays_lossless(setup):
    """Accelerators run in bf16: params, caches and activations in bf16 (softmax/norms in fp32). The tiny
    model's greedy choices are well separated, so DFlash must still reproduce the bf16 baseline exactly."""
    tc, tp, dc, dp, prompts, settings, _ = setup
    to_bf16 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)  # noqa: E731
    decoder = Decoder(tc, to_bf16(tp), dc, to_bf16(dp), BLOCK, "bfloat16")
    ar = decoder.generate(prompts, 16, baseline=True)
    df = decoder.generate(prompts, 16)
    assert df.tokens == ar.tokens and all(len(t) == 16 for t in df.tokens)


def test_prompt_checks_vocab_and_positions(setup):
    tc, tp, *_ = setup
    decoder = Decoder(tc, tp)
    with pytest.raises(ValueError, match="token id 97 outside"):
        decoder.generate([[1, 97]], 4, baseline=True)
    # 300 + 10 fits 512 positions even though the power-of-two bucket (512) alone would not.
    assert len(decoder.generate([[1] * 300], 10, baseline=True).tokens[0]) == 10
    with pytest.raises(ValueError, match="exceeds the target's 512 positions"):
        decoder.generate([[1] * 505], 10, baseline=True)


def test_a_broken_target_is_an_error_not_garbage(setup, tmp_path, capsys):
    """A NaN weight makes every logit NaN: the prefill check refuses instead of decoding garbage, through the
    library and as one error line of the CLI."""
    tc, tp, dc, dp, prompts, settings, _ = setup
    broken = jax.tree.map(lambda x: x, tp)
    broken["norm"] = {"weight": tp["norm"]["weight"].at[3].set(jnp.nan)}
    with pytest.raises(ValueError, match="logits for prompt 0 are not finite"):
        Decoder(tc, broken, dc, dp).generate([prompts[0]], 4)
    from cli_tiny import write_tiny_pair
    from dflash_jax.checkpoints.hf_target import load_target, save_target
    from infer.__main__ import main

    target, draft = write_tiny_pair(tmp_path)
    config, params = load_target(target)
    params["norm"]["weight"] = params["norm"]["weight"].at[0].set(jnp.inf)
    save_target(config, params, target)
    assert main(["--target", str(target), "--ckpt", str(draft), "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    assert "not finite (NaN or Inf)" in capsys.readouterr().err


def test_precision_policy_float32_matmuls_are_explicitly_highest(setup):
    """float32 runs set every matmul to HIGHEST (GPU TF32 / TPU bf16 passes would otherwise change greedy
    tokens against the CPU tests); bfloat16 runs leave the device default."""
    from dflash_jax.engine.generate import pad_prompts

    tc, tp, dc, dp, prompts, settings, ar = setup
    batch = pad_prompts(tc, prompts, MAX_NEW, BLOCK)
    prop = DFlashProposer(dc, BLOCK)
    for dtype, want in ((jnp.float32, True), (jnp.bfloat16, False)):
        consts, state = prop.init(dp, shared_head(tp, False), len(prompts), batch.slots)
        pre, _ = jitted_functions(tc, prop, settings, batch.slots, dtype)
        with jax.default_matmul_precision("default"):  # as on a device (conftest sets "highest" globally)
            text = pre.lower(tp, consts, state, batch.tokens, batch.lengths, jax.random.PRNGKey(0)).as_text()
        dots = re.findall(r"stablehlo\.dot_general.*", text)
        assert dots, "no matmul found in the prefill"
        assert all(("HIGHEST" in d) == want for d in dots), (dtype, dots[0])


def test_chunked_prefill_gives_the_same_tokens(setup):
    """A prompt prefilled in chunks (here 4 tokens, so the 16-wide prompts take 4 chunks, and a row's last
    prompt token falls in different chunks) gives the same tokens and rounds as a one-pass prefill."""
    import dataclasses

    tc, tp, dc, dp, prompts, settings, ar = setup
    prop = DFlashProposer(dc, BLOCK)
    slots = 16 + MAX_NEW + BLOCK
    whole = generate(tc, tp, prompts, prop, prop.init(dp, shared_head(tp, False), len(prompts), slots), settings)
    for size in (4, 5):  # 5 does not divide the 16-wide prompts: padded to 4 chunks of 5
        chunked = dataclasses.replace(settings, prefill_chunk=size)
        parts = generate(tc, tp, prompts, prop, prop.init(dp, shared_head(tp, False), len(prompts), slots), chunked)
        assert parts.tokens == whole.tokens == ar.tokens
        assert parts.accept_lengths == whole.accept_lengths
        # The draft read the prompt's features chunk by chunk: its proposals of every round are unchanged.
        assert all((a == b).all() for a, b in zip(parts.drafts, whole.drafts))
    ar_parts = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), chunked)
    assert ar_parts.tokens == ar.tokens
