"""Readers and writers that several families share: the activation and window checks, the experts' counts and
schedule, partial RoPE, and the sliding/full layer plan. A family module keeps only what is its own."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.models.config_fields import ConfigError, TargetFields, bool_field, float_field, int_field, present

SLIDING, FULL = "sliding_attention", "full_attention"


def check_silu(cfg: Mapping[str, Any], source: str) -> None:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")


def no_sliding_window(cfg: Mapping[str, Any], source: str) -> None:
    if bool_field(cfg, "use_sliding_window", source, False):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported for target models")


def num_experts(cfg: Mapping[str, Any], source: str) -> int:
    # transformers 5.x writes ``num_local_experts``; released Qwen3-MoE checkpoints say ``num_experts``.
    key = "num_experts" if present(cfg, "num_experts") else "num_local_experts"
    return int_field(cfg, key, source)


def top_k(cfg: Mapping[str, Any], source: str, experts: int) -> int:
    return int_field(cfg, "num_experts_per_tok", source, maximum=experts)


def sparse_layers(cfg: Mapping[str, Any], source: str, num_layers: int) -> tuple[int, ...]:
    """Layer i routes through experts iff it is not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0`` (Qwen3-MoE, Qwen3-Next)."""
    step = int_field(cfg, "decoder_sparse_step", source, 1)
    dense_only = cfg.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense_only):
        raise ConfigError(f"{source}: field 'mlp_only_layers' must be a list of layer indices in "
                          f"0..{num_layers - 1}, got {dense_only!r}")
    return tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def dense_only_layers(config: TargetFields) -> list[int]:
    """``mlp_only_layers`` of an export (with ``decoder_sparse_step`` 1): the layers without experts."""
    return [i for i in range(config.num_hidden_layers) if i not in config.expert_layers]


def rope_parameters_of(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The 5.x ``rope_parameters`` object, or an empty one (absent, or Gemma 4's per-layer-kind form)."""
    params = cfg.get("rope_parameters")
    return params if isinstance(params, Mapping) else {}


def partial_rotary_dim(cfg: Mapping[str, Any], source: str, head_dim: int) -> int:
    """The rotated dims per head: ``partial_rotary_factor`` (in ``rope_parameters`` or top level) x head_dim."""
    params = rope_parameters_of(cfg)
    where = source if "partial_rotary_factor" not in params else f"{source} (rope_parameters)"
    factor = float_field(params if "partial_rotary_factor" in params else cfg, "partial_rotary_factor", where,
                         1.0, positive=True)
    dim = int(head_dim * factor)
    if factor > 1 or dim < 2 or dim % 2:
        raise ConfigError(f"{where}: partial_rotary_factor {factor} gives {dim} rotary dims of head_dim "
                          f"{head_dim}; it must give an even number between 2 and head_dim")
    return dim


def partial_rope_to_hf(config: TargetFields, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the 5.x ``rope_parameters`` that carry a partial rotary factor (transformers reads the factor
    there), where only a part of each head rotates."""
    if config.rotary_dim:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope.theta,
                                  "partial_rotary_factor": config.rotary_dims / config.head_dim}
    return out


def sliding_layer_types(cfg: Mapping[str, Any], source: str, num_layers: int, default: list[str]) -> list[str]:
    """``layer_types`` of a model whose layers attend through a window (``sliding_attention``) or to the whole
    prefix (``full_attention``); absent: ``default``, the family's own schedule."""
    types = default if cfg.get("layer_types") is None else cfg["layer_types"]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ConfigError(f"{source}: field 'layer_types' must list 'sliding_attention' or 'full_attention' for "
                          f"each of the {num_layers} layers, got {types!r}")
    return types


def windows(types: list[str], window: int | None) -> tuple[int | None, ...]:
    """``TargetFields.layer_windows`` of a sliding/full plan: ``window`` on the sliding layers, None on the full."""
    return tuple(window if t == SLIDING else None for t in types)


def windows_to_hf(config: TargetFields) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` of an export, from ``layer_windows`` (one window per model)."""
    return dict(layer_types=[FULL if w is None else SLIDING for w in config.layer_windows],
                sliding_window=next((w for w in config.layer_windows if w is not None), None))
