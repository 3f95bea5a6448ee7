"""The official DFlash draft ``config.json``: parsing, defaults, validation against a target, export.

Field placement differs between released checkpoints: DFlash fields (``target_layer_ids``,
``mask_token_id``, ``block_size``, ...) are read from the nested ``dflash_config`` first, then top level.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dflash_jax.errors import ServingWarning
from dflash_jax.models.config import (
    MAX_LAYERS, ConfigError, RopeConfig, TargetConfig, attention_shape, bool_field, float_field, int_field,
    parse_rope, read_config_json, require, rope_to_hf,
)

LAYER_TYPES = ("full_attention", "sliding_attention")
# How the target's features reach the draft. "every_layer" is DFlash (and the only layout the official code
# runs): each layer projects the fused features into extra keys/values. "input" is the paper's ablation: the
# fused features are the draft's input at the context positions, which then travel through the layers as
# ordinary causal tokens, and each layer's block attends to the context's keys/values AT THAT LAYER.
CONTEXT_INJECTIONS = ("every_layer", "input")
QWEN3_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default
MAX_BLOCK_SIZE = 1024
DFLASH2 = "DFlash2DraftModel"
DRAFT_ARCHITECTURES = ("DFlashDraftModel", DFLASH2)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # all required
# Meta's DFlash drafter for Muse Glimmer (transformers' ``MuseGlimmerAssistantModel``, SPEC 11.2a): the same
# network as a DFlash draft, in its own config and tensor names. ``DraftConfig.layout`` says which of the two
# layouts a draft is read from and written back in.
MUSE_ASSISTANT = "muse_glimmer_assistant"
MUSE_ASSISTANT_ARCHITECTURE = "MuseGlimmerAssistantModel"
LAYOUTS = ("dflash", MUSE_ASSISTANT)
# ``MuseGlimmerAssistantConfig``'s defaults (the released 30B drafter's values) for fields a config leaves out.
# DeepSeek's DSpark drafts (deepseek-ai/DeepSpec ``Qwen3DSparkModel``, SPEC section 13): the DFlash backbone with
# shifted outputs (block position k predicts the token after ``anchor + k``), an optional Markov head on the
# previously drafted token and an optional confidence head. Their config.json is the target's plus these
# fields; their checkpoints hold copies of the target's embedding and head. DeepSpec's "DFlash" baselines are
# the same class with ``markov_rank: 0`` and no confidence head.
DEEPSPEC = "deepspec"
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)
DSPARK_UNSUPPORTED = ("Gemma4DSparkModel",)
MARKOV_HEAD_TYPES = ("vanilla", "gated")  # DeepSpec's "rnn" head carries a state along the block: not here yet
MUSE_ASSISTANT_DEFAULTS = {"block_size": 16, "mask_token_id": 201818, "target_layer_ids": [1, 13, 25, 37, 49],
                           "sliding_window": 2048, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                           "rope_theta": 500000.0}


def is_muse_assistant_config(cfg: Mapping[str, Any]) -> bool:
    architectures = cfg.get("architectures") or []
    return cfg.get("model_type") == MUSE_ASSISTANT or (
        isinstance(architectures, list) and MUSE_ASSISTANT_ARCHITECTURE in architectures)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Evenly spread feature layers, skipping the first and the last few (the reference rule; Python's
    ``round`` is half-to-even, which decides e.g. L=24, n=5)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = (num_target_layers - 4) / (num_draft_layers - 1)
    return tuple(int(round(1 + i * span)) for i in range(num_draft_layers))


def target_embedding_scale(target: TargetConfig) -> float:
    """What the target multiplies its embedding rows by (Gemma 4: sqrt(hidden_size), rounded to float32 as
    transformers does; 1 for every other family)."""
    return float(np.float32(target.hidden_size ** 0.5)) if target.scale_embeddings else 1.0


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    model_type: str = "qwen3"
    context_injection: str = "every_layer"
    # The official ``is_causal`` (newest code): True/False makes every layer causal/bidirectional inside the
    # block; None (absent) makes sliding layers causal and full layers bidirectional.
    is_causal: bool | None = None
    # DFlash2 (``architectures: ["DFlash2DraftModel"]``, SPEC section 10): block convolutions in every layer and
    # a candidate selector. All None for a DFlash draft.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # "dflash": the official DFlash / DFlash2 layout; MUSE_ASSISTANT: Meta's drafter, whose config records
    # neither the target's layer count nor its vocabulary (``num_target_layers`` and ``vocab_size`` are 0 then:
    # unknown, taken from the target where an export to the DFlash layout needs them).
    layout: str = "dflash"
    # DSpark (``layout == DEEPSPEC``): the Markov head's rank (0: none) and kind, the confidence head, whether it
    # also reads the previous token's Markov embedding, and DeepSpec's training ``num_anchors`` (kept for export).
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    num_anchors: int = 512
    # Not in any config file: set for a mesh whose tensor axis outnumbers the draft's KV heads
    # (``sharding.kv_replicas``, ``DFlashProposer.on_mesh``), so that the context cache splits over it.
    kv_replicas: int = 1

    @property
    def kv_copies(self) -> int:
        """How many times the context cache keeps each KV head: ``kv_replicas`` where the copies still split
        each head's group of query heads evenly, else once (exact either way, as ``TargetConfig.kv_copies``)."""
        group = self.num_attention_heads // self.num_key_value_heads
        return self.kv_replicas if group % self.kv_replicas == 0 else 1

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def dspark(self) -> bool:
        """A DeepSpec draft: shifted outputs (``block_size`` proposals, verify width ``block_size + 1``)."""
        return self.layout == DEEPSPEC

    @property
    def proposals(self) -> int:
        """Tokens one draft forward proposes: ``block_size`` (DSpark: every block position predicts the token
        after it) or ``block_size - 1`` (DFlash: the anchor's own output is dropped)."""
        return self.block_size if self.dspark else self.block_size - 1

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        """Per layer: whether block queries see only block keys at or before their own position."""
        if self.is_causal is not None:
            return (self.is_causal,) * self.num_hidden_layers
        return tuple(kind == "sliding_attention" for kind in self.layer_types)

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def reads_last_layer(self) -> bool:
        """Whether a feature comes from the target's last layer, which only transformers-based code can give:
        SGLang and vLLM capture the INPUT of layer i+1, so there is no layer after the last to read (SPEC 3)."""
        return self.num_target_layers - 1 in self.target_layer_ids

    def last_layer_note(self) -> str:
        return (f"target_layer_ids {list(self.target_layer_ids)} include the target's last layer "
                f"{self.num_target_layers - 1}: the official code feeds it the final-normed output, but SGLang "
                "and vLLM cannot serve such a draft (they capture the input of layer i+1)")

    def warn_if_last_layer(self, source: str) -> None:
        if self.reads_last_layer:
            warnings.warn(f"{source}: {self.last_layer_note()}", ServingWarning, stacklevel=2)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "draft config") -> "DraftConfig":
        if is_muse_assistant_config(cfg):
            return cls._from_muse_assistant(cfg, source)
        architectures = cfg.get("architectures") or []
        if isinstance(architectures, list) and set(architectures) & set(DSPARK_ARCHITECTURES + DSPARK_UNSUPPORTED):
            return cls._from_deepspec(cfg, source)
        nested = cfg.get("dflash_config") or {}
        if not isinstance(nested, Mapping):
            raise ConfigError(f"{source}: 'dflash_config' must be an object")

        def dflash(key: str, default: Any = None) -> Any:
            if key in nested and nested[key] is not None:
                return nested[key]
            return cfg.get(key, default)

        merged = {**cfg, **{k: v for k, v in nested.items() if v is not None}}
        architectures = cfg.get("architectures") or []
        if not isinstance(architectures, list):
            raise ConfigError(f"{source}: 'architectures' must be a list, got {architectures!r}")
        if not nested and "block_size" not in cfg and not set(DRAFT_ARCHITECTURES) & set(architectures):
            raise ConfigError(
                f"{source}: not a DFlash draft config (no 'dflash_config', 'block_size' or architectures "
                f"['DFlashDraftModel']; model_type {cfg.get('model_type')!r}). Is this a target checkpoint?"
            )
        hidden, heads, kv_heads, head_dim = attention_shape(cfg, source)
        layers = int_field(cfg, "num_hidden_layers", source, maximum=MAX_LAYERS)
        num_target_layers = int_field(merged, "num_target_layers", source, maximum=MAX_LAYERS)
        vocab = require(cfg, "vocab_size", source)
        ids = dflash("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(num_target_layers, layers)
        if (not isinstance(ids, (list, tuple)) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ConfigError(f"{source}: target_layer_ids must be a non-empty list of integers, got {ids!r}")
        if dflash("mask_token_id") is None:
            raise ConfigError(f"{source}: missing required field 'mask_token_id' (in dflash_config or top level)")
        mask_id = int_field(merged, "mask_token_id", source, minimum=0)  # validate_against: inside the target's table
        block = int_field(merged, "block_size", source, minimum=2, maximum=MAX_BLOCK_SIZE)
        # As transformers' Qwen3Config (the official code's config class) reads them: without
        # use_sliding_window (default false) there is no window anywhere, whatever sliding_window says; an
        # absent sliding_window is 4096 under use_sliding_window true. Layer types stay as given: a sliding layer
        # without a window is still causal inside the block (the official per-layer rule).
        use_window = bool_field(cfg, "use_sliding_window", source, False)
        window = int_field(cfg, "sliding_window", source, None, minimum=0) if "sliding_window" in cfg else 4096
        window = (window or None) if use_window else None  # 0: no window
        if cfg.get("layer_types") is not None:
            layer_types = cfg["layer_types"]
            if not isinstance(layer_types, list):
                raise ConfigError(f"{source}: layer_types must be a list, got {layer_types!r}")
            for t in layer_types:
                if t not in LAYER_TYPES:
                    raise ConfigError(f"{source}: layer type {t!r} is not one of {', '.join(LAYER_TYPES)}")
            layer_types = tuple(layer_types)
        elif window is not None:  # the Qwen3 rule when layer_types is absent
            first = int_field(cfg, "max_window_layers", source, QWEN3_MAX_WINDOW_LAYERS, minimum=0)
            layer_types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
        else:
            layer_types = ("full_attention",) * layers
        if len(layer_types) != layers:
            raise ConfigError(
                f"{source}: layer_types has {len(layer_types)} entries but num_hidden_layers is {layers}"
            )
        cap = float_field(merged, "final_logit_softcapping", source, None)
        if cap is not None and cap < 0:
            raise ConfigError(f"{source}: field 'final_logit_softcapping' must be positive (or 0/null for none), "
                              f"got {cap}")
        injection = dflash("context_injection", "every_layer")
        if injection not in CONTEXT_INJECTIONS:
            raise ConfigError(f"{source}: context_injection must be one of {', '.join(CONTEXT_INJECTIONS)}, "
                              f"got {injection!r}")
        dflash2 = {}
        if DFLASH2 in architectures:
            dflash2 = {key: int_field(merged, key, source) for key in DFLASH2_FIELDS}
            if hidden % dflash2["conv_group_size"]:
                raise ConfigError(f"{source}: conv_group_size {dflash2['conv_group_size']} does not divide "
                                  f"hidden_size {hidden}")
            if dflash2["selector_top_k"] > vocab:
                raise ConfigError(f"{source}: selector_top_k {dflash2['selector_top_k']} exceeds vocab_size {vocab}")
            if injection != "every_layer":
                raise ConfigError(f"{source}: a DFlash2 draft injects the context in every layer "
                                  f"(context_injection {injection!r} is not defined for it)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=require(cfg, "intermediate_size", source),
            rms_norm_eps=float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True, below=1.0),
            rope=parse_rope(cfg, source),
            vocab_size=vocab,
            block_size=block,
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(ids),
            mask_token_id=mask_id,
            layer_types=layer_types,
            sliding_window=window,
            attention_bias=bool_field(cfg, "attention_bias", source, False),
            max_position_embeddings=require(cfg, "max_position_embeddings", source)
            if "max_position_embeddings" in cfg else 40960,
            input_embedding_scale=float_field(merged, "input_embedding_scale", source, 1.0, positive=True),
            output_multiplier=float_field(merged, "output_multiplier", source, 1.0, positive=True),
            final_logit_softcapping=cap or None,
            model_type=str(cfg.get("model_type", "qwen3")),
            context_injection=injection,
            is_causal=bool_field(cfg, "is_causal", source, None),
            **dflash2,
        )

    @classmethod
    def _from_muse_assistant(cls, cfg: Mapping[str, Any], source: str) -> "DraftConfig":
        """Meta's ``MuseGlimmerAssistantConfig`` as the DFlash draft it is (SPEC 11.2a/c): top-level
        ``block_size``, ``mask_token_id`` and ``target_layer_ids``; every layer bidirectional inside the block;
        its sliding layers see keys with ``|q_pos - k_pos| <= sliding_window`` (transformers' bidirectional
        sliding mask includes the edge), which is this project's strict window of ``sliding_window + 1``."""
        if cfg.get("dflash_config") is not None:
            raise ConfigError(f"{source}: a {MUSE_ASSISTANT} config keeps block_size, mask_token_id and "
                              "target_layer_ids at the top level; it has no 'dflash_config'")
        d = {**MUSE_ASSISTANT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        layers = int_field(d, "num_hidden_layers", source, 5, maximum=MAX_LAYERS)
        window = int_field(d, "sliding_window", source, minimum=1)
        rope = dict(cfg.get("rope_parameters") or {}) if isinstance(cfg.get("rope_parameters"), Mapping) else \
            cfg.get("rope_parameters")
        if isinstance(rope, dict):  # transformers fills the class's default_theta (500000) when absent
            rope.setdefault("rope_theta", d["rope_theta"])
            rope.setdefault("rope_type", "default")
        official = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            **{k: d[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "intermediate_size", "rms_norm_eps", "max_position_embeddings", "hidden_act")
               if k in d},
            "num_hidden_layers": layers, "attention_bias": False,
            "layer_types": d.get("layer_types") or ["sliding_attention"] * layers,
            "sliding_window": window + 1, "use_sliding_window": True, "is_causal": False,
            "rope_parameters": rope if rope is not None else {"rope_type": "default", "rope_theta": d["rope_theta"]},
            "vocab_size": 1, "num_target_layers": 1, "block_size": d["block_size"],  # vocab, layers: placeholders
            "dflash_config": {"target_layer_ids": d["target_layer_ids"], "mask_token_id": d["mask_token_id"]},
        }
        parsed = cls.from_dict(official, source)
        return dataclasses.replace(parsed, layout=MUSE_ASSISTANT, num_target_layers=0, vocab_size=0)

    @classmethod
    def _from_deepspec(cls, cfg: Mapping[str, Any], source: str) -> "DraftConfig":
        """DeepSpec's ``Qwen3DSparkModel`` config (SPEC 13): the target's Qwen3 config plus top-level
        ``block_size``, ``num_target_layers``, ``target_layer_ids``, ``mask_token_id``, ``num_anchors``,
        ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``. Every
        layer is bidirectional inside the block (DeepSpec decodes with ``is_causal=False``)."""
        architectures = cfg.get("architectures") or []
        unsupported = [a for a in architectures if a in DSPARK_UNSUPPORTED]
        if unsupported:
            raise ConfigError(f"{source}: {unsupported[0]} (DeepSpec's Gemma 4 DSpark draft) is not supported yet; "
                              f"supported: {', '.join(DSPARK_ARCHITECTURES)}")
        for key in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head"):
            if cfg.get(key) is None:
                raise ConfigError(f"{source}: a DSpark draft config needs the top-level field {key!r}")
        rank = int_field(cfg, "markov_rank", source, minimum=0)
        kind = str(cfg.get("markov_head_type") or "vanilla").lower()
        if rank and kind not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"{source}: markov_head_type {cfg.get('markov_head_type')!r} is not supported (known "
                              f"here: {', '.join(MARKOV_HEAD_TYPES)})")
        confidence = bool_field(cfg, "enable_confidence_head", source, False)
        with_markov = confidence and bool_field(cfg, "confidence_head_with_markov", source, False)
        if with_markov and not rank:
            raise ConfigError(f"{source}: confidence_head_with_markov needs a Markov head (markov_rank is 0)")
        ids = cfg["target_layer_ids"]
        if isinstance(ids, (list, tuple)) and any(isinstance(i, int) and i < -1 for i in ids):
            raise ConfigError(f"{source}: target_layer_ids {ids!r}: -1 (the embeddings) is the only negative id")
        if bool_field(cfg, "use_sliding_window", source, False):
            raise ConfigError(f"{source}: use_sliding_window true: DeepSpec decodes DSpark drafts without a "
                              "window mask, so a windowed DSpark draft has no single meaning here")
        plain = {k: v for k, v in cfg.items() if k not in ("architectures", "layer_types")}
        plain["architectures"] = ["DFlashDraftModel"]
        plain["is_causal"] = False
        parsed = cls.from_dict(plain, source)
        return dataclasses.replace(
            parsed, layout=DEEPSPEC, markov_rank=rank, markov_head_type=kind, confidence_head=confidence,
            confidence_with_markov=with_markov,
            num_anchors=int_field(cfg, "num_anchors", source, 512, minimum=1))

    def to_deepspec_dict(self) -> dict[str, Any]:
        """DeepSpec's ``config.json`` (``Qwen3DSparkModel``): a Qwen3 config plus the DSpark fields."""
        if self.dflash2 or self.context_injection != "every_layer" or self.is_causal is not False:
            raise ConfigError("a DSpark draft is a plain bidirectional DFlash backbone (no DFlash2 pieces, "
                              "context in every layer)")
        out = {
            "architectures": list(DSPARK_ARCHITECTURES), "model_type": "qwen3",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "attention_bias": self.attention_bias, "attention_dropout": 0.0,
            "layer_types": ["full_attention"] * self.num_hidden_layers, "use_sliding_window": False,
            "sliding_window": None, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "tie_word_embeddings": False,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
            "num_anchors": self.num_anchors, "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type, "enable_confidence_head": self.confidence_head,
            "confidence_head_with_markov": self.confidence_with_markov,
        }
        out.update(rope_to_hf(self.rope))
        return out

    def as_dspark(self, markov_rank: int = 256, markov_head_type: str = "vanilla", confidence_head: bool = True,
                  confidence_with_markov: bool = True) -> "DraftConfig":
        """This backbone as a new DSpark draft (training): bidirectional, DeepSpec's layout and heads."""
        if markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type {markov_head_type!r} is not one of {', '.join(MARKOV_HEAD_TYPES)}")
        if confidence_with_markov and not markov_rank:
            raise ConfigError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        if self.sliding_window is not None:
            raise ConfigError("a DSpark draft has no sliding window (DeepSpec decodes without one)")
        return dataclasses.replace(
            self, layout=DEEPSPEC, is_causal=False, layer_types=("full_attention",) * self.num_hidden_layers,
            markov_rank=markov_rank, markov_head_type=markov_head_type, confidence_head=confidence_head,
            confidence_with_markov=confidence_head and confidence_with_markov)

    def muse_assistant_refusal(self) -> str | None:
        """Why this draft has no exact ``MuseGlimmerAssistantModel`` form (SPEC 11.2c), or None."""
        if self.dflash2:
            return ("it is a DFlash2 draft: its block convolutions and candidate selector have no counterpart in "
                    "MuseGlimmerAssistantModel")
        if self.attention_bias:
            return "it has attention biases (attention_bias true); MuseGlimmerAssistantModel has none"
        for name, value, plain in (("input_embedding_scale", self.input_embedding_scale, 1.0),
                                   ("output_multiplier", self.output_multiplier, 1.0),
                                   ("final_logit_softcapping", self.final_logit_softcapping, None)):
            if value != plain:
                return (f"it sets {name} {value}; transformers' DFlash generator embeds the raw rows and reads the "
                        "raw head logits (no such setting)")
        if self.context_injection != "every_layer":
            return f"its context_injection is {self.context_injection!r} (MuseGlimmerAssistantModel: every_layer)"
        causal = [i for i, c in enumerate(self.layer_causal) if c]
        if causal:
            return (f"its layers {causal} are causal inside the block (is_causal / sliding layers without "
                    "is_causal: false); every MuseGlimmerAssistantModel layer is bidirectional")
        sliding = [i for i, t in enumerate(self.layer_types) if t == "sliding_attention"]
        if sliding and (self.sliding_window is None or self.sliding_window < 2):
            return (f"its sliding layers {sliding} have window {self.sliding_window}; MuseGlimmerAssistantModel's "
                    "window includes its edge (|q - k| <= w), so it needs a window of at least 2 here")
        return None

    def to_muse_assistant_dict(self) -> dict[str, Any]:
        """Meta's ``config.json`` layout (``MuseGlimmerAssistantConfig``); a ConfigError naming the reason for a
        draft that has no exact form there (``muse_assistant_refusal``)."""
        refusal = self.muse_assistant_refusal()
        if refusal is not None:
            raise ConfigError(f"this draft cannot be written as a {MUSE_ASSISTANT} exactly: {refusal}")
        rope = rope_to_hf(self.rope)
        return {
            "architectures": [MUSE_ASSISTANT_ARCHITECTURE], "model_type": MUSE_ASSISTANT,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta,
                                **{k: v for k, v in (rope["rope_scaling"] or {}).items() if k != "rope_type"}},
            "layer_types": list(self.layer_types), "attention_dropout": 0.0,
            # the inclusive edge: this project's strict window w is Meta's w - 1 (transformers' default when
            # no layer slides, where it is unused)
            "sliding_window": self.sliding_window - 1 if self.sliding_window is not None else
            MUSE_ASSISTANT_DEFAULTS["sliding_window"],
            "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }

    def with_layout(self, layout: str, target: TargetConfig | None = None) -> "DraftConfig":
        """This draft in the other layout (exact, or a ConfigError naming why not). Meta's config records
        neither ``num_target_layers`` nor ``vocab_size``: going to the DFlash layout from it needs ``target``."""
        if layout not in LAYOUTS:
            raise ConfigError(f"draft layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if self.dspark:
            if layout == "dflash":  # the trainer's export names the layout it writes; a DSpark draft keeps its own
                return self
            raise ConfigError(f"a DSpark draft has no {layout} form (its outputs are shifted by one position)")
        if layout == MUSE_ASSISTANT:
            self.to_muse_assistant_dict()  # raises when inexact
            return dataclasses.replace(self, layout=layout)
        if self.num_target_layers and self.vocab_size:
            return dataclasses.replace(self, layout=layout)
        if target is None:
            raise ConfigError(f"a {MUSE_ASSISTANT} config records neither num_target_layers nor vocab_size, which "
                              "the DFlash layout states: give the target to take them from (python -m infer "
                              "convert --target DIR)")
        self.validate_against(target)
        return dataclasses.replace(self, layout=layout, num_target_layers=target.num_hidden_layers,
                                   vocab_size=target.vocab_size)

    @classmethod
    def from_json(cls, path: str | Path) -> "DraftConfig":
        path, cfg = read_config_json(path, "draft config")
        config = cls.from_dict(cfg, source=str(path))
        config.warn_if_yarn_amplitude_ambiguous(str(path))
        return config

    def warn_if_yarn_amplitude_ambiguous(self, source: str) -> None:
        """A YaRN draft whose ``mscale`` equals its ``mscale_all_dim`` and gives no ``attention_factor`` (z-lab's
        Kimi K2.5 / K2.6 drafts): transformers, and this engine, scale its cos/sin by 1.0, while SGLang and
        vLLM-Ascend use 0.1 ln(factor) + 1 (vLLM-Ascend restores it for these drafts: 1.0 lowers acceptance).
        Warned once per loaded directory; a config that states ``attention_factor`` is taken as it says."""
        rope = self.rope
        if (rope.rope_type == "yarn" and rope.factor > 1 and rope.mscale and rope.mscale == rope.mscale_all_dim
                and rope.attention_factor == 1.0):
            serving = 0.1 * float(np.log(rope.factor)) + 1
            warnings.warn(
                f"{source}: this draft's YaRN rope (factor {rope.factor:g}) sets mscale == mscale_all_dim, from "
                f"which transformers and this engine compute an attention factor of 1.0; SGLang and vLLM-Ascend run "
                f"such drafts (z-lab's Kimi K2.5/K2.6) at 0.1*ln(factor)+1 = {serving:.6g}. If it was trained at "
                f"that amplitude, add \"attention_factor\": {serving!r} to its rope_scaling / rope_parameters",
                ServingWarning, stacklevel=3)

    def to_official_dict(self) -> dict[str, Any]:
        """The ``config.json`` of this draft's own layout: the official DFlash one (``architectures:
        [DFlashDraftModel]`` or ``[DFlash2DraftModel]``, nested ``dflash_config``) or Meta's
        (``to_muse_assistant_dict``)."""
        if self.layout == MUSE_ASSISTANT:
            return self.to_muse_assistant_dict()
        if self.dspark:
            return self.to_deepspec_dict()
        out: dict[str, Any] = {
            "architectures": [DFLASH2 if self.dflash2 else "DFlashDraftModel"],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        }
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        out.update(rope_to_hf(self.rope))
        if self.input_embedding_scale != 1.0:
            out["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            out["dflash_config"]["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            out["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        if self.dflash2:
            out["dflash_config"].update({key: getattr(self, key) for key in DFLASH2_FIELDS})
        if self.context_injection != "every_layer":  # this project's ablation variant; official code ignores it
            out["dflash_config"]["context_injection"] = self.context_injection
        return out

    @classmethod
    def for_target(cls, target: TargetConfig, num_layers: int = 5, block_size: int = 16,
                   mask_token_id: int | None = None, target_layer_ids: tuple[int, ...] | None = None) -> "DraftConfig":
        """A Qwen3-style draft shaped like ``target`` (the recipe of the released drafts): same width, heads,
        head size, MLP size and RoPE; the mask token defaults to the last embedding row. For a mixture-of-experts
        target the MLP size is its config's dense ``intermediate_size`` (Qwen3-MoE's dense-layer width, 6144 for
        Qwen3-Coder-30B-A3B, as its released draft; gpt-oss's field is its expert width, 2880, while the
        released gpt-oss drafts use 7680: give ``draft.intermediate_size`` in the run config)."""
        return cls(
            hidden_size=target.hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim, intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
            rope=target.rope, vocab_size=target.vocab_size, block_size=block_size,
            num_target_layers=target.num_hidden_layers,
            target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_layers)),
            mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            layer_types=("full_attention",) * num_layers, max_position_embeddings=target.max_position_embeddings,
            # the block's embeddings and the head's logits as the target's own modules give them (Gemma 4: rows
            # times sqrt(H), soft-capped logits; Muse Glimmer: the multiplier), as z-lab's released drafts set
            input_embedding_scale=target_embedding_scale(target), output_multiplier=target.output_multiplier,
            final_logit_softcapping=target.final_logit_softcapping,
        )

    def validate_against(self, target: TargetConfig, source: str = "draft config") -> None:
        """Refuse a draft that cannot run on ``target``; each message names the field and both values."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"{source}: draft hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}"
            )
        for i in self.target_layer_ids:
            if i == -1 and self.dspark:  # DeepSpec: -1 reads the embeddings (hidden_states[0])
                continue
            if not 0 <= i < target.num_hidden_layers:
                raise ConfigError(
                    f"{source}: target_layer_ids contains {i}, outside the target's "
                    f"{target.num_hidden_layers} layers (valid 0..{target.num_hidden_layers - 1})"
                )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(
                f"{source}: mask_token_id {self.mask_token_id} is outside the target's embedding table "
                f"(vocab_size {target.vocab_size})"
            )
        if self.num_target_layers and self.num_target_layers != target.num_hidden_layers:  # 0: not recorded
            raise ConfigError(
                f"{source}: num_target_layers {self.num_target_layers} != target num_hidden_layers "
                f"{target.num_hidden_layers}"
            )
        scale = target_embedding_scale(target)
        if scale != 1.0 and self.input_embedding_scale == 1.0:
            warnings.warn(
                f"{source}: the target ({target.model_type}) scales its embedding rows by sqrt(hidden_size) = "
                f"{scale:.6g}, but this draft reads them unscaled (input_embedding_scale 1.0, or absent). z-lab's "
                "Gemma 4 drafts multiply the raw rows by dflash_config.input_embedding_scale (configs/gemma-4-* set "
                f"it to {scale:.6g}); if this draft was trained on scaled rows, set that field in its config.json, "
                "or its acceptance collapses", ServingWarning, stacklevel=2)
        self.warn_if_last_layer(source)
