"""``python -m infer speed`` end to end on the tiny preset (timings are measured and printed, never asserted)."""

import json
import os

import numpy as np
import pytest

from dflash_jax.errors import UserError

from dflash_jax.evaluation.speed import plant_errors, run_e2e
from infer.speed import main

TAU, BLOCK, NEW, BATCH = 3, 4, 12, 2
COMPONENTS = ("ar_step", "verify", "draft", "round", "ar_round", "draft_window", "round_window")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import contextlib
    import io

    path = tmp_path_factory.mktemp("speed") / "speed.json"
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        rc = main(["--preset", "tiny", "--batch", str(BATCH), "--block-size", str(BLOCK), "--context", "8",
                   "--new-tokens", str(NEW), "--tau", str(TAU), "--repeats", "2", "--adaptive", "1,2",
                   "--draft-window", "4", "--json", str(path)])
    assert rc == 0
    return {**json.loads(path.read_text()), "stderr": log.getvalue()}


def test_every_timing_is_positive(report):
    for name in COMPONENTS:
        t = report["timings"][name]
        assert len(t["times_ms"]) == 2 and all(x > 0 for x in t["times_ms"]), name
        assert t["median_ms"] > 0 and t["min_ms"] > 0 and t["compile_s"] > 0, name
    for mode in ("autoregressive", "oracle", "draft"):
        e = report["e2e"][mode]
        assert e["decode_s"] > 0 and e["tokens_per_s"] > 0 and e["speedup"] > 0, mode
        assert e["decoded_tokens"] == BATCH * (NEW - 1), mode
    for value in report["bounds"].values():
        assert value > 0
    assert report["e2e"]["oracle"]["bound"] > 0 and report["e2e"]["draft"]["bound"] > 0


def test_component_figures_are_logged_before_the_end_to_end_runs(report):
    """A run stopped during its end-to-end decodes (a device lent for minutes) has already printed them."""
    lines = report["stderr"].splitlines()
    at = next(i for i, line in enumerate(lines) if "components, median ms:" in line)
    assert at < next(i for i, line in enumerate(lines) if "end to end" in line)
    logged = dict(part.split() for part in lines[at].split("median ms: ")[1].split(", "))
    for name, value in logged.items():
        assert float(value) == pytest.approx(report["timings"][name]["median_ms"], abs=1e-3), name


def test_oracle_accepts_exactly_tau_and_outputs_match(report):
    oracle = report["e2e"]["oracle"]
    for row in oracle["accept_lengths"]:
        # Every round accepts tau - 1 planted-correct drafts + the bonus; only the last may be cut short by
        # max_new_tokens (its recorded length is still the accepted length, at most tau).
        assert row[:-1] == [TAU] * (len(row) - 1)
        assert 1 <= row[-1] <= TAU
        assert sum(row) >= NEW - 1 > sum(row[:-1])
    assert oracle["identical_to_ar"] and oracle["mismatch"] is None
    assert report["e2e"]["draft"]["identical_to_ar"]
    assert all(d["repeat_mismatch"] is None for d in report["e2e"].values())
    assert report["e2e"]["autoregressive"]["tokens_per_round"] == 1.0


def test_adaptive_modes_are_lossless_and_report_their_widths(report):
    assert report["settings"]["adaptive_widths"] == [1, 2]
    for mode in ("oracle_adaptive", "draft_adaptive"):
        e = report["e2e"][mode]
        assert e["identical_to_ar"] and e["decoded_tokens"] == BATCH * (NEW - 1), mode
        assert set(e["widths"]) <= {"1", "2", str(BLOCK)} and sum(e["widths"].values()) == e["rounds"], e["widths"]
        assert all(a <= TAU for row in e["accept_lengths"] for a in row), mode


def test_sharded_speed_run_on_fake_devices(tmp_path):
    """``--cpu-devices 2 --mesh tensor=2`` in a fresh process (the device count is fixed at start-up)."""
    import subprocess
    import sys

    path = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, "-m", "infer", "speed", "--preset", "tiny", "--block-size", str(BLOCK), "--context", "8",
         "--new-tokens", "6", "--tau", "2", "--repeats", "1", "--cpu-devices", "2", "--mesh", "tensor=2",
         "--json", str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(path.read_text())
    assert report["settings"]["mesh"]["tensor"] == 2
    assert report["machine"]["num_devices"] == 2
    assert all(report["e2e"][m]["identical_to_ar"] for m in ("oracle", "draft"))
    assert "sharded over the mesh" in proc.stdout


def test_report_records_settings_and_machine(report):
    s = report["settings"]
    assert (s["tau"], s["block_size"], s["batch"], s["dtype"]) == (TAU, BLOCK, BATCH, "float32")
    assert report["machine"]["backend"] == "cpu" and report["machine"]["jax"]


def test_plant_errors_every_tau_positions():
    ref, err = plant_errors([[5, 6]], [[7, 8, 9, 10, 11]], tau=2, block=4, width=10)
    assert ref[0, :7].tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert np.flatnonzero(err[0]).tolist() == [4, 6, 8]  # first anchor at position 2
    _, none = plant_errors([[5, 6]], [[7, 8]], tau=4, block=4, width=10)
    assert not none.any()  # tau == block: every round is full


def test_a_repeated_run_with_other_tokens_is_recorded_not_fatal():
    """What an H200 did (bfloat16, random weights): the same program's second run gave other tokens. The timed
    runs are kept and the first difference from the warm-up run is recorded, per mode."""
    from types import SimpleNamespace

    outputs = {"steady": iter([[[1, 2, 3]]] * 3), "unsteady": iter([[[1, 2, 3]], [[1, 2, 3]], [[1, 9, 3]]])}
    runs = {name: (lambda name=name: SimpleNamespace(tokens=next(outputs[name]), decode_s=1.0, compile_s=0.0))
            for name in outputs}
    e2e = run_e2e(runs, repeats=2)
    assert e2e["steady"].repeat_mismatch is None and len(e2e["steady"].results) == 2
    assert e2e["unsteady"].repeat_mismatch == "row 0 differs from token 1 on (3 vs 3 tokens)"
    assert len(e2e["unsteady"].results) == 2


def test_a_recorded_repeat_mismatch_is_a_warning_of_the_report(report):
    from dflash_jax.evaluation.speed import format_report

    assert "not run-to-run deterministic" not in format_report(report)
    e2e = {**report["e2e"], "oracle": {**report["e2e"]["oracle"], "repeat_mismatch": "row 1 differs from token 4"}}
    text = format_report({**report, "e2e": e2e})
    assert "warning: the same program gave other tokens on a repeated run (oracle: row 1 differs from token 4)" in text


@pytest.mark.parametrize("argv", [
    ["--preset", "nope"],
    ["--preset", "tiny", "--tau", "0"],
    ["--preset", "tiny", "--block-size", "4", "--tau", "5"],
    ["--preset", "tiny", "--block-size", "1"],
    ["--preset", "tiny", "--context", "4", "--block-size", "8"],
    ["--preset", "tiny", "--dtype", "float16"],
    ["--preset", "tiny", "--repeats", "x"],
    ["--preset", "tiny", "--ckpt", "somewhere"],
    ["--preset", "qwen3-8b", "--draft-layers", "2"],
    ["--preset", "tiny", "--target-layers", "2"],
    ["--preset", "gpt-oss-20b", "--target-layers", "25"],
    ["--preset", "gpt-oss-20b", "--target-layers", "1"],
    ["--preset", "qwen3-coder-30b-a3b", "--draft-layers", "2"],
    ["--preset", "tiny", "--expert-path", "sparse"],
    ["--target", "/nonexistent/target"],
    ["--target", "/nonexistent/target", "--ckpt", "/nonexistent/draft"],
    ["--preset", "tiny", "--target", "x"],
    [],
])
def test_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in err


def test_help_explains_every_flag(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--preset", "--target", "--ckpt", "--batch", "--block-size", "--context", "--new-tokens", "--tau",
                 "--dtype", "--repeats", "--json", "qwen3-8b", "small", "--target-layers", "--expert-path",
                 "qwen3-coder-30b-a3b", "gpt-oss-20b", "--low-memory"):
        assert flag in out


@pytest.mark.parametrize("name,pairing", [("qwen3.5-4b", "qwen3.5-4b-dflash-b16"),
                                          ("qwen3.5-35b-a3b", "qwen3.5-35b-a3b-dflash-b16")])
def test_cut_hybrid_presets_keep_a_layer_of_each_kind(name, pairing):
    from dflash_jax.configs import load_pairing
    from dflash_jax.evaluation.speed import preset_configs

    full = load_pairing(pairing)
    target, draft = preset_configs(name)
    assert target.num_hidden_layers == 4 and target.linear_layers == (0, 1, 2) and target.attention_layers == (3,)
    for field in ("hidden_size", "linear_attention", "experts", "rotary_dim", "attention_output_gate", "vocab_size"):
        assert getattr(target, field) == getattr(full.target, field)
    draft.validate_against(target)
    with pytest.raises(UserError, match="all linear attention; keep at least one full-attention layer"):
        preset_configs(name, target_layers=3)


@pytest.mark.parametrize("name,pairing,layers", [("qwen3-coder-30b-a3b", "qwen3-coder-30b-a3b-dflash-b16", 2),
                                                 ("gpt-oss-20b", "gpt-oss-20b-dflash-b8", 2)])
def test_cut_moe_presets_keep_the_real_widths(name, pairing, layers):
    """Configs only (no weights): the pairing's target cut to a few layers, everything else as released."""
    from dflash_jax.configs import load_pairing
    from dflash_jax.evaluation.speed import preset_configs, preset_description

    full = load_pairing(pairing)
    target, draft = preset_configs(name)
    assert target.num_hidden_layers == layers == draft.num_target_layers
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "experts",
                  "rope", "attention_sinks", "model_type"):
        assert getattr(target, field) == getattr(full.target, field)
    assert target.expert_layers == tuple(range(layers))
    assert target.layer_windows == full.target.layer_windows[:layers]
    assert draft.num_features == full.draft.num_features and max(draft.target_layer_ids) == layers - 2
    assert (draft.num_hidden_layers, draft.block_size, draft.hidden_size) == (
        full.draft.num_hidden_layers, full.draft.block_size, full.draft.hidden_size)
    draft.validate_against(target)
    assert f"first {layers} of its {full.target.num_hidden_layers}" in preset_description(name)
    deep, deep_draft = preset_configs(name, target_layers=full.target.num_hidden_layers)
    assert deep == full.target and deep_draft == full.draft  # the whole model: the pairing itself
    six, six_draft = preset_configs(name, target_layers=6)
    assert six.num_hidden_layers == 6 and six_draft.target_layer_ids == (0, 1, 2, 3, 4)


def test_low_memory_needs_a_fresh_process(report, capsys):
    """``--low-memory`` sets XLA_FLAGS, which XLA reads when JAX starts: in-process (JAX already started by the
    module fixture) it is a usage error, not a silent no-op."""
    assert main(["--preset", "tiny", "--low-memory"]) == 2
    assert "fresh process" in capsys.readouterr().err


def test_low_memory_xla_flags_merge(monkeypatch):
    from infer import speed
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_disable_hlo_passes=foo")
    speed.use_low_memory_xla_flags()
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=2" in flags
    assert "--xla_disable_hlo_passes=foo,while-loop-invariant-code-motion" in flags
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in flags


def test_dense_prefill_chunk_takes_the_dense_expert_path():
    from dflash_jax.evaluation.speed import dense_prefill_chunk, preset_configs
    from dflash_jax.models.experts import DENSE_LIMIT

    assert dense_prefill_chunk(preset_configs("tiny")[0]) is None
    for name, chunk in (("gpt-oss-20b", 128), ("qwen3.5-35b-a3b", 16), ("qwen3-coder-30b-a3b", 32)):
        target = preset_configs(name)[0]
        assert dense_prefill_chunk(target) == chunk
        assert chunk * target.experts.num_experts <= DENSE_LIMIT < 2 * chunk * target.experts.num_experts


def test_large_leaves_are_drawn_slice_by_slice(monkeypatch):
    """Leaves above DEVICE_SLICE elements are drawn a slice of rows at a time into their buffer: every row
    written, the requested scale and dtype, different values in each slice."""
    import jax.numpy as jnp

    from dflash_jax.models import init

    monkeypatch.setattr(init, "DEVICE_SLICE", 1000)
    x = init._draw_on_device(init.jax.random.PRNGKey(0), (70, 3, 11), jnp.bfloat16, jnp.float32(0.5))
    assert x.shape == (70, 3, 11) and x.dtype == jnp.bfloat16
    v = np.asarray(x, np.float32)
    assert np.all(v.reshape(70, -1).std(axis=1) > 0)  # no row left at zero (30 rows per slice, 3 slices)
    assert abs(v.std() - 0.5) < 0.05
    assert not np.allclose(v[:30], v[30:60])
    small = init._draw_on_device(init.jax.random.PRNGKey(0), (10, 10), jnp.float32, jnp.float32(1.0))
    np.testing.assert_array_equal(small, init._draw_jitted(init.jax.random.PRNGKey(0), (10, 10), jnp.float32,
                                                      jnp.float32(1.0)))


def test_packed_expert_codes_of_a_big_model_are_drawn_on_the_device(monkeypatch):
    """Past HOST_INIT_LIMIT, MXFP4 codes are uniform random bytes drawn by jax.random (NumPy drew them as int64 on
    the host: 8 bytes per code for gigabytes of gpt-oss-120b experts); scales stay 122 (2^-5)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.models import init

    monkeypatch.setattr(init, "HOST_INIT_LIMIT", 0)
    monkeypatch.setattr(init, "DEVICE_SLICE", 5000)  # the codes too are drawn a slice of rows at a time
    abstract = {"down_proj_blocks": jax.ShapeDtypeStruct((8, 64, 4, 16), jnp.uint8),
                "down_proj_scales": jax.ShapeDtypeStruct((8, 64, 4), jnp.uint8)}
    params = init.random_params(abstract)
    codes = np.asarray(params["down_proj_blocks"])
    assert codes.dtype == np.uint8 and codes.shape == (8, 64, 4, 16)
    assert all(codes[e].any() for e in range(8))  # every slice written (one expert of 4,096 codes per slice)
    assert not np.array_equal(codes[0], codes[1])
    counts = np.bincount(codes.ravel(), minlength=256)
    assert counts.min() > 80 and counts.max() < 180  # 32,768 bytes: 128 per value expected
    np.testing.assert_array_equal(np.asarray(params["down_proj_scales"]), 122)
