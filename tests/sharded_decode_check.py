"""Run in a subprocess with 8 fake CPU devices (tests/test_engine_sharded.py): the same prompts through the
engine on one device and sharded over meshes of 8 devices: DFlash (greedy on every mesh), planted acceptance
(an oracle with errors, every mesh), the autoregressive baseline (greedy and sampling on data=4,tensor=2, the
mesh that splits both the batch and the heads; the other meshes' target forward is the oracle's), DFlash
sampling with a fixed seed (data=4,tensor=2) and the Pallas kernel (data=4,tensor=2). Prints one JSON object:
tokens and acceptance lengths per run, and the shardings the params and caches got. Each part's wall time goes
to stderr (tests/section_timer.py).

Compiles are most of this check's time, and the programs run for a few rounds only: they are compiled with
XLA's backend optimizations off (``jax_disable_most_optimizations``: LLVM without its optimization passes),
~40% less compile time, the same tokens on every run (measured 167 -> 131 s for the whole check on a loaded
2-core VM). Every comparison is between programs compiled alike; the sharding itself (the SPMD partitioner,
the collectives) is XLA's HLO work, untouched by the flag. The Pallas interpreter runs long enough that its
programs keep the optimizations."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.engine.decoder import Decoder  # noqa: E402
from dflash_jax.engine.generate import DecodeSettings, generate, jitted_functions  # noqa: E402
from dflash_jax.engine.proposers import DFlashProposer, OracleProposer  # noqa: E402
from dflash_jax.models.draft import shared_head  # noqa: E402
from dflash_jax.engine.sampling import SamplingConfig  # noqa: E402
from dflash_jax.models.attention_kernels import Segment, attention_kernel, fused_attention  # noqa: E402
from dflash_jax.sharding import make_mesh  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from engine_tiny import tiny_draft, tiny_target  # noqa: E402
from section_timer import section  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)

tc, tp = tiny_target()
dc, dp = tiny_draft(block=8)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in (5, 13, 9, 21)]
runs = {}
specs = {}
for name, spec in (("one", None), ("tensor2_data4", "data=4,tensor=2"), ("tensor4_data2", "data=2,tensor=4"),
                   ("fsdp2_tensor2_data2", "data=2,fsdp=2,tensor=2")):
    mesh = make_mesh(spec) if spec else None
    decoder = Decoder(tc, tp, dc, dp, 8, mesh=mesh)
    if mesh is not None:
        specs[name] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(decoder.target_params)})
    full = name in ("one", "tensor2_data4")  # the mesh that splits both the batch and the heads
    for mode, sampling in (("greedy", SamplingConfig()), ("sample", SamplingConfig(0.8, top_k=20, top_p=0.9))):
        if mode == "sample" and not full:
            continue  # sampling is checked on the mesh that splits both the batch and the heads
        for baseline in (False, True) if full else (False,):  # elsewhere the oracle's run covers the target
            shown = []  # streaming: the loop is re-entered with its own (sharded) output state
            key = f"{name}/{mode}/{'ar' if baseline else 'dflash'}"
            with section(key):
                r = decoder.generate(prompts, 24, sampling, seed=3, baseline=baseline,
                                     on_tokens=shown.append if mode == "greedy" else None)
            assert mode != "greedy" or shown[-1] == r.tokens
            runs[key] = {"tokens": r.tokens, "accept": r.accept_lengths}
    # A random draft accepts one token per round; an oracle proposing the greedy continuation with an error
    # at every 3rd position makes rounds of 1..3 tokens, so acceptance lengths are really compared.
    if name == "one":
        greedy = runs["one/greedy/ar"]["tokens"]
        reference = np.zeros((len(prompts), 64), np.int32)
        for i, (p, g) in enumerate(zip(prompts, greedy)):
            reference[i, : len(p) + len(g)] = p + g
        errors = (np.arange(64)[None] % 3 == 0) & (rng.random((len(prompts), 64)) < 0.7)
    oracle = OracleProposer(8, tc.vocab_size)
    with section(f"{name}/greedy/oracle"):
        r = generate(tc, decoder.target_params, prompts, oracle, oracle.init(reference, errors),
                     DecodeSettings(24, mesh=mesh))
    runs[f"{name}/greedy/oracle"] = {"tokens": r.tokens, "accept": r.accept_lengths}
    # The Pallas attention kernel on each device's shard vs the loop on one: in TPU interpret mode a round takes
    # ~4 s on 2 cores, so 2 tokens (the prefill and one round, target and draft through the kernel; 4 tokens
    # took ~8 s more and ran no other path).
    if full:
        kernel = "loop" if name == "one" else "pallas"
        jax.config.update("jax_disable_most_optimizations", kernel == "loop")
        with section(f"{name}/short/{kernel}"):
            r = Decoder(tc, tp, dc, dp, 8, mesh=mesh, attention=kernel).generate(prompts, 2)
        jax.config.update("jax_disable_most_optimizations", True)
        runs[f"{name}/short/{kernel}"] = {"tokens": r.tokens, "accept": r.accept_lengths}
# 2 KV heads (of 4 query heads) on tensor=4: each head kept twice, so the target's cache and the draft's
# context cache split over tensor (one head per device) instead of sitting whole on every device (the DFlash
# runs on this mesh above decode with those copies). The prefill's output layout, compiled only.
mesh = make_mesh("data=2,tensor=4")
proposer = DFlashProposer(dc, 8).on_mesh(mesh)
consts, pstate = proposer.init(dp, shared_head(tp, tc.tie_word_embeddings), 2, 32)
pre, _ = jitted_functions(tc, proposer, DecodeSettings(8, mesh=mesh), 32, jnp.float32)
tokens = jnp.zeros((2, 16), jnp.int32)
with section("tensor4_data2/prefill layout (compile only)"):
    layout = pre.lower(tp, consts, pstate, tokens, jnp.array([5, 16]), jax.random.PRNGKey(0)).compile()
keys = layout.output_shardings.cache.keys[0]
draft_keys = layout.output_shardings.proposer["cache"].keys[0]
draft_shape = pstate["cache"].keys[0].shape
cache_layout = {"spec": str(keys.spec), "shard": list(keys.shard_shape((2, 4, 32, 16))),
                "draft_spec": str(draft_keys.spec), "draft_shape": list(draft_shape),
                "draft_shard": list(draft_keys.shard_shape(draft_shape))}
# The Pallas kernel under a mesh runs per shard: its compiled program moves no cache between devices (without
# the mesh, XLA gathers the operands of the pallas_call onto every device).
mesh = make_mesh("data=4,tensor=2")
q = jax.device_put(np.ones((4, 8, 4, 16), np.float32), NamedSharding(mesh, P("data", None, "tensor", None)))
kv = jax.device_put(np.ones((4, 2, 40, 16), np.float32), NamedSharding(mesh, P("data", "tensor", None, None)))
lengths = jax.device_put(np.array([30, 3, 0, 9], np.int32), NamedSharding(mesh, P("data")))
gathers = {}
for label, context_mesh in (("per_shard", mesh), ("no_mesh", None)):
    with attention_kernel("pallas", context_mesh), section(f"pallas gathers {label} (compile only)"):
        fn = jax.jit(lambda q, k, v, n: fused_attention(q, [Segment(k, v, n)], "pallas"))
        gathers[label] = fn.lower(q, kv, kv, lengths).compile().as_text().count("all-gather")
print(json.dumps({"devices": jax.device_count(), "runs": runs, "param_specs": specs, "pallas_gathers": gathers,
                  "tensor4_cache": cache_layout}))
