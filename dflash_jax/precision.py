"""Dtypes by name and the precision policy: the one place that turns a user's ``--dtype`` into a JAX dtype
and decides how precisely matmuls run in it."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dflash_jax.errors import UserError

DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "fp16": jnp.float16}


def resolve_dtype(dtype: Any) -> Any:
    """A dtype name (``float32``, ``bf16``, ...) or a dtype -> the JAX dtype; unknown names name the choices."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
        return DTYPES[dtype]
    return dtype


# The precision policy. bfloat16 (accelerators): weights, activations and matmuls in bf16; RMSNorm, attention
# scores and softmax in float32 (models/layers.py), logits cast to float32 before sampling. float32 (CPU, parity
# runs): every matmul at full float32 precision, set explicitly, because the default on GPUs (TF32) and TPUs
# (bf16 passes) is not float32 and would change greedy tokens against the CPU tests.
def matmul_precision(dtype: Any) -> contextlib.AbstractContextManager:
    """The matmul precision context of a computation in ``dtype``: HIGHEST for float32, DEFAULT else (set, not
    inherited: a global "highest" would ask TPU kernels, ``ragged_dot``'s Mosaic lowering among them, for an
    fp32 contraction of bfloat16 operands, which they refuse)."""
    if jnp.dtype(resolve_dtype(dtype)) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return jax.default_matmul_precision("default")


def with_precision_policy(fn: Callable, dtype: Any, attention: str | None = None, mesh: Any = None) -> Callable:
    """``fn`` traced under ``matmul_precision(dtype)`` and, if given, the ``attention`` kernel for a program
    sharded over ``mesh`` (``models.attention_kernels.attention_kernel``) and the expert layers' split of their
    work over it (``models.experts.experts_on_mesh``). Wrap before ``jax.jit``: the
    contexts apply at trace time, and what they choose is then part of the compiled program."""
    from dflash_jax.models.attention_kernels import attention_kernel
    from dflash_jax.models.experts import experts_on_mesh

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        kernel = attention_kernel(attention, mesh) if attention is not None else contextlib.nullcontext()
        with matmul_precision(dtype), kernel, experts_on_mesh(mesh):
            return fn(*args, **kwargs)

    return wrapped
