"""Run in a subprocess with 8 fake CPU devices (tests/test_train_step.py): the same global batch through the
train step on 1 device, 1 device with 4 accumulation micro-steps, and 8 devices (data=2, fsdp=2, tensor=2;
fsdp=8). Prints one JSON object with the largest differences of loss, gradients and updated params, and, per
8-device mesh, the collectives of the compiled step that carry activations of the whole global batch outside
the frozen target (the draft's side of the step should only ever hold each device's own rows).

Each run is one program, the step with its own gradients beside it (one compile a run, not two); the
collectives are counted in that program (without the batch constraints it holds 94 such collectives on
fsdp=8, measured). Each run's wall time goes to stderr (tests/section_timer.py).

Compiles are most of this check's time: the programs are compiled with XLA's backend optimizations off
(``jax_disable_most_optimizations``), as tests/sharded_decode_check.py does: 5m57s -> 3m40s of CPU for the whole
check (2026-12-03), the same collectives and shardings; every comparison is between programs compiled alike
(loss 8e-7 relative vs 2e-7 with them, gradients and params as before)."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_disable_most_optimizations", True)

from dflash_jax import sharding  # noqa: E402
from dflash_jax.models.draft import DraftModel  # noqa: E402
from dflash_jax.models.target import TargetModel  # noqa: E402
from dflash_jax.precision import with_precision_policy  # noqa: E402
from dflash_jax.training.step import (  # noqa: E402
    StepConfig, accumulated_gradients, init_train_state, make_optimizer, make_train_step,
)
from dflash_jax.checkpoints.official_draft import init_draft_params  # noqa: E402
from dflash_jax.models.draft_config import DraftConfig  # noqa: E402
from draft_tiny import official_config  # noqa: E402
from engine_tiny import tiny_draft, tiny_target  # noqa: E402
from section_timer import section  # noqa: E402
from train_tiny import STEP_KW, tiny_tokenized  # noqa: E402


def dflash2_draft():
    """The tiny draft as a DFlash2 draft (block convolutions and a selector whose sums join the loss)."""
    cfg = official_config(architectures=["DFlash2DraftModel"])
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    config = DraftConfig.from_dict(cfg)
    return config, init_draft_params(config, seed=1)


def run(mesh_spec, devices, accum, dflash2=False, **loss_kw):
    with section(f"{mesh_spec} accum={accum}{' dflash2' if dflash2 else ''} {loss_kw.get('loss', 'ce')}"):
        return _run(mesh_spec, devices, accum, dflash2, **loss_kw)


def _run(mesh_spec, devices, accum, dflash2, **loss_kw):
    tc, tp = tiny_target()
    dc, dp = dflash2_draft() if dflash2 else tiny_draft()
    cfg = StepConfig(feature_layers=dc.target_layer_ids, accum_steps=accum, **STEP_KW, **loss_kw)
    data = tiny_tokenized(rows=8)
    batch = data.padded_rows()
    mesh = sharding.make_mesh(mesh_spec, devices)
    target, draft = TargetModel(tc), DraftModel(dc)
    # Adam's first update is lr * g / (|g| + eps): with the default eps a gradient entry of 1e-7 (pure
    # rounding noise between reduction orders) moves by ~lr either way. eps 1e-4 keeps the update a smooth
    # function of the gradient, so the comparison checks the sharded step rather than Adam's sign function.
    optimizer, _ = make_optimizer(1e-3, total_steps=10, warmup_ratio=0.0, eps=1e-4)
    with jax.set_mesh(mesh):
        tp = jax.device_put(tp, sharding.tree_shardings(tp, mesh))
        state = init_train_state(dp, optimizer, seed=0)
        state_sh = sharding.tree_shardings(state, mesh)
        state = jax.device_put(state, state_sh)
        batch = sharding.global_batch_from_local(batch, mesh, 8)
        step = make_train_step(target, draft, cfg, optimizer)

        def step_and_gradients(state, tp, batch):
            # The step's own gradients (its key, under its precision policy) beside the step itself: one
            # program, one compile a run instead of two (measured 38 -> 25 s for a pair of runs on XLA:CPU).
            key = jax.random.fold_in(state.key, state.step)
            grads, _ = accumulated_gradients(state.params, tp, batch, key, target, draft, cfg)
            return grads, *step(state, tp, batch)

        compiled = jax.jit(with_precision_policy(step_and_gradients, draft.dtype),
                           out_shardings=(None, state_sh, None)).lower(state, tp, batch).compile()
        grads, new_state, metrics = compiled(state, tp, batch)
        hlo = compiled.as_text()
        kinds = {str(x.sharding.spec) for x in jax.tree.leaves(new_state.params)}
    return (float(metrics["loss"]), jax.device_get(grads), jax.device_get(new_state.params), len(mesh.devices.flat),
            sorted(kinds), full_batch_collectives(hlo, rows=8))


def full_batch_collectives(hlo: str, rows: int) -> list[str]:
    """Collectives of a compiled per-device program whose result holds all ``rows`` sequences of the global
    batch (leading dimension, or the second one under a scan's stacked dimension; no weight of the tiny
    models has such a dimension), outside the frozen target's forward (whose layout is left to XLA)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line)
        op = re.search(r'op_name="([^"]*)"', line)
        if (m and "TargetModel" not in (op.group(1) if op else "")
                and any(full_batch([int(d) for d in dims.split(",")], rows)
                        for dims in re.findall(r"[a-z]+\d*\[([\d,]+)\]", m.group(1)))):
            found.append(f"{m.group(2)} {m.group(1)} {op.group(1) if op else ''}")
    return found


def full_batch(dims: list[int], rows: int) -> bool:
    return (len(dims) >= 2 and dims[0] == rows) or (len(dims) >= 3 and dims[1] == rows)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_abs(tree):
    return max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(tree))


devs = jax.devices()
# Sharding alone (two meshes) and with 4 accumulation micro-steps, against one device without them: a fault in
# the accumulation shows in devices8_accum4 (there is no separate 1-device accumulation run).
one = run("data=1", devs[:1], 1)
eight = run("data=2,fsdp=2,tensor=2", devs, 1)
eight_accum = run("data=2,fsdp=2,tensor=2", devs, 4)
fsdp = run("fsdp=8", devs, 1)
out = {"devices": [one[3], eight[3]], "loss": one[0], "sharded_specs": eight[4],
       "full_batch_collectives": {"data=2,fsdp=2,tensor=2": eight[5], "fsdp=8": fsdp[5]}}
for name, other in (("devices8", eight), ("devices8_accum4", eight_accum), ("fsdp8", fsdp)):
    out[name] = {"loss": abs(other[0] - one[0]), "grads": max_diff(other[1], one[1]),
                 "params": max_diff(other[2], one[2])}
# The mixed loss (cross-entropy + KL) with D-PACE's position weights on a DFlash2 draft: its KL sums, D-PACE's
# weights and the selector's sums must add up over devices and micro-steps just the same (the KL loss alone is
# no longer run here: its sums are the ce+kl run's KL part).
KL_DPACE = dict(loss="ce+kl", kl_weight=0.3, temperature=0.8, position_weights="dpace", dflash2=True)
mixed = run("data=1", devs[:1], 1, **KL_DPACE)
other = run("data=2,fsdp=2,tensor=2", devs, 4, **KL_DPACE)
out["ce+kl,dpace/devices8_accum4"] = {"loss": abs(other[0] - mixed[0]) / abs(mixed[0]),
                                      "grads": max_diff(other[1], mixed[1]), "params": max_diff(other[2], mixed[2]),
                                      "grad_scale": max_abs(mixed[1])}
print(json.dumps(out))
