"""The demo pair shipped inside the package (package data, so a wheel install has it too).

``stories260k/target``: llama2.c's stories260K (Andrej Karpathy, MIT licence: ``stories260k/LICENSE.llama2c``),
converted to a Hugging Face LLaMA directory with ``dflash_jax.checkpoints.llama2c.convert_llama2c``.
``stories260k/draft-b8``: the DFlash2 draft trained for it by this project (``configs/runs/stories260k-b8.yaml``,
docs/training.md), in the official ``DFlash2DraftModel`` layout, reading target layers 0-3 (not the last, so
SGLang/vLLM can serve it). Block 8 because a block-8 round costs less than a block-16 one where verifying is not
free (a CPU); DFlash2 because it won the ablation (docs/ablations.md): tau 5.26 on the held-out openings against
4.11 for a DFlash draft of the same shape and budget.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEMO_TARGET = ASSETS / "stories260k" / "target"
DEMO_DRAFT = ASSETS / "stories260k" / "draft-b8"
