"""Training metrics to ``metrics.jsonl`` (one JSON object per logged step) and TensorBoard event files
(``tensorboard --logdir <output.dir>/tb``). Only process 0 writes."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLogger:
    def __init__(self, out_dir: str | Path, enabled: bool = True, resume_step: int = 0):
        """``resume_step``: a resumed run drops the lines of steps after it (written before the interruption
        by steps that are now redone), so each step appears once."""
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= resume_step]
                self.path.write_text("".join(line + "\n" for line in kept))
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tb"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for name, value in metrics.items():
            self._tb.add_scalar(name, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
