#!/usr/bin/env bash
# The run for a lent GPU (scripts/tpu_check.sh runs it on a TPU host), one command of at most 7.5 minutes by
# default: its steps' limits add up to 440 s (phase 1's run side by side). No install there: PYTHONPATH=.; no
# grain and no ../shared, so data-dependent tests skip.
#   bash scripts/gpu_check.sh [OUT_DIR]        (default runs/gpu)
#   SHAPES_WANTED="qwen3-8b qwen3.5-35b-a3b" bash scripts/gpu_check.sh     (the target shapes timed; default the
#                                             first two of ALL_SHAPES below)
#   DRY_RUN=1 JAX_PLATFORMS=cpu bash scripts/gpu_check.sh /tmp/dry   (the script itself, on the CPU, with small
#                                             shapes: check it here before a device run)
# Phase 1, side by side (nothing in it is timed; the processes share the device, so none preallocates):
#   - the accelerator tests: the fused-attention kernels (cuDNN against the dense softmax and the loop, bf16;
#     the TPU kernel in its interpreter) and the expert paths against each other;
#   - per target shape, `python -m infer plan --device local`: what the compiler says one device holds and runs;
#   - scripts/bf16_agreement.py on the shipped pair: how often DFlash == the baseline in bfloat16 on this
#     device, once as compiled by default and once with XLA:GPU's deterministic ops (the first H200 run gave
#     18 of 64 prompts identical against 61 of 64 on a CPU, and a repeated run of one program gave other tokens).
# Phase 2, one process at a time on a quiet machine (these are the timings):
#   - per target shape, random bfloat16 weights, `python -m infer speed` (tokens/s, verify(B) / AR step, the
#     speedup bound, peak device memory): Qwen3-8B (whole), gpt-oss-120b (packed MXFP4, its first 6 layers),
#     Qwen3-Coder-30B-A3B and Qwen3.5-35B-A3B (each cut to its first layers; the per-layer figures are what the
#     cut measures);
#   - with TREES=1 (150 s more), scripts/tree_sweep.py on the shipped pair (the chain against fixed tree budgets
#     and `--tree auto`, then auto with one option), when data/stories260k/heldout.jsonl is there
#     (docs/training.md makes it; carry it).
# Each step writes OUT_DIR/<step>.txt (speed also <step>.json) and prints its tail; a step that fails or runs
# out of time does not stop the next. STEPS=phase1|phase2 runs one half. At the end everything is packed into
# OUT_DIR/gpu_check.tgz (and copied to $OUT when that is set), since a device run returns few files.
set -uo pipefail
OUT_DIR=${1:-runs/gpu}
mkdir -p "$OUT_DIR"
# Compiled as a user's run is (the test suite's conftest would otherwise compile without XLA's optimisations).
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} DFLASH_JAX_COMPILE_CACHE=0 \
  JAX_DISABLE_MOST_OPTIMIZATIONS=0

step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT_DIR/$name.txt" 2>&1
  local rc=$?
  { echo "== $name (limit ${limit}s): $*"; echo "   exit $rc after $((SECONDS - t0)) s"
    tail -n 14 "$OUT_DIR/$name.txt"; } > "$OUT_DIR/$name.summary"
  cat "$OUT_DIR/$name.summary"
}

{ if [ "$JAX_PLATFORMS" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
  python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"; } \
  > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"
if [ -z "${DRY_RUN:-}" ] && ! python -c "import jax, sys; sys.exit(jax.devices()[0].platform == 'cpu')"; then
  echo "no accelerator is visible to JAX (JAX_PLATFORMS=$JAX_PLATFORMS): stopping"
  exit 1
fi

# name, time limit of the speed step, speed/plan arguments. SHAPES_WANTED picks by name (default the first two; the
# H200 of 2026-12-04 took ~100 s for Qwen3-8B's speed run, over a minute of it building and compiling).
ALL_SHAPES=(
  "qwen3-8b 130 --preset qwen3-8b"
  "gpt-oss-120b-packed 130 --preset gpt-oss-120b --target-layers 6 --experts packed"
  "qwen3-coder-30b-a3b 110 --preset qwen3-coder-30b-a3b --target-layers 6"
  "qwen3.5-35b-a3b 110 --preset qwen3.5-35b-a3b --target-layers 8"
)
if [ -n "${DRY_RUN:-}" ]; then
  ALL_SHAPES=("small 120 --preset small" "qwen3.5-4b-cut 120 --preset qwen3.5-4b --target-layers 4")
fi
SHAPES=()
for shape in "${ALL_SHAPES[@]}"; do
  for want in ${SHAPES_WANTED:-${ALL_SHAPES[0]%% *} ${ALL_SHAPES[1]%% *}}; do
    [ "${shape%% *}" = "$want" ] && SHAPES+=("$shape")
  done
done
PLAN_ARGS=(--dtype bfloat16 --context 1024 --max-new-tokens 128 --device local --json)
SPEED_ARGS=(--dtype bfloat16 --context 1024 --new-tokens 65 --tau 6 --repeats 3 --e2e-repeats 1)
HELDOUT=data/stories260k/heldout.jsonl

if [ "${STEPS:-all}" = all ] || [ "${STEPS:-all}" = phase1 ]; then
  echo "== phase 1: tests, plans and the bfloat16 agreement, side by side"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  # The Pallas TPU interpreter of the kernel tests runs its callbacks on a CPU device: list it beside the GPU.
  PLATFORMS_WITH_CPU=$JAX_PLATFORMS
  [[ ",$JAX_PLATFORMS," == *,cpu,* ]] || PLATFORMS_WITH_CPU="$JAX_PLATFORMS,cpu"
  JAX_PLATFORMS=$PLATFORMS_WITH_CPU step tests 180 python -m pytest -q -p no:cacheprovider -o addopts= \
    --durations=12 tests/test_fused_attention.py tests/test_expert_paths.py &
  for shape in "${SHAPES[@]}"; do
    read -r name _ args <<< "$shape"
    # shellcheck disable=SC2086
    step "plan-$name" 150 python -m infer plan $args "${PLAN_ARGS[@]}" &
  done
  step bf16-agreement 180 python scripts/bf16_agreement.py --prompts 64 --json "$OUT_DIR/bf16-agreement.json" &
  # The same with XLA:GPU asked for run-to-run determinism: how much of the disagreement is the device's.
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true" step bf16-agreement-deterministic 180 \
    python scripts/bf16_agreement.py --prompts 64 --json "$OUT_DIR/bf16-agreement-deterministic.json" &
  wait
  unset XLA_PYTHON_CLIENT_PREALLOCATE
fi

if [ "${STEPS:-all}" = all ] || [ "${STEPS:-all}" = phase2 ]; then
  echo "== phase 2: timings, one at a time"
  for shape in "${SHAPES[@]}"; do
    read -r name limit args <<< "$shape"
    # shellcheck disable=SC2086
    step "speed-$name" "$limit" python -m infer speed $args "${SPEED_ARGS[@]}" --json "$OUT_DIR/speed-$name.json"
  done
  if [ -n "${TREES:-}" ] && [ -f "$HELDOUT" ]; then
    step tree-sweep 100 python scripts/tree_sweep.py --prompt-file "$HELDOUT" --max-samples 16 \
      --max-new-tokens 128 --budgets 16,32,64 --repeats 3 --json "$OUT_DIR/tree-sweep.json"
    # --tree auto's own cost: with one small option (cache span 9) against the four above (span 65); the
    # first run's auto lost 14% to the chain, a quiet CPU's 19% while choosing the chain 95% of the time.
    step tree-auto-one-option 50 python scripts/tree_sweep.py --prompt-file "$HELDOUT" --max-samples 16 \
      --max-new-tokens 128 --budgets "" --auto-budgets 8 --repeats 3 --json "$OUT_DIR/tree-auto-one-option.json"
  fi
fi

tar czf /tmp/gpu_check.$$.tgz -C "$OUT_DIR" --exclude gpu_check.tgz . && mv /tmp/gpu_check.$$.tgz "$OUT_DIR/gpu_check.tgz"
[ -n "${OUT:-}" ] && cp "$OUT_DIR/gpu_check.tgz" "$OUT/"
echo "packed into $OUT_DIR/gpu_check.tgz"
