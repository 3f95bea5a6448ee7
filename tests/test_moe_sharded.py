"""Mixture-of-experts targets, and the hybrid Qwen3-Next (Gated DeltaNet channels over ``tensor``, its decode
state's value heads too), sharded over 8 fake CPU devices (experts over the ``expert`` mesh axis, heads and
MLPs over ``tensor``, rows over ``data``/``fsdp``) give the same tokens and acceptance lengths as one device
(gpt-oss and Qwen3-Next: DFlash with a random draft, planted acceptance; Qwen3-MoE: the baseline with the
grouped path), and the same train step: loss 1e-6 relative, gradients
1e-5 absolute (measured 2.3e-6 on gpt-oss, whose sinks and experts give larger activations), updated params 1e-5 absolute (the other tolerances of tests/test_train_step.py); a gpt-oss
checkpoint loaded straight into the mesh's shardings equals a one-device load exactly (and a Qwen3-Next one);
the grouped expert path under meshes that split the experts or the batch (each device its own experts and rows,
in a shard_map; float and FP8-packed experts) gives the one-device logits.
The hybrid's train step is checked on fsdp=2,tensor=2,expert=2 and on fsdp=8 (batch and weights split 8
ways). (Those with a tensor or expert axis used to stall on XLA:CPU inside its native triangular solve, which
the Gated DeltaNet layers no longer use on CPU: ``gated_deltanet.unit_lower_solve``.) Runs
tests/sharded_moe_check.py in a subprocess (the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_sharded_moe_targets_equal_one_device():
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, str(TESTS / "sharded_moe_check.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    if out["sharded_load"] is not None:  # written by transformers when torch is installed
        for variant, load in out["sharded_load"].items():
            assert load["max_diff"] == 0.0, variant
            assert all("expert" in s for s in load["expert_specs"]), (variant, load)
        assert any("tensor" in s for s in out["sharded_load"]["qwen3_next"]["linear_specs"]), out["sharded_load"]
    # The grouped path under meshes that split the experts or the batch runs each device's own experts and rows
    # in a shard_map: the one-device logits within 2e-5 of the largest logit (float32 rounding: a grouped
    # product over fewer rows, and the tensor split's partial sums; measured up to 1.01e-5 of it, gpt-oss with
    # random MXFP4 experts, whose weights reach 1.5, on expert=4,tensor=2, and 9.1e-6 on data=2,tensor=4, where
    # tensor stays XLA's as before the split; a wrong slice or a bias added by every tensor shard is O(1) off:
    # the down-projection bias left out, measured, 4.6).
    engine = out["grouped_ep"].pop("engine")
    assert engine["tokens"]["data=2,tensor=2,expert=2"] == engine["tokens"]["one"]
    # (expert shards, batch axes, tensor shards): float experts split over all three
    assert engine["traced"] == {"one": [], "data=2,tensor=2,expert=2": ["(2, ('data',), 2)"]}, engine["traced"]
    for variant, ep in out["grouped_ep"].items():
        for spec, run in ep["runs"].items():
            assert run["manual"], (variant, spec)
            # each device its share of the intermediate units where tensor=2 divides every projection's (the
            # tiny models' 32 or 64 units, FP8's 2 blocks of 16, MXFP4's 2 groups of 32); tensor=4 does not
            # divide the packed ones (XLA's then), and the float ones it does
            if "tensor=2" in spec:
                assert run["tensor_shards"] == [2], (variant, spec, run)
            if spec == "data=2,tensor=4":
                assert run["tensor_shards"] == ([1] if "/" in variant else [4]), (variant, spec, run)
            assert run["max_diff"] <= 2e-5 * ep["max_logit"], (variant, spec, run, ep["max_logit"])
    for family in ("gpt_oss", "qwen3_next"):
        runs = out[family]["runs"]
        for key, run in runs.items():
            mesh, kind = key.split("/")
            assert run == runs[f"one/{kind}"], (family, key)
        assert {"data=2,tensor=2,expert=2/dflash", "data=2,tensor=2,expert=2/oracle"} <= set(runs)
        assert runs["one/dflash"]["tokens"] == runs["one/ar"]["tokens"] == runs["one/oracle"]["tokens"]
        assert {a for row in runs["one/oracle"]["accept"] for a in row} >= {1, 2, 3}
        # The experts really were split over the expert axis.
        assert any("'expert'" in s for s in out[family]["param_specs"]["data=2,tensor=2,expert=2"]), out[family]
        assert out[family]["train"]
        for spec, diff in out[family]["train"].items():
            axis = "expert" if "expert" in spec else "fsdp"  # the experts really were split over the mesh
            assert any(axis in s for s in diff["expert_specs"]), (family, spec, diff)
            assert diff["loss"] <= 1e-6 and diff["grads"] <= 1e-5 and diff["params"] <= 1e-5, (family, spec, diff)
