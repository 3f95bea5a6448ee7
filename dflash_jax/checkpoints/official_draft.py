"""Official DFlash draft directories (``config.json`` + safetensors without ``model.`` prefix) <-> params.

The exported layout is the one the reference code, SGLang and vLLM load: keys ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}....``, linear weights ``[out, in]``, no embedding and
no head (the draft borrows the target's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.checkpoints.safetensors_io import (
    CheckpointError,
    SafetensorsDir,
    load_params,
    param_path_to_key,
    params_to_tensors,
    save_tensors,
)
from dflash_jax.models.draft import DraftModel, SharedHead, init_draft_cache
from dflash_jax.models.draft_config import MUSE_ASSISTANT, DraftConfig, is_muse_assistant_config
from dflash_jax.models.init import random_params
from dflash_jax.precision import resolve_dtype


# Meta's drafter (``MuseGlimmerAssistantModel``) names the feature fusion ``encoder.fc`` and
# ``encoder.output_norm_enc``; every other tensor has the DFlash name.
MUSE_ASSISTANT_NAMES = {"fc": "encoder.fc", "hidden_norm": "encoder.output_norm_enc"}
# Fields of an original config.json kept when a draft is written in the other layout.
LAYOUT_NEUTRAL_FIELDS = ("transformers_version", "bos_token_id", "eos_token_id", "pad_token_id")


def draft_key_of(path: tuple[str, ...]) -> str:
    return param_path_to_key(path)[0]


def muse_assistant_key_of(path: tuple[str, ...]) -> str:
    return param_path_to_key((MUSE_ASSISTANT_NAMES.get(path[0], path[0]),) + tuple(path[1:]))[0]


def key_map(config: DraftConfig):
    """The stored name of each draft param in ``config``'s layout."""
    return muse_assistant_key_of if config.layout == MUSE_ASSISTANT else draft_key_of


def abstract_draft_params(config: DraftConfig, dtype: Any = jnp.float32, head_copies: bool = True) -> dict:
    """Parameter shapes without allocating anything (works for the 8B pairing on any machine). A DSpark draft's
    include its copies of the target's embedding and head (``draft.HEAD_COPIES``, as its checkpoints hold
    them) unless ``head_copies`` is False (the trainer's params: it trains the backbone only)."""
    model = DraftModel(config, dtype)
    b, t = 1, 2
    tokens = jnp.zeros((b, t), jnp.int32)
    feats = jnp.zeros((b, 1, config.num_features * config.hidden_size), dtype)

    def init():  # everything inside eval_shape: the [vocab, hidden] table must not be allocated for real
        # a stand-in for the target's table (a DFlash draft's params do not depend on its size; Meta's drafter
        # does not record it: vocab_size 0)
        rows = max(config.vocab_size, config.mask_token_id + 1)
        shared = SharedHead(jnp.zeros((rows, config.hidden_size), dtype), None)
        cache = init_draft_cache(config, b, 4, dtype)
        return model.init(jax.random.PRNGKey(0), tokens, tokens, feats, tokens[:, :1], tokens[:, :1] >= 0,
                          cache, shared)

    params = jax.eval_shape(init)["params"]
    if config.dspark and head_copies:
        rows, h = config.vocab_size, config.hidden_size
        params = {**params, "embed_tokens": {"embedding": jax.ShapeDtypeStruct((rows, h), dtype)},
                  "lm_head": {"kernel": jax.ShapeDtypeStruct((h, rows), dtype)}}
    return params


def init_draft_params(config: DraftConfig, seed: int = 0, dtype: Any = jnp.float32, std: float | None = None,
                      head_copies: bool = True) -> dict:
    """Random draft params (``models.init.random_params``): norms at one, biases at zero, linear kernels
    N(0, std^2), by default std = 1/sqrt(fan_in). ``std=0.02`` is what the official (Hugging Face Qwen3) code
    initialises a new draft with (``initializer_range``), the trainer's starting point."""
    return random_params(abstract_draft_params(config, dtype, head_copies), seed, std)


def load_draft(path: str | Path, dtype: Any = None, progress: bool = False) -> tuple[DraftConfig, dict]:
    """Load an official draft directory. ``dtype=None`` keeps the stored dtype (needed for bit-exact export)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: draft checkpoint directory not found")
    config = DraftConfig.from_json(path / "config.json")
    source = SafetensorsDir(path)
    prefixed = [k for k in source.keys() if k.startswith("model.")]
    if prefixed:
        raise CheckpointError(
            f"{source.file_of(prefixed[0])}: key {prefixed[0]!r} has a 'model.' prefix; official drafts store "
            "bare keys (is this a target checkpoint?)"
        )
    dtype = resolve_dtype(dtype) if dtype is not None else None
    abstract = abstract_draft_params(config, dtype or jnp.float32)
    params = load_params(source, abstract, key_map(config), dtype=dtype, progress=progress)
    return config, params


def save_draft(config: DraftConfig, params: dict, out_dir: str | Path, dtype: Any = None,
               extra_config: dict | None = None) -> Path:
    """Export in the draft's layout (``config.layout``: the official DFlash one, or Meta's
    ``MuseGlimmerAssistantModel``); ``dtype`` (e.g. ``"bfloat16"``) casts on the way out.

    ``extra_config`` holds fields of the original ``config.json`` this project does not model (``auto_map``
    for ``trust_remote_code`` loading, ``transformers_version``, ...); they are kept, and every field the
    draft is computed from is written from ``config``."""
    out_dir = Path(out_dir)
    config.warn_if_last_layer(f"exporting the draft to {out_dir}")
    dtype = resolve_dtype(dtype) if dtype is not None else None
    official = config.to_official_dict()  # first: a layout it has no exact form in is refused before writing
    tensors = params_to_tensors(params, key_map(config), dtype=dtype)
    save_tensors(tensors, out_dir)
    extra = dict(extra_config or {})
    if is_muse_assistant_config(extra) != (config.layout == MUSE_ASSISTANT):  # the original was the other layout:
        extra = {k: v for k, v in extra.items() if k in LAYOUT_NEUTRAL_FIELDS}  # its own fields do not carry over
    cfg = {**extra, **official}
    if "dflash_config" in official:
        cfg["dflash_config"] = {**(extra.get("dflash_config") or {}), **official["dflash_config"]}
    cfg["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir
