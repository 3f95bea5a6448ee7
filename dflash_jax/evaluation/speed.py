"""Where DFlash's time goes on this machine: per-component timings, end-to-end decode and the speedup bound.

Everything is measured in ONE process on the current default device with jitted functions: each function is
compiled first (compile time is reported, never counted), run once untimed, then timed ``repeats`` times with
``jax.block_until_ready``; the median is reported. Functions that write a KV cache take it as a donated
argument, as the decode loop does, and every repetition gets a fresh copy made outside the timed region, so
each repetition does the same work at the same context length.

Components (batch ``b``, block ``B``, a cache holding ``context`` tokens):

- ``ar_step``: the target on 1 token (logits + argmax, cache write), as one autoregressive step;
- ``verify``: the target on ``B`` tokens with the draft's feature layers (one DFlash verification);
- ``draft``: one draft forward over ``[anchor, mask x (B-1)]`` that also writes the previous round's ``B``
  context features into the draft cache (as in every round);
- ``round``: a full DFlash round, :func:`dflash_jax.engine.generate.decode_round` with the DFlash proposer;
- ``ar_round``: an autoregressive round (the same function with :class:`NoProposer`).

End to end, :func:`dflash_jax.engine.generate.generate` decodes the same prompts autoregressively, with an
ORACLE proposer (the autoregressive output, with an error planted every ``tau`` positions so that every round
accepts exactly ``tau - 1`` drafts plus the bonus token: DFlash's round structure at a chosen acceptance
length, without any draft cost), and with the real DFlash draft. Greedy outputs must equal the
autoregressive output token for token.

A round of a draft reaching acceptance length ``tau`` replaces ``tau`` autoregressive steps by one
verification and one draft forward, so the speedup is bounded by ``tau * t(ar_step) / (t(verify) +
t(draft))``; the oracle pays no draft, so its bound is ``tau * t(ar_step) / t(verify)``. The report compares
each measured speedup with its matching bound.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints.hf_target import abstract_target_params
from dflash_jax.checkpoints.official_draft import abstract_draft_params
from dflash_jax.engine.adaptive import rounds_per_width
from dflash_jax.engine.generate import (
    DecodeSettings, GenerationResult, jitted_functions, decode_round, generate, prompt_width, cache_slots,
    verify_span,
)
from dflash_jax.engine.proposers import NoProposer, OracleProposer, make_proposer
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.errors import UserError
from dflash_jax.evaluation.machine import load_average, machine_info
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.experts import DENSE_LIMIT
from dflash_jax.models.init import random_params
from dflash_jax.models.draft import shared_head
from dflash_jax.models.draft_config import DraftConfig, default_target_layer_ids
from dflash_jax.models.attention_kernels import attention_kernel, resolve_kernel
from dflash_jax.models.gated_deltanet import committed_state
from dflash_jax.models.target import TargetModel

# --------------------------------------------------------------------------------------------------------
# Random-weight models from shapes


@dataclasses.dataclass(frozen=True)
class ShapePreset:
    """A Qwen3-style target and a DFlash draft shaped like it (same width, heads and MLP)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_layers: int
    description: str
    feature_layers: tuple[int, ...] | None = None  # None: the default rule for the draft depth


SHAPE_PRESETS = {
    "tiny": ShapePreset(64, 2, 4, 2, 16, 128, 256, 1,
                        "hidden 64, 2 layers, vocab 256; draft 1 layer reading target layer 0 (quick)",
                        feature_layers=(0,)),
    "small": ShapePreset(512, 8, 8, 4, 64, 1536, 32000, 2,
                         "hidden 512, 8 layers, 8/4 heads of 64, MLP 1536, vocab 32000; draft 2 layers"),
}
PAIRING_PRESETS = {
    "qwen3-8b": "qwen3-8b-dflash-b16",
    "qwen3-4b": "qwen3-4b-dflash-b16",
}


@dataclasses.dataclass(frozen=True)
class CutPreset:
    """A pairing's target and draft at their real widths, heads, experts and vocabulary, the target cut to its
    first ``target_layers`` layers (so that it fits a CPU's memory in float32); the draft keeps its own depth
    and reads the same number of feature layers, spread over the cut target."""

    pairing: str
    target_layers: int
    note: str


CUT_PRESETS = {
    "qwen3-coder-30b-a3b": CutPreset(
        "qwen3-coder-30b-a3b-dflash-b16", 2,
        "hidden 2048, 32/4 heads of 128, 128 experts top-8 of width 768, vocab 151936; draft 8 layers"),
    "gpt-oss-20b": CutPreset(
        "gpt-oss-20b-dflash-b8", 2,
        "hidden 2880, 64/8 heads of 64, 32 experts top-4 of width 2880, sinks, window 128 on even layers, "
        "vocab 201088; draft 8 layers, block 8"),
    "gpt-oss-120b": CutPreset(
        "gpt-oss-120b-dflash-b10", 2,
        "hidden 2880, 64/8 heads of 64, 128 experts top-4 of width 2880, sinks, window 128 on even layers, "
        "vocab 201088; draft 8 layers, block 10"),
    # Hybrids: 4 layers keep one of each kind (three Gated DeltaNet layers, then a gated full-attention layer).
    "qwen3.5-4b": CutPreset(
        "qwen3.5-4b-dflash-b16", 4,
        "hidden 2560, Gated DeltaNet 16/32 heads of 128 on 3 layers in 4, gated attention 16/4 heads of 256 with "
        "64 rotary dims, MLP 9216, tied vocab 248320; draft 6 layers"),
    "qwen3.5-35b-a3b": CutPreset(
        "qwen3.5-35b-a3b-dflash-b16", 4,
        "hidden 2048, Gated DeltaNet 16/32 heads of 128 on 3 layers in 4, gated attention 16/2 heads of 256, "
        "256 experts top-8 of width 512 plus a shared expert, vocab 248320; draft 8 layers"),
}
PRESETS = tuple(SHAPE_PRESETS) + tuple(PAIRING_PRESETS) + tuple(CUT_PRESETS)


def preset_description(name: str, target_layers: int | None = None) -> str:
    if name in SHAPE_PRESETS:
        return SHAPE_PRESETS[name].description
    if name in CUT_PRESETS:
        c = CUT_PRESETS[name]
        from dflash_jax.configs import load_pairing

        full = load_pairing(c.pairing).target.num_hidden_layers
        layers = c.target_layers if target_layers is None else target_layers
        cut = "all" if layers == full else f"the first {layers}"
        return (f"the real widths of configs/{c.pairing}.yaml, target cut to {cut} of its {full} layers "
                f"({c.note}), random weights")
    return f"the real shapes of configs/{PAIRING_PRESETS[name]}.yaml (36 layers; draft 5 layers), random weights"


def cut_target(target: TargetConfig, draft: DraftConfig, layers: int) -> tuple[TargetConfig, DraftConfig]:
    """``target`` with only its first ``layers`` layers (the per-layer plan cut alike: expert layers, windows)
    and ``draft`` re-pointed at it: as many feature layers as before, spread over layers ``0 .. layers-2``
    (never the last one, which SGLang/vLLM cannot serve; repeated when the cut target has fewer layers than
    the draft has features, which keeps the draft's fusion width). ``layers`` equal to the target's depth
    returns both unchanged."""
    full = target.num_hidden_layers
    if not 2 <= layers <= full:
        raise UserError(f"target layers must be between 2 and the target's {full}, got {layers}")
    if layers == full:
        return target, draft
    cut = dataclasses.replace(
        target, num_hidden_layers=layers,
        expert_layers=tuple(i for i in target.expert_layers if i < layers),
        layer_windows=target.layer_windows[:layers],
        linear_layers=tuple(i for i in target.linear_layers if i < layers))
    if not cut.attention_layers:
        raise UserError(f"the first {layers} layers of this target are all linear attention; keep at least one "
                        f"full-attention layer (the first is layer {target.attention_layers[0]})")
    ids = tuple(int(i) for i in np.linspace(0, layers - 2, draft.num_features).round())
    return cut, dataclasses.replace(draft, num_target_layers=layers, target_layer_ids=ids)


def preset_configs(name: str, block_size: int | None = None, draft_layers: int | None = None,
                   target_layers: int | None = None, experts: str = "dequantize") -> tuple[TargetConfig, DraftConfig]:
    target, draft = _preset_configs(name, block_size, draft_layers, target_layers)
    if experts != "dequantize":
        from dflash_jax.checkpoints.expert_layouts import with_packed_experts

        try:
            target = with_packed_experts(target, experts, source=f"preset {name}")
        except Exception as e:  # a CheckpointError about a checkpoint reads as a usage error here
            raise UserError(str(e)) from None
    return target, draft


def _preset_configs(name: str, block_size: int | None = None, draft_layers: int | None = None,
                    target_layers: int | None = None) -> tuple[TargetConfig, DraftConfig]:
    """Target and draft configs of a preset. Shape presets get a draft whose ``block_size`` is the requested
    block (default 16); pairing presets keep the released draft's config (block 16); cut presets keep the
    pairing's draft and cut the target to ``target_layers`` (default: the preset's)."""
    if target_layers is not None and name not in CUT_PRESETS:
        raise UserError(f"target_layers applies to the cut presets ({', '.join(CUT_PRESETS)}), not to {name!r}")
    if name in PAIRING_PRESETS or name in CUT_PRESETS:
        from dflash_jax.configs import load_pairing

        if draft_layers is not None:
            raise UserError(f"draft_layers applies to the shape presets ({', '.join(SHAPE_PRESETS)}), "
                             f"not to {name!r}, whose draft is the released one's shape")
        if name in PAIRING_PRESETS:
            pairing = load_pairing(PAIRING_PRESETS[name])
            return pairing.target, pairing.draft
        c = CUT_PRESETS[name]
        pairing = load_pairing(c.pairing)
        return cut_target(pairing.target, pairing.draft, c.target_layers if target_layers is None else target_layers)
    if name not in SHAPE_PRESETS:
        raise UserError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    p = SHAPE_PRESETS[name]
    target = TargetConfig.from_dict(dict(
        model_type="qwen3", vocab_size=p.vocab_size, hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size, num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=False,
    ), source=f"preset {name}")
    layers = p.draft_layers if draft_layers is None else draft_layers
    if layers < 1:
        raise UserError(f"draft_layers must be at least 1, got {layers}")
    ids = p.feature_layers if draft_layers is None else None
    if ids is None and len(set(default_target_layer_ids(p.num_hidden_layers, layers))) < layers:
        # Spread over all but the last layer (a draft reading the last one is not servable: SPEC section 3).
        ids = tuple(int(i) for i in np.linspace(0, p.num_hidden_layers - 2, layers).round())
    draft = DraftConfig.for_target(target, num_layers=layers, block_size=max(2, block_size or 16),
                                   target_layer_ids=ids)
    return target, draft


def preset_models(name: str, block_size: int | None = None, dtype: Any = jnp.float32, seed: int = 0,
                  draft_layers: int | None = None, target_layers: int | None = None,
                  experts: str = "dequantize") -> tuple[TargetConfig, dict, DraftConfig, dict]:
    target, draft = preset_configs(name, block_size, draft_layers, target_layers, experts)
    if block_size is not None and not 2 <= block_size <= draft.block_size:
        raise UserError(f"block_size {block_size} must be between 2 and the draft's block_size {draft.block_size}")
    target_params = random_params(abstract_target_params(target, dtype), seed,
                                  zero_centered_norms=target.zero_centered_norms,
                                  final_norm_plain=target.final_norm_plain)
    draft_params = random_params(abstract_draft_params(draft, dtype), seed + 1)
    return target, target_params, draft, draft_params


# --------------------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass
class Timing:
    name: str
    compile_s: float
    times_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    def to_dict(self) -> dict:
        return {"median_ms": self.median_s * 1e3, "min_ms": self.min_s * 1e3,
                "times_ms": [t * 1e3 for t in self.times_s], "compile_s": self.compile_s}


def fresh_copy(tree: Any) -> Any:
    """A copy on device with new buffers (what a donated argument consumes); no compiled program needed."""
    return jax.block_until_ready(jax.tree.map(lambda x: jax.device_put(x, may_alias=False), tree))


class Bench:
    """One jitted function, compiled and warmed up at construction; :meth:`run_once` times one call on fresh
    copies of ``template`` (donated when ``donate``), made outside the timed region."""

    def __init__(self, name: str, fn: Callable, fixed: Sequence[Any], template: Sequence[Any],
                 donate: bool = True, warmup: int = 2):
        n = len(fixed)
        jitted = jax.jit(fn, donate_argnums=tuple(range(n, n + len(template))) if donate else ())
        t0 = time.perf_counter()
        self.compiled = jitted.lower(*fixed, *template).compile()
        self.timing = Timing(name, time.perf_counter() - t0, [])
        self.fixed, self.template = tuple(fixed), tuple(template)
        # The first runs of a fresh XLA:CPU executable are several times slower than later ones.
        self.out = None
        for _ in range(warmup):
            self.out = jax.block_until_ready(self.compiled(*self.fixed, *fresh_copy(self.template)))

    def run_once(self) -> float:
        args = fresh_copy(self.template)
        t0 = time.perf_counter()
        self.out = jax.block_until_ready(self.compiled(*self.fixed, *args))
        dt = time.perf_counter() - t0
        self.timing.times_s.append(dt)
        return dt


def measure_interleaved(benches: Sequence[Bench], repeats: int) -> dict[str, Timing]:
    """Time every bench ``repeats`` times, round-robin, so that a slow spell of the machine (other processes,
    frequency changes) hits every component alike instead of one."""
    for _ in range(repeats):
        for b in benches:
            b.run_once()
    return {b.timing.name: b.timing for b in benches}


# --------------------------------------------------------------------------------------------------------
# The benchmark


@dataclasses.dataclass(frozen=True)
class SpeedSettings:
    batch: int = 1
    block_size: int = 16
    context: int = 256
    new_tokens: int = 128
    tau: int = 4
    repeats: int = 10
    e2e_repeats: int = 1
    seed: int = 0
    dtype: Any = jnp.float32
    cache_slots: int | None = None  # component timings only: preallocate at least this many cache slots
    adaptive_widths: tuple[int, ...] = ()  # also decode end to end with these adaptive widths (oracle and draft)
    attention: str = "auto"  # the attention kernel (DecodeSettings.attention)
    draft_window: int | None = None  # DraftModel.draft_window: the draft's context bound (None: its own layers')
    tree_budget: int = 0  # also decode end to end with a verified tree of this many nodes (oracle and draft)
    # Prefill in chunks of this many tokens (DecodeSettings.prefill_chunk; None: the engine's default). Prefills
    # only fill the caches here (their time is not a figure of the report), so this changes no measured figure.
    prefill_chunk: int | None = None

    def decode_settings(self, mesh: Any = None) -> DecodeSettings:
        chunk = {} if self.prefill_chunk is None else {"prefill_chunk": self.prefill_chunk}
        return DecodeSettings(max_new_tokens=self.new_tokens, mesh=mesh, attention=self.attention, **chunk)

    def validate(self) -> None:
        checks = [
            (self.batch >= 1, f"batch must be at least 1, got {self.batch}"),
            (self.block_size >= 2, f"block_size must be at least 2, got {self.block_size}"),
            (self.context >= self.block_size,
             f"context ({self.context}) must be at least block_size ({self.block_size}): the draft "
             "timing rewrites the last block of context features"),
            (self.new_tokens >= 2, f"new_tokens must be at least 2, got {self.new_tokens}"),
            (1 <= self.tau <= self.block_size,
             f"tau must be between 1 and block_size ({self.block_size}), got {self.tau}"),
            (self.repeats >= 1, f"repeats must be at least 1, got {self.repeats}"),
            (self.e2e_repeats >= 1, f"e2e_repeats must be at least 1, got {self.e2e_repeats}"),
            (self.prefill_chunk is None or self.prefill_chunk >= 1,
             f"prefill_chunk must be at least 1, got {self.prefill_chunk}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)


def dense_prefill_chunk(tc: TargetConfig) -> int | None:
    """For a mixture-of-experts target, the widest power-of-two prefill chunk whose expert layers take the
    ``dense`` path on CPU (``models/experts.DENSE_LIMIT`` token x expert pairs); None for other targets. A wider
    prefill takes the ``grouped`` path, which XLA:CPU expands into an ``[experts, rows, in]`` copy of each
    projection's input (4 GiB in float32 per projection for Qwen3.5-35B-A3B's 256 experts at 256 tokens) plus a
    transposed copy of every expert weight; chunks keep the prefill's temporaries at those of a verification."""
    if tc.experts is None:
        return None
    chunk = 1
    while 2 * chunk * tc.experts.num_experts <= DENSE_LIMIT:
        chunk *= 2
    return chunk


def device_peak_gib() -> float | None:
    """The most memory the first local accelerator has held so far (``memory_stats``' peak), in GiB; None on a
    CPU or where the runtime does not report it."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux ``ru_maxrss``, KiB), in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def random_prompts(vocab_size: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(batch)]


def plant_errors(prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], tau: int, block: int,
                 width: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference tokens by absolute position (prompt + greedy continuation) and the positions to corrupt so
    that every round accepts exactly ``tau`` tokens (``tau - 1`` drafts + the bonus): an error at every
    ``tau``-th position after the first anchor (none when ``tau == block``: every round is full)."""
    reference = np.zeros((len(prompts), width), np.int32)
    errors = np.zeros((len(prompts), width), bool)
    for b, (p, gen) in enumerate(zip(prompts, continuations)):
        seq = list(p) + list(gen)
        reference[b, : len(seq)] = seq
        if tau < block:
            errors[b, len(p) + tau:: tau] = True
    return reference, errors


def first_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> str | None:
    for row, (x, y) in enumerate(zip(a, b)):
        if x != y:
            i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"row {row} differs from token {i} on ({len(x)} vs {len(y)} tokens)"
    return None


def component_timings(tc: TargetConfig, tp: dict, dc: DraftConfig, dp: dict, s: SpeedSettings,
                      prompts: list[list[int]]) -> dict[str, Timing]:
    dtype, b = s.dtype, s.batch
    block = make_proposer(dc, s.block_size, dtype).block_size  # the engine's block (a DSpark draft's + 1)
    target = TargetModel(tc, dtype)
    settings = s.decode_settings()
    width = prompt_width(s.context, s.new_tokens, tc.max_position_embeddings)
    tokens = np.zeros((b, width), np.int32)
    tokens[:, : s.context] = np.asarray(prompts, np.int32)
    lengths = np.full((b,), s.context, np.int32)
    key = jax.random.PRNGKey(s.seed)

    # Caches filled by real prefills, with the slot counts generate() uses for each mode.
    # cache_slots > what the run needs shows that a round's cost follows the live length, not the slots.
    extra_slots = s.cache_slots or 0
    slots = max(cache_slots(s.context, s.new_tokens, block, tc.max_position_embeddings), extra_slots)

    def prefilled(window):
        prop = make_proposer(dc, s.block_size, dtype, window)
        consts, pstate = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), b, slots)
        pre, _ = jitted_functions(tc, prop, settings, slots, dtype)
        return prop, consts, jax.block_until_ready(pre(tp, consts, pstate, tokens, lengths, key))

    prop, consts, state0 = prefilled(None)  # the draft's own layers; with a draft window also timed bounded
    ar_prop = NoProposer()
    ar_slots = max(cache_slots(s.context, s.new_tokens, 1, tc.max_position_embeddings), extra_slots)
    ar_pre, _ = jitted_functions(tc, ar_prop, settings, ar_slots, dtype)
    ar_state0 = jax.block_until_ready(ar_pre(tp, *ar_prop.init(), tokens, lengths, key))
    start = state0.start  # [b] = context: the first anchor's position

    def ar_step(params, cache, token, pos):
        out = target.apply({"params": params}, token[:, None], pos[:, None], cache)
        return jnp.argmax(out.logits[:, -1], axis=-1), out.cache

    benches = [Bench("ar_step", lambda p, t, q, c: ar_step(p, c, t, q), (tp, ar_state0.anchor, ar_state0.start),
                     (ar_state0.cache,))]

    rng = np.random.default_rng(s.seed + 7)
    block_tokens = jnp.asarray(rng.integers(0, tc.vocab_size, (b, block)), jnp.int32)
    block_positions = start[:, None] + jnp.arange(block, dtype=jnp.int32)[None]

    def verify(params, toks, pos, cache):
        out = target.apply({"params": params}, toks, pos, cache, feature_layers=dc.target_layer_ids)
        return jnp.argmax(out.logits, axis=-1), out.features, out.cache

    benches.append(Bench("verify", verify, (tp, block_tokens, block_positions), (state0.cache,)))
    features = benches[-1].out[1]
    if tc.linear_layers:
        # Hybrid targets: the rollback of every Gated DeltaNet layer to an accepted prefix (half the block here),
        # as the next forward forms it from the verified block's terms (models/gated_deltanet.committed_state).
        verified = benches[-1].out[2].with_lengths(start + block // 2)

        def rollback(cache):
            return [committed_state(state, cache.lengths) for state in cache.linear]

        benches.append(Bench("rollback", rollback, (), (verified,), donate=False))

    # The previous round's B verified positions (here the last B of the context) are written in the forward.
    ctx = (features, start[:, None] - block + jnp.arange(block, dtype=jnp.int32)[None], jnp.ones((b, block), bool))
    draft_key = jax.random.PRNGKey(s.seed + 1)

    def draft_of(prop):
        def draft(draft_consts, ctx_, anchor, st, pstate_):
            drafts, _, new = prop.propose(draft_consts, pstate_, ctx_, anchor, st, draft_key, SamplingConfig())
            return drafts, new

        return draft

    # A whole round (the first after prefill); params and draft constants are not donated.
    def round_of(prop):
        return lambda params, draft_consts, state: decode_round(tc, prop, settings, params, draft_consts, state,
                                                                dtype=dtype)

    benches.append(Bench("draft", draft_of(prop), (consts, ctx, state0.anchor, start), (state0.proposer,)))
    benches.append(Bench("round", round_of(prop), (tp, consts), (state0,)))
    if s.draft_window is not None:  # the same with the draft's context bounded, timed in the same rounds
        prop_w, consts_w, state_w = prefilled(s.draft_window)
        benches.append(Bench("draft_window", draft_of(prop_w), (consts_w, ctx, state_w.anchor, start),
                             (state_w.proposer,)))
        benches.append(Bench("round_window", round_of(prop_w), (tp, consts_w), (state_w,)))

    def ar_round(params, state):
        return decode_round(tc, ar_prop, settings, params, {}, state, dtype=dtype)

    benches.append(Bench("ar_round", ar_round, (tp,), (ar_state0,)))
    return measure_interleaved(benches, s.repeats)


@dataclasses.dataclass
class E2E:
    name: str
    results: list[GenerationResult]
    warmup_decode_s: float = float("nan")  # the first run after compiling (not counted)
    # Where a timed run's tokens first differ from the warm-up run's (None: every run gave the same tokens).
    # Seen on an H200 (XLA:GPU, bfloat16, random weights whose logits are full of near-ties): the same
    # executable gave other tokens on its second run.
    repeat_mismatch: str | None = None

    @property
    def first(self) -> GenerationResult:
        return self.results[0]

    @property
    def decode_s(self) -> float:
        return statistics.median(r.decode_s for r in self.results)

    @property
    def decoded(self) -> int:
        """Tokens produced by the decode loop (the first token of each row comes from the prefill)."""
        r = self.first
        return r.num_tokens - len(r.tokens)

    @property
    def rounds(self) -> int:
        """Rounds of all rows together."""
        return int(sum(self.first.rounds))

    @property
    def tokens_per_round(self) -> float:
        return self.decoded / self.rounds if self.rounds else float("nan")

    @property
    def loop_iterations(self) -> int:
        return int(max(self.first.rounds))

    def to_dict(self) -> dict:
        r = self.first
        return {
            "decode_s": self.decode_s, "decode_s_all": [x.decode_s for x in self.results],
            "warmup_decode_s": self.warmup_decode_s,
            "prefill_s": r.prefill_s, "compile_s": r.compile_s, "tokens": r.num_tokens,
            "decoded_tokens": self.decoded, "rounds": self.rounds, "loop_iterations": self.loop_iterations,
            "tokens_per_s": self.decoded / self.decode_s,
            "tau": r.tau, "tokens_per_round": self.tokens_per_round, "accept_lengths": r.accept_lengths,
        }


def run_e2e(runs: dict[str, Callable[[], GenerationResult]], repeats: int,
            log: Callable[[str], None] = lambda _: None,
            warm: dict[str, GenerationResult] | None = None) -> dict[str, E2E]:
    """One untimed warm-up generation per mode (it compiles, and the first run of a fresh executable is
    slow: on XLA:CPU several times slower than the next), then ``repeats`` timed generations per mode,
    round-robin (served from the compile cache). ``warm`` holds warm-up results already obtained. A timed run
    whose tokens differ from its warm-up's is kept (the timings stand) and recorded as ``repeat_mismatch``."""
    warm = dict(warm or {})
    for name, fn in runs.items():
        if name not in warm:
            log(f"end to end: compiling and warming up '{name}' ...")
            warm[name] = fn()
    results: dict[str, list[GenerationResult]] = {name: [] for name in runs}
    mismatches: dict[str, str | None] = dict.fromkeys(runs)
    log(f"end to end: {repeats} timed generation(s) per mode ...")
    for _ in range(repeats):
        for name, fn in runs.items():
            r = fn()
            mismatches[name] = mismatches[name] or first_difference(r.tokens, warm[name].tokens)
            r.compile_s = warm[name].compile_s
            results[name].append(r)
    return {name: E2E(name, rs, warm[name].decode_s, mismatches[name]) for name, rs in results.items()}


def run_speed(tc: TargetConfig, tp: dict, dc: DraftConfig, dp: dict, s: SpeedSettings,
              log: Callable[[str], None] = lambda _: None, mesh: Any = None) -> dict:
    """The whole benchmark; returns a JSON-ready report (see :func:`format_report`). With ``mesh`` the
    params are placed by the sharding rules and every end-to-end decode runs sharded over it."""
    s.validate()
    make_proposer(dc, s.block_size, s.dtype, s.draft_window)  # validates the block size against the draft
    prompts = random_prompts(tc.vocab_size, s.batch, s.context, s.seed)
    if mesh is not None:
        from dflash_jax import sharding

        tp, dp = (jax.device_put(tree, sharding.tree_shardings(tree, mesh)) for tree in (tp, dp))
    settings = s.decode_settings(mesh)
    adaptive = dataclasses.replace(settings, adaptive_widths=s.adaptive_widths)
    tree = dataclasses.replace(settings, tree_budget=s.tree_budget)
    t_start = time.perf_counter()
    machine = machine_info()  # the load average at the start

    log("timing components (ar_step, verify, draft, round, ar_round) ...")
    with attention_kernel(s.attention, mesh):  # the component programs are traced here, outside generate()
        comp = component_timings(tc, tp, dc, dp, s, prompts)
    # Logged at once: a run stopped later (a device lent for minutes) still leaves the components' figures.
    log("components, median ms: " + ", ".join(f"{k} {v.median_s * 1e3:.3f}" for k, v in comp.items()))

    log("end to end: the autoregressive reference output ...")
    run_ar = lambda: generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings,  # noqa: E731
                              seed=s.seed, dtype=s.dtype)
    ar_warm = run_ar()
    reference_tokens = ar_warm.tokens
    prop = make_proposer(dc, s.block_size, s.dtype, s.draft_window).on_mesh(mesh)
    block = prop.block_size  # the engine's block (a DSpark draft's + 1)
    width = cache_slots(s.context, s.new_tokens, verify_span(tree, block), tc.max_position_embeddings)
    reference, errors = plant_errors(prompts, reference_tokens, s.tau, block, width)
    oracle = OracleProposer(block, tc.vocab_size)
    ostate = oracle.init(jnp.asarray(reference), jnp.asarray(errors))
    pstate = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), s.batch, width)
    modes = {
        "autoregressive": run_ar,
        "oracle": lambda: generate(tc, tp, prompts, oracle, ostate, settings, seed=s.seed, dtype=s.dtype),
        "draft": lambda: generate(tc, tp, prompts, prop, pstate, settings, seed=s.seed, dtype=s.dtype),
    }
    if s.adaptive_widths:
        modes["oracle_adaptive"] = lambda: generate(tc, tp, prompts, oracle, ostate, adaptive, seed=s.seed,
                                                    dtype=s.dtype)
        modes["draft_adaptive"] = lambda: generate(tc, tp, prompts, prop, pstate, adaptive, seed=s.seed,
                                                   dtype=s.dtype)
    if s.tree_budget:  # the oracle's tree offers its alternative at every position: it passes planted errors
        modes["oracle_tree"] = lambda: generate(tc, tp, prompts, oracle, ostate, tree, seed=s.seed, dtype=s.dtype)
        modes["draft_tree"] = lambda: generate(tc, tp, prompts, prop, pstate, tree, seed=s.seed, dtype=s.dtype)
    runs = run_e2e(modes, s.e2e_repeats, log, warm={"autoregressive": ar_warm})
    ar = runs["autoregressive"]

    t = {k: v.median_s for k, v in comp.items()}
    tau = float(s.tau)
    bounds = {
        "with_draft": tau * t["ar_step"] / (t["verify"] + t["draft"]),
        "without_draft": tau * t["ar_step"] / t["verify"],
        "rounds": tau * t["ar_round"] / t["round"],
    }
    e2e = {}
    for run in runs.values():
        kind = None if run.name == "autoregressive" else "without_draft" if "oracle" in run.name else "with_draft"
        d = run.to_dict()
        if run.first.widths is not None:
            d["widths"] = rounds_per_width(run.first.widths)
            d["width_costs"] = run.first.width_costs
        d["speedup"] = ar.decode_s / run.decode_s
        mismatch = first_difference(run.first.tokens, ar.first.tokens)
        d["identical_to_ar"] = mismatch is None
        d["mismatch"] = mismatch
        d["repeat_mismatch"] = run.repeat_mismatch  # None: every timed run gave its warm-up's tokens
        if kind is not None and "tree" not in run.name:  # a tree's verify is wider than the timed block
            cost = t["verify"] + (t["draft"] if kind == "with_draft" else 0.0)
            d["bound_kind"] = kind
            d["bound"] = run.tokens_per_round * t["ar_step"] / cost
            d["measured_over_bound"] = d["speedup"] / d["bound"]
        e2e[run.name] = d
    e2e["autoregressive"]["ar_s_per_token"] = ar.decode_s / ar.decoded

    return {
        "settings": {"batch": s.batch, "block_size": s.block_size, "context": s.context,
                     "new_tokens": s.new_tokens, "tau": s.tau, "repeats": s.repeats,
                     "e2e_repeats": s.e2e_repeats, "seed": s.seed, "dtype": jnp.dtype(s.dtype).name,
                     "adaptive_widths": list(s.adaptive_widths), "attention": s.attention,
                     "draft_window": s.draft_window, "prefill_chunk": s.prefill_chunk,
                     "tree_budget": s.tree_budget,
                     "attention_kernel": resolve_kernel(s.attention, s.dtype),
                     "mesh": None if mesh is None else dict(zip(mesh.axis_names, map(int, mesh.devices.shape)))},
        "models": {
            "target": {"layers": tc.num_hidden_layers, "hidden": tc.hidden_size, "heads": tc.num_attention_heads,
                       "kv_heads": tc.num_key_value_heads, "head_dim": tc.head_dim,
                       "intermediate": tc.intermediate_size, "vocab": tc.vocab_size,
                       "params": _count(tp)},
            "draft": {"layers": dc.num_hidden_layers, "feature_layers": list(dc.target_layer_ids),
                      "params": _count(dp)},
        },
        "machine": machine,
        "timings": {k: v.to_dict() for k, v in comp.items()},
        "ratios": {"verify_over_ar_step": t["verify"] / t["ar_step"], "draft_over_verify": t["draft"] / t["verify"],
                   "round_overhead_ms": (t["round"] - t["verify"] - t["draft"]) * 1e3},
        "bounds": bounds,
        "e2e": e2e,
        "estimate_with_draft_at_tau": bounds["with_draft"] * e2e["oracle"]["measured_over_bound"],
        "total_s": time.perf_counter() - t_start,
        "load_avg_1m_end": load_average(),
        "peak_rss_gib": peak_rss_gib(),
        "device_peak_gib": device_peak_gib(),
    }


def _count(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def format_report(r: dict, title: str = "") -> str:
    s, t, e = r["settings"], r["timings"], r["e2e"]
    m, mach = r["models"], r["machine"]
    ar = t["ar_step"]["median_ms"]
    tau, block = s["tau"], s["block_size"]
    nfeat = len(m["draft"]["feature_layers"])
    lines = []
    if title:
        lines.append(title)
    lines += [
        f"target {m['target']['layers']} layers, hidden {m['target']['hidden']}, vocab {m['target']['vocab']} "
        f"({m['target']['params'] / 1e6:.1f}M params); draft {m['draft']['layers']} layers "
        f"({m['draft']['params'] / 1e6:.1f}M params, features of target layers {m['draft']['feature_layers']})",
        f"{s['dtype']}, batch {s['batch']}, block {block}, context {s['context']}, {s['new_tokens']} new tokens, "
        f"tau {tau}, attention {s.get('attention_kernel', 'loop')}"
        f"{'' if s.get('draft_window') is None else ', draft window ' + str(s['draft_window'])}; JAX {mach['jax']} on {mach['backend']} "
        f"({mach['device']}; {mach['machine']}, {mach['cpu_count']} CPUs; load average {mach['load_avg_1m']} at "
        f"start, {r.get('load_avg_1m_end')} at end)",
        "",
        f"Components (jitted, median of {s['repeats']} runs, compile excluded)   median ms     min ms   x AR step",
    ]
    rows = [
        ("ar_step", f"AR step   target, 1 token, cache of {s['context']}"),
        ("verify", f"verify    target, {block} tokens + {nfeat} feature layers"),
        ("draft", f"draft     draft forward, block {block} + context write"),
        ("round", "round     DFlash round (draft + verify + accept)"),
        ("ar_round", "AR round  autoregressive round (step + accept)"),
    ]
    if "rollback" in t:
        rows.insert(2, ("rollback", "rollback  linear layers' states to an accepted prefix (in verify)"))
    for key, label in rows:
        lines.append(f"  {label:60s} {t[key]['median_ms']:9.3f}  {t[key]['min_ms']:9.3f}  "
                     f"{t[key]['median_ms'] / ar:9.2f}")
    if "rollback" in t:
        lines.append(f"  rollback / round: {t['rollback']['median_ms'] / t['round']['median_ms']:.1%} (timed alone; "
                     "inside a round it is part of the next verify forward)")
    lines.append(f"  {'round - verify - draft (engine overhead)':60s} {r['ratios']['round_overhead_ms']:9.3f}")
    if "draft_window" in t:
        for key in ("draft_window", "round_window"):
            label = f"{key.split('_')[0]:9s} with --draft-window {s['draft_window']}"
            lines.append(f"  {label:60s} {t[key]['median_ms']:9.3f}  {t[key]['min_ms']:9.3f}  "
                         f"{t[key]['median_ms'] / ar:9.2f}")
        lines.append(f"  --draft-window {s['draft_window']}, same runs: draft "
                     f"{t['draft_window']['median_ms'] / t['draft']['median_ms']:.2f}x and round "
                     f"{t['round_window']['median_ms'] / t['round']['median_ms']:.2f}x the time of the unbounded "
                     "draft's (the end-to-end decodes below use the window)")
    lines += [
        "",
        "End to end (engine.generate.generate, decode only; speedup = AR decode s / decode s, same tokens)",
        f"  {'mode':26s} {'tokens':>6s} {'loops':>6s} {'tok/round':>9s} {'decode s':>9s} {'tok/s':>9s} "
        f"{'speedup':>8s} {'bound':>7s} {'meas/bound':>10s}  same as AR",
    ]
    names = {"autoregressive": "autoregressive", "oracle": f"DFlash, oracle tau={tau}",
             "draft": "DFlash, the draft", "oracle_adaptive": "  adaptive widths",
             "draft_adaptive": "  adaptive widths", "oracle_tree": f"  tree of {s.get('tree_budget')} nodes",
             "draft_tree": f"  tree of {s.get('tree_budget')} nodes"}
    order = ("autoregressive", "oracle", "oracle_adaptive", "oracle_tree", "draft", "draft_adaptive", "draft_tree")
    for key in (k for k in order if k in e):
        d = e[key]
        bound = f"{d['bound']:6.2f}x" if "bound" in d else f"{'':7s}"
        ratio = f"{d['measured_over_bound']:10.2f}" if "measured_over_bound" in d else f"{'':10s}"
        lines.append(
            f"  {names[key]:26s} {d['decoded_tokens']:6d} {d['loop_iterations']:6d} {d['tokens_per_round']:9.2f} "
            f"{d['decode_s']:9.3f} {d['tokens_per_s']:9.1f} {d['speedup']:7.2f}x {bound} {ratio}  "
            f"{'yes' if d['identical_to_ar'] else 'NO: ' + str(d['mismatch'])}")
    b = r["bounds"]
    if s.get("adaptive_widths"):
        for key in ("oracle_adaptive", "draft_adaptive"):
            used = ", ".join(f"{w}: {n}" for w, n in e[key]["widths"].items())
            costs = ", ".join(f"{c:.2f}" for c in e[key]["width_costs"])
            lines.append(f"  {key.replace('_', ' ')}: rounds per verify width {{{used}}} "
                         f"(widths offered {s['adaptive_widths']} and the block; measured round costs {costs})")
    if s.get("mesh"):
        lines.append(f"  sharded over the mesh {s['mesh']}")
    lines += [
        "  (tokens: decoded by the loop, all rows; loops: decode-loop iterations; tok/round: tokens per row-round)",
        "  (bound: tokens/round x t(AR step) / t(verify) for the oracle, which has no draft cost;",
        "          tokens/round x t(AR step) / (t(verify) + t(draft)) for the draft)",
        "",
        f"Bounds at tau = {tau}:",
        f"  tau * t(AR step) / (t(verify) + t(draft)) = {b['with_draft']:.2f}x   (a draft reaching tau {tau})",
        f"  tau * t(AR step) / t(verify)              = {b['without_draft']:.2f}x   (no draft cost: the oracle)",
        f"  tau * t(AR round) / t(round)              = {b['rounds']:.2f}x   (whole rounds, engine overhead included)",
        f"  oracle measured / its bound = {e['oracle']['measured_over_bound']:.2f}; "
        f"so a draft reaching tau {tau} would give about {r['estimate_with_draft_at_tau']:.2f}x here",
        f"  verify({block}) / AR step = {r['ratios']['verify_over_ar_step']:.2f}  "
        f"(1.0 would be free verification, as on a GPU at small batch); draft / verify = "
        f"{r['ratios']['draft_over_verify']:.2f}",
    ]
    unstable = {k: d["repeat_mismatch"] for k, d in e.items() if d.get("repeat_mismatch")}
    if unstable:
        lines.append("warning: the same program gave other tokens on a repeated run (" + "; ".join(
            f"{k}: {v}" for k, v in unstable.items()) + "): this device's programs are not run-to-run "
            "deterministic (on XLA:GPU, XLA_FLAGS=--xla_gpu_deterministic_ops=true asks for determinism); the "
            "timings stand, the token comparisons are between first runs")
    if r.get("device_peak_gib") is not None:
        lines.append(f"Peak device memory: {r['device_peak_gib']:.1f} GiB (weights, caches and the largest "
                     "program's temporaries; compare `python -m infer plan`)")
    if r.get("peak_rss_gib") is not None:
        lines.append(f"Peak resident memory of this process: {r['peak_rss_gib']:.1f} GiB "
                     "(building the models included)")
    return "\n".join(lines)
