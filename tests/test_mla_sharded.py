"""A DeepSeek-V3 target (multi-head latent attention, its latent cache, group-limited and shared experts) sharded
over 8 fake CPU devices (``data=2,tensor=2,expert=2``: heads of the MLA up-projections and o_proj over
``tensor``, experts over ``expert``, the latent cache's rows over ``data`` and its single head replicated) gives
the same tokens as one device, for the autoregressive baseline, DFlash with a random draft and a verified tree
(the latent cache rolled back and committed on the mesh). Runs tests/sharded_mla_check.py in a subprocess (the
device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_sharded_mla_target_equals_one_device():
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, str(TESTS / "sharded_mla_check.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    runs = out["runs"]
    mesh = "data=2,tensor=2,expert=2"
    assert runs["one/chain"] == runs["one/tree"] == runs["one/ar"]
    assert runs[f"{mesh}/chain"] == runs[f"{mesh}/tree"] == runs["one/ar"]
    specs = out["param_specs"]
    for name in ("q_b_proj", "kv_b_proj"):
        assert "'tensor'" in specs[f"['layers_1']['self_attn']['{name}']['kernel']"], specs
    assert "'expert'" in specs["['layers_1']['mlp']['experts']['gate_proj']"], specs
    assert specs["['layers_1']['mlp']['e_score_correction_bias']"] == "P(None,)", specs
    assert out["cache_spec"] == "P('data', None, None, None)", out["cache_spec"]
