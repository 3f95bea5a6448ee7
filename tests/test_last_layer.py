"""Drafts that read the target's LAST layer (SPEC section 3): the official code feeds them transformers'
final-normed ``hidden_states[-1]``, but SGLang/vLLM cannot serve them. A new draft reading it is refused by
``train fit`` unless ``draft.allow_last_layer: true``; loading and exporting one warns, and the command lines
print the warning as one ``warning: ...`` line."""

import warnings

import pytest

from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft
from dflash_jax.errors import ServingWarning
from dflash_jax.models.config import ConfigError
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.training.trainer import build_draft_config
from cli_tiny import write_tiny_pair
from draft_tiny import official_config, write_official_draft
from engine_tiny import tiny_target
from train_tiny import tiny_run_config


def test_a_new_draft_reading_the_last_layer_is_refused(tmp_path):
    tc, _ = tiny_target()  # 4 layers: layer 3 is the last
    cfg = tiny_run_config(tmp_path / "t", tmp_path / "out", draft={"target_layer_ids": [0, 3]})
    with pytest.raises(ConfigError, match=r"include the target's last layer 3.*SGLang.*draft.allow_last_layer: true"):
        build_draft_config(cfg, tc)
    allowed = tiny_run_config(tmp_path / "t", tmp_path / "out",
                              draft={"target_layer_ids": [0, 3], "allow_last_layer": True})
    with pytest.warns(ServingWarning, match="last layer 3"):
        config, _ = build_draft_config(allowed, tc)
    assert config.target_layer_ids == (0, 3) and config.reads_last_layer
    fine = tiny_run_config(tmp_path / "t", tmp_path / "out", draft={"target_layer_ids": [0, 2]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not build_draft_config(fine, tc)[0].reads_last_layer


def test_loading_and_exporting_warn(tmp_path):
    tc, _ = tiny_target()
    config = DraftConfig.from_dict(official_config(dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 5}))
    with pytest.warns(ServingWarning, match="cannot serve"):
        config.validate_against(tc, source="the draft")
    with pytest.warns(ServingWarning, match="exporting the draft"):
        save_draft(config, init_draft_params(config), tmp_path / "export")


def test_the_cli_prints_one_warning_line(tmp_path, capsys):
    from infer.run import main

    tc_dir, _ = write_tiny_pair(tmp_path)  # the tiny character-tokenizer pair the CLI tests use
    draft = tmp_path / "last-layer-draft"
    write_official_draft(draft, official_config(dflash_config={"target_layer_ids": [0, 3], "mask_token_id": 5}))
    assert main(["--target", str(tc_dir), "--ckpt", str(draft), "--prompt", "ab", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "include the target's last layer 3" in err and "Warning:" not in err


def test_a_yarn_draft_with_an_ambiguous_amplitude_is_warned(tmp_path):
    """z-lab's Kimi drafts: YaRN with mscale == mscale_all_dim and no attention_factor (1.0 here and in
    transformers, 0.1 ln(64) + 1 = 1.4159 in SGLang / vLLM-Ascend): loading the directory warns, naming the field
    and the value; a config that states attention_factor loads silently with it."""
    import json

    yarn = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 50000.0}
    for name, rope in (("ambiguous", yarn), ("stated", {**yarn, "attention_factor": 1.4158883083359672})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(official_config(rope_parameters=rope)))
    with pytest.warns(ServingWarning, match=r'mscale == mscale_all_dim.*"attention_factor": 1\.41588'):
        ambiguous = DraftConfig.from_json(tmp_path / "ambiguous")
    assert ambiguous.rope.attention_factor == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ServingWarning)
        stated = DraftConfig.from_json(tmp_path / "stated")
    assert stated.rope.attention_factor == pytest.approx(1.4158883083359672)
