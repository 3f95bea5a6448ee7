#!/usr/bin/env bash
# Losses, position weights and DFlash2 at the stories260K scale (docs/ablations.md, "Better drafts"): every row trains
# a draft with configs/runs/stories260k-b16.yaml plus one change, two seeds each, the same step budget as the
# paper's ablations; each draft is benchmarked greedily on held-out openings at block 16 and at block 8.
# Resumable like scripts/ablations.sh (a finished row or bench is skipped; a cut run resumes). Needs the data
# of docs/training.md ("stories260K") under data/stories260k/.
#
#   scripts/loss_ablations.sh [OUT_DIR [STEPS]]      (defaults: runs/losses-1200, 1200)
set -euo pipefail
OUT=${1:-runs/losses-1200}
STEPS=${2:-1200}
CONFIG=configs/runs/stories260k-b16.yaml
TARGET=dflash_jax/assets/stories260k/target
HELDOUT=data/stories260k/heldout.jsonl
mkdir -p "$OUT"

source "$(dirname "$0")/ablation_lib.sh"

row() {  # NAME [--set ...]
  local name=$1; shift
  train "$name" "$@"
  bench "$name-at16" "$OUT/$name/export/draft" 16
  bench "$name-at8" "$OUT/$name/export/draft" 8
}

for seed in 0 1; do
  row "ce-s$seed" --set "train.seed=$seed"
  row "kl-s$seed" --set "train.seed=$seed" --set train.loss=kl
  row "ce+kl-s$seed" --set "train.seed=$seed" --set train.loss=ce+kl
  row "dpace-s$seed" --set "train.seed=$seed" --set train.position_weights=dpace
  row "dflash2-s$seed" --set "train.seed=$seed" --set draft.architecture=dflash2
  row "dflash2+dpace-s$seed" --set "train.seed=$seed" --set draft.architecture=dflash2 \
    --set train.position_weights=dpace
done
# A diagnostic of the base row: the target's last layer among the features, as the older table's base read it.
train ce-f5-s0 --set train.seed=0 --set "draft.target_layer_ids=[0, 1, 2, 3, 4]" --set draft.allow_last_layer=true
bench ce-f5-s0-at16 "$OUT/ce-f5-s0/export/draft" 16

# The step time of each row relative to the paper's recipe, measured side by side (the runs take turns).
[ -f "$OUT/step-times.txt" ] || python -m train speed --config "$CONFIG" --steps 20 \
  --compare kl:train.loss=kl --compare "ce+kl:train.loss=ce+kl" --compare dpace:train.position_weights=dpace \
  --compare dflash2:draft.architecture=dflash2 \
  --compare "dflash2+dpace:draft.architecture=dflash2;train.position_weights=dpace" > "$OUT/step-times.txt"
cat "$OUT/step-times.txt"

summary
