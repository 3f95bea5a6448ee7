"""The mixture-of-experts FFN of Qwen3-MoE, gpt-oss (and Qwen3-Next/Qwen3.5's shared-expert variant).

Dropless and exact: every token goes to its ``top_k`` experts, no capacity factor, nothing dropped, so the
target computes the same function as transformers' reference and DFlash stays lossless. Two ways to compute
the routed experts give the same result (tested against each other):

- ``dense``: every expert on every token, then each token keeps its k outputs (an einsum over all experts).
  Exact and simple; the cheaper path on CPU where ``tokens * num_experts`` is small (tests, decoding).
- ``grouped``: the (token, k) pairs sorted by expert and one grouped matmul (``jax.lax.ragged_dot``) per
  projection, so the work follows ``tokens * top_k``: prefill and training at real sizes.

``expert_path`` chooses; ``force_expert_path`` pins one (tests, benchmarks).

Parameters (``[in, out]`` like Flax kernels, experts leading): ``gate/kernel [H, E]`` (Qwen3-MoE's router,
``router/kernel`` + ``router/bias`` for gpt-oss), ``experts/{gate,up}_proj [E, H, I]``,
``experts/down_proj [E, I, H]``, with ``experts/*_bias`` for gpt-oss; ``shared_expert/*`` and
``shared_expert_gate/kernel [H, 1]`` for the shared-expert variant.

With ``ExpertsConfig.weight_format == "mxfp4"`` the three projections are instead kept packed as gpt-oss stores
them (``models/mxfp4``: uint8, 4.25 bits per weight), rows = output features:
``experts/{gate,up}_proj_blocks [E, I, H/32, 16]`` + ``_scales [E, I, H/32]``, ``experts/down_proj_blocks
[E, H, I/32, 16]`` + ``_scales [E, H, I/32]`` (biases stay float). ``ExpertWeights`` decodes them to the compute
dtype inside the traced layer, so both paths above run unchanged on the decoded ``[E, in, out]`` weights.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.models import mxfp4
from dflash_jax.models.config import ExpertsConfig
from dflash_jax.models.layers import MLP

GPT_OSS_ALPHA = 1.702  # gpt-oss's GLU uses x * sigmoid(1.702 x)
# tokens * experts up to which CPU takes the dense path: a round number, not a measured crossover (measured on
# this project's 2-core CPU at 1,280 tokens x 4 experts: dense 8.8 ms, grouped 10.4 ms for a 4-layer target).
DENSE_LIMIT = 4096

_forced_path: contextvars.ContextVar[str | None] = contextvars.ContextVar("expert_path", default=None)


@contextlib.contextmanager
def force_expert_path(path: str | None):
    """Trace expert layers with ``"dense"`` or ``"grouped"`` (None: choose by shape) inside the block."""
    if path not in (None, "dense", "grouped"):
        raise ValueError(f"expert path must be 'dense' or 'grouped', got {path!r}")
    token = _forced_path.set(path)
    try:
        yield
    finally:
        _forced_path.reset(token)


def expert_path(num_tokens: int, num_experts: int) -> str:
    """The cheaper exact path for this many tokens (a static choice, made while tracing). On accelerators
    always grouped: decoding is bound by reading weights, and the grouped matmul reads only the experts that
    received tokens, while the dense path reads (and computes) all of them. On CPU, where XLA expands
    ``ragged_dot`` into one product per expert over all rows, the dense path is cheaper up to
    ``DENSE_LIMIT``; past it the grouped path bounds the ``[E, tokens, I]`` intermediates."""
    forced = _forced_path.get()
    if forced is not None:
        return forced
    if jax.default_backend() != "cpu":
        return "grouped"
    return "dense" if num_tokens * num_experts <= DENSE_LIMIT else "grouped"


def route(logits: jax.Array, cfg: ExpertsConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits ``[N, E]`` -> (weights ``[N, k]`` in the logits' dtype, expert ids ``[N, k]``)."""
    if cfg.routing == "softmax_topk":  # Qwen3-MoE: softmax over all experts in float32, then the top k
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, ids = jax.lax.top_k(probs, cfg.top_k)
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    else:  # gpt-oss: the top k raw logits, softmax over those k
        top, ids = jax.lax.top_k(logits, cfg.top_k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
    return weights.astype(logits.dtype), ids


def activate(gate: jax.Array, up: jax.Array, cfg: ExpertsConfig) -> jax.Array:
    if cfg.activation == "clamped_swiglu":
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * GPT_OSS_ALPHA))
    return nn.silu(gate) * up


def dense_experts(x, weights, ids, p, cfg: ExpertsConfig):
    """Every expert on every token ``x [N, H]``; each token sums its k outputs with their weights."""
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
    # [N, E]: each token's weight for each expert, zero for the experts it did not choose
    combine = jnp.sum(jax.nn.one_hot(ids, cfg.num_experts, dtype=weights.dtype) * weights[..., None], axis=1)
    return jnp.einsum("ne,enh->nh", combine, y)


def grouped_experts(x, weights, ids, p, cfg: ExpertsConfig):
    """The (token, k) pairs sorted by expert, one ``ragged_dot`` per projection, outputs added back."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert_of = flat[order]
    token_of = order // k
    rows = x[token_of]  # [N * k, H], grouped by expert
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    gate = jax.lax.ragged_dot(rows, p["gate_proj"], sizes)
    up = jax.lax.ragged_dot(rows, p["up_proj"], sizes)
    if cfg.expert_bias:
        gate, up = gate + p["gate_proj_bias"][expert_of], up + p["up_proj_bias"][expert_of]
    y = jax.lax.ragged_dot(activate(gate, up, cfg), p["down_proj"], sizes)
    if cfg.expert_bias:
        y = y + p["down_proj_bias"][expert_of]
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token_of].add(y)


class ExpertWeights(nn.Module):
    """The stacked expert weights (``[E, in, out]``, and gpt-oss's biases) as a dict in ``dtype``; with
    ``config.weight_format == "mxfp4"`` declared packed (uint8 blocks and scales) and decoded here."""

    config: ExpertsConfig
    hidden_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        cfg, h = self.config, self.hidden_size
        e, i = cfg.num_experts, cfg.intermediate_size
        if cfg.weight_format == "mxfp4":
            p = self._packed(e, h, i)
        elif cfg.weight_format == "float":
            init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
            p = {"gate_proj": self.param("gate_proj", init, (e, h, i), self.dtype),
                 "up_proj": self.param("up_proj", init, (e, h, i), self.dtype),
                 "down_proj": self.param("down_proj", init, (e, i, h), self.dtype)}
        else:
            raise ValueError(f"expert weight_format must be 'float' or 'mxfp4', got {cfg.weight_format!r}")
        if cfg.expert_bias:
            for name, width in (("gate_proj_bias", i), ("up_proj_bias", i), ("down_proj_bias", h)):
                p[name] = self.param(name, nn.initializers.zeros, (e, width), self.dtype)
        return {name: value.astype(self.dtype) for name, value in p.items()}

    def _packed(self, e: int, h: int, i: int) -> dict[str, jax.Array]:
        """The MXFP4 params (uint8; zeros at init, i.e. all-zero weights: real values come from a checkpoint),
        decoded to ``[E, in, out]`` in ``dtype``. The decode is part of this layer's traced computation: only
        the packed bytes are persistent device memory, and the decoded copy is a temporary of this layer (XLA
        frees it after the layer's matmuls, so about one layer's decoded experts are alive at a time)."""
        for what, size in (("hidden_size", h), ("intermediate_size", i)):
            if size % mxfp4.BLOCK_SIZE:
                raise ValueError(f"MXFP4 expert weights need {what} to be a multiple of {mxfp4.BLOCK_SIZE}, "
                                 f"got {size}")
        out = {}
        for name, (inn, width) in (("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h))):
            blocks_shape, scales_shape = mxfp4.packed_shapes(inn, width, e)
            blocks = self.param(f"{name}_blocks", nn.initializers.zeros, blocks_shape, jnp.uint8)
            scales = self.param(f"{name}_scales", nn.initializers.zeros, scales_shape, jnp.uint8)
            out[name] = mxfp4.dequantize_jax(blocks, scales, self.dtype, name=f"{self.name}/{name}")
        return out


class Experts(nn.Module):
    """The routed experts (and the optional shared expert) of one layer: ``[B, T, H] -> [B, T, H]``."""

    config: ExpertsConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        router = nn.Dense(cfg.num_experts, use_bias=cfg.router_bias, dtype=self.dtype, param_dtype=self.dtype,
                          name="router" if cfg.router_bias else "gate")
        weights, ids = route(router(flat), cfg)
        p = ExpertWeights(cfg, h, self.dtype, name="experts")()
        compute = dense_experts if expert_path(b * t, cfg.num_experts) == "dense" else grouped_experts
        out = compute(flat, weights, ids, p, cfg)
        if cfg.shared_intermediate_size:
            shared = MLP(cfg.shared_intermediate_size, False, self.dtype, self.dtype, name="shared_expert")(flat)
            gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                            name="shared_expert_gate")(flat)
            out = out + jax.nn.sigmoid(gate) * shared
        return out.reshape(b, t, h)
