"""The thinking mode a draft was trained in is recorded at export and checked at inference: ``train fit``
writes the data's mode (regeneration settings, else data.enable_thinking) into the draft's config, and
``python -m infer`` / ``infer bench`` warn ONCE when they render prompts in the other mode. A tiny chat
template with an enable_thinking branch shows that --thinking really changes the prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_tiny import write_tiny_pair
from dflash_jax.data.regenerate import TRAINING_DATA_KEY, training_data_thinking
from dflash_jax.evaluation.thinking import draft_training_data, thinking_mismatch

THINKING_TEMPLATE = (  # the generation prompt says whether thinking is on, as Qwen3's does
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% if enable_thinking is defined and enable_thinking %}T{% endif %}{% endif %}"
)
WARNING = "warning: the draft was trained on data with thinking off"


def regeneration_dir(path: Path, thinking: bool, **extra) -> Path:
    path.mkdir(parents=True)
    settings = {"num_examples": 1, "shard_size": 1, "enable_thinking": thinking, **extra}
    (path / "regenerate.json").write_text(json.dumps(settings))
    (path / "shard-00000.jsonl").write_text('{"prompt": "a", "text": "b"}\n')
    return path


def test_training_data_thinking_follows_the_regeneration(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "a", "text": "b"}\n')
    assert training_data_thinking(str(plain), False, True) == (
        {"enable_thinking": False, "use_chat_template": True, "render_enable_thinking": False}, [])
    assert training_data_thinking([str(plain)], True, True)[0]["enable_thinking"] is True  # no settings: the config

    on = regeneration_dir(tmp_path / "on", True, chat_template_kwargs={"enable_thinking": True, "x": 1})
    meta, warnings = training_data_thinking(str(on), False, True)
    assert meta["enable_thinking"] is True and meta["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}
    assert len(warnings) == 1 and "regenerated with thinking on" in warnings[0] and "data.enable_thinking" in warnings[0]
    assert training_data_thinking(str(on), True, True)[1] == []  # rendered as generated

    off = regeneration_dir(tmp_path / "off", False)  # an engine regeneration: enable_thinking alone
    meta, warnings = training_data_thinking([str(on), str(off)], False, True)
    assert meta["enable_thinking"] is False and "chat_template_kwargs" not in meta
    assert len(warnings) == 1 and "mixes" in warnings[0]


def test_mismatch_rules():
    off = {"enable_thinking": False, "use_chat_template": True}
    assert thinking_mismatch(off, True, True) and "add" not in thinking_mismatch(off, True, True)
    assert thinking_mismatch(off, False, True) is None
    assert thinking_mismatch(off, True, False) is None  # no template renders the prompts: nothing to compare
    assert thinking_mismatch(None, True, True) is None  # a draft without the record (the released ones)
    assert "add --thinking" in thinking_mismatch({"enable_thinking": True}, False, True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny target (character tokenizer, the thinking template) and a draft exported by the trainer's
    export with the record of thinking-off data."""
    from dflash_jax.checkpoints.loading import load_draft_any
    from dflash_jax.training.trainer import export_draft

    root = tmp_path_factory.mktemp("thinking")
    target, draft = write_tiny_pair(root)
    (target / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    config, params = load_draft_any(draft)
    meta = {"enable_thinking": False, "use_chat_template": True, "render_enable_thinking": False}
    export = export_draft(root / "export", config, params, None, meta)
    return root, target, draft, export, params


def test_export_records_the_mode_and_loaders_ignore_it(pair):
    from dflash_jax.checkpoints.loading import load_draft_any

    _, _, draft, export, params = pair
    for path in (export / "draft", export / "draft-orbax"):
        assert draft_training_data(path) == {"enable_thinking": False, "use_chat_template": True,
                                             "render_enable_thinking": False}
        config, loaded = load_draft_any(path)  # the extra key changes nothing
        assert config == load_draft_any(draft)[0]
        np.testing.assert_array_equal(loaded["fc"]["kernel"], params["fc"]["kernel"])
    assert json.loads((export / "draft" / "config.json").read_text())[TRAINING_DATA_KEY]["enable_thinking"] is False
    assert draft_training_data(draft) is None


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(WARNING)]


def test_infer_warns_once_when_prompts_use_the_other_mode(pair, capsys):
    from infer.__main__ import main

    _, target, _, export, _ = pair
    base = ["--target", str(target), "--ckpt", str(export / "draft"), "--prompt", "ab", "--prompt", "cd",
            "--max-new-tokens", "2", "--json"]
    assert main([*base, "--thinking"]) == 0
    captured = capsys.readouterr()
    assert len(warnings_of(captured.err)) == 1, captured.err  # two prompts, one warning
    assert "leave out --thinking" in warnings_of(captured.err)[0]
    assert main(base) == 0  # the mode it was trained in (a draft without the record: test_mismatch_rules)
    assert warnings_of(capsys.readouterr().err) == []


def test_bench_warns_once_and_renders_thinking(pair, tmp_path, capsys):
    from infer.bench import main

    _, target, _, export, _ = pair
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "ab"}\n{"prompt": "cd"}\n')
    tokens = {}
    for thinking in (True, False):
        out = tmp_path / f"out-{thinking}"
        argv = ["--target", str(target), "--ckpt", str(export / "draft"), "--prompt-file", str(prompts),
                "--max-new-tokens", "2", "--out", str(out), *(["--thinking"] if thinking else [])]
        assert main(argv) == 0
        found = warnings_of(capsys.readouterr().err)
        assert len(found) == (1 if thinking else 0), found
        doc = json.loads((out / "results.json").read_text())
        tokens[thinking] = [r["prompt_tokens"] for r in doc["turns"]]
        assert doc["settings"]["enable_thinking"] is thinking
    # The template's thinking branch adds one character token to each generation prompt.
    assert tokens[True] == [t + 1 for t in tokens[False]]
