"""gpt-oss with its MXFP4 expert weights kept packed on the device (``load_target(..., experts="packed")``).

A tiny gpt-oss checkpoint whose experts are stored as released gpt-oss stores them (``gate_up_proj_blocks`` /
``_scales``, ``down_proj_blocks`` / ``_scales``, uint8), with the transformers model set to transformers' own
dequantisation of those tensors (``integrations.mxfp4.convert_moe_packed_tensors``) as the reference. Loading
it packed and dequantised must give the same logits (1e-5), both transformers' logits (1e-4), and identical
greedy tokens; the packed params are uint8 at 4.25 bits per expert weight.
"""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.numpy import load_file, save_file  # noqa: E402

from dflash_jax import sharding  # noqa: E402
from dflash_jax.checkpoints.expert_layouts import with_packed_experts  # noqa: E402
from dflash_jax.checkpoints.hf_target import abstract_target_params, load_target, save_target  # noqa: E402
from dflash_jax.checkpoints.safetensors_io import CheckpointError, flatten  # noqa: E402
from dflash_jax.engine.decoder import Decoder  # noqa: E402
from dflash_jax.models import mxfp4  # noqa: E402
from dflash_jax.models.experts import force_expert_path  # noqa: E402
from dflash_jax.models.target import TargetModel  # noqa: E402
from hf_tiny import make_hf_target  # noqa: E402

PROMPT_LENGTHS = (5, 11, 17)
# Scales 2 ** (s - 127) for s in [120, 126): weights up to 6 * 2 ** -2, typically ~0.03-0.1, comparable to the
# float tiny models (0.15 * randn), so three expert layers keep activations (and the 1e-4 tolerance) sensible.
SCALE_RANGE = (120, 126)


def _pack(rng, in_f, out_f, e):
    blocks_shape, scales_shape = mxfp4.packed_shapes(in_f, out_f, e)
    blocks = rng.integers(0, 256, size=blocks_shape, dtype=np.uint8)
    scales = rng.integers(*SCALE_RANGE, size=scales_shape, dtype=np.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(float-expert dir, MXFP4 dir, the transformers model holding the MXFP4 dir's decoded weights)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    float_dir = tmp_path_factory.mktemp("gpt_oss_float")
    hf_model = make_hf_target("gpt_oss", float_dir)
    packed_dir = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    for f in float_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, packed_dir / f.name)
    tensors = load_file(str(float_dir / "model.safetensors"))
    rng = np.random.default_rng(0)
    params = dict(hf_model.named_parameters())
    for layer in range(hf_model.config.num_hidden_layers):
        base = f"model.layers.{layer}.mlp.experts"
        for fused in ("gate_up_proj", "down_proj"):
            param = params[f"{base}.{fused}"]  # transformers' [E, in, out]: [E, H, 2I] / [E, I, H]
            e, in_f, out_f = param.shape
            blocks, scales = _pack(rng, in_f, out_f, e)
            del tensors[f"{base}.{fused}"]
            tensors[f"{base}.{fused}_blocks"], tensors[f"{base}.{fused}_scales"] = blocks, scales
            decoded = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32)
            assert tuple(decoded.shape) == tuple(param.shape)  # transformers' orientation is the parameter's
            np.testing.assert_array_equal(decoded.numpy(), mxfp4.dequantize(blocks, scales))
            with torch.no_grad():
                param.copy_(decoded)
    save_file(tensors, str(packed_dir / "model.safetensors"), metadata={"format": "pt"})
    return float_dir, packed_dir, hf_model


@pytest.fixture(scope="module")
def loaded(ckpts):
    _, packed_dir, _ = ckpts
    return load_target(packed_dir), load_target(packed_dir, experts="packed")


def _batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n) for n in PROMPT_LENGTHS]


def _logits(config, params, rows):
    t = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), t), np.int32)
    valid = np.zeros((len(rows), t), bool)
    for b, r in enumerate(rows):
        tokens[b, : len(r)], valid[b, : len(r)] = r, True
    positions = np.broadcast_to(np.arange(t), tokens.shape)
    out = jax.jit(TargetModel(config).apply)({"params": params}, tokens, positions, valid=valid)
    return np.asarray(out.logits)


def test_packed_and_dequantized_logits_match_each_other_and_transformers(ckpts, loaded):
    _, _, hf_model = ckpts
    (config_d, params_d), (config_p, params_p) = loaded
    assert config_d.experts.weight_format == "float" and config_p.experts.weight_format == "mxfp4"
    rows = _batch(config_d.vocab_size)
    ours_d = _logits(config_d, params_d, rows)
    for path in ("dense", "grouped", "routed"):  # routed: only the routed experts' blocks decoded
        with force_expert_path(path):
            ours_p = _logits(config_p, params_p, rows)
        np.testing.assert_allclose(ours_p, ours_d, atol=1e-5, rtol=0)
    for b, r in enumerate(rows):
        with torch.no_grad():
            ref = hf_model(torch.tensor(r)[None]).logits[0].numpy()
        np.testing.assert_allclose(ours_p[b, : len(r)], ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(ours_d[b, : len(r)], ref, atol=1e-4, rtol=0)


def test_packed_params_are_uint8_at_4_25_bits_per_weight(loaded):
    (_, params_d), (config_p, params_p) = loaded
    flat_d, flat_p = flatten(params_d), flatten(params_p)
    weights = ("gate_proj", "up_proj", "down_proj")
    float_bytes = sum(v.nbytes for k, v in flat_d.items() if k[-2] == "experts" and k[-1] in weights)
    packed = {k: v for k, v in flat_p.items() if k[-2] == "experts" and k[-1].endswith(("_blocks", "_scales"))}
    assert len(packed) == 6 * config_p.num_hidden_layers
    assert all(v.dtype == np.uint8 for v in packed.values())
    assert not any(k[-1] in weights for k in flat_p)  # no float copy of the experts
    assert sum(v.nbytes for v in packed.values()) / float_bytes == pytest.approx(4.25 / 32)  # float32 -> MXFP4
    # Everything else (biases included) is the same float32 tensor either way.
    rest = {k: v for k, v in flat_p.items() if k not in packed}
    assert set(rest) == {k for k in flat_d if not (k[-2] == "experts" and k[-1] in weights)}
    for k, v in rest.items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flat_d[k]))
    # The abstract tree of the packed config declares the same uint8 shapes (jax.eval_shape of init).
    abstract = flatten(abstract_target_params(config_p))
    assert {k: (v.shape, v.dtype) for k, v in abstract.items()} == {k: (v.shape, v.dtype) for k, v in flat_p.items()}
    # Rows of gate/up are the deinterleaved output features: gate = even rows of the stored gate_up blocks.
    e, i = config_p.experts.num_experts, config_p.experts.intermediate_size
    gate = flat_p[("layers_0", "mlp", "experts", "gate_proj_blocks")]
    assert gate.shape == (e, i, config_p.hidden_size // 32, 16)


def test_packed_params_have_sharding_rules(loaded):
    _, (_, params_p) = loaded
    for name in ("gate", "up"):
        assert sharding.logical_axes(f"layers_0/mlp/experts/{name}_proj_blocks", 4) == (
            "experts", "packed_rows", None, None)
        assert sharding.logical_axes(f"layers_0/mlp/experts/{name}_proj_scales", 3) == ("experts", "packed_rows", None)
    # down_proj [E, H rows, I/32 groups, 16]: split on its input (the groups) like the float down_proj [E, I, H].
    down = sharding.logical_axes("layers_0/mlp/experts/down_proj_blocks", 4)
    assert down == ("experts", "embed", "mlp", None)
    assert sharding.logical_axes("layers_0/mlp/experts/down_proj_scales", 3) == ("experts", "embed", "mlp")
    # gpt-oss-120b's gate blocks [128, 2880, 90, 16] on fsdp=8: the rows split (90 input groups would not).
    from jax.sharding import PartitionSpec
    abstract_mesh = jax.sharding.AbstractMesh((1, 8, 1, 1), sharding.MESH_AXES)
    assert sharding.spec_for((128, 2880, 90, 16), ("experts", "packed_rows", None, None), abstract_mesh) == \
        PartitionSpec(None, "fsdp", None, None)
    # Its down blocks on fsdp=4, tensor=2: the input groups over tensor and the rows over fsdp, the mesh axes of
    # the float down_proj's I and H; tensor=8 does not divide the 90 groups, which then stay whole (replicated).
    mesh_42 = jax.sharding.AbstractMesh((1, 4, 2, 1), sharding.MESH_AXES)
    assert sharding.spec_for((128, 2880, 90, 16), down, mesh_42) == PartitionSpec(None, "fsdp", "tensor", None)
    assert sharding.spec_for((128, 2880, 2880), sharding.logical_axes("layers_0/mlp/experts/down_proj", 3),
                             mesh_42) == PartitionSpec(None, "tensor", "fsdp")
    mesh_8 = jax.sharding.AbstractMesh((1, 1, 8, 1), sharding.MESH_AXES)
    assert sharding.spec_for((128, 2880, 90, 16), down, mesh_8) == PartitionSpec(None, None, None, None)
    mesh = sharding.make_mesh(None, jax.devices()[:1])
    sharding.tree_shardings(params_p, mesh)  # every packed leaf matches a rule


def test_engine_greedy_tokens_identical_packed_vs_dequantized(loaded):
    (config_d, params_d), (config_p, params_p) = loaded
    batch = _batch(config_d.vocab_size, seed=2)
    ours_d = Decoder(config_d, params_d).generate(batch, 16, baseline=True).tokens
    ours_p = Decoder(config_p, params_p).generate(batch, 16, baseline=True).tokens
    assert ours_p == ours_d
    assert all(len(row) == 16 for row in ours_p)


def test_packed_experts_loaded_in_a_platform_layout_decode_the_same(ckpts, loaded, monkeypatch):
    """Where ``experts.PACKED_LAYOUTS`` names a layout for the platform (TPUs; here the CPU, patched in), the
    loader stores the packed blocks and scales in it, the compiled programs take them as stored, and the
    engine's greedy tokens and the logits of every expert path are those of the default layout (the CPU honours
    device layouts, so this runs the real relayout and the real layout-taking compile)."""
    from dflash_jax.models import experts

    _, packed_dir, _ = ckpts
    (config_d, params_d), (config_p, params_p) = loaded
    monkeypatch.setitem(experts.PACKED_LAYOUTS, "cpu", {"_blocks": (0, 2, 3, 1), "_scales": (0, 2, 1)})
    config_l, params_l = load_target(packed_dir, experts="packed")
    flat = flatten(params_l)
    packed = {k: v for k, v in flat.items() if k[-1].endswith(("_blocks", "_scales"))}
    assert packed and {v.format.layout.major_to_minor for v in packed.values()} == {(0, 2, 3, 1), (0, 2, 1)}
    assert all(v.format.layout.major_to_minor == tuple(range(v.ndim)) for k, v in flat.items() if k not in packed)
    for k, v in packed.items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flatten(params_p)[k]))
    rows = _batch(config_d.vocab_size)
    for path in ("dense", "grouped", "routed"):
        with force_expert_path(path):
            np.testing.assert_array_equal(_logits(config_l, params_l, rows), _logits(config_p, params_p, rows))
    batch = _batch(config_d.vocab_size, seed=2)
    assert (Decoder(config_l, params_l).generate(batch, 16, baseline=True).tokens
            == Decoder(config_p, params_p).generate(batch, 16, baseline=True).tokens)


def test_packed_on_float_experts_is_one_clear_error(ckpts, loaded):
    float_dir, _, _ = ckpts
    with pytest.raises(CheckpointError) as err:
        load_target(float_dir, experts="packed")
    message = str(err.value)
    assert str(float_dir / "model.safetensors") in message
    assert "tensor 'model.layers.0.mlp.experts." in message and "float expert weights" in message
    assert "_blocks" in message and "experts='dequantize'" in message
    with pytest.raises(CheckpointError, match="experts must be one of"):
        load_target(float_dir, experts="fp4")
    (config_d, _), (config_p, params_p) = loaded
    qwen = dataclasses.replace(config_d, model_type="qwen3_moe")
    with pytest.raises(CheckpointError, match="float weights"):  # a qwen3_moe without quantization_config
        with_packed_experts(qwen, "packed")
    with pytest.raises(CheckpointError, match="experts='dequantize' to save"):
        save_target(config_p, params_p, float_dir.parent / "never_written")


def test_float_checkpoint_still_loads_dequantize_default(ckpts):
    float_dir, _, _ = ckpts
    config, params = load_target(float_dir)
    assert config.experts.weight_format == "float"
    assert json.loads((float_dir / "config.json").read_text())["model_type"] == "gpt_oss"
    assert flatten(params)[("layers_0", "mlp", "experts", "gate_proj")].dtype == np.float32


def test_trainer_step_takes_packed_experts_in_their_stored_layout(ckpts, loaded, monkeypatch):
    """The trainer's step compiles for the layout the loader stored the target's packed codes in (jit follows a
    committed argument's layout where its ``in_shardings`` name only a sharding), so the frozen target is not
    relaid every step. Checked with the layout table patched to the CPU, which honours layouts: the compiled
    step's input layouts are the stored ones, and one step from the same state gives the same loss and draft
    params as the default-layout target (the codes are the same bytes)."""
    from draft_tiny import official_config
    from train_tiny import STEP_KW, tiny_tokenized

    from dflash_jax.checkpoints.official_draft import init_draft_params
    from dflash_jax.models import experts
    from dflash_jax.models.draft_config import DraftConfig
    from dflash_jax.training.step import StepConfig, make_optimizer
    from dflash_jax.training.trainer import Run

    _, packed_dir, _ = ckpts
    _, (config_p, params_p) = loaded
    monkeypatch.setitem(experts.PACKED_LAYOUTS, "cpu", {"_blocks": (0, 2, 3, 1), "_scales": (0, 2, 1)})
    _, params_l = load_target(packed_dir, experts="packed")
    draft_config = DraftConfig.from_dict(official_config(
        vocab_size=config_p.vocab_size, num_target_layers=config_p.num_hidden_layers,
        dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 96}))  # every layer used
    optimizer, schedule = make_optimizer(1e-3, total_steps=2, warmup_ratio=0.0)
    mesh = sharding.make_mesh(None, jax.devices()[:1])
    batch = sharding.global_batch_from_local(tiny_tokenized(rows=4).padded_rows(), mesh, 4)

    def one_step(target_params):
        run = Run(cfg={"train": {"seed": 0}}, mesh=mesh, dtype=np.float32, target_config=config_p,
                  target_params=target_params, draft_config=draft_config,
                  init_params=init_draft_params(draft_config, seed=1), tokenized=None, eval_prompts=None,
                  stop_tokens=[], step_cfg=StepConfig(feature_layers=draft_config.target_layer_ids, **STEP_KW),
                  optimizer=optimizer, schedule=schedule, total_steps=2, fingerprint={})
        with jax.set_mesh(mesh):
            state_sh = sharding.tree_shardings(run.abstract_state(), mesh)
            step = run.jitted_step(state_sh)
            state = run.initial_state(state_sh)
            compiled = step.lower(state, target_params, batch).compile()
            new_state, metrics = step(state, target_params, batch)
        return compiled.input_formats[0][1], float(metrics["loss"]), jax.device_get(new_state.params)

    formats, loss_l, draft_l = one_step(params_l)
    _, loss_p, draft_p = one_step(params_p)
    stored = {k: v.format.layout.major_to_minor for k, v in flatten(params_l).items()
              if k[-1].endswith(("_blocks", "_scales"))}
    compiled = {k: v.layout.major_to_minor for k, v in flatten(formats).items() if k in stored}
    assert compiled == stored and set(stored.values()) == {(0, 2, 3, 1), (0, 2, 1)}
    assert loss_l == loss_p
    for a, b in zip(jax.tree.leaves(draft_l), jax.tree.leaves(draft_p)):
        np.testing.assert_array_equal(a, b)
