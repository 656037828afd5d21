"""Loads the registry's named target models: pinned GGUFs, tiny random ones (`load_model`).

The names and files are `dblast_jax.registry`'s tables. `dblast fetch NAME` downloads a
pinned file; `load_preset(NAME)` loads a pinned model (never downloading).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from dblast_jax import registry
from dblast_jax.config import TargetConfig
from dblast_jax.io import fetch as _fetch
from dblast_jax.io.fetch import PinnedFile
from dblast_jax.io.gguf import load_gguf, read_metadata
from dblast_jax.io.tokenizer import Tokenizer
from dblast_jax.models import target as target_lm
from dblast_jax.registry import TOKENIZER_FILES  # noqa: F401  (re-exported)

# the registry's views of before: name -> pinned GGUF, and the tiny models with a tokenizer
PRESETS: dict[str, PinnedFile] = {name: registry.MODEL_FILES[entry.file] for name, entry
                                  in registry.models_of_kind("gguf").items()}
TINY_TOKENIZER_PRESETS = tuple(registry.models_of_kind("tiny-tokenizer"))


def get_preset(name: str) -> PinnedFile:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: "
                       f"{', '.join(sorted(PRESETS))}") from None


def resolve_preset(name: str) -> Path:
    """Verified local path of a preset's file; raises (with the fetch command) if absent."""
    return _fetch.require(get_preset(name), name=name)


def load_preset(name: str, dtype=jnp.float32):
    """(TargetConfig, params, Tokenizer) of a preset model. The config is named `name`."""
    path = resolve_preset(name)
    config, params, metadata = load_gguf(path, dtype=dtype, name=name)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    return config, params, tokenizer


def load_tiny_with_tokenizer(name: str, dtype=jnp.float32, seed: int = 0):
    """(TargetConfig, params, Tokenizer): a tiny random Llama with SmolLM2's vocabulary,
    tokenizer and chat template (read from the pinned GGUF's metadata, no weights loaded).
    Text in, text out at test speed: the end-to-end tests and the CI-run notebook use it
    where the real model would cost minutes."""
    if name not in TINY_TOKENIZER_PRESETS:
        raise KeyError(f"unknown tiny tokenizer preset {name!r}")
    file = registry.MODELS[name].file
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(
        _fetch.require(registry.MODEL_FILES[file], name=file)))
    real = TargetConfig.smollm2_135m()
    config = TargetConfig.tiny_llama(vocab_size=real.vocab_size, bos_token_id=real.bos_token_id,
                                     eos_token_ids=real.eos_token_ids,
                                     max_position_embeddings=4096, name=name)
    return config, target_lm.init_params(config, seed, dtype), tokenizer


def load_model(name: str, dtype=jnp.float32, seed: int = 0):
    """(TargetConfig, params, Tokenizer or None) of the registry's model `name`
    (registry.MODELS; `seed` draws the random weights of the random kinds)."""
    try:
        entry = registry.MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: "
                       f"{', '.join(sorted(registry.MODELS))}") from None
    if entry.kind == "gguf":
        return load_preset(name, dtype=dtype)
    if entry.kind == "tiny-tokenizer":
        return load_tiny_with_tokenizer(name, dtype, seed)
    config = getattr(TargetConfig, entry.config)()
    return config, target_lm.init_params(config, seed, dtype), None


def load_qwen3_tokenizer():
    """Qwen3's official tokenizer and chat template (verified; never downloads)."""
    tok = _fetch.require(TOKENIZER_FILES["qwen3-tokenizer"], name="qwen3-tokenizer")
    cfg = _fetch.require(TOKENIZER_FILES["qwen3-tokenizer-config"], name="qwen3-tokenizer-config")
    return Tokenizer.from_file(tok, tokenizer_config=cfg)
