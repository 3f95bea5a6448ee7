"""Quantised checkpoints, dequantised at load: block-scaled FP8 and compressed-tensors INT4.

``SafetensorsDir`` reads ``config.json``'s ``quantization_config`` (top level, or its ``text_config``'s) when it
opens a directory, and from then on hands out every quantised weight as a plain float array under its usual
name, one tensor at a time: every family, the per-expert stacks of ``expert_layouts`` and the fused
projections included, loads a quantised checkpoint exactly as it loads a float one. What is quantised is read
from the tensors themselves (their dtype and companion tensors), not from the config's skip lists: the modules
that ``modules_to_not_convert`` / ``ignored_layers`` / ``ignore`` name are stored as plain floats and load as
they are, and no scale is asked of them.

**FP8, block-scaled** (``quant_method: "fp8"``: DeepSeek-V3, GLM-4.5/5.1-FP8, MiniMax-M2, Qwen3-*-FP8; fields
as transformers' ``FineGrainedFP8Config`` reads them, ``utils/quantization_config.py``)::

    quantization_config {quant_method: "fp8", activation_scheme: "dynamic" | "static",
                         weight_block_size: [bn, bk] (default [128, 128]; null = one scale per tensor),
                         modules_to_not_convert | ignored_layers, scale_fmt: "float" | "ue8m0", fmt: "e4m3"}
    <m>.weight            float8_e4m3fn [..., N, K]
    <m>.weight_scale_inv  [..., ceil(N / bn), ceil(K / bk)]     (a tensor not named .weight: <key>_scale_inv)
    W[i, j] = w8[i, j] * s[i // bn, j // bk]

The grid is the ceiling one (transformers' ``FP8Linear`` allocates it so), so N and K need not be multiples
of the block: the last block row/column is partial. (transformers' own ``Fp8Dequantize`` infers the block from
the grid and refuses such shapes; this decoder takes the block from the config.) The product is formed in
float32 (the FP8 code exactly, times the float32 scale), as transformers forms it, then cast.

``scale_fmt: "ue8m0"`` (DeepSeek-V3.2/V4-style scales): every scale is a power of two. transformers accepts
them stored either in float32 (the power of two itself, then cast exactly to ``float8_e8m0fnu``) or natively
as ``float8_e8m0fnu`` (``F8_E8M0``: one biased exponent byte, scale ``2 ** (b - 127)``, 0xFF = NaN), and its
``Fp8Dequantize`` reads uint8 scales as the same exponent bytes. All three are read here: float scales as
they are, ``F8_E8M0`` always, ``U8`` only when the config says ``ue8m0`` (a byte that is not known to be an
exponent is refused). A NaN exponent byte is an error naming the tensor.

**FP8, compressed-tensors ``float-quantized``** (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK releases)::

    quantization_config {quant_method: "compressed-tensors", format: "float-quantized",
                         config_groups: {g: {weights: {num_bits: 8, type: "float", symmetric: true,
                                                       strategy: "channel" | "block" | "group" | "tensor",
                                                       block_structure: [bn, bk], group_size: g}}}, ignore}
    <m>.weight        float8_e4m3fn [N, K]
    <m>.weight_scale  [N, 1] (channel) | [ceil(N/bn), ceil(K/bk)] (block) | [N, ceil(K/g)] (group) | [1] (tensor)
    W = w8 * scale over the same grid as above (compressed-tensors multiplies; it names no inverse)

**INT4, compressed-tensors ``pack-quantized``** (Kimi K2-Thinking / K2.5 - K2.7)::

    quantization_config {quant_method: "compressed-tensors", format: "pack-quantized",
                         config_groups: {g: {weights: {num_bits: 4, type: "int", symmetric: true,
                                                       strategy: "group", group_size: 32, actorder: null}}},
                         ignore: [...]}
    <m>.weight_packed  int32 [out, ceil(in / 8)]
    <m>.weight_scale   bf16/f16/f32 [out, ceil(in / group_size)]   ([out, 1] for strategy "channel")
    <m>.weight_shape   int [2] = [out, in]
    W[r, c] = q[r, c] * scale[r, c // group_size],  q in [-8, 7]

Packing convention (compressed-tensors ``compressors/quantized_compressors/pack_quantized.py``,
``pack_to_int32`` / ``unpack_from_int32``, and its vLLM copy ``compressed_tensors/utils/packing``): each value
is shifted to unsigned (``q + 8``); along each row, element ``8 g + k`` occupies bits ``4k .. 4k + 3`` of int32
word ``g`` (the lowest nibble holds the first element); a row shorter than a multiple of 8 is zero-padded and
cut back to ``weight_shape`` on unpacking. For 4 bits the newer "dense" packer (values may straddle words for
widths that do not divide 32) writes the same words. The stored ``weight`` name does not exist; this module
presents ``<m>.weight`` (shape ``weight_shape``) in its place. compressed-tensors multiplies in the scale's
dtype (bf16 for Kimi); the product of a 4-bit integer and a bf16 scale formed in float32 and then rounded to
bf16 is the same number, so a bfloat16 load is identical to it and a float32 load is exact.

Refused with one ``CheckpointError`` naming config.json and the field: any other ``quant_method`` (gptq,
awq, bitsandbytes, mxfp4 outside gpt-oss, whose experts ``expert_layouts`` decodes), another
compressed-tensors format (``int-quantized``, ``nvfp4-pack-quantized``, ``mixed-precision``, ...), bit
width, type or strategy, asymmetric quantisation (zero points), activation
ordering with a group index, several differing weight schemes, another FP8 encoding. A weight whose scale is
missing or whose scale grid does not match its shape is one error naming the file and the tensor.

The ``quantization_config`` itself is read in ``models/quantization_schemes`` (a target's config holds its
scheme, and models do not import checkpoints); this module decodes the tensors it describes.

The library stays importable without torch: numpy (and ml_dtypes, a jax dependency) only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from dflash_jax.checkpoints.errors import CheckpointError
from dflash_jax.models import quantization_schemes
from dflash_jax.models.quantization_schemes import (  # noqa: F401  (re-exported: the loaders read them here)
    Fp8Scheme, Int4Scheme, Scheme, UnsupportedScheme, quantization_config_of,
)

#: Stored dtypes whose tensors are FP8 weight codes.
FP8_WEIGHT_DTYPES = ("F8_E4M3",)
#: The FP8 e4m3fn code table: code (one byte) -> float32. 0x7F and 0xFF are NaN.
FP8_E4M3_VALUES: np.ndarray | None = None
INT4_PER_WORD = 8


class QuantizationError(CheckpointError):
    """A quantised checkpoint that cannot be read; the message names the file and the key or field."""


def _fp8_table() -> np.ndarray:
    global FP8_E4M3_VALUES
    if FP8_E4M3_VALUES is None:
        import ml_dtypes  # installed with jax

        FP8_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return FP8_E4M3_VALUES


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def raise_if_unsupported(scheme: Any) -> None:
    if isinstance(scheme, UnsupportedScheme):
        raise QuantizationError(scheme.error)


def scheme_of_dir(path: Path) -> Scheme | None:
    """The quantisation scheme ``path/config.json`` declares, ``None`` for unquantised weights (or no
    readable config.json: the caller reports a bad config itself). Unsupported methods raise."""
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, Mapping):
        return None
    q = quantization_config_of(config)
    if q is None:
        return None
    return parse_scheme(q, str(config_path), str(config.get("model_type", "")))


def parse_scheme(q: Any, source: str, model_type: str = "") -> Scheme | None:
    """``models.quantization_schemes.parse_scheme``, its errors raised as a ``QuantizationError`` (a
    ``CheckpointError``): here the scheme is read to read the weights."""
    try:
        return quantization_schemes.parse_scheme(q, source, model_type)
    except quantization_schemes.QuantizationConfigError as err:
        raise QuantizationError(str(err)) from None


# --- the tensors ---------------------------------------------------------------------------------------

def packed_names(weight_key: str) -> tuple[str, str, str]:
    """``<m>.weight`` -> its compressed-tensors tensors (``weight_packed``, ``weight_scale``, ``weight_shape``)."""
    return weight_key + "_packed", weight_key + "_scale", weight_key + "_shape"


class Reader:
    """What the decoders need of a checkpoint (``SafetensorsDir`` implements it): raw tensors, stored shapes
    and dtypes, the file a key lives in."""

    key_to_file: dict
    get_stored: Callable[[str], np.ndarray]
    stored_shape: Callable[[str], tuple[int, ...]]
    stored_dtype_name: Callable[[str], str]


def fp8_grid(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale shape for an FP8 tensor of ``shape`` (ceil grid over the last two axes)."""
    if block is None:
        return ()
    return tuple(shape[:-2]) + (_ceil_div(shape[-2], block[0]), _ceil_div(shape[-1], block[1]))


def scale_values(reader: Reader, scale_key: str, scheme: Fp8Scheme) -> np.ndarray:
    """An FP8 scale tensor as float32 (E8M0 exponent bytes converted; their NaN code refused)."""
    f = reader.key_to_file[scale_key]
    dtype = reader.stored_dtype_name(scale_key)
    if dtype in ("F32", "F16", "BF16", "F64"):
        return np.asarray(reader.get_stored(scale_key), dtype=np.float32)
    if dtype == "F8_E8M0" or (dtype == "U8" and scheme.scale_fmt == "ue8m0"):
        raw = np.asarray(reader.get_stored(scale_key)).view(np.uint8)
        if (raw == 0xFF).any():
            raise QuantizationError(f"{f}: tensor {scale_key!r} holds the E8M0 NaN code 0xFF")
        return np.ldexp(np.float32(1.0), raw.astype(np.int32) - 127).astype(np.float32)
    raise QuantizationError(
        f"{f}: tensor {scale_key!r} is stored as {dtype}; FP8 scales must be floating point"
        + (" (or F8_E8M0 / U8 exponents with scale_fmt 'ue8m0')" if dtype == "U8" else ""))


def dequantize_fp8(reader: Reader, key: str, scheme: Fp8Scheme, out_dtype: Any = np.float32) -> np.ndarray:
    """The float weight ``key`` (stored FP8) with its scale grid applied, as ``out_dtype``."""
    f = reader.key_to_file[key]
    shape = reader.stored_shape(key)
    scale_key = scheme.scale_key(key)
    what = f"({scheme.describe()}, {scheme.source})"
    if scale_key not in reader.key_to_file:
        raise QuantizationError(f"{f}: FP8 tensor {key!r} has no scale tensor {scale_key!r} {what}")
    if scheme.strategy != "tensor" and len(shape) < 2:
        raise QuantizationError(f"{f}: FP8 tensor {key!r} has shape {list(shape)}; block scales need a matrix")
    block = scheme.block_for(shape)
    want = fp8_grid(shape, block)
    got = reader.stored_shape(scale_key)
    if got != want and not (block is None and got in ((1,), (1, 1))):
        raise QuantizationError(
            f"{reader.key_to_file[scale_key]}: tensor {scale_key!r} has shape {list(got)}, expected {list(want)}: "
            f"the scale grid of {key!r} {list(shape)} {what}")
    scale = scale_values(reader, scale_key, scheme)
    codes = np.asarray(reader.get_stored(key)).view(np.uint8)
    if ((codes & 0x7F) == 0x7F).any():
        raise QuantizationError(f"{f}: FP8 tensor {key!r} holds the e4m3 NaN code (0x7F / 0xFF)")
    w = _fp8_table()[codes]  # float32, exact
    if block is None:
        w *= scale.reshape(())
        return w.astype(out_dtype, copy=False)
    bn, bk = block
    n, k = shape[-2:]
    gn, gk = want[-2:]
    lead = shape[:-2]
    if n % bn or k % bk:  # partial last blocks: pad, scale, cut
        padded = np.zeros(lead + (gn * bn, gk * bk), np.float32)
        padded[..., :n, :k] = w
        w = padded
    view = w.reshape(lead + (gn, bn, gk, bk))
    view *= scale[..., :, None, :, None]
    w = view.reshape(lead + (gn * bn, gk * bk))[..., :n, :k]
    return np.ascontiguousarray(w, dtype=out_dtype)


def int4_weight_shape(reader: Reader, key: str) -> tuple[int, ...]:
    """``<m>.weight``'s shape from its stored ``weight_shape`` tensor."""
    packed, _, shape_key = packed_names(key)
    f = reader.key_to_file[packed]
    if shape_key not in reader.key_to_file:
        raise QuantizationError(f"{f}: packed INT4 tensor {packed!r} has no {shape_key!r}")
    stored = np.asarray(reader.get_stored(shape_key))
    if stored.ndim != 1 or not np.issubdtype(stored.dtype, np.integer) or (stored <= 0).any():
        raise QuantizationError(f"{reader.key_to_file[shape_key]}: tensor {shape_key!r} must be a list of positive "
                                f"integers, got {stored.tolist()!r}")
    return tuple(int(d) for d in stored)


def refuse_int4_extras(reader: Reader, key: str, scheme: Int4Scheme) -> None:
    """Zero points and group indices (asymmetric or activation-ordered INT4) change the decoding; neither the
    load-time decoder nor the packed experts apply them, so a checkpoint that has them is refused."""
    for extra in (key + "_zero_point", key + "_g_idx"):
        if extra in reader.key_to_file:
            raise QuantizationError(f"{reader.key_to_file[extra]}: tensor {extra!r}: zero points and group indices "
                                    f"(asymmetric or activation-ordered INT4) are not supported "
                                    f"({scheme.describe()}, {scheme.source})")


def dequantize_int4(reader: Reader, key: str, scheme: Int4Scheme, out_dtype: Any = np.float32) -> np.ndarray:
    """The float weight ``<m>.weight`` from ``<m>.weight_packed`` / ``_scale`` / ``_shape``."""
    packed_key, scale_key, _ = packed_names(key)
    f = reader.key_to_file[packed_key]
    what = f"({scheme.describe()}, {scheme.source})"
    refuse_int4_extras(reader, key, scheme)
    shape = int4_weight_shape(reader, key)
    out, inn = shape[-2:] if len(shape) >= 2 else (None, None)
    if out is None:
        raise QuantizationError(f"{f}: {key + '_shape'!r} is {list(shape)}; a packed weight is a matrix")
    dtype = reader.stored_dtype_name(packed_key)
    if dtype != "I32":
        raise QuantizationError(f"{f}: tensor {packed_key!r} is stored as {dtype}; packed INT4 weights are I32")
    want_packed = shape[:-1] + (_ceil_div(inn, INT4_PER_WORD),)
    if reader.stored_shape(packed_key) != want_packed:
        raise QuantizationError(f"{f}: tensor {packed_key!r} has shape {list(reader.stored_shape(packed_key))}, "
                                f"expected {list(want_packed)} (8 values per int32 of a {list(shape)} weight)")
    if scale_key not in reader.key_to_file:
        raise QuantizationError(f"{f}: packed INT4 tensor {packed_key!r} has no scale tensor {scale_key!r} {what}")
    groups = 1 if scheme.group_size is None else _ceil_div(inn, scheme.group_size)
    want_scale = shape[:-1] + (groups,)
    got = reader.stored_shape(scale_key)
    if got != want_scale:
        raise QuantizationError(
            f"{reader.key_to_file[scale_key]}: tensor {scale_key!r} has shape {list(got)}, expected "
            f"{list(want_scale)}: the scale grid of {key!r} {list(shape)} {what}")
    scale_dtype = reader.stored_dtype_name(scale_key)
    if scale_dtype not in ("F32", "F16", "BF16", "F64"):
        raise QuantizationError(f"{reader.key_to_file[scale_key]}: tensor {scale_key!r} is stored as {scale_dtype}; "
                                "INT4 scales must be floating point")
    words = np.asarray(reader.get_stored(packed_key)).view(np.uint32)
    shifts = (4 * np.arange(INT4_PER_WORD, dtype=np.uint32))
    nibbles = ((words[..., None] >> shifts) & np.uint32(0xF)).astype(np.int8)  # [..., out, words, 8]
    q = nibbles.reshape(words.shape[:-1] + (-1,))[..., :inn]
    w = q.astype(np.float32) - np.float32(8.0)  # stored unsigned: q + 8
    scale = np.asarray(reader.get_stored(scale_key), dtype=np.float32)
    if scheme.group_size is None:
        w *= scale
    else:
        g = scheme.group_size
        full = groups * g
        if full != inn:
            w = np.concatenate([w, np.zeros(w.shape[:-1] + (full - inn,), np.float32)], axis=-1)
        view = w.reshape(w.shape[:-1] + (groups, g))
        view *= scale[..., None]
        w = view.reshape(w.shape)[..., :inn]
    return np.ascontiguousarray(w, dtype=out_dtype)


def virtual_int4_keys(keys: list[str]) -> dict[str, str]:
    """``{<m>.weight: <m>.weight_packed}`` for every packed tensor among ``keys``."""
    return {k[: -len("_packed")]: k for k in keys if k.endswith(".weight_packed")}
