"""A GLM-5 target (multi-head latent attention with DeepSeek's sparse-attention indexer, full and shared layers,
``index_topk`` smaller than the prompts) sharded over 8 fake CPU devices (``data=2,tensor=2,expert=2``: the
indexer's query heads over ``tensor`` with MLA's, its key and head-weight projections whole over tensor, the
indexer-key cache's rows over ``data`` and its single head replicated, experts over ``expert``) gives the same
tokens as one device, for the autoregressive baseline, DFlash with a random draft and a verified tree. Runs
tests/sharded_dsa_check.py in a subprocess (the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_sharded_dsa_target_equals_one_device():
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, str(TESTS / "sharded_dsa_check.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8 and "shared" in out["layer_types"] and out["layer_types"][0] == "full"
    runs = out["runs"]
    mesh = "data=2,tensor=2,expert=2"
    assert runs["one/chain"] == runs["one/tree"] == runs["one/ar"]
    assert runs[f"{mesh}/chain"] == runs[f"{mesh}/tree"] == runs["one/ar"]
    specs = out["param_specs"]
    assert any("'tensor'" in v for k, v in specs.items() if "wq_b" in k), specs
    assert all("'tensor'" not in v for k, v in specs.items() if "wq_b" not in k), specs
    assert out["cache_spec"] == "P('data', None, None, None)", out["cache_spec"]
