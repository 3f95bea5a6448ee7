"""The run configuration of ``python -m train fit``: one YAML file, overridable with ``--set key=value``.

Every key is known in advance (``DEFAULTS``); an unknown key, a wrong type or a value out of range is a
``ConfigError`` naming the file and the dotted key. Defaults follow SPEC section 6 (AdamW, lr 6e-4, 4% warmup,
cosine decay, clip 1.0, 512 anchors, 5 draft layers, max length 3072).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Mapping

import yaml

from dflash_jax.models.config import ConfigError
from dflash_jax.models.draft_config import CONTEXT_INJECTIONS, DFLASH2_FIELDS
from dflash_jax.training.loss import LOSSES, POSITION_WEIGHTS

DSPARK_FIELDS = ("markov_rank", "markov_head_type", "confidence_head")  # draft.* keys of a new DSpark draft

REQUIRED = object()

# section -> key -> (default, allowed type(s), help). ``None`` defaults are optional.
SCHEMA: dict[str, dict[str, tuple[Any, tuple[type, ...], str]]] = {
    "target": {
        "path": (REQUIRED, (str,), "target model: Hugging Face directory, Orbax checkpoint of this project, or "
                                   "Hugging Face Hub id such as Qwen/Qwen3-8B (the Hugging Face cache; "
                                   "HF_HUB_OFFLINE=1 reads it alone; a local path of the same name wins)"),
        "revision": (None, (str,), "with a Hub id as target.path: its branch, tag or commit instead of main"),
        "tokenizer": (None, (str,), "tokenizer directory or Hub id (default: the target's own)"),
        "experts": ("dequantize", (str,), "quantised expert weights (gpt-oss's MXFP4, block FP8, Kimi's INT4): "
                                          "dequantize at load, or packed (kept as stored on the devices, decoded "
                                          "inside each expert layer)"),
        "mxfp4": (None, (str,), "the older name of target.experts"),
    },
    "draft": {
        "init": (None, (str,), "an existing draft (official directory, Orbax or Hub id) to fine-tune instead of a "
                               "new one"),
        "init_revision": (None, (str,), "with a Hub id as draft.init: its branch, tag or commit instead of main"),
        "num_layers": (None, (int,), "draft depth of a new draft (default 5)"),
        "block_size": (None, (int,), "tokens per block: anchor + block_size-1 mask positions (default 16)"),
        "target_layer_ids": (None, (list,), "target layers whose features the draft reads (default: spread)"),
        "mask_token_id": (None, (int,), "the mask token's row of the target embedding (default: the last row)"),
        "intermediate_size": (None, (int,), "draft MLP width (default: the target's)"),
        "num_attention_heads": (None, (int,), "draft query heads (default: the target's)"),
        "num_key_value_heads": (None, (int,), "draft key/value heads (default: the target's)"),
        "head_dim": (None, (int,), "draft head size (default: the target's; q/k norms cap attention logits at "
                                   "sqrt(head_dim), so tiny heads cannot focus)"),
        "context_injection": (None, (str,), "every_layer (DFlash: features as keys/values in every layer) or "
                                            "input (the paper's ablation: features at the input only)"),
        "architecture": (None, (str,), "a new draft's kind: dflash (the paper's; default), dflash2 (block "
                                       "convolutions in every layer and a candidate selector, DFlash2DraftModel) "
                                       "or dspark (DeepSeek's DSpark: shifted outputs, a Markov head and a "
                                       "confidence head, DeepSpec's Qwen3DSparkModel layout and loss); "
                                       "with draft.init of a DFlash draft (e.g. Meta's Muse Glimmer drafter), "
                                       "dflash2 grows it into a DFlash2 draft that starts out proposing as it did"),
        "markov_rank": (None, (int,), "dspark: rank of the Markov head (default 256; 0: none, DeepSpec's "
                                      "shifted-DFlash baseline)"),
        "markov_head_type": (None, (str,), "dspark: vanilla (default) or gated"),
        "confidence_head": (None, (bool,), "dspark: train a confidence head (default true; needs the Markov "
                                           "head's codes as input when markov_rank > 0, as DeepSpec's)"),
        "conv_kernel_size": (None, (int,), "dflash2: convolution length along the block (default 2)"),
        "conv_group_size": (None, (int,), "dflash2: channels sharing one dynamic kernel (default 16)"),
        "selector_rank": (None, (int,), "dflash2: rank of the selector's pairwise score (default 256)"),
        "selector_top_k": (None, (int,), "dflash2: candidates the selector chooses among (default 16)"),
        "allow_last_layer": (False, (bool,), "experiments only: let a new draft read the target's last layer "
                                             "(the official code runs it; SGLang/vLLM cannot serve it)"),
        "init_std": (0.02, (float, int), "std of the normal init of new linear weights (HF initializer_range)"),
    },
    "data": {
        "train": (None, (str, list), "training data, one source or a list of them read one after the other: "
                                     "a .jsonl/.jsonl.gz, .json (one array), .parquet or .arrow file, a directory "
                                     "or glob of them, or a Hub dataset hf:ORG/NAME[:CONFIG[:SPLIT]]; rows are "
                                     "conversations, prompt/response or text (give data.train or data.sources)"),
        "sources": (None, (list,), "a mixture instead of data.train: a list of sources, each a source string or "
                                   "{path: SOURCE, weight: W, max_samples: N, columns: 'prompt=instruction,...'}; "
                                   "with weights (on every source or none) each row of the mixture is drawn from a "
                                   "source with probability weight/sum, a small source repeating; without them the "
                                   "sources' rows follow each other. Per-source counts go to "
                                   "output.dir/source_counts.json"),
        "limit": (None, (int,), "rows in the mixture (default: every row after the filters; with weights the "
                                "weighted draw makes this many)"),
        "dedup": (None, (bool,), "drop a row whose turns equal an earlier row's, across sources, first source "
                                 "first (default: true with data.sources, false with data.train)"),
        "min_length": (None, (int,), "drop rows of fewer tokens than this (after tokenization)"),
        "drop_truncated": (False, (bool,), "drop rows longer than data.max_length instead of cutting them"),
        "seed": (None, (int,), "seed of the mixture's draws: max_samples subsets, limit, weights (default: "
                               "train.seed)"),
        "cache": (True, (bool,), "keep each source's tokenized rows in data.cache_dir, keyed by the source's "
                                 "files (sizes, mtimes, Hub commit), the tokenizer, chat template, max_length and "
                                 "the loss-mask rule: a second run with the same inputs skips tokenizing"),
        "cache_dir": (None, (str,), "the tokenized cache's directory (default: $DFLASH_JAX_DATA_CACHE, "
                                    "else $XDG_CACHE_HOME or ~/.cache, then dflash_jax/tokenized)"),
        "max_length": (3072, (int,), "tokens per sequence; longer rows are truncated (counted)"),
        "use_chat_template": (True, (bool,), "render conversations with the tokenizer's chat template"),
        "enable_thinking": (False, (bool,), "Qwen3 thinking in the template (as 'train regenerate --thinking')"),
        "drop_unfinished": (False, (bool,), "leave out regenerated rows whose answers were cut at max_new_tokens "
                                            "(\"finished\": false)"),
        "eval_prompts": (None, (str,), "held-out prompts (JSONL rows with a prompt or messages) for the "
                                       "engine's real tau"),
    },
    "train": {
        "epochs": (6, (int,), "passes over the data"),
        "max_steps": (None, (int,), "at most this many optimizer steps (the learning-rate schedule spans them)"),
        "global_batch": (8, (int,), "sequences per optimizer step, over all devices and processes"),
        "accum_steps": (1, (int,), "gradient-accumulation micro-steps per optimizer step"),
        "num_anchors": (512, (int,), "anchors (blocks) drawn per sequence at every step"),
        "anchor_chunk": (64, (int,), "anchors per rematerialised chunk (memory vs speed)"),
        "gamma": (None, (float, int), "loss decay exp(-(k-1)/gamma) (default: 7 for B=16, 5 for 10, 4 for 8; "
                                           "dspark: exp(-k/gamma) over its B proposals, 4 as DeepSpec's)"),
        "uniform_loss": (False, (bool,), "ablation: equal weight for every block position"),
        "loss": ("ce", (str,), "ce (cross-entropy on the data's tokens: the paper's), kl (forward KL against the "
                               "target's own distribution, computed in the same step) or ce+kl"),
        "kl_weight": (0.5, (float, int), "loss ce+kl: the KL share a of (1 - a) ce + a kl"),
        "kl_temperature": (1.0, (float, int), "temperature of the target's distribution in the KL term"),
        "position_weights": ("decay", (str,), "decay (exp(-(k-1)/gamma), the paper's) or dpace (D-PACE: each "
                                              "position by the acceptance it still unlocks, arXiv 2605.18810)"),
        "dpace_alpha": (0.5, (float, int), "position_weights dpace: smoothing of the draft's label probability"),
        "selector_weight": (1.0, (float, int), "dflash2 drafts: weight of the selector's teacher-forced "
                                               "cross-entropy beside the block loss"),
        "dspark_loss_weights": ([0.1, 0.9, 1.0], (list,), "dspark drafts: weights of DeepSpec's cross-entropy, "
                                                         "L1 distance to the target's distribution and "
                                                         "confidence BCE (the paper's 0.1, 0.9, 1.0)"),
        "anchors": ("random", (str,), "random (fresh distinct anchors every step) or uniform (ablation: "
                                      "non-overlapping blocks end to end)"),
        "loss_mode": ("standard", (str,), "standard (each block: the anchor, then mask tokens) or variable_prefix "
                                          "(D2SD, arXiv 2606.04446: each block shows a visible prefix of real "
                                          "tokens whose length l follows a truncated geometric prior; only the "
                                          "masked suffix is supervised, the decay restarting at l)"),
        "prefix_base": (0.9, (float, int), "loss_mode variable_prefix: Pr(l) proportional to prefix_base**l "
                                           "(below 1 favours short prefixes)"),
        "prefix_min": (1, (int,), "loss_mode variable_prefix: shortest visible prefix l, the anchor included "
                                  "(1: the standard block, the one this engine drafts, is among the draws; "
                                  "NeMo AutoModel's trainer starts at 2)"),
        "prefix_max": (None, (int,), "loss_mode variable_prefix: longest visible prefix l (default: block_size-1, "
                                     "leaving one position to supervise)"),
        "optimizer": ("adamw", (str,), "adamw, or muon (optax's Muon for the draft's weight matrices, AdamW for "
                                       "norms and the rest; same clipping, warmup and decay)"),
        "muon_learning_rate": (None, (float, int), "optimizer muon: Muon's peak learning rate (default: "
                                                   "train.learning_rate; updates are scaled to AdamW's RMS)"),
        "muon_momentum": (0.95, (float, int), "optimizer muon: Muon's Nesterov momentum"),
        "learning_rate": (6e-4, (float, int), "peak AdamW learning rate"),
        "warmup_ratio": (0.04, (float, int), "share of the steps spent warming up linearly"),
        "min_lr_ratio": (0.0, (float, int), "final learning rate of the cosine decay, relative to the peak"),
        "weight_decay": (0.0, (float, int), "AdamW decoupled weight decay"),
        "clip_norm": (1.0, (float, int), "global gradient-norm clip"),
        "seed": (0, (int,), "seed of the draft init, anchors and data order"),
        "dtype": ("auto", (str,), "compute dtype: auto (bfloat16 on accelerators, float32 on CPU), float32, bfloat16"),
    },
    "mesh": {
        "data": (-1, (int,), "data-parallel axis size (-1: the remaining devices)"),
        "fsdp": (1, (int,), "fully-sharded axis: params and optimizer state split over it"),
        "tensor": (1, (int,), "tensor-parallel axis: heads, MLP and vocabulary split over it"),
        "expert": (1, (int,), "expert-parallel axis: a mixture-of-experts target's experts split over it"),
    },
    "output": {
        "dir": (REQUIRED, (str,), "run directory: checkpoints/, logs (TensorBoard, metrics.jsonl), export/"),
        "save_every": (500, (int,), "checkpoint every N steps (and on SIGTERM and at the end)"),
        "keep": (3, (int,), "checkpoints kept"),
        "log_every": (10, (int,), "metrics every N steps"),
        "eval_every": (0, (int,), "real tau through the engine every N steps (0: only at the end)"),
        "eval_num_prompts": (8, (int,), "held-out prompts per evaluation"),
        "eval_max_new_tokens": (64, (int,), "tokens generated per evaluation prompt"),
        "export_dtype": (None, (str,), "dtype of the exported official draft (default: float32)"),
    },
}

POSITIVE = {"draft.num_layers", "draft.block_size", "draft.intermediate_size", "draft.num_attention_heads",
            "draft.num_key_value_heads", "draft.head_dim", "draft.conv_kernel_size", "draft.conv_group_size",
            "draft.selector_rank", "draft.selector_top_k", "data.max_length", "data.limit", "data.min_length",
            "train.epochs",
            "train.max_steps", "train.global_batch", "train.accum_steps", "train.num_anchors", "train.anchor_chunk",
            "train.gamma", "train.kl_temperature", "train.learning_rate", "train.prefix_base", "train.prefix_min",
            "train.prefix_max", "train.muon_learning_rate", "train.clip_norm", "output.save_every", "output.keep",
            "output.log_every", "output.eval_num_prompts", "output.eval_max_new_tokens", "draft.init_std"}
NON_NEGATIVE = {"data.seed", "train.selector_weight", "train.warmup_ratio", "train.min_lr_ratio", "train.weight_decay", "output.eval_every", "train.seed"}


def _type_name(types: tuple[type, ...]) -> str:
    return " or ".join({"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                        "list": "list"}[t.__name__] for t in types)


def _check_value(dotted: str, value: Any, types: tuple[type, ...], source: str) -> Any:
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        name = _type_name(types)
        raise ConfigError(f"{source}: {dotted} must be {'an' if name[0] in 'aeiou' else 'a'} {name}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {dotted} must be a finite number, got {value!r}")
    if dotted in ("train.seed", "data.seed") and value >= 2**32:
        raise ConfigError(f"{source}: {dotted} must be below 2**32, got {value!r}")
    if dotted in POSITIVE and value <= 0:
        raise ConfigError(f"{source}: {dotted} must be positive, got {value!r}")
    if dotted in NON_NEGATIVE and value < 0:
        raise ConfigError(f"{source}: {dotted} must not be negative, got {value!r}")
    return value


def parse_run_config(raw: Any, source: str = "run config") -> dict[str, dict[str, Any]]:
    """Validate a loaded YAML mapping and fill in the defaults; returns ``{section: {key: value}}``."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(SCHEMA)}), got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SCHEMA) - {"name"})
    if unknown:
        raise ConfigError(f"{source}: unknown section {unknown[0]!r} (sections: {', '.join(SCHEMA)})")
    out: dict[str, dict[str, Any]] = {}
    for section, keys in SCHEMA.items():
        given = raw.get(section) or {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"{source}: section {section!r} must be a mapping, got {given!r}")
        bad = sorted(set(given) - set(keys))
        if bad:
            raise ConfigError(f"{source}: unknown key {section}.{bad[0]} (known: {', '.join(sorted(keys))})")
        out[section] = {}
        for key, (default, types, _) in keys.items():
            dotted = f"{section}.{key}"
            value = given.get(key, default)
            if value is REQUIRED:
                raise ConfigError(f"{source}: missing required key {dotted}")
            out[section][key] = None if value is None else _check_value(dotted, value, types, source)
    train = out["train"]
    if train["global_batch"] % train["accum_steps"]:
        raise ConfigError(f"{source}: train.global_batch {train['global_batch']} is not divisible by "
                          f"train.accum_steps {train['accum_steps']}")
    experts_key = "target.experts"
    if out["target"]["mxfp4"] is not None:  # the older name of target.experts
        if "experts" in (raw.get("target") or {}):
            raise ConfigError(f"{source}: target.mxfp4 is the older name of target.experts; give one of them")
        out["target"]["experts"], experts_key = out["target"]["mxfp4"], "target.mxfp4"
    if out["target"]["experts"] not in ("dequantize", "packed"):
        raise ConfigError(f"{source}: {experts_key} must be dequantize or packed, got "
                          f"{out['target']['experts']!r}")
    if out["train"]["dtype"] not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"{source}: train.dtype must be auto, float32 or bfloat16, got {train['dtype']!r}")
    if train["loss"] not in LOSSES:
        raise ConfigError(f"{source}: train.loss must be one of {', '.join(LOSSES)}, got {train['loss']!r}")
    if train["position_weights"] not in POSITION_WEIGHTS:
        raise ConfigError(f"{source}: train.position_weights must be one of {', '.join(POSITION_WEIGHTS)}, got "
                          f"{train['position_weights']!r}")
    for key in ("kl_weight", "dpace_alpha"):
        if not 0 <= train[key] <= 1:
            raise ConfigError(f"{source}: train.{key} must lie in [0, 1], got {train[key]!r}")
    if train["uniform_loss"] and train["position_weights"] != "decay":
        raise ConfigError(f"{source}: train.uniform_loss replaces the decay weights; it cannot go with "
                          f"train.position_weights {train['position_weights']}")
    if train["optimizer"] not in ("adamw", "muon"):
        raise ConfigError(f"{source}: train.optimizer must be adamw or muon, got {train['optimizer']!r}")
    if not 0 <= train["muon_momentum"] < 1:
        raise ConfigError(f"{source}: train.muon_momentum must lie in [0, 1), got {train['muon_momentum']!r}")
    if train["loss_mode"] not in ("standard", "variable_prefix"):
        raise ConfigError(f"{source}: train.loss_mode must be standard or variable_prefix, got {train['loss_mode']!r}")
    if train["loss_mode"] == "variable_prefix" and train["position_weights"] != "decay":
        raise ConfigError(f"{source}: train.loss_mode variable_prefix restarts the decay weights at the prefix; it "
                          f"cannot go with train.position_weights {train['position_weights']}")
    if train["prefix_max"] is not None and train["prefix_max"] < train["prefix_min"]:
        raise ConfigError(f"{source}: train.prefix_max {train['prefix_max']} is below train.prefix_min "
                          f"{train['prefix_min']}")
    if train["anchors"] not in ("random", "uniform"):
        raise ConfigError(f"{source}: train.anchors must be random or uniform, got {train['anchors']!r}")
    if out["draft"]["context_injection"] not in (None, *CONTEXT_INJECTIONS):
        raise ConfigError(f"{source}: draft.context_injection must be one of {', '.join(CONTEXT_INJECTIONS)}, got "
                          f"{out['draft']['context_injection']!r}")
    if out["draft"]["architecture"] not in (None, "dflash", "dflash2", "dspark"):
        raise ConfigError(f"{source}: draft.architecture must be dflash, dflash2 or dspark, got "
                          f"{out['draft']['architecture']!r}")
    if out["draft"]["architecture"] != "dspark":
        given = [k for k in DSPARK_FIELDS if out["draft"][k] is not None]
        if given:
            raise ConfigError(f"{source}: draft.{given[0]} belongs to a DSpark draft; set draft.architecture: dspark")
    weights = train["dspark_loss_weights"]
    if (not isinstance(weights, list) or len(weights) != 3
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights)):
        raise ConfigError(f"{source}: train.dspark_loss_weights must be three non-negative numbers (ce, l1, "
                          f"confidence), got {weights!r}")
    if out["draft"]["markov_head_type"] not in (None, "vanilla", "gated"):
        raise ConfigError(f"{source}: draft.markov_head_type must be vanilla or gated, got "
                          f"{out['draft']['markov_head_type']!r}")
    if out["draft"]["markov_rank"] is not None and out["draft"]["markov_rank"] < 0:
        raise ConfigError(f"{source}: draft.markov_rank must be >= 0, got {out['draft']['markov_rank']}")
    if out["draft"]["architecture"] != "dflash2":
        given = [k for k in DFLASH2_FIELDS if out["draft"][k] is not None]
        if given:
            raise ConfigError(f"{source}: draft.{given[0]} belongs to a DFlash2 draft; set draft.architecture: dflash2")
    least = 1 if out["draft"]["architecture"] == "dspark" else 2
    if out["draft"]["block_size"] is not None and out["draft"]["block_size"] < least:
        raise ConfigError(f"{source}: draft.block_size must be at least {least}, got {out['draft']['block_size']}")
    if out["output"]["export_dtype"] not in (None, "float32", "bfloat16", "float16"):
        raise ConfigError(f"{source}: output.export_dtype must be float32, bfloat16 or float16, got "
                          f"{out['output']['export_dtype']!r}")
    train_files = out["data"]["train"]
    if isinstance(train_files, list) and (not train_files or not all(isinstance(f, str) for f in train_files)):
        raise ConfigError(f"{source}: data.train must be a file name or a non-empty list of file names")
    _check_sources(out["data"], source)
    ids = out["draft"]["target_layer_ids"]
    if ids is not None and (not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ConfigError(f"{source}: draft.target_layer_ids must be a non-empty list of integers, got {ids!r}")
    for section, key, of in (("target", "revision", "path"), ("draft", "init_revision", "init")):
        revision = out[section][key]
        if revision is not None and not revision.strip():
            raise ConfigError(f"{source}: {section}.{key} must not be empty (leave it out for the default branch)")
        if revision is not None and not out[section][of]:
            raise ConfigError(f"{source}: {section}.{key} needs {section}.{of} (the Hugging Face Hub id it is a "
                              "revision of)")
    return out


SOURCE_KEYS = ("path", "weight", "max_samples", "columns")


def _check_sources(data: dict, source: str) -> None:
    """data.train or data.sources (one of them); each source normalised to ``{path, weight, max_samples,
    columns}``. data.train is then set to the sources' paths: code that reads data.train for the data's
    origin (the thinking mode of a regeneration directory) sees every source."""
    sources = data["sources"]
    if sources is None:
        if data["train"] is None:
            raise ConfigError(f"{source}: give data.train (a source or a list of them) or data.sources (a mixture)")
        return
    if not sources:
        raise ConfigError(f"{source}: data.sources must be a non-empty list")
    from dflash_jax.data.sources import parse_columns
    from dflash_jax.errors import UserError

    normalised = []
    for index, entry in enumerate(sources):
        where = f"{source}: data.sources[{index}]"
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a source string or a mapping with a path, got {entry!r}")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(SOURCE_KEYS)})")
        path, weight, max_samples = entry.get("path"), entry.get("weight"), entry.get("max_samples")
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"{where}: path must be a non-empty string (a file, directory, glob or "
                              f"hf:ORG/NAME[:CONFIG[:SPLIT]]), got {path!r}")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not math.isfinite(weight) or weight <= 0):
            raise ConfigError(f"{where} ({path}): weight must be a positive number, got {weight!r}")
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                        or max_samples < 1):
            raise ConfigError(f"{where} ({path}): max_samples must be a positive integer, got {max_samples!r}")
        try:
            columns = parse_columns(entry.get("columns"), f"{where} ({path}): columns")
        except UserError as e:
            raise ConfigError(str(e)) from None
        normalised.append({"path": path, "weight": weight, "max_samples": max_samples, "columns": columns})
    weighted = [s["weight"] is not None for s in normalised]
    if any(weighted) and not all(weighted):
        missing = normalised[weighted.index(False)]["path"]
        raise ConfigError(f"{source}: data.sources: give every source a weight or none ({missing} has none)")
    paths = [s["path"] for s in normalised]
    if data["train"] is not None and data["train"] != paths:  # (a parsed config, parsed again, has both)
        raise ConfigError(f"{source}: give data.train (a source or a list of them) or data.sources (a mixture), "
                          "not both")
    data["sources"] = normalised
    data["train"] = paths


def apply_overrides(raw: dict, overrides: list[str], source: str = "--set") -> dict:
    """``section.key=value`` overrides (values parsed as YAML: numbers, booleans, lists, null)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        dotted, sep, text = item.partition("=")
        parts = dotted.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ConfigError(f"{source} {item!r}: expected section.key=value, e.g. train.learning_rate=3e-4")
        section, key = parts
        if section not in SCHEMA or key not in SCHEMA[section]:
            raise ConfigError(f"{source} {item!r}: unknown key {dotted.strip()}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][key] = value
    return raw


def load_run_config(path: str | Path, overrides: list[str] = ()) -> dict[str, dict[str, Any]]:
    """Read, override and validate a run YAML. Relative paths inside it are relative to the working
    directory (as on the command line)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the run config ({e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    raw = apply_overrides(raw if isinstance(raw, dict) else {}, list(overrides)) if overrides else raw
    return parse_run_config(raw, str(path))


def describe_keys() -> str:
    """Every key with its default and meaning (for ``--help``)."""
    lines = []
    for section, keys in SCHEMA.items():
        for key, (default, _, text) in keys.items():
            shown = "required" if default is REQUIRED else f"default {default!r}"
            lines.append(f"  {section}.{key}: {text} ({shown})")
    return "\n".join(lines)
