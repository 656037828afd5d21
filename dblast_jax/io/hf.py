"""Hugging Face checkpoints (config.json + safetensors) <-> target parameters.

Supported: `LlamaForCausalLM` (model_type "llama") and `Qwen3ForCausalLM` ("qwen3").
One table, `KEY_TABLE`, maps Hugging Face tensor names to our parameter paths (see
`dblast_jax.models.target.PARAM_LAYOUT`) and says which tensors are transposed (torch
Linear weights are [out, in], our kernels [in, out]); loading and saving both use it.

Loading is lazy: tensors are read one at a time from memory-mapped safetensors files,
and with `shardings` each device shard reads only its slice of the file, so a large
checkpoint never needs a full host copy per device.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax.config import RopeScaling, TargetConfig
from dblast_jax.io.atomic import make_temp_dir
from dblast_jax.io.layer_keys import DECODER_LAYER_KEYS, get_leaf, set_leaf
from dblast_jax.io.safetensors_io import CheckpointError, SafetensorsReader, write_safetensors
from dblast_jax.models import target

__all__ = ["CheckpointError", "KEY_TABLE", "SUPPORTED_ARCHITECTURES", "config_from_hf",
           "config_to_hf", "hf_key_to_param", "param_to_hf_key", "load_hf_config", "load_hf",
           "save_hf"]

Params = dict[str, Any]

# HF `architectures` entry -> our TargetConfig.arch (== HF model_type).
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
_ARCH_TO_HF = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# Placeholders in KEY_TABLE templates and what each may match.
_FIELDS = {"i": r"\d+"}

# (HF key template, parameter path template, transform). "T" transposes a 2-D tensor
# (torch [out, in] <-> our [in, out]); "" copies it. Both directions use this table; the
# decoder-layer rows come from the table all formats share (io.layer_keys).
KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "embed/embedding", ""),
    *((f"model.layers.{{i}}.{k.torch}", "layers/{i}/" + "/".join(k.path),
       "T" if k.transposed else "") for k in DECODER_LAYER_KEYS),
    ("model.norm.weight", "final_norm/scale", ""),
    ("lm_head.weight", "lm_head/kernel", "T"),
)

# Buffers some checkpoints carry that hold no parameters (recomputed from the config).
_IGNORED_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _compile(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, field, ...
    regex = "".join(re.escape(p) if j % 2 == 0 else f"(?P<{p}>{_FIELDS[p]})"
                    for j, p in enumerate(parts))
    return re.compile(regex + "$")


_RULES = tuple((_compile(hf), hf, _compile(path), path, t) for hf, path, t in KEY_TABLE)


def _translate(name: str, from_hf: bool) -> Optional[tuple[str, bool]]:
    """One KEY_TABLE lookup, either way: (translated name, transpose?) or None."""
    for hf_re, hf_tpl, path_re, path_tpl, t in _RULES:
        m = (hf_re if from_hf else path_re).match(name)
        if m:
            return (path_tpl if from_hf else hf_tpl).format(**m.groupdict()), t == "T"
    return None


def hf_key_to_param(key: str) -> Optional[tuple[str, bool]]:
    """HF tensor name -> (parameter path "a/b/c", transpose?), or None if unmapped."""
    return _translate(key, from_hf=True)


def param_to_hf_key(path: str) -> Optional[tuple[str, bool]]:
    """Parameter path "a/b/c" -> (HF tensor name, transpose?), or None if unmapped."""
    return _translate(path, from_hf=False)


# ---- config ----------------------------------------------------------------------------------

def _unsupported(what: str) -> CheckpointError:
    return CheckpointError(f"unsupported checkpoint config: {what}")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, Optional[RopeScaling]]:
    """rope_theta and scaling from transformers-5 `rope_parameters` (preferred) or the
    older top-level `rope_theta` / `rope_scaling`."""
    params = dict(cfg.get("rope_scaling") or {})
    new = cfg.get("rope_parameters") or {}
    if new and not {"rope_type", "type", "rope_theta"} & set(new):  # keyed by layer type
        if set(new) != {"full_attention"}:
            raise _unsupported(f"per-layer-type rope_parameters {sorted(new)}")
        new = new["full_attention"]
    params.update(new)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _unsupported(f"partial_rotary_factor {params['partial_rotary_factor']}")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise _unsupported(f"rope_type {rope_type!r}; supported: "
                           f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise CheckpointError(f"llama3 rope scaling in config is missing {e.args[0]!r}") from e
    return theta, scaling


def _arch(cfg: Mapping[str, Any]) -> str:
    supported = ", ".join(f"{a} ({t})" for a, t in SUPPORTED_ARCHITECTURES.items())
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if archs:
        unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            raise CheckpointError(f"unsupported architecture {unknown[0]!r}; supported: "
                                  f"{supported}")
        arch = SUPPORTED_ARCHITECTURES[archs[0]]
        if model_type is not None and model_type != arch:
            raise CheckpointError(f"config says architecture {archs[0]!r} but model_type "
                                  f"{model_type!r} (expected {arch!r})")
        return arch
    if model_type in _ARCH_TO_HF:
        return model_type
    raise CheckpointError(f"unsupported model_type {model_type!r} (no 'architectures' given); "
                          f"supported: {supported}")


def config_from_hf(cfg: Mapping[str, Any], name: str = "hf") -> TargetConfig:
    """A parsed HF config.json (Llama or Qwen3 causal LM) -> TargetConfig.

    Features the target implementation does not have (biases, other RoPE variants,
    sliding windows, other activations) raise `CheckpointError` instead of being
    silently ignored.
    """
    arch = _arch(cfg)

    def req(key: str) -> int:
        if cfg.get(key) is None:
            raise CheckpointError(f"config is missing the required field {key!r}")
        return int(cfg[key])

    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise _unsupported(f"{flag}=true (biased projections)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported(f"hidden_act {cfg['hidden_act']!r}; only 'silu' is implemented")
    if cfg.get("use_sliding_window"):
        raise _unsupported("use_sliding_window=true")
    other_layers = sorted({t for t in cfg.get("layer_types") or () if t != "full_attention"})
    if other_layers:
        raise _unsupported(f"layer_types {other_layers}; only full_attention is implemented")

    hidden, heads = req("hidden_size"), req("num_attention_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"config has no head_dim and hidden_size {hidden} is not "
                                  f"divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    theta, scaling = _rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(
        int(e) for e in eos)
    bos = cfg.get("bos_token_id")
    default_max_pos = 2048 if arch == "llama" else 32768
    try:
        return TargetConfig(
            arch=arch, vocab_size=req("vocab_size"), hidden_size=hidden,
            intermediate_size=req("intermediate_size"), num_layers=req("num_hidden_layers"),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim), rope_theta=theta, rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            use_qk_norm=arch == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings") or default_max_pos),
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids, name=name)
    except ValueError as e:
        raise CheckpointError(f"invalid config: {e}") from e


def config_to_hf(config: TargetConfig, dtype: Any = jnp.float32) -> dict[str, Any]:
    """TargetConfig -> config.json dict that transformers (5.x, and 4.x via the legacy
    `rope_theta` / `rope_scaling` / `torch_dtype` fields) reloads as the same model."""
    if config.use_qk_norm != (config.arch == "qwen3"):
        raise CheckpointError(f"{config.arch} with use_qk_norm={config.use_qk_norm} has no "
                              "Hugging Face equivalent")
    rope_params: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    legacy_scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        legacy_scaling = {"rope_type": "llama3", "factor": s.factor,
                          "low_freq_factor": s.low_freq_factor,
                          "high_freq_factor": s.high_freq_factor,
                          "original_max_position_embeddings": s.original_max_position_embeddings}
        rope_params = {**legacy_scaling, "rope_theta": config.rope_theta}
    eos = list(config.eos_token_ids)
    dtype_name = jnp.dtype(dtype).name
    out: dict[str, Any] = {
        "architectures": [_ARCH_TO_HF[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_params,
        "rope_theta": config.rope_theta,
        "rope_scaling": legacy_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else eos,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    if config.arch == "llama":
        out.update(mlp_bias=False, pretraining_tp=1)
    else:
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=config.num_layers,
                   layer_types=["full_attention"] * config.num_layers)
    return out


def load_hf_config(folder: str | os.PathLike) -> TargetConfig:
    """Read `folder/config.json` into a TargetConfig (named after the folder)."""
    folder = _check_folder(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    try:
        return config_from_hf(cfg, name=folder.name)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e


# ---- params helpers ---------------------------------------------------------------------------

def _flatten(tree: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Nested dict -> ("a/0/b", leaf) pairs in a stable order (layers by index)."""
    keys = sorted(tree, key=lambda k: (isinstance(k, str), k if isinstance(k, int) else 0,
                                       str(k)))
    for k in keys:
        path = f"{prefix}{k}"
        if isinstance(tree[k], Mapping):
            yield from _flatten(tree[k], path + "/")
        else:
            yield path, tree[k]


def _names(keys, limit: int = 12) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _expected(config: TargetConfig, dtype) -> dict[str, tuple[str, bool, tuple[int, ...]]]:
    """HF key -> (param path, transpose?, HF-layout shape) for every parameter of `config`."""
    out = {}
    for path, leaf in _flatten(target.abstract_params(config, dtype)):
        mapped = param_to_hf_key(path)
        if mapped is None:  # a parameter the table does not cover is a bug here, not input
            raise AssertionError(f"KEY_TABLE has no entry for parameter {path}")
        key, transpose = mapped
        shape = tuple(leaf.shape)
        out[key] = (path, transpose, shape[::-1] if transpose else shape)
    return out


# ---- loading ----------------------------------------------------------------------------------

def _check_folder(folder: str | os.PathLike) -> Path:
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint path {folder} is not a folder")
    return folder


def _open_weights(folder: Path) -> SafetensorsReader:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return SafetensorsReader.from_index(index)
    single = folder / "model.safetensors"
    if single.is_file():
        return SafetensorsReader.from_file(single)
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = (f"; found {', '.join(present)} but no index to tie them together" if present
            else "")
    raise CheckpointError(f"{folder} has no weights: expected model.safetensors or "
                          f"model.safetensors.index.json{hint}")


def _validate(reader: SafetensorsReader, expected: Mapping, config: TargetConfig,
              folder: Path) -> None:
    present = set(reader.keys())
    missing = set(expected) - present
    if missing:
        hint = (" (config.json has tie_word_embeddings=false, so an output head is needed)"
                if "lm_head.weight" in missing else "")
        raise CheckpointError(f"checkpoint {folder} is missing tensor(s): {_names(missing)}"
                              f"{hint}")
    extra = {k for k in present - set(expected) if not _IGNORED_KEYS.search(k)}
    if config.tie_word_embeddings and "lm_head.weight" in extra:
        extra.discard("lm_head.weight")
        emb = "model.embed_tokens.weight"
        if (reader.shape("lm_head.weight") != reader.shape(emb)
                or not np.array_equal(reader.read("lm_head.weight"), reader.read(emb))):
            raise CheckpointError(
                f"config.json ties the word embeddings, but lm_head.weight in "
                f"{reader.file_of('lm_head.weight')} differs from {emb}; set "
                "tie_word_embeddings=false or drop lm_head.weight")
    if extra:
        raise CheckpointError(f"checkpoint {folder} has unexpected tensor(s) for a "
                              f"{config.num_layers}-layer {config.arch} config: {_names(extra)}")
    for key, (_, transpose, shape) in expected.items():
        found = reader.shape(key)
        if found != shape:
            layout = " (torch layout [out, in])" if transpose else ""
            raise CheckpointError(f"tensor {key} in {reader.file_of(key)} has shape "
                                  f"{found}, expected {shape}{layout}")


def _read_sharded(reader: SafetensorsReader, key: str, transpose: bool,
                  shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    """Build one global array; each device shard reads only its slice of the file."""
    memo: dict[tuple, np.ndarray] = {}  # replicated shards share one read

    def fetch(index) -> np.ndarray:
        index = tuple(index) if index is not None else ()
        index = index + (slice(None),) * (len(shape) - len(index))
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if bounds not in memo:
            src = tuple(slice(a, b) for a, b in (bounds[::-1] if transpose else bounds))
            arr = reader.read(key, src)
            memo[bounds] = np.ascontiguousarray((arr.T if transpose else arr).astype(dtype))
        return memo[bounds]

    return jax.make_array_from_callback(shape, sharding, fetch, dtype=dtype)


def load_hf(folder: str | os.PathLike, dtype: Any = jnp.float32, shardings: Any = None
            ) -> tuple[TargetConfig, Params]:
    """Load a Hugging Face Llama / Qwen3 checkpoint folder.

    folder: config.json plus model.safetensors, or shards with
      model.safetensors.index.json.
    dtype: parameter dtype (cast on read); None keeps the embedding's stored dtype.
    shardings: optional pytree of `jax.sharding.Sharding` matching the params (or one
      Sharding for all); each device then reads only its slice from disk.
    Returns (config, params) with params laid out as `target.PARAM_LAYOUT`.
    Raises CheckpointError naming the file / tensor / shapes on any mismatch.
    """
    folder = _check_folder(folder)
    config = load_hf_config(folder)
    with _open_weights(folder) as reader:
        expected = _expected(config, jnp.float32)
        _validate(reader, expected, config, folder)
        if dtype is None:
            dtype = reader.dtype("model.embed_tokens.weight")
        dtype = jnp.dtype(dtype)
        params: Params = {}
        for key, (path, transpose, hf_shape) in expected.items():
            if shardings is None:
                arr = reader.read(key)
                leaf = jnp.asarray((arr.T if transpose else arr).astype(dtype, copy=False))
            else:
                if isinstance(shardings, jax.sharding.Sharding):
                    sharding = shardings
                else:
                    try:
                        sharding = get_leaf(shardings, path)
                    except KeyError:
                        raise ValueError(f"shardings has no entry for parameter {path}") from None
                shape = hf_shape[::-1] if transpose else hf_shape
                leaf = _read_sharded(reader, key, transpose, shape, dtype, sharding)
            set_leaf(params, path, leaf)
    return config, params


# ---- saving -----------------------------------------------------------------------------------

def _to_hf_tensors(params: Params, config: TargetConfig, dtype) -> dict[str, np.ndarray]:
    expected = _expected(config, jnp.float32)
    by_path = {path: (key, transpose, shape) for key, (path, transpose, shape)
               in expected.items()}
    leaves = dict(_flatten(params))
    missing, extra = set(by_path) - set(leaves), set(leaves) - set(by_path)
    if missing or extra:
        raise CheckpointError(f"params do not match the {config.arch} config: missing "
                              f"[{_names(missing)}], unexpected [{_names(extra)}]")
    tensors = {}
    for path, leaf in leaves.items():
        key, transpose, hf_shape = by_path[path]
        shape = hf_shape[::-1] if transpose else hf_shape
        if tuple(leaf.shape) != shape:
            raise CheckpointError(f"parameter {path} has shape {tuple(leaf.shape)}, expected "
                                  f"{shape} for this config")
        arr = np.asarray(jax.device_get(leaf))
        if dtype is not None:
            arr = arr.astype(jnp.dtype(dtype), copy=False)
        tensors[key] = np.ascontiguousarray(arr.T if transpose else arr)
    return tensors


def save_hf(params: Params, config: TargetConfig, folder: str | os.PathLike,
            max_shard_bytes: Optional[int] = None, dtype: Any = None,
            overwrite: bool = False) -> Path:
    """Write params as a Hugging Face checkpoint folder that transformers can load.

    Files: config.json and model.safetensors, or size-bounded shards plus
    model.safetensors.index.json when `max_shard_bytes` is set and exceeded.
    dtype: cast the tensors (None keeps the parameter dtype). Writing goes to a temporary
    folder beside the target which is renamed into place, so a new checkpoint folder
    appears complete or not at all. An existing non-empty folder is refused unless
    `overwrite`; then the checkpoint files are replaced one by one (other files such as
    a tokenizer are kept, stale weight shards removed). Returns the folder.
    """
    folder = Path(folder)
    tensors = _to_hf_tensors(params, config, dtype)
    store_dtype = next(iter(tensors.values())).dtype
    exists_nonempty = folder.is_dir() and any(folder.iterdir())
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"cannot save to {folder}: it is a file")
    if exists_nonempty and not overwrite:
        raise CheckpointError(f"{folder} already exists and is not empty; pass overwrite=True")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(make_temp_dir(folder.parent, folder.name, "tmp"))
    try:
        names = write_safetensors(tensors, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(
            json.dumps(config_to_hf(config, store_dtype), indent=2) + "\n")
        names.append("config.json")
        if not exists_nonempty:
            if folder.is_dir():
                folder.rmdir()
            os.rename(tmp, folder)
        else:
            for name in names:
                os.replace(tmp / name, folder / name)
            stale = [p for p in folder.glob("model*.safetensors*") if p.name not in names]
            for p in stale:
                p.unlink()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
