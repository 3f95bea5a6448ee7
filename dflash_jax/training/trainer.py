"""The trainer loop behind ``python -m train fit``: one run config in, a trained draft out.

Data flow: run config -> mesh -> target params loaded straight into their shardings -> tokenized rows ->
grain batches (this process's share) -> global arrays -> the jitted, donated train step -> metrics
(TensorBoard, metrics.jsonl, progress bar), Orbax checkpoints (every N steps, on SIGTERM, at the end), the
real tau of the draft through the engine on held-out prompts, and the export (official layout + Orbax).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dflash_jax import sharding
from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.hub import resolve_checkpoint
from dflash_jax.checkpoints.loading import load_draft_any, load_target_any, load_tokenizer, tokenizer_dir
from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft
from dflash_jax.checkpoints.safetensors_io import flatten, unflatten
from dflash_jax.data.pipeline import BatchIterator, make_dataset, steps_per_run
from dflash_jax.data.regenerate import TRAINING_DATA_KEY, training_data_thinking
from dflash_jax.engine.decoder import stop_tokens_of
from dflash_jax.engine.generate import prompt_width
from dflash_jax.models.config import ConfigError, TargetConfig
from dflash_jax.models.draft import DraftModel, shared_head, split_head_copies, with_head_copies
from dflash_jax.models.draft_config import DFLASH2, DFLASH2_FIELDS, DraftConfig
from dflash_jax.training.run_config import DSPARK_FIELDS
from dflash_jax.models.target import TargetModel
from dflash_jax.errors import UserError
from dflash_jax.precision import resolve_dtype
from dflash_jax.training.checkpointing import TrainCheckpoints, abstract_like
from dflash_jax.training.loss import default_gamma
from dflash_jax.training.metrics import MetricsLogger
from dflash_jax.training.step import StepConfig, TrainState, init_train_state, make_optimizer, make_train_step

NEW_DRAFT_KEYS = ("num_layers", "block_size", "target_layer_ids", "mask_token_id", "intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "context_injection", "architecture",
                  *DFLASH2_FIELDS, *DSPARK_FIELDS)
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DSPARK_GAMMA = 4.0  # DeepSpec's loss_decay_gamma for every DSpark recipe
UNIFORM_GAMMA = 1e9  # exp(-(k-1)/gamma) == 1 to float precision: the uniform-weight ablation



def _unused_loss_field(step_cfg: StepConfig, name: str, draft: DraftConfig) -> bool:
    """Loss fields that cannot change the model under this config (left out of the fingerprint, so runs
    started before the options existed resume unchanged)."""
    if name == "selector_weight":
        return not draft.dflash2
    defaults = {"loss": "ce", "position_weights": "decay", "loss_mode": "standard"}
    if name in defaults:
        return getattr(step_cfg, name) == defaults[name]
    if name in ("kl_weight", "temperature"):
        return step_cfg.kl_share == 0.0 or (name == "kl_weight" and step_cfg.loss != "ce+kl")
    if name == "dpace_alpha":
        return step_cfg.position_weights != "dpace"
    if name in ("prefix_base", "prefix_min", "prefix_max"):
        return step_cfg.loss_mode != "variable_prefix"
    return False

def compute_dtype(name: str) -> Any:
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return resolve_dtype(name)


def build_draft_config(cfg: dict, target: TargetConfig) -> tuple[DraftConfig, dict | None]:
    """The draft to train: an existing one (``draft.init``) or a new Qwen3-style draft shaped like the target."""
    d = cfg["draft"]
    if d["init"]:
        # draft.architecture: dflash2 with a DFlash draft as draft.init: that draft grown into a DFlash2 one
        # (how z-lab's Muse-Glimmer-30B-DFlash2 started from Meta's drafter), with its own DFlash2 fields
        upgrade = d["architecture"] == "dflash2"
        shaped = [k for k in NEW_DRAFT_KEYS if d[k] is not None and not (upgrade and k in ("architecture",
                                                                                           *DFLASH2_FIELDS))]
        if shaped:
            raise ConfigError(f"run config: draft.{shaped[0]} cannot be combined with draft.init (the existing "
                              f"draft's own config decides it); remove it or train a new draft")
        config, params = load_draft_any(d["init"], dtype="float32", what="draft.init", revision=d["init_revision"])
        config.validate_against(target, source=f"draft.init {d['init']}")
        if config.dspark:  # a DSpark draft trains its backbone and heads; its embedding/head copies are the target's
            params, _ = split_head_copies(params)
        if upgrade and config.dspark:
            raise ConfigError("run config: draft.architecture dflash2 cannot grow a DSpark draft (draft.init): its "
                              "outputs are shifted by one position")
        if upgrade and not config.dflash2:
            return dflash2_from(config, params, target, {k: d[k] or DFLASH2_DEFAULTS[k] for k in DFLASH2_FIELDS})
        return config, params
    ids = tuple(d["target_layer_ids"]) if d["target_layer_ids"] else None
    config = DraftConfig.for_target(target, num_layers=d["num_layers"] or 5, block_size=d["block_size"] or 16,
                                    mask_token_id=d["mask_token_id"], target_layer_ids=ids)
    shape = {k: d[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                               "context_injection") if d[k]}
    config = dataclasses.replace(config, **shape)
    if d["architecture"] == "dspark":  # DeepSpec's recipe: block 7, rank 256, a confidence head on the codes
        if d["block_size"] is None:
            config = dataclasses.replace(config, block_size=7)
        rank = 256 if d["markov_rank"] is None else d["markov_rank"]
        confidence = True if d["confidence_head"] is None else d["confidence_head"]
        config = config.as_dspark(rank, d["markov_head_type"] or "vanilla", confidence, confidence and rank > 0)
    if d["architecture"] == "dflash2":  # through the official config, so its checks name the same fields
        official = config.to_official_dict()
        official["architectures"] = [DFLASH2]
        official["dflash_config"].update({k: d[k] or DFLASH2_DEFAULTS[k] for k in DFLASH2_FIELDS})
        config = DraftConfig.from_dict(official, source="run config [draft]")
    if config.reads_last_layer and not d["allow_last_layer"]:
        raise ConfigError(f"run config: draft.{config.last_layer_note()}. Pick earlier layers (the default spread "
                          "ends 3 before the last), or set draft.allow_last_layer: true for an experiment")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConfigError(f"run config: draft.num_attention_heads {config.num_attention_heads} is not a multiple of "
                          f"draft.num_key_value_heads {config.num_key_value_heads}")
    config.validate_against(target, source="run config [draft]")
    return config, None


def dflash2_from(config: DraftConfig, params: dict, target: TargetConfig, fields: dict) -> tuple[DraftConfig, dict]:
    """A DFlash2 draft grown from a DFlash draft (either layout; DFlash2 exists in the official one only): the
    same layers, fusion and norms, plus block convolutions that start as the identity (base kernels the
    identity, dynamic kernel projections zero) and a candidate selector whose pair scores start at zero
    (hidden projection zero, codebooks random): at step 0 it proposes exactly what the DFlash draft does
    (greedy), and training moves on from there."""
    official = config.with_layout("dflash", target).to_official_dict()
    official["architectures"] = [DFLASH2]
    official["dflash_config"].update(fields)
    grown = DraftConfig.from_dict(official, source="run config [draft] (draft.init grown into DFlash2)")
    fresh = flatten(init_draft_params(grown, seed=0, std=0.02))
    for path, leaf in flatten(params).items():
        if path not in fresh or np.shape(fresh[path]) != np.shape(leaf):
            raise ConfigError(f"draft.init: param {'/'.join(path)} does not fit the DFlash2 draft")
        fresh[path] = leaf
    for path, leaf in fresh.items():
        if path[-2:] in (("kernel_projection", "kernel"), ("hidden_projection", "kernel")):
            fresh[path] = jnp.zeros(np.shape(leaf), leaf.dtype)
    return grown, unflatten(fresh)


@dataclasses.dataclass
class FitResult:
    steps: int
    final_metrics: dict
    eval_tau: float | None
    export_dir: Path | None
    stopped_early: bool


class _Stop:
    """SIGTERM (a preempted job) asks the loop to save and stop after the current step."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, *_):
        self.requested = True

    def requested_anywhere(self) -> bool:
        """Every process must stop at the same step (a save and a train step are both collective)."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(self.requested))))

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


@dataclasses.dataclass
class Run:
    """Everything a run is built from, prepared once (by ``prepare_run``) for ``fit`` and ``measure_step``."""

    cfg: dict
    mesh: Any
    dtype: Any
    target_config: TargetConfig
    target_params: dict
    draft_config: DraftConfig
    init_params: Any  # the draft's starting params (host), new or from draft.init
    tokenized: Any  # TokenizedData
    eval_prompts: list[list[int]] | None
    stop_tokens: list[int]  # EOS ids of the target, as the engine uses them when serving
    step_cfg: StepConfig
    optimizer: Any
    schedule: Any
    total_steps: int
    fingerprint: dict  # what a resume must not change

    @property
    def global_batch(self) -> int:
        return self.cfg["train"]["global_batch"]

    def abstract_state(self) -> TrainState:
        return jax.eval_shape(lambda p: init_train_state(p, self.optimizer, self.cfg["train"]["seed"]),
                              self.init_params)

    def initial_state(self, state_shardings) -> TrainState:
        return jax.jit(lambda p: init_train_state(p, self.optimizer, self.cfg["train"]["seed"]),
                       out_shardings=state_shardings)(self.init_params)

    def batches(self) -> BatchIterator:
        return BatchIterator(make_dataset(
            self.tokenized, self.global_batch, seed=self.cfg["train"]["seed"], epochs=self.cfg["train"]["epochs"],
            process_index=jax.process_index(), process_count=jax.process_count()))

    def jitted_step(self, state_shardings):
        """The train step jitted with the rule shardings and the train state donated."""
        target = TargetModel(self.target_config, self.dtype)
        draft = DraftModel(self.draft_config, self.dtype)
        step_fn = make_train_step(target, draft, self.step_cfg, self.optimizer, self.schedule)
        target_sh = jax.tree.map(lambda x: x.sharding, self.target_params)
        batch_sh = {k: sharding.batch_sharding(self.mesh, 2 if k != "lengths" else 1)
                    for k in ("tokens", "loss_mask", "lengths")}
        return jax.jit(step_fn, in_shardings=(state_shardings, target_sh, batch_sh),
                       out_shardings=(state_shardings, sharding.replicated(self.mesh)), donate_argnums=(0,))

    def global_batch_of(self, local: dict) -> dict:
        return sharding.global_batch_from_local(local, self.mesh, self.global_batch)


def prepare_run(cfg: dict, *, tokenized=None, eval_prompts: list[list[int]] | None = None,
                log: Callable[[str], None] = print, progress: bool = True) -> Run:
    """Mesh, target (loaded into its shardings), draft config and starting params, tokenized data, held-out
    prompts, step settings, optimizer and the resume fingerprint of the run ``cfg``."""
    mesh = sharding.make_mesh(cfg["mesh"])
    dtype = compute_dtype(cfg["train"]["dtype"])
    log(f"mesh {dict(mesh.shape)} over {jax.device_count()} {jax.default_backend()} device(s), "
        f"{jax.process_count()} process(es); compute dtype {jnp.dtype(dtype).name}")

    # A Hub id becomes its cached snapshot directory once, here (dflash_jax.checkpoints.hub).
    target_path = resolve_checkpoint(cfg["target"]["path"], cfg["target"]["revision"], "target.path")
    target_config, target_params = load_target_any(target_path, dtype, mesh=mesh, missing="target.path",
                                                   experts=cfg["target"]["experts"])
    draft_config, init_params = build_draft_config(cfg, target_config)
    tokenizer = load_tokenizer(cfg["target"]["tokenizer"] or tokenizer_dir(target_path), what="target.tokenizer")
    stop_tokens = stop_tokens_of(target_config, tokenizer, tokenizer_dir(target_path))
    if tokenized is None:
        tokenized = read_training_data(cfg, tokenizer, log, progress)
    if eval_prompts is None and cfg["data"]["eval_prompts"]:
        eval_prompts = read_eval_prompts(cfg, tokenizer)
    if eval_prompts:  # fail now, not after hours of training
        longest = max(len(p) for p in eval_prompts[: cfg["output"]["eval_num_prompts"]])
        try:
            prompt_width(longest, cfg["output"]["eval_max_new_tokens"], target_config.max_position_embeddings)
        except UserError as e:
            raise ConfigError(f"data.eval_prompts / output.eval_max_new_tokens: {e}") from None
    devices_per_batch = int(mesh.shape["data"] * mesh.shape["fsdp"])
    if cfg["train"]["global_batch"] % devices_per_batch:
        raise ConfigError(f"train.global_batch {cfg['train']['global_batch']} is not divisible by the {devices_per_batch} "
                          "devices the batch is split over (mesh.data x mesh.fsdp)")
    vocab_top = int(tokenized.ids.max())
    if vocab_top >= target_config.vocab_size:
        raise ConfigError(f"data.train: token id {vocab_top} is outside the target's vocabulary "
                          f"({target_config.vocab_size}); is the tokenizer the target's own?")

    t = cfg["train"]
    block = draft_config.block_size
    # DSpark: position k (from 0) weighs exp(-k/gamma), DeepSpec's gamma 4 at every block size
    gamma = UNIFORM_GAMMA if t["uniform_loss"] else float(
        t["gamma"] or (DSPARK_GAMMA if draft_config.dspark else default_gamma(block)))
    step_cfg = StepConfig(block_size=block, gamma=gamma, mask_token_id=draft_config.mask_token_id,
                          feature_layers=draft_config.target_layer_ids, num_anchors=t["num_anchors"],
                          anchor_chunk=t["anchor_chunk"], accum_steps=t["accum_steps"],
                          tied_head=target_config.tie_word_embeddings, anchors=t["anchors"], loss=t["loss"],
                          kl_weight=float(t["kl_weight"]), temperature=float(t["kl_temperature"]),
                          position_weights=t["position_weights"], dpace_alpha=float(t["dpace_alpha"]),
                          selector_weight=float(t["selector_weight"]), loss_mode=t["loss_mode"],
                          prefix_base=float(t["prefix_base"]), prefix_min=t["prefix_min"], prefix_max=t["prefix_max"],
                          dspark_weights=(tuple(float(w) for w in t["dspark_loss_weights"]) if draft_config.dspark
                                          else None))
    global_batch = t["global_batch"]
    num_rows = len(tokenized)
    epoch_steps = steps_per_run(num_rows, global_batch, t["epochs"])
    total_steps = min(epoch_steps, t["max_steps"]) if t["max_steps"] else epoch_steps
    if total_steps < 1:
        raise ConfigError(f"data.train: {num_rows} usable rows x {t['epochs']} epochs do not fill one global batch "
                          f"of {global_batch} (train.global_batch)")
    optimizer, schedule = make_optimizer(t["learning_rate"], total_steps, t["warmup_ratio"], t["clip_norm"],
                                         t["weight_decay"], min_lr_ratio=t["min_lr_ratio"], optimizer=t["optimizer"],
                                         muon_learning_rate=t["muon_learning_rate"],
                                         muon_momentum=float(t["muon_momentum"]))
    # What decides the trained model. anchor_chunk and accum_steps only trade memory for time (the loss is
    # the same to float rounding), so a resume on other hardware may change them.
    fingerprint = {
        "draft": draft_config.to_official_dict(),
        "step": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(step_cfg).items()
                 if k not in ("anchor_chunk", "accum_steps") and not _unused_loss_field(step_cfg, k, draft_config)},
        "data": {"fingerprint": tokenized.fingerprint(), "global_batch": global_batch, "epochs": t["epochs"],
                 "seed": t["seed"]},
        "optimizer": {k: t[k] for k in ("learning_rate", "warmup_ratio", "min_lr_ratio", "weight_decay",
                                        "clip_norm")} | {"total_steps": total_steps}
                     | ({k: t[k] for k in ("optimizer", "muon_learning_rate", "muon_momentum")}
                        if t["optimizer"] != "adamw" else {}),  # AdamW runs started before the option resume
        "target": {"config": target_config.to_hf_dict(), "dtype": jnp.dtype(dtype).name},
    }
    if init_params is None:
        init_params = init_draft_params(draft_config, seed=t["seed"], std=float(cfg["draft"]["init_std"]),
                                        head_copies=False)
    return Run(cfg, mesh, dtype, target_config, target_params, draft_config, init_params, tokenized, eval_prompts,
               stop_tokens, step_cfg, optimizer, schedule, total_steps, fingerprint)


def fit(cfg: dict, *, tokenized=None, eval_prompts: list[list[int]] | None = None, progress: bool = True,
        log: Callable[[str], None] = print) -> FitResult:
    """Train (or resume) the run ``cfg`` (``run_config.parse_run_config``).

    ``tokenized`` (a ``TokenizedData``) skips reading and tokenizing ``data.train``; ``eval_prompts`` are the
    held-out prompts as token ids (otherwise read from ``data.eval_prompts``).
    """
    run = prepare_run(cfg, tokenized=tokenized, eval_prompts=eval_prompts, log=log, progress=progress)
    # The data's thinking mode goes into the exported draft's metadata: infer warns on prompts in the other mode.
    data_meta, data_warnings = training_data_thinking(cfg["data"]["train"], cfg["data"]["enable_thinking"],
                                                      cfg["data"]["use_chat_template"])
    for line in data_warnings if jax.process_index() == 0 else ():
        log(f"warning: {line}")
    out_dir = Path(cfg["output"]["dir"])
    mesh, target_params, draft_config = run.mesh, run.target_params, run.draft_config
    eval_prompts, total_steps, fingerprint = run.eval_prompts, run.total_steps, run.fingerprint
    with jax.set_mesh(mesh):
        abstract_state = run.abstract_state()
        state_sh = sharding.tree_shardings(abstract_state, mesh)
        ckpts = TrainCheckpoints(out_dir / "checkpoints", keep=cfg["output"]["keep"])
        restored = ckpts.restore_latest(abstract_like(abstract_state, state_sh), fingerprint)
        batches = run.batches()
        if restored is None:
            state = run.initial_state(state_sh)
            start = 0
        else:
            start, state, data_state = restored
            batches.restore(data_state)
            log(f"resumed from {ckpts.directory} at step {start}")
        logger = MetricsLogger(out_dir, enabled=jax.process_index() == 0, resume_step=start)
        train_step = run.jitted_step(state_sh)

        log_every, save_every = cfg["output"]["log_every"], cfg["output"]["save_every"]
        eval_every = cfg["output"]["eval_every"]
        metrics: dict = {}
        eval_tau = None
        stopped = False
        bar = tqdm(total=total_steps, initial=start, desc="train", unit="step", disable=not progress
                   or jax.process_index() != 0, dynamic_ncols=True)
        with _Stop() as stop:
            step = start
            window_t, window_tokens, window_steps = time.perf_counter(), 0.0, 0
            while step < total_steps:
                local = next(batches)
                batch = run.global_batch_of(local)
                state, m = train_step(state, target_params, batch)
                step += 1
                window_steps += 1
                window_tokens += float(np.sum(local["lengths"])) * jax.process_count()
                bar.update(1)
                if step % log_every == 0 or step == total_steps:
                    metrics = _scalarise(jax.device_get(m))  # waits for the step: the timing below is real
                    elapsed = time.perf_counter() - window_t
                    metrics |= {"step_time_s": elapsed / window_steps, "tokens_per_s": window_tokens / elapsed}
                    logger.write(step, metrics)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                                    tau_est=f"{metrics['implied_acceptance_length']:.2f}")
                    window_t, window_tokens, window_steps = time.perf_counter(), 0.0, 0
                if eval_every and step % eval_every == 0 and step < total_steps and eval_prompts:
                    eval_tau = evaluate_tau(run, state.params)
                    logger.write(step, {"eval_tau": eval_tau})
                if stop.requested_anywhere():
                    stop.requested = True
                if step % save_every == 0 or stop.requested:
                    ckpts.save(step, state, batches.state(), fingerprint)
                if stop.requested:
                    log(f"SIGTERM: saved step {step} to {ckpts.directory}; rerun the same command to resume")
                    stopped = True
                    break
        bar.close()
        if not stopped and ckpts.latest_step() != step:
            ckpts.save(step, state, batches.state(), fingerprint)
        ckpts.close()
        export_dir = None
        if not stopped:
            export_dir = export_draft(out_dir / "export", draft_config, state.params, cfg["output"]["export_dtype"],
                                      data_meta, target_params, run.target_config.tie_word_embeddings)
            if jax.process_index() == 0:
                layout = "DeepSpec's Qwen3DSparkModel layout" if draft_config.dspark else "official layout"
                log(f"exported {export_dir / 'draft'} ({layout}) and {export_dir / 'draft-orbax'} (Orbax)")
            if eval_prompts:
                eval_tau = evaluate_tau(run, state.params)
                logger.write(step, {"eval_tau": eval_tau})
                log(f"real tau of the draft on {min(len(eval_prompts), cfg['output']['eval_num_prompts'])} "
                    f"held-out prompts: {eval_tau:.2f}")
        logger.close()
    return FitResult(steps=step, final_metrics=metrics, eval_tau=eval_tau, export_dir=export_dir,
                     stopped_early=stopped)


def _scalarise(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        v = np.asarray(v)
        if v.ndim == 0:
            out[k] = float(v)
        else:
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(v.ravel())})
    return out


def evaluate_tau(run: Run, draft_params: Any, prompts: list[list[int]] | None = None) -> float:
    """The real acceptance length of a draft through the decode engine (greedy, the serving stop tokens), not a
    training estimate: a wrong mask id or a train/serve mismatch shows here and nowhere else (SPEC section 6).
    The decode runs on the run's mesh (params placed by the inference rules, prompts over the batch axes), so
    every process of a multi-process run takes part and reads the same tau."""
    from dflash_jax.engine.decoder import Decoder

    params = jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(run.dtype), tree))(draft_params)
    decoder = Decoder(run.target_config, run.target_params, run.draft_config, params, dtype=run.dtype,
                      mesh=run.mesh)
    chosen = (run.eval_prompts if prompts is None else prompts)[: run.cfg["output"]["eval_num_prompts"]]
    return decoder.generate(chosen, run.cfg["output"]["eval_max_new_tokens"], stop_tokens=run.stop_tokens).tau


def export_draft(directory: Path, config: DraftConfig, params: Any, dtype: str | None,
                 data_meta: dict | None = None, target_params: Any = None, tied: bool = False) -> Path:
    """The trained draft in the official layout (servable by SGLang/vLLM, loadable by ``python -m infer
    --ckpt``) and as an Orbax checkpoint; written beside and renamed into place when complete. Every process
    takes part (Orbax saves collectively); process 0 writes the files. ``data_meta`` (the training data's
    thinking mode) goes into both configs under ``dflash_training_data``; loaders ignore the key."""
    extra = {TRAINING_DATA_KEY: data_meta} if data_meta else {}
    from jax.experimental import multihost_utils

    multi = jax.process_count() > 1
    if config.dspark:  # DeepSpec's layout holds the target's embedding and head beside the backbone
        if target_params is None:
            raise UserError("exporting a DSpark draft needs the target's params (its embedding and head)")
        params = with_head_copies(params, shared_head(target_params, tied))
    if multi:
        params = multihost_utils.process_allgather(params, tiled=True)
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    primary = jax.process_index() == 0
    tmp = directory.with_name(directory.name + ".tmp")
    if primary:
        shutil.rmtree(tmp, ignore_errors=True)
        save_draft(config, host, tmp / "draft", dtype=dtype, extra_config=extra)
    if multi:
        multihost_utils.sync_global_devices("dflash_export_draft")
    orbax_io.save_params(tmp / "draft-orbax", host, "draft", {**config.to_official_dict(), **extra},
                         write_meta=primary)
    if primary:
        if directory.exists():
            old = directory.with_name(directory.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
            tmp.rename(directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(directory)
    if multi:
        multihost_utils.sync_global_devices("dflash_export_done")
    return directory


def read_training_data(cfg: dict, tokenizer: Any, log: Callable[[str], None], progress: bool = True):
    """The run's tokenized rows: ``data.train`` or the ``data.sources`` mixture (weights, dedup, length filters),
    through the tokenized cache, as ``train fit`` reads them."""
    from dflash_jax.data.mixture import prepare_training_data, settings_of

    return prepare_training_data(settings_of(cfg), tokenizer, log, progress)[0]


def read_eval_prompts(cfg: dict, tokenizer: Any) -> list[list[int]]:
    from dflash_jax.data.formats import read_examples
    from dflash_jax.data.regenerate import first_prompt_ids

    examples, _ = read_examples(cfg["data"]["eval_prompts"])
    return [first_prompt_ids(tokenizer, e, cfg["data"]["use_chat_template"], cfg["data"]["enable_thinking"])
            for e in examples]


def param_count(tree: Any) -> int:
    return int(sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree)))


def measure_step(run: Run, steps: int = 10) -> dict:
    """Time the train step and, on the same batches, the frozen target's feature pass alone (the step's
    first part): tokens/s of training and the share of the step the target takes. Nothing is saved."""
    from dflash_jax.training.step import target_features

    with jax.set_mesh(run.mesh):
        state_sh = sharding.tree_shardings(run.abstract_state(), run.mesh)
        state = run.initial_state(state_sh)
        train_step = run.jitted_step(state_sh)
        target = TargetModel(run.target_config, run.dtype)
        features = jax.jit(lambda p, b: target_features(target, p, b, run.step_cfg.feature_layers))
        batches = run.batches()
        batch = run.global_batch_of(next(batches))
        state, _ = train_step(state, run.target_params, batch)  # compile and warm up both programs
        jax.block_until_ready(features(run.target_params, batch))
        step_s, target_s, tokens = [], [], 0.0
        for _ in range(steps):
            local = next(batches)
            batch = run.global_batch_of(local)
            t0 = time.perf_counter()
            jax.block_until_ready(features(run.target_params, batch))
            target_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state, m = train_step(state, run.target_params, batch)
            jax.block_until_ready(m)
            step_s.append(time.perf_counter() - t0)
            tokens += float(np.sum(local["lengths"])) * jax.process_count()
    step, tgt = float(np.median(step_s)), float(np.median(target_s))
    return {"steps": steps, "step_s": step, "target_features_s": tgt, "target_share": tgt / step,
            "tokens_per_s": tokens / float(np.sum(step_s)), "global_batch": run.global_batch,
            "max_length": run.tokenized.max_length, "num_anchors": run.step_cfg.num_anchors,
            "block_size": run.step_cfg.block_size, "draft_params": param_count(run.init_params),
            "target_params": param_count(run.target_params)}


def compare_steps(runs: dict[str, Run], steps: int = 10) -> dict[str, dict]:
    """Time the train steps of several runs side by side: after one warm-up step each, the runs take turns,
    one step at a time, on their own batches, so drift of the machine's speed reaches them all alike. Per run:
    the median step time and the ratio to the first run's."""
    programs = {}
    for name, run in runs.items():
        with jax.set_mesh(run.mesh):
            state_sh = sharding.tree_shardings(run.abstract_state(), run.mesh)
            state, step, batches = run.initial_state(state_sh), run.jitted_step(state_sh), run.batches()
            state, metrics = step(state, run.target_params, run.global_batch_of(next(batches)))
            jax.block_until_ready(metrics)
        programs[name] = [state, step, batches]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, run in runs.items():
            state, step, batches = programs[name]
            with jax.set_mesh(run.mesh):
                batch = run.global_batch_of(next(batches))
                t0 = time.perf_counter()
                state, metrics = step(state, run.target_params, batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - t0)
            programs[name][0] = state
    first = float(np.median(times[next(iter(runs))]))
    return {name: {"step_s": float(np.median(t)), "ratio": float(np.median(t)) / first,
                   "spread_s": float(np.percentile(t, 75) - np.percentile(t, 25))} for name, t in times.items()}
