"""Target model configuration, parsed from a Hugging Face ``config.json``.

One decoder implementation covers LLaMA-2/3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, gpt-oss, the hybrid
Qwen3-Next / Qwen3.5 / Qwen3.6, MiniMax-M2, Gemma 4's and Muse Glimmer's text decoders, DeepSeek-V3 / Kimi
K2.5-K2.7 (multi-head latent attention) and GLM-5 / GLM-5.1 (latent attention with DeepSeek's sparse-attention
indexer; DeepSeek-V4 is not supported). A family is a small set of differences
from the dense decoder: attention flags, a per-layer plan (which layers mix tokens by softmax attention, by
Gated DeltaNet linear attention or by multi-head latent attention, which route through experts, which attend
through a sliding window), an :class:`ExpertsConfig`, a :class:`GatedDeltaNetConfig` and an :class:`MLAConfig`. Each family's reader below
(``FAMILIES``) turns its Hugging Face fields into those differences. Anything this implementation does not compute exactly is
refused with an error that names the file and the field, because a silently different model would break
losslessness downstream.
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


_REQUIRED = object()
MAX_INT32 = 2**31 - 1  # sizes, positions and token ids are int32 on the device
MAX_LAYERS = 4096


def _present(cfg: Mapping[str, Any], key: str) -> bool:
    return key in cfg and cfg[key] is not None


def int_field(cfg: Mapping[str, Any], key: str, source: str, default: Any = _REQUIRED, minimum: int = 1,
              maximum: int = MAX_INT32) -> Any:
    """An integer field (JSON booleans and floats refused) within ``[minimum, maximum]``; absent or null gives
    ``default`` (an error when there is none). Every message names the source and the field."""
    if not _present(cfg, key):
        if default is _REQUIRED:
            raise ConfigError(f"{source}: missing required field {key!r}")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: field {key!r} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{source}: field {key!r} must be between {minimum} and {maximum}, got {value}")
    return value


def float_field(cfg: Mapping[str, Any], key: str, source: str, default: Any = _REQUIRED,
                positive: bool = False, below: float | None = None) -> Any:
    """A finite number (booleans refused), optionally ``> 0`` and ``< below``; absent or null gives
    ``default``."""
    if not _present(cfg, key):
        if default is _REQUIRED:
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
    if not _present(cfg, key):
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
    if not _present(cfg, "head_dim") and hidden % heads:
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
class TargetConfig:
    """Everything the target decoder needs; hashable so it can be a static argument of ``jax.jit``."""

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
    # ``checkpoints/quantized`` scheme: block-scaled FP8 or packed INT4; None for float weights and for gpt-oss's
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

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config") -> "TargetConfig":
        raw, raw_source = cfg, source
        cfg, source = _text_config(cfg, source)
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(FAMILIES)})"
            )
        read_family = FAMILIES[model_type]
        if model_type in MLA_FAMILIES:
            cfg = _mla_attention_fields(cfg, source)
        if int_field(cfg, "pretraining_tp", source, 1) != 1:
            raise ConfigError(f"{source}: pretraining_tp != 1 is not supported")
        hidden, heads, kv_heads, head_dim = attention_shape(cfg, source)
        vocab = require(cfg, "vocab_size", source)
        num_layers = int_field(cfg, "num_hidden_layers", source, maximum=MAX_LAYERS)
        base = dict(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True, below=1.0),
            rope=parse_rope(cfg, source),
            max_position_embeddings=require(cfg, "max_position_embeddings", source)
            if "max_position_embeddings" in cfg else 4096,
            tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", source, False),
            bos_token_id=int_field(cfg, "bos_token_id", source, None, minimum=0, maximum=vocab - 1),
            eos_token_ids=token_ids_field(cfg, "eos_token_id", source, vocab),
        )
        base.update(read_family(cfg, source, num_layers))
        base["quantization"] = _quantization_scheme(raw, raw_source, model_type)
        return cls(**base)

    @classmethod
    def from_json(cls, path: str | Path) -> "TargetConfig":
        path, cfg = read_config_json(path, "config")
        return cls.from_dict(cfg, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict for this model (4.x rope layout, readable by 4.x and 5.x)."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type not in ("qwen2", "minimax_m2"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type in GEMMA4_TEXT:
            del out["hidden_act"]
            out.update(_gemma4_to_hf(self))
        if self.model_type == MUSE_GLIMMER_TEXT:
            return _muse_glimmer_to_hf(self, out)
        if self.model_type == "glm_moe_dsa":
            return _glm_moe_dsa_to_hf(self, _deepseek_v3_to_hf(self, out))
        if self.model_type in MLA_FAMILIES:
            return _deepseek_v3_to_hf(self, out)
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        e = self.experts
        if self.model_type == "qwen3_moe":
            out.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k,
                       moe_intermediate_size=e.intermediate_size, norm_topk_prob=e.norm_topk_prob,
                       decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(self.num_hidden_layers) if i not in self.expert_layers])
        if self.model_type == "minimax_m2":
            out.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k,
                       intermediate_size=e.intermediate_size)
        if self.model_type == "gpt_oss":
            out.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k,
                       intermediate_size=e.intermediate_size, swiglu_limit=e.swiglu_limit,
                       layer_types=["full_attention" if w is None else "sliding_attention"
                                    for w in self.layer_windows],
                       sliding_window=next((w for w in self.layer_windows if w is not None), None))
        if self.linear_layers:
            la = self.linear_attention
            out.update(layer_types=["linear_attention" if self.is_linear_layer(i) else "full_attention"
                                    for i in range(self.num_hidden_layers)],
                       linear_num_key_heads=la.num_k_heads, linear_num_value_heads=la.num_v_heads,
                       linear_key_head_dim=la.head_k_dim, linear_value_head_dim=la.head_v_dim,
                       linear_conv_kernel_dim=la.conv_kernel, partial_rotary_factor=self.rotary_dims / self.head_dim)
            if e is not None:
                out.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k,
                           moe_intermediate_size=e.intermediate_size, norm_topk_prob=e.norm_topk_prob,
                           shared_expert_intermediate_size=e.shared_intermediate_size)
            if self.model_type == "qwen3_next":
                out.update(decoder_sparse_step=1, mlp_only_layers=[
                    i for i in range(self.num_hidden_layers) if i not in self.expert_layers])
        if self.model_type not in GEMMA4_TEXT:
            out.update(rope_to_hf(self.rope))
        if self.rotary_dim:
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope.theta,
                                      "partial_rotary_factor": self.rotary_dims / self.head_dim}
        return out


# ---- The families: each reads its Hugging Face fields into the differences from the dense decoder. ----

def _check_silu(cfg: Mapping[str, Any], source: str) -> None:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")


def _no_sliding_window(cfg: Mapping[str, Any], source: str) -> None:
    if bool_field(cfg, "use_sliding_window", source, False):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported for target models")


def _dense_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """LLaMA, Mistral, Qwen2 and Qwen3."""
    model_type = cfg["model_type"]
    _check_silu(cfg, source)
    _no_sliding_window(cfg, source)
    if model_type == "mistral" and cfg.get("sliding_window") is not None:
        # Mistral applies its window whenever the field is set (Qwen gate it behind use_sliding_window).
        raise ConfigError(f"{source}: Mistral sliding_window={cfg['sliding_window']} is not supported "
                          "(set it to null only if the model was trained without a window)")
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    return dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        # Qwen2 always has q/k/v bias and no o bias; LLaMA/Qwen3 use attention_bias for all four.
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool_field(cfg, "mlp_bias", source, False),
        qk_norm=model_type == "qwen3",
    )


def _num_experts(cfg: Mapping[str, Any], source: str) -> int:
    # transformers 5.x writes ``num_local_experts``; released Qwen3-MoE checkpoints say ``num_experts``.
    key = "num_experts" if _present(cfg, "num_experts") else "num_local_experts"
    return int_field(cfg, key, source)


def _top_k(cfg: Mapping[str, Any], source: str, num_experts: int) -> int:
    return int_field(cfg, "num_experts_per_tok", source, maximum=num_experts)


def _sparse_layers(cfg: Mapping[str, Any], source: str, num_layers: int) -> tuple[int, ...]:
    """Layer i routes through experts iff it is not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0`` (Qwen3-MoE, Qwen3-Next)."""
    step = int_field(cfg, "decoder_sparse_step", source, 1)
    dense_only = cfg.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense_only):
        raise ConfigError(f"{source}: field 'mlp_only_layers' must be a list of layer indices in "
                          f"0..{num_layers - 1}, got {dense_only!r}")
    return tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def _qwen3_moe_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3 attention; layer i routes through experts iff
    it is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
    _check_silu(cfg, source)
    _no_sliding_window(cfg, source)
    num_experts = _num_experts(cfg, source)
    expert_layers = _sparse_layers(cfg, source, num_layers)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    return dict(
        # The dense layers' width; a config whose every layer is sparse may omit it.
        intermediate_size=int_field(cfg, "intermediate_size", source,
                                    _REQUIRED if len(expert_layers) < num_layers else 1),
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True,
        experts=ExpertsConfig(
            num_experts=num_experts, top_k=_top_k(cfg, source, num_experts),
            intermediate_size=require(cfg, "moe_intermediate_size", source),
            routing="softmax_topk", norm_topk_prob=bool_field(cfg, "norm_topk_prob", source, False)),
        expert_layers=expert_layers,
    )


def _gpt_oss_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """gpt-oss (20b, 120b): every layer routes through experts (top-k of biased logits, softmax over the k,
    clamped SwiGLU with biases); attention with biases and sinks; ``layer_types`` alternate sliding and full
    layers. Its ``hidden_act`` field says "silu" but the experts use the clamped form (not checked here)."""
    num_experts = _num_experts(cfg, source)
    window = int_field(cfg, "sliding_window", source, None)
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: even layers slide
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"sliding_attention",
                                                                                  "full_attention"}:
        raise ConfigError(f"{source}: field 'layer_types' must list 'sliding_attention' or 'full_attention' for "
                          f"each of the {num_layers} layers, got {types!r}")
    if "sliding_attention" in types and window is None:
        raise ConfigError(f"{source}: sliding_attention layers need a 'sliding_window'")
    limit = float_field(cfg, "swiglu_limit", source, 7.0, positive=True)
    return dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        qkv_bias=True, o_bias=True,
        experts=ExpertsConfig(
            num_experts=num_experts, top_k=_top_k(cfg, source, num_experts),
            intermediate_size=require(cfg, "intermediate_size", source),
            routing="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
            swiglu_limit=limit),
        expert_layers=tuple(range(num_layers)),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attention_sinks=True,
        norm_weight_in_float32=True,
    )


def _layer_types(cfg: Mapping[str, Any], source: str, num_layers: int) -> list[str]:
    """Qwen3-Next / Qwen3.5 ``layer_types`` (or, absent, every ``full_attention_interval``-th layer full)."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int_field(cfg, "full_attention_interval", source, 4)
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    allowed = {"linear_attention", "full_attention"}
    if not isinstance(types, list) or len(types) != num_layers or not all(
            isinstance(t, str) and t in allowed for t in types):
        raise ConfigError(f"{source}: field 'layer_types' must list 'linear_attention' or 'full_attention' for "
                          f"each of the {num_layers} layers, got {types!r}")
    return types


def _partial_rotary_dim(cfg: Mapping[str, Any], source: str, head_dim: int) -> int:
    """The rotated dims per head: ``partial_rotary_factor`` (in ``rope_parameters`` or top level) x head_dim."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    where = source if "partial_rotary_factor" not in params else f"{source} (rope_parameters)"
    factor = float_field(params if "partial_rotary_factor" in params else cfg, "partial_rotary_factor", where,
                         1.0, positive=True)
    dim = int(head_dim * factor)
    if factor > 1 or dim < 2 or dim % 2:
        raise ConfigError(f"{where}: partial_rotary_factor {factor} gives {dim} rotary dims of head_dim "
                          f"{head_dim}; it must give an even number between 2 and head_dim")
    return dim


def _linear_attention(cfg: Mapping[str, Any], source: str, hidden: int) -> GatedDeltaNetConfig:
    nk = int_field(cfg, "linear_num_key_heads", source)
    nv = int_field(cfg, "linear_num_value_heads", source)
    if nv % nk:
        raise ConfigError(f"{source}: linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads "
                          f"({nk})")
    return GatedDeltaNetConfig(
        hidden_size=hidden, num_k_heads=nk, num_v_heads=nv,
        head_k_dim=int_field(cfg, "linear_key_head_dim", source),
        head_v_dim=int_field(cfg, "linear_value_head_dim", source),
        conv_kernel=int_field(cfg, "linear_conv_kernel_dim", source, 4, minimum=2, maximum=64),
        eps=float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True, below=1.0))


def _hybrid_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Qwen3-Next, Qwen3.5 and Qwen3.6 (dense and MoE): Gated DeltaNet layers with a full-attention layer
    every ``full_attention_interval``; full layers gate their output per head and rotate a part of each head;
    every RMSNorm but the DeltaNet's output norm is zero-centred. FFN: dense (Qwen3.5), experts with a
    shared expert on every layer (Qwen3.5-MoE) or by ``decoder_sparse_step``/``mlp_only_layers``
    (Qwen3-Next)."""
    model_type = cfg["model_type"]
    _check_silu(cfg, source)
    types = _layer_types(cfg, source, num_layers)
    hidden, _, _, head_dim = attention_shape(cfg, source)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    out: dict[str, Any] = dict(
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_attention=_linear_attention(cfg, source, hidden),
        attention_output_gate=True, rotary_dim=_partial_rotary_dim(cfg, source, head_dim),
        zero_centered_norms=True,
    )
    routed = model_type != "qwen3_5_text" and int_field(cfg, "num_experts", source, 0, minimum=0) > 0
    expert_layers: tuple[int, ...] = ()
    if routed:
        num_experts = int_field(cfg, "num_experts", source)
        if model_type == "qwen3_next":
            expert_layers = _sparse_layers(cfg, source, num_layers)
        else:  # Qwen3.5-MoE: every layer
            expert_layers = tuple(range(num_layers))
        out["experts"] = ExpertsConfig(
            num_experts=num_experts, top_k=_top_k(cfg, source, num_experts),
            intermediate_size=require(cfg, "moe_intermediate_size", source), routing="softmax_topk",
            # Qwen3.5-MoE's router always renormalises its top-k (it has no norm_topk_prob field).
            norm_topk_prob=bool_field(cfg, "norm_topk_prob", source, True) if model_type == "qwen3_next" else True,
            shared_intermediate_size=int_field(cfg, "shared_expert_intermediate_size", source, 0, minimum=0))
    out["expert_layers"] = expert_layers
    out["intermediate_size"] = int_field(cfg, "intermediate_size", source,
                                         _REQUIRED if len(expert_layers) < num_layers else 1)
    return out


# MiniMax-M2 fields that transformers' MiniMaxM2 does not read (it hard-codes what they describe): released
# config.json files carry them, so a value other than the one computed here is refused, not ignored.
MINIMAX_M2_FIXED = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                    "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "attention_bias": False}


def _rotary_dim_checked(cfg: Mapping[str, Any], source: str, head_dim: int) -> int:
    """The rotary dims of ``partial_rotary_factor`` (``_partial_rotary_dim``), with a ``rotary_dim`` field (as
    MiniMax's own config.json files carry) required to agree: transformers reads only the factor (absent: 1,
    every dim rotates) and ignores ``rotary_dim``, MiniMax's code reads ``rotary_dim``; where they disagree
    the model's rotary size is ambiguous and the config is refused."""
    dim = _partial_rotary_dim(cfg, source, head_dim)
    if _present(cfg, "rotary_dim"):
        given = int_field(cfg, "rotary_dim", source, maximum=head_dim)
        if given != dim:
            raise ConfigError(
                f"{source}: field 'rotary_dim' ({given}) disagrees with partial_rotary_factor ({dim / head_dim:g}, "
                f"absent means 1), which rotates {dim} of head_dim {head_dim}: transformers reads only the factor, "
                f"MiniMax's own code reads rotary_dim. Set \"partial_rotary_factor\": {given / head_dim:g} (in "
                f"rope_parameters or at the top level) if the model rotates {given} dims, or remove 'rotary_dim'")
    return dim


def _minimax_m2_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """MiniMax-M2 (M2, M2.1, M2.5, M2.7): Qwen3-MoE-like, with q/k RMSNorms over the whole projection (before
    the head split), partial RoPE (split halves within the rotated dims), full attention, and on every layer
    experts chosen by sigmoid scores plus a selection-only correction bias, weighted by their renormalised
    scores (no shared expert, no groups, no routed scaling)."""
    _check_silu(cfg, source)
    _no_sliding_window(cfg, source)
    for key, value in MINIMAX_M2_FIXED.items():
        if _present(cfg, key) and cfg[key] != value:
            raise ConfigError(f"{source}: field {key!r} is {cfg[key]!r}, but transformers' MiniMaxM2 (what this "
                              f"implementation computes) always has {value!r}")
    types = cfg.get("attn_type_list")
    if types is not None and (not isinstance(types, list) or any(t != 1 for t in types)):
        raise ConfigError(f"{source}: field 'attn_type_list' must be all 1 (softmax attention on every layer), "
                          f"got {types!r}")
    if not _present(cfg, "head_dim"):  # transformers' class default, not hidden_size / num_attention_heads
        raise ConfigError(f"{source}: a minimax_m2 config needs 'head_dim' (transformers defaults it to 128, not "
                          "to hidden_size / num_attention_heads)")
    _, _, _, head_dim = attention_shape(cfg, source)
    rotary = _rotary_dim_checked(cfg, source, head_dim)
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    if not _present(cfg, "rope_theta") and not _present(params, "rope_theta"):
        cfg = {**cfg, "rope_theta": 5000000.0}  # MiniMaxM2Config.default_theta
    num_experts = _num_experts(cfg, source)
    width = require(cfg, "intermediate_size", source)  # of one expert (every layer routes)
    return dict(
        intermediate_size=width,
        qk_norm=True, qk_norm_scope="projection",
        rotary_dim=rotary if rotary != head_dim else 0,
        rope=parse_rope(cfg, source),
        experts=ExpertsConfig(
            num_experts=num_experts, top_k=_top_k(cfg, source, num_experts), intermediate_size=width,
            routing="sigmoid_topk", norm_topk_prob=True, selection_bias=True),
        expert_layers=tuple(range(num_layers)),
    )


# Gemma 4's text decoders: ``gemma4_text`` (31B, 26B-A4B, and the E-series this reader refuses) and
# ``gemma4_unified_text`` (12B: the same layer without MoE and per-layer embeddings).
GEMMA4_TEXT = ("gemma4_text", "gemma4_unified_text")
GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},  # transformers' default
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}


def _gemma4_layer_types(cfg: Mapping[str, Any], source: str, num_layers: int) -> list[str]:
    """``layer_types`` (absent: every 6th layer full); transformers forces the last layer to full attention."""
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"sliding_attention",
                                                                                  "full_attention"}:
        raise ConfigError(f"{source}: field 'layer_types' must list 'sliding_attention' or 'full_attention' for "
                          f"each of the {num_layers} layers, got {types!r}")
    return types[:-1] + ["full_attention"]


def _gemma4_full_shape(cfg: Mapping[str, Any], source: str, types: list[str], head_dim: int, kv_heads: int,
                       k_eq_v: bool) -> tuple[int, int]:
    """The full layers' (head_dim, KV heads). transformers 5.x writes ``per_layer_config`` (``{"<layer>":
    {"head_dim": .., "num_key_value_heads": ..}}``); without it the layer reads ``global_head_dim`` (default
    512, not ``head_dim``) and, only with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        dim = int_field(cfg, "global_head_dim", source, 512)
        kv = int_field(cfg, "num_global_key_value_heads", source, None) if k_eq_v else None
        return dim, kv or kv_heads
    if not isinstance(per_layer, Mapping):
        raise ConfigError(f"{source}: field 'per_layer_config' must be an object, got {per_layer!r}")
    shapes = {}
    for key, value in per_layer.items():
        where = f"{source} (per_layer_config[{key!r}])"
        if not str(key).isdigit() or int(key) >= len(types) or not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a layer index in 0..{len(types) - 1} and an object")
        if set(value) - {"head_dim", "num_key_value_heads"}:
            raise ConfigError(f"{where}: only 'head_dim' and 'num_key_value_heads' may differ per layer, got "
                              f"{sorted(value)}")
        shapes[int(key)] = (int_field(value, "head_dim", where, head_dim),
                            int_field(value, "num_key_value_heads", where, kv_heads))
    of = {t: {shapes.get(i, (head_dim, kv_heads)) for i, u in enumerate(types) if u == t} for t in set(types)}
    if len(of["full_attention"]) != 1 or of.get("sliding_attention", {(head_dim, kv_heads)}) != {(head_dim, kv_heads)}:
        raise ConfigError(f"{source}: field 'per_layer_config' must give every full_attention layer the same "
                          f"head_dim and num_key_value_heads and leave the sliding ones at the top-level values; "
                          f"got {dict(per_layer)!r}")
    return next(iter(of["full_attention"]))


def _gemma4_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Gemma 4's text decoder (``gemma4_text``: 31B dense, 26B-A4B MoE; ``gemma4_unified_text``: 12B), from the
    Qwen3 decoder: embeddings times sqrt(H); four RMSNorms per layer (``w * x``, the weight applied in
    float32) and a stored ``layer_scalar``; sliding (``head_dim``, default RoPE) and full layers (their own
    head size and KV heads, proportional RoPE, with ``attention_k_eq_v`` V from the raw k_proj); a
    weightless V norm, softmax scale 1; GeGLU; optional final logit soft-capping; with ``enable_moe_block``
    (gemma4_text) an expert block beside the dense MLP of every layer. Per-layer embeddings and KV sharing
    (the E-series) are refused."""
    unified = cfg["model_type"] == "gemma4_unified_text"
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):  # "vision" changes image tokens only
        raise ConfigError(f"{source}: use_bidirectional_attention={cfg['use_bidirectional_attention']!r} is not "
                          "supported (a target decodes causally; null or 'vision' only)")
    ple = 0 if unified else int_field(cfg, "hidden_size_per_layer_input", source, 256, minimum=0)
    if ple:
        raise ConfigError(f"{source}: field 'hidden_size_per_layer_input' is {ple} (per-layer embeddings, PLE; "
                          "transformers' default when the field is absent is 256): not implemented, only 0")
    shared = int_field(cfg, "num_kv_shared_layers", source, 0, minimum=0)
    if shared:
        raise ConfigError(f"{source}: field 'num_kv_shared_layers' is {shared} (layers reusing an earlier "
                          "layer's keys and values): not implemented, only 0")
    if not _present(cfg, "head_dim"):  # transformers' class default, not hidden_size / num_attention_heads
        raise ConfigError(f"{source}: a {cfg['model_type']} config needs 'head_dim' (transformers defaults it "
                          "to 256, not to hidden_size / num_attention_heads)")
    _, heads, kv_heads, head_dim = attention_shape(cfg, source)
    types = _gemma4_layer_types(cfg, source, num_layers)
    k_eq_v = bool_field(cfg, "attention_k_eq_v", source, False)
    global_dim, global_kv = _gemma4_full_shape(cfg, source, types, head_dim, kv_heads, k_eq_v)
    if global_dim % 2 or heads % global_kv:
        raise ConfigError(f"{source}: the full layers' head_dim ({global_dim}) must be even and their KV heads "
                          f"({global_kv}) must divide num_attention_heads ({heads})")
    params = cfg.get("rope_parameters") or GEMMA4_ROPE
    ropes = {}
    for kind in ("sliding_attention", "full_attention"):
        if not isinstance(params, Mapping) or not isinstance(params.get(kind), Mapping):
            raise ConfigError(f"{source}: field 'rope_parameters' must hold a {kind!r} object, got {params!r}")
        ropes[kind] = parse_rope({"rope_parameters": params[kind]}, f"{source} (rope_parameters.{kind})")
    window = int_field(cfg, "sliding_window", source, 1024 if unified else 512)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    eps = float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True, below=1.0)
    out: dict[str, Any] = dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", source, True),
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, norm_weight_in_float32=True,
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        rope=ropes["sliding_attention"], global_rope=ropes["full_attention"],
        global_head_dim=global_dim, global_kv_heads=global_kv, attention_k_eq_v=k_eq_v, v_norm=True,
        attention_scale=1.0, hidden_act="gelu_tanh", scale_embeddings=True, sandwich_norms=True, layer_scalar=True,
        final_logit_softcapping=float_field(cfg, "final_logit_softcapping", source, None, positive=True),
    )
    if not unified and bool_field(cfg, "enable_moe_block", source, False):
        num_experts = int_field(cfg, "num_experts", source)
        out.update(experts=ExpertsConfig(
            num_experts=num_experts, top_k=int_field(cfg, "top_k_experts", source, maximum=num_experts),
            intermediate_size=require(cfg, "moe_intermediate_size", source), routing="softmax_topk",
            norm_topk_prob=True, router_norm_eps=eps, activation="gelu_tanh"),
            expert_layers=tuple(range(num_layers)), experts_beside_mlp=True)
    return out


def _rope_parameters(rope: RopeConfig) -> dict[str, Any]:
    """One RoPE in transformers 5.x's ``rope_parameters`` form."""
    return {"rope_type": rope.rope_type, "rope_theta": rope.theta, **(rope_to_hf(rope)["rope_scaling"] or {})}


def _gemma4_to_hf(config: "TargetConfig") -> dict[str, Any]:
    """The Gemma 4 fields of ``TargetConfig.to_hf_dict`` (a ``Gemma4TextConfig`` / ``Gemma4UnifiedTextConfig``)."""
    e = config.experts
    out = dict(
        hidden_activation="gelu_pytorch_tanh", num_kv_shared_layers=0,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in config.layer_windows],
        sliding_window=next((w for w in config.layer_windows if w is not None), None),
        rope_parameters={"sliding_attention": _rope_parameters(config.rope),
                         "full_attention": _rope_parameters(config.global_rope)},
        global_head_dim=config.global_head_dim, attention_k_eq_v=config.attention_k_eq_v,
        final_logit_softcapping=config.final_logit_softcapping)
    if config.attention_k_eq_v:
        out["num_global_key_value_heads"] = config.global_kv_heads
    if config.model_type == "gemma4_text":
        out.update(hidden_size_per_layer_input=0, enable_moe_block=e is not None)
    if e is not None:
        out.update(num_experts=e.num_experts, top_k_experts=e.top_k, moe_intermediate_size=e.intermediate_size)
    return out


# Muse Glimmer's text decoder (Muse-Glimmer-30B; transformers' ``MuseGlimmerTextConfig``).
MUSE_GLIMMER_TEXT = "muse_glimmer_text"
# The vision tower written into an exported ``muse_glimmer`` config.json: transformers has no text-only LM class
# for the family, so an export is a ``MuseGlimmerForConditionalGeneration`` whose (absent) vision weights it
# initialises; the smallest tower keeps that cheap. Text generation never reads it.
MUSE_GLIMMER_EXPORT_VISION = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                              "num_attention_heads": 1, "pos_emb_height": 2, "pos_emb_width": 2}


def _muse_glimmer_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Muse Glimmer's text decoder, from the Qwen3 decoder: a weightless RMSNorm after the embedding lookup (no
    sqrt(H)); Gemma's four-norm sandwich in (1 + w) form, the post norms with their own ``post_norm_eps``; a
    final norm in ``w`` form; one weightless q/k RMSNorm per head, q then times ``qk_scale_factor``; the output
    gated by sigmoid(gate_proj(x)); sliding layers (window ``sliding_window``) and full layers as
    ``layer_types`` says (default: every 4th counted back from the last is full); no RoPE where
    ``layer_rope_theta`` is 0 (default: the full layers; a non-zero entry is only a flag: those layers use the
    global theta, as transformers does); SwiGLU; logits times ``output_multiplier``, then soft-capped."""
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "silu"))
    if act != "silu":
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (only 'silu')")
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: full iff (L - 1 - i) % 4 == 0, the last layer full
        types = ["full_attention" if (num_layers - 1 - i) % 4 == 0 else "sliding_attention"
                 for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"sliding_attention",
                                                                                  "full_attention"}:
        raise ConfigError(f"{source}: field 'layer_types' must list 'sliding_attention' or 'full_attention' for "
                          f"each of the {num_layers} layers, got {types!r}")
    window = int_field(cfg, "sliding_window", source, 2048)
    thetas = cfg.get("layer_rope_theta")
    if thetas is None:
        nope = tuple(i for i in range(num_layers) if (num_layers - 1 - i) % 4 == 0)
    elif (not isinstance(thetas, list) or len(thetas) != num_layers
          or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in thetas)):
        raise ConfigError(f"{source}: field 'layer_rope_theta' must list a number >= 0 (0: no RoPE) for each of "
                          f"the {num_layers} layers, got {thetas!r}")
    else:
        nope = tuple(i for i, v in enumerate(thetas) if v == 0)
    cap = float_field(cfg, "final_logit_softcapping", source, 20.0, positive=True)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    eps = float_field(cfg, "rms_norm_eps", source, 1e-5, positive=True, below=1.0)
    return dict(
        intermediate_size=require(cfg, "intermediate_size", source),
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", source, False),
        rms_norm_eps=eps,
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, qk_norm_weight=False,
        query_scale=float_field(cfg, "qk_scale_factor", source, 3.87, positive=True),
        attention_gate_proj=True, embed_norm=True, sandwich_norms=True, zero_centered_norms=True,
        final_norm_plain=True, norm_weight_in_float32=True,
        post_norm_eps=float_field(cfg, "post_norm_eps", source, 1e-8, positive=True, below=1.0),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types), nope_layers=nope,
        final_logit_softcapping=cap,
        output_multiplier=float_field(cfg, "output_multiplier", source, 0.19611613513818404, positive=True),
    )


def _muse_glimmer_to_hf(config: "TargetConfig", text: dict[str, Any]) -> dict[str, Any]:
    """``TargetConfig.to_hf_dict`` of a Muse Glimmer target: a ``muse_glimmer`` config.json whose
    ``text_config`` holds the language model (``MUSE_GLIMMER_EXPORT_VISION``: why a vision tower is named)."""
    text = {k: v for k, v in text.items() if k not in ("architectures", "hidden_act")}
    text.update(
        hidden_activation="silu",
        layer_types=["full_attention" if w is None else "sliding_attention" for w in config.layer_windows],
        sliding_window=next((w for w in config.layer_windows if w is not None), None),
        layer_rope_theta=[0 if i in config.nope_layers else config.rope.theta
                          for i in range(config.num_hidden_layers)],
        rope_parameters=_rope_parameters(config.rope), qk_scale_factor=config.query_scale,
        post_norm_eps=config.post_norm_eps, output_multiplier=config.output_multiplier,
        final_logit_softcapping=config.final_logit_softcapping)
    return {"architectures": ["MuseGlimmerForConditionalGeneration"], "model_type": "muse_glimmer",
            "text_config": text, "vision_config": dict(MUSE_GLIMMER_EXPORT_VISION),
            "out_hidden_size": 4 * MUSE_GLIMMER_EXPORT_VISION["hidden_size"],  # after its 2 x 2 patch merge
            "projector_hidden_size": MUSE_GLIMMER_EXPORT_VISION["hidden_size"]}


# Multi-head latent attention families: DeepSeek-V3 and Kimi K2 / K2.5-K2.7's text decoder (``kimi_k2``, which
# transformers reads as a DeepseekV3Config).
MLA_FAMILIES = ("deepseek_v3", "kimi_k2", "glm_moe_dsa")
# Fields of DeepSeek's own config.json that transformers does not read (it hard-codes what they describe):
# a value other than the one computed here is refused, not ignored.
DEEPSEEK_V3_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def _mla_head_dims(cfg: Mapping[str, Any], source: str) -> tuple[int, int]:
    """``qk_nope_head_dim, qk_rope_head_dim`` (transformers' defaults 128 and 64)."""
    return (int_field(cfg, "qk_nope_head_dim", source, 128),
            int_field(cfg, "qk_rope_head_dim", source, 64))


def _mla_attention_fields(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """An MLA config with the generic attention fields as the decoder reads them. transformers derives
    ``head_dim`` from ``qk_rope_head_dim`` (the RoPE size) and uses ``num_key_value_heads`` only to repeat the
    expanded keys, one per query head already (its sdpa path ignores it; 5.x writes the class default, 128, for
    any head count): neither is read. Here: one key head per query head, of the query-key size."""
    if cfg.get("model_type") == "glm_moe_dsa":  # its own class defaults, before anything reads them
        cfg = {**GLM_MOE_DSA_DEFAULTS, **cfg}
    nope, rope = _mla_head_dims(cfg, source)
    if rope % 2 or nope % 2:
        raise ConfigError(f"{source}: fields 'qk_nope_head_dim' ({nope}) and 'qk_rope_head_dim' ({rope}) must be "
                          "even (RoPE turns pairs; the head sizes of every released model are)")
    heads = require(cfg, "num_attention_heads", source)
    return {**cfg, "num_key_value_heads": heads, "head_dim": nope + rope}


def _deepseek_v3_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """DeepSeek-V3 and Kimi K2's text decoder (transformers' DeepseekV3): multi-head latent attention on every
    layer (``MLAConfig``, SPEC 11.4), dense SwiGLU layers first (``first_k_dense_replace``), then experts chosen
    by sigmoid scores plus a selection-only correction bias within the best ``topk_group`` of ``n_group`` groups,
    weighted by their renormalised scores times ``routed_scaling_factor``, plus ungated shared experts. The
    multi-token-prediction layer (``model.layers.{num_hidden_layers}``) is not part of the decoder."""
    _check_silu(cfg, source)
    for key, value in DEEPSEEK_V3_FIXED.items():
        if _present(cfg, key) and cfg[key] != value:
            raise ConfigError(f"{source}: field {key!r} is {cfg[key]!r}, but transformers' DeepseekV3 (what this "
                              f"implementation computes) always has {value!r}")
    for key in ("n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace"):
        if key in cfg and cfg[key] is None:  # transformers would fail on these, not default them
            raise ConfigError(f"{source}: field {key!r} must be an integer, got null")
    nope, rope_dim = _mla_head_dims(cfg, source)
    rope = parse_rope(cfg, source)
    if rope.rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: rope type {rope.rope_type!r} is not supported for multi-head latent attention "
                          "(only 'default' and 'yarn')")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    for where in (cfg, params):
        if _present(where, "partial_rotary_factor") and where["partial_rotary_factor"] != 1:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' is {where['partial_rotary_factor']!r}; "
                              "multi-head latent attention rotates all of qk_rope_head_dim (only 1)")
    scale = (nope + rope_dim) ** -0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:  # transformers' yarn_apply_mscale, in the same order
        mscale = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    q_lora = 0 if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None else int_field(cfg, "q_lora_rank", source, 1536)
    attention_bias = bool_field(cfg, "attention_bias", source, False)
    mla = MLAConfig(q_lora_rank=q_lora, kv_lora_rank=int_field(cfg, "kv_lora_rank", source, 512),
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                    v_head_dim=int_field(cfg, "v_head_dim", source, 128),
                    rope_interleave=bool_field(cfg, "rope_interleave", source, True), softmax_scale=scale,
                    attention_bias=attention_bias)

    key = "n_routed_experts" if _present(cfg, "n_routed_experts") or not _present(cfg, "num_local_experts") \
        else "num_local_experts"  # transformers' attribute_map: num_local_experts is n_routed_experts
    num_experts = int_field(cfg, key, source, 256)
    top_k = int_field(cfg, "num_experts_per_tok", source, 8, maximum=num_experts)
    n_group = int_field(cfg, "n_group", source, 8, maximum=num_experts)
    topk_group = int_field(cfg, "topk_group", source, 4, maximum=n_group)
    per_group = num_experts // n_group
    if num_experts % n_group or per_group < 2:
        raise ConfigError(f"{source}: n_routed_experts ({num_experts}) must split into n_group ({n_group}) equal "
                          "groups of at least 2 experts (a group scores the sum of its two best experts)")
    if topk_group * per_group < top_k:
        raise ConfigError(f"{source}: topk_group ({topk_group}) groups of {per_group} experts cannot hold "
                          f"num_experts_per_tok ({top_k}) experts")
    first_dense = int_field(cfg, "first_k_dense_replace", source, 3, minimum=0, maximum=num_layers)
    width = int_field(cfg, "moe_intermediate_size", source, 2048)
    shared = int_field(cfg, "n_shared_experts", source, 1, minimum=0)
    return dict(
        intermediate_size=int_field(cfg, "intermediate_size", source, 18432),
        rope=rope, mla=mla, qkv_bias=False, o_bias=attention_bias,
        experts=ExpertsConfig(
            num_experts=num_experts, top_k=top_k, intermediate_size=width, routing="sigmoid_topk",
            norm_topk_prob=bool_field(cfg, "norm_topk_prob", source, True), selection_bias=True,
            shared_intermediate_size=width * shared, shared_expert_gate=False, n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float_field(cfg, "routed_scaling_factor", source, 2.5, positive=True),
            norm_eps=1e-20),
        expert_layers=tuple(range(first_dense, num_layers)),
    )


# GLM-5 / GLM-5.1 (``glm_moe_dsa``, SPEC 11.5): transformers' GlmMoeDsaConfig defaults where they differ from
# DeepSeek-V3's (a config.json that leaves a field out gets these).
GLM_MOE_DSA_DEFAULTS = dict(q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                            v_head_dim=256, intermediate_size=12288, moe_intermediate_size=2048, n_group=1,
                            topk_group=1, rms_norm_eps=1e-5, index_topk=2048, index_head_dim=128, index_n_heads=32)


def _glm_moe_dsa_family(cfg: Mapping[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """GLM-5 / GLM-5.1: DeepSeek-V3's decoder (MLA, its router with ``n_group = topk_group = 1`` by default, shared
    experts, dense first layers) with three differences: the low-rank query path always (transformers has no
    ``q_proj`` form: its indexer reads the query residual), RoPE always interleaved (no flag), the dense/sparse
    plan from ``mlp_layer_types`` when given; plus DeepSeek's sparse-attention indexer (``models/dsa_indexer``)."""
    from dflash_jax.models.dsa_indexer import DSAConfig, indexer_layer_types

    if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
        raise ConfigError(f"{source}: field 'q_lora_rank' is null, but GLM-MoE-DSA always uses the low-rank query "
                          "path (its indexer reads the query residual)")
    out = _deepseek_v3_family({**cfg, "rope_interleave": True}, source, num_layers)
    if cfg.get("mlp_layer_types") is not None:
        types = cfg["mlp_layer_types"]
        if not isinstance(types, (list, tuple)) or len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise ConfigError(f"{source}: field 'mlp_layer_types' must give 'dense' or 'sparse' for each of the "
                              f"{num_layers} layers, got {types!r}")
        out["expert_layers"] = tuple(i for i, kind in enumerate(types) if kind == "sparse")
    rope_dim = out["mla"].qk_rope_head_dim
    heads = int_field(cfg, "index_n_heads", source, 32)
    dim = int_field(cfg, "index_head_dim", source, 128)
    if dim < rope_dim or dim % 2:
        raise ConfigError(f"{source}: field 'index_head_dim' ({dim}) must be even and at least qk_rope_head_dim "
                          f"({rope_dim}): the indexer rotates its first qk_rope_head_dim dims")
    out["dsa"] = DSAConfig(index_topk=int_field(cfg, "index_topk", source, 2048), index_n_heads=heads,
                           index_head_dim=dim, rope_dim=rope_dim,
                           layer_types=indexer_layer_types(cfg, num_layers, source))
    return out


def _glm_moe_dsa_to_hf(config: "TargetConfig", out: dict[str, Any]) -> dict[str, Any]:
    """A ``GlmMoeDsaForCausalLM`` config.json: DeepSeek-V3's fields, then GLM's own."""
    d = config.dsa
    for key in ("rope_interleave", "num_nextn_predict_layers"):  # not GLM fields
        out.pop(key, None)
    out.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", index_topk=d.index_topk,
               index_n_heads=d.index_n_heads, index_head_dim=d.index_head_dim, indexer_types=list(d.layer_types),
               mlp_layer_types=["sparse" if config.is_expert_layer(i) else "dense"
                                for i in range(config.num_hidden_layers)])
    return out


def _deepseek_v3_to_hf(config: "TargetConfig", out: dict[str, Any]) -> dict[str, Any]:
    """``TargetConfig.to_hf_dict`` of an MLA target: a ``DeepseekV3ForCausalLM`` config.json (Kimi K2's text
    decoder too: transformers has no text-only Kimi class, its language model is a DeepseekV3 model)."""
    m, e = config.mla, config.experts
    out = {k: v for k, v in out.items() if k != "head_dim"}  # transformers sets it to qk_rope_head_dim
    out.update(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=m.attention_bias,
        q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave,
        n_routed_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.intermediate_size,
        n_shared_experts=e.shared_intermediate_size // e.intermediate_size, n_group=e.n_group,
        topk_group=e.topk_group, norm_topk_prob=e.norm_topk_prob, routed_scaling_factor=e.routed_scaling_factor,
        first_k_dense_replace=min(config.expert_layers, default=config.num_hidden_layers),
        num_nextn_predict_layers=0)
    out.update(rope_to_hf(config.rope))
    return out


# Multimodal checkpoints whose language model is nested under ``text_config`` (the model_type it takes).
NESTED_TEXT_CONFIGS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text",
                       "gemma4_unified": "gemma4_unified_text", "muse_glimmer": MUSE_GLIMMER_TEXT,
                       "kimi_k25": "kimi_k2"}


def _quantization_scheme(cfg: Mapping[str, Any], source: str, model_type: str) -> Any:
    """The weight quantisation a config.json declares (its own ``quantization_config`` or its text config's), as
    ``checkpoints/quantized`` parses it; None for float weights. An unsupported method or a bad field is an
    ``UnsupportedScheme`` holding the error that names the file and the field: a config alone describes the
    model's shapes (plans, layouts) without the weights, which are what cannot be read."""
    from dflash_jax.checkpoints import quantized  # numpy only; imported here to keep models free of checkpoints

    if not isinstance(cfg, Mapping):
        return None
    q = quantized.quantization_config_of(cfg)
    if q is None:
        return None
    try:
        return quantized.parse_scheme(q, source, model_type)
    except quantized.QuantizationError as err:  # raised when the weights are read or kept packed
        return quantized.UnsupportedScheme(str(err))


def _text_config(cfg: Mapping[str, Any], source: str) -> tuple[Mapping[str, Any], str]:
    """The language model's config of a multimodal checkpoint (Qwen3.5's and Gemma 4's ``text_config``; the
    vision and audio towers' settings are not needed: their weights are skipped at load), else ``cfg`` itself."""
    model_type = cfg.get("model_type")
    if model_type not in NESTED_TEXT_CONFIGS:
        return cfg, source
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"{source}: a {model_type!r} config needs a 'text_config' object (the language model); "
                          "got " + ("none: a vision-only directory?" if text is None else repr(text)))
    merged = dict(text)
    merged["model_type"] = text.get("model_type") or NESTED_TEXT_CONFIGS[model_type]
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # sometimes given at the top only
        if key not in merged and key in cfg:
            merged[key] = cfg[key]
    if model_type == "kimi_k25":
        # Its text_config says kimi_k2 (released) or deepseek_v3 (transformers 5.x writes what it maps it to).
        if merged["model_type"] not in MLA_FAMILIES:
            raise ConfigError(f"{source} (text_config): model_type {merged['model_type']!r} is not a Kimi text "
                              f"decoder (expected 'kimi_k2' or 'deepseek_v3')")
        merged["model_type"] = "kimi_k2"
        # transformers ties the head by the TOP-LEVEL flag, whose class default is True, whatever text_config
        # says (5.x writes False there); released configs set it at the top level.
        merged["tie_word_embeddings"] = bool_field(cfg, "tie_word_embeddings", source, True)
    return merged, f"{source} (text_config)"


FAMILIES = {
    "llama": _dense_family, "mistral": _dense_family, "qwen2": _dense_family, "qwen3": _dense_family,
    "qwen3_moe": _qwen3_moe_family, "gpt_oss": _gpt_oss_family,
    "qwen3_next": _hybrid_family, "qwen3_5_text": _hybrid_family, "qwen3_5_moe_text": _hybrid_family,
    "minimax_m2": _minimax_m2_family, "gemma4_text": _gemma4_family, "gemma4_unified_text": _gemma4_family,
    MUSE_GLIMMER_TEXT: _muse_glimmer_family, "deepseek_v3": _deepseek_v3_family, "kimi_k2": _deepseek_v3_family,
    "glm_moe_dsa": _glm_moe_dsa_family,
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "minimax_m2": "MiniMaxM2ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                 "gemma4_unified_text": "Gemma4UnifiedForCausalLM",
                 MUSE_GLIMMER_TEXT: "MuseGlimmerForConditionalGeneration", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "kimi_k2": "DeepseekV3ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
