#!/usr/bin/env bash
# Adaptive vs fixed block size on the shipped demo pair and the block-16 stories260K draft (docs/results-cpu.md, "Adaptive widths";
# "Adaptive block size"): a mixed workload of held-out story openings (the drafts' own domain, high
# acceptance) and GSM8K questions (far outside it, low acceptance), same engine, greedy, 2-core CPU.
# The adaptive runs also replay width schedules on the answers (--replay): full block, the policy, and the
# best possible schedule, at the round costs measured in the run.
set -euo pipefail
OUT=${1:-runs/bench/adaptive}
T=dflash_jax/assets/stories260k/target
COMMON=(--target "$T" --prompt-file data/stories260k/heldout.jsonl --datasets gsm8k --max-samples 48
        --max-new-tokens 128 --no-chat-template)
python -m infer bench "${COMMON[@]}" --ckpt dflash_jax/assets/stories260k/draft-b8 --out "$OUT/b8-fixed"
python -m infer bench "${COMMON[@]}" --ckpt dflash_jax/assets/stories260k/draft-b8 --adaptive 1,2,4 --replay \
  --out "$OUT/b8-adaptive"
if [ -d runs/stories260k-b16/export/draft ]; then
  python -m infer bench "${COMMON[@]}" --ckpt runs/stories260k-b16/export/draft --out "$OUT/b16-fixed"
  python -m infer bench "${COMMON[@]}" --ckpt runs/stories260k-b16/export/draft --adaptive 1,4,8 --replay \
    --out "$OUT/b16-adaptive"
fi
