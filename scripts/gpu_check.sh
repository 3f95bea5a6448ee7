#!/usr/bin/env bash
# The accelerator checks docs/speed.md still lacks, in one run of at most ~8 minutes on a lent GPU (no install
# there: PYTHONPATH=.; no grain and no ../shared, so data-dependent tests skip):
#   bash scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else runs/gpu)
# 1. the engine's tests on the GPU (float32 with explicit highest-precision matmuls: same greedy tokens as CPU),
#    and the fused-attention tests, which on a GPU also run cuDNN's kernel (bf16) against the dense softmax and
#    the loop;
# 2. the speed tool at the Qwen3-8B shapes in bfloat16 (components, speedup bound, fixed vs adaptive widths;
#    attention "auto" = cuDNN);
# 3. a round at 256 live tokens in a 16k-slot cache (the live-length claim on the device), with cuDNN and with
#    the loop (does cuDNN skip the slots past each row's length? does the loop pay per trip?);
# 4. XLA's memory analysis of long-prompt prefills at the 8B shapes (chunked prefill);
# 5. the speed tool at the whole mixture-of-experts targets in bfloat16 (random weights, every layer: 48 for
#    Qwen3-Coder-30B-A3B, 61 GB; 24 for gpt-oss-20b, 42 GB): verify(B) / AR step and the speedup bound, with the
#    experts computed the engine's way (auto) and, for Qwen3-Coder's 128 experts, routed only (grouped).
#    These add up to ~6 minutes more; run them alone with STEPS=moe.
# 6. the speed tool at the whole hybrid Qwen3.5-4B (32 layers, 24 of them Gated DeltaNet) and Qwen3.5-35B-A3B
#    (40 layers, ~70 GB) in bfloat16: verify through the linear layers, the rollback of their states (should be
#    under 5% of a round), the draft and the bound; ~3 minutes; alone with STEPS=hybrid.
# 7. what the KL loss adds to the train step's memory on the device (XLA:CPU's plan shows +22 GiB per device at
#    paper scale, most likely its float32 copies of the head): the Qwen3-8B pairing's step compiled for this one
#    GPU, 1 sequence of 3072 tokens, ce and kl; compile only (nothing allocated); ~2 minutes; alone STEPS=kl.
# Each step writes OUT_DIR/<step>.txt and prints its tail; a step that fails or runs out of time does not stop
# the next.
set -uo pipefail
OUT_DIR=${1:-${OUT:-runs/gpu}}
mkdir -p "$OUT_DIR"
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}

step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT_DIR/$name.txt" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s"
  tail -n 30 "$OUT_DIR/$name.txt"
}

{ nvidia-smi; python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"; } \
  > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"
if [ "${STEPS:-all}" = all ]; then
step tests 180 python -m pytest -q -p no:cacheprovider -o addopts= tests/test_fused_attention.py tests/test_engine_greedy.py \
  tests/test_adaptive.py tests/test_replay.py tests/test_engine_sampling.py
step speed-8b 120 python -m infer speed --preset qwen3-8b --dtype bfloat16 --context 1024 --new-tokens 256 --tau 6 \
  --repeats 5 --adaptive 1,4,8 --json "$OUT_DIR/speed-8b.json"
for kernel in cudnn loop; do
  step "live-16k-$kernel" 75 python -m infer speed --preset qwen3-8b --dtype bfloat16 --context 256 \
    --cache-slots 16384 --new-tokens 32 --tau 6 --repeats 3 --attention "$kernel"
done
step prefill-memory 50 python scripts/prefill_memory.py --lengths 4096,16384,32768
fi
if [ "${STEPS:-all}" = all ] || [ "${STEPS:-all}" = moe ]; then
for path in auto grouped; do
  step "speed-qwen3-coder-30b-a3b-$path" 150 python -m infer speed --preset qwen3-coder-30b-a3b --target-layers 48 \
    --dtype bfloat16 --context 1024 --new-tokens 129 --tau 6 --repeats 5 --expert-path "$path" \
    --json "$OUT_DIR/speed-qwen3-coder-30b-a3b-$path.json"
done
step speed-gpt-oss-20b 120 python -m infer speed --preset gpt-oss-20b --target-layers 24 --dtype bfloat16 \
  --context 1024 --new-tokens 129 --tau 4 --repeats 5 --json "$OUT_DIR/speed-gpt-oss-20b.json"
fi
if [ "${STEPS:-all}" = all ] || [ "${STEPS:-all}" = hybrid ]; then
step speed-qwen3.5-4b 90 python -m infer speed --preset qwen3.5-4b --target-layers 32 --dtype bfloat16 \
  --context 1024 --new-tokens 129 --tau 6 --repeats 5 --json "$OUT_DIR/speed-qwen3.5-4b.json"
step speed-qwen3.5-35b-a3b 150 python -m infer speed --preset qwen3.5-35b-a3b --target-layers 40 --dtype bfloat16 \
  --context 1024 --new-tokens 129 --tau 6 --repeats 5 --json "$OUT_DIR/speed-qwen3.5-35b-a3b.json"
fi
if [ "${STEPS:-all}" = all ] || [ "${STEPS:-all}" = kl ]; then
for loss in ce kl; do
  step "plan-8b-$loss" 90 python -m train plan --pairing qwen3-8b-dflash-b16 --mesh data=1 --global-batch 1 \
    --seq-len 3072 --num-anchors 512 --anchor-chunk 64 --dtype bfloat16 --loss "$loss"
done
fi
