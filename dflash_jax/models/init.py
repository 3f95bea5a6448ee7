"""Random weights for any params tree: speed runs, tests, and the starting point of a new draft."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.dflash2 import identity_conv_init
from dflash_jax.models.experts import place_packed


def _draw(key: jax.Array, shape: tuple[int, ...], dtype: Any, std: jax.Array) -> jax.Array:
    """N(0, std^2) in ``dtype``, or uniform random bytes for an integer ``dtype`` (MXFP4 codes, INT4 words;
    ``std`` unused)."""
    if jnp.issubdtype(dtype, jnp.integer):  # (INT4 words: int32, the bits of uint32 ones)
        bits = jax.random.bits(key, shape, jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}"))
        return jax.lax.bitcast_convert_type(bits, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


_draw_jitted = jax.jit(_draw, static_argnums=(1, 2))


HOST_INIT_LIMIT = 300_000_000  # parameters; bigger models are drawn on the device
# Elements drawn by one program on the device. ``jax.random.normal`` needs about three times its float32 output
# in temporaries (the key counters and random bits; measured with XLA:CPU's memory analysis: 6.5 GiB for a
# float32 201,088 x 2,880 embedding, 8.6 GiB for the same in bfloat16), so bigger leaves are drawn in slices of
# rows written into their buffer in place: the draw's temporaries stay near 0.4 GiB whatever the leaf.
DEVICE_SLICE = 1 << 25


@functools.partial(jax.jit, static_argnums=(2,), donate_argnums=(0,))
def _fill_rows(buf: jax.Array, key: jax.Array, rows: int, start: jax.Array, std: jax.Array) -> jax.Array:
    part = _draw(key, (rows,) + buf.shape[1:], buf.dtype, std)
    return jax.lax.dynamic_update_slice_in_dim(buf, part, start, axis=0)


def _draw_on_device(key: jax.Array, shape: tuple[int, ...], dtype: Any, std: jax.Array) -> jax.Array:
    """N(0, std^2) in ``dtype`` (random bytes for an integer ``dtype``) drawn on the default device; a leaf of
    more than ``DEVICE_SLICE`` elements slice by slice along its first axis (slice ``i`` from
    ``fold_in(key, i)``) into a donated buffer."""
    size = int(np.prod(shape))
    if size <= DEVICE_SLICE or len(shape) < 2:
        return _draw_jitted(key, shape, dtype, std)
    rows = max(1, DEVICE_SLICE // (size // shape[0]))
    buf = jnp.zeros(shape, dtype)
    for i, start in enumerate(range(0, shape[0], rows)):
        buf = _fill_rows(buf, jax.random.fold_in(key, i), min(rows, shape[0] - start), jnp.int32(start), std)
    return buf


def _keys(path) -> tuple[str, ...]:
    return tuple(getattr(k, "key", str(k)) for k in path)


def _is_zero_centered_norm(path, final_norm_plain: bool = False) -> bool:
    """A zero-centred RMSNorm's weight (hybrid targets and Muse Glimmer scale by ``1 + w``), i.e. every norm
    weight but the Gated DeltaNet's output norm (``linear_attn/norm``, a plain scale) and, with
    ``final_norm_plain`` (Muse Glimmer), the final norm (``norm/weight`` at the top, a plain ``w``)."""
    keys = [getattr(k, "key", "") for k in path]
    if final_norm_plain and keys == ["norm", "weight"]:
        return False
    return not (len(keys) >= 3 and keys[-3:] == ["linear_attn", "norm", "weight"])


def random_params(abstract: Any, seed: int = 0, std: float | None = None, zero_centered_norms: bool = False,
                  final_norm_plain: bool = False) -> Any:
    """Random weights for a params tree of ``jax.ShapeDtypeStruct``. Norm weights (and Gemma 4's layer and
    router scales) are one, biases zero,
    DFlash2 convolution base kernels the identity,
    embeddings N(0, 1), linear kernels ``[in, out]`` N(0, 1/in) (packed MXFP4 experts: random codes at
    scale 2^-5; FP8 / INT4 experts: random codes, scales that make the weights about N(0, 1/in)), or N(0, std^2) when ``std`` is given (0.02 is
    Hugging Face's ``initializer_range``, a new draft's start). Unit-scale activations keep greedy choices
    well separated in speed runs and tests. ``zero_centered_norms`` (a hybrid target's
    ``TargetConfig.zero_centered_norms``): its norm weights start at zero, the identity of ``1 + w``, but the final
    norm at one with ``final_norm_plain`` (``TargetConfig.final_norm_plain``: Muse Glimmer's plain ``w``). Models up to ``HOST_INIT_LIMIT`` parameters are drawn with NumPy
    (no per-shape compiles); bigger ones (8B) with ``jax.random`` directly on the default device, with no
    host copy, leaves of more than ``DEVICE_SLICE`` elements a slice of rows at a time (so building peaks at
    about the params' own size)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaf_of = {_keys(path): leaf for path, leaf in leaves}
    on_host = sum(int(np.prod(leaf.shape)) for _, leaf in leaves) <= HOST_INIT_LIMIT
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        name = getattr(path[-1], "key", "")
        shape, dtype = tuple(leaf.shape), leaf.dtype
        if name.endswith("_qscale"):  # FP8 / INT4 experts (models/quantized_experts): N(0, 1/in) weights
            codes = leaf_of[_keys(path)[:-1] + (name[: -len("_qscale")] + "_qweight",)]
            int4 = jnp.issubdtype(codes.dtype, jnp.integer)
            fan_in = codes.shape[-1] * (8 if int4 else 1)
            spread = 4.6 if int4 else 1.0  # the codes' spread: INT4 uniform over -8..7, FP8 drawn N(0, 1)
            out.append(jnp.full(shape, fan_in ** -0.5 / spread, dtype))
        elif name.endswith("_qweight"):  # INT4 words (random nibbles) or FP8 codes N(0, 1)
            if on_host and int(np.prod(shape)) and jnp.issubdtype(dtype, jnp.integer):
                out.append(jnp.asarray(rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)))
            elif on_host:
                out.append(jnp.asarray(rng.standard_normal(shape, np.float32), dtype))
            else:
                out.append(_draw_on_device(jax.random.fold_in(key, i), shape, dtype, jnp.float32(1)))
        elif jnp.issubdtype(dtype, jnp.integer):  # MXFP4 experts (models/mxfp4): random codes, scale 2^-5
            if not name.endswith("_blocks"):
                codes = jnp.full(shape, 122, dtype)
            elif on_host:
                codes = jnp.asarray(rng.integers(0, 256, shape), dtype)
            else:  # gigabytes of codes (gpt-oss-120b): NumPy would draw them as int64 on the host, 8 bytes each
                codes = _draw_on_device(jax.random.fold_in(key, i), shape, dtype, jnp.float32(0))
            out.append(place_packed(name, codes))  # as a loaded checkpoint's are (TPUs: the decode's layout)
        elif name in ("layer_scalar", "scale", "per_expert_scale"):
            out.append(jnp.ones(shape, dtype))
        elif name == "weight" and len(shape) == 1:
            value = 0.0 if zero_centered_norms and _is_zero_centered_norm(path, final_norm_plain) else 1.0
            out.append(jnp.asarray(np.full(shape, value, np.float32), dtype))
        elif name == "bias":
            out.append(jnp.asarray(np.zeros(shape, np.float32), dtype))
        elif name == "base_kernel":  # DFlash2 block convolutions [2, K, H] start as the identity
            out.append(identity_conv_init(None, shape, dtype))
        else:
            # Kernels are [in, out]; stacked experts [E, in, out] and sinks [heads] follow the same rule.
            fan_in = shape[-2] if len(shape) >= 2 else shape[0]
            scale = 1.0 if name == "embedding" else (fan_in ** -0.5 if std is None else std)
            if on_host:
                out.append(jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(scale), dtype))
            else:
                out.append(_draw_on_device(jax.random.fold_in(key, i), shape, dtype, jnp.float32(scale)))
    return jax.tree_util.tree_unflatten(treedef, out)
