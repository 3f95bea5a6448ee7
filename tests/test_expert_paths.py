"""The three expert paths (``dense``, ``grouped``, ``routed`` in both of its forms: looped and gathered) compute
the same layer, float and packed MXFP4, with gpt-oss's biases and clamped SwiGLU and with Qwen3-MoE's softmax
routing; the routed path on packed weights decodes only the routed experts; ``expert_path`` chooses per
platform; the router decides in float32.

Tiny layers (hidden 64, 8 experts, top-2), fp32 at HIGHEST matmul precision: each path within 1e-5 of the
largest output of the dense path (the paths sum the same products in different orders; measured <= 3e-7).
Dense itself is checked against transformers' blocks in tests/test_experts_block.py and the whole targets in
tests/test_target_parity.py / tests/test_mxfp4_packed.py."""

import contextlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import experts as X
from dflash_jax.models import mxfp4
from dflash_jax.models.config import ExpertsConfig
from dflash_jax.platform import compiling_for

H, E, I, K = 64, 8, 64, 2
GPT_OSS = dict(routing="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
               swiglu_limit=1.5)  # a low limit so that the clamps bite on these activations
QWEN3_MOE = dict(routing="softmax_topk", norm_topk_prob=True)
CONFIGS = {
    "gpt_oss_float": ExpertsConfig(E, K, I, **GPT_OSS),
    "gpt_oss_mxfp4": ExpertsConfig(E, K, I, weight_format="mxfp4", **GPT_OSS),
    "qwen3_moe": ExpertsConfig(E, K, I, **QWEN3_MOE),
}
# (path forced, routed form): the routed path in both of its forms, whatever this platform would pick.
VARIANTS = (("dense", None), ("grouped", None), ("routed", "looped"), ("routed", "gathered"))
# 2 x 7 tokens x top-2 = 28 pairs over 8 experts: experts repeat across tokens; 3 tokens x 2 = 6 <= 8 pairs:
# the routed path is chosen without forcing.
MANY, FEW = (2, 7), (1, 3)


@contextlib.contextmanager
def routed_form(form):
    """Trace the routed path in ``form`` ("looped", "gathered"; None: the platform's choice)."""
    saved = dict(X.ROUTED_LOOP)
    if form is not None:
        X.ROUTED_LOOP.update({(platform, packed): form == "looped" for platform in ("cpu", "gpu", "tpu")
                              for packed in (False, True)})
    try:
        yield
    finally:
        X.ROUTED_LOOP.clear()
        X.ROUTED_LOOP.update(saved)


def _params(cfg, seed=0):
    abstract = jax.eval_shape(lambda: X.Experts(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1, H)))["params"])
    rng = np.random.default_rng(seed)

    def draw(path, a):
        name = path[-1].key
        if a.dtype == jnp.uint8:  # MXFP4: random codes, scales 2 ** (s - 127) for s in [122, 126): weights <= 3
            return (rng.integers(0, 256, a.shape, dtype=np.uint8) if name.endswith("_blocks")
                    else rng.integers(122, 126, a.shape, dtype=np.uint8))
        scale = 0.1 if name.endswith("bias") else 0.2
        return (scale * rng.standard_normal(a.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.fixture(scope="module")
def outputs():
    """Every (config, variant, token shape) output, each variant compiled once per config and token shape."""
    rng = np.random.default_rng(1)
    xs = {shape: rng.standard_normal(shape + (H,)).astype(np.float32) for shape in (MANY, FEW)}
    out = {}
    with jax.default_matmul_precision("highest"):
        for name, cfg in CONFIGS.items():
            params = _params(cfg)
            for path, form in VARIANTS + (("auto", None),):
                with routed_form(form), X.force_expert_path(None if path == "auto" else path):
                    fn = jax.jit(lambda p, x: X.Experts(cfg).apply({"params": p}, x))
                    for shape, x in xs.items():
                        if path != "auto" or shape == FEW:
                            out[name, path, form, shape] = np.asarray(fn(params, x))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("shape", [MANY, FEW])
def test_every_path_equals_dense(outputs, name, shape):
    want = outputs[name, "dense", None, shape]
    scale = np.abs(want).max()
    assert scale > 0.1  # the layer computes something (not all-zero weights)
    for path, form in VARIANTS[1:]:
        got = outputs[name, path, form, shape]
        assert np.abs(got - want).max() <= 1e-5 * scale, (name, path, form, shape)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_routed_is_chosen_for_few_tokens_and_equals_dense(outputs, name):
    assert X.expert_path(FEW[0] * FEW[1], E, K) == "routed"
    want = outputs[name, "dense", None, FEW]  # "auto": this platform's path and form
    np.testing.assert_allclose(outputs[name, "auto", None, FEW], want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_repeated_experts_are_routed_per_pair():
    """Two tokens picking the same expert: routed (both forms) equals the per-pair reference in numpy."""
    cfg = CONFIGS["gpt_oss_float"]
    p = _params(cfg, seed=3)
    experts = X.StackedExperts(p["experts"], "float", jnp.float32, "experts")
    x = np.random.default_rng(4).standard_normal((3, H)).astype(np.float32)
    ids = np.array([[5, 1], [1, 5], [5, 2]], np.int32)  # expert 5 three times, 1 twice
    weights = np.array([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]], np.float32)
    w = {k: np.asarray(v) for k, v in p["experts"].items()}
    want = np.zeros((3, H), np.float32)
    for n in range(3):
        for j in range(2):
            e = ids[n, j]
            g, u = x[n] @ w["gate_proj"][e] + w["gate_proj_bias"][e], x[n] @ w["up_proj"][e] + w["up_proj_bias"][e]
            a = np.asarray(X.activate(jnp.asarray(g), jnp.asarray(u), cfg))
            want[n] += weights[n, j] * (a @ w["down_proj"][e] + w["down_proj_bias"][e])
    with jax.default_matmul_precision("highest"):
        for loop in (True, False):
            got = np.asarray(X.routed_experts(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(ids), experts, cfg,
                                              loop=loop))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _float_arrays(jaxpr, out=None):
    """Shapes of every float-typed value computed in ``jaxpr`` and its sub-jaxprs (loop bodies, pjit)."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                out.append(tuple(aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _float_arrays(sub, out)
    return out


@pytest.mark.parametrize("form", ["gathered", "looped"])
def test_routed_packed_decodes_only_the_routed_experts(form):
    """No float value of the routed layer holds a whole [E, ...] stack of decoded weights; the decoded weights
    it does hold are the N * k gathered experts (gathered form: every platform's choice for packed weights)
    or one expert at a time (looped form). The same check finds the E decoded experts in the dense path's
    trace (so it would fail if routed decoded them all)."""
    cfg = CONFIGS["gpt_oss_mxfp4"]
    params = _params(cfg)
    x = jnp.zeros(FEW + (H,), jnp.float32)
    pairs = FEW[0] * FEW[1] * K
    assert pairs != E

    def decoded(path):
        with routed_form(form), X.force_expert_path(path):
            jaxpr = jax.make_jaxpr(lambda p: X.Experts(cfg).apply({"params": p}, x))(params).jaxpr
        return [s for s in _float_arrays(jaxpr) if np.prod(s) >= H * I]  # whole matrices, at least one

    dense = decoded("dense")
    assert any(s[0] == E and np.prod(s) >= E * H * I for s in dense)
    routed = decoded("routed")
    assert routed and not any(s[0] == E for s in routed), routed
    if form == "looped":
        assert all(np.prod(s) <= H * I for s in routed), routed  # one expert's matrix per iteration
        assert {(I, H), (H, I)} <= set(routed)  # gate/up and down, decoded rows first
    else:
        assert all(s[0] == pairs for s in routed), routed
        assert {(pairs, I, H), (pairs, H, I)} <= set(routed)
    for platform in ("cpu", "gpu", "tpu"):
        assert not X.ROUTED_LOOP.get((platform, True), False)  # packed weights: the gathered form everywhere


def test_gathered_decode_equals_decoding_everything():
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (5, 48, 3, 16), dtype=np.uint8)
    scales = rng.integers(118, 130, (5, 48, 3), dtype=np.uint8)
    ids = np.array([[4, 0], [4, 4]])
    got = np.asarray(mxfp4.dequantize_rows_jax(blocks, scales, jnp.float32, ids=ids))
    whole = mxfp4.dequantize(blocks, scales)  # [E, in, out] on the host
    np.testing.assert_array_equal(got, np.swapaxes(whole, 1, 2)[ids])


def test_expert_path_per_platform():
    cases = {  # (tokens, experts, top_k): (cpu, gpu, tpu)
        (16, 128, 4): ("routed",) * 3,  # gpt-oss-120b, a 16-token verify block: 64 pairs of 128 experts
        (32, 128, 4): ("routed",) * 3,  # 128 pairs: the bound
        (33, 128, 4): ("grouped",) * 3,  # 33 x 128 > DENSE_LIMIT on CPU
        (16, 32, 4): ("dense", "grouped", "grouped"),  # gpt-oss-20b: 64 pairs > 32 experts
        (1, 32, 4): ("routed",) * 3,
        (1024, 4, 2): ("dense", "grouped", "grouped"),  # 4096 token x expert pairs: DENSE_LIMIT
        (2048, 4, 2): ("grouped",) * 3,
    }
    for (n, e, k), want in cases.items():
        for platform, path in zip(("cpu", "gpu", "tpu"), want):
            with compiling_for(platform):
                assert X.expert_path(n, e, k) == path, (n, e, k, platform)
                with X.force_expert_path("dense"):
                    assert X.expert_path(n, e, k) == "dense"
    with pytest.raises(ValueError, match="routed"):
        with X.force_expert_path("ragged"):
            pass


def test_router_decides_in_float32_whatever_the_compute_dtype():
    """bf16 layer: the router's product accumulates in float32 and top-k sees float32 values."""
    cfg = CONFIGS["gpt_oss_float"]
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), _params(cfg))
    x = jnp.zeros(FEW + (H,), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda p: X.Experts(cfg, jnp.bfloat16).apply({"params": p}, x))(params).jaxpr
    eqns = []

    def walk(j):
        for eqn in j.eqns:
            eqns.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr)
    top_k = [e for e in eqns if e.primitive.name == "top_k"]
    assert top_k and all(e.invars[0].aval.dtype == jnp.float32 for e in top_k)
    router = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (3, E)]
    assert router and all(e.params["preferred_element_type"] == jnp.float32 for e in router)
    out = X.Experts(cfg, jnp.bfloat16).apply({"params": params}, x)
    assert out.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss_mxfp4"])
def test_recorded_reads_follow_the_path(name):
    """What ``infer plan`` counts per expert layer (``recording_reads``): routed reads one expert per (token, k)
    pair; grouped over float weights at most the experts some pair uses (min(pairs, E)); dense, and grouped over
    packed MXFP4 (every expert decoded first), all E. Traced only (eval_shape), for 1 x 3 tokens (6 pairs) and
    2 x 7 (28 pairs) over 8 experts."""
    cfg = CONFIGS[name]
    params = _params(cfg)
    packed = cfg.weight_format == "mxfp4"
    for path in ("routed", "grouped", "dense"):
        for shape in (FEW, MANY):
            pairs = shape[0] * shape[1] * K
            with X.force_expert_path(path), X.recording_reads() as reads:
                jax.eval_shape(lambda p, x: X.Experts(cfg).apply({"params": p}, x), params,
                               jax.ShapeDtypeStruct(shape + (H,), jnp.float32))
            want = {"routed": pairs, "grouped": E if packed else min(pairs, E), "dense": E}[path]
            assert [(r.experts_read, r.routed_pairs, r.num_experts) for r in reads] == [(want, pairs, E)], (path, shape)


def test_the_selection_bias_stays_float32_in_bfloat16():
    """MiniMax-M2's / DeepSeek-V3's / GLM-5's ``e_score_correction_bias`` only chooses experts: declared float32
    under a bfloat16 model (a bfloat16 copy of 0.1 + 1e-3 differences flips near-tie choices)."""
    cfg = ExpertsConfig(E, K, I, routing="sigmoid_topk", selection_bias=True, norm_topk_prob=True)
    shapes = jax.eval_shape(lambda: X.Experts(cfg, jnp.bfloat16).init(jax.random.PRNGKey(0), jnp.zeros((1, 1, H))))
    params = shapes["params"]
    assert params["e_score_correction_bias"].dtype == jnp.float32
    assert params["gate"]["kernel"].dtype == jnp.bfloat16


def test_plan_expert_bytes_bound_the_busiest_device_by_brute_force():
    """``aot._expert_bytes``' busiest-device figure against every routing of a tiny round: 3 (token, expert)
    pairs over 8 experts on ``expert=4`` (2 experts a shard), each expert's rows split over ``tensor=2``. The
    grouped path reads each distinct expert of a shard once, the routed one reads one expert per pair, the dense
    one all of its shard's; the bound must equal the worst routing, and the mean the even spread."""
    import itertools
    import types

    from dflash_jax.aot import _expert_bytes

    mesh = types.SimpleNamespace(shape={"expert": 4, "tensor": 2})
    n_exp, pairs, size = 8, 3, 1000
    worst = {"grouped": 0, "routed": 0, "dense": 0}
    for routing in itertools.product(range(n_exp), repeat=pairs):
        for shard in range(4):
            own = [e for e in routing if e // 2 == shard]
            worst["grouped"] = max(worst["grouped"], len(set(own)))
            worst["routed"] = max(worst["routed"], len(own))
    worst["dense"] = 2
    for path, read in (("grouped", min(pairs, n_exp)), ("routed", pairs), ("dense", n_exp)):
        record = X.ExpertReads(n_exp, read, pairs, size, path)
        mean, routed, busiest = _expert_bytes([record], mesh)
        assert busiest == worst[path] * size // 2, path
        assert mean == read * size // 8 and routed == min(pairs, n_exp) * size // 8
        assert busiest >= mean
