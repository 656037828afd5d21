"""Load a llama.cpp GGUF checkpoint (Llama or Qwen3 family) into our parameter layout.

Quantised tensors are dequantised with the `gguf` package (numpy, no torch), so the
weights are exactly what llama.cpp and transformers' GGUF path compute. Two facts about
the format matter:

* GGUF stores a tensor's dimensions fastest-first; the numpy view is the reverse, i.e.
  the torch layout (out, in). Our kernels are (in, out), hence a transpose.
* llama.cpp's converter permutes the rows of Llama's Q and K projections so that each
  head's rotary pairs are adjacent (its "normal" RoPE) instead of half a head apart (HF
  rotate-half). Within a head of D rows, GGUF row 2j is HF row j and GGUF row 2j+1 is HF
  row j + D/2; `unpermute_qk` inverts that. Qwen-family files use the rotate-half
  ("neox") RoPE and are not permuted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from dblast_jax.config import TargetConfig
from dblast_jax.io.layer_keys import DECODER_LAYER_KEYS, get_leaf, set_leaf

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen3")
_PERMUTED_QK = {"llama": True, "qwen3": False}

# GGUF per-layer tensor name -> (our path inside layers/{i}, transpose?), in write order
_LAYER_TENSORS = {k.gguf: (k.path, k.transposed) for k in DECODER_LAYER_KEYS}
_GLOBAL_TENSORS = {
    "token_embd": (("embed", "embedding"), False),
    "output_norm": (("final_norm", "scale"), False),
    "output": (("lm_head", "kernel"), True),
}


class GGUFFormatError(ValueError):
    """The file is not a (complete) GGUF file or does not describe a supported model."""


def _import_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover - gguf is a core dependency
        raise ImportError("reading GGUF files needs the `gguf` package (pip install "
                          "gguf==0.19.0)") from e
    return gguf


def _open(path: os.PathLike | str):
    """A GGUFReader, with clear errors for missing, foreign and truncated files."""
    gguf = _import_gguf()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file (first bytes {magic!r}, "
                              f"expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on cut-off files
        raise GGUFFormatError(f"{path} could not be parsed as GGUF (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFFormatError(f"{path} is truncated: tensor {t.name} ends at byte {end} "
                                  f"but the file has {size} bytes")
    return reader


def _field_value(field) -> Any:
    gguf = _import_gguf()
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # float32 metadata: keep the shortest decimal that round-trips (1e-05, not 9.99e-06)
        return float(str(np.float32(value)))
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_metadata(path: os.PathLike | str, reader=None) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (arrays as lists)."""
    reader = reader or _open(path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = _field_value(field)
    return meta


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row interleave. w: [n_heads * D, in] (torch layout)."""
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise GGUFFormatError(f"cannot un-permute a [{rows}, ...] projection into {n_heads} "
                              "heads of even size")
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of `unpermute_qk`); used for tests
    and for writing GGUF files."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(meta: dict, key: str, path, default: Any = None, required: bool = True):
    if key in meta:
        return meta[key]
    if not required:
        return default
    raise GGUFFormatError(f"{path}: metadata key {key!r} is missing")


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], path="<gguf>",
                         name: Optional[str] = None) -> TargetConfig:
    """A TargetConfig from llama.cpp metadata keys (`{arch}.*`, `tokenizer.ggml.*`)."""
    arch = _meta(meta, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFFormatError(f"{path}: unsupported architecture {arch!r}; this loader "
                              f"supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    k = lambda key, **kw: _meta(meta, f"{arch}.{key}", path, **kw)  # noqa: E731
    hidden = int(k("embedding_length"))
    n_heads = int(k("attention.head_count"))
    n_kv = int(k("attention.head_count_kv", required=False, default=n_heads))
    head_dim = int(k("attention.key_length", required=False, default=hidden // n_heads))
    scaling = k("rope.scaling.type", required=False, default="none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise GGUFFormatError(f"{path}: RoPE scaling ({scaling!r}, rope_freqs) is not "
                              "supported by the GGUF loader")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(k("vocab_size", required=False, default=len(tokens) if tokens else 0))
    if vocab <= 0:
        raise GGUFFormatError(f"{path}: no vocabulary size ({arch}.vocab_size or "
                              "tokenizer.ggml.tokens)")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return TargetConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(k("feed_forward_length")), num_layers=int(k("block_count")),
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim,
        rope_theta=float(k("rope.freq_base", required=False, default=10000.0)),
        rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        use_qk_norm=(arch == "qwen3"),
        max_position_embeddings=int(k("context_length", required=False, default=8192)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name or str(meta.get("general.name", "gguf")),
    )


def _target_path(tensor_name: str, config: TargetConfig):
    """(param path tuple, transpose, layer index or None) for a GGUF tensor name."""
    if not tensor_name.endswith(".weight"):
        return None
    stem = tensor_name[: -len(".weight")]
    if stem in _GLOBAL_TENSORS:
        path, transpose = _GLOBAL_TENSORS[stem]
        return path, transpose, None
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        i = int(parts[1])
        if i >= config.num_layers:
            return None
        sub, transpose = _LAYER_TENSORS[parts[2]]
        return ("layers", i) + sub, transpose, i
    return None


def _expected_shapes(config: TargetConfig) -> dict[tuple, tuple[int, ...]]:
    c = config
    h, f, v, d = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    shapes = {("embed", "embedding"): (v, h), ("final_norm", "scale"): (h,)}
    if not c.tie_word_embeddings:
        shapes[("lm_head", "kernel")] = (h, v)
    for i in range(c.num_layers):
        layer = {
            ("input_norm", "scale"): (h,), ("post_attn_norm", "scale"): (h,),
            ("attn", "q_proj", "kernel"): (h, c.num_heads * d),
            ("attn", "k_proj", "kernel"): (h, c.num_kv_heads * d),
            ("attn", "v_proj", "kernel"): (h, c.num_kv_heads * d),
            ("attn", "o_proj", "kernel"): (c.num_heads * d, h),
            ("mlp", "gate_proj", "kernel"): (h, f), ("mlp", "up_proj", "kernel"): (h, f),
            ("mlp", "down_proj", "kernel"): (f, h),
        }
        if c.use_qk_norm:
            layer[("attn", "q_norm", "scale")] = (d,)
            layer[("attn", "k_norm", "scale")] = (d,)
        shapes.update({("layers", i) + k: s for k, s in layer.items()})
    return shapes


def _dequantize(tensor) -> np.ndarray:
    gguf = _import_gguf()
    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    want = tuple(int(x) for x in reversed(tensor.shape))
    if arr.size != int(np.prod(want)):
        raise GGUFFormatError(f"tensor {tensor.name}: dequantised {arr.size} values, "
                              f"expected {want}")
    return np.asarray(arr, np.float32).reshape(want)


def load_gguf(path: os.PathLike | str, dtype=jnp.float32, name: Optional[str] = None):
    """Read a GGUF checkpoint.

    Returns (config, params, metadata): a TargetConfig, a params dict in our layout
    (see `dblast_jax.models.target.PARAM_LAYOUT`) with `dtype` leaves, and the file's
    metadata dict (tokenizer.ggml.* arrays included) for `Tokenizer.from_gguf_metadata`.
    """
    path = Path(path)
    reader = _open(path)
    meta = read_metadata(path, reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_metadata(meta, set(tensors), path, name=name)
    expected = _expected_shapes(config)
    permute = _PERMUTED_QK[config.arch]

    params: dict = {}
    seen = set()
    for tname, tensor in tensors.items():
        target = _target_path(tname, config)
        if target is None:
            raise GGUFFormatError(f"{path}: unexpected tensor {tname!r} for a "
                                  f"{config.num_layers}-layer {config.arch} model")
        ppath, transpose, _ = target
        if ppath not in expected:
            raise GGUFFormatError(f"{path}: tensor {tname!r} has no place in a "
                                  f"{config.arch} model with this config")
        w = _dequantize(tensor)
        if permute and ppath[-2] in ("q_proj", "k_proj") and w.ndim == 2:
            heads = config.num_heads if ppath[-2] == "q_proj" else config.num_kv_heads
            if w.shape[0] == heads * config.head_dim:
                w = unpermute_qk(w, heads)
        if transpose:
            w = w.T
        if tuple(w.shape) != expected[ppath]:
            raise GGUFFormatError(
                f"{path}: tensor {tname!r} -> {'/'.join(map(str, ppath))} has shape "
                f"{tuple(w.shape)} (after transposing to (in, out)) but the config "
                f"expects {expected[ppath]}")
        set_leaf(params, ppath, jnp.asarray(w, dtype=dtype))
        seen.add(ppath)
    missing = [p for p in expected if p not in seen]
    if missing:
        names = ", ".join("/".join(map(str, p)) for p in missing[:8])
        raise GGUFFormatError(f"{path}: {len(missing)} parameter(s) missing from the file, "
                              f"e.g. {names}")
    return config, params, meta


# ---- writing (F32 / F16 export, the inverse of load_gguf) ---------------------------------

_TOKENIZER_WRITERS = {
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.chat_template": "add_chat_template",
}


def save_gguf(path: os.PathLike | str, config: TargetConfig, params: dict,
              tokenizer_metadata: Optional[dict[str, Any]] = None,
              dtype=np.float32) -> Path:
    """Write params in llama.cpp's layout (unquantised, `dtype` float32 or float16).

    Applies the Q/K row permutation for Llama files and the (out, in) transpose, so
    `load_gguf(save_gguf(...))` returns the same params and llama.cpp / transformers
    read the file as the same model. `tokenizer_metadata` takes `tokenizer.ggml.*` /
    `tokenizer.chat_template` keys (as `read_metadata` returns them).
    """
    gguf = _import_gguf()
    if config.arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFFormatError(f"cannot write architecture {config.arch!r}")
    if config.rope_scaling is not None:
        raise GGUFFormatError("RoPE scaling is not supported by the GGUF writer")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), config.arch)
    w.add_name(config.name)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(config.num_layers)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    for key, value in (tokenizer_metadata or {}).items():
        if key in _TOKENIZER_WRITERS:
            getattr(w, _TOKENIZER_WRITERS[key])(value)

    def put(name: str, value, ppath: tuple, transpose: bool):
        arr = np.asarray(value, dtype=np.float32)
        if tuple(arr.shape) != _expected_shapes(config)[ppath]:
            raise GGUFFormatError(f"param {'/'.join(map(str, ppath))} has shape {arr.shape}, "
                                  f"config expects {_expected_shapes(config)[ppath]}")
        if transpose:
            arr = arr.T
        if _PERMUTED_QK[config.arch] and ppath[-2] in ("q_proj", "k_proj"):
            arr = permute_qk(arr, config.num_heads if ppath[-2] == "q_proj"
                             else config.num_kv_heads)
        out_dtype = np.float32 if arr.ndim == 1 else dtype  # norms stay float32 (llama.cpp)
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=out_dtype))

    for stem, (ppath, transpose) in _GLOBAL_TENSORS.items():
        if stem == "output" and config.tie_word_embeddings:
            continue
        put(f"{stem}.weight", get_leaf(params, ppath), ppath, transpose)
    for i in range(config.num_layers):
        for stem, (sub, transpose) in _LAYER_TENSORS.items():
            if sub[-2:] in (("q_norm", "scale"), ("k_norm", "scale")) and not config.use_qk_norm:
                continue
            ppath = ("layers", i) + sub
            put(f"blk.{i}.{stem}.weight", get_leaf(params, ppath), ppath, transpose)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
