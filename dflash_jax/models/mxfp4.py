"""MXFP4 expert weights (gpt-oss): decode on the host, or keep them packed on the device.

Storage (checked against transformers ``integrations/mxfp4.py``: ``_convert_moe_packed_tensors`` /
``convert_moe_packed_tensors``, ``Mxfp4GptOssExperts`` and ``quantizers/quantizer_mxfp4.py``). A fused expert
parameter ``model.layers.{i}.mlp.experts.{gate_up_proj,down_proj}`` is stored as two uint8 tensors named by
appending ``_blocks`` / ``_scales`` to its key (the bias ``..._bias`` is stored unquantised)::

    <key>_blocks  [E, out, G, 16]  uint8   two FP4 (e2m1) codes per byte, LOW nibble first
    <key>_scales  [E, out, G]      uint8   one shared exponent per 32 values: scale = 2 ** (s - 127)

with ``G = in_features / 32``. Byte ``j`` of group ``g`` of row ``o`` holds input features ``32 g + 2 j``
(low nibble) and ``32 g + 2 j + 1`` (high nibble). A code decodes through ``FP4_VALUES`` (0, .5, 1, 1.5, 2, 3,
4, 6 for codes 0-7; the same negated for 8-15). transformers reshapes the decoded ``[E, out, G, 32]`` to
``[E, out, in]`` and then transposes axes 1 and 2, giving the parameter in ``x @ W`` layout ``[E, in, out]``:

    gate_up_proj: blocks [E, 2I, H/32, 16] -> W [E, H, 2I]   (gate/up interleaved along the last axis)
    down_proj:    blocks [E, H, I/32, 16]  -> W [E, I, H]

Every function here returns / uses that ``[E, in, out]`` orientation. Stored cost: 4 bits per weight plus one
8-bit scale per 32 weights = 4.25 bits per weight (gpt-oss-120b: 128 x 2880 x 5760 gate_up is ~1.0 GB packed
vs ~4.2 GB in bfloat16).

Every decoded value is an FP4 value times a power of two, so it is exact in float32 and bfloat16 for all
scales that occur in practice (the tests compare bit for bit with transformers). Out-of-range scales
behave like ``ldexp`` in float32: ``s = 255`` overflows to inf for |v| >= 1 (the MX format reserves 0xFF for NaN);
``s <= 1`` yields subnormals, which the host decode keeps and XLA flushes to zero (CPU included).

The library stays importable without torch: numpy and jax only.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import UserError

__all__ = [
    "FP4_VALUES",
    "BLOCK_SIZE",
    "Mxfp4Error",
    "packed_key_names",
    "packed_shapes",
    "check_packed_shapes",
    "check_packed",
    "dequantize",
    "dequantize_jax",
    "dequantize_rows_jax",
    "packed_expert_matmul",
    "packed_ragged_dot",
    "packed_nbytes",
]

#: The FP4 (e2m1) code table, in code order 0..15 (bit 3 is the sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Values that share one scale (two per byte, 16 bytes per block).
BLOCK_SIZE = 32
_BYTES_PER_BLOCK = BLOCK_SIZE // 2
_SCALE_BIAS = 127


class Mxfp4Error(UserError):
    """A packed MXFP4 tensor with the wrong dtype, rank or shape (the message names the tensor and shapes)."""


def packed_key_names(param_key: str) -> tuple[str, str]:
    """Checkpoint names of a packed parameter: ``"model.layers.0.mlp.experts.gate_up_proj"`` ->
    ``("..._blocks", "..._scales")`` (underscore-joined, as in the released gpt-oss safetensors)."""
    return f"{param_key}_blocks", f"{param_key}_scales"


def packed_shapes(in_features: int, out_features: int, num_experts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``(blocks_shape, scales_shape)`` that hold a weight of logical shape ``[E, in, out]``."""
    groups = in_features // BLOCK_SIZE
    return (num_experts, out_features, groups, _BYTES_PER_BLOCK), (num_experts, out_features, groups)


def packed_nbytes(in_features: int, out_features: int, num_experts: int) -> int:
    """Bytes of blocks + scales for an ``[E, in, out]`` weight: 4.25 bits per weight."""
    groups = in_features // BLOCK_SIZE
    return num_experts * out_features * groups * (_BYTES_PER_BLOCK + 1)


def _label(name: str | None) -> str:
    return f"MXFP4 tensor {name!r}" if name else "MXFP4 tensor"


def check_packed_shapes(
    blocks_shape: Sequence[int],
    scales_shape: Sequence[int],
    in_features: int | None = None,
    out_features: int | None = None,
    num_experts: int | None = None,
    name: str | None = None,
) -> tuple[int, int, int]:
    """Validate packed shapes (e.g. from a safetensors header, before reading the data) and return the logical
    ``(num_experts, in_features, out_features)``. ``in_features``/``out_features``/``num_experts``, when given,
    must match (``in`` is the x @ W input size: hidden for gate_up_proj, intermediate for down_proj).
    Raises ``Mxfp4Error`` naming ``name`` and the shapes."""
    label = _label(name)
    blocks_shape = tuple(int(d) for d in blocks_shape)
    scales_shape = tuple(int(d) for d in scales_shape)
    if len(blocks_shape) != 4 or blocks_shape[-1] != _BYTES_PER_BLOCK:
        raise Mxfp4Error(
            f"{label}: blocks must have shape [experts, out, groups, {_BYTES_PER_BLOCK}], got {list(blocks_shape)}"
        )
    if len(scales_shape) != 3:
        raise Mxfp4Error(f"{label}: scales must have shape [experts, out, groups], got {list(scales_shape)}")
    if blocks_shape[:3] != scales_shape:
        raise Mxfp4Error(
            f"{label}: blocks {list(blocks_shape)} and scales {list(scales_shape)} disagree on "
            f"[experts, out, groups] ({list(blocks_shape[:3])} vs {list(scales_shape)})"
        )
    experts, out, groups = scales_shape
    inn = groups * BLOCK_SIZE
    expected = {"num_experts": (num_experts, experts), "in_features": (in_features, inn),
                "out_features": (out_features, out)}
    wrong = {k: v for k, v in expected.items() if v[0] is not None and int(v[0]) != v[1]}
    if wrong:
        if in_features is not None and int(in_features) % BLOCK_SIZE:
            raise Mxfp4Error(f"{label}: in_features={in_features} is not a multiple of {BLOCK_SIZE}")
        want_b, want_s = packed_shapes(
            int(in_features if in_features is not None else inn),
            int(out_features if out_features is not None else out),
            int(num_experts if num_experts is not None else experts),
        )
        detail = ", ".join(f"{k}={v[0]} but the tensor holds {v[1]}" for k, v in wrong.items())
        raise Mxfp4Error(
            f"{label}: blocks {list(blocks_shape)} / scales {list(scales_shape)} do not fit the config ({detail}); "
            f"expected blocks {list(want_b)} and scales {list(want_s)}"
        )
    return experts, inn, out


def check_packed(blocks, scales, name: str | None = None) -> tuple[int, int, int]:
    """Validate packed arrays (numpy or jax): uint8 dtype and consistent shapes. Returns ``(E, in, out)``."""
    label = _label(name)
    for what, arr in (("blocks", blocks), ("scales", scales)):
        dtype = getattr(arr, "dtype", None)
        if dtype is None or np.dtype(dtype) != np.uint8:
            raise Mxfp4Error(
                f"{label}: {what} must be uint8, got {dtype} with shape {list(getattr(arr, 'shape', ()))}"
            )
    return check_packed_shapes(blocks.shape, scales.shape, name=name)


# ---------------------------------------------------------------------------------------------------------------
# Host (numpy)
# ---------------------------------------------------------------------------------------------------------------

_LUT_F32 = np.asarray(FP4_VALUES, dtype=np.float32)


def _decode_rows_np(blk: np.ndarray, scl: np.ndarray) -> np.ndarray:
    """[R, G, 16] uint8 codes and [R, G] uint8 scales -> [R, G * 32] float32 (row-major, input order)."""
    rows, groups, _ = blk.shape
    vals = np.empty((rows, groups, BLOCK_SIZE), dtype=np.float32)
    vals[..., 0::2] = _LUT_F32[blk & 0x0F]
    vals[..., 1::2] = _LUT_F32[blk >> 4]
    exp = scl.astype(np.int32) - _SCALE_BIAS
    with np.errstate(over="ignore"):  # s = 255 -> inf, as ldexp/transformers
        np.ldexp(vals, exp[..., None], out=vals)
    return vals.reshape(rows, groups * BLOCK_SIZE)


def dequantize(blocks, scales, dtype=np.float32, *, name: str | None = None,
               rows_per_chunk: int = 8192) -> np.ndarray:
    """Decode packed MXFP4 expert weights on the host into ``[E, in, out]`` (transformers' gpt-oss parameter
    orientation: ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``).

    ``blocks [E, out, in/32, 16]`` and ``scales [E, out, in/32]`` are uint8 (numpy arrays, memmaps or anything
    ``np.asarray`` accepts per slice). Works expert by expert and ``rows_per_chunk`` output rows at a time, so
    besides the result only one chunk's float32 temporaries are alive (8192 rows x 2880 -> ~94 MB).
    ``dtype``: the result's dtype (float32, bfloat16 via ``jnp.bfloat16``/ml_dtypes, float16, ...); values are
    decoded in float32 and cast once."""
    experts, inn, out = check_packed(blocks, scales, name=name)
    dtype = np.dtype(dtype)
    result = np.empty((experts, inn, out), dtype=dtype)
    step = max(1, int(rows_per_chunk))
    for e in range(experts):
        for r0 in range(0, out, step):
            r1 = min(r0 + step, out)
            blk = np.asarray(blocks[e, r0:r1])
            scl = np.asarray(scales[e, r0:r1])
            result[e, :, r0:r1] = _decode_rows_np(blk, scl).T  # [rows, in] -> [in, rows]
    return result


# ---------------------------------------------------------------------------------------------------------------
# Device (jax): weights stay packed; decode inside the jitted computation
# ---------------------------------------------------------------------------------------------------------------


def _pow2(e, dtype):
    """Exact 2**e for integer e in [-126, 127] as float32 (built from the exponent bits), cast to dtype."""
    bits = (e + 127).astype(jnp.uint32) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _fp4_values(codes, dtype):
    """``FP4_VALUES[codes]`` (codes 0..15, uint8) by arithmetic, not a table lookup: E2M1 is sign, 2 exponent
    bits and 1 mantissa bit, ``m / 2`` for exponent 0 and ``(1 + m / 2) * 2 ** (e - 1)`` otherwise, all exact.
    A lookup lowers to a gather with an int32 index per weight, which the TPU compiler materialises (several
    index and float copies of each decoded expert stack); this is elementwise and fuses into its consumer."""
    c = codes.astype(jnp.int32)
    e = (c >> 1) & 3
    m = (c & 1).astype(dtype)
    half = jnp.asarray(0.5, dtype)
    magnitude = jnp.where(e == 0, m * half, (1 + m * half) * jnp.left_shift(1, jnp.maximum(e - 1, 0)).astype(dtype))
    return jnp.where((c >> 3) == 1, -magnitude, magnitude)


def _work_dtype(dtype):
    # bfloat16 has float32's exponent range, so decoding in it is exact; narrower types decode in float32.
    return dtype if dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) else jnp.dtype(jnp.float32)


def _decode_jax(blocks, scales, dtype):
    """[..., out, G, 16] / [..., out, G] -> [..., out, in] in dtype (un-transposed)."""
    dtype = jnp.dtype(dtype)
    work = _work_dtype(dtype)
    blocks = jnp.asarray(blocks)
    scales = jnp.asarray(scales)
    lo = _fp4_values(blocks & 0x0F, work)
    hi = _fp4_values(blocks >> 4, work)
    vals = jnp.stack([lo, hi], axis=-1)  # [..., out, G, 16, 2]: low nibble first
    vals = vals.reshape(*blocks.shape[:-1], BLOCK_SIZE)  # [..., out, G, 32]
    # 2 ** (s - 127) as two exact powers of two (each exponent in [-64, 64]): the first product is exact, the
    # second rounds once, so this equals ldexp (s = 255 included) without building 2 ** 128.
    e = scales.astype(jnp.int32) - _SCALE_BIAS
    e1 = e // 2
    e2 = e - e1
    vals = vals * _pow2(e1, work)[..., None] * _pow2(e2, work)[..., None]
    vals = vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE)
    return vals.astype(dtype)


def dequantize_jax(blocks, scales, dtype=jnp.bfloat16, *, name: str | None = None):
    """Jittable decode: ``blocks [E, out, in/32, 16]``, ``scales [E, out, in/32]`` (uint8) -> ``[E, in, out]`` in
    ``dtype`` (same orientation and values as ``dequantize``). Shapes/dtypes are checked at trace time."""
    check_packed(blocks, scales, name=name)
    return jnp.swapaxes(_decode_jax(blocks, scales, dtype), -1, -2)


def dequantize_rows_jax(blocks, scales, dtype=jnp.bfloat16, *, ids=None, name: str | None = None):
    """Jittable decode in the stored orientation, rows = output features: ``blocks [E, out, in/32, 16]``,
    ``scales [E, out, in/32]`` (uint8) -> ``[E, out, in]`` in ``dtype`` (``dequantize_jax`` transposed).

    ``ids`` (integer, any shape ``S``): decode only those experts, ``-> [*S, out, in]``. The packed blocks and
    scales are gathered FIRST (uint8, 4.25 bits per weight) and only the gathered copy is decoded, so the
    decoded temporary holds ``prod(S)`` experts, not ``E`` (a decode step routing a few tokens to a few of
    gpt-oss-120b's 128 experts decodes those, not all 128). Repeated ids are decoded once per occurrence.
    Out-of-range ids are clamped, like any JAX gather: check them upstream."""
    check_packed(blocks, scales, name=name)
    if ids is not None:
        ids = jnp.asarray(ids)
        blocks = jnp.take(jnp.asarray(blocks), ids, axis=0, mode="clip")
        scales = jnp.take(jnp.asarray(scales), ids, axis=0, mode="clip")
    return _decode_jax(blocks, scales, dtype)


def packed_expert_matmul(x, blocks, scales, *, dtype=None, precision=None, preferred_element_type=None,
                         name: str | None = None):
    """Per-expert ``x[e] @ W[e]`` with ``W`` kept packed: ``x [E, C, in]`` (tokens grouped per expert, e.g. an
    all-experts or capacity layout) -> ``[E, C, out]``.

    Inside the jitted caller the whole ``[E, in, out]`` weight is decoded to ``dtype`` (default ``x.dtype``) and
    contracted with one einsum, so the only persistent device memory is the packed 4.25 bits/weight; the decoded
    copy is a temporary of this op (XLA may fuse it; call it per layer to keep one layer's copy alive)."""
    experts, inn, out = check_packed(blocks, scales, name=name)
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[0] != experts or x.shape[2] != inn:
        raise Mxfp4Error(
            f"{_label(name)}: x must have shape [experts={experts}, tokens, in={inn}], got {list(x.shape)}"
        )
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    w = _decode_jax(blocks, scales, dtype)  # [E, out, in]
    return jnp.einsum("eci,eoi->eco", x.astype(dtype), w, precision=precision,
                      preferred_element_type=preferred_element_type)


def packed_ragged_dot(x, blocks, scales, group_sizes, *, dtype=None, precision=None,
                      preferred_element_type=None, name: str | None = None):
    """Dropless grouped matmul with packed weights: ``x [T, in]`` sorted by expert, ``group_sizes [E]`` (int32,
    summing to at most T) -> ``[T, out]`` where row t of group e is ``x[t] @ W[e]`` (``jax.lax.ragged_dot``; rows
    past ``sum(group_sizes)`` come back as zeros). The weight is decoded to ``dtype`` (default ``x.dtype``)
    inside the caller's jit."""
    experts, inn, out = check_packed(blocks, scales, name=name)
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] != inn:
        raise Mxfp4Error(f"{_label(name)}: x must have shape [tokens, in={inn}], got {list(x.shape)}")
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (experts,):
        raise Mxfp4Error(
            f"{_label(name)}: group_sizes must have shape [{experts}] (one per expert), got {list(group_sizes.shape)}"
        )
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    w = jnp.swapaxes(_decode_jax(blocks, scales, dtype), -1, -2)  # [E, in, out]
    return jax.lax.ragged_dot(x.astype(dtype), w, group_sizes.astype(jnp.int32), precision=precision,
                              preferred_element_type=preferred_element_type)

