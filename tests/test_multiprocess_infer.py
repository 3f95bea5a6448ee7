"""``python -m infer`` in two real processes (``jax.distributed`` on a localhost coordinator, one CPU device
each, ``--mesh data=2``): the batch is split over the processes, results are gathered across them, only
process 0 prints, and tokens and acceptance lengths equal a single-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_tiny import write_tiny_pair
from conftest import FAST_COMPILE_ENV, free_port

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["5,17,9,33,2,41", "7,7,8,19,23,4,4,60,11,3,27"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("mp"))


def infer_cmd(target: Path, draft: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "infer", "--target", str(target), "--ckpt", str(draft), "--max-new-tokens", "16",
           "--json", "--adaptive", "1,2,4"]
    for p in PROMPTS:
        cmd += ["--prompt-ids", p]
    return cmd + list(extra)


def test_two_processes_decode_like_one(pair):
    target, draft = pair
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **FAST_COMPILE_ENV}
    port = free_port()
    procs = [subprocess.Popen(infer_cmd(target, draft, "--baseline", "--mesh", "data=2", "--coordinator",
                                        f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    # Only process 0 prints results (the CPU collectives library may log a connection line on either).
    assert "{" not in outs[1][0], outs[1][0]
    multi = json.loads(outs[0][0][outs[0][0].index("{"):])
    # The reference: DFlash alone (the baseline's agreement is checked on the two processes above).
    single = subprocess.run(infer_cmd(target, draft), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    one = json.loads(single.stdout)
    assert [r["tokens"] for r in multi["results"]] == [r["tokens"] for r in one["results"]]
    assert [r["accept_lengths"] for r in multi["results"]] == [r["accept_lengths"] for r in one["results"]]
    assert all(r["matches_baseline"] for r in multi["results"])
    assert all(len(r["tokens"]) == 16 or r["tokens"][-1] == 2 for r in multi["results"])
