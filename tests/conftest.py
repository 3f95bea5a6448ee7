"""Shared test settings: fp32 CPU JAX, the location of the shared real test data, a free local port."""

import os
import shutil
import socket
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every program of the suite (in these processes and in the subprocesses they start, which inherit the
# environment) compiles without XLA's backend optimizations (LLVM's passes): on these tiny models compiling is
# most of a test's time (one A/B on 2026-12-03, 2-core x86_64: 45 instead of 60 CPU-minutes). The tests
# compare results with references at stated tolerances; none depends on how fast the code runs. The device
# compilers' checks (tests/test_aot_compile.py and the plans) read XLA:GPU / TPU programs, which the flag also
# leaves unoptimised; their assertions (loops per round, fused kernels, bytes read) hold either way.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One persistent compilation cache for the whole run, in a temporary folder shared by the xdist workers and the
# subprocesses (never the user's: tests/test_compile_cache.py checks the user-facing cache in its own folder):
# the same tiny pairs compile in many modules and command lines.
_OWNS_CACHE = "DFLASH_JAX_SUITE_CACHE" not in os.environ  # the first process (the xdist controller) makes it
if _OWNS_CACHE:
    os.environ["DFLASH_JAX_SUITE_CACHE"] = tempfile.mkdtemp(prefix="dflash_jax_tests_")
SUITE_CACHE = Path(os.environ["DFLASH_JAX_SUITE_CACHE"])
os.environ["DFLASH_JAX_COMPILE_CACHE"] = str(SUITE_CACHE)  # the command lines'
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(SUITE_CACHE)  # every jax process's (read when jax is imported)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
os.environ["DFLASH_JAX_DATA_CACHE"] = str(SUITE_CACHE / "tokenized")  # train fit's tokenized rows: never the user's
# One thread per XLA:CPU computation: the two xdist workers (and the subprocesses they start) share 2 cores, and
# on these tiny programs Eigen's thread pool costs more than it gives (A/B on 2026-12-08, 2 cores, two engine
# modules under -n 2: 240 -> 161 s wall, CPU time about equal). Appended, so a caller's flags are kept (and every
# token must be a --flag: XLA stops reading XLA_FLAGS at the first one that is not, dropping the rest).
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_cpu_multi_thread_eigen=false"]))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_file(*parts: str) -> Path:
    """A file of ../shared/data, or a clean skip when the folder is absent on this machine."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared test data not available: {path.name}")
    return path


# For command-line subprocesses whose runs are compared only with each other (or with fixed expectations that do
# not depend on rounding): programs compiled without XLA's backend optimizations (LLVM's passes), ~40% less
# compile time on these tiny models, where compiling is most of a run (tests/sharded_decode_check.py measures it).
FAST_COMPILE_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def free_port() -> int:
    """A free localhost port (for a jax.distributed coordinator in multi-process tests)."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def pytest_unconfigure(config):
    if _OWNS_CACHE:
        shutil.rmtree(SUITE_CACHE, ignore_errors=True)


def pytest_configure(config):
    # Tiny models: multi-threaded torch CPU kernels are far slower than one thread here (measured ~40x on
    # 200 greedy steps of stories260K on 2 cores).
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


# The longest modules (mostly subprocesses over 8 fake devices or 2 processes) go first, longest first, so that
# with two xdist workers (pyproject's addopts: -n 2 --dist loadfile) no long module starts last while the other
# worker sits idle. Seconds alone on the shared 2-core VM (2026-12-03): train_fit ~300, moe_sharded ~230,
# train_step ~245, aot_compile ~150, engine_sharded ~130, fused_attention ~100, train_plan_device ~70,
# multiprocess_infer ~65.
# Later modules of a minute or more, by their helpers' runs on a loaded machine (2026-12-03): glm_moe_dsa ~150,
# deepseek_v3 ~80, mla_sharded (both MLA families) ~150, muse_glimmer, gemma4.
LONG_MODULES = ("test_train_fit.py", "test_train_step.py", "test_moe_sharded.py", "test_aot_compile.py",
                "test_engine_sharded.py", "test_fused_attention.py", "test_glm_moe_dsa.py",
                "test_deepseek_v3.py", "test_train_plan_device.py",
                "test_multiprocess_infer.py", "test_mla_sharded.py", "test_muse_glimmer.py",
                "test_gemma4.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_MODULES)))  # stable: order kept otherwise
