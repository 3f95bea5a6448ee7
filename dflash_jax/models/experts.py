"""The mixture-of-experts FFN of Qwen3-MoE, gpt-oss, MiniMax-M2, Gemma 4 and DeepSeek-V3 / Kimi K2 (and
Qwen3-Next/Qwen3.5's gated shared expert, DeepSeek-V3's ungated ``shared_experts``).

Dropless and exact: every token goes to its ``top_k`` experts, no capacity factor, nothing dropped, so the
target computes the same function as transformers' reference and DFlash stays lossless. Three ways to compute
the routed experts give the same result (tested against each other, tests/test_expert_paths.py):

- ``dense``: every expert on every token, then each token keeps its k outputs (an einsum over all experts).
  Reads and computes all experts; exact and simple, the cheaper path on CPU for short prefill chunks.
- ``grouped``: the (token, k) pairs sorted by expert and one grouped matmul per projection, so the FLOPs
  follow ``tokens * top_k``: prefill and training at real sizes. TPUs run ``jax.lax.ragged_dot`` natively.
  GPUs run this project's Pallas (Triton) kernel, ``models/grouped_matmul``: XLA:GPU would lower
  ``ragged_dot`` to one GEMM over ALL experts (the tokens broadcast to ``[tokens, E, H]``), while the kernel
  multiplies each row tile by its own expert only and reads only the experts that have rows. CPUs keep
  ``ragged_dot``, which XLA:CPU expands to one product per expert over all rows: it reads every expert like
  ``dense``.
- ``routed``: each (token, k) pair through ITS expert's matrices (gathered, ``w[ids] -> [N * k, in, out]``,
  or read one pair at a time by a dynamic slice, per platform) with matrix-vector products: reads only the
  routed experts' weights on every backend, one expert per pair (repeats read again), so it pays for few
  pairs: decoding and verification (a block of ~16 tokens, top-4 of 32-128 experts). With MXFP4 weights the
  routed experts' uint8 blocks and scales are gathered first and only those are decoded (a round decodes
  ``N * k`` experts, not ``E``).

``expert_path`` chooses, per platform (``dflash_jax.platform.current_platform``) and static shape;
``force_expert_path`` pins one (tests, benchmarks).

Parameters (``[in, out]`` like Flax kernels, experts leading): ``gate/kernel [H, E]`` (Qwen3-MoE's router,
``router/kernel`` + ``router/bias`` for gpt-oss), ``experts/{gate,up}_proj [E, H, I]``,
``experts/down_proj [E, I, H]``, with ``experts/*_bias`` for gpt-oss and ``e_score_correction_bias [E]`` (the
selection-only router bias) for MiniMax-M2; ``shared_expert/*`` and
``shared_expert_gate/kernel [H, 1]`` for the shared-expert variant; Gemma 4's scaled router
(``ExpertsConfig.router_norm_eps``) is ``router/proj/kernel [H, E]``, ``router/scale [H]`` and
``router/per_expert_scale [E]``.

With ``ExpertsConfig.weight_format == "mxfp4"`` the three projections are instead kept packed as gpt-oss stores
them (``models/mxfp4``: uint8, 4.25 bits per weight), rows = output features:
``experts/{gate,up}_proj_blocks [E, I, H/32, 16]`` + ``_scales [E, I, H/32]``, ``experts/down_proj_blocks
[E, H, I/32, 16]`` + ``_scales [E, H, I/32]`` (biases stay float). ``ExpertWeights`` declares them and returns
a ``StackedExperts`` that decodes inside the traced layer, lazily per path: ``all()`` (dense, grouped) decodes
every expert to ``[E, in, out]`` as the float params are; ``gathered`` / ``expert`` (routed) decode only the
experts of the routed pairs. ``weight_format`` "fp8" / "int4" (block-scaled FP8, packed INT4: DeepSeek-V3,
Kimi K2.5-K2.7, GLM-5.1-FP8, MiniMax-M2) keeps the checkpoint's codes and scales the same way,
``experts/{proj}_qweight`` + ``_qscale`` (``models/quantized_experts``), decoded by the same lazy paths.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import flax.linen as nn
import jax
from jax.experimental.layout import Format, Layout, with_layout_constraint
import jax.numpy as jnp

from dflash_jax.models import mxfp4, quantized_experts
from dflash_jax.models.config import ExpertsConfig
from dflash_jax.models.layers import ACTIVATIONS, MLP, RMSNorm, float32_dot_general
from dflash_jax.platform import current_platform
from dflash_jax.sharding import LOGICAL_TO_MESH, logical_axes

# the mesh axes the sharding rules split the experts and the batch over
EXPERT_AXIS = LOGICAL_TO_MESH["experts"]
BATCH_AXES = LOGICAL_TO_MESH["batch"]
ROWS_AXIS = LOGICAL_TO_MESH["mlp"]  # splits each expert's intermediate units (tensor parallelism)

GPT_OSS_ALPHA = 1.702  # gpt-oss's GLU uses x * sigmoid(1.702 x)
# tokens * experts up to which CPU takes the dense path: a round number, not a measured crossover (measured on
# this project's 2-core CPU at 1,280 tokens x 4 experts: dense 8.8 ms, grouped 10.4 ms for a 4-layer target).
DENSE_LIMIT = 4096
PATHS = ("dense", "grouped", "routed")

# ``routed`` while tokens * top_k <= ROUTED_PAIRS_PER_EXPERT * num_experts, on every platform. Why 1:
# - GPU (deviceless compile for an H200, gpt-oss-120b's layer: hidden 2880, E 128, top-4, bf16, 16 tokens =
#   64 pairs): the gathered form fuses gather + product into one reduction that reads each pair's expert in
#   place (float: 1 MB of temporaries; packed: gather, decode and product in one fusion, only the per-group
#   scale factors written, 190 MB), while ``dense`` and ``grouped`` read all E (packed: decode all E to
#   bf16 first, 2.2 GB written and read again per projection). Routed reads N k experts, repeats included:
#   float breaks even at N k = E; packed routed moves ~6 bits per weight against dense's ~36, so it would
#   still win past E, but its product runs on CUDA cores, not tensor cores: E kept, unmeasured on a device.
#   (Measured against XLA:GPU's ``ragged_dot``; the GPU's grouped path is now a Pallas kernel that reads only
#   the experts with rows, on tensor cores, which may move this bound down: not measured on a device either.)
# - CPU (this project's 2-core machine, shared, so minima of 7 calls; one expert layer at gpt-oss-20b-like
#   shapes: hidden 2880, E 32, top-4, biases, clamped SwiGLU, intermediate 720/736 (a quarter of
#   gpt-oss-20b's, to fit), fp32, jitted; ms dense / routed):
#     float  tokens 1: 116 / 42   4: 286 / 120   8 (N k = E): 426 / 270   16: 494 / 535   32: 714 / 1131
#     mxfp4  tokens 1: 908 / 109                 8 (N k = E): 1377 / 981
#   so routed wins up to N k = E (float crosses between 1 and 2 E, packed near E).
# - TPU: not measured (no TPU here; deviceless v5p compiles of every path relayout the stacked weights, which
#   hides the difference): the bound of the GPU kept.
ROUTED_PAIRS_PER_EXPERT = 1
# The routed path's form (``routed_experts``) per (platform, packed weights): a loop over the pairs (True) or
# one gather. The gather everywhere but for float weights on CPU: GPU fuses it (above; a loop would launch 3
# small kernels per pair), and under a mesh XLA's partitioner splits a gather from expert- or fsdp-sharded
# weights into local gathers and one all-reduce of the [N k, H] outputs, while the loop's dynamic slices
# all-gather the whole stack of experts first (8-device compile of gpt-oss-width layers, expert=2, fsdp=2,
# tensor=2). On one CPU the gathered float slices are copied, the cost that dominates there: one projection
# at 32 pairs of the shapes above took 340 ms gathered vs 60-80 ms looped; packed, gathering uint8 is cheap
# and the gathered decode is one vectorised loop (109 vs 219 ms looped at 1 token, 981 vs 1643 ms at 8).
ROUTED_LOOP = {("cpu", False): True}

_forced_path: contextvars.ContextVar[str | None] = contextvars.ContextVar("expert_path", default=None)


@contextlib.contextmanager
def force_expert_path(path: str | None):
    """Trace expert layers with ``"dense"``, ``"grouped"`` or ``"routed"`` (None: choose by shape) inside the
    block."""
    if path is not None and path not in PATHS:
        raise ValueError(f"expert path must be one of {', '.join(map(repr, PATHS))} or None, got {path!r}")
    token = _forced_path.set(path)
    try:
        yield
    finally:
        _forced_path.reset(token)


def expert_path(num_tokens: int, num_experts: int, top_k: int) -> str:
    """The cheaper exact path for ``num_tokens`` tokens routed to ``top_k`` of ``num_experts`` experts, for the
    platform being traced for (``current_platform``; a static choice made while tracing, which
    ``force_expert_path`` overrides): ``routed`` while ``tokens * top_k <= ROUTED_PAIRS_PER_EXPERT *
    num_experts`` (decoding and verification: reading weights is the cost, and routed reads only the chosen
    experts'); past it, accelerators take ``grouped`` (TPU: native ``ragged_dot``; GPU: the Pallas grouped
    matmul of ``models/grouped_matmul``), CPU ``dense`` up to ``DENSE_LIMIT`` token x
    expert pairs (XLA:CPU expands ``ragged_dot`` into one product per expert over all rows) and ``grouped``
    past it, which bounds the ``[E, tokens, I]`` intermediates."""
    forced = _forced_path.get()
    if forced is not None:
        return forced
    if num_tokens * top_k <= ROUTED_PAIRS_PER_EXPERT * num_experts:
        return "routed"
    if current_platform() != "cpu":
        return "grouped"
    return "dense" if num_tokens * num_experts <= DENSE_LIMIT else "grouped"


def route(logits: jax.Array, cfg: ExpertsConfig, selection_bias: jax.Array | None = None,
          expert_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits ``[N, E]`` -> (weights ``[N, k]`` in float32, expert ids ``[N, k]``), decided in float32.
    ``selection_bias [E]`` (``cfg.selection_bias``, MiniMax-M2's and DeepSeek-V3's ``e_score_correction_bias``)
    is added to the scores to choose the k experts only (DeepSeek-V3: within the best groups,
    ``limit_to_groups``); their weights are the unbiased scores, renormalised, times
    ``cfg.routed_scaling_factor``. ``expert_scale [E]`` (Gemma 4's
    ``per_expert_scale``) multiplies each chosen expert's final weight.

    ``Experts`` computes the logits with float32 accumulation (bf16 inputs give exact products), so top-k and
    softmax never see logits rounded to the compute dtype. transformers rounds them first: Qwen3-MoE
    (``Qwen3MoeTopKRouter``) softmaxes the compute-dtype logits in float32; gpt-oss (``GptOssTopKRouter``,
    like OpenAI's reference) takes top-k of the compute-dtype logits and softmaxes them in that dtype. In
    float32 (every parity test) both are the same function. In bfloat16 we deliberately differ on near ties:
    bf16 keeps 8 significant bits, so with 32-128 experts two logits often round to the same value and the
    choice then depends on the accumulation order of the router matmul, which differs between a decode step,
    a verify block, a prefill chunk and a sharded layout; with float32 logits (16 more bits) such ties are
    about 65,000 times rarer, so the same token picks the same experts in all of them (DFlash's lossless
    check compares the target with itself), and those of the exact logits."""
    logits = logits.astype(jnp.float32)
    if cfg.routing in ("softmax_topk", "sigmoid_topk"):  # Qwen3-MoE: softmax over all experts, then the top k;
        # MiniMax-M2: each expert's sigmoid, then the top k (of the scores plus the selection bias)
        probs = jax.nn.softmax(logits, axis=-1) if cfg.routing == "softmax_topk" else jax.nn.sigmoid(logits)
        if selection_bias is None:
            weights, ids = jax.lax.top_k(probs, cfg.top_k)
        else:
            choice = probs + selection_bias.astype(jnp.float32)
            if cfg.topk_group < cfg.n_group:
                choice = limit_to_groups(choice, cfg.n_group, cfg.topk_group)
            _, ids = jax.lax.top_k(choice, cfg.top_k)
            weights = jnp.take_along_axis(probs, ids, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + cfg.norm_eps)
        if cfg.routed_scaling_factor != 1.0:  # DeepSeek-V3: after the renormalisation (or without one)
            weights = weights * cfg.routed_scaling_factor
    else:  # gpt-oss: the top k raw logits, softmax over those k
        top, ids = jax.lax.top_k(logits, cfg.top_k)
        weights = jax.nn.softmax(top, axis=-1)
    if expert_scale is not None:
        weights = weights * jnp.take(expert_scale.astype(jnp.float32), ids)
    return weights, ids


def limit_to_groups(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """DeepSeek-V3's group-limited routing: ``choice [N, E]`` (biased scores, float32) with every expert outside
    each token's ``topk_group`` best groups set to -inf. The experts form ``n_group`` consecutive equal groups;
    a group's score is the sum of its two best choice scores (transformers' ``DeepseekV3TopkRouter``)."""
    n, e = choice.shape
    grouped = choice.reshape(n, n_group, e // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_group]
    _, best = jax.lax.top_k(group_scores, topk_group)
    keep = jnp.any(jnp.arange(n_group)[None, :, None] == best[:, None, :], axis=-1)  # [N, n_group]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)


def activate(gate: jax.Array, up: jax.Array, cfg: ExpertsConfig) -> jax.Array:
    if cfg.activation == "clamped_swiglu":
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * GPT_OSS_ALPHA))
    return ACTIVATIONS[cfg.activation](gate) * up


# Platforms where packed weights leave the barrier of ``StackedExperts.after`` pinned to their stored
# (row-major) layout. Otherwise layout assignment gives the barrier the layout the decode would read best
# (XLA:GPU: the output rows minor, as the decoded ``[E, in, out]`` weights) and carries the params into the
# prefill's chunk loop already in it: one relaid copy of every layer's packed experts made before the loop
# and alive through it (gpt-oss-120b, H200, 8k prefill: 61.9 GiB of temporaries; pinned: 3.2). Pinned, the
# relayout happens per layer inside the loop. Not row-major on TPUs: there the row-major form of ``[.., 16]``-byte
# groups pads to (8, 128) tiles (the same prefill asked for 562 GB pinned, 126 GB not); they are stored and
# pinned in PACKED_LAYOUTS' order instead (``_pinned``). MXFP4 only: pinned
# FP8 / INT4 codes raised the 2 x 8 H200 prefills of GLM-5.1 (45.0 -> 52.4 GiB) and Kimi-K2.5 (37.3 -> 60.7).
PIN_PACKED_LAYOUT = ("gpu",)


# The device layout (major to minor) packed MXFP4 params are stored in, per platform; elsewhere the platform's
# default. On TPUs the default layout of ``u8[E, out, in/32, 16]`` puts the experts minor (no padding of the
# (32, 128) uint8 tiles when E is a multiple of 128), which neither the routed gather over experts nor the
# decode reads: the decode loop then copied every layer's packed stacks into the output-rows-minor order once,
# before the loop, all alive through it (gpt-oss-120b, one v5p: 148 GB of temporaries at 36 layers). Stored in
# that order (``place_packed``, when a target is loaded; ``aot.plan_decode`` compiles with it), the loop holds
# no such copy (a 4-layer cut: 11.7 -> 5.7 GiB of temporaries); pinned in it after the layer's barrier too
# (``_pinned``: deeper cuts had the loop carry them in yet another order), the whole model fits one v5p at 8k
# tokens (77.6 of 95 GiB; docs/devices.md). Not on GPUs (their default is
# row-major; see PIN_PACKED_LAYOUT) nor the CPU.
PACKED_LAYOUTS = {"tpu": {"_blocks": (0, 2, 3, 1), "_scales": (0, 2, 1)}}


def packed_layout(name: str, ndim: int, platform: str) -> Layout | None:
    """The device layout for the expert param ``name`` (a path or key ending ``_blocks`` / ``_scales``: MXFP4)
    on ``platform``, or None for the platform's default."""
    for suffix, order in PACKED_LAYOUTS.get(platform, {}).items():
        if name.endswith(suffix) and len(order) == ndim:
            return Layout(order)
    return None


def packed_format(name: str, x: Any, platform: str) -> Format | None:
    """``x``'s sharding with ``packed_layout`` (an array or an abstract one), or None for the default layout."""
    layout = packed_layout(name, x.ndim, platform)
    return None if layout is None else Format(layout, x.sharding)


def with_packed_layouts(tree: Any, platform: str) -> Any:
    """``tree`` (abstract params) with the packed expert params in the layout the loader stores them in on
    ``platform`` (``place_packed``), the rest unchanged: what a plan compiles for (jit compiles for an
    argument's own layout, as it does for the loaded params)."""
    def one(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        fmt = packed_format(name, x, platform) if "experts/" in name else None
        return x if fmt is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fmt)

    return jax.tree_util.tree_map_with_path(one, tree)


def place_packed(name: str, x: jax.Array) -> jax.Array:
    """``x`` (a placed param) moved into ``packed_layout`` on its platform, or ``x`` itself. One param at a time,
    so a load holds at most one extra copy of one projection's stack."""
    fmt = packed_format(name, x, next(iter(x.devices())).platform)
    return x if fmt is None else jax.device_put(x, fmt)


def _pinned(name: str, x: jax.Array, platform: str) -> jax.Array:
    """A packed param as it leaves ``StackedExperts.after``'s barrier: pinned to the layout it is stored in
    where that matters (GPUs: row-major, PIN_PACKED_LAYOUT; TPUs: ``packed_layout``), else as it was. On TPUs,
    unpinned, layout assignment gave the decode loop's carried params another order past 8 layers
    (gpt-oss-120b: every layer's blocks copied into it before the loop and back at each barrier: 38.1 GiB of
    temporaries at 16 layers; pinned, 4.9)."""
    layout = packed_layout(name, x.ndim, platform)
    if layout is None and platform in PIN_PACKED_LAYOUT:
        layout = Layout(tuple(range(x.ndim)))
    return x if layout is None else with_layout_constraint(x, layout)


@dataclasses.dataclass(frozen=True)
class StackedExperts:
    """One layer's expert params as declared (float ``[E, in, out]``; packed MXFP4 blocks and scales; FP8 or
    INT4 codes and scales, ``fmt`` and ``block`` as ``ExpertsConfig.weight_format`` / ``weight_block``; plus
    gpt-oss's biases), decoded to ``dtype`` on demand by the path that uses them: ``all()`` every expert,
    ``gathered`` / ``expert`` only the experts the routed path asks for."""

    params: Mapping[str, jax.Array]
    fmt: str
    dtype: Any
    name: str | None = None
    block: tuple[int, int] | None = None

    @property
    def packed(self) -> bool:
        """Whether the weights are kept quantised (decoded inside the layer, rows first)."""
        return self.fmt != "float"

    def after(self, x: jax.Array) -> "StackedExperts":
        """These params, made to wait for ``x`` (the layer's input) through an optimization barrier. Packed
        weights are decoded inside the layer, and the decode depends on nothing but the params: XLA's
        schedulers may then hoist every layer's decode to the start of the program, all alive at once (the
        TPU compile of gpt-oss-120b's 8k prefill asked for 338 GB of temporaries that way). Tied to the
        layer's input, each decode runs when its layer does."""
        if not self.packed:
            return self
        params, _ = jax.lax.optimization_barrier((dict(self.params), x))
        if self.fmt == "mxfp4":
            params = {k: _pinned(k, v, current_platform()) for k, v in params.items()}
        return dataclasses.replace(self, params=params)

    def _each(self, rows, plain) -> dict[str, jax.Array]:
        """Per projection: ``rows(codes, scales, name)`` for quantised weights (MXFP4 ``_blocks`` /
        ``_scales``, FP8 / INT4 ``_qweight`` / ``_qscale``), decoded rows first ``[..., out, in]``, else
        ``plain(value)``; results in ``dtype``, keyed by projection."""
        out = {}
        for name, value in self.params.items():
            if name.endswith(("_scales", "_qscale")):
                continue
            for codes, scales in (("_blocks", "_scales"), ("_qweight", "_qscale")):
                if name.endswith(codes):
                    proj = name[: -len(codes)]
                    out[proj] = rows(value, self.params[proj + scales], f"{self.name}/{proj}")
                    break
            else:
                out[name] = plain(value).astype(self.dtype)
        return out

    def _decode_rows(self, codes, scales, name, ids=None):
        if self.fmt == "mxfp4":
            return mxfp4.dequantize_rows_jax(codes, scales, self.dtype, ids=ids, name=name)
        return quantized_experts.decode_rows(self.fmt, self.block, codes, scales, self.dtype, ids=ids)

    def all(self) -> dict[str, jax.Array]:
        """Every expert's weights ``[E, in, out]`` and biases ``[E, width]`` in ``dtype`` (packed: all decoded;
        the decoded copy is a temporary of this layer, about one layer's experts alive at a time)."""
        return self._each(lambda c, s, name: jnp.swapaxes(self._decode_rows(c, s, name), -1, -2), lambda v: v)

    def gathered(self, ids: jax.Array) -> dict[str, jax.Array]:
        """The weights and biases of the experts ``ids`` (any shape ``S``; repeats gathered again), in ``dtype``:
        ``[*S, in, out]``, packed ``[*S, out, in]`` (rows first, as stored: the codes and scales of those
        experts are gathered, then only they are decoded); biases ``[*S, width]``. ``matvec`` takes either."""
        return self._each(lambda c, s, name: self._decode_rows(c, s, name, ids=ids),
                          lambda v: jnp.take(v, ids, axis=0, mode="clip"))

    def expert(self, index: jax.Array) -> dict[str, jax.Array]:
        """One expert's weights and biases (``index``: a traced scalar), by dynamic slicing: ``gathered`` of a
        single id without a gather (XLA:CPU copies gathered slices; a dynamic slice is read in place)."""
        one = lambda v: jax.lax.dynamic_index_in_dim(v, index, keepdims=True)  # noqa: E731
        return self._each(lambda c, s, name: self._decode_rows(one(c), one(s), name)[0], lambda v: one(v)[0])

    def matvec(self, rows: jax.Array, w: jax.Array) -> jax.Array:
        """``rows[..., :] @ W[...]`` for weights from ``gathered`` / ``expert`` (``[..., in]`` -> ``[..., out]``)."""
        rows = rows.astype(self.dtype)
        return jnp.einsum("...i,...oi->...o" if self.packed else "...i,...io->...o", rows, w)


def _combine_matrix(weights, ids, num_experts):
    """``[N, E]``: each token's weight for each expert, zero for the experts it did not choose."""
    return jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=weights.dtype) * weights[..., None], axis=1)


def dense_experts(x, weights, ids, experts: StackedExperts, cfg: ExpertsConfig):
    """Every expert on every token ``x [N, H]``; each token sums its k outputs with their weights."""
    p = experts.all()
    # x broadcast over the experts first: with "nh,ehi->eni" XLA:CPU copies every expert's weights transposed
    # on each call (gpt-oss-20b's shapes, 8 tokens: 1.25 s vs 0.14 s for gate + up, outputs equal to 6e-6).
    xe = jnp.broadcast_to(x, (cfg.num_experts,) + x.shape)
    gate = jnp.einsum("enh,ehi->eni", xe, p["gate_proj"])
    up = jnp.einsum("enh,ehi->eni", xe, p["up_proj"])
    if cfg.expert_bias:
        gate, up = gate + p["gate_proj_bias"][:, None], up + p["up_proj_bias"][:, None]
    y = jnp.einsum("eni,eih->enh", activate(gate, up, cfg), p["down_proj"])
    if cfg.expert_bias:
        y = y + p["down_proj_bias"][:, None]
    return jnp.einsum("ne,enh->nh", _combine_matrix(weights, ids, cfg.num_experts), y)


def grouped_experts(x, weights, ids, experts: StackedExperts, cfg: ExpertsConfig):
    """The (token, k) pairs sorted by expert, one grouped matmul per projection, outputs added back: on GPUs
    the Pallas kernel of ``models/grouped_matmul`` (same contract as ``ragged_dot``, whose XLA:GPU lowering
    computes every expert on every row), elsewhere ``jax.lax.ragged_dot``. Under a mesh that splits the
    experts, the batch or each expert's intermediate units, each device runs its own share
    (``_grouped_sharded``)."""
    shards, batch = mesh_split(cfg.num_experts, x.shape[0])
    rows_split = rows_split_of(experts, shards)
    if shards > 1 or batch or rows_split > 1:
        return _grouped_sharded(x, weights, ids, experts, cfg, shards, batch, rows_split)
    return _grouped_local(x, weights, ids, experts, cfg, 0, cfg.num_experts).astype(x.dtype)


_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("experts_mesh", default=None)


@contextlib.contextmanager
def experts_on_mesh(mesh: Any):
    """Trace expert layers inside the block for ``mesh`` (a ``Mesh`` or ``AbstractMesh``; None: no change). The
    engine's programs take arguments sharded over a mesh but are not traced under a mesh context (so that
    nothing else in them changes layout); this tells the grouped path how its experts and rows are split
    (``precision.with_precision_policy`` enters it). Without it, the context's mesh (``jax.set_mesh``, the
    trainer and the planners) is used."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def _traced_mesh():
    mesh = _MESH.get()
    if mesh is None:
        return jax.sharding.get_abstract_mesh()
    return getattr(mesh, "abstract_mesh", mesh)


def mesh_split(num_experts: int, num_rows: int) -> tuple[int, tuple[str, ...]]:
    """How the mesh the program is traced for splits a layer's work: ``(expert shards, batch axes)``. The
    experts split over ``expert`` where its size divides ``num_experts`` (the sharding rules split the experts'
    leading axis exactly then), the token rows over the batch's axes (``data``, ``fsdp``) where they divide
    ``num_rows``; ``(1, ())``: no mesh, or neither."""
    mesh = _traced_mesh()
    if mesh.empty:
        return 1, ()
    n = mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in mesh.axis_names else 1
    shards = n if n > 1 and num_experts % n == 0 else 1
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if batch and num_rows % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    return shards, batch


def _grouped_local(x, weights, ids, experts: StackedExperts, cfg: ExpertsConfig, first, count: int):
    """The grouped path over experts ``first .. first + count - 1`` (``experts`` holds just those): the pairs
    routed elsewhere are sorted past the groups, where the grouped product gives zero rows, and weighted 0.
    Returns each token's sum over its pairs here, ``[N, H]`` in the product's dtype."""
    if current_platform() == "gpu":  # imported here: only programs traced for GPUs need Pallas
        from dflash_jax.models.grouped_matmul import grouped_matmul as product
    else:
        product = jax.lax.ragged_dot
    p = experts.all()
    n, k = ids.shape
    flat = ids.reshape(-1) - first
    mine = (flat >= 0) & (flat < count)
    key = jnp.where(mine, flat, count)
    order = jnp.argsort(key, stable=True)
    expert_of = jnp.minimum(key[order], count - 1)  # the rows past the groups: any expert's bias (weighted 0)
    token_of = order // k
    rows = x[token_of]  # [N * k, H], grouped by expert
    sizes = jnp.bincount(key, length=count + 1)[:count].astype(jnp.int32)
    gate = product(rows, p["gate_proj"], sizes)
    up = product(rows, p["up_proj"], sizes)
    if cfg.expert_bias:
        gate, up = gate + p["gate_proj_bias"][expert_of], up + p["up_proj_bias"][expert_of]
    y = product(activate(gate, up, cfg), p["down_proj"], sizes)
    if cfg.expert_bias:
        y = y + p["down_proj_bias"][expert_of]
    # other devices' pairs are zeroed by a select, not by their weight: what a grouped product leaves in the rows
    # past its groups is documented as zero, but a select does not depend on it (0 x NaN would not be 0)
    y = jnp.where(mine[order][:, None], y * weights.reshape(-1)[order][:, None], 0)
    # Back to (token, k) order (each pair written once), then each token's k outputs summed in a fixed order. (A
    # scatter-add over the repeated token indices lowers to atomics on GPUs: its summation order, and so its
    # rounding, could change from run to run; the first H200 run saw repeated runs of one program disagree.)
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(n, k, -1)
    return jnp.sum(y, axis=1)


def rows_split_of(experts: StackedExperts, shards: int) -> int:
    """How many ways the traced mesh's tensor axis splits each expert's intermediate units in every projection
    (gate/up's outputs, down's inputs; float weights, their biases, or packed codes and scales, split alike)
    as the sharding rules lay them out: the ``tensor`` size, or 1 (no such axis, or a projection whose
    intermediate units, or their packed blocks, it does not divide: gpt-oss's 90 groups of 32 over 4)."""
    mesh = _traced_mesh()
    if mesh.empty or ROWS_AXIS not in mesh.axis_names or mesh.shape[ROWS_AXIS] == 1:
        return 1
    specs = _param_specs(experts, shards, mesh.shape[ROWS_AXIS])
    if any(ROWS_AXIS not in spec for name, spec in specs.items() if name != "down_proj_bias"):
        return 1
    return mesh.shape[ROWS_AXIS]


_ROWS_LOGICAL = tuple(name for name, axes in LOGICAL_TO_MESH.items()
                      if axes == ROWS_AXIS or (isinstance(axes, tuple) and ROWS_AXIS in axes))


def _param_specs(experts: StackedExperts, shards: int, rows_split: int) -> dict[str, jax.sharding.PartitionSpec]:
    """Each expert param's spec inside the shard_map: its experts over ``expert`` (``shards`` > 1) and, with
    ``rows_split`` > 1, its intermediate units over ``tensor`` where the sharding rules put them and the
    size divides (quantised codes split where their scales split, as ``sharding.tree_shardings`` stores
    them: whole blocks on every device); the other mesh axes (``fsdp`` over the hidden size, or MXFP4 rows
    over ``fsdp`` too) stay outside: the shard_map takes those dims whole, as the layer would gather them."""
    out = {}
    for name, value in experts.params.items():
        logical = logical_axes(f"mlp/experts/{name}", value.ndim)
        grid = experts.params.get(name[: -len("qweight")] + "qscale") if name.endswith("_qweight") else None
        shape = grid.shape if grid is not None and grid.ndim == value.ndim else value.shape
        parts = []
        for size, axis in zip(shape, logical):
            if axis == "experts" and shards > 1:
                parts.append(EXPERT_AXIS)
            elif axis in _ROWS_LOGICAL and rows_split > 1 and size % rows_split == 0:
                parts.append(ROWS_AXIS)
            else:
                parts.append(None)
        out[name] = jax.sharding.PartitionSpec(*parts)
    return out


def _grouped_sharded(x, weights, ids, experts: StackedExperts, cfg: ExpertsConfig, shards: int,
                     batch: tuple[str, ...], rows_split: int = 1):
    """The grouped path inside a ``shard_map`` manual over the ``expert`` axis (``shards`` > 1), the batch axes
    ``batch`` and ``tensor`` (``rows_split`` > 1): every device takes its batch rows' tokens (replicated over
    ``expert`` and ``tensor``), runs the pairs routed to its own ``E / shards`` experts through its own
    ``I / rows_split`` intermediate units of each (packed weights: decoding just those), and one all-reduce over
    ``expert`` and ``tensor`` sums the devices' partial outputs (float32; the down projection's bias is added by
    the first tensor shard only). The grouped kernel has no partitioning rule: without this XLA gathered every
    expert of the layer onto every device (Kimi-K2.5's prefill: 384 experts, 31.5 GiB in bfloat16 per layer),
    every row of the batch, and each expert's intermediate units split over ``tensor``; now each device reads
    and, for packed weights, decodes only its own share (whole over ``fsdp``: gathered as any FSDP-split weight
    is for its layer)."""
    local = cfg.num_experts // shards
    rows = jax.sharding.PartitionSpec(batch or None)
    summed = (EXPERT_AXIS,) * (shards > 1) + (ROWS_AXIS,) * (rows_split > 1)
    specs = _param_specs(experts, shards, rows_split)

    def body(x, weights, ids, params, first, lead):
        if rows_split > 1 and "down_proj_bias" in params:  # once in the sum over the tensor shards
            params = {**params, "down_proj_bias": params["down_proj_bias"] * lead[0].astype(
                params["down_proj_bias"].dtype)}
        part = dataclasses.replace(experts, params=params)
        y = _grouped_local(x, weights, ids, part, cfg, first[0], local)
        return jax.lax.psum(y.astype(jnp.float32), summed) if summed else y

    params = dict(experts.params)
    # Each device's first expert, and whether it is the first tensor shard, as inputs split over ``expert`` and
    # ``tensor`` rather than ``axis_index``: XLA's SPMD partitioner refuses the partition id that lowers to when
    # other axes stay automatic (the full Kimi-K2.5 prefill compiled for H200s failed so).
    first = jnp.arange(shards, dtype=jnp.int32) * local
    lead = jnp.arange(rows_split) == 0
    _note_sharded(shards, batch, rows_split)
    over = lambda axis, n: jax.sharding.PartitionSpec(axis if n > 1 else None)  # noqa: E731
    out = jax.shard_map(body, mesh=_traced_mesh(),
                        in_specs=(rows, rows, rows, specs, over(EXPERT_AXIS, shards), over(ROWS_AXIS, rows_split)),
                        out_specs=rows, axis_names={*batch, *summed},
                        # the Pallas kernel's outputs carry no varying-axes type: the psum makes the result
                        # replicated over ``expert`` and ``tensor``, which the out_specs say
                        check_vma=False)(x, weights, ids, params, first, lead)
    return out.astype(x.dtype)


def routed_experts(x, weights, ids, experts: StackedExperts, cfg: ExpertsConfig, loop: bool | None = None):
    """Each (token, k) pair through its own expert: ``x [N, H]``, ``ids [N, k]`` -> ``[N, H]``. Pair ``p`` is
    token ``p // k``'s ``p % k``-th choice; an expert chosen by several tokens is read once per pair.

    Two forms of the same products (``ROUTED_LOOP`` picks by platform and weight format; ``loop`` forces one):
    gathered, every pair's matrices at once (``w[ids] -> [N * k, in, out]``; packed: the uint8 blocks and
    scales gathered, then only they decoded) and one batched matrix-vector product per projection; or a
    loop over the pairs (``lax.map``), each pair reading (and decoding) its expert by a dynamic slice."""
    n, k = ids.shape
    flat = ids.reshape(-1)  # [P = N * k]
    rows = jnp.repeat(x, k, axis=0)  # [P, H]
    if loop is None:
        loop = ROUTED_LOOP.get((current_platform(), experts.packed), False)

    def pairs(rows, w):
        gate, up = experts.matvec(rows, w["gate_proj"]), experts.matvec(rows, w["up_proj"])
        if cfg.expert_bias:
            gate, up = gate + w["gate_proj_bias"], up + w["up_proj_bias"]
        y = experts.matvec(activate(gate, up, cfg), w["down_proj"])
        return y + w["down_proj_bias"] if cfg.expert_bias else y

    if loop:
        y = jax.lax.map(lambda pair: pairs(pair[0], experts.expert(pair[1])), (rows, flat))
    else:
        y = pairs(rows, experts.gathered(flat))
    return jnp.einsum("nk,nkh->nh", weights, y.reshape(n, k, -1).astype(weights.dtype))


COMPUTE = {"dense": dense_experts, "grouped": grouped_experts, "routed": routed_experts}


class ExpertWeights(nn.Module):
    """Declares the stacked expert params (float ``[E, in, out]``; with ``config.weight_format`` "mxfp4"
    packed uint8 blocks and scales, "fp8" / "int4" codes and scales; gpt-oss's biases) and returns them as a
    ``StackedExperts``
    whose paths decode them to ``dtype`` inside the traced layer. The param tree (names, shapes, dtypes) is
    what checkpoints and ``dflash_jax.sharding``'s rules expect."""

    config: ExpertsConfig
    hidden_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> StackedExperts:
        cfg, h = self.config, self.hidden_size
        e, i = cfg.num_experts, cfg.intermediate_size
        if cfg.weight_format == "mxfp4":
            p = self._packed(e, h, i)
        elif cfg.weight_format in quantized_experts.FORMATS:
            p = self._quantized(e, h, i)
        elif cfg.weight_format == "float":
            init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
            p = {"gate_proj": self.param("gate_proj", init, (e, h, i), self.dtype),
                 "up_proj": self.param("up_proj", init, (e, h, i), self.dtype),
                 "down_proj": self.param("down_proj", init, (e, i, h), self.dtype)}
        else:
            raise ValueError(f"expert weight_format must be 'float', 'mxfp4', 'fp8' or 'int4', got "
                             f"{cfg.weight_format!r}")
        if cfg.expert_bias:
            for name, width in (("gate_proj_bias", i), ("up_proj_bias", i), ("down_proj_bias", h)):
                p[name] = self.param(name, nn.initializers.zeros, (e, width), self.dtype)
        return StackedExperts(p, cfg.weight_format, self.dtype, self.name, cfg.weight_block)

    def _packed(self, e: int, h: int, i: int) -> dict[str, jax.Array]:
        """The MXFP4 params (uint8; zeros at init, i.e. all-zero weights: real values come from a checkpoint).
        Decoding is part of the layer's traced computation (``StackedExperts``): only the packed bytes are
        persistent device memory."""
        for what, size in (("hidden_size", h), ("intermediate_size", i)):
            if size % mxfp4.BLOCK_SIZE:
                raise ValueError(f"MXFP4 expert weights need {what} to be a multiple of {mxfp4.BLOCK_SIZE}, "
                                 f"got {size}")
        out = {}
        for name, (inn, width) in (("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h))):
            blocks_shape, scales_shape = mxfp4.packed_shapes(inn, width, e)
            blocks = self.param(f"{name}_blocks", nn.initializers.zeros, blocks_shape, jnp.uint8)
            scales = self.param(f"{name}_scales", nn.initializers.zeros, scales_shape, jnp.uint8)
            mxfp4.check_packed(blocks, scales, name=f"{self.name}/{name}")
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        return out

    def _quantized(self, e: int, h: int, i: int) -> dict[str, jax.Array]:
        """FP8 / INT4 codes and scales (zeros at init: real values come from a checkpoint), rows first."""
        fmt, block = self.config.weight_format, self.config.weight_block
        codes_dtype, scales_dtype = quantized_experts.param_dtypes(fmt)
        out = {}
        for name, (inn, width) in (("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h))):
            quantized_experts.check_block(fmt, block, width, inn, f"{self.name}/{name}")
            out[f"{name}_qweight"] = self.param(f"{name}_qweight", nn.initializers.zeros,
                                                quantized_experts.qweight_shape(fmt, e, width, inn), codes_dtype)
            out[f"{name}_qscale"] = self.param(f"{name}_qscale", nn.initializers.zeros,
                                               quantized_experts.qscale_shape(fmt, block, e, width, inn),
                                               scales_dtype)
        return out


class ScaledRouter(nn.Module):
    """Gemma 4's router (``ExpertsConfig.router_norm_eps``): ``proj`` reads its input RMS-normalised without a
    weight, times ``scale [H]`` and H^-0.5; ``per_expert_scale [E]`` multiplies each chosen expert's weight."""

    config: ExpertsConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, h = self.config, x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (h,), self.dtype)
        per_expert = self.param("per_expert_scale", nn.initializers.ones, (cfg.num_experts,), self.dtype)
        x = RMSNorm(cfg.router_norm_eps, self.dtype, self.dtype, use_weight=False)(x) * scale
        x = x * jnp.asarray(h ** -0.5, self.dtype)
        proj = nn.Dense(cfg.num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="proj",
                        dot_general=float32_dot_general)
        return route(proj(x), cfg, expert_scale=per_expert)


class Experts(nn.Module):
    """The routed experts (and the optional shared expert) of one layer: ``[B, T, H] -> [B, T, H]``.
    ``router_input``: what the router reads, when not ``x`` (Gemma 4 routes the un-normed residual)."""

    config: ExpertsConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, router_input: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        routed = flat if router_input is None else router_input.reshape(-1, h)
        if cfg.router_norm_eps is not None:
            weights, ids = ScaledRouter(cfg, self.dtype, name="router")(routed)
        else:  # the router accumulates in float32 whatever the compute dtype (route() says why)
            router = nn.Dense(cfg.num_experts, use_bias=cfg.router_bias, dtype=self.dtype, param_dtype=self.dtype,
                              name="router" if cfg.router_bias else "gate", dot_general=float32_dot_general)
            # float32 whatever the compute dtype (as transformers, vLLM and SGLang keep it): it only chooses
            # experts, and a bfloat16 bias flips near-tie choices (load_target keeps declared float32 params)
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (cfg.num_experts,), jnp.float32) \
                if cfg.selection_bias else None
            weights, ids = route(router(routed), cfg, bias)
        weights = weights.astype(self.dtype)  # the experts' outputs are combined in the compute dtype
        experts = ExpertWeights(cfg, h, self.dtype, name="experts")()
        path = expert_path(b * t, cfg.num_experts, cfg.top_k)
        _note_reads(path, b * t, cfg, experts)
        out = COMPUTE[path](flat, weights, ids, experts.after(flat), cfg)
        if cfg.shared_intermediate_size and not cfg.shared_expert_gate:  # DeepSeek-V3: added as it is
            out = out + MLP(cfg.shared_intermediate_size, False, self.dtype, self.dtype, name="shared_experts")(flat)
        elif cfg.shared_intermediate_size:
            shared = MLP(cfg.shared_intermediate_size, False, self.dtype, self.dtype, name="shared_expert")(flat)
            gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                            name="shared_expert_gate")(flat)
            out = out + jax.nn.sigmoid(gate) * shared
        return out.reshape(b, t, h)


# ------------------------------------------------------------------ what a traced program's expert layers read


_SHARDED: contextvars.ContextVar[list | None] = contextvars.ContextVar("grouped_sharded", default=None)


@contextlib.contextmanager
def _recording(var: contextvars.ContextVar):
    seen: list = []
    token = var.set(seen)
    try:
        yield seen
    finally:
        var.reset(token)


def recording_sharded():
    """Collect ``(expert shards, batch axes, tensor shards)`` per grouped expert layer traced inside the block with
    its work split over a mesh (``_grouped_sharded``; tests check that a program runs it)."""
    return _recording(_SHARDED)


def _note_sharded(shards: int, batch: tuple[str, ...], rows_split: int) -> None:
    seen = _SHARDED.get()
    if seen is not None:
        seen.append((shards, batch, rows_split))


class ExpertReads(NamedTuple):
    """One traced expert layer: its experts, how many expert weight sets its path reads, how many (token,
    expert) pairs its tokens are routed to, the bytes of one expert's weights as stored, and its path."""

    num_experts: int
    experts_read: int
    routed_pairs: int
    bytes_per_expert: int
    path: str


_READS: contextvars.ContextVar[list | None] = contextvars.ContextVar("expert_reads", default=None)


def recording_reads():
    """Collect an ``ExpertReads`` per expert layer traced inside the block (``aot.plan_decode``'s figures)."""
    return _recording(_READS)


def _note_reads(path: str, num_tokens: int, cfg: ExpertsConfig, experts: StackedExperts) -> None:
    """Record what this layer's path reads: ``routed`` one expert per (token, k) pair; ``grouped`` over float
    weights only the experts some token is routed to, at most ``min(pairs, E)`` (the grouped matmul's tiles
    follow the groups: an expert with no rows is never read); ``dense``, and ``grouped`` over packed weights
    (``StackedExperts.all`` decodes every expert first), all ``E``."""
    reads = _READS.get()
    if reads is None:
        return
    per_expert = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dict(experts.params))) // cfg.num_experts
    pairs = num_tokens * cfg.top_k
    if path == "routed":
        read = pairs
    elif path == "grouped" and not experts.packed:
        read = min(pairs, cfg.num_experts)
    else:
        read = cfg.num_experts
    reads.append(ExpertReads(cfg.num_experts, read, pairs, per_expert, path))
