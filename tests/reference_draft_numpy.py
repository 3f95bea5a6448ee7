"""Plain NumPy reference of ONE DFlash draft forward (test oracle).

Written only from ``SPEC.md`` sections 2, 3, 4 and 7, independently of the ``dflash_jax`` library: it imports
nothing but NumPy and the standard library. It is deliberately slow and literal (explicit Python loops over
heads, queries and keys) and computes everything in float64, so a float32 JAX implementation can be compared
against it at about 1e-5.

Public functions
----------------
``draft_forward_reference(weights, config, embed, head, context_features, block_tokens, start,
context_positions=None) -> np.ndarray``  logits ``[B, V]`` (float64) for every block position.

``default_target_layer_ids(num_target_layers, num_draft_layers) -> list[int]``  SPEC section 2's default.

``random_official_draft_weights(config, num_target_features, rng, dtype=np.float32) -> dict[str, np.ndarray]``
a full random draft state dict in the official checkpoint layout of SPEC section 7.

Conventions fixed here (where the SPEC leaves room)
---------------------------------------------------
* Causality and windows, per layer (SPEC sections 2 and 4, the newest official code): a top-level
  ``is_causal`` makes every layer causal (true) or bidirectional (false) inside the block; without it
  ``sliding_attention`` layers are causal and ``full_attention`` layers bidirectional. A query at absolute
  position ``p`` sees a key at absolute position ``k`` iff (not causal or ``k <= p``) and, on a sliding layer,
  ``p - k < sliding_window`` and (causal or ``k - p < sliding_window``). A missing / ``None``
  ``sliding_window``, or ``use_sliding_window`` not true (transformers' default false), means no limit. A
  missing ``layer_types`` means every layer is ``full_attention``.
* RoPE: ``inv_freq[i] = theta ** (-2i / head_dim)`` for ``i < head_dim / 2``; angles ``pos * inv_freq`` are
  duplicated to ``head_dim`` (``cat(freqs, freqs)``), ``x' = x * cos + rotate_half(x) * sin`` with
  ``rotate_half(x) = cat(-x[d/2:], x[:d/2])``. ``rope_theta`` is read from the top level, else from
  ``rope_parameters``. The scaling dict is ``rope_scaling`` if present (not None) else ``rope_parameters``;
  its type is ``rope_type`` (else legacy ``type``); ``None`` / ``"default"`` mean unscaled, ``"llama3"`` applies
  Hugging Face's ``_compute_llama3_parameters`` (attention factor 1). Any other type raises.
* Optional scalars ``input_embedding_scale`` / ``output_multiplier`` / ``final_logit_softcapping`` are looked up
  in ``dflash_config`` first, then at the top level (same rule SPEC section 2 gives for DFlash fields);
  defaults 1.0, 1.0, none. A softcap of ``None`` or ``0`` means no softcapping.
* ``head_dim`` defaults to ``hidden_size // num_attention_heads`` when absent; ``num_key_value_heads`` defaults
  to ``num_attention_heads``.
* Biases: any ``<linear>.bias`` key present in ``weights`` is used (q/k/v/o when ``attention_bias``), whether or
  not the config flag is set.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "draft_forward_reference",
    "default_target_layer_ids",
    "random_official_draft_weights",
]


# --------------------------------------------------------------------------------------------------------------
# Config helpers
# --------------------------------------------------------------------------------------------------------------


def _cfg_get(config: dict, key: str, default=None):
    """DFlash-style lookup: ``dflash_config`` first, then the top level."""
    nested = config.get("dflash_config") or {}
    if key in nested and nested[key] is not None:
        return nested[key]
    if key in config and config[key] is not None:
        return config[key]
    return default


def _head_dim(config: dict) -> int:
    hd = config.get("head_dim")
    if hd is None:
        hd = config["hidden_size"] // config["num_attention_heads"]
    return int(hd)


def _num_kv_heads(config: dict) -> int:
    kv = config.get("num_key_value_heads")
    return int(config["num_attention_heads"] if kv is None else kv)


def _num_layers(config: dict, weights: dict | None = None) -> int:
    n = config.get("num_hidden_layers")
    if n is not None:
        return int(n)
    if config.get("layer_types") is not None:
        return len(config["layer_types"])
    assert weights is not None, "cannot infer the number of draft layers"
    idx = {int(k.split(".")[1]) for k in weights if k.startswith("layers.")}
    return max(idx) + 1


def _layer_type(config: dict, i: int) -> str:
    types = config.get("layer_types")
    if types is None:
        return "full_attention"
    t = types[i]
    if t not in ("full_attention", "sliding_attention"):
        raise ValueError(f"unknown layer type {t!r} for layer {i}")
    return t


def _rope_inv_freq(config: dict) -> np.ndarray:
    """float64 ``[head_dim // 2]`` inverse frequencies, with llama3 scaling if configured."""
    d = _head_dim(config)
    rope_parameters = config.get("rope_parameters") or {}
    theta = config.get("rope_theta")
    if theta is None:
        theta = rope_parameters.get("rope_theta")
    if theta is None:
        theta = 10000.0
    theta = float(theta)

    scaling = config.get("rope_scaling")
    if scaling is None:
        scaling = rope_parameters if rope_parameters else None
    rope_type = None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))

    inv_freq = np.empty(d // 2, dtype=np.float64)
    for i in range(d // 2):
        inv_freq[i] = 1.0 / (theta ** ((2.0 * i) / d))

    if rope_type is None or rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}")

    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    out = np.empty_like(inv_freq)
    for i, f in enumerate(inv_freq):
        wavelen = 2.0 * math.pi / f
        if wavelen < high_freq_wavelen:  # high frequency: unchanged
            out[i] = f
        elif wavelen > low_freq_wavelen:  # low frequency: divided by factor
            out[i] = f / factor
        else:  # medium: smooth interpolation between the two
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out[i] = (1.0 - smooth) * f / factor + smooth * f
    return out


# --------------------------------------------------------------------------------------------------------------
# Elementary ops (float64)
# --------------------------------------------------------------------------------------------------------------


def _linear(x: np.ndarray, weights: dict, name: str) -> np.ndarray:
    """``y = x @ W.T (+ b)`` with ``W`` stored ``[out, in]``."""
    w = np.asarray(weights[name + ".weight"], dtype=np.float64)
    y = x @ w.T
    b = weights.get(name + ".bias")
    if b is not None:
        y = y + np.asarray(b, dtype=np.float64)
    return y


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``."""
    w = np.asarray(weight, dtype=np.float64)
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), written stably for both signs.
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = x[pos] / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = x[~pos] * ex / (1.0 + ex)
    return out


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """``x`` is ``[T, heads, head_dim]``; ``positions`` ``[T]`` absolute positions."""
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        freqs = float(positions[t]) * inv_freq  # [d/2]
        emb = np.concatenate([freqs, freqs])  # [d]
        cos, sin = np.cos(emb), np.sin(emb)
        for h in range(x.shape[1]):
            out[t, h] = x[t, h] * cos + _rotate_half(x[t, h]) * sin
    return out


# --------------------------------------------------------------------------------------------------------------
# The draft forward
# --------------------------------------------------------------------------------------------------------------


def draft_forward_reference(
    weights: dict[str, np.ndarray],
    config: dict,
    embed: np.ndarray,
    head: np.ndarray,
    context_features: np.ndarray,
    block_tokens: np.ndarray,
    start: int,
    context_positions: np.ndarray | None = None,
    return_hidden: bool = False,
) -> np.ndarray:
    """One DFlash draft forward for ONE sequence; returns float64 logits ``[B, V]`` for all block positions
    (and, with ``return_hidden``, the final-normed hidden states ``[B, H]`` the DFlash2 selector reads).

    Args:
      weights: official draft checkpoint dict (SPEC section 7), linear weights ``[out, in]``.
      config: the official draft ``config.json`` as a dict (SPEC section 2).
      embed: target embedding table ``[V, H]``.
      head: target output head ``[V, H]`` (``logits = x @ head.T``); the embedding for tied targets.
      context_features: ``[T_ctx, n*H]`` RAW concatenated target features (before ``fc`` / ``hidden_norm``).
      block_tokens: ``[B]`` ints ``[anchor, mask, ..., mask]``.
      start: absolute position of the anchor; the block occupies ``start .. start+B-1``.
      context_positions: optional ``[T_ctx]`` absolute positions of the context rows; default
        ``0 .. T_ctx-1`` (then ``T_ctx`` must equal ``start``). Every position must be ``< start``.

    Visibility per layer as in the module docstring (causal or bidirectional inside the block, windows on
    sliding layers). A shorter ``block_tokens`` is a shorter block (the official code's last rounds).

    Callers drop position 0 (the anchor); block position i >= 1 predicts the token at ``start + i``.
    """
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_kv = _num_kv_heads(config)
    d = _head_dim(config)
    eps = float(config.get("rms_norm_eps", 1e-6))
    if num_heads % num_kv != 0:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    group = num_heads // num_kv
    scale = d ** -0.5
    # transformers' Qwen3Config: no window at all unless use_sliding_window is true (its default is false).
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
    emb_scale = float(_cfg_get(config, "input_embedding_scale", 1.0))
    out_mult = float(_cfg_get(config, "output_multiplier", 1.0))
    softcap = _cfg_get(config, "final_logit_softcapping", None)
    num_layers = _num_layers(config, weights)
    inv_freq = _rope_inv_freq(config)
    dflash2 = _is_dflash2(config)

    ctx_raw = np.asarray(context_features, dtype=np.float64)
    if ctx_raw.ndim != 2:
        raise ValueError(f"context_features must be [T_ctx, n*H], got {ctx_raw.shape}")
    t_ctx = ctx_raw.shape[0]
    if context_positions is None:
        if t_ctx != start:
            raise ValueError(f"context has {t_ctx} rows at positions 0..{t_ctx - 1} but start={start}")
        ctx_pos = np.arange(t_ctx, dtype=np.int64)
    else:
        ctx_pos = np.asarray(context_positions, dtype=np.int64)
        if ctx_pos.shape != (t_ctx,):
            raise ValueError("context_positions must have one entry per context row")
        if t_ctx and ctx_pos.max() >= start:
            raise ValueError("context positions must all be < start")

    tokens = np.asarray(block_tokens, dtype=np.int64)
    B = tokens.shape[0]
    blk_pos = np.arange(start, start + B, dtype=np.int64)

    # SPEC 3.3: fused context feature, shared by every layer.
    ctx = _linear(ctx_raw, weights, "fc")
    ctx = _rms_norm(ctx, weights["hidden_norm.weight"], eps)
    assert ctx.shape == (t_ctx, hidden)

    # Block embedding from the TARGET's table.
    embed64 = np.asarray(embed, dtype=np.float64)
    x = embed64[tokens] * emb_scale  # [B, H]

    # All keys' positions: context first, then block.
    key_pos = np.concatenate([ctx_pos, blk_pos])
    n_keys = key_pos.shape[0]

    for li in range(num_layers):
        p = f"layers.{li}."
        sliding = _layer_type(config, li) == "sliding_attention" and window is not None
        causal = bool(config["is_causal"]) if config.get("is_causal") is not None else (
            _layer_type(config, li) == "sliding_attention")

        h = _rms_norm(x, weights[p + "input_layernorm.weight"], eps)
        if dflash2:  # SPEC section 10: the attention reads the convolved normed input
            h, attn_dynamic = _block_conv_first(h, weights, p + "attention_conv.", config)

        q = _linear(h, weights, p + "self_attn.q_proj").reshape(B, num_heads, d)
        q = _rms_norm(q, weights[p + "self_attn.q_norm.weight"], eps)

        k_ctx = _linear(ctx, weights, p + "self_attn.k_proj").reshape(t_ctx, num_kv, d)
        k_ctx = _rms_norm(k_ctx, weights[p + "self_attn.k_norm.weight"], eps)
        v_ctx = _linear(ctx, weights, p + "self_attn.v_proj").reshape(t_ctx, num_kv, d)

        k_blk = _linear(h, weights, p + "self_attn.k_proj").reshape(B, num_kv, d)
        k_blk = _rms_norm(k_blk, weights[p + "self_attn.k_norm.weight"], eps)
        v_blk = _linear(h, weights, p + "self_attn.v_proj").reshape(B, num_kv, d)

        q = _apply_rope(q, blk_pos, inv_freq)
        k_ctx = _apply_rope(k_ctx, ctx_pos, inv_freq)
        k_blk = _apply_rope(k_blk, blk_pos, inv_freq)

        keys = np.concatenate([k_ctx, k_blk], axis=0)  # [n_keys, kv, d]
        values = np.concatenate([v_ctx, v_blk], axis=0)

        attn = np.zeros((B, num_heads, d), dtype=np.float64)
        for hq in range(num_heads):
            hk = hq // group
            for i in range(B):
                qp = blk_pos[i]
                scores = []
                vis_vals = []
                for j in range(n_keys):
                    kp = key_pos[j]
                    if causal and kp > qp:
                        continue
                    if sliding and not (qp - kp < window and (causal or kp - qp < window)):
                        continue
                    scores.append(float(np.dot(q[i, hq], keys[j, hk])) * scale)
                    vis_vals.append(values[j, hk])
                scores = np.array(scores, dtype=np.float64)
                m = scores.max()
                probs = np.exp(scores - m)
                probs = probs / probs.sum()
                acc = np.zeros(d, dtype=np.float64)
                for w_j, v_j in zip(probs, vis_vals):
                    acc += w_j * v_j
                attn[i, hq] = acc

        attn_out = _linear(attn.reshape(B, num_heads * d), weights, p + "self_attn.o_proj")
        if dflash2:
            attn_out = _block_conv(attn_out, attn_dynamic, weights[p + "attention_conv.base_kernel"][1], config)
        x = x + attn_out

        h2 = _rms_norm(x, weights[p + "post_attention_layernorm.weight"], eps)
        if dflash2:
            h2, mlp_dynamic = _block_conv_first(h2, weights, p + "mlp_conv.", config)
        gate = _linear(h2, weights, p + "mlp.gate_proj")
        up = _linear(h2, weights, p + "mlp.up_proj")
        mlp_out = _linear(_silu(gate) * up, weights, p + "mlp.down_proj")
        if dflash2:
            mlp_out = _block_conv(mlp_out, mlp_dynamic, weights[p + "mlp_conv.base_kernel"][1], config)
        x = x + mlp_out

    x = _rms_norm(x, weights["norm.weight"], eps)
    logits = x @ np.asarray(head, dtype=np.float64).T * out_mult
    if softcap:
        cap = float(softcap)
        logits = cap * np.tanh(logits / cap)
    return (logits, x) if return_hidden else logits


def _is_dflash2(config: dict) -> bool:
    return "DFlash2DraftModel" in (config.get("architectures") or [])


def _block_conv(x: np.ndarray, dynamic: np.ndarray, base: np.ndarray, config: dict) -> np.ndarray:
    """SPEC section 10, element by element: ``y[t, j] = sum_{o < K, t - o >= 0} (base[o, j] + dynamic[t, o, j //
    group_size]) * x[t - o, j]`` over the block's positions ``t``; ``dynamic [T, K, G]``, ``base [K, H]``."""
    gs = int(_cfg_get(config, "conv_group_size"))
    t_len, hidden = x.shape
    y = np.zeros_like(x, dtype=np.float64)
    for t in range(t_len):
        for o in range(base.shape[0]):
            if t - o < 0:
                continue
            for j in range(hidden):
                y[t, j] += (float(base[o, j]) + float(dynamic[t, o, j // gs])) * x[t - o, j]
    return y


def _block_conv_first(h: np.ndarray, weights: dict, prefix: str, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """The dynamic kernels of both halves from ``h`` (``kernel_projection``, viewed ``[T, 2, K, G]``); returns
    ``h`` convolved by the first half and the second half's kernels."""
    k = int(_cfg_get(config, "conv_kernel_size"))
    groups = h.shape[1] // int(_cfg_get(config, "conv_group_size"))
    dynamic = _linear(h, weights, prefix + "kernel_projection").reshape(h.shape[0], 2, k, groups)
    return _block_conv(h, dynamic[:, 0], weights[prefix + "base_kernel"][0], config), dynamic[:, 1]


def _is_dspark(config: dict) -> bool:
    return "Qwen3DSparkModel" in (config.get("architectures") or [])


def dspark_chain_reference(weights: dict, config: dict, base_logits: np.ndarray, hidden: np.ndarray, anchor: int,
                           tokens=None) -> tuple[list[int], np.ndarray, np.ndarray | None]:
    """A DSpark block (SPEC 13.3-13.4) from the backbone's ``base_logits [K, V]`` and final-normed ``hidden
    [K, H]`` of its K positions: position k's logits are ``base_k + w2 @ w1[x_{k-1}]`` (x_{-1} = the anchor;
    the gated kind scales ``w1[x]`` by ``sigmoid(gate @ [h_k ; w1[x]] + b)``), x_k their argmax (or the given
    ``tokens``, teacher-forced). Returns the tokens, the corrected logits ``[K, V]`` and the confidence logits
    ``[K]`` (``proj @ [h_k ; w1[x_{k-1}]] + b``, or ``proj @ h_k``; None without a confidence head)."""
    rank = int(config.get("markov_rank") or 0)
    gated = str(config.get("markov_head_type") or "vanilla") == "gated"
    f64 = lambda name: np.asarray(weights[name], np.float64)  # noqa: E731
    chain, corrected, previous = [], [], []
    prev = int(anchor)
    for k in range(base_logits.shape[0]):
        row = np.asarray(base_logits[k], np.float64).copy()
        if rank:
            code = f64("markov_head.markov_w1.weight")[prev]
            if gated:
                z = f64("markov_head.gate_proj.weight") @ np.concatenate([hidden[k], code]) + \
                    f64("markov_head.gate_proj.bias")
                code = code / (1.0 + np.exp(-z))
            row += f64("markov_head.markov_w2.weight") @ code
        corrected.append(row)
        previous.append(prev)
        prev = int(np.argmax(row)) if tokens is None else int(tokens[k])
        chain.append(prev)
    confidence = None
    if config.get("enable_confidence_head"):
        w, b = f64("confidence_head.proj.weight")[0], float(f64("confidence_head.proj.bias")[0])
        confidence = []
        for k in range(base_logits.shape[0]):
            feats = np.asarray(hidden[k], np.float64)
            if config.get("confidence_head_with_markov"):
                feats = np.concatenate([feats, f64("markov_head.markov_w1.weight")[previous[k]]])
            confidence.append(float(w @ feats) + b)
        confidence = np.asarray(confidence)
    return chain, np.stack(corrected), confidence


def selector_scores_reference(weights: dict, config: dict, logits: np.ndarray, hidden: np.ndarray,
                              predecessor: int, candidates=None) -> tuple[np.ndarray, np.ndarray]:
    """The DFlash2 selector at ONE mask position: its ``top_k`` candidates (best first; or the given
    ``candidates``) and their scores
    ``logit + sum_r pred_code[predecessor, r] * (hidden_projection @ hidden)[r] * succ_code[candidate, r]``."""
    k = int(_cfg_get(config, "selector_top_k"))
    if candidates is None:
        candidates = np.argsort(-np.asarray(logits, np.float64), kind="stable")[:k]
    projected = np.asarray(weights["candidate_selector.hidden_projection.weight"], np.float64) @ hidden
    pred = np.asarray(weights["candidate_selector.predecessor_codebook"], np.float64)[predecessor]
    succ = np.asarray(weights["candidate_selector.successor_codebook"], np.float64)
    scores = np.array([logits[c] + float(np.sum(pred * projected * succ[c])) for c in candidates])
    return candidates, scores


def selector_chain_reference(weights: dict, config: dict, logits: np.ndarray, hidden: np.ndarray,
                             anchor: int) -> list[int]:
    """Greedy DFlash2 block: from the anchor, each mask position takes its best-scoring candidate, which
    becomes the next position's predecessor. ``logits [K, V]``, ``hidden [K, H]`` of the mask positions."""
    chain, predecessor = [], int(anchor)
    for i in range(logits.shape[0]):
        candidates, scores = selector_scores_reference(weights, config, logits[i], hidden[i], predecessor)
        predecessor = int(candidates[int(np.argmax(scores))])
        chain.append(predecessor)
    return chain


# --------------------------------------------------------------------------------------------------------------
# Config defaults and random weights
# --------------------------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SPEC section 2: ``[L // 2]`` if n == 1, else ``round(1 + i * (L - 4) / (n - 1))`` (Python round)."""
    L, n = int(num_target_layers), int(num_draft_layers)
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


def random_official_draft_weights(
    config: dict,
    num_target_features: int,
    rng: np.random.Generator,
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Random draft weights in the official layout (SPEC section 7), scaled so activations stay O(1).

    Linear weights ~ N(0, 1/in_features) (std 0.125 at in=64); norm weights 1 + 0.1 * N(0, 1);
    biases (when ``attention_bias``) 0.1 * N(0, 1).
    """
    H = int(config["hidden_size"])
    nh = int(config["num_attention_heads"])
    nkv = _num_kv_heads(config)
    d = _head_dim(config)
    inter = int(config["intermediate_size"])
    n_layers = _num_layers(config)
    bias = bool(config.get("attention_bias", False))

    def lin(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(dtype)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(dtype)

    w: dict[str, np.ndarray] = {
        "fc.weight": lin(H, num_target_features * H),
        "hidden_norm.weight": norm(H),
        "norm.weight": norm(H),
    }
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes = {
            "q_proj": (nh * d, H),
            "k_proj": (nkv * d, H),
            "v_proj": (nkv * d, H),
            "o_proj": (H, nh * d),
        }
        for name, (o, i_) in shapes.items():
            w[p + f"self_attn.{name}.weight"] = lin(o, i_)
            if bias:
                w[p + f"self_attn.{name}.bias"] = (0.1 * rng.standard_normal(o)).astype(dtype)
        w[p + "self_attn.q_norm.weight"] = norm(d)
        w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = lin(inter, H)
        w[p + "mlp.up_proj.weight"] = lin(inter, H)
        w[p + "mlp.down_proj.weight"] = lin(H, inter)
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        if _is_dflash2(config):  # near-identity convolutions with visible dynamic parts
            k = int(_cfg_get(config, "conv_kernel_size"))
            groups = H // int(_cfg_get(config, "conv_group_size"))
            for conv in ("attention_conv", "mlp_conv"):
                base = 0.3 * rng.standard_normal((2, k, H))
                base[:, 0] += 1.0
                w[p + f"{conv}.base_kernel"] = base.astype(dtype)
                w[p + f"{conv}.kernel_projection.weight"] = (0.3 * lin(2 * k * groups, H)).astype(dtype)
    if _is_dflash2(config):
        r, vocab = int(_cfg_get(config, "selector_rank")), int(config["vocab_size"])
        w["candidate_selector.predecessor_codebook"] = rng.standard_normal((vocab, r)).astype(dtype)
        w["candidate_selector.successor_codebook"] = rng.standard_normal((vocab, r)).astype(dtype)
        w["candidate_selector.hidden_projection.weight"] = lin(r, H)
    if _is_dspark(config):  # DeepSpec's heads, scaled so the Markov term moves the argmax
        r, vocab = int(config.get("markov_rank") or 0), int(config["vocab_size"])
        if r:
            w["markov_head.markov_w1.weight"] = rng.standard_normal((vocab, r)).astype(dtype)
            w["markov_head.markov_w2.weight"] = (2.0 * lin(vocab, r)).astype(dtype)
            if str(config.get("markov_head_type")) == "gated":
                w["markov_head.gate_proj.weight"] = lin(r, H + r)
                w["markov_head.gate_proj.bias"] = (0.1 * rng.standard_normal(r)).astype(dtype)
        if config.get("enable_confidence_head"):
            width = H + (r if config.get("confidence_head_with_markov") else 0)
            w["confidence_head.proj.weight"] = lin(1, width)
            w["confidence_head.proj.bias"] = (0.1 * rng.standard_normal(1)).astype(dtype)
    return w


# --------------------------------------------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------------------------------------------


def _tiny_config(**overrides) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "max_position_embeddings": 512,
        "vocab_size": 50,
        "block_size": 8,
        "num_target_layers": 6,
        "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 49},
    }
    cfg.update(overrides)
    return cfg


def _self_check() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert default_target_layer_ids(36, 1) == [18]

    rng = np.random.default_rng(0)
    n_feat, V, B = 3, 50, 8
    embed = rng.standard_normal((V, 64))
    head = rng.standard_normal((V, 64)) * 0.5
    block = np.array([7] + [49] * (B - 1))

    # 1. Sliding layers: context at positions <= start - window is invisible to every query of every layer.
    W = 6
    cfg = _tiny_config(layer_types=["sliding_attention"] * 2, sliding_window=W, use_sliding_window=True)
    w = random_official_draft_weights(cfg, n_feat, rng)
    start = 30
    ctx = rng.standard_normal((start, n_feat * 64))
    base = draft_forward_reference(w, cfg, embed, head, ctx, block, start)
    assert base.shape == (B, V) and np.all(np.isfinite(base))
    ctx2 = ctx.copy()
    ctx2[: start - W + 1] = rng.standard_normal((start - W + 1, n_feat * 64))  # positions 0..start-W
    assert np.allclose(draft_forward_reference(w, cfg, embed, head, ctx2, block, start), base, atol=0, rtol=0)
    # ... while the last visible context position (start - W + 1) does matter, for query 0 at least.
    ctx3 = ctx.copy()
    ctx3[start - W + 1] += 1.0
    assert not np.allclose(draft_forward_reference(w, cfg, embed, head, ctx3, block, start), base)
    # ... and with full attention the far context matters too.
    cfg_full = _tiny_config()
    assert not np.allclose(
        draft_forward_reference(w, cfg_full, embed, head, ctx2, block, start),
        draft_forward_reference(w, cfg_full, embed, head, ctx, block, start),
    )
    # Same check written as "appending context": a longer history with identical last W-1 rows.
    longer = np.concatenate([rng.standard_normal((10, n_feat * 64)), ctx[start - W + 1 :]], axis=0)
    base_short = draft_forward_reference(w, cfg, embed, head, ctx[start - W + 1 :], block, start,
                                         context_positions=np.arange(start - W + 1, start))
    out_long = draft_forward_reference(w, cfg, embed, head, longer, block, start,
                                       context_positions=np.concatenate([np.arange(0, 10),
                                                                         np.arange(start - W + 1, start)]))
    assert np.allclose(out_long, base_short, atol=1e-12)
    assert np.allclose(out_long, base, atol=1e-12)

    # 2. RoPE is relative: shifting every position by a constant leaves full-attention logits unchanged
    #    (default and llama3 RoPE, with biases, GQA, softcap and multipliers on).
    for rope_scaling in (None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}):
        cfg = _tiny_config(rope_scaling=rope_scaling, attention_bias=True, input_embedding_scale=1.5,
                           output_multiplier=0.7, final_logit_softcapping=3.0)
        w = random_official_draft_weights(cfg, n_feat, rng)
        ctx = rng.standard_normal((12, n_feat * 64))
        a = draft_forward_reference(w, cfg, embed, head, ctx, block, 12)
        b = draft_forward_reference(w, cfg, embed, head, ctx, block, 12 + 37,
                                    context_positions=np.arange(37, 37 + 12))
        assert np.allclose(a, b, atol=1e-10), np.abs(a - b).max()
        assert np.abs(a).max() <= 3.0

    # 3. llama3 scaling really changes the frequencies; rope_parameters (transformers 5 layout) parses the same.
    cfg_plain = _tiny_config()
    cfg_l3 = _tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    f0, f1 = _rope_inv_freq(cfg_plain), _rope_inv_freq(cfg_l3)
    assert f0[0] == f1[0] == 1.0 and np.isclose(f1[-1], f0[-1] / 8.0) and not np.allclose(f0, f1)
    cfg_v5 = _tiny_config(rope_theta=None, rope_scaling=None,
                          rope_parameters={"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    assert np.array_equal(_rope_inv_freq(cfg_v5), f1)

    # 4. GQA: 4 query heads over 2 kv heads == 4 kv heads with the kv weights duplicated per group.
    cfg = _tiny_config()
    w = random_official_draft_weights(cfg, n_feat, rng)
    cfg_mha = _tiny_config(num_key_value_heads=4)
    w_mha = dict(w)
    for li in range(2):
        for name in ("k_proj", "v_proj"):
            key = f"layers.{li}.self_attn.{name}.weight"
            wk = w[key].reshape(2, 16, 64)
            w_mha[key] = np.repeat(wk, 2, axis=0).reshape(64, 64)  # kv head h//2 for query head h
    ctx = rng.standard_normal((9, n_feat * 64))
    assert np.allclose(draft_forward_reference(w, cfg, embed, head, ctx, block, 9),
                       draft_forward_reference(w_mha, cfg_mha, embed, head, ctx, block, 9), atol=1e-12)

    # 5. Non-causal block: the anchor's output depends on a later block token.
    block2 = block.copy()
    block2[-1] = 3
    r1 = draft_forward_reference(w, cfg, embed, head, ctx, block, 9)
    r2 = draft_forward_reference(w, cfg, embed, head, ctx, block2, 9)
    assert not np.allclose(r1[0], r2[0])

    # 5b. is_causal: true makes the anchor independent of later block tokens; a causal layer's query i
    #     equals the same forward on the block cut after i (later keys are invisible).
    cfg_c = _tiny_config(is_causal=True)
    c1 = draft_forward_reference(w, cfg_c, embed, head, ctx, block, 9)
    assert np.allclose(c1[:-1], draft_forward_reference(w, cfg_c, embed, head, ctx, block2, 9)[:-1], atol=0)
    assert np.allclose(c1[:3], draft_forward_reference(w, cfg_c, embed, head, ctx, block[:3], 9), atol=1e-12)
    assert not np.allclose(c1, r1)

    # 6. Cross-check the loop attention against a vectorised one-layer recomputation (layer 0, query outputs).
    cfg1 = _tiny_config(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=5,
                        use_sliding_window=True)
    w1 = {k: v for k, v in w.items() if not k.startswith("layers.1.")}
    ref = draft_forward_reference(w1, cfg1, embed, head, ctx, block, 9)
    f = lambda name: w1[name].astype(np.float64)
    rms = lambda z, g: z / np.sqrt((z * z).mean(-1, keepdims=True) + 1e-6) * g
    c = rms(ctx @ f("fc.weight").T, f("hidden_norm.weight"))
    x = embed[block]
    hh = rms(x, f("layers.0.input_layernorm.weight"))
    inv = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)

    def rope(z, pos):
        ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None, :]
        return z * np.cos(ang) + np.concatenate([-z[..., 8:], z[..., :8]], -1) * np.sin(ang)

    qp, kp = np.arange(9, 9 + B), np.arange(0, 9 + B)
    q = rope(rms((hh @ f("layers.0.self_attn.q_proj.weight").T).reshape(B, 4, 16),
                 f("layers.0.self_attn.q_norm.weight")), qp)
    src = np.concatenate([c, hh])
    k = rope(rms((src @ f("layers.0.self_attn.k_proj.weight").T).reshape(-1, 2, 16),
                 f("layers.0.self_attn.k_norm.weight")), kp)
    v = (src @ f("layers.0.self_attn.v_proj.weight").T).reshape(-1, 2, 16)
    k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / 4.0
    diff = qp[:, None] - kp[None, :]
    s = np.where(((diff >= 0) & (diff < 5))[None], s, -np.inf)  # a sliding layer: causal by default
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", pr, v).reshape(B, 64)
    x = x + o @ f("layers.0.self_attn.o_proj.weight").T
    h2 = rms(x, f("layers.0.post_attention_layernorm.weight"))
    g, u = h2 @ f("layers.0.mlp.gate_proj.weight").T, h2 @ f("layers.0.mlp.up_proj.weight").T
    x = x + (g / (1 + np.exp(-g)) * u) @ f("layers.0.mlp.down_proj.weight").T
    vec = rms(x, f("norm.weight")) @ head.T
    assert np.allclose(ref, vec, atol=1e-10), np.abs(ref - vec).max()

    print("reference_draft_numpy self-check: OK")


if __name__ == "__main__":
    _self_check()
