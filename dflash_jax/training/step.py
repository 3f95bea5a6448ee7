"""The jitted DFlash train step: frozen target features -> fresh anchors -> chunked packed draft loss.

Memory at paper scale (3072 tokens, 512 anchors, block 16, Qwen3-8B draft shapes, vocab 151,936) is decided
here. The unchunked packed forward keeps every layer's ``[A*B, L]`` context scores for the backward pass and
materialises ``[A*B, V]`` logits; compiled grad needs ~52 GiB per sequence. So:

* each layer's context keys/values are computed once per sequence (they are small: ``[KV, L, D]``);
* the anchors are processed ``anchor_chunk`` at a time in a ``lax.scan`` whose body is rematerialised
  (``jax.checkpoint``): the backward pass recomputes one chunk's activations instead of storing all of them;
* each chunk goes straight from hidden states to the cross-entropy sums of its MASK positions; the anchor's
  logits are never computed and no ``[A*B, V]`` array exists.

The loss is normalised globally: the step adds up ``LossSums`` (``sum(w * loss)``, the normaliser, metric counts)
over chunks, sequences, devices (XLA's reductions over the sharded batch) and accumulation micro-steps, and
divides once. Anchors of a sequence come from ``fold_in(step key, global row index)``, so the same global
batch gives the same anchors whatever the device count or accumulation split.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, muon

from dflash_jax.errors import UserError
from dflash_jax.models.draft import DraftModel, SharedHead, head_logits, shared_head
from dflash_jax.models.target import TargetModel
from dflash_jax.sharding import constrain_batch
from dflash_jax.training.anchors import (block_labels, prefix_range, sample_prefix_lengths, sample_row_anchors,
                                         uniform_anchors, visible_prefix)
from dflash_jax.precision import with_precision_policy
from dflash_jax.training.forward import _block_hidden, _context_kv, frozen
from dflash_jax.training.loss import LossSpec, LossSums, block_loss_sums, kl_share, loss_and_metrics

LOSS_MODES = ("standard", "variable_prefix")

Batch = dict[str, jax.Array]  # tokens [G, L] int32, loss_mask [G, L] bool, lengths [G] int32


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What decides the loss of a batch (everything here is part of a run's resume fingerprint)."""

    block_size: int
    gamma: float
    mask_token_id: int
    feature_layers: tuple[int, ...]
    num_anchors: int = 512
    anchor_chunk: int = 64  # anchors per rematerialised chunk: bounds the draft's activation memory
    accum_steps: int = 1  # gradient-accumulation micro-steps per optimizer step (same global batch)
    tied_head: bool = False  # the target ties its output head to its embedding
    anchors: str = "random"  # "random" (the paper's) or "uniform" (non-overlapping blocks: the ablation)
    loss: str = "ce"  # "ce" (the paper's), "kl" (forward KL against the target's distribution) or "ce+kl"
    kl_weight: float = 0.5  # the KL share a of (1 - a) ce + a kl under loss "ce+kl"
    temperature: float = 1.0  # of the target's distribution in the KL term
    position_weights: str = "decay"  # "decay" (the paper's, gamma) or "dpace" (D-PACE, training/loss.py)
    dpace_alpha: float = 0.5
    selector_weight: float = 1.0  # DFlash2 drafts: the selector's cross-entropy beside the block loss
    loss_mode: str = "standard"  # "standard" (anchor + masks) or "variable_prefix" (D2SD, anchors.visible_prefix)
    prefix_base: float = 0.9  # variable_prefix: Pr(l) proportional to prefix_base**l (D2SD's and NeMo's 0.9)
    prefix_min: int = 1  # variable_prefix: shortest visible prefix, the anchor included (1: the standard block)
    prefix_max: int | None = None  # variable_prefix: longest visible prefix (None: B-1)
    # DSpark drafts (SPEC 13.6): shifted blocks (position k learns the token at a + k + 1) and DeepSpec's loss,
    # ``(ce, l1, confidence)`` weights; None for DFlash drafts. ``gamma`` then weighs position k by exp(-k/gamma).
    dspark_weights: tuple[float, float, float] | None = None

    def __post_init__(self):
        self.loss_spec  # validates the loss fields
        if self.loss_mode not in LOSS_MODES:
            raise UserError(f"unknown loss_mode {self.loss_mode!r} (known: {', '.join(LOSS_MODES)})")
        if self.loss_mode == "variable_prefix":
            if self.position_weights != "decay":
                raise UserError("loss_mode variable_prefix restarts the decay weights at the prefix; it cannot go "
                                f"with position_weights {self.position_weights}")
            if not self.prefix_base > 0:
                raise UserError(f"prefix_base must be positive, got {self.prefix_base}")
            if self.prefix_min < 1 or (self.prefix_max is not None and self.prefix_max < self.prefix_min):
                raise UserError(f"need 1 <= prefix_min <= prefix_max, got {self.prefix_min} and {self.prefix_max}")
        if self.dspark_weights is not None and (self.loss != "ce" or self.position_weights != "decay"
                                                or self.loss_mode != "standard"):
            raise UserError("a DSpark draft trains with DeepSpec's loss (train.dspark_loss_weights): train.loss, "
                            "position_weights and loss_mode keep their defaults (ce, decay, standard)")

    @property
    def prefix_range(self) -> tuple[int, int]:
        return prefix_range(self.block_size, self.prefix_min, self.prefix_max)

    @property
    def loss_spec(self) -> LossSpec:
        return LossSpec(self.gamma, kl_share(self.loss, self.kl_weight), self.temperature, self.position_weights,
                        self.dpace_alpha, self.selector_weight, self.dspark_weights)

    @property
    def label_width(self) -> int:
        """Labels per block: the anchor's slot and ``B - 1`` mask positions (DFlash), or the anchor's slot and
        ``B`` proposals (DSpark: every block position predicts the token after it)."""
        return self.block_size + (1 if self.dspark_weights is not None else 0)

    @property
    def needs_target_logits(self) -> bool:
        return self.kl_share > 0 or self.dspark_weights is not None

    @property
    def kl_share(self) -> float:
        """The share of the KL term (0: the target's logits are never computed)."""
        return self.loss_spec.kl_weight


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # draft params (float32 master weights)
    opt_state: Any
    key: jax.Array  # uint32[2] base key; step s uses fold_in(key, s)


def _target_logits_at(shared: SharedHead, target_hidden: jax.Array, block_positions: jax.Array) -> jax.Array:
    """The target's own logits ``[N, c, B-1, V]`` predicting block positions 1..B-1: its head over its final
    (normed) hidden states one position earlier, ``anchor .. anchor+B-2`` (all inside the sequence; past a
    row's length they carry no label)."""
    n, c, b = block_positions.shape
    at = jnp.clip(block_positions[..., :-1], 0, target_hidden.shape[1] - 1).reshape(n, c * (b - 1))
    hidden = jnp.take_along_axis(target_hidden, at[..., None], axis=1).reshape(n, c, b - 1, -1)
    return head_logits(shared, hidden)


def _chunk_logits_sums(module: DraftModel, context_kv, target_hidden, block_tokens, block_positions, anchor_valid,
                       labels, label_mask, shared, spec, prefix=None):
    """Inside ``apply``: one chunk of anchors from block tokens to its ``LossSums`` (mask positions only).
    With ``target_hidden`` the chunk's target logits are formed here too, so the ``[.., B-1, V]`` arrays of
    both models exist for one chunk at a time (and are recomputed in the backward pass, not stored)."""
    x = constrain_batch(_block_hidden(module, context_kv, block_tokens, block_positions, anchor_valid, shared))
    if module.config.dspark:  # every position proposes the token after it: the labels' frame is one wider
        block_positions = jnp.concatenate([block_positions, block_positions[..., -1:] + 1], axis=-1)
    target_logits = None
    if target_hidden is not None:
        target_logits = constrain_batch(_target_logits_at(shared, target_hidden, block_positions))
    if module.config.dspark:
        normed = module.norm(x)
        logits = constrain_batch(module.normed_logits(normed, shared))
        # teacher forcing: each position's previous token is the true one (the anchor, then the labels)
        previous = jnp.concatenate([block_tokens[..., :1], labels[..., 1:-1]], axis=-1)
        bias, confidence = module.dspark_heads(normed, previous)
        if bias is not None:
            logits = logits + bias
        return block_loss_sums(logits, labels, label_mask, spec, target_logits, confidence=confidence)
    normed = module.norm(x[:, :, 1:])
    logits = constrain_batch(module.normed_logits(normed, shared))
    selector = None
    if module.candidate_selector is not None:  # DFlash2: predecessors are the anchor, then the true tokens
        predecessors = jnp.concatenate([block_tokens[..., :1], labels[..., 1:-1]], axis=-1)
        selector = module.candidate_selector.teacher_forced(logits, normed, predecessors, labels[..., 1:])
    return block_loss_sums(logits, labels, label_mask, spec, target_logits, selector, prefix)


def draft_loss_sums(model: DraftModel, params: Any, target_features: jax.Array, block_tokens: jax.Array,
                    block_positions: jax.Array, anchor_valid: jax.Array, labels: jax.Array, label_mask: jax.Array,
                    shared: SharedHead, spec: LossSpec, anchor_chunk: int,
                    target_hidden: jax.Array | None = None, prefix: jax.Array | None = None) -> LossSums:
    """``LossSums`` of all packed blocks ``[N, A, B]`` of ``target_features [N, L, n*H]``, ``anchor_chunk``
    anchors at a time under rematerialisation. Equal (to float rounding) to ``dflash_loss`` of
    ``draft_training_logits``, whatever the chunk size. ``target_hidden [N, L, H]`` (the target's final normed
    hidden states) adds the KL sums against the target's distribution at ``spec.temperature``; ``prefix
    [N, A]`` the blocks' visible-prefix lengths under ``loss_mode: variable_prefix``."""
    n, a, b = block_tokens.shape
    chunk = max(1, min(anchor_chunk, a))
    pad = -a % chunk
    if pad:  # extra anchors are invalid: no context, no labels, so they add nothing
        widths = ((0, 0), (0, pad), (0, 0))
        block_tokens, block_positions = jnp.pad(block_tokens, widths), jnp.pad(block_positions, widths)
        labels, label_mask = jnp.pad(labels, widths), jnp.pad(label_mask, widths)
        anchor_valid = jnp.pad(anchor_valid, ((0, 0), (0, pad)))
        if prefix is not None:
            prefix = jnp.pad(prefix, ((0, 0), (0, pad)), constant_values=1)
    shared = frozen(shared)
    context_kv = jax.tree.map(constrain_batch, model.apply({"params": params}, target_features, method=_context_kv))
    if target_hidden is not None:
        target_hidden = constrain_batch(jax.lax.stop_gradient(target_hidden))

    def chunks(x):  # [N, A, ...] -> [num_chunks, N, chunk, ...]
        return jnp.moveaxis(x.reshape((n, -1, chunk) + x.shape[2:]), 1, 0)

    @jax.checkpoint
    def body(total, xs):
        xs = tuple(constrain_batch(x) for x in xs)
        chunk_prefix = xs[5] if len(xs) > 5 else None
        sums = model.apply({"params": params}, context_kv, target_hidden, *xs[:5], shared, spec, chunk_prefix,
                           method=_chunk_logits_sums)
        return total + sums, None

    xs = tuple(chunks(x) for x in (block_tokens, block_positions, anchor_valid, labels, label_mask)
               + (() if prefix is None else (prefix,)))
    total, _ = jax.lax.scan(body, LossSums.zeros(labels.shape[-1]), xs)
    return total


def target_features(target: TargetModel, target_params: Any, batch: Batch, feature_layers: tuple[int, ...],
                    final_hidden: bool = False):
    """The frozen target over the clean sequences: the concatenated features of ``feature_layers``, no logits
    (XLA also drops the layers past the last feature layer), no gradient. ``final_hidden``: also return the
    final normed hidden states ``[N, L, H]`` (the last layer's feature, from which the head gives the target's
    logits), as ``(features, final)``."""
    tokens, lengths = batch["tokens"], batch["lengths"]
    n, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (n, length))
    last = target.config.num_hidden_layers - 1
    layers = tuple(feature_layers) + ((last,) if final_hidden and last not in feature_layers else ())
    out = target.apply({"params": target_params}, tokens, positions, valid=positions < lengths[:, None],
                       feature_layers=layers, skip_logits=True)
    features = jax.lax.stop_gradient(out.features)
    if not final_hidden:
        return features
    hidden = features.shape[-1] // len(layers)
    at = layers.index(last)
    final = features[..., at * hidden:(at + 1) * hidden]
    return features[..., :len(feature_layers) * hidden], final


def batch_loss_sums(draft_params: Any, target_params: Any, batch: Batch, key: jax.Array, row_index: jax.Array,
                    target: TargetModel, draft: DraftModel, cfg: StepConfig) -> LossSums:
    """The frozen target's features of the clean sequences, anchors drawn for each row from
    ``fold_in(key, row_index)``, then the chunked draft loss sums."""
    batch = {k: constrain_batch(v) for k, v in batch.items()}  # sequences stay split over data x fsdp
    tokens, loss_mask, lengths = batch["tokens"], batch["loss_mask"].astype(bool), batch["lengths"]
    final = None
    if cfg.needs_target_logits:
        features, final = target_features(target, target_params, batch, cfg.feature_layers, final_hidden=True)
    else:
        features = target_features(target, target_params, batch, cfg.feature_layers)
    features = constrain_batch(features)
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, row_index)
    if cfg.anchors == "uniform":
        anchors, valid = uniform_anchors(loss_mask, lengths, cfg.num_anchors, cfg.block_size)
    else:
        anchors, valid = sample_row_anchors(row_keys, loss_mask, lengths, cfg.num_anchors)
    block_tokens, block_positions, labels, label_mask = block_labels(
        tokens, loss_mask, lengths, anchors, valid, cfg.label_width, mask_token_id=cfg.mask_token_id)
    block_tokens, block_positions = block_tokens[..., :cfg.block_size], block_positions[..., :cfg.block_size]
    prefix = None
    if cfg.loss_mode == "variable_prefix":
        prefix = constrain_batch(sample_prefix_lengths(row_keys, cfg.num_anchors, *cfg.prefix_range, cfg.prefix_base))
        block_tokens, label_mask = visible_prefix(block_tokens, labels, label_mask, prefix)
    shared = shared_head(target_params, cfg.tied_head)
    return draft_loss_sums(draft, draft_params, features, block_tokens, block_positions, valid, labels, label_mask,
                           shared, cfg.loss_spec, cfg.anchor_chunk, final, prefix)


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def accumulated_gradients(params: Any, target_params: Any, batch: Batch, key: jax.Array, target: TargetModel,
                          draft: DraftModel, cfg: StepConfig) -> tuple[Any, LossSums]:
    """Gradients of the globally normalised loss over the whole batch, in ``cfg.accum_steps`` micro-steps.

    Each micro-step differentiates the UNnormalised ``sum(w * loss)``; gradients and sums are added up and
    divided once by the total ``sum(w)``. Micro-step ``m`` takes rows ``r`` with ``r % accum_steps == m``, so
    each device keeps working on the rows it already holds under a batch-sharded layout.
    """
    g = batch["tokens"].shape[0]
    steps = cfg.accum_steps
    if g % steps:
        raise UserError(f"global batch {g} is not divisible by accum_steps {steps}")
    compute_dtype = draft.dtype

    def micro_batches(x):  # [G, ...] -> [steps, G // steps, ...] with row r in micro-step r % steps
        return jnp.swapaxes(x.reshape((g // steps, steps) + x.shape[1:]), 0, 1)

    micro = {k: micro_batches(v) for k, v in batch.items()}
    rows = micro_batches(jnp.arange(g, dtype=jnp.int32))

    def objective(p, mb, idx):
        sums = batch_loss_sums(_cast(p, compute_dtype), target_params, mb, key, idx, target, draft, cfg)
        return sums.objective(cfg.kl_share, cfg.selector_weight, cfg.dspark_weights), sums

    grad_fn = jax.grad(objective, has_aux=True)

    def body(carry, xs):
        grads, sums = carry
        mb, idx = xs
        g_m, s_m = grad_fn(params, mb, idx)
        return (jax.tree.map(jnp.add, grads, g_m), sums + s_m), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, sums), _ = jax.lax.scan(body, (zeros, LossSums.zeros(cfg.label_width)), (micro, rows))
    grads = jax.tree.map(lambda x: x / jnp.maximum(sums.weight, 1e-12), grads)
    return grads, sums


OPTIMIZERS = ("adamw", "muon")
MUON_RMS = 0.2  # Muon's update RMS matched to AdamW's (Moonlight, arXiv 2502.16982), so AdamW's learning rate carries over


def _warmup_cosine(peak: float, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> optax.Schedule:
    warmup = max(1, int(round(warmup_ratio * total_steps))) if warmup_ratio > 0 else 0
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else peak, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=peak * min_lr_ratio)


def is_muon_matrix(path: tuple, leaf: Any) -> bool:
    """Muon takes the draft's Dense kernels (attention and MLP projections, the ``fc`` feature projection, a
    DFlash2 draft's kernel projections and selector projection); everything else (norm weights, biases, a
    DFlash2 draft's convolution base kernels and selector codebooks, which are embedding tables) stays with
    AdamW, as in Muon's own recipe and vLLM speculators'. A kernel with more than two axes is a stack of
    matrices along its leading axes (layers under ``nn.scan``): each is orthogonalised on its own."""
    last = path[-1]
    name = getattr(last, "key", getattr(last, "name", None))
    return name == "kernel" and getattr(leaf, "ndim", 0) >= 2


def muon_dimension_numbers(params: Any) -> Any:
    """optax's ``MuonDimensionNumbers`` for every Muon leaf (the last two axes: input, output; the leading
    axes are batch axes, vmapped over) and None for the AdamW leaves."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: MuonDimensionNumbers(x.ndim - 2, x.ndim - 1) if is_muon_matrix(path, x) else None, params)


def make_optimizer(learning_rate: float = 6e-4, total_steps: int = 1000, warmup_ratio: float = 0.04,
                   clip_norm: float = 1.0, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   min_lr_ratio: float = 0.0, eps: float = 1e-8, optimizer: str = "adamw",
                   muon_learning_rate: float | None = None, muon_momentum: float = 0.95,
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then AdamW with linear warmup and cosine decay (SPEC section 6 defaults); returns
    the optimizer and its learning-rate schedule (for logging).

    ``optimizer="muon"``: optax's Muon (``optax.contrib.muon``: Nesterov momentum ``muon_momentum``, five
    Newton-Schulz steps with the published coefficients, updates scaled to AdamW's RMS, ``MUON_RMS``) for the
    matrices of ``is_muon_matrix``, plain AdamW for the rest, both under the same clipping and the same warmup
    and cosine shape; Muon's peak is ``muon_learning_rate`` (default: ``learning_rate``), weight decay the same.
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})")
    schedule = _warmup_cosine(learning_rate, total_steps, warmup_ratio, min_lr_ratio)
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if optimizer == "adamw":
        return optax.chain(optax.clip_by_global_norm(clip_norm), adamw), schedule
    if not 0.0 <= muon_momentum < 1.0:
        raise UserError(f"muon_momentum must lie in [0, 1), got {muon_momentum}")
    muon_schedule = _warmup_cosine(learning_rate if muon_learning_rate is None else muon_learning_rate,
                                   total_steps, warmup_ratio, min_lr_ratio)
    # Two partitions rather than muon's own AdamW branch: that one is Nesterov-Adam (it shares muon's flag).
    matrices = muon(muon_schedule, beta=muon_momentum, weight_decay=weight_decay,
                                  consistent_rms=MUON_RMS, muon_weight_dimension_numbers=muon_dimension_numbers)

    def labels(params):
        return jax.tree_util.tree_map_with_path(lambda p, x: "muon" if is_muon_matrix(p, x) else "adamw", params)

    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.partition({"muon": matrices, "adamw": adamw}, labels)), schedule


def make_train_step(target: TargetModel, draft: DraftModel, cfg: StepConfig, optimizer: optax.GradientTransformation,
                    schedule: Callable[[Any], Any] | None = None):
    """``step(state, target_params, batch) -> (state, metrics)``, pure (jit it with shardings/donation)."""

    def step(state: TrainState, target_params: Any, batch: Batch):
        key = jax.random.fold_in(state.key, state.step)
        grads, sums = accumulated_gradients(state.params, target_params, batch, key, target, draft, cfg)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss, metrics = loss_and_metrics(sums, cfg.kl_share,
                                         cfg.selector_weight if draft.config.dflash2 else None, cfg.dspark_weights)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["tokens"] = jnp.sum(batch["lengths"]).astype(jnp.float32)
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return with_precision_policy(step, draft.dtype)  # float32 steps: full-precision matmuls on every device


def init_train_state(params: Any, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      key=jax.random.PRNGKey(seed))
