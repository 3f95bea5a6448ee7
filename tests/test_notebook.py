"""notebooks/dflash_quickstart.ipynb runs top to bottom on CPU with its default parameters (the shipped demo
pair), in a fresh kernel, from an empty folder: load, stream, benchmark (DFlash identical to the baseline is
asserted inside), a few training steps, export and reload."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(REPO / "notebooks" / "dflash_quickstart.ipynb", as_version=4)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "identical True" in outputs and "mean tau" in outputs
    assert "identical to the baseline: True" in outputs
    assert (tmp_path / "runs" / "notebook" / "run" / "export" / "draft" / "model.safetensors").is_file()
