"""Sharded inference: the engine on 8 fake CPU devices (tensor, data and fsdp meshes, the training's sharding
rules) gives the same tokens and acceptance lengths as one device: DFlash and planted acceptance greedy on
every mesh, the baseline greedy and both with sampling (fixed seed) on data=4, tensor=2, where the Pallas
kernel runs per shard too. Runs tests/sharded_decode_check.py in a subprocess (the device count is fixed
when JAX starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_sharded_decoding_equals_one_device():
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, str(TESTS / "sharded_decode_check.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    runs = out["runs"]
    for key, run in runs.items():
        mesh, mode, kind = key.split("/")
        if mesh == "one":
            continue
        reference = runs[f"one/{mode}/{'loop' if kind == 'pallas' else kind}"]
        assert run["tokens"] == reference["tokens"], key
        assert run["accept"] == reference["accept"], key
    for mesh in ("tensor2_data4", "tensor4_data2", "fsdp2_tensor2_data2"):
        assert {f"{mesh}/greedy/dflash", f"{mesh}/greedy/oracle"} <= set(runs), mesh
    assert {"tensor2_data4/greedy/ar", "tensor2_data4/sample/dflash", "tensor2_data4/sample/ar"} <= set(runs)
    assert runs["one/greedy/dflash"]["tokens"] == runs["one/greedy/ar"]["tokens"]  # lossless, as ever
    assert runs["one/greedy/oracle"]["tokens"] == runs["one/greedy/ar"]["tokens"]
    assert "tensor2_data4/short/pallas" in runs  # the sharded Pallas kernel, compared with the loop above
    assert out["pallas_gathers"]["per_shard"] == 0 < out["pallas_gathers"]["no_mesh"], out["pallas_gathers"]
    assert {a for row in runs["one/greedy/oracle"]["accept"] for a in row} >= {1, 2, 3}
    # The params really were split: MLP and attention over tensor, embeddings over fsdp where it divides.
    assert any("tensor" in s for s in out["param_specs"]["tensor4_data2"])
    assert any("fsdp" in s for s in out["param_specs"]["fsdp2_tensor2_data2"])
    # Fewer KV heads (2) than tensor devices (4): each head kept twice, so the cache splits over tensor (one
    # head per device of the 4 copies) instead of sitting whole on every device.
    assert "tensor" in out["tensor4_cache"]["spec"] and out["tensor4_cache"]["shard"][1] == 1
    # the draft's context cache too (2 KV heads of 4 query heads, kept twice: 4 heads, one per device)
    layout = out["tensor4_cache"]
    assert "tensor" in layout["draft_spec"] and layout["draft_shape"][1] == 4 and layout["draft_shard"][1] == 1
