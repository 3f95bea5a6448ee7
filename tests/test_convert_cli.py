"""``python -m infer convert`` (``infer.convert.main``): both directions, bit exact, and clean user errors."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.hf_target import abstract_target_params, load_target, save_target
from dflash_jax.checkpoints.official_draft import load_draft
from dflash_jax.checkpoints.safetensors_io import flatten, unflatten
from dflash_jax.configs import load_pairing
from dflash_jax.models.draft_config import DraftConfig
from draft_tiny import official_config, write_official_draft
from infer.convert import EXTRA_DIR, build_parser, main

TOKENIZER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": '{"bos_token": "<s>"}',
    "special_tokens_map.json": '{"eos_token": "</s>"}',
    "generation_config.json": '{"eos_token_id": 2}',
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


def read_tensors(path) -> dict[str, np.ndarray]:
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_tensors_bit_exact(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv] + ["--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_draft")
    write_official_draft(root / "official", official_config(attention_bias=True), seed=5, dtype=ml_dtypes.bfloat16)
    return root / "official"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random HF target (the tiny-test pairing's target) with tokenizer files, written without torch."""
    root = tmp_path_factory.mktemp("cli_target")
    config = load_pairing("tiny-test").target
    rng = np.random.default_rng(0)
    flat = {path: (0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)
            for path, leaf in flatten(abstract_target_params(config)).items()}
    out = save_target(config, unflatten(flat), root / "hf")
    for name, text in TOKENIZER_FILES.items():
        (out / name).write_text(text)
    return out


# ------------------------------------------------------------------------------------------ conversions


def test_draft_official_to_orbax_to_official_is_bit_exact(draft_dir, tmp_path, capsys):
    code, out, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "orbax")
    assert code == 0, err
    assert "draft" in out and str(tmp_path / "orbax") in out
    assert orbax_io.is_orbax_dir(tmp_path / "orbax")
    meta = orbax_io.read_meta(tmp_path / "orbax")
    assert meta["kind"] == "draft"
    config, params = load_draft(draft_dir)
    assert DraftConfig.from_dict(meta["config"]) == config
    assert orbax_io.trees_equal(params, orbax_io.restore_params(tmp_path / "orbax")[0])

    code, out, err = run(capsys, "--from", tmp_path / "orbax", "--to", tmp_path / "back")
    assert code == 0, err
    assert_tensors_bit_exact(read_tensors(draft_dir), read_tensors(tmp_path / "back"))
    assert DraftConfig.from_json(tmp_path / "back") == config
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    # no temporary directories are left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "orbax"]


def test_draft_dtype_cast(draft_dir, tmp_path, capsys):
    code, _, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "orbax", "--dtype", "float32")
    assert code == 0, err
    params, _ = orbax_io.restore_params(tmp_path / "orbax")
    assert {str(a.dtype) for a in jax.tree.leaves(params)} == {"float32"}
    code, _, err = run(capsys, "--from", tmp_path / "orbax", "--to", tmp_path / "bf16", "--dtype", "bfloat16")
    assert code == 0, err
    # fp32 up-cast of bf16 values and back down is exact
    assert_tensors_bit_exact(read_tensors(draft_dir), read_tensors(tmp_path / "bf16"))


def test_target_hf_to_orbax_to_hf_keeps_tensors_and_tokenizer(target_dir, tmp_path, capsys):
    code, out, err = run(capsys, "--from", target_dir, "--to", tmp_path / "orbax")
    assert code == 0, err
    assert "target" in out
    meta = orbax_io.read_meta(tmp_path / "orbax")
    assert meta["kind"] == "target"
    for name, text in TOKENIZER_FILES.items():
        assert (tmp_path / "orbax" / EXTRA_DIR / name).read_text() == text

    code, out, err = run(capsys, "--from", tmp_path / "orbax", "--to", tmp_path / "hf")
    assert code == 0, err
    assert_tensors_bit_exact(read_tensors(target_dir), read_tensors(tmp_path / "hf"))
    for name, text in TOKENIZER_FILES.items():
        assert (tmp_path / "hf" / name).read_text() == text
    config, params = load_target(target_dir)
    config2, params2 = load_target(tmp_path / "hf")
    assert config2 == config
    assert orbax_io.trees_equal(params, params2)


def test_kind_can_be_forced_and_must_agree_with_orbax_meta(draft_dir, target_dir, tmp_path, capsys):
    code, _, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "o", "--kind", "draft")
    assert code == 0, err
    code, _, err = run(capsys, "--from", tmp_path / "o", "--to", tmp_path / "x", "--kind", "target")
    assert_user_error(code, err, "--kind target", "draft")
    # a target dir forced to be read as a draft fails cleanly (its keys carry the 'model.' prefix)
    code, _, err = run(capsys, "--from", target_dir, "--to", tmp_path / "y", "--kind", "draft")
    assert_user_error(code, err)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_existing_output_needs_force(draft_dir, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    code, _, err = run(capsys, "--from", draft_dir, "--to", dst)
    assert_user_error(code, err, str(dst), "not empty", "--force")
    assert (dst / "old.txt").exists()
    code, _, err = run(capsys, "--from", draft_dir, "--to", dst, "--force")
    assert code == 0, err
    assert not (dst / "old.txt").exists() and orbax_io.is_orbax_dir(dst)
    # an existing empty directory is fine without --force
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "--from", dst, "--to", tmp_path / "empty")
    assert code == 0, err
    assert (tmp_path / "empty" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------- errors


def test_missing_input(tmp_path, capsys):
    code, _, err = run(capsys, "--from", tmp_path / "nope", "--to", tmp_path / "out")
    assert_user_error(code, err, str(tmp_path / "nope"), "no such file or directory")
    assert not (tmp_path / "out").exists()


def test_bad_dtype_and_kind_and_missing_flags(draft_dir, tmp_path, capsys):
    code, _, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "out", "--dtype", "fp8")
    assert_user_error(code, err, "--dtype", "'fp8'", "bfloat16")
    code, _, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "out", "--kind", "tokenizer")
    assert_user_error(code, err, "--kind", "'tokenizer'")
    code, _, err = run(capsys, "--from", draft_dir)
    assert_user_error(code, err, "--to")
    code, _, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "out", "--bogus")
    assert_user_error(code, err, "--bogus")
    assert not (tmp_path / "out").exists()


def test_unrecognised_or_unreadable_inputs(draft_dir, tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    code, _, err = run(capsys, "--from", plain, "--to", tmp_path / "o1")
    assert_user_error(code, err, str(plain), "no config.json")

    code, _, err = run(capsys, "--from", draft_dir / "config.json", "--to", tmp_path / "o2")
    assert_user_error(code, err, "config.json", "directory")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(official_config()))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    code, _, err = run(capsys, "--from", pickled, "--to", tmp_path / "o3")
    assert_user_error(code, err, "pytorch_model.bin", "refused")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{oops")
    code, _, err = run(capsys, "--from", broken, "--to", tmp_path / "o4")
    assert_user_error(code, err, str(broken / "config.json"), "not valid JSON")

    bad_cfg = tmp_path / "bad_cfg"
    write_official_draft(bad_cfg, official_config(dflash_config={"target_layer_ids": [0, 2]}))
    code, _, err = run(capsys, "--from", bad_cfg, "--to", tmp_path / "o5")
    assert_user_error(code, err, "mask_token_id")

    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_damaged_orbax_inputs(draft_dir, tmp_path, capsys):
    orbax = tmp_path / "orbax"
    assert run(capsys, "--from", draft_dir, "--to", orbax)[0] == 0

    (orbax / orbax_io.META_FILE).write_text("not json")
    code, _, err = run(capsys, "--from", orbax, "--to", tmp_path / "o1")
    assert_user_error(code, err, "meta.json", "not valid JSON")

    (orbax / orbax_io.META_FILE).write_text(json.dumps({"kind": "tokenizer", "config": {}}))
    code, _, err = run(capsys, "--from", orbax, "--to", tmp_path / "o2")
    assert_user_error(code, err, "meta.json", "'tokenizer'")

    # a config that does not match the stored params (hidden size changed)
    cfg = load_draft(draft_dir)[0].to_official_dict()
    (orbax / orbax_io.META_FILE).write_text(json.dumps({"kind": "draft", "config": {**cfg, "intermediate_size": 96}}))
    code, _, err = run(capsys, "--from", orbax, "--to", tmp_path / "o3")
    assert_user_error(code, err, "params", "mlp/down_proj/kernel", "[128, 64]", "[96, 64]")

    (orbax / orbax_io.META_FILE).write_text(json.dumps({"kind": "draft", "config": cfg}))
    for f in (orbax / orbax_io.PARAMS_DIR).rglob("*"):
        if f.is_file():
            f.write_bytes(b"junk")
    code, _, err = run(capsys, "--from", orbax, "--to", tmp_path / "o4")
    assert_user_error(code, err, str(orbax))
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_output_may_not_contain_the_input(draft_dir, tmp_path, capsys):
    code, _, err = run(capsys, "--from", draft_dir, "--to", draft_dir, "--force")
    assert_user_error(code, err, "--to", "input directory")
    code, _, err = run(capsys, "--from", draft_dir, "--to", draft_dir.parent, "--force")
    assert_user_error(code, err, "--to", "input directory")
    assert (draft_dir / "model.safetensors").is_file()
    code, _, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "file.txt")
    assert code == 0, err
    (tmp_path / "a_file").write_text("x")
    code, _, err = run(capsys, "--from", draft_dir, "--to", tmp_path / "a_file")
    assert_user_error(code, err, "not a directory")


def test_help_explains_every_flag(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--from", "--to", "--kind", "--dtype", "--force", "--no-progress", "keep", "bfloat16", "auto"):
        assert flag in out
    parser = build_parser()
    for action in parser._actions:
        assert action.help, action.dest


def test_draft_round_trip_keeps_remote_code_config_and_files(tmp_path, capsys):
    """Official drafts load in their reference code through trust_remote_code: the exported directory keeps
    ``auto_map`` (and other fields we do not model) and the modeling ``*.py`` next to the weights."""
    src = tmp_path / "official"
    cfg = official_config(auto_map={"AutoModel": "dflash.DFlashDraftModel"}, transformers_version="4.57.1")
    write_official_draft(src, cfg, seed=9)
    (src / "dflash.py").write_text("# modeling code shipped with the checkpoint\n")
    assert run(capsys, "--from", src, "--to", tmp_path / "orbax")[0] == 0
    assert run(capsys, "--from", tmp_path / "orbax", "--to", tmp_path / "back")[0] == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert back["transformers_version"] == "4.57.1"
    assert back["dflash_config"] == cfg["dflash_config"] and back["architectures"] == ["DFlashDraftModel"]
    assert (tmp_path / "back" / "dflash.py").read_text() == (src / "dflash.py").read_text()
    assert DraftConfig.from_json(tmp_path / "back") == DraftConfig.from_json(src)
    assert_tensors_bit_exact(read_tensors(src), read_tensors(tmp_path / "back"))


# ------------------------------------------------------------------------------------------ never lose data


def dead_pid() -> int:
    """The pid of a process that has exited (a killed earlier run)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_output_may_not_be_the_working_directory_or_its_parent(draft_dir, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for dst in (".", "..", str(work)):
        code, _, err = run(capsys, "--from", draft_dir, "--to", dst, "--force")
        assert_user_error(code, err, "--to", "current directory")
    assert (work / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_interrupted_conversion_keeps_the_old_output(draft_dir, tmp_path, capsys, monkeypatch):
    import infer.convert as convert_cli

    dst = tmp_path / "out"
    assert run(capsys, "--from", draft_dir, "--to", dst)[0] == 0
    before = {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()}

    def interrupted(src, out, *args):  # Ctrl-C after part of the new output is written
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_cli, "from_orbax", interrupted)
    code, _, err = run(capsys, "--from", dst, "--to", tmp_path / "hf")
    assert code == 130 and "interrupted" in err
    monkeypatch.setattr(convert_cli, "to_orbax", interrupted)
    code, _, err = run(capsys, "--from", draft_dir, "--to", dst, "--force")
    assert code == 130
    after = {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    assert after == before, "the old output must survive an interrupted replacement"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no temporary folder may be left behind"


def test_leftovers_of_a_killed_run_are_repaired(draft_dir, tmp_path, capsys):
    """kill -9 can land anywhere: between the two renames the old output sits aside (put back by the next
    run), while writing the new one a partial folder is left (deleted by the next run)."""
    pid = dead_pid()
    dst = tmp_path / "out"
    assert run(capsys, "--from", draft_dir, "--to", dst)[0] == 0
    aside = tmp_path / f".out.replaced-{pid}-1"
    dst.rename(aside)  # killed after moving the old output aside, before moving the new one in
    partial = tmp_path / f".out.partial-{pid}-2"
    (partial / "out").mkdir(parents=True)
    code, _, err = run(capsys, "--from", draft_dir, "--to", dst)  # no --force: the old output is back
    assert_user_error(code, err, "not empty", "--force")
    assert orbax_io.is_orbax_dir(dst) and not aside.exists() and not partial.exists()
    code, _, err = run(capsys, "--from", draft_dir, "--to", dst, "--force")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
