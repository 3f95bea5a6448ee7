"""The command lines' persistent compilation cache: on by default where DFLASH_JAX_COMPILE_CACHE points,
off with --no-compile-cache or DFLASH_JAX_COMPILE_CACHE=0, a warning (not a failure) where it cannot be made;
a second process with the same shapes loads the programs instead of compiling them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from dflash_jax import compile_cache

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=512)


def plan(tmp_path, env_value, *flags):
    """``python -m infer plan`` of a tiny target on this CPU in a fresh process; JAX's threshold lowered so
    that the tiny programs are stored."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "DFLASH_JAX_COMPILE_CACHE": env_value}
    return subprocess.run([sys.executable, "-m", "infer", "plan", "--target-config", str(cfg), "--context", "64",
                           "--max-new-tokens", "8", "--dtype", "float32", "--json", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_programs_are_kept_and_only_when_asked(tmp_path):
    cache = tmp_path / "xla"
    first = plan(tmp_path, str(cache))
    assert first.returncode == 0, first.stderr
    stored = sorted(p.name for p in cache.iterdir())
    assert len(stored) >= 2  # prefill and decode loop (and the small helpers jit compiles on the way)
    second = plan(tmp_path, str(cache))
    assert second.returncode == 0 and sorted(p.name for p in cache.iterdir()) == stored  # loaded, none new



def test_no_compile_cache_flag(monkeypatch, tmp_path):
    from infer.plan import main

    off = tmp_path / "off"
    monkeypatch.setenv("DFLASH_JAX_COMPILE_CACHE", str(off))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert main(["--target-config", str(cfg), "--context", "64", "--max-new-tokens", "8", "--dtype", "float32",
                 "--json", "--no-compile-cache"]) == 0
    assert not off.exists()


def test_cache_dir_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_JAX_COMPILE_CACHE", "off")
    assert compile_cache.cache_dir() is None and compile_cache.enable() is None
    monkeypatch.setenv("DFLASH_JAX_COMPILE_CACHE", str(tmp_path / "c"))
    assert compile_cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DFLASH_JAX_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_dir() == tmp_path / "dflash_jax" / "xla"


def test_an_unwritable_place_is_a_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(Warning, match="not kept on disk: cannot create"):
        assert compile_cache.enable(blocker / "xla") is None
    assert jax.config.jax_compilation_cache_dir == before
