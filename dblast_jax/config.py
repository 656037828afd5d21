"""Frozen configuration dataclasses and named presets.

Configs are hashable (frozen dataclasses of plain Python values) so that they can be
passed as static arguments to `jax.jit` and used as cache keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

ARCHITECTURES = ("llama", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (HF `rope_scaling` with rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shape and numerics of a decoder-only target LM (Llama or Qwen3 family).

    The two families share one implementation; they differ in `use_qk_norm` (Qwen3
    applies RMSNorm per head to queries and keys before RoPE) and in defaults.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_qk_norm: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "custom"

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")

    def replace(self, **changes: Any) -> "TargetConfig":
        return dataclasses.replace(self, **changes)

    # ---- presets -------------------------------------------------------------------
    @classmethod
    def tiny_llama(cls, **overrides: Any) -> "TargetConfig":
        """A few-KB random Llama for tests: GQA, tied embeddings, odd sizes."""
        cfg = cls(arch="llama", vocab_size=97, hidden_size=48, intermediate_size=80,
                  num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  name="tiny-llama")
        return cfg.replace(**overrides)

    @classmethod
    def tiny_qwen3(cls, **overrides: Any) -> "TargetConfig":
        """A few-KB random Qwen3 for tests: q/k norm, explicit head_dim, untied head."""
        cfg = cls(arch="qwen3", vocab_size=101, hidden_size=40, intermediate_size=72,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=12,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_qk_norm=True, name="tiny-qwen3")
        return cfg.replace(**overrides)

    @classmethod
    def smollm2_135m(cls) -> "TargetConfig":
        return cls(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                   max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
                   name="smollm2-135m-instruct")

    @classmethod
    def qwen3_4b(cls) -> "TargetConfig":
        return cls(arch="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                   num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   use_qk_norm=True, max_position_embeddings=40960,
                   eos_token_ids=(151645, 151643), name="qwen3-4b")

    @classmethod
    def qwen3_8b(cls) -> "TargetConfig":
        return cls(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                   num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   use_qk_norm=True, max_position_embeddings=40960,
                   eos_token_ids=(151645, 151643), name="qwen3-8b")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. `temperature == 0` means greedy (argmax).

    Filtering follows the Hugging Face order: temperature, then top-k, then top-p.
    `top_k = 0` and `top_p = 1.0` disable the filters.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    verify_mode: str = "greedy-branch"
    category_temperature: float = 1.0
    draft_temperature: float = 1.0
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("temperature", "top_p", "category_temperature", "draft_temperature"):
            if not math.isfinite(getattr(self, name)):  # nan passes every comparison below
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(
                f"unknown verify_mode {self.verify_mode!r}; supported: {', '.join(VERIFY_MODES)}")
        if self.category_temperature <= 0 or self.draft_temperature <= 0:
            raise ValueError("category_temperature and draft_temperature must be > 0")

    def replace(self, **changes: Any) -> "SamplingConfig":
        return dataclasses.replace(self, **changes)


VERIFY_MODES = ("greedy-branch", "sampled-branch", "mixture", "sampled-mixture")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default taps: one draft layer -> the middle target layer; otherwise
    `num_draft_layers` ids evenly spaced from 1 to n - 3, rounded (n = 36, m = 5 ->
    1, 9, 17, 25, 33)."""
    n, m = num_target_layers, num_draft_layers
    if m == 1:
        return (n // 2,)
    start, end = 1, n - 3
    return tuple(int(round(start + i * (end - start) / (m - 1))) for i in range(m))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash block drafter plus the DBlast latent-mixture additions.

    `hidden_size` must equal the target's (the drafter reuses the target's embedding and
    LM head). `num_categories = 1` with `expander_width = 0` is DFlash exactly.
    `mask_token_id = None` means a learned mask embedding (targets without a spare row,
    e.g. SmolLM2); an int uses that row of the target's embedding (DFlash checkpoints).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int = 16
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    vocab_size: int = 0
    mask_token_id: Optional[int] = None
    num_categories: int = 1
    expander_width: int = 0
    name: str = "drafter"

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_categories < 1:
            raise ValueError(f"num_categories must be >= 1, got {self.num_categories}")
        if self.num_categories > 1 and self.expander_width <= 0:
            raise ValueError("num_categories > 1 needs the category expander "
                             "(expander_width > 0); identical branches never diverge")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                raise ValueError(f"target layer id {i} out of range for a "
                                 f"{self.num_target_layers}-layer target")

    def replace(self, **changes: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target: TargetConfig, *, num_layers: int = 1, block_size: int = 16,
                   num_categories: int = 1, expander_width: Optional[int] = None,
                   target_layer_ids: Optional[tuple[int, ...]] = None,
                   intermediate_size: Optional[int] = None, **overrides: Any) -> "DrafterConfig":
        """A drafter shaped like the target's layers (DFlash's choice)."""
        if expander_width is None:
            expander_width = 0 if num_categories == 1 else max(16, target.hidden_size // 4)
        ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)
        cfg = cls(hidden_size=target.hidden_size,
                  intermediate_size=intermediate_size or target.intermediate_size,
                  num_layers=num_layers, num_heads=target.num_heads,
                  num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                  target_layer_ids=tuple(ids), num_target_layers=target.num_layers,
                  block_size=block_size, rope_theta=target.rope_theta,
                  rms_norm_eps=target.rms_norm_eps, vocab_size=target.vocab_size,
                  num_categories=num_categories, expander_width=expander_width)
        return cfg.replace(**overrides)
