"""``python -m train fit`` end to end on the tiny target: resume after SIGKILL is bit-identical, two
processes with ``jax.distributed`` match one, SIGTERM saves and stops, and bad input is one error line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from cli_tiny import write_tiny_pair
from conftest import FAST_COMPILE_ENV, free_port
from train.__main__ import main as train_main
from train_tiny import write_text_rows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    target_dir, _ = write_tiny_pair(root)
    train_file = write_text_rows(root / "train.jsonl", rows=40)
    raw = {"target": {"path": str(target_dir)}, "data": {"train": str(train_file), "max_length": 48},
           "draft": {"num_layers": 2, "block_size": 8, "target_layer_ids": [0, 2]},
           "train": {"epochs": 3, "global_batch": 4, "num_anchors": 6, "anchor_chunk": 4},
           "output": {"dir": str(root / "run"), "log_every": 5, "save_every": 2}}
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    return root, config, raw


def fit_cmd(config: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "fit", "--config", str(config), "--no-progress",
            "--set", f"output.dir={out}", *extra]


def fit_env(root: Path) -> dict:
    """The environment of a ``train fit`` subprocess: the module's own persistent compile cache (the command
    line keeps one by default; tests/conftest.py turns the user's off), so that every run after the first
    loads the train step instead of compiling it again (~8 s a run of the ~30 s). A program that compiles
    differently (another shape or sharding) has another key and is compiled as ever."""
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
            "DFLASH_JAX_COMPILE_CACHE": str(root / "xla"), **FAST_COMPILE_ENV}


def run(cmd, root: Path, timeout=300, **kw):
    return subprocess.run(cmd, cwd=REPO, env=fit_env(root), capture_output=True, text=True, timeout=timeout, **kw)


def exported(out: Path) -> dict:
    return load_file(str(out / "export" / "draft" / "model.safetensors"))


def test_sigkill_mid_training_then_resume_is_bit_identical(tiny):
    root, config, _ = tiny
    full = run(fit_cmd(config, root / "full"), root)
    assert full.returncode == 0, full.stderr[-2000:]
    assert "step 30:" in full.stdout
    # The data's thinking mode (plain rows, data.enable_thinking false) is recorded for infer's check.
    exported_config = json.loads((root / "full" / "export" / "draft" / "config.json").read_text())
    assert exported_config["dflash_training_data"] == {"enable_thinking": False, "use_chat_template": True,
                                              "render_enable_thinking": False}

    killed_out = root / "killed"
    proc = subprocess.Popen(fit_cmd(config, killed_out), cwd=REPO, env=fit_env(root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not (killed_out / "checkpoints" / "6").is_dir():
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed_out / "export").exists(), "killed before the end: nothing exported yet"

    resumed = run(fit_cmd(config, killed_out), root)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    a, b = exported(root / "full"), exported(killed_out)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


def test_resume_under_changed_settings_is_refused(tiny):
    root, config, _ = tiny
    out = root / "refuse"
    first = run(fit_cmd(config, out, "--set", "train.max_steps=2"), root)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run(fit_cmd(config, out, "--set", "train.max_steps=2", "--set", "train.num_anchors=5"), root)
    assert again.returncode == 2
    err = again.stderr.strip().splitlines()[-1]
    assert err.startswith("error:") and "num_anchors: 6 -> 5" in err and str(out) in err



def test_two_processes_match_one(tiny):
    """Two local processes (jax.distributed, localhost coordinator, one CPU device each, data=2) run 3 steps
    on the same global batches as one process. Tolerance 1e-6 on the params (measured ~1e-7). The real tau
    of the exported draft (a decode on the run's mesh, every process taking part) equals one process's."""
    root, config, _ = tiny
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **FAST_COMPILE_ENV}
    out_multi, out_single = root / "multi", root / "single"
    prompts = root / "eval_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc de", "ja bi gc", "hh")))
    evals = ("--set", f"data.eval_prompts={prompts}", "--set", "output.eval_max_new_tokens=12")
    port = free_port()
    procs = [subprocess.Popen(fit_cmd(config, out_multi, "--set", "train.max_steps=3", *evals, "--coordinator",
                                      f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert "over 2 cpu device(s), 2 process(es)" in outs[0][0]
    single = run(fit_cmd(config, out_single, "--set", "train.max_steps=3", *evals), root)
    assert single.returncode == 0, single.stderr[-2000:]
    a, b = exported(out_multi), exported(out_single)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-6, rtol=0, err_msg=k)

    def last(out: Path, key: str) -> float:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r[key] for r in rows if key in r][-1]

    assert last(out_multi, "loss") == pytest.approx(last(out_single, "loss"), rel=1e-6)
    assert 1.0 <= last(out_single, "eval_tau") <= 8.0
    assert last(out_multi, "eval_tau") == last(out_single, "eval_tau")


def test_sigterm_saves_a_checkpoint_and_stops(tiny):
    root, config, _ = tiny
    out = root / "term"
    proc = subprocess.Popen(fit_cmd(config, out, "--set", "output.save_every=1000"), cwd=REPO, env=fit_env(root),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "metrics.jsonl").is_file():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert "SIGTERM: saved step" in stdout
    steps = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps and max(steps) < 30 and not (out / "export").exists()


def error_of(capsys, argv) -> str:
    assert train_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: "), lines
    return lines[-1]


def test_bad_input_is_one_error_line(tiny, tmp_path, capsys):
    root, config, raw = tiny
    base = ["fit", "--config", str(config), "--no-progress", "--set", f"output.dir={tmp_path / 'o'}"]

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**raw, "train": {**raw["train"], "learning_rat": 1e-3}}))
    assert "unknown key train.learning_rat" in error_of(capsys, ["fit", "--config", str(bad)])
    assert "unknown key draft.layers" in error_of(capsys, base + ["--set", "draft.layers=3"])
    assert "train.global_batch must be positive" in error_of(capsys, base + ["--set", "train.global_batch=0"])
    msg = error_of(capsys, base + ["--set", "draft.target_layer_ids=[0, 9]"])
    assert "target_layer_ids contains 9" in msg
    assert "mask_token_id 500" in error_of(capsys, base + ["--set", "draft.mask_token_id=500"])
    assert "needs 3 devices, but 1 are available" in error_of(capsys, base + ["--set", "mesh.data=3"])
    missing = error_of(capsys, base + ["--set", f"data.train={tmp_path / 'nope.jsonl'}"])
    assert "nope.jsonl" in missing
    empty = tmp_path / "prompts_only.jsonl"
    empty.write_text(json.dumps({"prompt": "abc"}) + "\n")
    assert "prompts_only.jsonl" in error_of(capsys, base + ["--set", f"data.train={empty}"])
    assert "has a token to train on" in error_of(capsys, base + ["--set", "data.max_length=2"])
    assert "output.export_dtype must be" in error_of(capsys, base + ["--set", "output.export_dtype=int8"])
    assert "train.seed must be below 2**32" in error_of(capsys, base + ["--set", "train.seed=4294967296"])
    assert "must be a finite number" in error_of(capsys, base + ["--set", "train.learning_rate=.inf"])
    assert "target.experts must be dequantize or packed" in error_of(capsys, base + ["--set", "target.experts=int4"])
    assert "has no experts" in error_of(capsys, base + ["--set", "target.mxfp4=packed"])  # the older name
    assert "target.mxfp4 must be dequantize or packed" in error_of(capsys, base + ["--set", "target.mxfp4=int4"])
    assert "give one of them" in error_of(capsys, base + ["--set", "target.mxfp4=packed", "--set",
                                                          "target.experts=packed"])
    init = error_of(capsys, base + ["--set", f"draft.init={root / 'draft'}"])
    assert "cannot be combined with draft.init" in init and "draft.num_layers" in init
    long_eval = tmp_path / "long.jsonl"
    long_eval.write_text(json.dumps({"prompt": "a" * 600}) + "\n")
    msg = error_of(capsys, base + ["--set", f"data.eval_prompts={long_eval}"])
    assert "data.eval_prompts" in msg and "max_position_embeddings" in msg


def test_unreadable_latest_checkpoint_falls_back_to_the_previous(tiny, recwarn):
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.trainer import fit

    root, config, _ = tiny
    out = root / "fallback"
    cfg = load_run_config(config, [f"output.dir={out}", "train.max_steps=6", "output.save_every=2"])
    assert fit(cfg, progress=False, log=lambda _: None).steps == 6
    first = exported(out)
    for f in (out / "checkpoints" / "6" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0garbage")
    logs = []
    assert fit(cfg, progress=False, log=logs.append).steps == 6
    assert any("resumed" in line and "step 4" in line for line in logs), logs
    messages = [str(w.message) for w in recwarn.list]
    assert any("step 6 is unreadable" in m and "falling back to step 4" in m for m in messages), messages
    again = exported(out)
    assert all(first[k].tobytes() == again[k].tobytes() for k in first), "steps 5-6 redone identically"


def test_shipped_run_configs_parse():
    from dflash_jax.training.run_config import load_run_config

    shipped = sorted((REPO / "configs" / "runs").glob("*.yaml"))
    assert shipped
    for path in shipped:
        cfg = load_run_config(path)
        if cfg["draft"]["init"]:  # a fine-tune: the block size is the initial draft's
            assert cfg["draft"]["block_size"] is None, path
        else:
            assert cfg["draft"]["block_size"] in ((7,) if cfg["draft"]["architecture"] == "dspark" else (8, 10, 16)), path


def test_train_speed_reports_the_targets_share(tiny, capsys):
    root, config, _ = tiny
    assert train_main(["speed", "--config", str(config), "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 2 and out["step_s"] > out["target_features_s"] > 0
    assert 0 < out["target_share"] < 1 and out["tokens_per_s"] > 0
    assert out["draft_params"] > 0 and out["target_params"] > 0


def test_train_speed_compares_variants_side_by_side(tiny, capsys):
    root, config, _ = tiny
    assert train_main(["speed", "--config", str(config), "--steps", "2", "--json",
                       "--compare", "kl:train.loss=kl", "--compare", "more:train.num_anchors=12;train.anchor_chunk=12"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["as configured", "kl", "more"] and out["as configured"]["ratio"] == 1.0
    assert all(r["step_s"] > 0 for r in out.values())
    assert train_main(["speed", "--config", str(config), "--compare", "broken"]) == 2
    assert "expected NAME:KEY=VALUE" in capsys.readouterr().err


def test_drop_unfinished_leaves_out_cut_answers(tiny, tmp_path):
    """data.drop_unfinished: rows a regeneration marked "finished": false are not trained on (and counted)."""
    from dflash_jax.checkpoints.loading import load_tokenizer
    from dflash_jax.training.run_config import parse_run_config
    from dflash_jax.training.trainer import read_training_data

    _, _, raw = tiny
    rows = tmp_path / "regenerated.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "ab", "text": text, "finished": finished}) + "\n" for text, finished
                            in (("cab dab", True), ("cut off", False), ("bad ace", True), ("no flag", None))))
    tokenizer = load_tokenizer(raw["target"]["path"])
    for drop, kept in ((False, 4), (True, 3)):
        cfg = parse_run_config({**raw, "data": {**raw["data"], "train": str(rows), "drop_unfinished": drop}})
        logs = []
        data = read_training_data(cfg, tokenizer, logs.append, progress=False)
        assert len(data) == kept
        assert ("1 unfinished left out" in logs[0]) == drop, logs


def test_a_new_dflash2_draft_trains_its_selector(tiny):
    """``draft.architecture: dflash2`` with the KL loss and D-PACE: the selector's loss falls over a short run,
    its metrics are logged, and the export is a DFlash2 draft in the official layout (codebooks included)."""
    from dflash_jax.checkpoints.official_draft import load_draft
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.trainer import fit

    root, config, _ = tiny
    out = root / "dflash2"
    cfg = load_run_config(config, [f"output.dir={out}", "train.max_steps=20", "output.log_every=1",
                                   "draft.architecture=dflash2", "draft.conv_group_size=16", "draft.selector_rank=8",
                                   "draft.selector_top_k=4", "train.loss=ce+kl", "train.position_weights=dpace",
                                   "train.learning_rate=0.003"])
    result = fit(cfg, progress=False, log=lambda _: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["selector_loss"] for r in rows if "selector_loss" in r]
    assert len(losses) >= 10 and all(k in rows[-1] for k in ("head_accuracy", "ce", "kl"))
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    config2, params = load_draft(result.export_dir / "draft")
    assert config2.dflash2 and config2.selector_top_k == 4
    assert params["candidate_selector"]["successor_codebook"].shape == (config2.vocab_size, 8)
    assert json.loads((result.export_dir / "draft" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]


def test_a_new_dspark_draft_trains_and_exports_in_deepspecs_layout(tiny):
    """``draft.architecture: dspark``: DeepSpec's loss falls over a short run (its terms and the expected
    acceptance logged), and the export is a ``Qwen3DSparkModel`` checkpoint holding the target's embedding and
    head, which loads back and decodes identically to the baseline."""
    from dflash_jax.checkpoints.loading import load_target_any
    from dflash_jax.checkpoints.official_draft import load_draft
    from dflash_jax.engine.decoder import Decoder
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.trainer import fit

    root, config, _ = tiny
    out = root / "dspark"
    cfg = load_run_config(config, [f"output.dir={out}", "train.max_steps=20", "output.log_every=1",
                                   "draft.architecture=dspark", "draft.block_size=5", "draft.markov_rank=8",
                                   "train.learning_rate=0.003"])
    result = fit(cfg, progress=False, log=lambda _: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and "l1" in r]
    assert len(losses) >= 10 and all(k in rows[-1] for k in ("ce", "l1", "confidence_loss",
                                                             "expected_acceptance_length"))
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses  # measured 2.82 -> 2.29 in 20 steps
    draft_dir = result.export_dir / "draft"
    written = json.loads((draft_dir / "config.json").read_text())
    assert written["architectures"] == ["Qwen3DSparkModel"] and written["markov_rank"] == 8
    assert written["block_size"] == 5 and written["enable_confidence_head"] is True
    tensors = exported(out)
    assert {"embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight",
            "confidence_head.proj.weight"} <= set(tensors)
    tc, tp = load_target_any(cfg["target"]["path"])
    dc, dp = load_draft(draft_dir)
    decoder = Decoder(tc, tp, dc, dp)
    assert decoder.head_source == "shared"
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    assert decoder.generate(prompts, 12).tokens == decoder.generate(prompts, 12, baseline=True).tokens
