"""Run in a subprocess with 8 fake CPU devices (tests/test_moe_sharded.py): mixture-of-experts targets (tiny
Qwen3-MoE and gpt-oss) and a hybrid one (Qwen3-Next: Gated DeltaNet layers and experts) on one device and
sharded with their experts split over the ``expert`` mesh axis, linear-attention channels over ``tensor``.
Engine: DFlash with a random draft, the autoregressive baseline and planted acceptance (an oracle with
errors), greedy. Train step: loss, gradients and updated draft params. Prints one JSON object; each part's wall
time goes to stderr (tests/section_timer.py).

The engine's programs are compiled with XLA's backend optimizations off (``jax_disable_most_optimizations``,
as in tests/sharded_decode_check.py: about half the compile time, the same tokens; every comparison between
programs compiled alike). The train steps keep them: their float comparisons have tolerances of a few float32
rounding steps, and unoptimised reductions (not vectorised) bring them closer to the bound (gpt-oss's loss
4.9e-7 relative instead of 7e-8, of 1e-6)."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from dflash_jax import sharding  # noqa: E402
from dflash_jax.engine.decoder import Decoder  # noqa: E402
from dflash_jax.engine.generate import DecodeSettings, generate  # noqa: E402
from dflash_jax.engine.proposers import OracleProposer  # noqa: E402
from dflash_jax.models.draft import DraftModel  # noqa: E402
from dflash_jax.models.target import TargetModel  # noqa: E402
from dflash_jax.precision import with_precision_policy  # noqa: E402
from dflash_jax.training.step import (  # noqa: E402
    StepConfig, accumulated_gradients, init_train_state, make_optimizer, make_train_step,
)
from engine_tiny import tiny_draft, tiny_moe_target  # noqa: E402
from section_timer import section  # noqa: E402
from train_tiny import STEP_KW, tiny_tokenized  # noqa: E402

# The engine and the train step sharded: gpt-oss (experts with biases, sinks, sliding windows) and the hybrid
# Qwen3-Next (experts and Gated DeltaNet layers). Qwen3-MoE's experts take the same paths as gpt-oss's (its
# sharded logits under every mesh and its engine's baseline on a mesh are in grouped_expert_parallel below);
# its own DFlash / planted runs here added ~20 s and no path the other two do not take.
FAMILIES = ("gpt_oss", "qwen3_next")
ENGINE_MESHES = (None, "data=2,tensor=2,expert=2")
TRAIN_MESHES = (None, "fsdp=2,tensor=2,expert=2")
HYBRID_TRAIN_MESHES = ("fsdp=8", "fsdp=2,tensor=2,expert=2")


def engine_runs(family):
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        return _engine_runs(family)
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


def _engine_runs(family):
    tc, tp = tiny_moe_target(family)
    dc, dp = tiny_draft(block=8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in (5, 13, 9, 21)]
    runs, specs, reference = {}, {}, None
    for spec in ENGINE_MESHES:
        mesh = sharding.make_mesh(spec) if spec else None
        name = spec or "one"
        decoder = Decoder(tc, tp, dc, dp, 8, mesh=mesh)
        if mesh is not None:
            specs[name] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(decoder.target_params)})
        for baseline in (False, True) if mesh is None else (False,):  # the planted run covers the rest
            with section(f"{family} {name} {'ar' if baseline else 'dflash'}"):
                r = decoder.generate(prompts, 24, baseline=baseline)
            runs[f"{name}/{'ar' if baseline else 'dflash'}"] = {"tokens": r.tokens, "accept": r.accept_lengths}
        if reference is None:  # the greedy continuation, errors planted at about every 3rd position
            reference = np.zeros((len(prompts), 64), np.int32)
            for i, (p, g) in enumerate(zip(prompts, runs["one/ar"]["tokens"])):
                reference[i, : len(p) + len(g)] = p + g
            errors = (np.arange(64)[None] % 3 == 0) & (rng.random((len(prompts), 64)) < 0.7)
        oracle = OracleProposer(8, tc.vocab_size)
        with section(f"{family} {name} oracle"):
            r = generate(tc, decoder.target_params, prompts, oracle, oracle.init(reference, errors),
                         DecodeSettings(24, mesh=mesh))
        runs[f"{name}/oracle"] = {"tokens": r.tokens, "accept": r.accept_lengths}
    return runs, specs


def train_run(family, spec):
    with section(f"{family} train {spec or 'one'}"):
        return _train_run(family, spec)


def _train_run(family, spec):
    tc, tp = tiny_moe_target(family)
    dc, dp = tiny_draft()
    cfg = StepConfig(feature_layers=dc.target_layer_ids, **STEP_KW)
    batch = tiny_tokenized(rows=8).padded_rows()
    mesh = sharding.make_mesh(spec, jax.devices()[:1] if spec is None else None)
    target, draft = TargetModel(tc), DraftModel(dc)
    optimizer, _ = make_optimizer(1e-3, total_steps=10, warmup_ratio=0.0, eps=1e-4)  # eps: see sharded_step_check
    with jax.set_mesh(mesh):
        tp = jax.device_put(tp, sharding.tree_shardings(tp, mesh))
        state = init_train_state(dp, optimizer, seed=0)
        state_sh = sharding.tree_shardings(state, mesh)
        state = jax.device_put(state, state_sh)
        batch = sharding.global_batch_from_local(batch, mesh, 8)
        step = make_train_step(target, draft, cfg, optimizer)

        def step_and_gradients(state, tp, batch):
            # The step's own gradients (its key, under its precision policy) beside the step itself: one program,
            # one compile per mesh instead of two (measured 19-27 s -> 15-21 s a mesh on XLA:CPU).
            key = jax.random.fold_in(state.key, state.step)
            grads, _ = accumulated_gradients(state.params, tp, batch, key, target, draft, cfg)
            return grads, *step(state, tp, batch)

        grads, new_state, metrics = jax.jit(with_precision_policy(step_and_gradients, draft.dtype),
                                            out_shardings=(None, state_sh, None))(state, tp, batch)
        expert_specs = sorted({str(x.sharding.spec) for path, x in jax.tree_util.tree_leaves_with_path(tp)
                               if "experts" in jax.tree_util.keystr(path)})
    return float(metrics["loss"]), jax.device_get(grads), jax.device_get(new_state.params), expert_specs


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def sharded_loads():
    """A gpt-oss Hugging Face directory (written by transformers) loaded straight into the shardings of an
    8-device mesh, tensor by tensor: the same values as a one-device load, experts split over the expert
    axis. None without torch (needed only to write the checkpoint)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    import tempfile
    from pathlib import Path

    from dflash_jax.checkpoints.loading import load_target_any
    from hf_tiny import make_hf_target

    mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
    out = {}
    for variant in ("gpt_oss", "qwen3_next"):
        with tempfile.TemporaryDirectory() as tmp, section(f"load {variant}"):
            make_hf_target(variant, Path(tmp))
            _, one = load_target_any(tmp)
            _, sharded = load_target_any(tmp, mesh=mesh)
            specs = lambda part: sorted({str(x.sharding.spec) for path, x in  # noqa: E731
                                         jax.tree_util.tree_leaves_with_path(sharded)
                                         if part in jax.tree_util.keystr(path)})
            out[variant] = {"max_diff": max_diff(sharded, one), "expert_specs": specs("experts"),
                            "linear_specs": specs("linear_attn")}
    return out


EP_MESHES = ("data=4,expert=2", "data=8", "expert=4,tensor=2", "data=2,tensor=2,expert=2", "data=2,tensor=4")


def grouped_expert_parallel():
    """The grouped expert path (prefill and training at real sizes) under meshes that split the experts or the
    batch: each device runs its own rows' pairs for its own experts (float weights: through its own share of
    their intermediate units over ``tensor``) inside a ``shard_map`` over ``expert``, ``tensor`` and the batch
    axes, and one all-reduce over ``expert`` and ``tensor`` sums them (``experts._grouped_sharded``). Target
    logits, the grouped path forced, against one device, for Qwen3-MoE, gpt-oss (expert biases), Qwen3-MoE with
    FP8 experts kept packed (16 x 16 blocks) and gpt-oss with MXFP4 experts kept packed (random codes and
    scales: each device decodes its own experts' codes). Per variant and mesh: the largest difference, the
    largest logit, whether the program has the manual (shard_map) region, and the tensor shards it used."""
    import dataclasses

    import jax.numpy as jnp
    import ml_dtypes

    from dflash_jax.models.experts import force_expert_path, recording_sharded

    out = {}
    for variant in ("qwen3_moe", "gpt_oss", "qwen3_moe/fp8", "gpt_oss/mxfp4"):
        tc, tp = tiny_moe_target(variant.split("/")[0])
        if "/" in variant:  # packed experts: random codes and scales drawn for the packed params
            from dflash_jax.checkpoints.hf_target import abstract_target_params

            packed = {"fp8": dict(weight_format="fp8", weight_block=(16, 16)),
                      # intermediate 64: two groups of 32 in down_proj's inputs, so that tensor=2 splits them
                      "mxfp4": dict(weight_format="mxfp4", intermediate_size=64)}[variant.split("/")[1]]
            tc = dataclasses.replace(tc, experts=dataclasses.replace(tc.experts, **packed))
            rng = np.random.default_rng(3)

            def draw(path, x):
                name = path[-1].key
                if name.endswith("_qweight"):
                    return jnp.asarray(rng.standard_normal(x.shape).astype(ml_dtypes.float8_e4m3fn))
                if name.endswith("_qscale"):
                    return jnp.asarray(0.05 + 0.1 * rng.random(x.shape), x.dtype)
                if name.endswith("_blocks"):
                    return jnp.asarray(rng.integers(0, 256, x.shape, dtype=np.uint8))
                if name.endswith("_scales"):  # MXFP4: 2 ** (s - 127) for s in [122, 126)
                    return jnp.asarray(rng.integers(122, 126, x.shape, dtype=np.uint8))
                if name.endswith("_proj_bias"):  # the expert biases, at the new width for MXFP4
                    return jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
                return None

            tp = _merge(jax.tree_util.tree_map_with_path(draw, abstract_target_params(tc)), tp)
        rows = jnp.asarray(np.random.default_rng(4).integers(0, tc.vocab_size, (2, 12)), jnp.int32)

        def logits(params, rows, tc=tc):
            with force_expert_path("grouped"):
                return TargetModel(tc).apply({"params": params}, rows, jnp.arange(12)[None].repeat(2, 0)).logits

        with section(f"grouped expert-parallel {variant}"):
            ref = np.asarray(jax.jit(logits)(tp, rows))
            runs = {}
            for spec in EP_MESHES:
                mesh = sharding.make_mesh(spec)
                with jax.set_mesh(mesh), recording_sharded() as seen:
                    params = jax.device_put(tp, sharding.tree_shardings(tp, mesh))
                    fn = jax.jit(logits)
                    got = np.asarray(fn(params, rows))
                    manual = "sdy.manual_computation" in fn.lower(params, rows).as_text()
                runs[spec] = {"max_diff": float(np.max(np.abs(got - ref))), "manual": manual,
                              "tensor_shards": sorted({record[2] for record in seen})}
            out[variant] = {"max_logit": float(np.max(np.abs(ref))), "runs": runs}
    # The engine's own programs (which take sharded arguments without a mesh context) run it too: the
    # autoregressive baseline, grouped path forced, on one device and on a mesh, and which layers traced it.
    from dflash_jax.engine import generate as engine

    tc, tp = tiny_moe_target("qwen3_moe")
    prompts = [[3, 5, 7, 11], [13, 17, 19, 23]]
    tokens, traced = {}, {}
    for spec in (None, "data=2,tensor=2,expert=2"):
        mesh = sharding.make_mesh(spec) if spec else None
        with section(f"grouped expert-parallel engine {spec}"), force_expert_path("grouped"), \
                recording_sharded() as seen:
            tokens[spec or "one"] = Decoder(tc, tp, mesh=mesh).generate(prompts, 10, baseline=True).tokens
        traced[spec or "one"] = sorted({str(x) for x in seen})
    engine._EXECUTABLES.clear()  # programs compiled with the path forced are not for the checks that follow
    out["engine"] = {"tokens": tokens, "traced": traced}
    return out


def _merge(packed, floats):
    """``packed``'s leaves where it has them (the drawn codes and scales), else the float target's."""
    if isinstance(packed, dict):
        return {k: _merge(v, floats.get(k) if isinstance(floats, dict) else None) for k, v in packed.items()}
    return floats if packed is None else packed


out = {"devices": jax.device_count(), "sharded_load": sharded_loads(), "grouped_ep": grouped_expert_parallel()}
for family in FAMILIES:
    runs, specs = engine_runs(family)
    train = {}
    # The train step: on gpt-oss (the richer MoE family) and on the hybrid, the latter also with its batch and
    # weights split 8 ways (fsdp=8).
    one = train_run(family, None)
    for spec in TRAIN_MESHES[1:] if family == "gpt_oss" else HYBRID_TRAIN_MESHES:
        other = train_run(family, spec)
        train[spec] = {"loss": abs(other[0] - one[0]) / abs(one[0]), "grads": max_diff(other[1], one[1]),
                       "params": max_diff(other[2], one[2]), "expert_specs": other[3]}
    out[family] = {"runs": runs, "param_specs": specs, "train": train}
print(json.dumps(out))
