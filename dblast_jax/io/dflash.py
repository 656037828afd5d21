"""Read and write drafters in the DFlash checkpoint format (DESIGN.md section 2).

A DFlash folder is `config.json` (architectures ["DFlashDraftModel"], a Qwen3-style
config plus `block_size`, `num_target_layers` and `dflash_config` {mask_token_id,
target_layer_ids}) and safetensors files with unprefixed keys in torch layout (Linear
weights are (out, in); ours are (in, out)). There is no embedding and no LM head.

DBlast extras (expander, prior head, learned mask embedding) travel in the same file
under the `dblast.` key prefix, with a `dblast_config` entry in config.json; a K = 1
drafter with a token mask writes neither, so public DFlash loaders take it unchanged.
Conversions are transposes and dtype casts only, so a round trip at the checkpoint's
dtype is bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dblast_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dblast_jax.models import drafter as drafter_lib

Params = dict[str, Any]

DBLAST_PREFIX = "dblast."
FORMAT_VERSION = 1
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# our path (tuple) <-> torch key, and whether the 2-D kernel is transposed.
_LAYER_KEYS = (
    (("input_norm", "scale"), "input_layernorm.weight", False),
    (("post_attn_norm", "scale"), "post_attention_layernorm.weight", False),
    (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", True),
    (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", True),
    (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", True),
    (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", True),
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", True),
)


def key_table(config: DrafterConfig) -> list[tuple[tuple, str, str]]:
    """[(our param path, checkpoint key, layout)] for every parameter of `config`.

    layout: "same" (copied), "T" (2-D transpose), "T12" (transpose the last two axes of
    a per-category [K, a, b] stack, so each category's matrix is torch (out, in))."""
    rows: list[tuple[tuple, str, str]] = [
        (("fc", "kernel"), "fc.weight", "T"),
        (("hidden_norm", "scale"), "hidden_norm.weight", "same"),
        (("final_norm", "scale"), "norm.weight", "same"),
    ]
    for i in range(config.num_layers):
        for path, key, transpose in _LAYER_KEYS:
            rows.append((("layers", i) + path, f"layers.{i}.{key}", "T" if transpose else "same"))
    if config.mask_token_id is None:
        rows.append((("mask_embedding",), DBLAST_PREFIX + "mask_embedding", "same"))
    if config.expander_width > 0:
        rows.append((("expander", "in_kernel"), DBLAST_PREFIX + "expander.in_proj.weight", "T12"))
        rows.append((("expander", "out_kernel"), DBLAST_PREFIX + "expander.out_proj.weight", "T12"))
    if config.num_categories > 1:
        rows.append((("prior", "kernel"), DBLAST_PREFIX + "prior.weight", "T"))
        rows.append((("prior", "bias"), DBLAST_PREFIX + "prior.bias", "same"))
    return rows


def _to_torch_layout(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "T":
        return np.ascontiguousarray(x.T)
    if layout == "T12":
        return np.ascontiguousarray(np.swapaxes(x, -1, -2))
    return np.ascontiguousarray(x)


_from_torch_layout = _to_torch_layout  # transposes are involutions


def _torch_shape(shape: tuple, layout: str) -> tuple:
    if layout == "T":
        return tuple(reversed(shape))
    if layout == "T12":
        return tuple(shape[:-2]) + (shape[-1], shape[-2])
    return tuple(shape)


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


# ---- config ---------------------------------------------------------------------------

def _read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"drafter folder {folder!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} is not a DFlash checkpoint: no config.json")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" not in archs and "dflash_config" not in cfg:
        raise ValueError(f"{folder!r} is not a DFlash checkpoint: config.json has "
                         f"architectures {archs} and no dflash_config "
                         "(expected architectures [\"DFlashDraftModel\"])")
    return cfg


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0  # the Qwen3Config default


def drafter_config_from_dflash(cfg: dict, target_config: TargetConfig, *,
                               source: str = "config.json") -> DrafterConfig:
    """A DrafterConfig from a DFlash config.json dict (plus our `dblast_config`)."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{source}: DFlash config lacks required entries {missing}")
    dflash = cfg.get("dflash_config") or {}
    dblast = cfg.get("dblast_config") or {}
    scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        warnings.warn(f"{source}: rope scaling {scaling} is ignored; the drafter uses plain "
                      "RoPE with rope_theta")
    n_layers = int(cfg["num_hidden_layers"])
    n_target = int(cfg.get("num_target_layers", target_config.num_layers))
    ids = dflash.get("target_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else default_target_layer_ids(n_target, n_layers)
    block_size = cfg.get("block_size", dflash.get("block_size"))
    if block_size is None:
        raise ValueError(f"{source}: no block_size in the config (top level or dflash_config)")
    learned_mask = dblast.get("mask", "token") == "learned"
    mask_id = None if learned_mask else dflash.get("mask_token_id")
    if mask_id is None and not learned_mask:
        raise ValueError(f"{source}: dflash_config has no mask_token_id and no learned mask "
                         "embedding (dblast_config.mask == 'learned')")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    if hidden != target_config.hidden_size:
        raise ValueError(f"{source}: drafter hidden_size {hidden} does not match the target's "
                         f"hidden_size {target_config.hidden_size} ({target_config.name})")
    bad = [i for i in ids if not 0 <= i < target_config.num_layers]
    if bad or n_target != target_config.num_layers:
        raise ValueError(f"{source}: target_layer_ids {list(ids)} (num_target_layers "
                         f"{n_target}) do not fit the {target_config.num_layers}-layer "
                         f"target {target_config.name}")
    return DrafterConfig(
        hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n_layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        target_layer_ids=ids, num_target_layers=n_target, block_size=int(block_size),
        rope_theta=_rope_theta(cfg), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab_size=int(cfg.get("vocab_size", 0) or 0),
        mask_token_id=None if mask_id is None else int(mask_id),
        num_categories=int(dblast.get("num_categories", 1)),
        expander_width=int(dblast.get("expander_width", 0)),
        name=str(cfg.get("name_or_path", cfg.get("_name_or_path", "dflash")) or "dflash"))


def dflash_config_dict(config: DrafterConfig, dtype: str = "float32") -> dict:
    """config.json contents for `config` (DFlash layout; `dblast_config` when needed)."""
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "num_target_layers": config.num_target_layers,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        "dflash_config": {"mask_token_id": config.mask_token_id,
                          "target_layer_ids": list(config.target_layer_ids)},
    }
    if needs_dblast_extras(config):
        cfg["dblast_config"] = {
            "format_version": FORMAT_VERSION,
            "num_categories": config.num_categories,
            "expander_width": config.expander_width,
            "mask": "learned" if config.mask_token_id is None else "token",
            "prior_input": "anchor",
            "expander": "branch_z = u + out_proj_z(silu(in_proj_z(u))), u = norm(h)",
            "tensor_prefix": DBLAST_PREFIX,
        }
    return cfg


def needs_dblast_extras(config: DrafterConfig) -> bool:
    return (config.num_categories > 1 or config.expander_width > 0
            or config.mask_token_id is None)


# ---- safetensors ------------------------------------------------------------------------

def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return sorted({os.path.join(folder, v) for v in weight_map.values()})
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                   if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{folder!r} is not a DFlash checkpoint: no *.safetensors files")
    return files


def _read_tensors(folder: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(folder):
        tensors.update(load_file(path))
    return tensors


def load_dflash(folder: str, target_config: TargetConfig, dtype=jnp.float32, *,
                block_size: Optional[int] = None,
                num_categories: Optional[int] = None) -> tuple[DrafterConfig, Params]:
    """Load a DFlash checkpoint (or a DBlast export) as (DrafterConfig, drafter params).

    `block_size` / `num_categories`, when given, must match the checkpoint. Every
    expected key must be present with the expected shape; unexpected keys warn.
    """
    cfg = _read_config(folder)
    source = os.path.join(folder, "config.json")
    config = drafter_config_from_dflash(cfg, target_config, source=source)
    if block_size is not None and block_size != config.block_size:
        raise ValueError(f"{folder!r} is a block-size-{config.block_size} drafter, but block "
                         f"size {block_size} was requested")
    if num_categories is not None and num_categories != config.num_categories:
        raise ValueError(f"{folder!r} has K = {config.num_categories} categories, but "
                         f"K = {num_categories} was requested")
    drafter_lib.check_drafter_fits_target(config, target_config)
    tensors = _read_tensors(folder)
    abstract = drafter_lib.abstract_drafter_params(config, target_config, dtype)
    table = key_table(config)
    missing = [key for _, key, _ in table if key not in tensors]
    if missing:
        raise ValueError(f"{folder!r}: missing tensors {missing}")
    expected = {key for _, key, _ in table}
    extra = sorted(k for k in tensors if k not in expected)
    if extra:
        warnings.warn(f"{folder!r}: ignoring unexpected tensors {extra}")
    np_dtype = _DTYPES[jnp.dtype(dtype).name]
    params: Params = {}
    for path, key, layout in table:
        want = tuple(_get(abstract, path).shape)
        arr = _from_torch_layout(tensors[key], layout)
        if tuple(arr.shape) != want:
            raise ValueError(f"{folder!r}: tensor {key} has shape {tuple(tensors[key].shape)} "
                             f"(torch layout); this config expects {_torch_shape(want, layout)}")
        _set(params, path, jnp.asarray(arr.astype(np_dtype)))
    return config, params


def export_drafter(dparams: Params, drafter_config: DrafterConfig, folder: str,
                   dtype: str = "float32") -> str:
    """Write `dparams` as a DFlash folder (config.json + model.safetensors), atomically.

    K = 1 with a token mask and no expander: the exact DFlash layout. Otherwise the
    same plus `dblast.`-prefixed tensors and a `dblast_config` entry. dtype:
    "float32" or "bfloat16". Returns the folder path.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"export dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    from safetensors.numpy import save_file
    np_dtype = _DTYPES[dtype]
    tensors = {}
    for path, key, layout in key_table(drafter_config):
        try:
            leaf = _get(dparams, path)
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"drafter params lack {'/'.join(map(str, path))} "
                             f"(checkpoint key {key}) required by the config") from None
        arr = np.asarray(jax.device_get(leaf))
        tensors[key] = _to_torch_layout(arr.astype(np_dtype), layout)
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dflash_config_dict(drafter_config, dtype), f, indent=2)
            f.write("\n")
        if not os.path.exists(folder):
            os.rename(tmp, folder)
        else:
            written = set(os.listdir(tmp))
            for name in written:  # each replace is atomic
                os.replace(os.path.join(tmp, name), os.path.join(folder, name))
            os.rmdir(tmp)
            for stale in os.listdir(folder):  # an older export's shards would mix in
                if stale not in written and (stale.endswith(".safetensors")
                                             or stale == "model.safetensors.index.json"):
                    os.remove(os.path.join(folder, stale))
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
