"""``python -m train plan``: the train step compiled from abstract shapes on 8 simulated CPU devices (each
plan in its own subprocess: the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.plan import format_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--pairing", "tiny-test", "--cpu-devices", "8", "--seq-len", "64", "--num-anchors", "8", "--anchor-chunk",
        "4", "--global-batch", "8", "--dtype", "float32"]
MESHES = ("data=2,fsdp=2,tensor=2", "fsdp=8", "data=8")


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _start(args):
    return subprocess.Popen([sys.executable, "-m", "train", "plan", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def plans():
    """The tiny pairing planned on three meshes; the compiles run side by side (XLA compiles mostly on one
    core)."""
    procs = {mesh: _start([*TINY, "--mesh", mesh, "--json"]) for mesh in MESHES}
    out = {}
    for mesh, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[mesh] = json.loads(stdout)
    return out


def test_plan_reports_memory_and_flops(plans):
    r = plans["data=2,fsdp=2,tensor=2"]
    assert r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1} and r["num_devices"] == 8
    assert r["argument_bytes"] > 0 and r["temp_bytes"] > 0
    params = r["target_param_bytes"] + r["draft_state_bytes"]
    assert 0 < params <= r["input_bytes"]
    assert r["total_bytes"] == r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"] - r["alias_bytes"]
    # the tiny target's last layer follows its last feature layer (2): jit drops it, the trainer holds it
    assert r["dropped_argument_bytes"] > 0
    assert r["resident_total_bytes"] == r["total_bytes"] + r["dropped_argument_bytes"] >= params
    assert r["matmul_flops"] > 0 and r["matmul_flops_exact"]
    if r["flops"] is not None:
        assert r["flops"] > 0
    assert r["fits"] and r["compile_seconds"] > 0
    table = format_plan(r)
    assert "temporaries" in table and "fits in 80 GiB" in table


def test_fsdp_shards_what_data_parallel_replicates(plans):
    # fsdp splits the hidden dimension (64 / 8) of every weight and Adam moment; data=8 replicates them
    fsdp, data = plans["fsdp=8"], plans["data=8"]
    assert fsdp["argument_bytes"] < data["argument_bytes"] / 4
    assert fsdp["target_param_bytes"] < data["target_param_bytes"] / 4
    assert fsdp["draft_state_bytes"] < data["draft_state_bytes"] / 4
    assert fsdp["matmul_flops"] == data["matmul_flops"]  # the same global step, however it is split


@pytest.mark.parametrize("args, message", [
    ([*TINY, "--mesh", "data=3"], "needs 3 devices, but 8 are available"),
    (["--pairing", "no-such-pairing", "--mesh", "data=8"], "no such pairing"),
    ([*TINY[:2], "--mesh", "fsdp=8"], "--cpu-devices 8"),
    ([*TINY, "--mesh", "data=8", "--global-batch", "4"], "not divisible"),
    (["--pairing", "qwen3-8b-dflash-b16", "--experts", "packed", "--mesh", "data=8"], "has no experts"),
    (["--pairing", "qwen3-8b-dflash-b16", "--mxfp4", "packed", "--mesh", "data=8"], "has no experts"),  # older name
])
def test_bad_input_is_one_error_line(args, message):
    proc = _start(args)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr


def test_run_config_without_target_config_is_one_error_line(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(f"target: {{path: {tmp_path / 'missing'}}}\ndata: {{train: x.jsonl}}\noutput: {{dir: {tmp_path}}}\n")
    proc = _start(["--config", str(run), "--cpu-devices", "8"])
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and stderr.startswith("error: ") and "no config.json" in stderr, stderr
