"""Convert Karpathy's llama2.c checkpoints into Hugging Face LLaMA directories.

llama2.c (``run.c``) reads a flat "version 0" binary: seven little-endian int32 header fields
``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len`` followed by float32 weights in a fixed
order (see :data:`_LAYOUT`), then two legacy RoPE tables, then -- only when ``vocab_size`` is stored negated --
a separate output classifier. Its tokenizer ships as a SentencePiece BPE ``.model`` file.

:func:`convert_llama2c` turns such a pair into a directory that ``transformers`` (and this project's JAX
loaders) read as a plain ``LlamaForCausalLM``: ``config.json``, ``generation_config.json``,
``model.safetensors`` and a ``tokenizers``-backed tokenizer that encodes exactly like the SentencePiece model.

Two details make the conversion more than a reshuffle:

* RoPE convention. llama2.c rotates adjacent pairs ``(x[2i], x[2i+1])``; Hugging Face LLaMA rotates the split
  halves ``(x[i], x[i + head_dim/2])``. Permuting the output rows of ``wq`` and ``wk`` inside every head maps one
  onto the other (the same permutation as llama2.c's ``export.py`` and transformers' LLaMA conversion script),
  and because q and k are permuted identically the attention scores are unchanged.
* Stopping. The llama2.c models were trained on stories that are each *prefixed* by BOS and never followed by
  EOS, so ``run.c`` stops when it samples BOS. ``generation_config.json`` therefore lists both EOS and BOS as
  stop tokens, while ``config.json`` keeps the conventional ``eos_token_id``.

Only NumPy, ``safetensors.numpy``, ``sentencepiece``'s protobuf and ``tokenizers`` are used: no torch.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.errors import UserError

__all__ = [
    "Llama2cConfig",
    "convert_llama2c",
    "permute_rope_rows",
    "read_llama2c",
    "read_llama2c_header",
]

_HEADER = struct.Struct("<7i")
# llama2.c's export.py "version 1/2" files start with this uint32 ("ak42"); run.c cannot read them, and neither
# can this converter, so they get a targeted message instead of a confusing size mismatch.
_VERSIONED_MAGIC = 0x616B3432
# run.c hard-codes these ids (it stops on BOS and strips the space after it), so the tokenizer must agree.
_BOS_ID, _EOS_ID = 1, 2
_RMS_NORM_EPS = 1e-5
_ROPE_THETA = 10000.0
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Llama2cConfig:
    """The llama2.c header, with the tied/untied classifier flag decoded from the sign of ``vocab_size``."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of every float32 block in file order, including the skipped RoPE tables."""
        d, h, n, kv, v = self.dim, self.hidden_dim, self.n_layers, self.kv_dim, self.vocab_size
        blocks: list[tuple[str, tuple[int, ...]]] = [
            ("token_embedding", (v, d)),
            ("rms_att", (n, d)),
            ("wq", (n, d, d)),
            ("wk", (n, kv, d)),
            ("wv", (n, kv, d)),
            ("wo", (n, d, d)),
            ("rms_ffn", (n, d)),
            ("w1", (n, h, d)),
            ("w2", (n, d, h)),
            ("w3", (n, h, d)),
            ("rms_final", (d,)),
            # Precomputed cos/sin tables from early llama2.c versions; run.c skips them and so do we.
            ("freq_cis_real", (self.seq_len, self.head_dim // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_dim // 2)),
        ]
        if not self.shared_classifier:
            blocks.append(("wcls", (v, d)))
        return blocks

    def expected_file_size(self) -> int:
        # Python ints, so a hostile header cannot overflow the arithmetic into a "matching" size.
        return _HEADER.size + 4 * sum(int(np.prod(shape, dtype=object)) for _, shape in self.layout())


def _check_file(path: Path, what: str) -> None:
    if not path.exists():
        raise UserError(f"{what} not found: {path}")
    if not path.is_file():
        raise UserError(f"{what} is not a regular file: {path}")


def read_llama2c_header(bin_path: str | Path) -> Llama2cConfig:
    """Parse and validate the header of a llama2.c ``.bin``, including that the file size matches it.

    Raises ``ValueError`` naming the file for anything that is not a well-formed version-0 checkpoint.
    """
    path = Path(bin_path)
    _check_file(path, "llama2.c checkpoint")
    size = path.stat().st_size
    if size < _HEADER.size:
        raise UserError(f"{path}: {size} bytes is too small for the {_HEADER.size}-byte llama2.c header")
    with path.open("rb") as f:
        raw = f.read(_HEADER.size)
    if struct.unpack_from("<I", raw)[0] == _VERSIONED_MAGIC:
        raise UserError(
            f"{path}: this is a versioned llama2.c export (magic 'ak42'); only the legacy version-0 format "
            "that run.c reads is supported (re-export with export.py --version 0)"
        )
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = _HEADER.unpack(raw)
    fields = {
        "dim": dim,
        "hidden_dim": hidden_dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": abs(vocab_size),
        "seq_len": seq_len,
    }
    bad = [f"{k}={v}" for k, v in fields.items() if v <= 0]
    if bad:
        raise UserError(f"{path}: not a llama2.c checkpoint, non-positive header field(s) {', '.join(bad)}")
    if dim % n_heads:
        raise UserError(f"{path}: dim={dim} is not divisible by n_heads={n_heads}")
    if (dim // n_heads) % 2:
        raise UserError(f"{path}: head size {dim // n_heads} is odd, RoPE needs pairs of dimensions")
    if n_heads % n_kv_heads:
        raise UserError(f"{path}: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")

    cfg = Llama2cConfig(
        dim=dim,
        hidden_dim=hidden_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=abs(vocab_size),
        seq_len=seq_len,
        shared_classifier=vocab_size > 0,
    )
    expected = cfg.expected_file_size()
    if size != expected:
        raise UserError(
            f"{path}: file is {size} bytes but its header ({', '.join(f'{k}={v}' for k, v in fields.items())}, "
            f"{'shared' if cfg.shared_classifier else 'separate'} classifier) implies {expected} bytes; "
            "the file is truncated, padded, or not a llama2.c version-0 checkpoint"
        )
    return cfg


def read_llama2c(bin_path: str | Path) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Read a llama2.c checkpoint into float32 arrays named as in ``run.c`` (``wq`` is ``[L, dim, dim]``, ...).

    ``wcls`` is present only for untied checkpoints; the legacy RoPE tables are dropped. Arrays are in
    llama2.c's own (adjacent-pair RoPE) convention, i.e. not yet permuted.
    """
    path = Path(bin_path)
    cfg = read_llama2c_header(path)
    flat = np.memmap(path, dtype="<f4", mode="r", offset=_HEADER.size)
    weights: dict[str, np.ndarray] = {}
    offset = 0
    for name, shape in cfg.layout():
        count = int(np.prod(shape))
        if not name.startswith("freq_cis"):
            weights[name] = np.array(flat[offset : offset + count], dtype=np.float32).reshape(shape)
        offset += count
    del flat  # release the mapping now rather than whenever the GC gets to it
    for name, array in weights.items():
        if not np.isfinite(array).all():
            raise UserError(f"{path}: weight block {name!r} contains NaN or Inf; not a usable checkpoint")
    return cfg, weights


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder a ``[n_heads * head_dim, in]`` projection from adjacent-pair to split-half RoPE layout.

    Within each head, rows ``2i`` and ``2i + 1`` (a rotated pair in llama2.c) move to ``i`` and
    ``i + head_dim/2`` (a rotated pair for ``rotate_half``). Equivalent to transformers' ``permute``:
    ``w.view(n_heads, head_dim // 2, 2, in).transpose(1, 2).reshape(out, in)``.
    """
    out_dim, in_dim = w.shape
    if out_dim % n_heads or (out_dim // n_heads) % 2:
        raise UserError(f"cannot split {out_dim} rows into {n_heads} heads of even size")
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_dim).transpose(0, 2, 1, 3).reshape(out_dim, in_dim)


def _to_hf_state_dict(cfg: Llama2cConfig, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sd: dict[str, np.ndarray] = {"model.embed_tokens.weight": w["token_embedding"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = w["rms_att"][i]
        sd[f"{p}.self_attn.q_proj.weight"] = permute_rope_rows(w["wq"][i], cfg.n_heads)
        # k has only n_kv_heads heads under grouped-query attention, so it is permuted per KV head.
        sd[f"{p}.self_attn.k_proj.weight"] = permute_rope_rows(w["wk"][i], cfg.n_kv_heads)
        sd[f"{p}.self_attn.v_proj.weight"] = w["wv"][i]
        sd[f"{p}.self_attn.o_proj.weight"] = w["wo"][i]
        sd[f"{p}.post_attention_layernorm.weight"] = w["rms_ffn"][i]
        sd[f"{p}.mlp.gate_proj.weight"] = w["w1"][i]
        sd[f"{p}.mlp.down_proj.weight"] = w["w2"][i]
        sd[f"{p}.mlp.up_proj.weight"] = w["w3"][i]
    sd["model.norm.weight"] = w["rms_final"]
    if not cfg.shared_classifier:
        sd["lm_head.weight"] = w["wcls"]
    return sd


def _numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        # NumPy has no bfloat16; ml_dtypes (a JAX dependency) provides one that safetensors.numpy understands.
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _load_sentencepiece_proto(path: Path) -> Any:
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except DecodeError as e:
        raise UserError(f"{path}: not a SentencePiece model ({e})") from e
    if not proto.pieces:
        raise UserError(f"{path}: not a SentencePiece model (no pieces)")
    return proto


def _build_tokenizer(proto: Any, path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` that reproduces SentencePiece BPE encoding of this model.

    SentencePiece BPE repeatedly merges the adjacent pair whose merged piece scores highest; an HF BPE model
    does the same when its merges are ranked by that score, so every split of every normal piece into two
    vocabulary pieces becomes a merge ranked by the merged piece's score.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from sentencepiece import sentencepiece_model_pb2

    piece_type = sentencepiece_model_pb2.ModelProto.SentencePiece
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        raise UserError(f"{path}: SentencePiece model type must be BPE for llama2.c tokenizers")
    if not trainer.byte_fallback:
        raise UserError(f"{path}: SentencePiece model has no byte fallback, unlike llama2.c tokenizers")
    if trainer.treat_whitespace_as_suffix or not norm.escape_whitespaces:
        raise UserError(f"{path}: unsupported SentencePiece whitespace handling")
    if (trainer.bos_id, trainer.eos_id) != (_BOS_ID, _EOS_ID):
        raise UserError(
            f"{path}: BOS/EOS ids are {trainer.bos_id}/{trainer.eos_id}, but llama2.c assumes {_BOS_ID}/{_EOS_ID}"
        )

    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    if len(vocab) != len(proto.pieces):
        raise UserError(f"{path}: SentencePiece model has duplicate pieces")
    ranked: list[tuple[float, int, str, str]] = []
    for i, p in enumerate(proto.pieces):
        if p.type != piece_type.NORMAL:
            continue
        for k in range(1, len(p.piece)):
            left, right = p.piece[:k], p.piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-p.score, i, left, right))
    ranked.sort(key=lambda m: (m[0], m[1], vocab[m[2]], vocab[m[3]]))
    merges = [(left, right) for _, _, left, right in ranked]

    unk = proto.pieces[trainer.unk_id].piece
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))

    steps: list[Any] = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        # SentencePiece trims and collapses only U+0020 (tabs and newlines survive as byte pieces).
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if steps:
        tok.normalizer = normalizers.Sequence(steps)
    # "always" rather than HF LLaMA's "first": the leading-space strip above shifts offsets, and "first" then
    # wrongly skips the dummy prefix. They differ only for text that contains literal special tokens.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="always" if norm.add_dummy_prefix else "never", split=False
    )
    decode_steps: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decode_steps)

    specials = [p.piece for p in proto.pieces if p.type in (piece_type.CONTROL, piece_type.UNKNOWN)]
    user = [p.piece for p in proto.pieces if p.type == piece_type.USER_DEFINED]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if user:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in user])
    bos = proto.pieces[_BOS_ID].piece
    # Matches llama2.c's run.c and the SentencePiece training data: every sequence starts with BOS, no EOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, _BOS_ID)]
    )
    return tok


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_llama2c(
    bin_path: str | Path,
    tokenizer_model_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
) -> Path:
    """Convert a llama2.c ``.bin`` plus its SentencePiece ``.model`` into a Hugging Face LLaMA directory.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (standard HF key names;
    ``lm_head.weight`` only for untied checkpoints), ``tokenizer.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json`` and a copy of the SentencePiece model as ``tokenizer.model``.
    ``dtype`` is one of ``float32``, ``float16``, ``bfloat16``. Returns ``out_dir`` as a ``Path``.

    Raises ``ValueError`` naming the offending file if either input is missing or malformed, or if the
    tokenizer's vocabulary does not match the checkpoint's.
    """
    from safetensors.numpy import save_file

    if dtype not in _DTYPES:
        raise UserError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    bin_path, tok_path, out = Path(bin_path), Path(tokenizer_model_path), Path(out_dir)
    _check_file(tok_path, "SentencePiece tokenizer model")

    # Validate everything before writing anything, so a failed conversion leaves no half-written directory.
    cfg, weights = read_llama2c(bin_path)
    proto = _load_sentencepiece_proto(tok_path)
    if len(proto.pieces) != cfg.vocab_size:
        raise UserError(
            f"{tok_path}: tokenizer has {len(proto.pieces)} pieces but {bin_path} has vocab_size={cfg.vocab_size}"
        )
    tokenizer = _build_tokenizer(proto, tok_path)

    np_dtype = _numpy_dtype(dtype)
    state = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in _to_hf_state_dict(cfg, weights).items()}

    out.mkdir(parents=True, exist_ok=True)
    # "format": "pt" is what transformers expects in the metadata of a PyTorch-loadable safetensors file.
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    _write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.dim,
            "intermediate_size": cfg.hidden_dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.seq_len,
            "rms_norm_eps": _RMS_NORM_EPS,
            "rope_theta": _ROPE_THETA,
            "rope_scaling": None,
            "hidden_act": "silu",
            "tie_word_embeddings": cfg.shared_classifier,
            "bos_token_id": _BOS_ID,
            "eos_token_id": _EOS_ID,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "use_cache": True,
            # transformers 4.x reads torch_dtype, 5.x reads dtype.
            "torch_dtype": dtype,
            "dtype": dtype,
        },
    )
    _write_json(
        out / "generation_config.json",
        # BOS is a stop token because llama2.c models emit it to start the next story (see module docstring).
        {"bos_token_id": _BOS_ID, "eos_token_id": [_EOS_ID, _BOS_ID]},
    )

    tokenizer.save(str(out / "tokenizer.json"))
    pieces = proto.pieces
    special = {
        "bos_token": pieces[_BOS_ID].piece,
        "eos_token": pieces[_EOS_ID].piece,
        "unk_token": pieces[proto.trainer_spec.unk_id].piece,
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            # The generic class loads tokenizer.json verbatim; LlamaTokenizer would rebuild its own
            # normalizer and pre-tokenizer and lose SentencePiece's whitespace handling.
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": True,
            "add_eos_token": False,
            # Cleanup would glue punctuation ("don 't" style fixes) and break byte-exact round trips.
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.seq_len,
        },
    )
    _write_json(out / "special_tokens_map.json", special)
    shutil.copyfile(tok_path, out / "tokenizer.model")
    return out
