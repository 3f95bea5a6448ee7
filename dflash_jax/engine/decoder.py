"""A loaded target (+ optional draft) ready to generate: the object behind ``python -m infer``.

It owns the choice between DFlash and the autoregressive baseline, which share one engine, so the measured
speedup compares like with like.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from dflash_jax.engine.generate import (
    DecodeSettings, GenerationResult, generate, prompt_width,
)
from dflash_jax.engine.proposers import NoProposer, make_proposer
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.errors import UserError
from dflash_jax.models.config import TargetConfig, read_json_object, token_ids_field
from dflash_jax.models.draft import HEAD_COPIES, shared_head, split_head_copies
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.models.attention_kernels import check_attention_kernel
from dflash_jax.precision import resolve_dtype


@dataclasses.dataclass
class Decoder:
    target_config: TargetConfig
    target_params: dict
    draft_config: DraftConfig | None = None
    draft_params: dict | None = None
    block_size: int | None = None  # defaults to the draft's block size
    dtype: Any = jnp.float32
    mesh: Any = None  # a jax Mesh (dflash_jax.sharding.make_mesh): params placed by the sharding rules table
    adaptive_widths: tuple[int, ...] = ()  # DecodeSettings.adaptive_widths: verify widths chosen per phase
    width_costs: tuple[float, ...] = ()  # DecodeSettings.width_costs: their relative round times (else measured)
    attention: str = "auto"  # DecodeSettings.attention: the attention kernel
    draft_window: int | None = None  # DraftModel.draft_window: every draft layer sees at most this much context
    tree_budget: int = 0  # DecodeSettings.tree_budget: nodes of a verified draft tree per round (0: the chain)
    tree_auto: tuple[int, ...] = ()  # DecodeSettings.tree_auto: the chain or one of these budgets, per phase
    block_verify: bool = False  # DecodeSettings.block_verify: sampled chains judged as whole blocks
    confidence_threshold: float = 0.0  # DSpark: verify each row up to its first draft predicted below this
    # DSpark drafts hold copies of the target's embedding and head: "shared" once found equal to the target's
    # (and dropped), "own" where they differ (the draft decodes with its own); None for other drafts.
    head_source: str | None = dataclasses.field(default=None, init=False)
    # (params it was made from, config, params) the engine decodes with: see ``decoding_target``
    _decoding: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.dtype = resolve_dtype(self.dtype)
        check_attention_kernel(self.attention)
        if self.mesh is not None:  # params already in their shardings (straight from the loader) stay put
            from dflash_jax import sharding

            place = lambda tree: jax.device_put(tree, sharding.tree_shardings(tree, self.mesh))  # noqa: E731
            self.target_params = place(self.target_params)
            if self.draft_params is not None:
                self.draft_params = place(self.draft_params)
        if self.draft_config is not None:
            self.draft_config.validate_against(self.target_config)
            if self.block_size is None:
                self.block_size = self.draft_config.block_size
            least = 1 if self.draft_config.dspark else 2
            if not least <= self.block_size <= self.draft_config.block_size:
                raise UserError(
                    f"block_size {self.block_size} must be between {least} and the draft's block_size "
                    f"{self.draft_config.block_size}"
                )
            self.proposer()  # checks the window and the threshold
            if self.draft_params is not None and any(name in self.draft_params for name in HEAD_COPIES):
                self._share_head_copies()

    def proposer(self):
        return make_proposer(self.draft_config, self.block_size, self.dtype, self.draft_window,
                             self.confidence_threshold)

    def _share_head_copies(self) -> None:
        """A DSpark draft's own embedding/head: dropped when equal to the target's (one copy in memory),
        kept (and decoded with) when they differ."""
        backbone, own = split_head_copies(self.draft_params)
        target = shared_head(self.target_params, self.target_config.tie_word_embeddings)
        target_head = target.head_kernel if target.head_kernel is not None else jnp.transpose(target.embedding)
        same = (own.embedding.shape == target.embedding.shape and own.head_kernel.shape == target_head.shape
                and bool(jnp.array_equal(own.embedding, target.embedding.astype(own.embedding.dtype)))
                and bool(jnp.array_equal(own.head_kernel, target_head.astype(own.head_kernel.dtype))))
        if same:
            self.draft_params, self.head_source = backbone, "shared"
        else:
            self.head_source = "own"

    @property
    def has_draft(self) -> bool:
        return self.draft_config is not None

    def decoding_target(self) -> tuple[TargetConfig, dict]:
        """The target config and params the engine decodes with (both loops alike). On CPU a tied head is
        given as an explicit ``lm_head/kernel`` [H, V], a transposed copy of the embedding made once here:
        XLA:CPU's ``x @ E.T`` inside the decode loop costs ~5% of a DFlash round more than ``x @ kernel`` (the
        same products, so the same logits up to float rounding; greedy tokens checked identical by the tests),
        for one more embedding-sized array. The draft's shared head then uses the same kernel. Elsewhere
        (accelerators, a mesh) the params are used as given."""
        cfg, params = self.target_config, self.target_params
        if not (cfg.tie_word_embeddings and self.mesh is None and jax.default_backend() == "cpu"):
            return cfg, params
        if self._decoding is None or self._decoding[0] is not params:
            kernel = jnp.transpose(params["embed_tokens"]["embedding"])  # eager: a materialised [H, V] copy
            self._decoding = (params, dataclasses.replace(cfg, tie_word_embeddings=False),
                              {**params, "lm_head": {"kernel": kernel}})
        return self._decoding[1], self._decoding[2]

    def check_fits(self, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
        """Refuse before compiling anything when a prompt cannot fit the target's positions."""
        prompt_width(max(prompt_lengths), max_new_tokens, self.target_config.max_position_embeddings)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingConfig = SamplingConfig(),
        stop_tokens: Sequence[int] = (),
        baseline: bool = False,
        seed: int = 0,
        on_tokens: Callable[[list[list[int]]], None] | None = None,
    ) -> GenerationResult:
        self.check_fits([len(p) for p in prompts], max_new_tokens)
        settings = DecodeSettings(max_new_tokens, sampling, tuple(int(t) for t in stop_tokens), mesh=self.mesh,
                                  adaptive_widths=() if baseline else tuple(self.adaptive_widths),
                                  width_costs=() if baseline else tuple(self.width_costs),
                                  attention=self.attention, tree_budget=0 if baseline else self.tree_budget,
                                  tree_auto=() if baseline else tuple(self.tree_auto),
                                  block_verify=self.block_verify)
        target_config, target_params = self.decoding_target()
        if baseline or not self.has_draft:
            return generate(target_config, target_params, prompts, NoProposer(), NoProposer().init(),
                            settings, seed, self.dtype, on_tokens=on_tokens)
        proposer = self.proposer().on_mesh(self.mesh)
        head = shared_head(target_params, target_config.tie_word_embeddings)
        return generate(target_config, target_params, prompts, proposer,
                        lambda slots: proposer.init(self.draft_params, head, len(prompts), slots), settings, seed,
                        self.dtype, on_tokens=on_tokens)


def stop_tokens_of(target_config: TargetConfig, tokenizer: Any = None, target_dir: Path | None = None) -> list[int]:
    """EOS ids from the model config, ``generation_config.json`` and the tokenizer."""
    ids = set(target_config.eos_token_ids)
    if target_dir is not None and (target_dir / "generation_config.json").is_file():
        path = target_dir / "generation_config.json"
        ids.update(token_ids_field(read_json_object(path, "generation config"), "eos_token_id", str(path),
                                   target_config.vocab_size))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def encode_conversation(tokenizer: Any, messages: list[dict], use_chat_template: bool = True,
                        enable_thinking: bool = False) -> list[int]:
    """Token ids of a conversation ending in a user turn, with the generation prompt (thinking off unless
    asked: Qwen3's switch, ignored by other templates) when the tokenizer has a chat template; otherwise the
    plain text of the last message (with BOS)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(messages[-1]["content"])["input_ids"])


def decode_continuation(tokenizer: Any, prompt_ids: Sequence[int], new_ids: Sequence[int],
                        keep_special: bool = False) -> str:
    """The text that ``new_ids`` add after ``prompt_ids``. Decoding the new ids alone loses what depends on
    their left context: a SentencePiece tokenizer drops the leading space of a word-start token ("Lily" +
    " was" would come back as "Lily" + "was"). So decode both and take the difference; when that is not an
    extension (a tokenizer that rewrites earlier text), fall back to the new ids alone. ``keep_special``
    keeps special tokens in the text (for display they are dropped)."""
    skip = not keep_special
    head = tokenizer.decode(list(prompt_ids), skip_special_tokens=skip)
    whole = tokenizer.decode(list(prompt_ids) + list(new_ids), skip_special_tokens=skip)
    if whole.startswith(head):
        return whole[len(head):]
    return tokenizer.decode(list(new_ids), skip_special_tokens=skip)
