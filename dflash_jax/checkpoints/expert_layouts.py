"""How checkpoints store expert weights, as rules from stored tensors to ``models/experts`` parameters.

The experts' parameters are ``[E, in, out]`` stacks (``experts/{gate,up}_proj [E, H, I]``,
``experts/down_proj [E, I, H]``, gpt-oss biases ``[E, I]``/``[E, H]``). Checkpoints hold them as:

- per expert (released Qwen3-MoE, DeepSeek-V3 and Kimi K2, and what transformers writes):
  ``mlp.experts.{j}.gate_proj.weight [I, H]`` (PyTorch ``[out, in]``), one tensor per expert and projection
  (DeepSeek-V3's router bias inside its router: ``mlp.gate.e_score_correction_bias``, ``moe_key``);
- per expert, Mixtral names (MiniMax-M2, released and written by transformers): the block is
  ``block_sparse_moe`` and expert j's projections ``block_sparse_moe.experts.{j}.w1`` (gate), ``.w3`` (up),
  ``.w2`` (down) ``.weight``; its router ``block_sparse_moe.gate.weight`` and ``e_score_correction_bias``
  (``moe_key``);
- fused, Qwen style (transformers' in-memory layout): ``mlp.experts.gate_up_proj [E, 2I, H]`` with the gate
  rows first, ``mlp.experts.down_proj [E, H, I]``; Gemma 4 stores its experts so, on disk too, at the layer's
  top level (``layers.{i}.experts.*``, ``layers.{i}.router.{proj.weight,scale,per_expert_scale}``: the
  params' ``moe`` block, ``moe_key``) beside its dense ``mlp``;
- fused, gpt-oss style: ``mlp.experts.gate_up_proj [E, H, 2I]`` (``x @ W``) with gate and up INTERLEAVED
  (gate = even columns), ``gate_up_proj_bias [E, 2I]`` likewise, ``down_proj [E, I, H]``, ``down_proj_bias``;
- gpt-oss MXFP4 (released weights): ``gate_up_proj_blocks``/``_scales`` and ``down_proj_blocks``/``_scales``
  (``models/mxfp4``), decoded here at load, or (``experts="packed"``, ``ExpertsConfig.weight_format ==
  "mxfp4"``) loaded as they are into the packed params ``experts/{gate,up,down}_proj_{blocks,scales}`` (uint8,
  rows = output features, so splitting the interleaved gate/up is taking every other row);
- block-scaled FP8 and packed INT4 per expert (DeepSeek-V3, Kimi K2.5-K2.7, GLM-5.1-FP8, MiniMax-M2;
  ``checkpoints/quantized``): dequantised at load like any weight, or (``experts="packed"``,
  ``ExpertsConfig.weight_format`` "fp8" / "int4") the per-expert codes and scales stacked as they are into
  ``experts/{gate,up,down}_proj_{qweight,qscale}`` (``models/quantized_experts``).

Everything else of an expert layer (the router ``mlp.gate``/``mlp.router``, the shared expert) follows the
default name mirror.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from dflash_jax.checkpoints import quantized
from dflash_jax.checkpoints.safetensors_io import CheckpointError, Derived, SafetensorsDir
from dflash_jax.models import mxfp4, quantized_experts
from dflash_jax.models.config import TargetConfig

EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj", "gate_proj_bias", "up_proj_bias", "down_proj_bias",
                 "gate_proj_blocks", "gate_proj_scales", "up_proj_blocks", "up_proj_scales", "down_proj_blocks",
                 "down_proj_scales", "gate_proj_qweight", "gate_proj_qscale", "up_proj_qweight", "up_proj_qscale",
                 "down_proj_qweight", "down_proj_qscale")
PACKED_SUFFIXES = ("_blocks", "_scales", "_qweight", "_qscale")
# Families whose checkpoints use transformers' "mixtral" names: the MoE block ``block_sparse_moe``, an expert's
# projections w1/w3/w2 (our ``experts/{gate,up,down}_proj``).
MIXTRAL_STYLE = ("minimax_m2",)
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Families whose expert block (params ``layers_{i}/moe``, beside the dense ``mlp``) is stored at the layer's top
# level, its experts fused Qwen style (Gemma 4).
TOP_LEVEL_MOE = ("gemma4_text",)
# Families whose selection-only router bias sits inside the router (``mlp.gate.e_score_correction_bias``, the
# params' ``mlp/e_score_correction_bias``): DeepSeek-V3, Kimi K2 and GLM-5.
ROUTER_HELD_BIAS = ("deepseek_v3", "kimi_k2", "glm_moe_dsa")
#: ``load_target(..., experts=...)``: what to do with quantised expert weights (MXFP4, FP8, INT4).
EXPERT_MODES = ("dequantize", "packed")


def is_packed_param(path: tuple[str, ...]) -> bool:
    return is_expert_param(path) and path[-1].endswith(PACKED_SUFFIXES)


def with_packed_experts(config: TargetConfig, mode: str, source: str = "") -> TargetConfig:
    """``config`` whose routed experts are declared as the checkpoint quantises them (``mode == "packed"``) or
    as it is ("dequantize"): gpt-oss's MXFP4, or the FP8 / INT4 scheme of ``config.quantization`` (read from
    config.json's ``quantization_config``). Anything else is a ``CheckpointError`` naming ``source`` and why."""
    if mode not in EXPERT_MODES:
        raise CheckpointError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {mode!r}")
    if mode == "dequantize":
        return config
    where, fix = source or "target", "load it with experts='dequantize' (--experts dequantize)"
    if config.experts is None:
        raise CheckpointError(f"{where}: experts='packed' keeps quantised expert weights packed, but this "
                              f"{config.model_type} model has no experts; {fix}")
    if config.model_type == "gpt_oss":
        fmt, block = "mxfp4", None
    else:
        fmt, block = _packed_format(config.quantization, where, fix)
        e = config.experts
        for what, (out, inn) in (("gate/up_proj", (e.intermediate_size, config.hidden_size)),
                                 ("down_proj", (config.hidden_size, e.intermediate_size))):
            try:
                quantized_experts.check_block(fmt, block, out, inn, f"{where}: experts' {what}")
            except ValueError as err:
                raise CheckpointError(f"{err}; {fix}") from None
    return dataclasses.replace(config, experts=dataclasses.replace(config.experts, weight_format=fmt,
                                                                   weight_block=block))


def _packed_format(scheme, where: str, fix: str) -> tuple[str, tuple[int, int]]:
    """``(weight_format, weight_block)`` that keep a checkpoint's quantised experts as stored."""
    quantized.raise_if_unsupported(scheme)
    if isinstance(scheme, quantized.Int4Scheme) and scheme.group_size:
        return "int4", (1, scheme.group_size)
    if isinstance(scheme, quantized.Fp8Scheme) and scheme.strategy in ("block", "group"):
        return "fp8", scheme.block
    what = "float weights (no quantization_config)" if scheme is None else scheme.describe()
    raise CheckpointError(f"{where}: experts='packed' keeps MXFP4 (gpt-oss), block- or group-scaled FP8 and "
                          f"group-scaled INT4 experts as stored, but this checkpoint holds {what}; {fix}")


def moe_key(config: TargetConfig, key: str) -> str:
    """A stored key as this family names it: ``model.layers.3.mlp.gate.weight`` (the param mirror) is
    ``model.layers.3.block_sparse_moe.gate.weight`` on disk for the ``MIXTRAL_STYLE`` families, and
    ``model.layers.3.moe.router.scale`` is ``model.layers.3.router.scale`` for the ``TOP_LEVEL_MOE`` ones."""
    if config.model_type in MIXTRAL_STYLE:
        return re.sub(r"(^|\.)(layers\.\d+)\.mlp\.", r"\1\2.block_sparse_moe.", key, count=1)
    if config.model_type in TOP_LEVEL_MOE:
        return re.sub(r"(^|\.)(layers\.\d+)\.moe\.", r"\1\2.", key, count=1)
    if config.model_type in ROUTER_HELD_BIAS:
        return re.sub(r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias", key)
    return key


def is_expert_param(path: tuple[str, ...]) -> bool:
    return len(path) >= 3 and path[-2] == "experts" and path[-1] in EXPERT_PARAMS


def expert_rule(config: TargetConfig, source: SafetensorsDir, prefix: str,
                path: tuple[str, ...], layers: str = "layers") -> Derived:
    """The stored tensors and the transform that make the expert parameter at ``path``
    (``('layers_3', 'mlp', 'experts', 'gate_proj')``), for whichever layout ``source`` holds. ``layers``: what
    the checkpoint calls its decoder layers (Kimi K2.5 as transformers 5.x saves it: ``blocks``)."""
    layer = int(path[0].split("_")[1])
    base = moe_key(config, f"{prefix}{layers}.{layer}.{path[1]}.experts")
    e, h, i = config.experts.num_experts, config.hidden_size, config.experts.intermediate_size
    name, where = path[-1], f"{base} ({path[-1]})"
    has = source.key_to_file.__contains__
    if config.model_type == "gpt_oss":
        if name.endswith(PACKED_SUFFIXES):
            return _gpt_oss_packed_rule(source, base, name, e, h, i, where)
        return _gpt_oss_rule(base, name, e, h, i, has, where)
    if name.endswith(("_qweight", "_qscale")):
        return _quantized_rule(config, source, base, name, where)
    # Qwen style
    if name.endswith("_bias"):
        raise CheckpointError(f"{source.path}: {config.model_type} experts have no biases ({name})")
    if has(f"{base}.gate_up_proj") or config.model_type in TOP_LEVEL_MOE:  # Gemma 4 stores only this form
        if name == "down_proj":  # [E, H, I] ([out, in]) -> [E, I, H]
            return Derived((f"{base}.down_proj",), ((e, h, i),), lambda a: a[0].transpose(0, 2, 1), name=where)
        half = slice(0, i) if name == "gate_proj" else slice(i, 2 * i)
        return Derived((f"{base}.gate_up_proj",), ((e, 2 * i, h),),
                       lambda a: a[0][:, half, :].transpose(0, 2, 1), name=where)
    stored = (i, h) if name != "down_proj" else (h, i)
    if config.model_type in MIXTRAL_STYLE:
        keys = tuple(f"{base}.{j}.{MIXTRAL_NAMES[name]}.weight" for j in range(e))
    else:
        keys = tuple(f"{base}.{j}.{name}.weight" for j in range(e))
    return Derived(keys, (stored,) * e, lambda a: np.stack([w.T for w in a]), name=where)


def _gpt_oss_rule(base: str, name: str, e: int, h: int, i: int, has: Callable[[str], bool], where: str) -> Derived:
    fused = "down_proj" if name.startswith("down_proj") else "gate_up_proj"
    columns = slice(None) if fused == "down_proj" else slice(0, None, 2) if name.startswith("gate") \
        else slice(1, None, 2)
    if name.endswith("_bias"):
        width = h if fused == "down_proj" else 2 * i
        return Derived((f"{base}.{fused}_bias",), ((e, width),), lambda a: a[0][:, columns], name=where)
    in_f, out_f = (i, h) if fused == "down_proj" else (h, 2 * i)
    blocks, scales = mxfp4.packed_key_names(f"{base}.{fused}")
    if has(blocks) or has(scales):
        shapes = mxfp4.packed_shapes(in_f, out_f, e)

        def decode(a):
            return mxfp4.dequantize(a[0], a[1], np.float32, name=f"{base}.{fused}")[..., columns]

        return Derived((blocks, scales), shapes, decode, ("uint8", "uint8"), name=where)
    return Derived((f"{base}.{fused}",), ((e, in_f, out_f),), lambda a: a[0][..., columns], name=where)


def _gpt_oss_packed_rule(source: SafetensorsDir, base: str, name: str, e: int, h: int, i: int,
                         where: str) -> Derived:
    """A packed param (``gate_proj_blocks`` ...) straight from the stored uint8 tensor: gate = even rows of
    ``gate_up_proj_*``, up = odd rows (the rows are the interleaved output features), down as stored."""
    proj, part = name.rsplit("_", 1)  # ("gate_proj", "blocks")
    fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
    key = f"{base}.{fused}_{part}"
    if key not in source.key_to_file and f"{base}.{fused}" in source.key_to_file:
        float_key = f"{base}.{fused}"
        raise CheckpointError(
            f"{source.file_of(float_key)}: tensor {float_key!r} holds float expert weights "
            f"({source.dtype_name(float_key)}), but experts='packed' (--experts packed) needs the MXFP4 tensors "
            f"{fused}_blocks / {fused}_scales of a released gpt-oss checkpoint; load it with experts='dequantize'")
    in_f, out_f = (i, h) if fused == "down_proj" else (h, 2 * i)
    blocks_shape, scales_shape = mxfp4.packed_shapes(in_f, out_f, e)
    shape = blocks_shape if part == "blocks" else scales_shape
    rows = slice(None) if fused == "down_proj" else slice(0, None, 2) if proj == "gate_proj" else slice(1, None, 2)
    return Derived((key,), (shape,), lambda a: np.ascontiguousarray(a[0][:, rows]), ("uint8",), name=where)


def _quantized_rule(config: TargetConfig, source: SafetensorsDir, base: str, name: str, where: str) -> Derived:
    """A kept-quantised param (``gate_proj_qweight`` / ``_qscale``) stacked from the per-expert tensors as
    stored: FP8 ``<m>.weight`` + ``<m>.weight_scale_inv`` (or ``_scale``), INT4 ``<m>.weight_packed`` +
    ``<m>.weight_scale``, ``<m>`` = ``{base}.{j}.{proj}`` (Mixtral names for MiniMax-M2). Each tensor's
    stored dtype is checked; FP8 scales are read as float32 (E8M0 exponents converted)."""
    proj, part = name.rsplit("_", 1)
    e, cfg = config.experts.num_experts, config.experts
    h, i = config.hidden_size, cfg.intermediate_size
    out_f, in_f = (i, h) if proj != "down_proj" else (h, i)
    stored = MIXTRAL_NAMES[proj] if config.model_type in MIXTRAL_STYLE else proj
    weights = [f"{base}.{j}.{stored}.weight" for j in range(e)]
    scheme = source.quantization
    fmt, block = cfg.weight_format, cfg.weight_block
    if fmt == "int4":
        packed_key, scale_key, _ = quantized.packed_names(weights[0])
        words = lambda w: quantized.packed_names(w)[0]  # noqa: E731
        if part == "qweight":
            for w in weights:
                if words(w) not in source.key_to_file:
                    continue  # reported below (float experts) or by the loader (a missing tensor)
                quantized.refuse_int4_extras(source, w, scheme)
                stored_shape = quantized.int4_weight_shape(source, w)
                if stored_shape != (out_f, in_f):
                    raise CheckpointError(f"{source.file_of(words(w))}: tensor {quantized.packed_names(w)[2]!r} says "
                                          f"{list(stored_shape)}, but config.json makes {w!r} [{out_f}, {in_f}]")
            keys = tuple(words(w) for w in weights)
            read = _reader(source, ("I32",), "packed INT4 words", where)
        else:
            keys = tuple(quantized.packed_names(w)[1] for w in weights)
            read = _reader(source, ("BF16",), "INT4 scales kept on the device (bfloat16, as Kimi ships them)",
                           where)
    else:
        if part == "qweight":
            keys = tuple(weights)
            read = _reader(source, quantized.FP8_WEIGHT_DTYPES, "FP8 e4m3 codes", where, fp8_codes=True)
        else:
            keys = tuple(scheme.scale_key(w) for w in weights)
            read = lambda k: quantized.scale_values(source, k, scheme)  # noqa: E731
    if part == "qweight":
        shape = quantized_experts.qweight_shape(fmt, e, out_f, in_f)[1:]
    else:
        shape = quantized_experts.qscale_shape(fmt, block, e, out_f, in_f)[1:]
    fused = [k for k in (f"{base}.gate_up_proj", f"{base}.down_proj") if k in source.key_to_file]
    if keys[0] not in source.key_to_file and weights[0] not in source.key_to_file and fused:
        raise CheckpointError(
            f"{source.file_of(fused[0])}: tensor {fused[0]!r} holds all experts in one tensor (a fused layout), "
            f"but experts='packed' (--experts packed) keeps only per-expert quantised tensors as stored "
            f"('{base}.<j>.{stored}.weight'); load it with experts='dequantize'")
    if keys[0] not in source.key_to_file and weights[0] in source.key_to_file \
            and not source.is_quantized(weights[0]):
        raise CheckpointError(
            f"{source.file_of(weights[0])}: tensor {weights[0]!r} holds float expert weights "
            f"({source.dtype_name(weights[0])}), but experts='packed' (--experts packed) needs them quantised as "
            f"config.json says; load it with experts='dequantize'")
    return Derived(keys, (shape,) * e, lambda arrays: np.stack(arrays), ("raw",) * e, name=where, read=read)


def _reader(source: SafetensorsDir, dtypes: tuple[str, ...], what: str, where: str, fp8_codes: bool = False):
    """Reads one stored tensor as it is, after checking its dtype (and, for FP8 codes, that none is NaN)."""
    def read(key: str) -> np.ndarray:
        stored = source.stored_dtype_name(key)
        if stored not in dtypes:
            raise CheckpointError(f"{source.file_of(key)}: tensor {key!r} is stored as {stored}; {what} must be "
                                  f"{' or '.join(dtypes)} ({where}; or load with experts='dequantize')")
        arr = source.get_stored(key)
        if fp8_codes and ((np.asarray(arr).view(np.uint8) & 0x7F) == 0x7F).any():
            raise CheckpointError(f"{source.file_of(key)}: FP8 tensor {key!r} holds the e4m3 NaN code (0x7F / 0xFF)")
        return arr

    return read


def export_expert_tensors(config: TargetConfig, layer_params: dict, prefix: str, layer: int) -> dict:
    """One layer's expert parameters in the layout transformers writes for this family (per expert for
    Qwen3-MoE and, with Mixtral names, MiniMax-M2; fused and interleaved for gpt-oss; fused, gate rows first,
    for Gemma 4)."""
    p = {k: np.asarray(v) for k, v in layer_params.items()}
    block = "moe" if config.model_type in TOP_LEVEL_MOE else "mlp"
    base = moe_key(config, f"{prefix}layers.{layer}.{block}.experts")
    if config.model_type in TOP_LEVEL_MOE:  # [E, H, I] gate and up -> [E, 2I, H]; down [E, I, H] -> [E, H, I]
        return {f"{base}.gate_up_proj": np.ascontiguousarray(
                    np.concatenate([p["gate_proj"], p["up_proj"]], axis=-1).transpose(0, 2, 1)),
                f"{base}.down_proj": np.ascontiguousarray(p["down_proj"].transpose(0, 2, 1))}
    if config.model_type == "gpt_oss":
        def interleave(gate, up):
            out = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), gate.dtype)
            out[..., 0::2], out[..., 1::2] = gate, up
            return out

        return {f"{base}.gate_up_proj": interleave(p["gate_proj"], p["up_proj"]),
                f"{base}.gate_up_proj_bias": interleave(p["gate_proj_bias"], p["up_proj_bias"]),
                f"{base}.down_proj": p["down_proj"], f"{base}.down_proj_bias": p["down_proj_bias"]}
    if config.model_type in MIXTRAL_STYLE:
        return {f"{base}.{j}.{MIXTRAL_NAMES[name]}.weight": np.ascontiguousarray(p[name][j].T)
                for name in ("gate_proj", "up_proj", "down_proj") for j in range(config.experts.num_experts)}
    return {f"{base}.{j}.{name}.weight": np.ascontiguousarray(p[name][j].T)
            for name in ("gate_proj", "up_proj", "down_proj") for j in range(config.experts.num_experts)}
