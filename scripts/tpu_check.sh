#!/usr/bin/env bash
# The TPU counterpart of scripts/gpu_check.sh, the first run on a lent TPU host (v5e/v5p/v6e) in one command of
# at most 8 minutes: the same steps on JAX's TPU platform (the fused-attention tests then compile the Pallas
# kernel for the chip instead of interpreting it, and `auto` attention is that kernel).
#   bash scripts/tpu_check.sh [OUT_DIR]        (default runs/tpu)
# A v5e chip (16 GB) cannot hold Qwen3-8B's weights (16 GB): there that step's out-of-memory error is the figure.
export JAX_PLATFORMS=${JAX_PLATFORMS:-tpu}
exec bash "$(dirname "$0")/gpu_check.sh" "${1:-runs/tpu}"
