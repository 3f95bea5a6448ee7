"""The fused-kernel form of attention (``layers.fused_attention`` over length-bounded segments) and its use in
the models and the engine, checked on CPU through XLA's implementation of the fused API (``--attention xla``):

- against a dense NumPy softmax (float64), tolerance 1e-5;
- the target's and the draft's cache forwards under the fused form against the loop (the independent path the
  PyTorch parity tests cover), tolerance 1e-5 on logits and caches;
- the shipped stories260K pair: identical tokens and acceptance lengths round by round with either kernel.

cuDNN itself runs only on a CUDA GPU (``scripts/gpu_check.sh`` runs this module there); here ``auto``'s choice
per platform is checked: on a GPU it falls back to ``xla`` (never the loop) where cuDNN refuses the shapes or is
missing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.generate import DecodeSettings
from dflash_jax.errors import UserError
from dflash_jax.models import attention_kernels, layers
from dflash_jax.models.cache import KVCache
from dflash_jax.models.draft import DraftModel, init_draft_cache, shared_head
from dflash_jax.models.attention_kernels import Segment, attention_kernel, fused_attention, resolve_kernel
from dflash_jax.platform import compiling_for
from dflash_jax.models.target import TargetModel, init_cache
from engine_tiny import tiny_draft, tiny_target

ON_GPU = jax.default_backend() == "gpu"


def _cpu_device_present() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:
        return False


# pallas: the TPU kernel, in Pallas's TPU interpret mode off a TPU. The interpreter runs its callbacks on a CPU
# device: on a GPU host JAX_PLATFORMS must list cpu beside cuda (scripts/gpu_check.sh does), else those tests skip.
INTERPRETER = _cpu_device_present()
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="Pallas's TPU interpreter needs a CPU device "
                                       "(JAX_PLATFORMS=cuda,cpu on a GPU host)")
KERNELS = ["xla"] + (["pallas"] if INTERPRETER else []) + (["cudnn"] if ON_GPU else [])
B, T, HQ, HKV, D = 3, 4, 4, 2, 16


def dense_reference(q, segments):
    """Softmax over the union of every segment's visible keys, float64, loop over rows/heads/queries."""
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(HQ):
            for t in range(T):
                keys, vals = [], []
                for k, v, lengths, causal in segments:
                    n = lengths[b] if not causal else min(lengths[b], t + 1)
                    keys.append(k[b, h // (HQ // HKV), :n])
                    vals.append(v[b, h // (HQ // HKV), :n])
                keys, vals = np.concatenate(keys).astype(np.float64), np.concatenate(vals).astype(np.float64)
                if len(keys) == 0:
                    continue
                s = keys @ q[b, t, h].astype(np.float64) * D**-0.5
                w = np.exp(s - s.max())
                out[b, t, h] = w / w.sum() @ vals
    return out


@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_attention_equals_dense_softmax(kernel):
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if kernel == "cudnn" else np.float32
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    cache = [rng.standard_normal((B, HKV, 40, D)).astype(np.float32) for _ in range(2)]
    block = [rng.standard_normal((B, HKV, T, D)).astype(np.float32) for _ in range(2)]
    # Row 0: a long prefix and a full block; row 1: no prefix and 2 valid block tokens; row 2: a prefix only.
    prefix, valid = np.array([37, 0, 5], np.int32), np.array([T, 2, 0], np.int32)
    segments = [(*cache, prefix, False), (*block, valid, True)]
    fn = jax.jit(lambda q, segs: fused_attention(q, [Segment(k, v, n, c) for (k, v, n), c in
                                                     zip(segs, (False, True))], kernel))
    got = fn(jnp.asarray(q, dtype), [tuple(jnp.asarray(x, dtype) if x.dtype != np.int32 else x for x in s[:3])
                                     for s in segments])
    want = dense_reference(q, segments)
    tol = 3e-2 if kernel == "cudnn" else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol)
    # A query that sees nothing (row 2 has no prefix here) gets zeros, not NaN.
    alone = fn(jnp.asarray(q, dtype), [(segments[0][0], segments[0][1], np.zeros(B, np.int32)),
                                       (segments[1][0], segments[1][1], np.zeros(B, np.int32))])
    assert not np.asarray(alone, np.float32).any()


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(), tiny_draft(block=T)


def precision_of(kernel):
    """cuDNN takes 16-bit inputs only: its checks run both kernels in bf16."""
    return (jnp.bfloat16, 0.03) if kernel == "cudnn" else (jnp.float32, None)


def assert_close(got, want, rel):
    """float32: elementwise within 1e-5. bf16 (``rel``): every layer rounds its activations, so elements of
    two exact-in-math implementations drift apart by ~0.1 on logits of a few units; the error relative to
    the whole tensor's norm stays ~1% (a wrong merge or mask is O(1))."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if rel is None:
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    else:
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error <= rel, f"relative error {error:.4f} > {rel}"


def cast(tree, dtype):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x,
                        tree)


def under(kernel, fn, *args):
    # Traced here, as a new function: jit's trace cache keys on the function, not on the kernel context.
    with attention_kernel(kernel):
        return jax.jit(lambda *a: fn(*a))(*args)


_LOOP_RESULTS = {}


def loop_reference(name, fn, *args):
    """``under("loop", fn, *args)``, computed once per ``name`` (a check and its dtype) for all the kernels
    compared with it: the inputs of a check are the same for every kernel (fixed seeds), so the loop's program
    is compiled once a module, not once a kernel."""
    if name not in _LOOP_RESULTS:
        _LOOP_RESULTS[name] = under("loop", fn, *args)
    return _LOOP_RESULTS[name]


@pytest.mark.parametrize("kernel", KERNELS)
def test_target_cache_forward_matches_the_loop(tiny, kernel):
    """A prefill of rows of different lengths (right padding), then a block after it with one row idle."""
    (tc, tp), _ = tiny
    dtype, tol = precision_of(kernel)
    model = TargetModel(tc, dtype)
    rng = np.random.default_rng(1)
    lengths = np.array([5, 12, 9])
    tokens = rng.integers(0, tc.vocab_size, (B, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), (B, 12))
    valid = np.arange(12)[None] < lengths[:, None]
    block = rng.integers(0, tc.vocab_size, (B, T)).astype(np.int32)
    block_pos = (lengths[:, None] + np.arange(T)).astype(np.int32)
    block_valid = np.array([True, True, False])[:, None] & np.ones((1, T), bool)

    def run(params):
        first = model.apply({"params": params}, tokens, positions, init_cache(tc, B, 40, dtype), valid)
        second = model.apply({"params": params}, block, block_pos, first.cache, block_valid)
        return first.logits, second.logits, second.cache

    want = loop_reference(("target", dtype), run, cast(tp, dtype))
    got = under(kernel, run, cast(tp, dtype))
    assert_close(np.asarray(got[0], np.float32)[valid], np.asarray(want[0], np.float32)[valid], tol)
    assert_close(got[1][:2], want[1][:2], tol)
    for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        assert_close(g, w, tol)


@pytest.mark.parametrize("kernel", KERNELS)
def test_draft_cache_forward_matches_the_loop(tiny, kernel):
    """A later round: rows whose cached context has different lengths, new context written in the same pass."""
    (tc, tp), (dc, dp) = tiny
    dtype, tol = precision_of(kernel)
    model = DraftModel(dc, dtype)
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((B, 6, len(dc.target_layer_ids) * tc.hidden_size)).astype(np.float32)
    old = np.array([10, 3, 0])  # context already cached per row
    ctx_pos = (old[:, None] + np.arange(6)).astype(np.int32)
    ctx_valid = np.arange(6)[None] < np.array([6, 2, 4])[:, None]
    anchor = old + ctx_valid.sum(1)
    block_pos = (anchor[:, None] + np.arange(T)).astype(np.int32)
    tokens = np.full((B, T), dc.mask_token_id, np.int32)
    tokens[:, 0] = rng.integers(0, tc.vocab_size, B)
    cache = init_draft_cache(dc, B, 40, dtype)
    cache = KVCache(tuple(jnp.asarray(rng.standard_normal(k.shape), k.dtype) for k in cache.keys),
                    tuple(jnp.asarray(rng.standard_normal(v.shape), v.dtype) for v in cache.values),
                    jnp.asarray(old, jnp.int32))
    shared = cast(shared_head(tp, tc.tie_word_embeddings), dtype)
    feats = jnp.asarray(feats, dtype)

    def run(params, cache):
        out = model.apply({"params": params}, tokens, block_pos, feats, ctx_pos, ctx_valid, cache, shared)
        return out.logits, out.cache

    want = loop_reference(("draft", dtype), run, cast(dp, dtype), cache)
    got = under(kernel, run, cast(dp, dtype), cache)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, tol)


def test_stories260k_pair_decodes_identically_with_the_fused_form():
    """The shipped demo pair (a real draft: acceptances of 1 to 5 here), prompts of different lengths: the same
    tokens and acceptance lengths, round by round (float32; on a GPU without the Pallas interpreter). 12 new
    tokens (up to 6 rounds a row): a round of the Pallas interpreter takes ~2 s on 2 cores, and 48 tokens (21
    rounds) took ~70 s."""
    from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET
    from dflash_jax.checkpoints.loading import load_draft_any, load_target_any
    from dflash_jax.engine.decoder import Decoder

    tc, tp = load_target_any(DEMO_TARGET)
    dc, dp = load_draft_any(DEMO_DRAFT)
    rng = np.random.default_rng(3)
    prompts = [[1] + rng.integers(3, 300, n).tolist() for n in (3, 20, 11)]
    results = {}
    kernels = ("xla",) if ON_GPU or not INTERPRETER else ("xla", "pallas")
    for kernel in ("loop",) + kernels:
        decoder = Decoder(tc, tp, dc, dp, attention=kernel)
        results[kernel] = decoder.generate(prompts, 12)
    for kernel in kernels:
        assert results[kernel].tokens == results["loop"].tokens, kernel
        assert results[kernel].accept_lengths == results["loop"].accept_lengths, kernel
    assert max(max(a) for a in results["loop"].accept_lengths) > 2  # the draft's context attention matters


@needs_interpreter
def test_pallas_kernel_walks_chunks_up_to_each_row_length_only(monkeypatch):
    """Chunks of 16 keys over 40 slots (the last chunk moved back to overlap the previous one), rows of 37, 3
    and 0 keys, NaN in every slot past a row's length: equal to the dense softmax, nothing stale read."""
    monkeypatch.setattr(attention_kernels, "PALLAS_KV_CHUNK", 16)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, 40, D)).astype(np.float32) for _ in range(2))
    lengths = np.array([37, 3, 0], np.int32)
    want = dense_reference(q, [(k, v, lengths, False)])
    for row, n in enumerate(lengths):
        k[row, :, n:] = np.nan
        v[row, :, n:] = np.nan
    got = jax.jit(lambda *a: fused_attention(a[0], [Segment(*a[1:])], "pallas"))(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_pallas_kernel_in_bfloat16():
    """What ``auto`` runs on a TPU: bf16 inputs, float32 scores and accumulators (tolerance of bf16 inputs)."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    cache = [rng.standard_normal((B, HKV, 24, D)).astype(np.float32) for _ in range(2)]
    block = [rng.standard_normal((B, HKV, T, D)).astype(np.float32) for _ in range(2)]
    prefix, valid = np.array([20, 0, 9], np.int32), np.array([T, 3, 1], np.int32)
    want = dense_reference(q, [(*cache, prefix, False), (*block, valid, True)])
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    got = jax.jit(lambda: fused_attention(bf(q), [Segment(bf(cache[0]), bf(cache[1]), prefix),
                                                  Segment(bf(block[0]), bf(block[1]), valid, True)], "pallas"))()
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


def test_auto_takes_each_platforms_kernel_and_never_the_loop_on_an_accelerator(monkeypatch):
    """``auto`` per platform traced for (``platform.compiling_for``): on a GPU cuDNN in 16 bits, falling back to
    ``xla`` (static shapes, never the data-dependent loop) where cuDNN refuses the shapes (NotImplementedError)
    or is missing (RuntimeError), and ``xla`` in float32 without asking cuDNN; on a TPU the Pallas kernel; on a
    CPU the loop. A fallback's result is exactly the ``xla`` kernel's."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((B, T, HQ, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((B, HKV, 24, D)), jnp.bfloat16) for _ in range(2))
    lengths = jnp.asarray([20, 7, 0], jnp.int32)
    visible = lambda pos: jnp.broadcast_to(pos[None, None] < lengths[:, None, None], (B, T, pos.shape[0]))  # noqa: E731

    def attend(query=q):
        return layers.cache_attention(query, k, v, visible, jnp.max(lengths), segments=[Segment(k, v, lengths)])

    with attention_kernel("xla"):
        want = np.asarray(attend(), np.float32)
    called = []

    def refuse(*_, error, **__):
        called.append(error)
        raise error("refused")

    with compiling_for("gpu"):
        for error in (NotImplementedError, RuntimeError):
            monkeypatch.setitem(attention_kernels._KERNELS, "cudnn", functools.partial(refuse, error=error))
            with attention_kernel("auto"):
                np.testing.assert_array_equal(np.asarray(attend(), np.float32), want)
        assert called == [NotImplementedError, RuntimeError]
        assert resolve_kernel("auto", jnp.float32) == "xla"
        with attention_kernel("auto"):
            attend(q.astype(jnp.float32))  # would raise through ``refuse`` if cuDNN were asked
    assert called == [NotImplementedError, RuntimeError]
    with compiling_for("tpu"):
        monkeypatch.setitem(attention_kernels._KERNELS, "pallas", functools.partial(refuse, error=NotImplementedError))
        with attention_kernel("auto"):
            np.testing.assert_array_equal(np.asarray(attend(), np.float32), want)
        assert called[-1] is NotImplementedError and len(called) == 3
        # Asked for by name, a kernel refusing the shapes is a clear error instead.
        with attention_kernel("pallas"), pytest.raises(UserError, match="kernel 'pallas' cannot run this attention"):
            attend()
    with compiling_for("cpu"):
        assert resolve_kernel("auto", jnp.bfloat16) == "loop"


def test_static_walk_off_the_cpu_has_no_data_dependent_loop():
    """Without segments (a ring-bounded draft layer), a kernel other than the loop walks every slot in a static
    number of chunks: the traced program holds no ``while`` (a ``scan`` at most), and the result equals the
    live-length loop's."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((B, T, HQ, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, HKV, 40, D)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([33, 7, 0], jnp.int32)
    visible = lambda pos: jnp.broadcast_to(pos[None, None] < lengths[:, None, None], (B, T, pos.shape[0]))  # noqa: E731

    def attend(live, kernel):  # the kernel is chosen at trace time: one traced function per kernel
        with attention_kernel(kernel):
            return layers.cache_attention(q, k, v, visible, live, chunk=16)

    results, programs = {}, {}
    for kernel in ("loop", "xla"):
        fn = functools.partial(attend, kernel=kernel)
        results[kernel] = np.asarray(jax.jit(fn)(jnp.max(lengths)))
        programs[kernel] = str(jax.make_jaxpr(fn)(jnp.max(lengths)))
    assert " while[" in programs["loop"] and " while[" not in programs["xla"]
    np.testing.assert_allclose(results["xla"], results["loop"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "cudnn"])
def test_sinks_join_a_fused_kernel_through_its_log_sum_exp(kernel):
    """gpt-oss's sinks (one logit per query head in every softmax's denominator) folded in after the kernel
    equal a float64 NumPy softmax with the sink as one more key of value zero (tolerance 1e-5)."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    cache = [rng.standard_normal((B, HKV, 24, D)).astype(np.float32) for _ in range(2)]
    block = [rng.standard_normal((B, HKV, T, D)).astype(np.float32) for _ in range(2)]
    sinks = rng.standard_normal(HQ).astype(np.float32) * 2
    prefix, valid = np.array([20, 0, 9], np.int32), np.array([T, 3, 0], np.int32)
    want = np.zeros(q.shape)
    for b in range(B):
        for h in range(HQ):
            for t in range(T):
                n_blk = min(valid[b], t + 1)
                keys = np.concatenate([cache[0][b, h // 2, :prefix[b]], block[0][b, h // 2, :n_blk]]).astype(np.float64)
                vals = np.concatenate([cache[1][b, h // 2, :prefix[b]], block[1][b, h // 2, :n_blk]]).astype(np.float64)
                s = np.concatenate([keys @ q[b, t, h].astype(np.float64) * D**-0.5, [sinks[h]]])
                w = np.exp(s - s.max())
                want[b, t, h] = (w / w.sum())[:-1] @ vals
    got = jax.jit(lambda: fused_attention(jnp.asarray(q), [Segment(*map(jnp.asarray, cache), jnp.asarray(prefix)),
                                                          Segment(*map(jnp.asarray, block), jnp.asarray(valid), True)],
                                          kernel, jnp.asarray(sinks)))()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_bad_kernel_names_are_refused():
    with pytest.raises(UserError, match="unknown attention kernel 'flash'.*auto, loop, cudnn, pallas, xla"):
        DecodeSettings(max_new_tokens=4, attention="flash")

    if not ON_GPU:
        with pytest.raises(UserError, match="'cudnn' needs a CUDA GPU; this process runs on cpu"):
            DecodeSettings(max_new_tokens=4, attention="cudnn")
    with compiling_for("gpu"), pytest.raises(UserError, match="'pallas' is the TPU kernel; on a GPU choose cudnn"):
        DecodeSettings(max_new_tokens=4, attention="pallas")


@needs_interpreter
def test_segments_a_tpu_kernel_cannot_tile_go_to_xla_with_the_same_result():
    """On a TPU a segment whose width is not whole 16-row tiles (a 10-key verify block, one key) is computed by
    XLA in the kernel's grouped layout (``_grouped_xla``): the same outputs and log-sum-exps as the kernel in
    interpret mode (which has no tiles), causal or not, for rows with no visible key too (1e-5, float32)."""
    rng = np.random.default_rng(9)
    for slots in (10, 1):
        q = rng.standard_normal((B, HKV, 2 * slots, D)).astype(np.float32)  # 2 query heads per KV head x slots
        k, v = (rng.standard_normal((B, HKV, slots, D)).astype(np.float32) for _ in range(2))
        lengths = np.array([slots, slots // 2, 0], np.int32)
        for causal in (False, True):
            out, lse = attention_kernels._grouped_xla(q, k, v, lengths, causal)
            want_out, want_lse = attention_kernels._kernel_pallas(q, k, v, lengths, causal, interpret=True)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-5, rtol=1e-5)
            seen = np.asarray(lengths > 0)
            np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], atol=1e-5, rtol=1e-5)
