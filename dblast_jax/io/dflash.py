"""Read and write drafters in the DFlash checkpoint format (docs/METHOD.md section 2).

A DFlash folder is `config.json` (architectures ["DFlashDraftModel"], a Qwen3-style
config plus `block_size`, `num_target_layers` and `dflash_config` {mask_token_id,
target_layer_ids}) and safetensors files with unprefixed keys in torch layout (Linear
weights are (out, in); ours are (in, out)). There is no embedding and no LM head.

DBlast extras (expander, prior head, learned mask embedding, correction head) travel in the
same file under the `dblast.` key prefix, with a `dblast_config` entry in config.json; a K = 1
drafter with a token mask writes neither, so public DFlash loaders take it unchanged.
Conversions are transposes and dtype casts only, so a round trip at the checkpoint's
dtype is bit-exact.

The folder may be an object-store URI (`gs://bucket/export`, dblast_jax.io.paths): it is
then read through epath and written object by object (see `export_drafter`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax import draft_vocab
from dblast_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dblast_jax.dtypes import dtype_from_name
from dblast_jax.io import paths
from dblast_jax.io.atomic import default_file_mode, fsync_dir, fsync_file
from dblast_jax.io.atomic import make_temp_dir as _make_temp_dir  # tests patch this name
from dblast_jax.io.layer_keys import DECODER_LAYER_KEYS, get_leaf, set_leaf
from dblast_jax.io.safetensors_io import SafetensorsReader, checkpoint_files
from dblast_jax.models import drafter as drafter_lib

Params = dict[str, Any]

DBLAST_PREFIX = "dblast."
FORMAT_VERSION = 1
_LOAD_DTYPES = ("float32", "bfloat16", "float16")  # export: dtypes.PARAM_DTYPES

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
        for k in DECODER_LAYER_KEYS:
            rows.append((("layers", i) + k.path, f"layers.{i}.{k.torch}",
                         "T" if k.transposed else "same"))
    if config.mask_token_id is None:
        rows.append((("mask_embedding",), DBLAST_PREFIX + "mask_embedding", "same"))
    if config.expander_width > 0:
        rows.append((("expander", "in_kernel"), DBLAST_PREFIX + "expander.in_proj.weight", "T12"))
        rows.append((("expander", "out_kernel"), DBLAST_PREFIX + "expander.out_proj.weight", "T12"))
    if config.num_categories > 1:
        rows.append((("prior", "kernel"), DBLAST_PREFIX + "prior.weight", "T"))
        rows.append((("prior", "bias"), DBLAST_PREFIX + "prior.bias", "same"))
    if config.correction != "none":
        for name in ("prev", "ctx", "out"):
            rows.append((("correction", f"{name}_kernel"),
                         f"{DBLAST_PREFIX}correction.{name}_proj.weight", "T"))
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


# ---- config ---------------------------------------------------------------------------

def _read_config(folder: str) -> dict:
    folder = os.fspath(folder)
    path = paths.join(folder, "config.json")
    if paths.isfile(folder):
        raise ValueError(f"drafter path {folder!r} is a file; pass the folder that holds "
                         "config.json and the .safetensors")
    if not paths.isdir(folder):
        raise FileNotFoundError(f"drafter folder {folder!r} does not exist")
    if not paths.isfile(path):
        raise ValueError(f"{folder!r} is not a DFlash checkpoint: no config.json")
    if paths.is_local(path):
        with open(path) as f:
            cfg = json.load(f)
    else:
        cfg = json.loads(paths.read_text(path))
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
    correction, correction_rank = _correction_of(dblast, source)
    block_attention = _block_attention_of(dflash, dblast, source)
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
        correction=correction, correction_rank=correction_rank,
        block_attention=block_attention,
        name=str(cfg.get("name_or_path", cfg.get("_name_or_path", "dflash")) or "dflash"))


def _correction_of(dblast: dict, source: str) -> tuple[str, int]:
    """(correction, correction_rank) recorded in `dblast_config` (absent: none, 0); a
    correction this version does not know is refused (it could not draft losslessly)."""
    from dblast_jax.config import CORRECTIONS
    correction = dblast.get("correction", "none")
    rank = dblast.get("correction_rank", 0)
    if correction not in CORRECTIONS:
        raise ValueError(f"{source}: dblast_config.correction {correction!r} is not one this "
                         f"version of dblast_jax can draft with ({', '.join(CORRECTIONS)})")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < (correction != "none"):
        raise ValueError(f"{source}: dblast_config.correction_rank must be an integer >= 1 "
                         f"with correction {correction!r}, got {rank!r}")
    return correction, rank


def _block_attention_of(dflash: dict, dblast: dict, source: str) -> str:
    """"causal" when `dflash_config.causal` is true (vLLM's key) or dblast_config says so,
    else "bidirectional"; a value this version does not know is refused."""
    from dblast_jax.config import BLOCK_ATTENTIONS
    causal = dflash.get("causal", None)
    if causal is not None and not isinstance(causal, bool):
        raise ValueError(f"{source}: dflash_config.causal must be true or false, got "
                         f"{causal!r}")
    attention = dblast.get("block_attention", "causal" if causal else "bidirectional")
    if attention not in BLOCK_ATTENTIONS:
        raise ValueError(f"{source}: dblast_config.block_attention {attention!r} is not one "
                         f"this version of dblast_jax can draft with "
                         f"({', '.join(BLOCK_ATTENTIONS)})")
    if causal is not None and causal != (attention == "causal"):
        raise ValueError(f"{source}: dflash_config.causal {str(causal).lower()} contradicts "
                         f"dblast_config.block_attention {attention!r}")
    return attention


def _dblast_only_note(config: DrafterConfig) -> str:
    """Why a DBlast-only export cannot run in DFlash loaders, and what loads it."""
    if config.block_attention != "bidirectional":
        return ("DBlast-only checkpoint with a causal block (dflash_config.causal): "
                "drafts are taken left to right, one drafter pass per block position "
                "with the drafted tokens' embeddings in the block; DFlash loaders "
                "(vLLM reads dflash_config.causal) draft the block in one pass over "
                "MASK positions, which is not what it was trained for. Load it with "
                "dblast_jax (load_drafter) or "
                "dblast_jax.io.torch_drafter.DBlastDrafterTorch")
    if config.correction != "none":
        return ("DBlast-only checkpoint with a serial correction head (drafts are "
                "taken left to right, each position's logits corrected by the token "
                "drafted before it): load it with dblast_jax (load_drafter) or "
                "dblast_jax.io.torch_drafter.DBlastDrafterTorch, not with DFlash "
                "loaders (dflash.DFlashDraftModel, vLLM, SGLang)")
    return ("DBlast-only checkpoint (K > 1 latent mixture and/or learned mask "
            "embedding): load it with dblast_jax (load_drafter) or "
            "dblast_jax.io.torch_drafter.DBlastDrafterTorch, not with DFlash "
            "loaders (dflash.DFlashDraftModel, vLLM, SGLang)")


def dflash_config_dict(config: DrafterConfig, dtype: str = "float32") -> dict:
    """config.json contents for `config` (DFlash layout; `dblast_config` when needed).

    A K = 1 token-mask drafter gets the fields of the published DFlash checkpoints, which
    z-lab's `dflash` package (`DFlashDraftModel.from_pretrained`, a Qwen3Config) reads:
    `dflash_config` {mask_token_id, target_layer_ids}, top-level `block_size` and
    `num_target_layers`, the dtype under both `dtype` (transformers >= 4.56) and
    `torch_dtype` (older readers), full (non-causal, non-sliding) attention in every
    layer and plain RoPE. tests/test_dflash_interop.py loads it with the `dflash` package.
    Anything else is marked DBlast-only in `dblast_config` (see `needs_dblast_extras`);
    `architectures` stays ["DFlashDraftModel"] there too, which older exports and their
    tests rely on."""
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
        "rope_scaling": None,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * config.num_layers,
        "dtype": dtype,
        "torch_dtype": dtype,
        "dflash_config": {"mask_token_id": config.mask_token_id,
                          "target_layer_ids": list(config.target_layer_ids)},
    }
    if needs_dblast_extras(config):
        cfg["dblast_config"] = {
            # the `dflash` package and vLLM cannot run this checkpoint: they would ignore
            # the dblast.* tensors (K > 1 mixture) or have no mask token to fill the block
            "dblast_only": True,
            "note": _dblast_only_note(config),
            "format_version": FORMAT_VERSION,
            "num_categories": config.num_categories,
            "expander_width": config.expander_width,
            "mask": "learned" if config.mask_token_id is None else "token",
            "prior_input": "anchor",
            "expander": "branch_z = u + out_proj_z(silu(in_proj_z(u))), u = norm(h)",
            "tensor_prefix": DBLAST_PREFIX,
        }
        if config.correction != "none":
            cfg["dblast_config"].update({
                "correction": config.correction,
                "correction_rank": config.correction_rank,
                "correction_formula": (
                    "logits_i = lm_head(h_i + out_proj(silu(prev_proj(rmsnorm(embed(x_{i-1})))"
                    " + ctx_proj(h_i)))), x_0 = the anchor, h_i = branch state; drafts "
                    "left to right"),
            })
        if config.block_attention != "bidirectional":
            cfg["dblast_config"].update({
                "block_attention": config.block_attention,
                "block_drafting": ("left to right: pass i runs [anchor, d_1 .. d_{i-1}, "
                                   "MASK ..] with block position i attending to the "
                                   "context and block positions <= i, and reads position "
                                   "i; training teacher-forces the data tokens"),
            })
    if config.block_attention == "causal":  # where vLLM's DFlash loader reads it
        cfg["dflash_config"]["causal"] = True
    return cfg


def needs_dblast_extras(config: DrafterConfig) -> bool:
    return (config.num_categories > 1 or config.expander_width > 0
            or config.mask_token_id is None or config.correction != "none"
            or config.block_attention != "bidirectional")


# ---- safetensors ------------------------------------------------------------------------

def _safetensors_files(folder: str) -> list[str]:
    """The checkpoint's files: the index's shards, or the folder's single *.safetensors
    (several without an index are refused: see safetensors_io.checkpoint_files)."""
    files, _ = checkpoint_files(folder)
    if not files:
        raise ValueError(f"{folder!r} is not a DFlash checkpoint: no *.safetensors files")
    return [str(p) for p in files]


def _read_tensors(folder: str) -> dict[str, np.ndarray]:
    _safetensors_files(folder)  # the folder's rule and its messages
    with SafetensorsReader.from_folder(folder) as reader:  # a key in two shards is refused
        return {key: reader.read(key) for key in reader.keys()}


def load_dflash(folder: str, target_config: TargetConfig, dtype=jnp.float32, *,
                block_size: Optional[int] = None,
                num_categories: Optional[int] = None) -> tuple[DrafterConfig, Params]:
    """Load a DFlash checkpoint (or a DBlast export) as (DrafterConfig, drafter params).

    `block_size` / `num_categories`, when given, must match the checkpoint. Every
    expected key must be present with the expected shape; unexpected keys warn.
    """
    cfg = _read_config(folder)
    source = paths.join(os.fspath(folder), "config.json")
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
    expected = {key for _, key, _ in table} | set(DRAFT_VOCAB_TENSORS)
    extra = sorted(k for k in tensors if k not in expected)
    if extra:
        warnings.warn(f"{folder!r}: ignoring unexpected tensors {extra}")
    np_dtype = dtype_from_name(jnp.dtype(dtype).name, _LOAD_DTYPES)
    params: Params = {}
    for path, key, layout in table:
        want = tuple(get_leaf(abstract, path).shape)
        arr = _from_torch_layout(tensors[key], layout)
        if tuple(arr.shape) != want:
            raise ValueError(f"{folder!r}: tensor {key} has shape {tuple(tensors[key].shape)} "
                             f"(torch layout); this config expects {_torch_shape(want, layout)}")
        set_leaf(params, path, jnp.asarray(arr.astype(np_dtype)))
    return config, params


# A draft-time vocabulary in vLLM's fields (dblast_jax/draft_vocab.py): config.json's
# `draft_vocab_size` N, and in the safetensors `d2t` [N] int64 offsets (target id of draft
# row j = j + d2t[j]; we write the rows most frequent first), `t2d` [V] bool (which
# target ids are in it) and `lm_head.weight` [N, H] (the target head's rows, for loaders
# that give the drafter its own head; dblast_jax takes them from the target instead).
DRAFT_VOCAB_TENSORS = ("d2t", "t2d", "lm_head.weight")


def read_draft_vocab(folder: str, vocab_size: int) -> Optional[np.ndarray]:
    """The draft vocabulary an export carries, as target ids [N] int32 in its row order,
    or None (no `draft_vocab_size` in config.json)."""
    cfg = _read_config(folder)
    n = cfg.get("draft_vocab_size")
    if n is None or n == vocab_size:
        return None
    where = paths.join(os.fspath(folder), "config.json")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < vocab_size:
        raise ValueError(f"{where}: draft_vocab_size must be an integer in [1, {vocab_size}),"
                         f" got {n!r}")
    with SafetensorsReader.from_folder(folder) as reader:
        if "d2t" not in reader.keys():
            raise ValueError(f"{os.fspath(folder)!r}: config.json sets draft_vocab_size {n} "
                             "but the safetensors hold no d2t tensor (draft row -> target id)")
        d2t = np.asarray(reader.read("d2t"))
    if d2t.shape != (n,) or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"{os.fspath(folder)!r}: d2t must be [{n}] integers, got "
                         f"{d2t.shape} {d2t.dtype}")
    ids = np.arange(n, dtype=np.int64) + d2t
    if ids.min() < 0 or ids.max() >= vocab_size or np.unique(ids).shape[0] != n:
        raise ValueError(f"{os.fspath(folder)!r}: d2t maps draft rows outside [0, "
                         f"{vocab_size}) or onto the same target id twice")
    return ids.astype(np.int32)


def draft_vocab_tensors(ids: np.ndarray, head_rows: np.ndarray, vocab_size: int,
                        np_dtype) -> dict[str, np.ndarray]:
    """vLLM's draft-vocabulary tensors for target ids [N] and the head's rows [N, H]."""
    ids = np.asarray(ids, np.int64)
    t2d = np.zeros((vocab_size,), bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(ids.shape[0], dtype=np.int64), "t2d": t2d,
            "lm_head.weight": np.asarray(head_rows).astype(np_dtype)}


# ---- the export folder ------------------------------------------------------------------

class ExportError(ValueError):
    """An export refused or failed; str() is one line naming the folder. `errno` is set
    when an OS error (no space, no permission) caused it."""

    def __init__(self, message: str, errno: Optional[int] = None):
        super().__init__(message)
        self.errno = errno


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
COUNTS_FILE = draft_vocab.COUNTS_FILE  # the ranking a draft vocabulary is taken from
# Modeling code export_drafter writes beside the weights, if it ever does: list it here so
# a folder holding it is still recognised as a previous export.
EXPORT_MODELING_FILES: tuple[str, ...] = ("modeling_dblast.py",)  # io/hf_remote.py
# names an export writes or has written (an older sharded export's shards and index)
_EXPORT_WEIGHT_NAMES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors"
                                  r"|model\.safetensors\.index\.json")


def is_export_file(name: str) -> bool:
    """Whether `name` is a file that export_drafter writes (or an earlier export wrote)."""
    return (name in (CONFIG_FILE, COUNTS_FILE) or name in EXPORT_MODELING_FILES
            or _EXPORT_WEIGHT_NAMES.fullmatch(name) is not None)


def _is_drafter_config(path: str) -> bool:
    try:
        cfg = json.loads(paths.read_text(path))
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    return "DFlashDraftModel" in (cfg.get("architectures") or []) or "dflash_config" in cfg


def _brief(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f", +{len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _classify_destination(folder: str) -> tuple[str, list[str]]:
    """("absent" | "empty" | "export" | "foreign", the folder's entries). "export": its
    config.json is a drafter's and every entry is a file an export writes."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise ExportError(f"cannot export to {folder!r}: it is a file, not a folder")
    if not os.path.exists(folder):
        return "absent", []
    try:
        entries = sorted(os.listdir(folder))
    except OSError as e:
        raise ExportError(f"cannot export to {folder!r}: cannot list it "
                          f"({e.strerror or e})", e.errno) from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ExportError(f"cannot export to {folder!r}: the folder is not writable",
                          errno.EACCES)
    if not entries:
        return "empty", entries
    ours = all(is_export_file(n) and os.path.isfile(os.path.join(folder, n))
               and not os.path.islink(os.path.join(folder, n)) for n in entries)
    if ours and _is_drafter_config(os.path.join(folder, CONFIG_FILE)):
        return "export", entries
    return "foreign", entries


def _write_weights(tensors: dict[str, np.ndarray], path: str) -> None:
    from safetensors.numpy import save_file
    save_file(tensors, path, metadata={"format": "pt"})


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _move_into(tmp: str, folder: str, written: list[str], stale: list[str]) -> None:
    """os.replace each of `written` from `tmp` into `folder` and remove `stale`; on a
    failure part way, the files replaced or removed so far are put back."""
    parent, name = os.path.split(folder)
    backup = _make_temp_dir(parent, name, "export-old")
    saved: list[str] = []
    placed: list[str] = []
    try:
        for n in list(written) + list(stale):
            src = os.path.join(folder, n)
            if os.path.lexists(src):
                try:
                    os.link(src, os.path.join(backup, n), follow_symlinks=False)
                except OSError:
                    shutil.copy2(src, os.path.join(backup, n), follow_symlinks=False)
                saved.append(n)
        for n in written:  # each replace is atomic
            os.replace(os.path.join(tmp, n), os.path.join(folder, n))
            placed.append(n)
        for n in stale:
            if os.path.lexists(os.path.join(folder, n)):
                os.remove(os.path.join(folder, n))
    except BaseException:
        for n in placed:
            if n not in saved:
                try:
                    os.remove(os.path.join(folder, n))
                except OSError:
                    pass
        for n in saved:
            try:
                os.replace(os.path.join(backup, n), os.path.join(folder, n))
            except OSError:
                pass
        raise
    finally:
        shutil.rmtree(backup, ignore_errors=True)


def _classify_remote(folder: str) -> tuple[str, list[str]]:
    """_classify_destination for an object-store folder (a prefix: "absent" when no
    object lies under it)."""
    try:
        if paths.isfile(folder):
            raise ExportError(f"cannot export to {folder!r}: it is a file, not a folder")
        entries = sorted(paths.listdir(folder)) if paths.isdir(folder) else None
    except OSError as e:
        raise ExportError(f"cannot export to {folder!r}: cannot list it "
                          f"({e.strerror or e})", e.errno) from e
    if entries is None:
        return "absent", []
    if not entries:
        return "empty", entries
    ours = all(is_export_file(n) and paths.isfile(paths.join(folder, n)) for n in entries)
    if ours and _is_drafter_config(paths.join(folder, CONFIG_FILE)):
        return "export", entries
    return "foreign", entries


def _refuse_foreign(folder: str, entries: list[str], planned: list[str]) -> ExportError:
    foreign = [n for n in entries if not is_export_file(n)]
    why = (f"files an export does not write ({_brief(foreign)})" if foreign else
           f"a {CONFIG_FILE} that is not a drafter's")
    touched = [n for n in planned if n in entries]
    return ExportError(
        f"refusing to export to {folder!r}: it is not empty and not a previous drafter "
        f"export (it holds {why}); export would write {CONFIG_FILE}, {WEIGHTS_FILE}"
        + (f", replacing the existing {', '.join(touched)}" if touched else "")
        + "; pass --force (force=True) to replace only those and keep every other file")


def _warn_left_weights(folder: str, entries: list[str], written: list[str]) -> None:
    left = [n for n in entries if n not in written and (n.endswith(".safetensors")
                                                        or n.endswith(".index.json"))]
    if left:
        warnings.warn(f"forced export to {folder!r} kept the folder's other weight files "
                      f"({_brief(left)}); loading it as a drafter refuses them until they "
                      "are removed")


def _export_to_object_store(tensors: dict[str, np.ndarray], config_text: str,
                            extra_files: dict[str, bytes], folder: str, force: bool) -> str:
    """export_drafter to gs://... : the same refusals, then each file one object write
    (atomic per object; a rename there is a copy + delete, not atomic), the weights first
    and config.json last, so a folder whose config.json is new has its new weights. An
    overwrite of a previous export cut short between the two may pair the new weights
    with the old config.json (the loader checks every shape); rerun the export then."""
    from safetensors.numpy import save
    planned = [CONFIG_FILE, WEIGHTS_FILE, *extra_files, *EXPORT_MODELING_FILES]
    state, entries = _classify_remote(folder)
    if state == "foreign" and not force:
        raise _refuse_foreign(folder, entries, planned)
    weights = save(tensors, metadata={"format": "pt"})
    written = [CONFIG_FILE, WEIGHTS_FILE, *extra_files]
    try:
        paths.atomic_write_bytes(paths.join(folder, WEIGHTS_FILE), weights)
        for name, data in extra_files.items():
            paths.atomic_write_bytes(paths.join(folder, name), data)
        paths.atomic_write_text(paths.join(folder, CONFIG_FILE), config_text)
        if state == "export":
            for n in entries:
                if is_export_file(n) and n not in written:
                    paths.as_path(paths.join(folder, n)).unlink(missing_ok=True)
    except OSError as e:
        raise ExportError(f"cannot export to {folder!r}: {e.strerror or e}", e.errno) from e
    if state == "foreign":
        _warn_left_weights(folder, entries, written)
    return folder


def export_drafter(dparams: Params, drafter_config: DrafterConfig, folder: str,
                   dtype: str = "float32", *, force: bool = False,
                   token_counts: Optional[np.ndarray] = None) -> str:
    """Write `dparams` as a DFlash folder (config.json + model.safetensors), atomically.

    K = 1 with a token mask and no expander: the exact DFlash layout. Otherwise the
    same plus `dblast.`-prefixed tensors and a `dblast_config` entry. dtype:
    "float32" or "bfloat16". Returns the folder path.

    The folder must be absent, empty, or hold a previous export (a drafter config.json
    and only files an export writes; an older export's leftover shards or index are
    removed). Any other folder is refused (ExportError, one line), unless `force`, which
    replaces only the files this export writes (config.json, model.safetensors) and
    leaves every other file as it is. Everything is written into a temporary sibling
    folder first, then renamed into place (an absent or empty folder) or moved in file by
    file, so a failure (no space, no permission) leaves the destination unchanged.
    Non-finite parameters are refused before anything is written. A `gs://` folder gets
    the same refusals, then one object write per file (`_export_to_object_store`).

    A drafter with a draft-time vocabulary attached (dblast_jax/draft_vocab.py) is written
    with vLLM's fields for it (`draft_vocab_size`, `d2t`, `t2d`, `lm_head.weight`);
    `token_counts` [V] (response-token counts of the training corpus) is written beside
    the weights as token_counts.npy, the ranking later draft vocabularies are taken from.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"export dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    np_dtype = dtype_from_name(dtype)
    dparams, dv = draft_vocab.split(dparams)
    tensors = {}
    for path, key, layout in key_table(drafter_config):
        try:
            leaf = get_leaf(dparams, path)
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"drafter params lack {'/'.join(map(str, path))} "
                             f"(checkpoint key {key}) required by the config") from None
        arr = np.asarray(jax.device_get(leaf))
        cast = arr.astype(np_dtype)
        finite = np.isfinite(cast)
        if not finite.all():  # after the cast: a float32 beyond bfloat16's range is inf too
            bad = int(finite.size - np.count_nonzero(finite))
            raise ExportError(f"refusing to export to {os.fspath(folder)!r}: tensor {key} "
                              f"(params {'/'.join(map(str, path))}) has {bad} non-finite "
                              f"value(s) (NaN/inf) in {dtype}; nothing was written")
        tensors[key] = _to_torch_layout(cast, layout)
    config_dict = dflash_config_dict(drafter_config, dtype)
    if dv is not None:
        ids = np.asarray(jax.device_get(dv["ids"]))
        tensors.update(draft_vocab_tensors(ids, np.asarray(jax.device_get(dv["head"])),
                                           drafter_config.vocab_size, np_dtype))
        config_dict["draft_vocab_size"] = int(ids.shape[0])
    config_text = json.dumps(config_dict, indent=2) + "\n"
    extra_files = {} if token_counts is None else {COUNTS_FILE: draft_vocab.counts_bytes(
        token_counts, drafter_config.vocab_size)}
    if not paths.is_local(folder):
        return _export_to_object_store(tensors, config_text, extra_files,
                                       paths.normalize(folder), force)
    folder = os.path.abspath(os.fspath(folder))
    parent, name = os.path.split(folder)
    planned = [CONFIG_FILE, WEIGHTS_FILE, *extra_files, *EXPORT_MODELING_FILES]
    state, entries = _classify_destination(folder)
    if state == "foreign" and not force:
        raise _refuse_foreign(folder, entries, planned)
    tmp = None
    try:
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = _make_temp_dir(parent, name, "export-tmp")
            _write_weights(tensors, os.path.join(tmp, WEIGHTS_FILE))
            for extra, data in extra_files.items():
                with open(os.path.join(tmp, extra), "wb") as f:
                    f.write(data)
            _write_text(os.path.join(tmp, CONFIG_FILE), config_text)
            written = sorted(os.listdir(tmp))
            mode = default_file_mode()  # safetensors creates its files 0600
            for n in written:
                os.chmod(os.path.join(tmp, n), mode)
                fsync_file(os.path.join(tmp, n))
            fsync_dir(tmp)
            if state in ("absent", "empty") and not os.path.islink(folder):
                os.rename(tmp, folder)  # onto an empty folder too: rename(2) replaces it
                tmp = None
            else:
                stale = ([n for n in entries if is_export_file(n) and n not in written]
                         if state == "export" else [])
                _move_into(tmp, folder, written, stale)
            fsync_dir(parent)
        except OSError as e:
            what = e.strerror or str(e)
            raise ExportError(f"cannot export to {folder!r}: {what}"
                              + (f" ({e.filename})" if e.filename else ""), e.errno) from e
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if state == "foreign":
        _warn_left_weights(folder, entries, written)
    return folder
