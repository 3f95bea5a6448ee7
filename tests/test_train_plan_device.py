"""``python -m train plan --device``: the train step of a tiny run config (hidden 64, a 4-layer target, a
2-layer draft) compiled for an H200 (XLA:GPU through the CUDA plugin) and a TPU v5p slice (libtpu) on this
CPU machine, over meshes of compile-only devices; memory against the device's own; the error lines.

One compile per device kind (each costs 10-60 s here), run in this process like tests/test_aot_compile.py;
skipped without the ``aot`` extra. The error lines and the mesh rules need no compile."""

import importlib.util
import json
import re

import pytest
import yaml

from train.plan import DEFAULT_MEMORY_GIB, GIB, build_parser, format_plan, main, memory_limit

HAVE_TPU = importlib.util.find_spec("libtpu") is not None
HAVE_CUDA = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None and \
    importlib.util.find_spec("nvidia.cuda_nvcc") is not None
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="the aot extra (CUDA plugin) is not installed")
needs_tpu = pytest.mark.skipif(not HAVE_TPU, reason="the aot extra (libtpu) is not installed")

# configs/tiny-test.yaml's target, as the config.json a run config's target.path points at (plan reads no weight)
TARGET = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, bos_token_id=1,
              eos_token_id=2, head_dim=16, hidden_act="silu", hidden_size=64, intermediate_size=128,
              max_position_embeddings=512, num_attention_heads=4, num_hidden_layers=4, num_key_value_heads=2,
              rms_norm_eps=1e-6, rope_scaling=None, rope_theta=10000.0, tie_word_embeddings=False, vocab_size=97)


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    """A run config of the tiny target: batch 8 x 64 tokens, 8 anchors in chunks of 4, mesh data=-1 x fsdp=2,
    dtype auto (bfloat16 on an accelerator)."""
    root = tmp_path_factory.mktemp("plan")
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(json.dumps(TARGET))
    raw = {"target": {"path": str(root / "target")}, "data": {"train": "unused.jsonl", "max_length": 64},
           "draft": {"num_layers": 2, "block_size": 8, "target_layer_ids": [0, 2]},
           "train": {"global_batch": 8, "num_anchors": 8, "anchor_chunk": 4},
           "mesh": {"data": -1, "fsdp": 2}, "output": {"dir": str(root / "out")}}
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def check_accounting(r: dict) -> None:
    assert r["argument_bytes"] > 0 and r["temp_bytes"] > 0
    assert r["total_bytes"] == r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"] - r["alias_bytes"]
    # target layer 3 follows the last feature layer (2): jit drops it, the trainer holds it; found in the traced
    # program, so a TPU's padded argument bytes do not hide it
    assert r["dropped_argument_bytes"] > 0
    assert r["resident_total_bytes"] == r["total_bytes"] + r["dropped_argument_bytes"] > 0
    assert r["dtype"] == "bfloat16" and r["matmul_flops"] > 0 and r["compile_seconds"] > 0


@needs_cuda
def test_h200_plan_of_a_run_config(run_config, capsys):
    assert main(["--config", run_config, "--device", "h200", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # the run config's data=-1 is 1 on a bare device name: the smallest mesh with its fsdp=2
    assert r["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 1} and r["num_devices"] == 2
    assert r["device"] == "h200" and r["backend"] == "gpu"
    assert 140 < r["device_memory_gib"] < 142 and r["device_memory_bytes"] == r["device_memory_gib"] * GIB
    check_accounting(r)
    assert r["fits"]
    table = format_plan(r)
    assert "2 compile-only h200 device(s), gpu compiler" in table and "fits in 141 GiB per device" in table


@needs_tpu
def test_v5p_slice_plan_of_a_run_config(run_config, capsys):
    # a topology is a whole slice: data=-1 takes the chips fsdp=2 leaves (4 / 2)
    assert main(["--config", run_config, "--device", "v5p:2x2x1"]) == 0
    out = capsys.readouterr().out
    assert "compiling the train step" in out
    assert "mesh data=2,fsdp=2,tensor=1,expert=1 (4 compile-only v5p:2x2x1 device(s), tpu compiler)" in out
    assert "fits in 95 GiB per device" in out and "TPU compiler's buffer assignment" in out
    total = re.search(r"total resident\s+([\d.]+)", out)
    assert total and float(total.group(1)) > 0, out
    seconds = re.search(r"compiled in ([\d.]+) s", out)
    assert seconds and float(seconds.group(1)) > 0, out


def test_local_device_plans_on_this_process_devices(capsys):
    """``--device local`` (aot's ``local``): the process's own devices, here the CPU; no memory figure of its
    own on a CPU, so the default 80 GiB."""
    assert main(["--pairing", "tiny-test", "--seq-len", "32", "--num-anchors", "4", "--anchor-chunk", "4",
                 "--global-batch", "1", "--device", "local", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"].startswith("local") and r["backend"] == "cpu" and not r["compile_only"]
    assert r["num_devices"] == 1 and r["device_memory_gib"] == DEFAULT_MEMORY_GIB
    check_accounting(r)
    assert "local cpu device(s), cpu compiler" in format_plan(r) and "compile-only" not in format_plan(r)


def test_memory_to_compare_with():
    class Target:
        memory_bytes = 95 * GIB

    assert memory_limit(None) == DEFAULT_MEMORY_GIB * GIB  # no --device: as before
    assert memory_limit(None, Target()) == 95 * GIB
    assert memory_limit(40.0, Target()) == 40 * GIB  # --device-memory-gib overrides the device's


def test_help_documents_the_device():
    text = build_parser().format_help()
    assert "--device DEVICE" in text and "h200" in text and "v5p:2x2x2" in text


@pytest.mark.parametrize("args, message", [
    (["--device", "v9x"], "unknown device 'v9x'"),
    (["--device", "v5p:2x2x1", "--mesh", "fsdp=8"], "TPU topology 'v5p:2x2x1' has 4 chips: mesh "),
    (["--device", "h200", "--cpu-devices", "8"], "--cpu-devices simulates CPU devices"),
    (["--device", "h200", "--distributed"], "drop the multi-process flags"),
    (["--device", "local", "--num-processes", "2"], "drop the multi-process flags"),
    (["--device", "h200", "--mesh", "data=-1,fsdp=-1"], "only one axis may be -1"),
])
def test_bad_device_input_is_one_error_line(args, message, capsys):
    code = main(["--pairing", "tiny-test", "--seq-len", "64", "--num-anchors", "8", *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
