"""Quantised checkpoints written by the tests themselves, independent of ``checkpoints/quantized``: a vectorised
block-FP8 quantiser (block amax / 448, e4m3 rounding by ml_dtypes) and an INT4 packer in compressed-tensors'
``pack_to_int32`` layout (code + 8, element ``8 g + k`` in bits ``4k .. 4k + 3`` of word ``g``; a hand-computed
word checks it in tests/test_quantized_checkpoints.py), decoders by explicit index formulas, and a writer of a
one-file checkpoint with its config.json (torch's safetensors writer: it stores float8 and bfloat16)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

FP8_MAX = 448.0


def fp8_quantise(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """float [N, K] -> (e4m3 codes, float32 scale_inv [ceil(N/bn), ceil(K/bk)]) by block amax / 448; partial
    blocks at the edges."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = np.zeros((gn * bn, gk * bk), np.float32)
    padded[:n, :k] = w
    amax = np.abs(padded.reshape(gn, bn, gk, bk)).max(axis=(1, 3))
    scale = (np.maximum(amax, 1e-12) / FP8_MAX).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[:n, :k]
    codes = np.clip(w.astype(np.float32) / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def fp8_decode(codes: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """``codes[..., i, j] * scale[..., i // bn, j // bk]`` through explicit index arrays."""
    n, k = codes.shape[-2:]
    rows, cols = np.arange(n) // block[0], np.arange(k) // block[1]
    return codes.astype(np.float32) * scale[..., rows[:, None], cols[None, :]]


def int4_pack(q: np.ndarray) -> np.ndarray:
    """int [out, in] in [-8, 7] -> int32 [out, ceil(in / 8)]; a partial last word holds zero nibbles."""
    out, inn = q.shape
    words = -(-inn // 8)
    u = np.zeros((out, words * 8), np.uint32)
    u[:, :inn] = q.astype(np.int32) + 8
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    return np.bitwise_or.reduce(u.reshape(out, words, 8) << shifts, axis=2).astype(np.uint32).view(np.int32)


def int4_decode(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """``q[r, c] * scale[r, c // group]``."""
    return q.astype(np.float32) * scale.astype(np.float32)[:, np.arange(q.shape[1]) // group]


def to_torch(a: np.ndarray):
    import torch

    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def write_checkpoint(dst: Path, config: dict, tensors: dict) -> Path:
    """``dst/config.json`` and ``dst/model.safetensors`` holding ``tensors``; returns ``dst``."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: to_torch(v) for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
