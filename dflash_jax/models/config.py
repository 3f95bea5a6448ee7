"""Target model configuration, parsed from a Hugging Face ``config.json``.

One decoder implementation covers LLaMA-2/3.x, Qwen2/2.5 and Qwen3; the differences are the flags of
:class:`TargetConfig`. Anything this implementation does not compute exactly is refused with an error that
names the file and the field, because a silently different model would break losslessness downstream.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
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


def parse_rope(cfg: Mapping[str, Any], source: str = "config") -> RopeConfig:
    """Read RoPE settings from either the 4.x layout (top-level ``rope_theta``/``rope_scaling``) or the 5.x
    layout (``rope_parameters``), since released checkpoints and freshly saved ones differ."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
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
    theta = float(merged.get("rope_theta", 10000.0))
    if theta <= 0:
        raise ConfigError(f"{source}: rope_theta must be positive, got {theta}")
    kw: dict[str, Any] = {"theta": theta, "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        if "factor" not in merged:
            raise ConfigError(f"{source}: rope type {rope_type!r} needs a 'factor'")
        kw["factor"] = float(merged["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise ConfigError(f"{source}: rope type 'llama3' needs {key!r}")
        kw["low_freq_factor"] = float(merged["low_freq_factor"])
        kw["high_freq_factor"] = float(merged["high_freq_factor"])
        kw["original_max_position_embeddings"] = int(merged["original_max_position_embeddings"])
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
    return out


def read_json_object(path: str | Path, what: str = "file", error: type[Exception] = ConfigError) -> dict:
    """A JSON file that must hold an object; errors name the file and say what was expected."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: {what} not found")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object in the {what}")
    return value


def read_config_json(path: str | Path, what: str) -> tuple[Path, dict]:
    """``config.json`` of a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return path, read_json_object(path, f"{what} file")


def require(cfg: Mapping[str, Any], key: str, source: str, kind: type = int) -> Any:
    """Fetch a mandatory field, checking presence and type, with a message naming source and key."""
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: missing required field {key!r}")
    value = cfg[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{source}: field {key!r} must be an integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: field {key!r} must be a number, got {value!r}")
    if kind is int and value <= 0:
        raise ConfigError(f"{source}: field {key!r} must be positive, got {value}")
    return kind(value)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Everything the target decoder needs; hashable so it can be a static argument of ``jax.jit``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config") -> "TargetConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported for target models")
        if model_type == "mistral" and cfg.get("sliding_window") is not None:
            # Mistral applies its window whenever the field is set (Qwen gate it behind use_sliding_window).
            raise ConfigError(f"{source}: Mistral sliding_window={cfg['sliding_window']} is not supported "
                              "(set it to null only if the model was trained without a window)")
        if int(cfg.get("pretraining_tp", 1) or 1) != 1:
            raise ConfigError(f"{source}: pretraining_tp != 1 is not supported")
        hidden = require(cfg, "hidden_size", source)
        heads = require(cfg, "num_attention_heads", source)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"{source}: hidden_size ({hidden}) not divisible by num_attention_heads ({heads})")
            head_dim = hidden // heads
        if int(head_dim) % 2:
            raise ConfigError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=require(cfg, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=require(cfg, "intermediate_size", source),
            num_hidden_layers=require(cfg, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(cfg, source),
            max_position_embeddings=require(cfg, "max_position_embeddings", source)
            if "max_position_embeddings" in cfg else 4096,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o bias; LLaMA/Qwen3 use attention_bias for all four.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "TargetConfig":
        path, cfg = read_config_json(path, "config")
        return cls.from_dict(cfg, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict for this model (4.x rope layout, readable by 4.x and 5.x)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM"}[self.model_type]
        out: dict[str, Any] = {
            "architectures": [arch],
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
        if self.model_type != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        out.update(rope_to_hf(self.rope))
        return out
