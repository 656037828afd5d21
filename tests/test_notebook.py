"""The Colab quickstart notebook runs top to bottom (at tiny size), so it cannot rot."""

import json
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "experiments" / "colab" / "quickstart.ipynb"


def test_quickstart_notebook_executes_at_tiny_size(tmp_path, tiny_demo, monkeypatch):
    """Every cell runs in a real kernel. Its demo cell resumes a copy of the session's
    finished tiny demo (test_demo.py runs and checks the demo itself from scratch), so
    this test costs the kernel, the generate calls and the plots, not a second demo."""
    shutil.copytree(tiny_demo.workdir, tmp_path / "work")
    monkeypatch.setenv("DBLAST_PRETRAINED_DIR", tiny_demo.pretrained)  # the kernel inherits it
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    assert "TINY = False" in params[0].source  # Colab users get the real model by default
    params[0].source += (f"\nTINY = True\nWORKDIR = {json.dumps(str(tmp_path / 'work'))}\n")
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # tau vs temperature, histograms, per-position acceptance
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "SMALL-BUDGET DEMO" in text and "tau" in text
    assert (tmp_path / "work" / "eval" / "results.json").exists()
