"""``python -m infer`` in two real processes (``jax.distributed`` on a localhost coordinator, one CPU device
each): only process 0 prints, and tokens and acceptance lengths equal a single-process run's.

- ``--mesh data=2`` on the tiny dense pair: the batch is split over the processes, results gathered across them.
- ``--mesh expert=2`` on a block-FP8 DeepSeek-V3 target (the way a multi-host run puts ``expert`` across hosts):
  each process dequantises the checkpoint at load and holds half of every layer's experts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_tiny import write_tiny_pair, write_tokenizer
from conftest import FAST_COMPILE_ENV, free_port
from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft
from dflash_jax.models.draft_config import DraftConfig
from draft_tiny import official_config
from hf_tiny import randomise
from quant_tiny import fp8_quantise, write_checkpoint

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["5,17,9,33,2,41", "7,7,8,19,23,4,4,60,11,3,27"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **FAST_COMPILE_ENV}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("mp"))


@pytest.fixture(scope="module")
def fp8_deepseek_pair(tmp_path_factory):
    """A block-FP8 DeepSeek-V3 target (transformers' tiny random model, quantised by tests/quant_tiny.py) and a
    random block-4 draft."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_mla_quantized import BLOCK, FP8_CONFIG, FP8_LINEAR, TEXT, read
    root = tmp_path_factory.mktemp("mp_mla")
    torch.manual_seed(2)
    text = {**TEXT, "eos_token_id": 2}
    model = randomise(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**text)).eval())
    model.save_pretrained(root / "hf")
    cfg = json.loads((root / "hf" / "config.json").read_text())
    quant = {}
    for key, w in read(root / "hf").items():
        if FP8_LINEAR.search(key):
            codes, scale = fp8_quantise(w, BLOCK)
            quant[key], quant[key[: -len("weight")] + "weight_scale_inv"] = codes, scale
        else:
            quant[key] = w
    target = write_checkpoint(root / "target", {**cfg, "quantization_config": FP8_CONFIG}, quant)
    write_tokenizer(target)  # the CLI wants one even for --prompt-ids
    draft_config = DraftConfig.from_dict(official_config(
        vocab_size=TEXT["vocab_size"], block_size=4, num_target_layers=TEXT["num_hidden_layers"],
        dflash_config={"target_layer_ids": [0, 1], "mask_token_id": TEXT["vocab_size"] - 1}))
    save_draft(draft_config, init_draft_params(draft_config, seed=3), root / "draft")
    return target, root / "draft"


def infer_cmd(target: Path, draft: Path, max_new_tokens: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "infer", "--target", str(target), "--ckpt", str(draft), "--max-new-tokens",
           str(max_new_tokens), "--json"]
    for p in PROMPTS:
        cmd += ["--prompt-ids", p]
    return cmd + list(extra)


def two_processes(cmd: list[str], mesh: str) -> dict:
    """Runs ``cmd`` as processes 0 and 1 of one ``jax.distributed`` job on ``mesh``; process 0's results."""
    port = free_port()
    procs = [subprocess.Popen(cmd + ["--mesh", mesh, "--coordinator", f"localhost:{port}", "--num-processes", "2",
                                     "--process-id", str(i)],
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    # Only process 0 prints results (the CPU collectives library may log a connection line on either).
    assert "{" not in outs[1][0], outs[1][0]
    return json.loads(outs[0][0][outs[0][0].index("{"):])


def one_process(cmd: list[str]) -> dict:
    single = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)
    assert single.returncode == 0, single.stderr[-3000:]
    return json.loads(single.stdout[single.stdout.index("{"):])


def same_decoding(multi: dict, one: dict, max_new_tokens: int) -> None:
    assert [r["tokens"] for r in multi["results"]] == [r["tokens"] for r in one["results"]]
    assert [r["accept_lengths"] for r in multi["results"]] == [r["accept_lengths"] for r in one["results"]]
    assert all(r["matches_baseline"] for r in multi["results"])
    assert all(len(r["tokens"]) == max_new_tokens or r["tokens"][-1] == 2 for r in multi["results"])


def test_two_processes_decode_like_one(pair):
    cmd = infer_cmd(*pair, 16, "--adaptive", "1,2,4")
    # The reference: DFlash alone (the baseline's agreement is checked on the two processes).
    same_decoding(two_processes(cmd + ["--baseline"], "data=2"), one_process(cmd), 16)


def test_experts_across_two_processes_decode_like_one(fp8_deepseek_pair):
    cmd = infer_cmd(*fp8_deepseek_pair, 12, "--baseline")
    one = one_process(cmd)
    same_decoding(two_processes(cmd, "expert=2"), one, 12)
    assert all(r["matches_baseline"] for r in one["results"])
    assert sum(len(r["tokens"]) for r in one["results"]) > 12
