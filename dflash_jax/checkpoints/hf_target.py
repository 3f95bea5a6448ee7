"""Hugging Face target checkpoints (config.json + safetensors) <-> ``TargetModel`` params."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import numpy as np

from dflash_jax.checkpoints.expert_layouts import (
    expert_rule,
    export_expert_tensors,
    is_expert_param,
    is_packed_param,
    moe_key,
    with_packed_experts,
)
from dflash_jax.checkpoints.safetensors_io import (
    CheckpointError,
    Derived,
    SafetensorsDir,
    flatten,
    unflatten,
    load_params,
    param_path_to_key,
    params_to_tensors,
    save_tensors,
)
from dflash_jax.models.config import MUSE_GLIMMER_TEXT, TargetConfig
from dflash_jax.models.experts import place_packed
from dflash_jax.models.gated_deltanet import join_qwen3_next_projections, split_qwen3_next_projections
from dflash_jax.models.target import TargetModel
from dflash_jax.precision import resolve_dtype

log = logging.getLogger(__name__)

# Multimodal checkpoints (Qwen3.5/3.6, Gemma 4, Muse Glimmer) keep the language model under this prefix, next to
# the vision (and audio) towers and the multi-token-prediction head, which a text target does not use.
LANGUAGE_MODEL_PREFIX = "model.language_model."
UNUSED_PREFIXES = {"model.visual.": "vision tower", "mtp.": "multi-token prediction head",
                   "model.vision_tower.": "vision tower", "model.embed_vision.": "vision embedder",
                   "model.vision_embedder.": "vision embedder", "model.audio_tower.": "audio tower",
                   "model.embed_audio.": "audio embedder", "model.vision_adapter.": "vision adapter",
                   "model.vision_projection.": "vision projection",
                   "vision_tower.": "vision tower", "mm_projector.": "multimodal projector",
                   "model.mm_projector.": "multimodal projector"}
# Kimi K2.5-K2.7 (``kimi_k25``): the language model under ``language_model.model.`` and its head
# ``language_model.lm_head``, as the released checkpoints store them; transformers 5.x's save_pretrained writes
# the same prefix with the decoder layers renamed ``blocks`` (it reverses its global ``blocks -> layers``
# rename), which ``load_target`` reads too.
KIMI_LANGUAGE_MODEL_PREFIX = "language_model.model."
KIMI_HEAD = "language_model.lm_head.weight"
# Families whose only language-model class is multimodal (Muse Glimmer's MuseGlimmerForConditionalGeneration):
# an export keeps that class's names, the language model under ``model.language_model.``.
EXPORT_PREFIXES = {MUSE_GLIMMER_TEXT: LANGUAGE_MODEL_PREFIX}
# Families whose Gated DeltaNet checkpoints fuse the input projections per key head (Qwen3-Next).
GROUPED_LINEAR_PROJECTIONS = ("qwen3_next",)
SPLIT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def abstract_target_params(config: TargetConfig, dtype: Any = jnp.float32) -> dict:
    model = TargetModel(config, dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, tokens))["params"]


def target_key_of(prefix: str):
    def key_of(path: tuple[str, ...]) -> str:
        key, _ = param_path_to_key(path)
        return key if path[0] == "lm_head" else prefix + key

    return key_of


def load_target(path: str | Path, dtype: Any = "float32", progress: bool = False,
                place=None, experts: str = "dequantize") -> tuple[TargetConfig, dict]:
    """Load a Hugging Face target directory (any family of ``models/config.FAMILIES``) into
    ``(config, params)``; expert weights in any stored layout (``expert_layouts``).

    Keys may carry the ``model.`` prefix (``*ForCausalLM`` checkpoints) or not (bare ``*Model``).
    ``place(path, host_array)`` puts each tensor on the devices (see ``safetensors_io.load_params``).
    ``experts``: what becomes of quantised routed-expert weights. ``"dequantize"`` (default) decodes them to
    ``dtype`` here (16 bits per weight in bfloat16); ``"packed"`` keeps them as stored and the returned config
    says so (``config.experts.weight_format``): gpt-oss's MXFP4 uint8 blocks and scales (4.25 bits per weight:
    gpt-oss-120b's experts in ~61 GB instead of ~230 GB), block-scaled FP8 codes (DeepSeek-V3, GLM-5.1-FP8,
    MiniMax-M2: 8 bits) or packed INT4 words (Kimi K2.5-K2.7: 4.5 bits); the model decodes them inside each
    layer. "packed" needs experts stored quantised (float experts are a ``CheckpointError`` naming the file and
    tensor). Packed params are never cast; every other param (the attention and dense layers of a quantised
    checkpoint too, dequantised) is cast to ``dtype`` (``None`` keeps the stored dtypes).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: target checkpoint directory not found")
    config = with_packed_experts(TargetConfig.from_json(path / "config.json"), experts, str(path))
    dtype = resolve_dtype(dtype)
    source = SafetensorsDir(path)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        # FP8 / INT4 weights decoded straight into the load dtype (the product is formed in float32 either way):
        # a large expert layer stacked in bfloat16 needs half the host memory of float32
        source.dequantize_dtype = np.dtype(dtype)
    prefix = _weight_prefix(source)
    layers = "blocks" if prefix == KIMI_LANGUAGE_MODEL_PREFIX and any(
        k.startswith(prefix + "blocks.") for k in source.keys()) else "layers"
    _note_skipped_mtp(source, config, prefix, layers)
    if prefix == KIMI_LANGUAGE_MODEL_PREFIX and config.tie_word_embeddings and KIMI_HEAD in source.key_to_file:
        raise CheckpointError(
            f"{path / 'config.json'}: the output head is tied to the embeddings (top-level tie_word_embeddings "
            f"true, or absent: transformers' default for kimi_k25 is true), but {source.file_of(KIMI_HEAD)} stores "
            f"a separate head {KIMI_HEAD!r}; set \"tie_word_embeddings\" at the top level of config.json")
    abstract = abstract_target_params(config, dtype if dtype is not None else jnp.float32)
    mirror = target_key_of(prefix)

    def key_of(param_path):
        if is_expert_param(param_path):
            return expert_rule(config, source, prefix, param_path, layers)
        if config.model_type in GROUPED_LINEAR_PROJECTIONS and param_path[-2] in SPLIT_PROJECTIONS:
            return _grouped_projection_rule(config, prefix, param_path)
        key = mirror(param_path)
        if prefix == KIMI_LANGUAGE_MODEL_PREFIX and param_path[0] == "lm_head":
            return KIMI_HEAD
        if key.startswith(prefix + "layers."):  # Kimi as transformers 5.x saves it: ``blocks``
            key = prefix + layers + key[len(prefix + "layers"):]
        stored = moe_key(config, key)  # MiniMax-M2's router under block_sparse_moe, Gemma 4's at the top level
        return key if stored not in source.key_to_file and key in source.key_to_file else stored

    # Params the model declares float32 whatever the compute dtype stay float32 (GLM-5's indexer weights_proj,
    # which transformers keeps in float32 too): a bfloat16 load would round what the model reads in float32.
    float32_params = {path for path, leaf in flatten(abstract).items() if leaf.dtype == jnp.float32}

    def put(param_path, arr):
        # load_params runs with dtype=None (it would cast every tensor); the cast to ``dtype`` happens here, for
        # floating-point tensors only: quantised experts kept packed stay as stored.
        if dtype is not None and not is_packed_param(tuple(param_path)) and not np.issubdtype(arr.dtype, np.integer):
            arr = arr.astype(np.float32 if tuple(param_path) in float32_params else dtype, copy=False)
        placed = place(param_path, arr) if place is not None else jnp.asarray(arr)
        # packed MXFP4 experts in the order the decode reads them, where the platform's default differs (TPUs)
        return place_packed("/".join(param_path), placed) if is_packed_param(tuple(param_path)) else placed

    params = load_params(source, abstract, key_of, dtype=None, progress=progress, place=put)
    return config, params


def _weight_prefix(source: SafetensorsDir) -> str:
    """``model.language_model.`` (multimodal Qwen3.5, Gemma 4, Muse Glimmer), ``language_model.model.`` (Kimi
    K2.5-K2.7; the unused towers of both are noted in the log), ``model.`` (``*ForCausalLM``) or none (a bare
    ``*Model``)."""
    keys = source.keys()
    for prefix in (LANGUAGE_MODEL_PREFIX, KIMI_LANGUAGE_MODEL_PREFIX):
        if any(k.startswith(prefix) for k in keys):
            for unused, what in UNUSED_PREFIXES.items():
                n = sum(k.startswith(unused) for k in keys)
                if n:
                    log.info("%s: skipping %d tensor(s) of the %s (%s*): a text target does not use them",
                             source.path, n, what, unused)
            return prefix
    return "model." if any(k.startswith("model.") for k in keys) else ""


def _note_skipped_mtp(source: SafetensorsDir, config: TargetConfig, prefix: str, layers: str) -> None:
    """DeepSeek-V3's multi-token-prediction layer is stored as one more decoder layer
    (``model.layers.{num_hidden_layers}.*``), which the decoder does not run: say so in the log."""
    extra = f"{prefix}{layers}.{config.num_hidden_layers}."
    n = sum(k.startswith(extra) for k in source.keys())
    if n:
        log.info("%s: skipping %d tensor(s) of the multi-token prediction layer (%s*): the target decoder has %d "
                 "layers", source.path, n, extra, config.num_hidden_layers)


def _grouped_projection_rule(config: TargetConfig, prefix: str, path: tuple[str, ...]) -> Derived:
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head) -> this layer's split kernel."""
    la = config.linear_attention
    layer = int(path[0].split("_")[1])
    base = f"{prefix}layers.{layer}.linear_attn"
    r = la.num_v_heads // la.num_k_heads
    shapes = ((la.num_k_heads * (2 * la.head_k_dim + 2 * r * la.head_v_dim), config.hidden_size),
              (2 * la.num_v_heads, config.hidden_size))
    name = path[-2]
    return Derived(keys=(f"{base}.in_proj_qkvz.weight", f"{base}.in_proj_ba.weight"), shapes=shapes,
                   build=lambda arrays: split_qwen3_next_projections(arrays[0], arrays[1], la)[name].T,
                   name=f"{base}.{name}")


def save_target(config: TargetConfig, params: dict, out_dir: str | Path, dtype: Any = None) -> Path:
    """Write a Hugging Face directory (``model.`` prefixed keys, 4.x-style config) loadable by transformers."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(dtype) if dtype is not None else None
    experts = {path: leaf for path, leaf in flatten(params).items() if is_expert_param(path)}
    if any(is_packed_param(path) for path in experts):
        raise CheckpointError(f"{out_dir}: these params keep quantised experts packed (loaded with "
                              "experts='packed'); load the target with experts='dequantize' to save it")
    prefix = EXPORT_PREFIXES.get(config.model_type, "model.")
    mirror = target_key_of(prefix)
    tensors = params_to_tensors(unflatten({path: leaf for path, leaf in flatten(params).items()
                                           if path not in experts}), lambda path: moe_key(config, mirror(path)),
                                dtype=dtype)
    if config.model_type in GROUPED_LINEAR_PROJECTIONS:
        for layer in config.linear_layers:
            base = f"model.layers.{layer}.linear_attn"
            split = {name: tensors.pop(f"{base}.{name}.weight") for name in SPLIT_PROJECTIONS}
            for name, arr in join_qwen3_next_projections(split, config.linear_attention).items():
                tensors[f"{base}.{name}.weight"] = arr
    for layer in sorted({path[0] for path in experts}):
        layer_params = {path[-1]: leaf for path, leaf in experts.items() if path[0] == layer}
        exported = export_expert_tensors(config, layer_params, "model.", int(layer.split("_")[1]))
        tensors.update({k: v.astype(dtype) if dtype is not None else v for k, v in exported.items()})
    save_tensors(tensors, out_dir)
    cfg = config.to_hf_dict()
    any_leaf = next(iter(tensors.values()))
    cfg["torch_dtype"] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[str(any_leaf.dtype)]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir
