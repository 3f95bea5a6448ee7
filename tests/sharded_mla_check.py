"""Run in a subprocess with 8 fake CPU devices (tests/test_mla_sharded.py): tiny targets of the two multi-head
latent attention families, DeepSeek-V3 (its latent cache, group-limited and shared experts) and GLM-5 (the same
plus DeepSeek's sparse-attention indexer with ``index_topk`` 4, smaller than every prompt, layers full / shared /
full ..., and its indexer-key cache), decoded on one device and on the mesh ``data=2,tensor=2,expert=2``: the
autoregressive baseline, DFlash with a random draft (chain) and a verified tree, every cache rolled back and
committed on the mesh. No torch needed: random params drawn with NumPy, norms, biases and the router's
correction bias away from their init. Prints one JSON object per family: the tokens of each run, the param
shardings of layer 1 (MLA projections, experts) and of the indexers and the shardings of the latent and indexer-key caches.
XLA's backend optimizations are off (as in tests/sharded_moe_check.py: about half the compile time; every
comparison is between programs compiled alike)."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_disable_most_optimizations", True)

from dflash_jax import sharding  # noqa: E402
from dflash_jax.checkpoints.hf_target import abstract_target_params  # noqa: E402
from dflash_jax.engine.decoder import Decoder  # noqa: E402
from dflash_jax.models.config import TargetConfig  # noqa: E402
from engine_tiny import tiny_draft  # noqa: E402
from draft_tiny import HIDDEN, TARGET_LAYERS, VOCAB  # noqa: E402

MESH = "data=2,tensor=2,expert=2"
MLA = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=24,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
           first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=512)
CONFIGS = {
    "deepseek_v3": dict(MLA, model_type="deepseek_v3", n_group=2, topk_group=1, rope_interleave=True),
    "glm_moe_dsa": dict(MLA, model_type="glm_moe_dsa", index_topk=4, index_n_heads=4, index_head_dim=16,
                        index_topk_freq=2, index_skip_topk_offset=1),
}


def tiny_target(family, seed=0, scale=0.3):
    config = TargetConfig.from_dict(CONFIGS[family])
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        if len(x.shape) > 1:
            return jnp.asarray(rng.standard_normal(x.shape) * scale, x.dtype)
        if "e_score_correction_bias" in name or "'bias'" in name:
            return jnp.asarray(rng.standard_normal(x.shape) * 0.5, x.dtype)
        return jnp.asarray(1 + 0.2 * rng.standard_normal(x.shape), x.dtype)  # norms around 1

    return config, jax.tree_util.tree_map_with_path(draw, abstract_target_params(config))


def check(family, dc, dp, prompts):
    tc, tp = tiny_target(family)
    out = {"runs": {}}
    if tc.dsa is not None:
        out["layer_types"] = list(tc.dsa.layer_types)
    for spec in (None, MESH):
        mesh = sharding.make_mesh(spec) if spec else None
        name = spec or "one"
        decoder = Decoder(tc, tp, dc, dp, 8, mesh=mesh)
        if spec is None:
            out["runs"]["one/ar"] = decoder.generate(prompts, 20, baseline=True).tokens
        out["runs"][f"{name}/chain"] = decoder.generate(prompts, 20).tokens
        decoder.tree_budget = 12
        out["runs"][f"{name}/tree"] = decoder.generate(prompts, 20).tokens
        if mesh is not None:
            specs = {jax.tree_util.keystr(path): str(x.sharding.spec)
                     for path, x in jax.tree_util.tree_leaves_with_path(decoder.target_params)}
            out["param_specs"] = {k: v for k, v in specs.items() if "layers_1" in k or "indexer" in k}
            cache = ("batch", "kv_heads", None, None)
            out["cache_spec"] = str(sharding.spec_for((4, 1, 64, tc.mla.cache_width), cache, mesh))
            if tc.dsa is not None:
                out["indexer_cache_spec"] = str(sharding.spec_for((4, 1, 64, tc.dsa.index_head_dim), cache, mesh))
    return out


def main():
    dc, dp = tiny_draft(block=8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB - 1, n).tolist() for n in (5, 13, 9, 21)]
    out = {"devices": jax.device_count(), **{family: check(family, dc, dp, prompts) for family in CONFIGS}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
