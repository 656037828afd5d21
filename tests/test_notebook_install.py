"""The Colab notebook's install cell works where the package is not installed: a wheel
built from this checkout goes into a plain venv that already holds other jax / numpy
versions (as Colab's image does), then the notebook's first cells run there at tiny size
and find the drafters the wheel carries as package data (setup.py, pretrained.py)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "colab" / "quickstart.ipynb"
# preinstalled before the wheel, outside setup.py's ranges (the previous jax minor, an
# older numpy): pip must move them into the ranges, not break on them
PREINSTALLED = {"jax": "0.9.2", "jaxlib": "0.9.2", "numpy": "2.3.5"}

CHECK = '''
import importlib.metadata as md, json
from dblast_jax import pretrained
from dblast_jax.demo import DemoConfig, shipped_drafters
said = []
shipped = shipped_drafters(DemoConfig(), said.append)
print("CHECK " + json.dumps({
    "package": dj.__file__, "root": str(pretrained.pretrained_root()),
    "verified": {n: str(pretrained.pretrained_folder(n)) for n in pretrained.available()},
    "shipped": sorted(shipped), "said": said,
    "versions": {p: md.version(p) for p in ("jax", "jaxlib", "numpy")}}))
'''


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _build_wheel(tmp_path: Path) -> Path:
    """`pip wheel --no-deps` of a copy of what setup.py packages (building in the checkout
    would write build/ and *.egg-info into a tree others may be using)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy2(ROOT / "setup.py", src / "setup.py")
    for folder in ("dblast_jax", "pretrained"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist")]
    try:  # the build backend of this environment when it has one, else pip's isolated build
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
        cmd.append("--no-build-isolation")
    except ImportError:
        pass
    _run(cmd + [str(src)])
    (wheel_file,) = (tmp_path / "dist").glob("dblast_jax-*.whl")
    return wheel_file


def _ranges() -> dict[str, SpecifierSet]:
    text = (ROOT / "setup.py").read_text()
    return {name: SpecifierSet(spec) for name, spec in
            re.findall(r'"(jax|jaxlib|numpy)([<>=!~][^"]*)"', text)}


@pytest.mark.slow  # a wheel build + a fresh venv from PyPI: ~1 min, on demand
def test_notebook_install_cell_from_a_wheel_in_a_fresh_venv(tmp_path):
    started = time.perf_counter()
    wheel_file = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])  # plain: no system site-packages
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DBLAST_PRETRAINED_DIR", "VIRTUAL_ENV")}
    _run([python, "-m", "pip", "install", "-q"] +
         [f"{p}=={v}" for p, v in PREINSTALLED.items()], env=env)

    # the notebook's cells up to the pipeline: parameters (TINY, REPO = the wheel), the
    # install cell, plain sampling; then the shipped drafters are looked up and verified
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    first = code[:next(i for i, c in enumerate(code) if "run_demo" in c.source)]
    assert "parameters" in first[0].metadata.get("tags", [])
    assert any("pip\", \"install\"" in c.source and "REPO" in c.source for c in first)
    overrides = (f"\nTINY = True\nWORKDIR = {json.dumps(str(tmp_path / 'work'))}\n"
                 f"REPO = {json.dumps(str(wheel_file))}\n")
    script = tmp_path / "notebook_cells.py"
    script.write_text("\n\n".join([first[0].source + overrides] +
                                  [c.source for c in first[1:]] + [CHECK]))
    proc = _run([python, str(script)], cwd=tmp_path, env=env, timeout=1200)
    assert "tok/s" in proc.stdout  # the sampling cell ran

    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("CHECK ")]
    check = json.loads(line[len("CHECK "):])
    site = (venv / "lib").resolve()
    assert Path(check["package"]).resolve().is_relative_to(site)  # the wheel, not the checkout
    assert Path(check["root"]).resolve().is_relative_to(site)
    manifest = json.loads((ROOT / "pretrained" / "manifest.json").read_text())["drafters"]
    assert manifest and set(check["verified"]) == set(manifest)  # all present, sha256 checked
    assert check["shipped"] == sorted(n for n, e in manifest.items()
                                      if e["target"] == "smollm2-135m-instruct")
    assert check["said"] == []  # the demo finds them: no "no shipped drafter" line
    for name, spec in _ranges().items():  # the preinstalled versions were moved into range
        assert Version(check["versions"][name]) in spec, (name, check["versions"], spec)
    print(f"notebook install test: {time.perf_counter() - started:.0f} s")
