"""The multi-head latent attention families sharded over 8 fake CPU devices (``data=2,tensor=2,expert=2``) give
the same tokens as one device, for the autoregressive baseline, DFlash with a random draft and a verified tree
(the latent cache, and GLM-5's indexer-key cache, rolled back and committed on the mesh):

- DeepSeek-V3 (its latent cache, group-limited and shared experts): heads of the MLA up-projections over
  ``tensor``, experts over ``expert``, the correction bias replicated, the latent cache's rows over ``data`` and
  its single head replicated;
- GLM-5 (DeepSeek's sparse-attention indexer, full and shared layers, ``index_topk`` smaller than the prompts):
  the indexer's query heads over ``tensor`` with MLA's, its key and head-weight projections whole over tensor,
  the indexer-key cache laid out as the latent one.

Runs tests/sharded_mla_check.py in a subprocess (the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
MESH = "data=2,tensor=2,expert=2"
ROWS_OVER_DATA = "P('data', None, None, None)"


@pytest.fixture(scope="module")
def out():
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, str(TESTS / "sharded_mla_check.py")], capture_output=True, text=True,
                          env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_sharded_mla_target_equals_one_device(out, family):
    assert out["devices"] == 8
    runs = out[family]["runs"]
    assert runs["one/chain"] == runs["one/tree"] == runs["one/ar"]
    assert runs[f"{MESH}/chain"] == runs[f"{MESH}/tree"] == runs["one/ar"]
    assert out[family]["cache_spec"] == ROWS_OVER_DATA, out[family]["cache_spec"]


def test_deepseek_v3_shardings(out):
    specs = out["deepseek_v3"]["param_specs"]
    for name in ("q_b_proj", "kv_b_proj"):
        assert "'tensor'" in specs[f"['layers_1']['self_attn']['{name}']['kernel']"], specs
    assert "'expert'" in specs["['layers_1']['mlp']['experts']['gate_proj']"], specs
    assert specs["['layers_1']['mlp']['e_score_correction_bias']"] == "P(None,)", specs


def test_glm_indexer_shardings(out):
    glm = out["glm_moe_dsa"]
    assert "shared" in glm["layer_types"] and glm["layer_types"][0] == "full"
    specs = {k: v for k, v in glm["param_specs"].items() if "indexer" in k}
    assert specs, glm["param_specs"]
    assert any("'tensor'" in v for k, v in specs.items() if "wq_b" in k), specs
    assert all("'tensor'" not in v for k, v in specs.items() if "wq_b" not in k), specs
    assert glm["indexer_cache_spec"] == ROWS_OVER_DATA, glm["indexer_cache_spec"]
