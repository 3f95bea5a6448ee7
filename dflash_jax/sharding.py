"""The device mesh and the ONE table of sharding rules, shared by training and inference.

Parameters are nested dicts whose paths mirror the Hugging Face names, so sharding is a lookup: a parameter
path matches a pattern of ``PARAM_RULES`` and gets one *logical* axis name per dimension (``embed``, ``heads``,
``mlp``, ``vocab``, ``experts`` ...); ``LOGICAL_TO_MESH`` maps logical axes to the mesh axes ``data``,
``fsdp``, ``tensor`` and ``expert`` (as MaxText's ``logical_axis_rules`` and jax-llm-examples'
``ShardingRules`` do). The expert axis splits a mixture-of-experts layer's experts (expert parallelism);
activations are replicated over it, so each device computes its own experts' share and XLA sums them. Target and draft
use the same table: their layers have the same names.

A dimension that the mesh axis does not divide is replicated instead (tiny test models on 8 devices, a KV
projection narrower than the tensor axis): sharding only changes where bytes live, never the result.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dflash_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# (pattern on "/".join(path), logical axis of each dimension). Flax kernels are [in, out].
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"q_proj/kernel$", ("embed", "heads")),
    (r"[kv]_proj/kernel$", ("embed", "kv_heads")),
    (r"q_proj/bias$", ("heads",)),
    (r"[kv]_proj/bias$", ("kv_heads",)),
    (r"o_proj/kernel$", ("heads", "embed")),
    (r"o_proj/bias$", ("embed",)),
    (r"self_attn/gate_proj/kernel$", ("embed", "heads")),  # Muse Glimmer's output gate, one unit per head dim
    # Multi-head latent attention (models/mla.py): the low-rank down-projections [H, rank] (the latent every head
    # shares, and the query's) split like any weight over fsdp and whole over tensor; the up-projections
    # [rank, heads * ...] by their heads over tensor, as q_proj and o_proj are. The latent cache has one head:
    # replicated over tensor (``spec_for``: 1 is not divisible), rows over the data axes.
    (r"self_attn/(q_a_proj|kv_a_proj_with_mqa)/kernel$", ("embed", None)),
    (r"self_attn/(q_a_proj|kv_a_proj_with_mqa)/bias$", (None,)),
    (r"self_attn/(q_b_proj|kv_b_proj)/kernel$", (None, "heads")),
    # GLM-5's DSA indexer (models/dsa_indexer.py): its query heads over tensor like q_b_proj's (the head-weighted
    # score sum then reduces across the axis); its single key and the per-head weights [H, ...] like the latent's
    # down-projection; k_norm's weight falls to the norm rule, its bias is replicated with it.
    (r"self_attn/indexer/wq_b/kernel$", (None, "heads")),
    (r"self_attn/indexer/(wk|weights_proj)/kernel$", ("embed", None)),
    (r"self_attn/indexer/k_norm/bias$", ("norm",)),
    (r"(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"(gate|up)_proj/bias$", ("mlp",)),
    (r"down_proj/kernel$", ("mlp", "embed")),
    (r"down_proj/bias$", ("embed",)),
    (r"(^|/)fc/kernel$", ("features", "embed")),  # the draft's feature fusion [n * H, H]
    # Mixture-of-experts layers (models/experts.py): stacked experts [E, in, out] split over the expert axis.
    (r"mlp/(gate|router)/kernel$", ("embed", None)),  # the router [H, E]: small, replicated over experts
    (r"mlp/router/bias$", (None,)),
    # MiniMax-M2's and DeepSeek-V3's selection bias [E]: replicated like the router
    (r"mlp/e_score_correction_bias$", (None,)),
    # Gemma 4's router beside the dense MLP (``moe/router``): [H, E] like the others, its input scale [H] and
    # per-expert scale [E] replicated; its experts follow the stacked-expert rules below.
    (r"moe/router/proj/kernel$", ("embed", None)),
    (r"moe/router/(scale|per_expert_scale)$", (None,)),
    (r"experts/(gate|up)_proj$", ("experts", "embed", "mlp")),
    (r"experts/down_proj$", ("experts", "mlp", "embed")),
    (r"experts/(gate|up)_proj_bias$", ("experts", "mlp")),
    (r"experts/down_proj_bias$", ("experts", "embed")),
    # gpt-oss's MXFP4 experts kept packed (models/mxfp4): blocks [E, out, in/32, 16], scales [E, out, in/32].
    # gate/up: the rows (output features, the intermediate units) over every weight-splitting axis, the input
    # groups whole. down: split like the float down_proj [E, I, H] is, its input I (here the groups of 32)
    # over tensor and its rows H over fsdp, so that each tensor shard multiplies its own intermediate units
    # and the partial sums reduce once, instead of gathering the decoded weights or the activations. A tensor
    # axis that does not divide I/32 (gpt-oss: 90 groups; tensor 4 or 8) leaves the groups whole: replicated
    # over tensor, still exact.
    (r"experts/(gate|up)_proj_blocks$", ("experts", "packed_rows", None, None)),
    (r"experts/(gate|up)_proj_scales$", ("experts", "packed_rows", None)),
    (r"experts/down_proj_blocks$", ("experts", "embed", "mlp", None)),
    (r"experts/down_proj_scales$", ("experts", "embed", "mlp")),
    # FP8 / INT4 experts kept quantised (models/quantized_experts): codes [E, out, in or in/8] and scales
    # [E, out/bn, in/bk], rows first, split like the float weights they decode to (gate/up [E, H, I] over
    # (embed, mlp), so their rows I over tensor and inputs H over fsdp; down the other way round). Codes and
    # scales split alike (``tree_shardings`` gives the codes their scales' split), so every device holds whole
    # blocks and decodes its own slice; a grid dimension the mesh does not divide is whole on every device.
    (r"experts/(gate|up)_proj_(qweight|qscale)$", ("experts", "mlp", "embed")),
    (r"experts/down_proj_(qweight|qscale)$", ("experts", "embed", "mlp")),
    (r"shared_expert_gate/kernel$", ("embed", None)),
    (r"self_attn/sinks$", ("heads",)),
    (r"/layer_scalar$", (None,)),  # Gemma 4's stored per-layer output scale [1]
    # Gated DeltaNet (hybrid targets): projections into the linear heads' channels over tensor (like an MLP's
    # hidden units), the depthwise conv per channel, the per-head decay parameters replicated (tiny).
    (r"linear_attn/in_proj_(qkv|z|b|a)/kernel$", ("embed", "linear")),
    (r"linear_attn/out_proj/kernel$", ("linear", "embed")),
    (r"linear_attn/conv1d/weight$", ("linear", None, None)),
    (r"linear_attn/(A_log|dt_bias)$", (None,)),
    # DFlash2 drafts (models/dflash2.py): the block convolutions' kernels per channel, the selector's
    # codebooks over the vocabulary like the head and, being trained, over fsdp by their rank (left whole, a
    # Qwen3-8B draft's two [151936, 256] codebooks and their Adam moments took 0.9 GB on every device of
    # fsdp=8); the low-rank factors are small and stay whole.
    (r"_conv/base_kernel$", (None, None, "embed")),
    (r"_conv/kernel_projection/kernel$", ("embed", None)),
    (r"candidate_selector/(predecessor|successor)_codebook$", ("vocab", "embed")),
    (r"candidate_selector/hidden_projection/kernel$", ("embed", None)),
    # DSpark's heads (models/dspark.py): the Markov head's tables split over the vocabulary as the embedding's;
    # its gate and the confidence head are small and stay whole
    (r"markov_head/markov_w1/embedding$", ("vocab", None)),
    (r"markov_head/markov_w2/kernel$", (None, "vocab")),
    (r"markov_head/gate_proj/kernel$", (None, None)),
    (r"markov_head/gate_proj/bias$", (None,)),
    (r"confidence_head/proj/kernel$", (None, None)),
    (r"confidence_head/proj/bias$", (None,)),
    # Every RMSNorm (layer norms, q/k norms, final and hidden norms, DeltaNet's), replicated: also MiniMax-M2's
    # q/k norms over the whole projection ([heads * head_dim]; their RMS is reduced over the tensor axis).
    # Gemma 4's numbered FFN norms (``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_1`` / ``_2``).
    (r"norm(_\d)?/weight$", ("norm",)),
)

LOGICAL_TO_MESH: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "linear": "tensor",
    "experts": "expert",
    # Packed MXFP4 gate/up rows (output features) over every weight-splitting axis: their input axis is stored
    # in groups of 32 (90 groups for gpt-oss's 2880), which 8 devices do not divide.
    "packed_rows": ("fsdp", "tensor"),
    "features": None,
    "norm": None,
    "length": None,
}


def parse_mesh(spec: str | Mapping[str, int] | None, num_devices: int | None = None) -> dict[str, int]:
    """``"data=2,fsdp=4"`` or a mapping -> sizes of all four axes; one axis may be ``-1`` (the rest of the
    devices). Axes left out have size 1, except that with no spec at all every device goes to ``data``."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    if spec is None or spec == "" or spec == {}:
        return {"data": num_devices, **{a: 1 for a in MESH_AXES[1:]}}
    if isinstance(spec, str):
        sizes: dict[str, Any] = {}
        for part in spec.split(","):
            name, sep, value = part.strip().partition("=")
            if not sep:
                raise UserError(f"mesh {spec!r}: expected axis=size pairs like 'data=2,fsdp=4', got {part!r}")
            try:
                sizes[name.strip()] = int(value)
            except ValueError:
                raise UserError(f"mesh {spec!r}: size of axis {name.strip()!r} must be an integer, got {value!r}") from None
    else:
        sizes = dict(spec)
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise UserError(f"mesh {spec!r}: unknown axis {unknown[0]!r} (axes: {', '.join(MESH_AXES)})")
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise UserError(f"mesh {spec!r}: axis {name!r} must be a positive integer or -1, got {size!r}")
    sizes = {name: sizes.get(name, 1) for name in MESH_AXES}
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise UserError(f"mesh {spec!r}: only one axis may be -1")
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    if free:
        if num_devices % fixed:
            raise UserError(f"mesh {spec!r}: {num_devices} devices are not divisible by {fixed}")
        sizes[free[0]] = num_devices // fixed
    total = int(np.prod(list(sizes.values())))
    if total != num_devices:
        shown = ",".join(f"{n}={s}" for n, s in sizes.items())
        raise UserError(f"mesh {shown} needs {total} devices, but {num_devices} are available")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor, expert) over all devices (all processes), with automatic sharding."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, path):
            if len(axes) != ndim:
                raise ValueError(f"sharding rule {pattern!r} names {len(axes)} axes but {path} has {ndim}")
            return axes
    raise ValueError(f"no sharding rule matches parameter {path!r} (add one to dflash_jax.sharding.PARAM_RULES)")


def spec_for(shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of an array with the given logical axes; dims the mesh does not divide replicate."""
    parts: list[Any] = []
    used: set[str] = set()
    for size, logical in zip(shape, axes):
        mesh_axes = LOGICAL_TO_MESH.get(logical) if logical else None
        names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        names = tuple(n for n in names if mesh.shape[n] > 1 and n not in used)
        if names and size % int(np.prod([mesh.shape[n] for n in names])) == 0:
            parts.append(names[0] if len(names) == 1 else names)
            used.update(names)
        else:
            parts.append(None)
    return PartitionSpec(*parts)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a params tree or a whole train state (real or abstract arrays): every leaf that a
    rule matches (params, and the optimizer's moments, whose paths end like the params') is sharded like its
    parameter; scalars and the RNG key replicate. Quantised expert codes (``*_qweight``) are split exactly as
    their scales (``*_qscale``) are: a code dimension is a whole multiple of its scale-grid dimension, and
    splitting the codes where the grid does not divide (MiniMax-M2's 12 blocks of 128 over tensor=8) would
    leave each device a part of a block whose scale it lacks, so XLA would gather the decoded weights."""
    shapes = {_path_str(path): np.shape(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}

    def one(path, leaf):
        shape, name = np.shape(leaf), _path_str(path)
        if len(shape) <= 1 and not any(re.search(p, name) for p, _ in PARAM_RULES):
            return replicated(mesh)
        axes = logical_axes(name, len(shape))
        scale = name[:-len("qweight")] + "qscale" if name.endswith("_qweight") else None
        if scale in shapes and len(shapes[scale]) == len(shape):
            return NamedSharding(mesh, spec_for(shapes[scale], axes, mesh))
        return NamedSharding(mesh, spec_for(shape, axes, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) dimension over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_TO_MESH["batch"], *([None] * (ndim - 1))))


def constrain_batch(x: jax.Array, residual: bool = False) -> jax.Array:
    """Pin an activation's leading (batch) dimension to data x fsdp under the mesh the computation is traced
    with (``jax.set_mesh``). ``residual``: the rest is replicated (a residual stream, whole on every device of
    the tensor axis as in Megatron-style tensor parallelism), else left to XLA (the tensor axis may split
    heads, the MLP or the vocabulary). Without such constraints XLA lays activations out like the
    fsdp-sharded weights they meet (hidden dimension over the devices): every device then computes every
    sequence and activations are all-reduced (docs/results-training.md). No mesh in context, or a batch
    the axes do not divide: unchanged."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or x.ndim == 0:
        return x
    names = tuple(a for a in LOGICAL_TO_MESH["batch"] if a in mesh.shape and mesh.shape[a] > 1)
    if not names or x.shape[0] % int(np.prod([mesh.shape[a] for a in names])):
        return x
    rest = None if residual else PartitionSpec.UNCONSTRAINED
    return jax.lax.with_sharding_constraint(x, PartitionSpec(names, *([rest] * (x.ndim - 1))))


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` (ids batch-first), batch-sharded under a mesh in context. The table is first constrained
    to its vocabulary sharding alone (the fsdp-sharded hidden dimension gathered, as for any fsdp weight), so
    that the lookup is vocabulary-parallel: XLA's partitioner cannot turn a gather from a table split over
    both dimensions into batch-sharded rows without replicating them (measured: a full-batch all-gather of
    the embeddings on a data x fsdp x tensor mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and table.ndim == 2:
        vocab = LOGICAL_TO_MESH["vocab"]
        split = vocab in mesh.shape and mesh.shape[vocab] > 1 and table.shape[0] % mesh.shape[vocab] == 0
        table = jax.lax.with_sharding_constraint(table, PartitionSpec(vocab if split else None, None))
    return constrain_batch(jnp.take(table, ids, axis=0), residual=True)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(host_array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array built shard by shard from a host (or memory-mapped) array: each device receives only
    its slice, so a large checkpoint never needs a full copy per device."""
    return jax.make_array_from_callback(np.shape(host_array), sharding, lambda index: np.asarray(host_array[index]))


def global_batch_from_local(local: Mapping[str, np.ndarray], mesh: Mesh, global_batch: int) -> dict[str, jax.Array]:
    """Assemble per-process host rows into global batch-sharded arrays."""
    out = {}
    for name, array in local.items():
        sharding = batch_sharding(mesh, np.ndim(array))
        shape = (global_batch,) + tuple(np.shape(array)[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, np.asarray(array), shape)
    return out


def kv_replicas(num_kv_heads: int, num_heads: int, mesh: Mesh | None) -> int:
    """How many times to keep each KV head in a cache so that the heads split over the ``tensor`` axis: a model
    with 4 KV heads (and 32 query heads) on ``tensor=8`` keeps each twice, and every device holds one head
    instead of all four (replicated, the whole cache would sit on every device). 1 where the heads already
    divide the axis, or where no whole number of copies makes them (the copies must also split each KV
    head's group of query heads evenly)."""
    tensor = int(mesh.shape.get("tensor", 1)) if mesh is not None else 1
    if num_kv_heads >= tensor or tensor % num_kv_heads:
        return 1
    copies = tensor // num_kv_heads
    return copies if (num_heads // num_kv_heads) % copies == 0 else 1
