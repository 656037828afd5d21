"""Make a drafter export loadable as Hugging Face remote code.

`write_remote_code(folder)` adds `modeling_dblast.py` (a verbatim copy of
dblast_jax/io/torch_drafter.py: torch and transformers imports only, plus safetensors,
a dependency of transformers) and an `auto_map` entry in config.json to an existing
`dblast export` folder, so that

    model = AutoModel.from_pretrained(folder, trust_remote_code=True)
    out = model.spec_generate(target_model, input_ids, max_new_tokens=64, temperature=1.0,
                              verify_mode="mixture")

gives a drafter (`DBlastDraftModel`, a PreTrainedModel) that can generate with any
transformers causal LM target. `dblast export --remote-code` calls it after exporting.
Export itself writes only config.json and model.safetensors; dblast_jax.io.dflash lists
MODELING_FILE in EXPORT_MODELING_FILES so a folder holding it is still a previous
export (a plain re-export removes it again, with the auto_map entry).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dblast_jax.io.atomic import atomic_write_json, atomic_write_text

MODELING_FILE = "modeling_dblast.py"
AUTO_MAP = {"AutoConfig": "modeling_dblast.DBlastDraftConfig",
            "AutoModel": "modeling_dblast.DBlastDraftModel"}


def modeling_source() -> str:
    """The text written as modeling_dblast.py: io/torch_drafter.py, read, not imported
    (importing it would import torch)."""
    return (Path(__file__).parent / "torch_drafter.py").read_text(encoding="utf-8")


def write_remote_code(folder: str | os.PathLike) -> str:
    """Add modeling_dblast.py and config.json's auto_map to an export folder; returns
    the folder. Each file is replaced atomically; running it twice changes nothing."""
    folder = os.fspath(folder)
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{folder!r} is not a drafter export: no config.json") from None
    if not isinstance(cfg, dict) or "dflash_config" not in cfg:
        raise ValueError(f"{folder!r} is not a DFlash/DBlast drafter export: config.json "
                         "has no dflash_config")
    atomic_write_text(os.path.join(folder, MODELING_FILE), modeling_source())
    cfg["auto_map"] = dict(AUTO_MAP)
    atomic_write_json(path, cfg, indent=2)
    return folder
