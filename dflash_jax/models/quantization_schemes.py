"""The weight quantisation a ``config.json`` declares (``quantization_config``), read without the weights.

A target's config says how its checkpoint stores the weights (block-scaled FP8, compressed-tensors FP8 or INT4;
``checkpoints/quantized`` describes the formats and decodes the tensors). The scheme is part of
``TargetConfig`` (``quantization``), which the model layer builds, so it is read here, below both the model
and the checkpoint layers: models never import checkpoints. A bad or unsupported ``quantization_config`` is a
:class:`QuantizationConfigError` naming the file and the field; ``checkpoints/quantized`` raises it as its own
``QuantizationError`` (a ``CheckpointError``) where the weights are read.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

from dflash_jax.models.config_fields import ConfigError

log = logging.getLogger(__name__)

FP8_METHOD = "fp8"
COMPRESSED_TENSORS = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
FLOAT_QUANTIZED = "float-quantized"


class QuantizationConfigError(ConfigError):
    """A ``quantization_config`` this project cannot read; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """FP8 e4m3 weights times a scale grid: ``quant_method: "fp8"`` (``<key>_scale_inv``, block ``(bn, bk)`` or
    ``None`` for one scale per tensor) or compressed-tensors ``float-quantized`` (``<m>.weight_scale``;
    ``strategy`` "block", "channel" (one scale per output row), "group" (``(1, group)``) or "tensor")."""

    block: tuple[int, int] | None
    scale_fmt: str
    source: str  # config.json, for messages
    scale_suffix: str = "_scale_inv"
    strategy: str = "block"

    def block_for(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The block one scale covers in a tensor of ``shape`` (``None``: the whole tensor)."""
        if self.strategy == "channel":
            return (1, shape[-1])
        return self.block if self.strategy in ("block", "group") else None

    def scale_key(self, key: str) -> str:
        """``<m>.weight`` -> ``<m>.weight_scale_inv`` / ``<m>.weight_scale``; transformers names the scale of a
        tensor not called ``.weight`` (a fused ``experts.gate_up_proj``) ``<key>_scale_inv`` alike."""
        return key + self.scale_suffix

    def describe(self) -> str:
        if self.strategy == "channel":
            grid = "one scale per output channel"
        elif self.block:
            grid = f"{self.block[0]}x{self.block[1]} blocks"
        else:
            grid = "one scale per tensor"
        return f"FP8 e4m3, {grid}" + (f", scale_fmt {self.scale_fmt}" if self.scale_suffix == "_scale_inv" else "")


@dataclasses.dataclass(frozen=True)
class Int4Scheme:
    """compressed-tensors ``pack-quantized``, symmetric signed INT4; ``group_size None`` = one scale per row."""

    group_size: int | None
    source: str

    def describe(self) -> str:
        return f"INT4 pack-quantized, {'group ' + str(self.group_size) if self.group_size else 'per channel'}"


@dataclasses.dataclass(frozen=True)
class UnsupportedScheme:
    """A ``quantization_config`` this project cannot read (another method, or bad fields), kept on a config
    that only describes the model (``infer plan --target-config``, ``train plan``, ``convert --layout``):
    those need no weights. ``error`` is the ``QuantizationConfigError`` message; loading the weights or keeping
    them packed raises it as a ``QuantizationError`` (``checkpoints.quantized.raise_if_unsupported``)."""

    error: str

    def describe(self) -> str:
        return "weights quantised in a way this project cannot read"


Scheme = Fp8Scheme | Int4Scheme


def quantization_config_of(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``quantization_config`` of a config.json object: its own, else its ``text_config``'s."""
    q = config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), Mapping):
        q = config["text_config"].get("quantization_config")
    return q


def parse_scheme(q: Any, source: str, model_type: str = "") -> Scheme | None:
    """Read one ``quantization_config`` object; ``source`` names the file in messages."""
    where = f"{source}: quantization_config"
    if not isinstance(q, Mapping):
        raise QuantizationConfigError(f"{where} must be an object, got {str(q)[:80]!r}")
    method = q.get("quant_method")
    if method == FP8_METHOD:
        return _parse_fp8(q, where, source)
    if method == COMPRESSED_TENSORS:
        return _parse_compressed_tensors(q, where, source)
    if method == "mxfp4" and model_type == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts: expert_layouts / models.mxfp4 decode them
    raise QuantizationConfigError(
        f"{where}: quant_method {method!r} is not supported; dflash_jax reads block-scaled FP8 "
        f"('fp8'), compressed-tensors INT4 ('compressed-tensors', pack-quantized) and gpt-oss's MXFP4. "
        "Use the model's bfloat16 or FP8 release, or dequantise it first")


def _parse_fp8(q: Mapping[str, Any], where: str, source: str) -> Fp8Scheme:
    activation = str(q.get("activation_scheme", "dynamic")).lower()
    if activation not in ("dynamic", "static"):
        raise QuantizationConfigError(f"{where}: activation_scheme {q.get('activation_scheme')!r} is not one of "
                                "'dynamic', 'static'")
    if activation == "static":
        log.info("%s: activation_scheme 'static': the weights are dequantised and the activations are not "
                 "quantised (the stored input scales are unused)", source)
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn", "e4m3fn"):
        raise QuantizationConfigError(f"{where}: fmt {fmt!r} is not supported (FP8 weights must be e4m3)")
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise QuantizationConfigError(f"{where}: scale_fmt {scale_fmt!r} is not one of 'float', 'ue8m0'")
    block = q.get("weight_block_size", [128, 128])
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantizationConfigError(f"{where}: weight_block_size must be two positive integers or null, "
                                    f"got {block!r}")
        block = (int(block[0]), int(block[1]))
    if q.get("modules_to_convert"):
        raise QuantizationConfigError(f"{where}: modules_to_convert (FP8 embeddings) is not supported")
    return Fp8Scheme(block=block, scale_fmt=scale_fmt, source=source, strategy="block" if block else "tensor")


def _parse_compressed_tensors(q: Mapping[str, Any], where: str, source: str) -> Int4Scheme | Fp8Scheme:
    fmt = q.get("format")
    if fmt not in (PACK_QUANTIZED, FLOAT_QUANTIZED):
        raise QuantizationConfigError(f"{where}: compressed-tensors format {fmt!r} is not supported (only "
                                f"{PACK_QUANTIZED!r}: symmetric INT4, and {FLOAT_QUANTIZED!r}: FP8 e4m3)")
    kind, bits = ("int", 4) if fmt == PACK_QUANTIZED else ("float", 8)
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantizationConfigError(f"{where}: config_groups must be a non-empty object")
    schemes = set()
    for name, group in groups.items():
        gw = f"{where}.config_groups.{name}.weights"
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise QuantizationConfigError(f"{gw} must be an object")
        if weights.get("type", "int") != kind:
            raise QuantizationConfigError(f"{gw}: type {weights.get('type')!r} is not supported with format {fmt!r} "
                                    f"(only {kind!r})")
        if weights.get("num_bits") != bits:
            raise QuantizationConfigError(f"{gw}: num_bits {weights.get('num_bits')!r} is not supported with format "
                                    f"{fmt!r} (only {bits})")
        if weights.get("symmetric") is not True:
            raise QuantizationConfigError(f"{gw}: symmetric {weights.get('symmetric')!r}: asymmetric quantisation (zero "
                                    "points) is not supported")
        if weights.get("actorder") == "group":
            raise QuantizationConfigError(f"{gw}: actorder 'group' (a permuted group index) is not supported")
        strategy = weights.get("strategy")
        if strategy == "group":
            size = weights.get("group_size")
            if not _positive_int(size):
                raise QuantizationConfigError(f"{gw}: group_size must be a positive integer, got {size!r}")
            schemes.add(("group", (1, size)))
        elif strategy == "channel":
            schemes.add(("channel", None))
        elif strategy == "block" and kind == "float":
            block = weights.get("block_structure")
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(map(_positive_int, block))):
                raise QuantizationConfigError(f"{gw}: block_structure must be two positive integers, got {block!r}")
            schemes.add(("block", (int(block[0]), int(block[1]))))
        elif strategy == "tensor" and kind == "float":
            schemes.add(("tensor", None))
        else:
            allowed = "'group', 'channel'" + (", 'block', 'tensor'" if kind == "float" else "")
            raise QuantizationConfigError(f"{gw}: strategy {strategy!r} is not supported with format {fmt!r} "
                                    f"({allowed})")
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                log.info("%s: %s %s is not applied: the weights are dequantised, the activations kept in the "
                         "load dtype", source, name, act)
    if len(schemes) != 1:
        raise QuantizationConfigError(f"{where}: config_groups declare different weight schemes "
                                f"({sorted(map(str, schemes))}); only one is supported")
    strategy, block = schemes.pop()
    if kind == "float":
        return Fp8Scheme(block=block, scale_fmt="float", source=source, scale_suffix="_scale", strategy=strategy)
    return Int4Scheme(group_size=block[1] if block else None, source=source)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
