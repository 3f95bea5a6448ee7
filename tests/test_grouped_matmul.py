"""The GPU grouped matmul (``models/grouped_matmul``, a Pallas Triton kernel) run here by Pallas' interpreter:
equal to ``jax.lax.ragged_dot`` and to a NumPy product per group, on group sizes with empty groups, groups that
are not whole tiles, a tile shared by several groups and rows past ``sum(group_sizes)`` (zeros); its gradients
equal ragged_dot's; the grouped expert layer traced for a GPU (``compiling_for("gpu")``: the kernel, here
interpreted) equals the dense path; and compiled without a device for an H200 (the ``aot`` extra, skipped
without it) the layer calls the Triton kernel and holds no all-expert broadcast of the rows, which the same
check finds in XLA:GPU's ``ragged_dot``.

Tolerance (float32, HIGHEST precision, conftest's default): within 1e-5 of the largest output of the reference
(products summed in tiles of 16 or 32 in float32, in another order than XLA; measured <= 4e-7 relative).
Tiny shapes: hidden 64, 8 experts, 64 tokens."""

import importlib.util
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import experts as X
from dflash_jax.models.config import ExpertsConfig
from dflash_jax.models.grouped_matmul import Tiles, default_tiles, grouped_matmul, work_items
from dflash_jax.platform import compiling_for

TOL = 1e-5  # of the largest reference output
HAVE_CUDA = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None and \
    importlib.util.find_spec("nvidia.cuda_nvcc") is not None
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="the aot extra (CUDA plugin) is not installed")

M, K, N = 100, 40, 24  # K and N not whole tiles of 16: the kernel's masked depth and column steps
SIZES = {
    "empty_groups": [0, 17, 33, 0, 20, 30],  # sum 100: two tiles of 16 shared by groups
    "rows_past_the_groups": [5, 0, 40, 0, 0, 31],  # sum 76 < 100: the last 24 rows are zeros
    "one_group": [0, 0, 100, 0, 0, 0],
    "no_rows": [0, 0, 0, 0, 0, 0],
    "singles": [1, 1, 1, 1, 1, 95],  # five groups inside one tile
}


def _close(got, want):
    scale = max(float(np.abs(want).max()), 1.0)
    assert np.abs(np.asarray(got, np.float64) - want).max() <= TOL * scale


def _numpy(lhs, rhs, sizes):
    """Each group's rows by its own matrix, in float64; rows past the groups zero."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g].astype(np.float64)
        start += size
    return out


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    return rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((6, K, N)).astype(np.float32)


@pytest.fixture(scope="module")
def kernel():
    """One jitted interpreted kernel with 16 x 16 x 16 tiles (group sizes are data: one compile for all)."""
    return jax.jit(lambda a, b, g: grouped_matmul(a, b, g, tiles=Tiles(16, 16, 16), interpret=True))


@pytest.mark.parametrize("case", sorted(SIZES))
def test_kernel_equals_ragged_dot_and_numpy(operands, kernel, case):
    lhs, rhs = operands
    sizes = np.array(SIZES[case], np.int32)
    got = np.asarray(kernel(lhs, rhs, sizes))
    want = _numpy(lhs, rhs, sizes)
    _close(got, want)
    _close(got, np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)))
    assert not np.any(got[sizes.sum():])  # rows no group covers: exactly zero


def test_work_items_cover_every_row_once_within_one_group():
    """The kernel's metadata: every row of [0, M) in exactly one item, each item's rows in one group (or
    past the groups, expert -1), at most one tile, items within the static bound cdiv(M, rows) + E."""
    rng = np.random.default_rng(2)
    e, m, rows = 6, 150, 16
    items = jax.jit(work_items, static_argnums=(1, 2))  # one compile: the sizes are data
    for _ in range(30):
        sizes = rng.integers(0, 26, e) * (rng.random(e) < 0.7)  # about a third empty; sum <= 150
        expert, start, end = map(np.asarray, items(jnp.asarray(sizes, jnp.int32), m, rows))
        assert expert.shape == (-(-m // rows) + e,)
        group_of = np.concatenate([np.repeat(np.arange(e), sizes), np.full(m - sizes.sum(), -1)])
        covered = np.zeros(m, int)
        for g, a, b in zip(expert, start, end):
            assert 0 <= b - a <= rows
            covered[a:b] += 1
            assert np.all(group_of[a:b] == g)
        assert np.all(covered == 1)


def test_gradients_equal_ragged_dot(operands):
    lhs, rhs = operands
    sizes = np.array(SIZES["empty_groups"], np.int32)
    cot = np.random.default_rng(3).standard_normal((M, N)).astype(np.float32)

    def loss(product):
        return lambda a, b: jnp.sum(product(a, b, sizes) * cot)

    got = jax.jit(jax.grad(loss(lambda a, b, g: grouped_matmul(a, b, g, interpret=True)), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    for g, w in zip(got, want):
        _close(g, np.asarray(w))


def test_default_tiles():
    assert default_tiles(128, 64, 64, 8, jnp.float32) == Tiles(16, 64, 32, 4)  # 16 rows per expert
    assert default_tiles(32768, 2880, 2880, 128, jnp.bfloat16) == Tiles(128, 128, 64, 8)  # gpt-oss-120b prefill


# ------------------------------------------------------------------------------ the expert layer on the kernel

H, E, I, TOP_K = 64, 8, 64, 2
TOKENS = (2, 32)  # 64 tokens x top-2 = 128 rows over 8 experts
LAYERS = {
    "gpt_oss": ExpertsConfig(E, TOP_K, I, routing="topk_softmax", router_bias=True, expert_bias=True,
                             activation="clamped_swiglu", swiglu_limit=1.5),
    "qwen3_moe": ExpertsConfig(E, TOP_K, I, routing="softmax_topk", norm_topk_prob=True),
}


def _layer_params(cfg, dtype=np.float32):
    abstract = jax.eval_shape(lambda: X.Experts(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1, H)))["params"])
    rng = np.random.default_rng(4)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: (0.2 * rng.standard_normal(a.shape)).astype(dtype), abstract)


def _primitives(jaxpr, out):
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, out)
    return out


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_grouped_layer_on_the_kernel_equals_dense(name):
    """Traced for a GPU, the grouped path calls the kernel (a pallas_call in its program; none on CPU) and
    computes the dense path's layer."""
    cfg = LAYERS[name]
    params = _layer_params(cfg)
    x = np.random.default_rng(5).standard_normal(TOKENS + (H,)).astype(np.float32)

    def layer():  # a new function per trace: JAX's trace caches do not see the contexts that choose the path
        return lambda p, x: X.Experts(cfg).apply({"params": p}, x)

    with X.force_expert_path("dense"):
        want = np.asarray(jax.jit(layer())(params, x))
    with X.force_expert_path("grouped"):
        on_cpu = _primitives(jax.make_jaxpr(layer())(params, x).jaxpr, set())
        with compiling_for("gpu"):
            on_gpu = _primitives(jax.make_jaxpr(layer())(params, x).jaxpr, set())
            got = np.asarray(jax.jit(layer())(params, x))  # lowered for this CPU: the kernel interpreted
    assert "pallas_call" in on_gpu and "ragged_dot_general" not in on_gpu
    assert "pallas_call" not in on_cpu and "ragged_dot_general" in on_cpu
    assert np.abs(want).max() > 0.1
    _close(got, want)


# ------------------------------------------------------------------------------ compiled for an H200, no device


def _all_expert_arrays(hlo: str, rows: int) -> list[str]:
    """Arrays of rank >= 3 with both an experts (E) and a rows dimension: the rows broadcast over every
    expert, which XLA:GPU's ragged_dot builds."""
    found = []
    for dtype, dims in re.findall(r"\b(bf16|f32|s32|pred)\[([0-9,]+)\]", hlo):
        shape = [int(d) for d in dims.split(",")]
        if len(shape) >= 3 and E in shape and rows in shape:
            found.append(f"{dtype}[{dims}]")
    return found


def _compile_for_h200(fn, *shapes):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from dflash_jax.aot import compile_target

    target = compile_target("h200", 1)
    replicated = NamedSharding(Mesh(target.devices, ("d",)), PartitionSpec())
    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shapes)
    with compiling_for("gpu"):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(target.lowering,)).compile().as_text()


@needs_cuda
def test_h200_grouped_layer_calls_the_kernel_not_an_all_expert_gemm():
    cfg = LAYERS["gpt_oss"]
    rows = TOKENS[0] * TOKENS[1] * TOP_K
    params = jax.eval_shape(lambda: _layer_params(cfg, jnp.bfloat16))
    x = jax.ShapeDtypeStruct(TOKENS + (H,), jnp.bfloat16)
    with X.force_expert_path("grouped"), jax.default_matmul_precision("default"):
        hlo = _compile_for_h200(lambda p, x: X.Experts(cfg, jnp.bfloat16).apply({"params": p}, x), params, x)
    calls = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?name = "(\w+)"', hlo)
    assert calls.count("grouped_matmul") == 3, calls  # gate, up, down
    assert not _all_expert_arrays(hlo, rows), _all_expert_arrays(hlo, rows)
    # the check itself: XLA:GPU's ragged_dot of the same rows broadcasts them over the experts
    ragged = _compile_for_h200(jax.lax.ragged_dot, jax.ShapeDtypeStruct((rows, H), jnp.bfloat16),
                               jax.ShapeDtypeStruct((E, H, I), jnp.bfloat16), jax.ShapeDtypeStruct((E,), jnp.int32))
    assert _all_expert_arrays(ragged, rows)
