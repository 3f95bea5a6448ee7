"""A block-FP8 DeepSeek-V3 target with its experts split across two real processes (``jax.distributed`` on a
localhost coordinator, one CPU device each, ``--mesh expert=2``: the way a multi-host run puts ``expert`` across
hosts): each process dequantises the checkpoint at load and holds half of every layer's experts; DFlash with a
random draft and the baseline give the tokens and acceptance lengths of a single-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cli_tiny import write_tokenizer  # noqa: E402
from conftest import free_port  # noqa: E402
from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft  # noqa: E402
from dflash_jax.models.draft_config import DraftConfig  # noqa: E402
from draft_tiny import official_config  # noqa: E402
from hf_tiny import randomise  # noqa: E402
from test_mla_quantized import FP8_CONFIG, FP8_LINEAR, TEXT, fp8_quantise, read, write  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["5,17,9,33,2,41", "7,7,8,19,23,4,4,60,11,3,27"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp_mla")
    torch.manual_seed(2)
    text = {**TEXT, "eos_token_id": 2}
    model = randomise(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**text)).eval())
    model.save_pretrained(root / "hf")
    cfg = json.loads((root / "hf" / "config.json").read_text())
    quant = {}
    for key, w in read(root / "hf").items():
        if FP8_LINEAR.search(key):
            codes, scale = fp8_quantise(w)
            quant[key], quant[key[: -len("weight")] + "weight_scale_inv"] = codes, scale
        else:
            quant[key] = w
    target = write(root / "target", {**cfg, "quantization_config": FP8_CONFIG}, quant)
    write_tokenizer(target)  # the CLI wants one even for --prompt-ids
    draft_config = DraftConfig.from_dict(official_config(
        vocab_size=TEXT["vocab_size"], block_size=4, num_target_layers=TEXT["num_hidden_layers"],
        dflash_config={"target_layer_ids": [0, 1], "mask_token_id": TEXT["vocab_size"] - 1}))
    save_draft(draft_config, init_draft_params(draft_config, seed=3), root / "draft")
    return target, root / "draft"


def infer_cmd(target: Path, draft: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "infer", "--target", str(target), "--ckpt", str(draft), "--max-new-tokens", "12",
           "--json", "--baseline"]
    for p in PROMPTS:
        cmd += ["--prompt-ids", p]
    return cmd + list(extra)


def test_experts_across_two_processes_decode_like_one(pair):
    target, draft = pair
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    port = free_port()
    procs = [subprocess.Popen(infer_cmd(target, draft, "--mesh", "expert=2", "--coordinator", f"localhost:{port}",
                                        "--num-processes", "2", "--process-id", str(i)),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "{" not in outs[1][0], outs[1][0]  # only process 0 prints results
    multi = json.loads(outs[0][0][outs[0][0].index("{"):])
    single = subprocess.run(infer_cmd(target, draft), cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert single.returncode == 0, single.stderr[-3000:]
    one = json.loads(single.stdout[single.stdout.index("{"):])
    assert [r["tokens"] for r in multi["results"]] == [r["tokens"] for r in one["results"]]
    assert [r["accept_lengths"] for r in multi["results"]] == [r["accept_lengths"] for r in one["results"]]
    assert all(r["matches_baseline"] for r in multi["results"] + one["results"])
    assert all(len(r["tokens"]) == 12 or r["tokens"][-1] == 2 for r in multi["results"])
    assert np.sum([len(r["tokens"]) for r in one["results"]]) > 12
