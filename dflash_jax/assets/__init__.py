"""The demo pair shipped inside the package (package data, so a wheel install has it too).

``stories260k/target``: llama2.c's stories260K (Andrej Karpathy, MIT licence: ``stories260k/LICENSE.llama2c``),
converted to a Hugging Face LLaMA directory with ``dflash_jax.checkpoints.llama2c.convert_llama2c``.
``stories260k/draft-b16``: the DFlash draft trained for it by this project (``configs/runs/stories260k-b16.yaml``,
docs/training.md), in the official draft layout.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEMO_TARGET = ASSETS / "stories260k" / "target"
DEMO_DRAFT = ASSETS / "stories260k" / "draft-b16"
