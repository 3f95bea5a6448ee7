#!/usr/bin/env bash
# The first run on a lent GPU (scripts/tpu_check.sh runs it on a TPU host), in one command of at most 8 minutes
# (no install there: PYTHONPATH=.; no grain and no ../shared, so data-dependent tests skip):
#   bash scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else runs/gpu)
# 1. the accelerator tests: the fused-attention kernels (cuDNN against the dense softmax and the loop, bf16),
#    the expert paths against each other, and greedy decoding (float32 with explicit highest-precision
#    matmuls: the CPU's tokens);
# 2. per target shape, random bfloat16 weights: `python -m infer plan --device local` (what the compiler says
#    one device holds and runs) beside `python -m infer speed` (tokens/s, verify(B) / AR step, the speedup
#    bound, peak device memory): Qwen3-8B (whole), gpt-oss-20b, gpt-oss-120b (packed MXFP4),
#    Qwen3-Coder-30B-A3B and Qwen3.5-35B-A3B (each cut to its first layers, to fit the time; the per-layer
#    figures are what the cut measures).
# Each step writes OUT_DIR/<step>.txt (speed also <step>.json) and prints its tail; a step that fails or runs
# out of time does not stop the next. STEPS=tests|shapes runs one half. The older long checks (a 16k-slot
# cache, prefill memory, whole MoE targets) remain in docs/speed.md's commands.
set -uo pipefail
OUT_DIR=${1:-${OUT:-runs/gpu}}
mkdir -p "$OUT_DIR"
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} DFLASH_JAX_COMPILE_CACHE=0

step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT_DIR/$name.txt" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s"
  tail -n 14 "$OUT_DIR/$name.txt"
}

{ if [ "$JAX_PLATFORMS" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
  python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"; } \
  > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"

if [ "${STEPS:-all}" = all ] || [ "${STEPS:-all}" = tests ]; then
step tests 80 python -m pytest -q -x -p no:cacheprovider -o addopts= tests/test_fused_attention.py \
  tests/test_expert_paths.py tests/test_engine_greedy.py
fi

# name, speed/plan arguments, time limit of the speed step
shape() {
  local name=$1 limit=$2
  shift 2
  step "plan-$name" 30 python -m infer plan "$@" --dtype bfloat16 --context 1024 --max-new-tokens 128 \
    --device local --json
  step "speed-$name" "$limit" python -m infer speed "$@" --dtype bfloat16 --context 1024 --new-tokens 65 \
    --tau 6 --repeats 3 --e2e-repeats 1 --json "$OUT_DIR/speed-$name.json"
}

if [ "${STEPS:-all}" = all ] || [ "${STEPS:-all}" = shapes ]; then
shape qwen3-8b 70 --preset qwen3-8b
shape gpt-oss-20b 45 --preset gpt-oss-20b --target-layers 6
shape gpt-oss-120b-packed 50 --preset gpt-oss-120b --target-layers 6 --mxfp4 packed
shape qwen3-coder-30b-a3b 45 --preset qwen3-coder-30b-a3b --target-layers 6
shape qwen3.5-35b-a3b 45 --preset qwen3.5-35b-a3b --target-layers 8
fi
