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

import dataclasses
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


def _tensors(directory):
    with safe_open(str(directory / "model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _convert(*argv):
    from infer import convert

    assert convert.main([*map(str, argv), "--no-progress"]) == 0


def test_conversion_to_the_dflash_layout_and_back_is_exact(pair, tmp_path):
    """Meta -> DFlash (the target's layer count and vocabulary from its config.json) -> Meta: the same tensors
    under each layout's names, the same settings (Meta's inclusive window 6 is the DFlash layout's strict 7,
    stated with is_causal false), and transformers runs the written drafter exactly as the original."""
    target_dir, drafter_dir, target, drafter = pair
    _convert("--from", drafter_dir, "--to", tmp_path / "dflash", "--layout", "dflash", "--target", target_dir)
    original, dflash = _tensors(drafter_dir), _tensors(tmp_path / "dflash")
    renamed = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    assert sorted(dflash) == sorted(renamed.get(k, k) for k in original)
    for key, value in original.items():
        np.testing.assert_array_equal(dflash[renamed.get(key, key)], value, err_msg=key)
    cfg = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["is_causal"] is False
    assert (cfg["sliding_window"], cfg["use_sliding_window"], cfg["num_target_layers"], cfg["vocab_size"]) == (
        WINDOW + 1, True, 4, MUSE_VOCAB)
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": MUSE_VOCAB - 1}
    meta = DraftConfig.from_json(drafter_dir / "config.json")
    assert DraftConfig.from_json(tmp_path / "dflash" / "config.json") == meta.with_layout(
        "dflash", load_target(target_dir)[0])

    _convert("--from", tmp_path / "dflash", "--to", tmp_path / "meta", "--layout", "muse_glimmer_assistant")
    back = _tensors(tmp_path / "meta")
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    written, given = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "meta", drafter_dir))
    for key in ("architectures", "model_type", "block_size", "mask_token_id", "target_layer_ids", "sliding_window",
                "layer_types", "rope_parameters", "rms_norm_eps", "num_key_value_heads", "head_dim"):
        assert written[key] == given[key], key
    reread = transformers.MuseGlimmerAssistantModel.from_pretrained(tmp_path / "meta").eval()
    prompt = [11, 42, 7, 250, 99, 3, 17, 88, 120, 64]
    assert hf_dflash(target, reread, prompt) == hf_dflash(target, drafter, prompt)


def test_drafts_without_an_exact_meta_form_are_refused():
    base = DraftConfig.from_dict(official_config())  # full layers, bidirectional: it has one
    assert base.with_layout(MUSE_ASSISTANT).to_official_dict()["layer_types"] == ["full_attention"] * 2
    dflash2 = official_config(architectures=["DFlash2DraftModel"], dflash_config={
        "target_layer_ids": [0, 2], "mask_token_id": 96, "conv_kernel_size": 2, "conv_group_size": 16,
        "selector_rank": 8, "selector_top_k": 4})
    causal = official_config(layer_types=["sliding_attention"] * 2, sliding_window=8)  # no is_causal: causal
    for cfg, reason in ((dflash2, "DFlash2"), (causal, "causal inside the block"),
                        (official_config(dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 96,
                                                        "output_multiplier": 0.5}), "output_multiplier"),
                        (official_config(attention_bias=True), "attention biases")):
        with pytest.raises(ConfigError, match=reason):
            DraftConfig.from_dict(cfg).with_layout(MUSE_ASSISTANT)
    windowed = DraftConfig.from_dict(official_config(layer_types=["sliding_attention"] * 2, sliding_window=8,
                                                     is_causal=False)).with_layout(MUSE_ASSISTANT)
    assert windowed.to_official_dict()["sliding_window"] == 7  # the inclusive edge


def test_meta_to_dflash_needs_the_target(pair, tmp_path):
    from infer import convert

    with pytest.raises(ConfigError, match="num_target_layers nor vocab_size"):
        DraftConfig.from_json(pair[1] / "config.json").with_layout("dflash")
    assert convert.main(["--from", str(pair[1]), "--to", str(tmp_path / "x"), "--layout", "dflash",
                         "--no-progress"]) == 2
    assert convert.main(["--from", str(pair[0]), "--to", str(tmp_path / "y"), "--layout", "dflash",
                         "--no-progress"]) == 2  # a target has no layout


def test_fine_tuning_from_the_drafter_then_transformers_runs_it(pair, tmp_path, capsys):
    """``draft.init`` with Meta's drafter directory starts from its weights in its own layout; a short run of
    the trainer's step on the target's own greedy continuations lifts its acceptance; the draft written back
    in Meta's layout runs in transformers' native DFlash generation exactly as in ``python -m infer`` (the
    same tokens and acceptance lengths in every whole-block round), now with drafts accepted."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.data.tokenize import TokenizedData
    from dflash_jax.engine.proposers import NoProposer
    from dflash_jax.models.draft import DraftModel
    from dflash_jax.models.target import TargetModel
    from dflash_jax.training.step import StepConfig, init_train_state, make_optimizer, make_train_step
    from dflash_jax.training.trainer import build_draft_config
    from cli_tiny import write_tokenizer
    from infer.__main__ import main
    from train_tiny import STEP_KW, tiny_run_config

    target_dir, drafter_dir, target, _ = pair
    tc, tp = load_target(target_dir)
    run = tiny_run_config(target_dir, tmp_path / "run")
    run["draft"].update({k: None for k in ("num_layers", "block_size", "target_layer_ids")}, init=str(drafter_dir))
    dc, dp = build_draft_config(run, tc)
    assert dc.layout == MUSE_ASSISTANT and dc == DraftConfig.from_json(drafter_dir / "config.json")
    rng = np.random.default_rng(7)
    starts = [rng.integers(0, MUSE_VOCAB - 1, 3).tolist() for _ in range(4)]
    gen = generate(tc, tp, starts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=24)).tokens
    tokens = np.asarray([s + g for s, g in zip(starts, gen)], np.int32)
    loss_mask = np.zeros(tokens.shape, bool)
    loss_mask[:, 3:] = True
    data = TokenizedData.from_padded(tokens, loss_mask, np.full(len(tokens), tokens.shape[1], np.int32))
    batch = {k: jnp.asarray(v) for k, v in data.padded_rows().items()}
    cfg = StepConfig(feature_layers=dc.target_layer_ids, **{**STEP_KW, "block_size": BLOCK,
                                                            "mask_token_id": dc.mask_token_id})
    optimizer, _ = make_optimizer(5e-3, total_steps=60, warmup_ratio=0.05)
    step = jax.jit(make_train_step(TargetModel(tc), DraftModel(dc), cfg, optimizer))
    state = init_train_state(dp, optimizer, seed=0)
    for _ in range(60):
        state, _ = step(state, tp, batch)
    save_draft(dc, jax.device_get(state.params), tmp_path / "tuned")
    tuned = transformers.MuseGlimmerAssistantModel.from_pretrained(tmp_path / "tuned").eval()
    prompt = starts[0] + gen[0][:2]
    tokens, rounds = hf_dflash(target, tuned, prompt)
    # ``python -m infer --target DIR --ckpt DRAFTDIR``, as a user would run it
    write_tokenizer(tmp_path / "tokenizer")  # it decodes the output text; ids are fed as they are
    capsys.readouterr()
    assert main(["--target", str(target_dir), "--ckpt", str(tmp_path / "tuned"), "--tokenizer",
                 str(tmp_path / "tokenizer"), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                 str(MAX_NEW), "--json", "--no-compile-cache"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["tokens"] == tokens == hf_greedy(target, prompt, MAX_NEW, PAD)
    committed = 1 + np.cumsum([0] + row["accept_lengths"])
    whole = [i for i, (_, accepted) in enumerate(rounds)
             if accepted is not None and MAX_NEW - committed[i] + 1 >= BLOCK]
    assert len(whole) >= 3
    assert [row["accept_lengths"][i] for i in whole] == [rounds[i][1] + 1 for i in whole]
    tau = float(np.mean(row["accept_lengths"]))
    print(f"fine-tuned Meta drafter: tau {tau:.2f}")
    assert tau > 1.5


def test_the_released_pairings_have_the_released_shapes():
    """configs/: Muse-Glimmer-30B with Meta's drafter and with z-lab's DFlash2 draft. The drafter's tensors, named
    and shaped as Meta's checkpoint stores them (SPEC 11.2a), and a text decoder of about 28B parameters."""
    from dflash_jax.checkpoints.hf_target import abstract_target_params
    from dflash_jax.checkpoints.official_draft import abstract_draft_params, key_map
    from dflash_jax.checkpoints.safetensors_io import flatten, param_path_to_key
    from dflash_jax.configs import load_pairing

    meta = load_pairing("muse-glimmer-30b-assistant-b16")
    stored = {}
    for path, leaf in flatten(abstract_draft_params(meta.draft)).items():
        stored[key_map(meta.draft)(path)] = leaf.shape[::-1] if param_path_to_key(path)[1] else leaf.shape
    assert stored["encoder.fc.weight"] == (6656, 33280) and stored["encoder.output_norm_enc.weight"] == (6656,)
    assert stored["layers.4.self_attn.q_proj.weight"] == (4096, 6656)
    assert stored["layers.4.self_attn.k_proj.weight"] == (1024, 6656)
    assert stored["layers.4.self_attn.k_norm.weight"] == (128,) and stored["norm.weight"] == (6656,)
    assert stored["layers.0.mlp.down_proj.weight"] == (6656, 19968) and len(stored) == 2 + 11 * 5 + 1
    assert meta.draft.sliding_window == 2049 and not any(meta.draft.layer_causal)
    target = meta.target
    n = sum(int(np.prod(leaf.shape)) for leaf in flatten(abstract_target_params(target)).values())
    assert 27.5e9 < n < 28.5e9 and target.nope_layers == tuple(range(3, 52, 4))
    assert target.layer_windows.count(None) == 13 and set(target.layer_windows) == {2048, None}
    zlab = load_pairing("muse-glimmer-30b-dflash2-b16")
    assert zlab.target == target and zlab.draft.dflash2 and zlab.draft.block_size == 16
    assert (zlab.draft.output_multiplier, zlab.draft.final_logit_softcapping) == (target.output_multiplier, 20.0)


@pytest.mark.parametrize("key", ["encoder.output_norm_enc.weight", "encoder.fc.weight",
                                 "layers.1.self_attn.k_norm.weight"])
def test_a_drafter_missing_a_tensor_names_file_and_key(pair, key, tmp_path):
    from safetensors.numpy import save_file

    from dflash_jax.checkpoints.safetensors_io import CheckpointError

    (tmp_path / "config.json").write_text((pair[1] / "config.json").read_text())
    save_file({k: v for k, v in _tensors(pair[1]).items() if k != key}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_draft(tmp_path)


def test_drafter_configs_it_cannot_read_are_refused(pair):
    given = json.loads((pair[1] / "config.json").read_text())
    for change, field in (({"dflash_config": {"block_size": 4}}, "dflash_config"),
                          ({"sliding_window": 0}, "sliding_window"), ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"layer_types": ["sliding_attention"]}, "layer_types")):
        with pytest.raises(ConfigError, match=field):
            DraftConfig.from_dict({**given, **change}, "drafter/config.json")


def test_the_drafter_grows_into_a_dflash2_draft_that_starts_where_it_was(pair):
    """``draft.init`` = Meta's drafter with ``draft.architecture: dflash2`` (how z-lab's Muse-Glimmer-30B-DFlash2
    began): the same weights plus identity block convolutions and a selector whose pair scores start at zero;
    its first forward gives the drafter's logits and its selector walk the drafter's greedy proposals."""
    import jax.numpy as jnp

    from dflash_jax.models.draft import DraftModel, init_draft_cache
    from dflash_jax.training.trainer import build_draft_config
    from train_tiny import tiny_run_config

    target_dir, drafter_dir, _, _ = pair
    tc, tp = load_target(target_dir)
    run = tiny_run_config(target_dir, pair[1].parent / "grow", draft={
        "num_layers": None, "block_size": None, "target_layer_ids": None, "init": str(drafter_dir),
        "architecture": "dflash2", "selector_top_k": 4, "selector_rank": 8})
    grown, gp = build_draft_config(run, tc)
    meta, mp = load_draft(drafter_dir, dtype="float32")
    assert grown.dflash2 and grown.layout == "dflash" and grown.selector_top_k == 4
    assert dataclasses.replace(grown, conv_kernel_size=None, conv_group_size=None, selector_rank=None,
                               selector_top_k=None) == meta.with_layout("dflash", tc)
    rng = np.random.default_rng(9)
    feats = jnp.asarray(rng.normal(size=(2, 11, 2 * 64)), jnp.float32)
    block = jnp.asarray([[5] + [MUSE_VOCAB - 1] * (BLOCK - 1)] * 2)
    shared = shared_head(tp, tc.tie_word_embeddings)
    args = (block, jnp.arange(11, 11 + BLOCK)[None].repeat(2, 0), feats, jnp.arange(11)[None].repeat(2, 0),
            jnp.ones((2, 11), bool))
    a = DraftModel(meta).apply({"params": mp}, *args, init_draft_cache(meta, 2, 32), shared)
    b = DraftModel(grown).apply({"params": gp}, *args, init_draft_cache(grown, 2, 32), shared)
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), atol=1e-5, rtol=1e-5)
    chain = DraftModel(grown).apply({"params": gp}, b.logits[:, 1:], b.hidden[:, 1:], block[:, 0],
                                    method=DraftModel.select)
    tokens = chain[0] if isinstance(chain, tuple) else chain
    assert np.asarray(tokens).tolist() == np.asarray(a.logits[:, 1:]).argmax(-1).tolist()
