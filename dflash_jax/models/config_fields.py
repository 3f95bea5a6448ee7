"""The shared pieces of a target's configuration: the field readers, RoPE, and the dataclasses every family
fills in (:class:`TargetFields` with its per-layer plan, :class:`ExpertsConfig`, :class:`GatedDeltaNetConfig`,
:class:`MLAConfig`).

This module sits below the family readers (``models/families``) and below the decoder's layers, so that both
import it; ``models/config`` puts them together into :class:`~dflash_jax.models.config.TargetConfig`, which
reads and writes a Hugging Face ``config.json`` through the family table. Every reader names the source and
the field in its error, because a user has to find the bad value in their own file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

from dflash_jax.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


class ConfigError(UserError):
    """A configuration value that this project cannot use; the message names the source and the field."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (HF ``rope_theta`` + ``rope_scaling``, or 5.x ``rope_parameters``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (gpt-oss): ramp between interpolated and original frequencies, and a cos/sin multiplier.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # "proportional" (Gemma 4's full layers): only the first ``int(partial_rotary_factor * head_dim // 2)``
    # frequencies turn (exponents over the WHOLE head_dim), the others are zero, then all are divided by factor.
    partial_rotary_factor: float = 1.0
    # YaRN's ``mscale`` / ``mscale_all_dim`` (DeepSeek-V3, Kimi K2): with both set and no explicit
    # attention_factor, the cos/sin factor is get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    # (1 for DeepSeek-V3's 1.0 / 1.0); ``mscale_all_dim`` also multiplies the softmax scale of multi-head latent
    # attention by get_mscale(factor, mscale_all_dim)^2 (``MLAConfig.softmax_scale``). 0: not given.
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """transformers' (and DeepSeek's) YaRN magnitude scale: ``0.1 * mscale * ln(factor) + 1``, 1 at factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def parse_rope(cfg: Mapping[str, Any], source: str = "config") -> RopeConfig:
    """Read RoPE settings from either the 4.x layout (top-level ``rope_theta``/``rope_scaling``) or the 5.x
    layout (``rope_parameters``), since released checkpoints and freshly saved ones differ."""
    params = {} if cfg.get("rope_parameters") is None else cfg["rope_parameters"]
    scaling = {} if cfg.get("rope_scaling") is None else cfg["rope_scaling"]
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: {key} must be an object or null, got {value!r}")
    merged: dict[str, Any] = {}
    if "rope_theta" in cfg:
        merged["rope_theta"] = cfg["rope_theta"]
    merged.update(scaling)
    merged.update(params)
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    theta = float_field(merged, "rope_theta", source, 10000.0, positive=True)
    kw: dict[str, Any] = {"theta": theta, "rope_type": rope_type}
    where = f"{source} (rope scaling)"
    if rope_type in ("linear", "llama3", "yarn"):
        kw["factor"] = float_field(merged, "factor", where, positive=True)
    if rope_type == "proportional":
        kw["factor"] = float_field(merged, "factor", where, 1.0, positive=True)
        kw["partial_rotary_factor"] = float_field(merged, "partial_rotary_factor", where, 1.0, positive=True)
        if kw["partial_rotary_factor"] > 1:
            raise ConfigError(f"{where}: partial_rotary_factor must be at most 1, got {kw['partial_rotary_factor']}")
    if rope_type == "llama3":
        kw["low_freq_factor"] = float_field(merged, "low_freq_factor", where, positive=True)
        kw["high_freq_factor"] = float_field(merged, "high_freq_factor", where, positive=True)
        if kw["high_freq_factor"] <= kw["low_freq_factor"]:
            raise ConfigError(f"{where}: high_freq_factor ({kw['high_freq_factor']}) must exceed low_freq_factor "
                              f"({kw['low_freq_factor']})")
        kw["original_max_position_embeddings"] = int_field(merged, "original_max_position_embeddings", where)
    if rope_type == "yarn":
        kw["original_max_position_embeddings"] = int_field(merged, "original_max_position_embeddings", where)
        kw["beta_fast"] = float_field(merged, "beta_fast", where, 32.0, positive=True) or 32.0
        kw["beta_slow"] = float_field(merged, "beta_slow", where, 1.0, positive=True) or 1.0
        kw["truncate"] = bool_field(merged, "truncate", where, True)
        kw["mscale"] = float_field(merged, "mscale", where, 0.0)
        kw["mscale_all_dim"] = float_field(merged, "mscale_all_dim", where, 0.0)
        factor = kw["factor"]
        # transformers' _compute_yarn_parameters, unless given: with both mscales (truthy), their ratio of
        # magnitude scales; else 0.1 * ln(factor) + 1 (no scaling at factor <= 1)
        if kw["mscale"] and kw["mscale_all_dim"]:
            default_af = yarn_get_mscale(factor, kw["mscale"]) / yarn_get_mscale(factor, kw["mscale_all_dim"])
        else:
            default_af = yarn_get_mscale(factor)
        kw["attention_factor"] = float_field(merged, "attention_factor", where, default_af, positive=True)
    return RopeConfig(**kw)


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    """The 4.x layout (top-level ``rope_theta`` and ``rope_scaling``), which every serving stack reads."""
    out: dict[str, Any] = {"rope_theta": rope.theta, "rope_scaling": None}
    if rope.rope_type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rope.factor}
    elif rope.rope_type == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    elif rope.rope_type == "yarn":
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": rope.factor,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
            "truncate": rope.truncate,
            "attention_factor": rope.attention_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            **{k: v for k, v in (("mscale", rope.mscale), ("mscale_all_dim", rope.mscale_all_dim)) if v},
        }
    elif rope.rope_type == "proportional":  # transformers' check names "factor" unexpected, though it reads it
        out["rope_scaling"] = {"rope_type": "proportional", "partial_rotary_factor": rope.partial_rotary_factor,
                               **({"factor": rope.factor} if rope.factor != 1.0 else {})}
    return out


def rope_parameters(rope: RopeConfig) -> dict[str, Any]:
    """One RoPE in transformers 5.x's ``rope_parameters`` form."""
    return {"rope_type": rope.rope_type, "rope_theta": rope.theta, **(rope_to_hf(rope)["rope_scaling"] or {})}


def read_json_object(path: str | Path, what: str = "file", error: type[Exception] = ConfigError) -> dict:
    """A JSON file that must hold an object; errors name the file and say what was expected. The one JSON
    reader of checkpoint and config files."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: {what} not found")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object in the {what}")
    return value


def read_config_json(path: str | Path, what: str) -> tuple[Path, dict]:
    """``config.json`` of a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return path, read_json_object(path, f"{what} file")


REQUIRED = object()  # int_field / float_field: no default, the field must be given
MAX_INT32 = 2**31 - 1  # sizes, positions and token ids are int32 on the device
MAX_LAYERS = 4096


def present(cfg: Mapping[str, Any], key: str) -> bool:
    """Whether ``key`` is given: a null field means the default, as transformers reads it."""
    return key in cfg and cfg[key] is not None


def int_field(cfg: Mapping[str, Any], key: str, source: str, default: Any = REQUIRED, minimum: int = 1,
              maximum: int = MAX_INT32) -> Any:
    """An integer field (JSON booleans and floats refused) within ``[minimum, maximum]``; absent or null gives
    ``default`` (an error when there is none). Every message names the source and the field."""
    if not present(cfg, key):
        if default is REQUIRED:
            raise ConfigError(f"{source}: missing required field {key!r}")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: field {key!r} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{source}: field {key!r} must be between {minimum} and {maximum}, got {value}")
    return value


def float_field(cfg: Mapping[str, Any], key: str, source: str, default: Any = REQUIRED,
                positive: bool = False, below: float | None = None) -> Any:
    """A finite number (booleans refused), optionally ``> 0`` and ``< below``; absent or null gives
    ``default``."""
    if not present(cfg, key):
        if default is REQUIRED:
            raise ConfigError(f"{source}: missing required field {key!r}")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: field {key!r} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{source}: field {key!r} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{source}: field {key!r} must be positive, got {value!r}")
    if below is not None and value >= below:
        raise ConfigError(f"{source}: field {key!r} must be below {below}, got {value!r}")
    return float(value)


def bool_field(cfg: Mapping[str, Any], key: str, source: str, default: bool) -> bool:
    """``true``/``false`` only: the string "false" or the number 0 is a mistake, not a boolean."""
    if not present(cfg, key):
        return default
    value = cfg[key]
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field {key!r} must be true or false, got {value!r}")
    return value


def token_ids_field(cfg: Mapping[str, Any], key: str, source: str, vocab_size: int) -> tuple[int, ...]:
    """A token id or a list of them (``eos_token_id``), each inside the vocabulary; null means none."""
    value = cfg.get(key)
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab_size:
            raise ConfigError(f"{source}: field {key!r} must be a token id or a list of token ids in "
                              f"0..{vocab_size - 1}, got {value!r}")
    return tuple(items)


def require(cfg: Mapping[str, Any], key: str, source: str) -> int:
    """A mandatory positive integer field."""
    return int_field(cfg, key, source)


def attention_shape(cfg: Mapping[str, Any], source: str) -> tuple[int, int, int, int]:
    """``hidden_size, num_attention_heads, num_key_value_heads, head_dim`` checked together (target and
    draft alike): KV heads divide the query heads, head_dim defaults to hidden/heads and is even for RoPE."""
    hidden = require(cfg, "hidden_size", source)
    heads = require(cfg, "num_attention_heads", source)
    kv_heads = int_field(cfg, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if not present(cfg, "head_dim") and hidden % heads:
        raise ConfigError(f"{source}: hidden_size ({hidden}) not divisible by num_attention_heads ({heads})")
    head_dim = int_field(cfg, "head_dim", source, hidden // heads)
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
    return hidden, heads, kv_heads, head_dim


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """A mixture-of-experts FFN: the router, the experts' shape and their activation."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # "softmax_topk": Qwen3-MoE (softmax over all experts in float32, then top-k, renormalised when
    # ``norm_topk_prob``); "topk_softmax": gpt-oss (top-k of the raw logits, softmax over those k);
    # "sigmoid_topk": MiniMax-M2 (sigmoid of each logit in float32, then top-k, renormalised when
    # ``norm_topk_prob``).
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    # MiniMax-M2: a learned per-expert ``e_score_correction_bias [E]`` added to the scores for CHOOSING the
    # top k only; the weights are the unbiased scores of the chosen experts.
    selection_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    # Gemma 4's router (``router/proj``): it reads its input RMS-normalised without a weight (this eps), times
    # a learned ``router/scale [H]`` and H^-0.5, and each chosen expert's renormalised weight is multiplied by
    # its learned ``router/per_expert_scale [E]``. None: the plain router.
    router_norm_eps: float | None = None
    # "silu": SwiGLU ``down(silu(gate) * up)``; "gelu_tanh": GeGLU with tanh-approximated GELU (Gemma 4);
    # "clamped_swiglu": gpt-oss's ``(clip(up) + 1) * glu(min(gate))``.
    activation: str = "silu"
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0  # a shared expert scaled by sigmoid(shared_expert_gate(x)); 0 = none
    # False: DeepSeek-V3's shared experts (params ``shared_experts``, transformers' name), added without a gate.
    shared_expert_gate: bool = True
    # DeepSeek-V3's router (``routing="sigmoid_topk"`` with the selection bias): the experts come in ``n_group``
    # equal groups, a group scores the sum of its two best biased scores, and only the ``topk_group`` best groups'
    # experts may be chosen (1, 1: no restriction); the renormalised weights (``norm_eps`` added to their sum)
    # are then multiplied by ``routed_scaling_factor``.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_eps: float = 0.0
    # How the routed experts' weights live on the device. "float": ``experts/{gate,up,down}_proj`` in the compute
    # dtype. "mxfp4": kept packed as gpt-oss stores them (``experts/*_proj_blocks`` / ``_scales``, uint8, 4.25 bits
    # per weight; ``models/mxfp4``) and decoded inside the layer's computation. "fp8" / "int4": block-scaled FP8
    # or packed INT4 codes with their scales as the checkpoint stores them (``experts/*_proj_qweight`` /
    # ``_qscale``; ``models/quantized_experts``), one scale per ``weight_block`` (bn, bk) of a row-first
    # [out, in] weight (INT4: (1, group)). Not part of the Hugging Face config: chosen at load
    # (``load_target(..., experts="packed")``, ``python -m infer --experts packed``).
    weight_format: str = "float"
    weight_block: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Sizes of one Gated DeltaNet layer (HF: ``linear_num_key_heads``, ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``rms_norm_eps``)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                             f"({self.num_k_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: the concatenated ``[q | k | v]`` (``2 * key_dim + value_dim``)."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries through a low-rank path (``q_lora_rank``;
    0: a direct ``q_proj``), keys and values from one per-token latent of ``kv_lora_rank`` plus one RoPE key of
    ``qk_rope_head_dim`` shared by every head (``models/mla.py``)."""

    q_lora_rank: int  # 0: q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # RoPE on (even, odd) pairs, outputs permuted to evens then odds
    softmax_scale: float = 1.0  # (nope + rope)^-0.5, times YaRN's get_mscale(factor, mscale_all_dim)^2
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj (q_proj never has one)
    # The low-rank norms' eps: transformers builds them with its RMSNorm default, never rms_norm_eps.
    latent_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values per token in a layer's latent cache: the normed latent, then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class TargetFields:
    """Everything the target decoder needs; hashable so it can be a static argument of ``jax.jit``. Built and
    used as :class:`~dflash_jax.models.config.TargetConfig`, which adds the Hugging Face reading and writing
    (the family readers and writers take these fields, so they sit below ``models/config``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLP layers (unused when every layer routes through experts)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # "head": q_norm/k_norm weights [head_dim], one RMS per head (Qwen3); "projection": weights [heads *
    # head_dim], one RMS over the whole q (k) projection before the head split (MiniMax-M2; under tensor
    # parallelism over heads its mean spans every shard: XLA reduces it across the tensor axis).
    qk_norm_scope: str = "head"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The per-layer plan. ``experts``: the FFN of the layers listed in ``expert_layers`` (others are dense).
    experts: ExpertsConfig | None = None
    expert_layers: tuple[int, ...] = ()
    # ``layer_windows[i]``: layer i's keys are visible iff ``0 <= q_pos - k_pos < window``; None = full
    # causal. Empty = every layer full.
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # gpt-oss: one learned logit per head joins every softmax's denominator
    norm_weight_in_float32: bool = False  # gpt-oss multiplies the RMSNorm weight before casting back
    # Hybrid targets (Qwen3-Next, Qwen3.5/3.6). ``linear_layers``: the layers whose token mixer is a Gated
    # DeltaNet (``linear_attention``) instead of softmax attention; their sizes in ``linear_attention``.
    linear_layers: tuple[int, ...] = ()
    linear_attention: GatedDeltaNetConfig | None = None
    attention_output_gate: bool = False  # q_proj also yields a per-head gate: out * sigmoid(gate) before o_proj
    rotary_dim: int = 0  # RoPE rotates the first ``rotary_dim`` dims of each head (partial rotary); 0 = all
    zero_centered_norms: bool = False  # RMSNorm scales by (1 + w): the stored w starts at 0
    # Gemma 4. Full-attention layers (no window) with their own head size, KV heads and RoPE (0 / None: the
    # same as the others); ``attention_k_eq_v``: those layers have no v_proj, V is the raw k_proj output (before
    # k_norm, without RoPE); ``v_norm``: V is RMS-normalised per head without a weight; ``attention_scale``:
    # the softmax scale (None: 1/sqrt(head_dim)).
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_rope: RopeConfig | None = None
    attention_k_eq_v: bool = False
    v_norm: bool = False
    attention_scale: float | None = None
    hidden_act: str = "silu"  # the dense MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False  # the embeddings times sqrt(hidden_size), rounded to the weights' dtype
    # Sandwich norms: the attention output goes through ``post_attention_layernorm`` before the residual add,
    # the FFN reads ``pre_feedforward_layernorm`` and its output goes through ``post_feedforward_layernorm``.
    sandwich_norms: bool = False
    layer_scalar: bool = False  # each layer's output times its stored ``layer_scalar [1]``
    # The experts run BESIDE the dense MLP of an expert layer (Gemma 4's ``enable_moe_block``): each has its
    # own pre/post norms (``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_1`` / ``_2``), and the
    # router reads the un-normed residual.
    experts_beside_mlp: bool = False
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Muse Glimmer. ``embed_norm``: the looked-up embeddings RMS-normalised without a weight (eps
    # rms_norm_eps); ``final_norm_plain``: the final norm scales by ``w`` while the layer norms are (1 + w);
    # ``post_norm_eps``: the eps of the sandwich's post-attention / post-FFN norms (None: rms_norm_eps);
    # ``qk_norm_weight`` False: q/k norms without a weight; ``query_scale``: q times this after its norm (the
    # softmax scale stays 1/sqrt(head_dim)); ``attention_gate_proj``: the attention output times
    # sigmoid(gate_proj(x)) of the layer's normed input before o_proj; ``nope_layers``: layers without RoPE;
    # ``output_multiplier``: the logits times this before the soft-cap.
    embed_norm: bool = False
    final_norm_plain: bool = False
    post_norm_eps: float | None = None
    qk_norm_weight: bool = True
    query_scale: float = 1.0
    attention_gate_proj: bool = False
    nope_layers: tuple[int, ...] = ()
    output_multiplier: float = 1.0
    # DeepSeek-V3 / Kimi K2: every layer's token mixer is multi-head latent attention (``models/mla.py``) and
    # keeps a latent cache; ``num_key_value_heads`` then equals the query heads and ``head_dim`` is the query-key
    # head size (``MLAConfig.qk_head_dim``), as the expanded form computes.
    mla: MLAConfig | None = None
    # GLM-5 / GLM-5.1: MLA layers whose queries attend only to the keys the DSA indexer selects
    # (``models/dsa_indexer.DSAConfig``: sizes and each layer's full/shared mode), with an indexer-key cache.
    dsa: Any = None
    # Not a checkpoint setting: each KV head is kept this many times in the cache, so that a model with fewer
    # KV heads than the mesh's tensor axis still splits its cache over it (``sharding.kv_replicas``; the
    # engine sets it). The projections are unchanged; the copies are made after them.
    kv_replicas: int = 1
    # How the checkpoint stores its weights, from config.json's ``quantization_config`` (a
    # ``models/quantization_schemes`` scheme: block-scaled FP8 or packed INT4; None for float weights and for gpt-oss's
    # MXFP4, which its expert layout says): what ``--experts packed`` keeps on the device. Not compared: it
    # says how the weights were stored, not what the model computes (``experts.weight_format`` says how they live).
    quantization: Any = dataclasses.field(default=None, compare=False)

    def is_expert_layer(self, i: int) -> bool:
        return i in self.expert_layers

    def is_linear_layer(self, i: int) -> bool:
        return i in self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The softmax-attention layers, in order: the ones with a key/value cache."""
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.linear_layers)

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, i: int) -> int | None:
        return self.layer_windows[i] if self.layer_windows else None

    def has_rope(self, i: int) -> bool:
        return i not in self.nope_layers

    def attention_dims(self, window: int | None) -> tuple[int, int, RopeConfig]:
        """Head size, KV heads and RoPE of the attention layers with this ``window`` (None: the full layers,
        whose shape Gemma 4 sets apart)."""
        if window is None and self.global_head_dim:
            return self.global_head_dim, self.global_kv_heads or self.num_key_value_heads, self.global_rope or self.rope
        return self.head_dim, self.num_key_value_heads, self.rope

    def kv_copies(self, kv_heads: int) -> int:
        """How many times a layer with ``kv_heads`` keeps each KV head in its cache: ``kv_replicas`` where the
        copies still split each head's group of query heads evenly, else once (exact either way)."""
        return self.kv_replicas if (self.num_attention_heads // kv_heads) % self.kv_replicas == 0 else 1
