"""Tests for the llama2.c -> Hugging Face LLaMA converter (``dflash_jax.checkpoints.llama2c``).

The real-model tests use Karpathy's stories260K from ``../shared/data`` (skipped when absent); the permutation
test builds its own tiny random checkpoint and checks transformers against a NumPy port of llama2.c's run.c.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.checkpoints.llama2c import convert_llama2c, read_llama2c_header

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "stories260K"
BIN = DATA / "stories260K.bin"
TOK = DATA / "tok512.model"
EXPECTED = DATA / "expected_greedy_200.txt"
FIRST_20 = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]


def _need_data() -> None:
    if not (BIN.is_file() and TOK.is_file() and EXPECTED.is_file()):
        pytest.skip(f"stories260K data not found under {DATA}")


@pytest.fixture
def torch_one_thread() -> Iterator[object]:
    """torch, limited to one intra-op thread while the test runs.

    These models are tiny, and multi-threaded CPU matmuls made 200 greedy steps ~40x slower here (25 s vs 0.6 s).
    """
    torch = pytest.importorskip("torch")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield torch
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _need_data()
    return convert_llama2c(BIN, TOK, tmp_path_factory.mktemp("stories260K_hf"))


# --------------------------------------------------------------------------------------------------------------
# stories260K end to end


def test_stories260k_greedy_matches_llama2c(converted: Path, torch_one_thread: object) -> None:
    torch = torch_one_thread
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    tensors = load_file(converted / "model.safetensors")
    assert "lm_head.weight" not in tensors  # stories260K stores a positive vocab_size: tied classifier
    assert len(tensors) == 1 + 5 * 9 + 1

    model = transformers.LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    assert model.config.tie_word_embeddings

    # `run stories260K.bin -z tok512.bin -t 0 -n 200` runs forward() at positions 0..199 (BOS at 0) and prints
    # the token sampled at each of them, i.e. 200 new tokens; 199 would stop one word short ("...so she" ->
    # "...so"). It would stop early on a sampled BOS, which generation_config lists as a stop token too.
    with torch.inference_mode():
        out = model.generate(torch.tensor([[1]]), max_new_tokens=200, do_sample=False)
    new_ids = out[0, 1:].tolist()
    assert new_ids[:20] == FIRST_20
    assert len(new_ids) == 200 and 1 not in new_ids

    # expected_greedy_200.txt is llama2.c's test_all.py `expected_stdout`: run.c's stdout minus the single "\n"
    # it prints after generation (the tok/s line goes to stderr), so it has no trailing newline. run.c drops the
    # leading space of the first piece after BOS and prints <0x0A> as a raw newline; the tokenizer's decoder does
    # the same, so the decoded text of the 200 new tokens, UTF-8 encoded, must equal the file's bytes exactly.
    text = tokenizer.decode(new_ids)
    assert text.encode("utf-8") == EXPECTED.read_bytes()


def test_tokenizer_matches_sentencepiece(converted: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")

    sp = spm.SentencePieceProcessor(model_file=str(TOK))
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    samples = [
        'Lily\'s mom said, "Let\'s go to the park." Tom was 3 years old.\nThe end!',
        "  leading, trailing  and  double spaces  ",
        "tabs\tand\nnewlines,\n\n unicode: café 😀",
        "",
    ]
    for text in samples:
        expected = sp.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text
        assert tokenizer(text).input_ids == [1, *expected], text  # BOS is prepended, never EOS
    assert tokenizer.decode(sp.encode(samples[0])) == samples[0]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (1, 2, 0)


# --------------------------------------------------------------------------------------------------------------
# Validation


def test_truncated_file_is_rejected(tmp_path: Path) -> None:
    _need_data()
    bad = tmp_path / "truncated.bin"
    bad.write_bytes(BIN.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated.bin") as info:
        convert_llama2c(bad, TOK, tmp_path / "out")
    assert "implies 1056540 bytes" in str(info.value)
    assert not (tmp_path / "out").exists()  # nothing is written for a bad input


def test_missing_file_is_rejected(tmp_path: Path) -> None:
    missing = tmp_path / "nope.bin"
    with pytest.raises(ValueError, match=r"not found: .*nope\.bin"):
        read_llama2c_header(missing)


def _header(dim: int, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int) -> bytes:
    return struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab, seq)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x00" * 10, "too small"),
        (_header(0, 8, 1, 2, 2, 4, 4), "non-positive"),
        (_header(10, 8, 1, 4, 4, 4, 4), "not divisible by n_heads"),
        (_header(12, 8, 1, 4, 4, 4, 4), "odd"),
        (_header(16, 8, 1, 4, 3, 4, 4), "not a multiple of n_kv_heads"),
        (struct.pack("<Ii", 0x616B3432, 1) + b"\x00" * 248, "versioned"),
        (_header(16, 8, 1, 4, 4, 4, 4) + b"\x00" * 64, "implies"),
    ],
)
def test_malformed_headers_are_rejected(tmp_path: Path, raw: bytes, message: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=message) as info:
        read_llama2c_header(path)
    assert "bad.bin" in str(info.value)


# --------------------------------------------------------------------------------------------------------------
# RoPE permutation, checked against an independent NumPy port of llama2.c's run.c

TINY = dict(dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, seq_len=16)


def _tiny_weights(rng: np.random.Generator, shared: bool) -> dict[str, np.ndarray]:
    d, h, n, v = TINY["dim"], TINY["hidden_dim"], TINY["n_layers"], TINY["vocab_size"]
    kv = TINY["n_kv_heads"] * d // TINY["n_heads"]

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    w = {
        "token_embedding": mat(v, d),
        "rms_att": 1.0 + mat(n, d),
        "wq": mat(n, d, d),
        "wk": mat(n, kv, d),
        "wv": mat(n, kv, d),
        "wo": mat(n, d, d),
        "rms_ffn": 1.0 + mat(n, d),
        "w1": mat(n, h, d),
        "w2": mat(n, d, h),
        "w3": mat(n, h, d),
        "rms_final": 1.0 + mat(d),
    }
    if not shared:
        w["wcls"] = mat(v, d)
    return w


def _write_llama2c_bin(path: Path, w: dict[str, np.ndarray], shared: bool, rng: np.random.Generator) -> None:
    """Write the run.c layout by hand (not via the module under test)."""
    head = TINY["dim"] // TINY["n_heads"]
    vocab = TINY["vocab_size"] if shared else -TINY["vocab_size"]
    order = ["token_embedding", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final"]
    # Junk in the legacy RoPE tables proves the converter skips them rather than reading them as weights.
    rope_tables = rng.standard_normal(2 * TINY["seq_len"] * head // 2).astype(np.float32)
    blocks = [w[k] for k in order] + [rope_tables] + ([] if shared else [w["wcls"]])
    with path.open("wb") as f:
        dims = [TINY[k] for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads")]
        f.write(_header(*dims, vocab, TINY["seq_len"]))
        for block in blocks:
            f.write(np.ascontiguousarray(block, dtype="<f4").tobytes())


def _run_c_forward(w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """llama2.c's forward(), token by token with a KV cache; returns the logits at every position."""
    d, n_heads, n_kv = TINY["dim"], TINY["n_heads"], TINY["n_kv_heads"]
    hs = d // n_heads
    kv_dim, kv_mul = n_kv * hs, n_heads // n_kv
    wcls = w.get("wcls", w["token_embedding"])

    def rmsnorm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        ss = np.float32(1.0) / np.sqrt(np.mean(x * x) + np.float32(1e-5))
        return weight * (ss * x)

    key_cache = np.zeros((TINY["n_layers"], len(tokens), kv_dim), np.float32)
    value_cache = np.zeros_like(key_cache)
    all_logits = []
    for pos, token in enumerate(tokens):
        x = w["token_embedding"][token].copy()
        for layer in range(TINY["n_layers"]):
            xb = rmsnorm(x, w["rms_att"][layer])
            q = w["wq"][layer] @ xb
            k = w["wk"][layer] @ xb
            v = w["wv"][layer] @ xb
            # RoPE exactly as run.c: rotate adjacent pairs (i, i+1); q spans dim, k only kv_dim.
            for i in range(0, d, 2):
                freq = 1.0 / 10000.0 ** ((i % hs) / hs)
                fcr, fci = np.cos(pos * freq), np.sin(pos * freq)
                for vec in (q, k) if i < kv_dim else (q,):
                    v0, v1 = vec[i], vec[i + 1]
                    vec[i], vec[i + 1] = v0 * fcr - v1 * fci, v0 * fci + v1 * fcr
            key_cache[layer, pos], value_cache[layer, pos] = k, v
            att_out = np.zeros(d, np.float32)
            for h in range(n_heads):
                kv_slice = slice((h // kv_mul) * hs, (h // kv_mul + 1) * hs)
                scores = key_cache[layer, : pos + 1, kv_slice] @ q[h * hs : (h + 1) * hs] / np.sqrt(hs)
                scores = np.exp(scores - scores.max())
                scores /= scores.sum()
                att_out[h * hs : (h + 1) * hs] = scores @ value_cache[layer, : pos + 1, kv_slice]
            x = x + w["wo"][layer] @ att_out
            xb = rmsnorm(x, w["rms_ffn"][layer])
            gate, up = w["w1"][layer] @ xb, w["w3"][layer] @ xb
            x = x + w["w2"][layer] @ (gate / (1.0 + np.exp(-gate)) * up)
        all_logits.append(wcls @ rmsnorm(x, w["rms_final"]))
    return np.stack(all_logits)


@pytest.mark.parametrize("shared", [True, False], ids=["tied", "untied"])
def test_permutation_matches_run_c(tmp_path: Path, torch_one_thread: object, shared: bool) -> None:
    torch = torch_one_thread
    transformers = pytest.importorskip("transformers")

    rng = np.random.default_rng(1234 + shared)
    weights = _tiny_weights(rng, shared)
    bin_path = tmp_path / "tiny.bin"
    _write_llama2c_bin(bin_path, weights, shared, rng)
    cfg = read_llama2c_header(bin_path)
    assert (cfg.dim, cfg.n_layers, cfg.n_kv_heads, cfg.shared_classifier) == (16, 2, 2, shared)

    tok_path = _tiny_sentencepiece(tmp_path)
    out = convert_llama2c(bin_path, tok_path, tmp_path / "hf")
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings is shared

    tokens = [1, 5, 17, 30, 2, 9, 9, 21, 0, 13, 31, 4]  # 12 positions: every RoPE frequency turns visibly
    reference = _run_c_forward(weights, tokens)
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(logits[-1], reference[-1], rtol=0, atol=1e-4)
    assert np.abs(logits - reference).max() <= 1e-4


def _tiny_sentencepiece(tmp_path: Path) -> Path:
    """A hand-made 32-piece SentencePiece BPE model, so this test does not depend on the shared data."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = TINY["vocab_size"]
    kinds = pb.ModelProto.SentencePiece
    for piece, kind in [("<unk>", kinds.UNKNOWN), ("<s>", kinds.CONTROL), ("</s>", kinds.CONTROL)]:
        proto.pieces.add(piece=piece, score=0.0, type=kind)
    normal = ["\u2581a", "ab"] + ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    for rank, piece in enumerate(normal):
        proto.pieces.add(piece=piece, score=-float(rank), type=kinds.NORMAL)
    assert len(proto.pieces) == TINY["vocab_size"]
    path = tmp_path / "tiny.model"
    path.write_bytes(proto.SerializeToString())
    return path
