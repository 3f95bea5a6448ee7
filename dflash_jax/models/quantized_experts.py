"""Block-scaled FP8 and packed INT4 expert weights kept quantised on the device, decoded inside each layer.

The released checkpoints of the largest MoE targets store their routed experts quantised (what each format is,
and how the host decodes it, is ``checkpoints/quantized``'s docstring):

- ``"fp8"``: FP8 e4m3 codes times a float32 scale per ``(bn, bk)`` block (DeepSeek-V3 / Kimi-K2-Base, GLM-5.1-FP8,
  MiniMax-M2: ``weight_scale_inv`` over 128 x 128 blocks; compressed-tensors ``float-quantized`` "block" or
  "group" scales). 8 bits per weight (+ 32 bits per 16,384 weights).
- ``"int4"``: compressed-tensors ``pack-quantized`` symmetric INT4 (Kimi K2-Thinking, K2.5-K2.7): eight 4-bit
  values per int32 word (lowest nibble first, stored as ``q + 8``), times a bfloat16 scale per group of
  ``group_size`` inputs in a row. 4 bits per weight (+ 16 bits per 32 weights).

Kimi-K2.5's ~1.03T parameters take ~2 TB in bfloat16 and ~0.55 TB with its experts as stored: the difference
between 2 x 8 H200s and one. Only the routed experts are kept quantised (the bulk of such a model; its
attention, dense layers and shared experts are dequantised at load, as before).

Parameters, rows = output features as stored (``[out, in]`` per expert), experts leading::

    experts/{proj}_qweight   fp8: float8_e4m3fn [E, out, in]      int4: int32 [E, out, in / 8]
    experts/{proj}_qscale    fp8: float32 [E, out / bn, in / bk]  int4: bfloat16 [E, out, in / group]

for ``proj`` in ``gate_proj``, ``up_proj`` (out = I, in = H) and ``down_proj`` (out = H, in = I). The block
``ExpertsConfig.weight_block`` is ``(bn, bk)`` for FP8 and ``(1, group)`` for INT4; the sizes must be
multiples of it (true of every released model above; a checkpoint whose are not loads with ``--experts
dequantize``).

Decoding forms the product in float32 (an FP8 code and an INT4 integer are exact there) and casts once, as the
host decoder does, so a packed layer computes exactly what the same layer loaded dequantised computes
(tests/test_quantized_experts.py compares the two bit for bit in float32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["FORMATS", "INT4_PER_WORD", "qweight_shape", "qscale_shape", "param_dtypes", "check_block",
           "decode_rows", "decode_all"]

FORMATS = ("fp8", "int4")
#: INT4 values per int32 word (compressed-tensors' packing).
INT4_PER_WORD = 8


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantised expert format must be one of {', '.join(map(repr, FORMATS))}, got {fmt!r}")


def check_block(fmt: str, block: tuple[int, int] | None, out_features: int, in_features: int, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless an ``[out, in]`` weight splits into whole ``block``s (and,
    for INT4, whole int32 words)."""
    _check_format(fmt)
    if block is None or len(block) != 2 or min(block) < 1:
        raise ValueError(f"{what}: {fmt} experts need ExpertsConfig.weight_block (bn, bk), got {block!r}")
    bn, bk = block
    if fmt == "int4" and bn != 1:
        raise ValueError(f"{what}: INT4 scales cover (1, group) blocks, got {block!r}")
    if out_features % bn or in_features % bk or (fmt == "int4" and in_features % INT4_PER_WORD):
        words = f" and of {INT4_PER_WORD} inputs" if fmt == "int4" else ""
        raise ValueError(f"{what}: a [{out_features}, {in_features}] weight is not a whole number of {bn} x {bk} "
                         f"blocks{words}; kept quantised only then (load it dequantised instead)")


def qweight_shape(fmt: str, num_experts: int, out_features: int, in_features: int) -> tuple[int, int, int]:
    _check_format(fmt)
    inner = in_features if fmt == "fp8" else in_features // INT4_PER_WORD
    return num_experts, out_features, inner


def qscale_shape(fmt: str, block: tuple[int, int], num_experts: int, out_features: int,
                 in_features: int) -> tuple[int, int, int]:
    _check_format(fmt)
    return num_experts, out_features // block[0], in_features // block[1]


def param_dtypes(fmt: str) -> tuple[Any, Any]:
    """(codes dtype, scales dtype)."""
    _check_format(fmt)
    return (jnp.float8_e4m3fn, jnp.float32) if fmt == "fp8" else (jnp.int32, jnp.bfloat16)


def _values(fmt: str, qweight: jax.Array) -> jax.Array:
    """The stored codes as float32 values, ``[..., out, in]`` (exact: FP8 codes and 4-bit integers)."""
    if fmt == "fp8":
        return qweight.astype(jnp.float32)
    shifts = jnp.arange(INT4_PER_WORD, dtype=jnp.int32) * 4
    nibbles = jnp.right_shift(qweight[..., None], shifts) & 0xF  # arithmetic shift: the mask keeps 4 low bits
    q = nibbles.reshape(*qweight.shape[:-1], qweight.shape[-1] * INT4_PER_WORD)
    return (q - 8).astype(jnp.float32)


def decode_rows(fmt: str, block: tuple[int, int], qweight: jax.Array, qscale: jax.Array, dtype: Any,
                ids: jax.Array | None = None) -> jax.Array:
    """``[E, out, in]`` in ``dtype``, rows = output features (as stored). ``ids`` (any shape ``S``): only those
    experts, ``[*S, out, in]``: their codes and scales are gathered first and only the gathered copy is
    decoded (a round decodes the routed pairs' experts, not all ``E``); out-of-range ids are clamped."""
    if ids is not None:
        qweight = jnp.take(qweight, ids, axis=0, mode="clip")
        qscale = jnp.take(qscale, ids, axis=0, mode="clip")
    w = _values(fmt, qweight)
    *lead, out, inn = w.shape
    bn, bk = block
    w = w.reshape(*lead, out // bn, bn, inn // bk, bk) * qscale.astype(jnp.float32)[..., :, None, :, None]
    return w.reshape(*lead, out, inn).astype(dtype)


def decode_all(fmt: str, block: tuple[int, int], qweight: jax.Array, qscale: jax.Array, dtype: Any) -> jax.Array:
    """Every expert, ``[E, in, out]`` (the float params' orientation) in ``dtype``."""
    return jnp.swapaxes(decode_rows(fmt, block, qweight, qscale, dtype), -1, -2)
