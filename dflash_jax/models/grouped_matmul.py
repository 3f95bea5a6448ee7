"""A grouped matmul for GPUs whose work follows the rows: a Pallas kernel on the Triton backend.

``grouped_matmul(lhs [M, K], rhs [E, K, N], group_sizes [E]) -> [M, N]`` has the contract of
``jax.lax.ragged_dot``: ``lhs``'s rows are sorted by group, the first ``group_sizes[0]`` rows are multiplied by
``rhs[0]``, the next ``group_sizes[1]`` by ``rhs[1]``, and so on; rows past ``sum(group_sizes)`` come out zero.
It exists because XLA:GPU lowers ``ragged_dot`` to one GEMM over all groups (the rows broadcast to
``[M, E, K]``, then masked), so a mixture-of-experts layer on a GPU would multiply every routed row by every
expert; this kernel multiplies each row by its own group's matrix only, reading only the experts that have
rows.

How the work is cut (the approach of megablox, the TPU grouped matmul, laid out for a Triton grid): every group
is cut into tiles of ``rows`` rows starting at the group's first row, so a tile never holds two groups and
needs only its group's weights. The number of such tiles depends on the group sizes (data), but is bounded by
``cdiv(M, rows) + E`` (each group adds at most one partial tile), which is the grid's static size; a small
metadata computation in XLA maps each grid item to (expert, first row, end row), and the items past the real
tiles do nothing. Rows past ``sum(group_sizes)`` form one extra group with no matrix, whose tiles write zeros.
The grid is (tiles, column tiles); each program walks ``K`` in ``depth`` steps, loading its rows (masked to its
group) and its expert's ``[depth, cols]`` slice, accumulating in float32, and stores its rows only: the rows of
a tile's neighbour group belong to another program, so no two programs write the same element.

``interpret``: None (the default) lowers the Triton kernel for GPUs and Pallas' interpreter everywhere else (a
``platform_dependent`` choice made when the program is lowered), so a program traced for a GPU on this CPU
machine (``platform.compiling_for("gpu")``, the tests) computes the kernel's own tiling, and one compiled for a
GPU without a device (``dflash_jax.aot``) calls the kernel. The interpreter is slow (a Python-level grid);
CPU programs use ``ragged_dot`` (``experts.grouped_experts`` takes this kernel on GPUs only).

Reverse mode (a ``custom_vjp``): the gradient of ``lhs`` is this kernel again (``dy @ rhs[g]^T``); the
gradient of ``rhs`` is a product contracted over each group's rows, left to XLA's ``ragged_dot_general``. The
engine and the trainer never differentiate a target's experts (the target is frozen); this keeps the op usable
where someone does.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Tiles(NamedTuple):
    """The kernel's tile sizes (powers of two, at least 16: Triton's ``dot`` needs both) and launch options."""

    rows: int
    cols: int
    depth: int
    num_warps: int = 4
    num_stages: int = 3


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_between(x: int, low: int, high: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return max(low, min(high, p))


def default_tiles(m: int, k: int, n: int, num_groups: int, dtype: Any) -> Tiles:
    """Tile sizes for ``[m, k] x [num_groups, k, n]``. Not tuned on a device (none here); chosen so that:

    - ``rows`` follows the mean group size (``m / num_groups``) up to 128: each group wastes at most one
      partial tile, so with many small groups (prefill of a few hundred tokens over 128 experts) short tiles
      waste less than 128-row ones, while large groups get the 128-row tiles GEMMs use on Hopper.
    - ``depth`` 64 for 16-bit inputs, 32 for float32, so that 3 pipeline stages of a 128 x 128 tile fit in
      shared memory (3 x (128 x 64 + 64 x 128) x 2 bytes = 96 KiB of an H200's 227 KiB, float32 the same).
    - 8 warps for 128 x 128 output tiles (64 float32 accumulators per thread), 4 below."""
    rows = _pow2_between(-(-m // max(num_groups, 1)), 16, 128)
    cols = _pow2_between(n, 16, 128)
    depth = _pow2_between(k, 16, 64 if jnp.dtype(dtype).itemsize <= 2 else 32)
    return Tiles(rows, cols, depth, num_warps=8 if rows * cols >= 128 * 128 else 4)


def _resolve_precision(precision):
    """An explicit precision, else the one in context (``jax.default_matmul_precision``): the kernel's ``dot``
    does not see that context when Pallas lowers it, and float32 would silently become TF32 on a GPU."""
    if precision is not None:
        return precision
    name = jax.config.jax_default_matmul_precision
    if name is None:
        return None
    try:
        return jax.lax.Precision(name)
    except ValueError:  # a dot-algorithm name: leave the kernel's default
        return None


def work_items(group_sizes: jax.Array, m: int, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's row tiles: ``(expert, start, end)`` per grid item, each ``[cdiv(m, rows) + E]`` int32.

    Item ``w`` covers rows ``[start, end)`` (at most ``rows`` of them) of group ``expert``; ``expert`` is -1 for
    the rows past ``sum(group_sizes)`` (written as zeros) and for the unused items (``start == end``: nothing
    done). Group sizes are clipped so that no group reaches past row ``m``."""
    e = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    # group e (the extra one): the rows no group covers
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    tiles = (ends - starts + rows - 1) // rows
    last = jnp.cumsum(tiles)  # item w belongs to the first group whose cumulative tile count exceeds w
    items = jnp.arange(_cdiv(m, rows) + e, dtype=jnp.int32)
    # a comparison over [items, E + 1] (small) rather than searchsorted, whose default form is a while loop
    group = jnp.sum(last[None, :] <= items[:, None], axis=1).astype(jnp.int32)
    used = group <= e
    g = jnp.minimum(group, e)
    start = starts[g] + (items - (last[g] - tiles[g])) * rows
    end = jnp.minimum(start + rows, ends[g])
    expert = jnp.where(used & (g < e), g, -1)
    return expert, jnp.where(used, start, 0), jnp.where(used, end, 0)


def _kernel(expert_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref, *, tiles: Tiles, k: int, n: int,
            precision):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    tm, tn, tk = tiles.rows, tiles.cols, tiles.depth
    expert, start, end = expert_ref[...], start_ref[...], end_ref[...]
    col = pl.program_id(1) * tn
    row_ok = (start + jnp.arange(tm)) < end
    col_ok = (col + jnp.arange(tn)) < n
    ragged_k = k % tk != 0  # static: the last depth step masks past K only when K is not a whole number of steps

    def step(i, acc):
        depth = i * tk
        a_mask, b_mask = row_ok[:, None], col_ok[None, :]
        if ragged_k:
            k_ok = (depth + jnp.arange(tk)) < k
            a_mask, b_mask = a_mask & k_ok[None, :], b_mask & k_ok[:, None]
        a = plgpu.load(lhs_ref.at[pl.ds(start, tm), pl.ds(depth, tk)], mask=a_mask, other=0)
        b = plgpu.load(rhs_ref.at[expert, pl.ds(depth, tk), pl.ds(col, tn)], mask=b_mask, other=0)
        return acc + plgpu.dot(a, b, precision=precision)

    mask = row_ok[:, None] & col_ok[None, :]
    out = out_ref.at[pl.ds(start, tm), pl.ds(col, tn)]

    @pl.when((end > start) & (expert >= 0))
    def _():
        # a static trip count: Triton software-pipelines (num_stages) a loop with known bounds
        acc = jax.lax.fori_loop(0, _cdiv(k, tk), step, jnp.zeros((tm, tn), jnp.float32))
        plgpu.store(out, acc.astype(out_ref.dtype), mask=mask)

    @pl.when((end > start) & (expert < 0))
    def _():
        plgpu.store(out, jnp.zeros((tm, tn), out_ref.dtype), mask=mask)


def _pallas(lhs, rhs, group_sizes, out_dtype, tiles: Tiles, precision, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    m, k = lhs.shape
    _, _, n = rhs.shape
    expert, start, end = work_items(group_sizes, m, tiles.rows)
    per_item = pl.BlockSpec((None,), lambda w, j: (w,))  # one scalar of each metadata array per program
    whole = pl.no_block_spec  # rows and weights are addressed by the metadata, not by the grid
    call = pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, k=k, n=n, precision=precision),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(expert.shape[0], _cdiv(n, tiles.cols)),
        in_specs=[per_item, per_item, per_item, whole, whole],
        out_specs=whole,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )
    return call(expert, start, end, lhs, rhs)


def _forward(lhs, rhs, group_sizes, out_dtype, tiles, precision, interpret):
    if interpret is None:  # decided when lowering: the kernel for GPUs, the interpreter for anything else
        kernel = functools.partial(_pallas, out_dtype=out_dtype, tiles=tiles, precision=precision, interpret=False)
        # ROCm: Pallas' Triton backend lowers for it too (not compiled here: no ROCm compiler on this machine)
        return jax.lax.platform_dependent(
            lhs, rhs, group_sizes, cuda=kernel, rocm=kernel,
            default=functools.partial(_pallas, out_dtype=out_dtype, tiles=tiles, precision=precision,
                                      interpret=True))
    return _pallas(lhs, rhs, group_sizes, out_dtype, tiles, precision, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _grouped(lhs, rhs, group_sizes, out_dtype, tiles, precision, interpret):
    return _forward(lhs, rhs, group_sizes, out_dtype, tiles, precision, interpret)


def _grouped_fwd(lhs, rhs, group_sizes, out_dtype, tiles, precision, interpret):
    return _forward(lhs, rhs, group_sizes, out_dtype, tiles, precision, interpret), (lhs, rhs, group_sizes)


def _grouped_bwd(out_dtype, tiles, precision, interpret, saved, dy):
    del out_dtype, tiles  # the forward's: the backward products choose their own tiles
    lhs, rhs, group_sizes = saved
    m, k = lhs.shape
    e, _, n = rhs.shape
    back = default_tiles(m, n, k, e, dy.dtype)
    d_lhs = _forward(dy, jnp.swapaxes(rhs, 1, 2).astype(dy.dtype), group_sizes, lhs.dtype, back, precision,
                     interpret)
    # [E, K, N]: lhs^T dy over each group's rows (ragged contracting dimension)
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    d_rhs = jax.lax.ragged_dot_general(lhs.astype(dy.dtype), dy, group_sizes, numbers, precision=precision,
                                       preferred_element_type=jnp.float32).astype(rhs.dtype)
    return d_lhs, d_rhs, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, precision=None,
                   preferred_element_type=None, tiles: Tiles | None = None,
                   interpret: bool | None = None) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` by the grouped kernel: ``lhs [M, K]`` (rows sorted by
    group), ``rhs [E, K, N]``, ``group_sizes [E]`` -> ``[M, N]`` in ``preferred_element_type`` (default: the
    inputs' promoted type), accumulated in float32. ``precision``: None takes the context's
    (``jax.default_matmul_precision``). ``tiles``: None chooses by shape (``default_tiles``). ``interpret``:
    None lowers the kernel for GPUs (CUDA, ROCm) and interprets it elsewhere; True / False force one."""
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != rhs.shape[:1] or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul needs lhs [M, K], rhs [E, K, N], group_sizes [E]; got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}")
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"grouped_matmul takes floating-point operands, got {lhs.dtype} x {rhs.dtype}")
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    m, k = lhs.shape
    e, _, n = rhs.shape
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    if tiles is None:
        tiles = default_tiles(m, k, n, e, dtype)
    # Triton's dot takes one operand type: the promoted one, as ragged_dot computes
    return _grouped(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32), out_dtype, tiles,
                    _resolve_precision(precision), interpret)
