"""Fused attention kernels behind ``layers.cache_attention``.

The chunked loop in ``layers.cache_attention`` is portable and bounded by the live length, but its trip count
depends on data: XLA's GPU runtime generally checks such a loop's condition on the host every trip, in every
layer, and every trip is a small kernel. A fused kernel takes each row's key count itself.

Kernels take masks only in the form they support natively, per-row key counts and causal within a square
block, so callers describe their attention as ``Segment``s: the cache prefix every query of a row sees, then
the block's own keys. A mask tensor over the cache slots would cost what the slots cost, not the live length.
Each segment runs through the kernel, which also returns its log-sum-exp; segments are merged in float32.

- ``cudnn``: cuDNN flash attention (CUDA GPUs, bf16/fp16), in the cache's own ``[B, H, S, D]`` layout.
- ``pallas``: a Pallas TPU kernel written here (scalar-prefetched row lengths; key/value chunks copied from
  HBM only up to each row's length, the next chunk's copy overlapping the current chunk's compute). Runs on
  CPU in Pallas's TPU interpret mode, which is how it is tested.
- ``xla``: the segments through XLA's reference implementation of the fused API (scores over all slots): a
  correctness check on any device, not a speed option.
- ``auto``: per platform (``dflash_jax.platform.current_platform``, so a program compiled ahead of time for a
  device this process does not have gets that device's choice): on a CUDA GPU ``cudnn`` for 16-bit
  activations (where cuDNN accepts the shapes at trace time) and ``xla`` otherwise; on a TPU ``pallas``; on a
  CPU the loop. So no accelerator program runs a loop whose trip count depends on data: such a loop costs a
  device-to-host sync per trip on a GPU (10-20 us), in every layer of every round.

Attention sinks (gpt-oss) join a fused kernel's result through its log-sum-exp: a sink is a key with a logit
and no value, so it is one more part of the merge with weight ``exp(sink)`` and output zero.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from dflash_jax.errors import UserError
from dflash_jax.platform import current_platform

ATTENTION_KERNELS = ("auto", "loop", "cudnn", "pallas", "xla")
_KERNEL = contextvars.ContextVar("attention_kernel", default="loop")
_MESH = contextvars.ContextVar("attention_mesh", default=None)  # the mesh the traced program is sharded over
# What ``auto`` takes per platform, for 16-bit and for other activations. Nothing on an accelerator falls to the
# loop: ``xla`` (every slot, static shapes) is the fallback there.
_DEVICE_KERNEL = {"gpu": ("cudnn", "xla"), "tpu": ("pallas", "pallas"), "cpu": ("loop", "loop")}


class Segment(NamedTuple):
    """Keys ``[B, Hkv, S, D]`` and values of one part of an attention, of which each row's queries see the
    first ``lengths [B]``; ``causal``: query ``i`` sees key ``j`` only if ``j <= i`` (a block attending to
    itself); ``mask [B, T, S]``: an explicit visibility on top of ``lengths`` (a tree's ancestors: query ``i``
    sees key ``j`` iff node ``j`` is ``i`` or one of its ancestors). Masked segments are small (a verify
    block) and go through XLA whatever the kernel."""

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array
    causal: bool = False
    mask: jax.Array | None = None


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, T, Hq, D]`` -> ``[B, Hkv, G*T, D]``: each KV head's query heads stacked, block position fastest
    (so a batched dot over (batch, KV head) reads the cache in place, and row % T is a query's position)."""
    b, t, hq, d = q.shape
    return q.reshape(b, t, kv_heads, hq // kv_heads, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)


def ungroup_queries(x: jax.Array, t: int) -> jax.Array:
    """The inverse of ``group_queries``: ``[B, Hkv, G*T, D]`` -> ``[B, T, Hq, D]``."""
    b, hkv, rows, d = x.shape
    return x.reshape(b, hkv, rows // t, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, -1, d)


def check_attention_kernel(name: str) -> str:
    if name not in ATTENTION_KERNELS:
        raise UserError(f"unknown attention kernel {name!r} (choose from {', '.join(ATTENTION_KERNELS)})")
    backend = current_platform()
    if name == "cudnn" and backend != "gpu":
        raise UserError(f"attention kernel 'cudnn' needs a CUDA GPU; this process runs on {backend}")
    if name == "pallas" and backend == "gpu":
        # Off a TPU the kernel runs in Pallas's TPU interpreter (how the CPU tests check it): on a GPU that is
        # slow and needs a CPU device beside it (seen on an H200: "io_callback failed to find a local CPU device").
        raise UserError("attention kernel 'pallas' is the TPU kernel; on a GPU choose cudnn, xla or auto")
    return name


@contextlib.contextmanager
def attention_kernel(name: str, mesh: Any = None) -> Iterator[None]:
    """Trace the ``cache_attention`` calls inside with kernel ``name`` (``ATTENTION_KERNELS``; ``loop``, the
    chunked online softmax, is the default outside this context), for a program sharded over ``mesh``."""
    tokens = _KERNEL.set(check_attention_kernel(name)), _MESH.set(mesh)
    try:
        yield
    finally:
        _KERNEL.reset(tokens[0])
        _MESH.reset(tokens[1])


def resolve_kernel(name: str, dtype: Any) -> str:
    """The kernel ``name`` means for activations of ``dtype`` on the platform traced for (``auto`` resolved;
    where the kernel then refuses the shapes at trace time, ``auto`` falls back to ``fallback_kernel``)."""
    if name != "auto":
        return name
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    choices = _DEVICE_KERNEL.get(current_platform(), ("loop", "loop"))
    return choices[0] if sixteen_bit else choices[1]


def fallback_kernel() -> str:
    """What ``auto`` uses where its fused kernel refuses the shapes: the loop on a CPU, ``xla`` (static shapes,
    no data-dependent loop) on accelerators."""
    return "loop" if current_platform() == "cpu" else "xla"


def active_kernel(dtype: Any) -> tuple[str, bool]:
    """The kernel to trace with for activations of ``dtype``, and whether to fall back to the loop when it
    refuses the shapes (``auto``)."""
    name = _KERNEL.get()
    return resolve_kernel(name, dtype), name == "auto"


def _kernel_xla(q, k, v, lengths, causal):
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, H, S, D] <-> [B, S, H, D], the public API's layout
    out, lse = jax.nn.dot_product_attention(t(q), t(k), t(v), key_value_seq_lengths=lengths, is_causal=causal,
                                            implementation="xla", return_residual=True)
    return t(out), lse.transpose(0, 2, 1)


def _kernel_cudnn(q, k, v, lengths, causal):
    # The private entry point takes the cache's own [B, H, S, D] layout ("BNTH"); the public one would need a
    # transposed copy of every key and value. Its checks raise NotImplementedError at trace time for shapes
    # cuDNN does not support.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    full = jnp.full((q.shape[0],), q.shape[2], jnp.int32)
    mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    return cudnn.dot_product_attention(q, k, v, q_seqlen=full, kv_seqlen=lengths, scale=q.shape[-1] ** -0.5,
                                       mask_type=mask, qkv_layout="BNTH", return_residual=True)


PALLAS_KV_CHUNK = 512  # keys per step of the Pallas kernel (copied from HBM into VMEM)
PALLAS_Q_ROWS = 512  # query rows (heads of a group x block positions) per kernel instance
TILE = 16  # row multiple of tiles and copies (the sublane tiling of bf16 on TPUs)


def _query_tile(rows: int) -> int | None:
    """All ``rows`` if they fit one kernel instance, else the largest multiple of ``TILE`` dividing them."""
    if rows <= PALLAS_Q_ROWS:
        return rows
    return next((d for d in range(PALLAS_Q_ROWS - PALLAS_Q_ROWS % TILE, 0, -TILE) if rows % d == 0), None)


# The kernel copies key chunks whose offsets and lengths must be whole sublane tiles (16 rows of bfloat16):
# Mosaic refuses a one-key segment ("vector.broadcast op failed to verify", the autoregressive step) and a
# 10-key verify block ("offsets along tiled dimensions must be aligned"). Caches have whole tiles of slots
# (``generate.cache_slots``); a segment that does not (a verify block, a prompt width clipped by the context)
# goes to XLA in the same layout: such segments are blocks, small next to the cache.
PALLAS_KEY_ALIGN = 16


def _grouped_xla(q, k, v, lengths, causal, mask=None):
    """``_kernel_pallas``'s result computed by XLA in its grouped layout (q ``[B, Hkv, G*T, D]``): for segments
    too narrow for a TPU kernel, and for masked ones (``mask [B, T, S]``, ``Segment.mask``)."""
    slots, d = k.shape[2], q.shape[-1]
    s = jnp.einsum("bhrd,bhsd->bhrs", q, k, preferred_element_type=jnp.float32) * d**-0.5
    key_pos = jnp.arange(slots)
    visible = key_pos[None, None, None, :] < lengths[:, None, None, None]
    if causal:
        query_pos = jnp.arange(q.shape[2]) % slots
        visible = visible & (key_pos[None, :] <= query_pos[:, None])[None, None]
    if mask is not None:  # row r of a group is block position r % T
        t = mask.shape[1]
        visible = visible & jnp.tile(mask, (1, q.shape[2] // t, 1))[:, None]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(s - m), 0.0)
    denom = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhrs,bhsd->bhrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    seen = denom > 0
    out = jnp.where(seen, out / jnp.where(seen, denom, 1.0), 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), jnp.finfo(jnp.float32).min)
    return out, lse[..., 0]


def _kernel_pallas(q, k, v, lengths, causal, interpret: bool = False):
    """q ``[B, Hkv, G*T, D]`` (a group's query heads stacked, block position fastest), k/v ``[B, Hkv, S, D]``
    in HBM. One kernel instance per (row, KV head, query tile) walks the row's key chunks up to its length,
    copying each from HBM and folding it into an online softmax in float32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, hkv, rows, d = q.shape
    slots = k.shape[2]
    if slots % PALLAS_KEY_ALIGN and not interpret:  # (the interpreter has no tiles: the tests run the kernel)
        return _grouped_xla(q, k, v, lengths, causal)
    bq = _query_tile(rows)
    if bq is None:
        raise NotImplementedError(f"Pallas attention: {rows} query rows have no tile of <= {PALLAS_Q_ROWS}")
    # Chunks are whole tiles; the last one moves back to overlap the previous one instead of reaching past.
    bk = slots if slots < TILE else min(PALLAS_KV_CHUNK, slots - slots % TILE)
    # explicit for 16-bit inputs too: a global "highest" default (the tests set one) asks Mosaic for an fp32
    # contraction of bf16 operands, which it refuses
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    neg = jnp.finfo(jnp.float32).min
    scale = d**-0.5

    def kernel(lengths_ref, q_ref, k_hbm, v_hbm, o_ref, lse_ref, k_buf, v_buf, sems):
        row, head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        n = lengths_ref[row]
        trips = (n + bk - 1) // bk
        qv = q_ref[...]
        # A causal segment is the block itself (slots == block length): a query row's block position is
        # row % slots, the group's heads being stacked with block position fastest.
        query_pos = (tile * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)) % slots

        def copies(c, buffer):
            start = jnp.minimum(c * bk, slots - bk)  # the last chunk moves back inside the cache
            return [pltpu.make_async_copy(src.at[row, head, pl.ds(start, bk)], buf.at[buffer], sems.at[i, buffer])
                    for i, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

        @pl.when(trips > 0)
        def _():
            for cp in copies(0, 0):
                cp.start()

        def chunk(c, carry):
            m, denom, acc = carry
            buffer = c % 2

            @pl.when(c + 1 < trips)  # double buffering: fetch the next chunk while this one computes
            def _():
                for cp in copies(c + 1, 1 - buffer):
                    cp.start()

            for cp in copies(c, buffer):
                cp.wait()
            start = jnp.minimum(c * bk, slots - bk)
            key_pos = start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            fresh = (key_pos >= c * bk) & (key_pos < n)  # not covered by the previous chunk, and live
            visible = fresh & (key_pos <= query_pos) if causal else jnp.broadcast_to(fresh, (bq, bk))
            s = jax.lax.dot_general(qv, k_buf[buffer], (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * scale
            s = jnp.where(visible, s, neg)
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            slot = start + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            values = jnp.where((slot >= c * bk) & (slot < n), v_buf[buffer], 0)  # stale slots may hold NaN
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha + jax.lax.dot_general(p.astype(values.dtype), values, (((1,), (0,)), ((), ())),
                                                    precision=precision, preferred_element_type=jnp.float32)
            return m_new, denom * alpha + p.sum(axis=1, keepdims=True), acc

        init = (jnp.full((bq, 1), neg, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
                jnp.zeros((bq, d), jnp.float32))
        m, denom, acc = jax.lax.fori_loop(0, trips, chunk, init)
        seen = denom > 0
        denom = jnp.where(seen, denom, 1.0)
        o_ref[...] = jnp.where(seen, acc / denom, 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m + jnp.log(denom), neg)

    tile_spec = lambda width: pl.BlockSpec((None, None, bq, width), lambda i, j, r, _: (i, j, r, 0))  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(b, hkv, rows // bq),
        in_specs=[tile_spec(d), pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[tile_spec(d), tile_spec(1)],
        scratch_shapes=[pltpu.VMEM((2, bk, d), k.dtype), pltpu.VMEM((2, bk, d), v.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))])
    out, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3] + (1,), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(lengths, q, k, v)
    return out, lse[..., 0]


def _per_shard(run, mesh):
    """``run`` (a Pallas kernel) on each device's shard: a ``pallas_call`` has no partitioning rule, so XLA
    would otherwise gather every cache onto every device. Rows and KV heads are independent, and the engine
    shards its caches exactly so (batch over data x fsdp, KV heads over tensor), hence no communication."""
    from dflash_jax import sharding

    def sharded(q, k, v, lengths, causal):
        spec = lambda x: sharding.spec_for(x.shape, ("batch", "kv_heads", None, None), mesh)  # noqa: E731
        out_specs = (spec(q), sharding.spec_for(q.shape[:3], ("batch", "kv_heads", None), mesh))
        body = lambda q, k, v, lengths: run(q, k, v, lengths, causal)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(spec(q), spec(k), spec(v),
                                                        sharding.spec_for(lengths.shape, ("batch",), mesh)),
                             out_specs=out_specs, check_vma=False)(q, k, v, lengths)

    return sharded


def group_sinks(sinks: jax.Array, hkv: int, t: int) -> jax.Array:
    """Per-query-head sink logits ``[Hq]`` laid out like ``group_queries``' rows: ``[Hkv, G * T]``."""
    return jnp.repeat(sinks.astype(jnp.float32).reshape(hkv, -1), t, axis=1)


def _masked_segment(q, keys, values, lengths, causal, mask, grouped: bool):
    """A masked segment through XLA, laid out as the kernel's own results: grouped rows ``[B, Hkv, G*T, ...]``
    (Pallas) or ``[B, Hq, T, ...]`` (the others; query head ``h`` is KV head ``h // G``'s ``h % G``-th)."""
    b, t, hq, _ = q.shape
    hkv = keys.shape[1]
    out, lse = _grouped_xla(group_queries(q, hkv), keys, values, lengths, causal, mask)
    if grouped:
        return out, lse
    out = ungroup_queries(out, t).transpose(0, 2, 1, 3)
    return out, lse.reshape(b, hkv, hq // hkv, t).reshape(b, hq, t)


_KERNELS = {"xla": _kernel_xla, "cudnn": _kernel_cudnn, "pallas": _kernel_pallas}


def fused_attention(q: jax.Array, segments: Sequence[Segment], kernel: str,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention of ``q [B, T, Hq, D]`` over all ``segments`` jointly (a row's segment with no visible
    key weighs nothing; a query seeing nothing gets zeros). ``sinks [Hq]``: one logit per query head that joins
    every softmax's denominator and adds no value (gpt-oss)."""
    t = q.shape[1]
    run = _KERNELS[kernel]
    if kernel == "pallas":
        # The Pallas kernel takes grouped rows [B, Hkv, G*T, D] (block position fastest, so row % T is the
        # query's block position for a causal segment); off a TPU it runs in interpret mode.
        query = group_queries(q, segments[0].keys.shape[1])
        run = functools.partial(run, interpret=current_platform() != "tpu")
        mesh = _MESH.get()
        if mesh is not None and mesh.size > 1:
            run = _per_shard(run, mesh)
    else:
        query = q.transpose(0, 2, 1, 3)  # [B, Hq, T, D]
    parts = []
    for seg in segments:
        keys, values, lengths = seg.keys.astype(q.dtype), seg.values.astype(q.dtype), seg.lengths.astype(jnp.int32)
        if seg.mask is not None:
            out, lse = _masked_segment(q, keys, values, lengths, seg.causal, seg.mask, grouped=kernel == "pallas")
        else:
            out, lse = run(query, keys, values, lengths, seg.causal)
        seen = (seg.lengths > 0)[:, None, None]
        parts.append((jnp.where(seen[..., None], out.astype(jnp.float32), 0.0),
                      jnp.where(seen, lse.astype(jnp.float32), -jnp.inf), seen))
    if sinks is not None:  # a key of logit ``sink`` and value zero, laid out like the query rows
        hkv = segments[0].keys.shape[1]
        rows = group_sinks(sinks, hkv, t) if kernel == "pallas" else jnp.repeat(
            sinks.astype(jnp.float32)[:, None], t, axis=1)
        lse = jnp.broadcast_to(rows[None], parts[0][1].shape)
        parts.append((jnp.zeros_like(parts[0][0]), lse, jnp.ones(lse.shape, bool)))
    top = parts[0][1]
    for _, lse, _ in parts[1:]:
        top = jnp.maximum(top, lse)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    total, acc = 0.0, 0.0
    for out, lse, seen in parts:
        w = jnp.where(seen, jnp.exp(lse - top), 0.0)
        total, acc = total + w, acc + w[..., None] * out
    out = jnp.where(total[..., None] > 0, acc / jnp.maximum(total, 1e-30)[..., None], 0.0)
    if kernel == "pallas":
        return ungroup_queries(out, t).astype(q.dtype)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)
