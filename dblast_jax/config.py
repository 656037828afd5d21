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
        return cls(**_QWEN3_4B_8B, hidden_size=2560, intermediate_size=9728,
                   tie_word_embeddings=True, name="qwen3-4b")

    @classmethod
    def qwen3_8b(cls) -> "TargetConfig":
        return cls(**_QWEN3_4B_8B, hidden_size=4096, intermediate_size=12288,
                   tie_word_embeddings=False, name="qwen3-8b")


# what Qwen3-4B and Qwen3-8B share (their config.json); they differ in width and head tying
_QWEN3_4B_8B = dict(arch="qwen3", vocab_size=151936, num_layers=36, num_heads=32,
                    num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                    use_qk_norm=True, max_position_embeddings=40960,
                    eos_token_ids=(151645, 151643))


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

# Serial correction heads of a trained drafter (dblast_jax/correction.py): "none" (the
# parallel block, DFlash / DBlast as published) or "previous-token" (position i's logits
# get a rank-r correction from the token drafted at position i - 1, drafts taken left to
# right; docs/METHOD.md section 3.1).
CORRECTIONS = ("none", "previous-token")
# correction_rank when a correction is asked for without one (min(this, hidden_size))
DEFAULT_CORRECTION_RANK = 32
# Attention among a trained drafter's block positions: "bidirectional" (DFlash / DBlast as
# published: one parallel pass, every block position sees the whole block) or "causal"
# (block position i sees the context and the block's tokens before it only; drafts are
# taken left to right, one drafter pass per position, each drafted token's embedding put
# in its block position; dblast_jax/block_causal.py, docs/METHOD.md section 3.2).
BLOCK_ATTENTIONS = ("bidirectional", "causal")


def block_attention_problems(block_attention: Any, correction: Any,
                             prefix: str = "") -> list[str]:
    """What is wrong with block_attention (and its pairing with a correction head)."""
    if block_attention not in BLOCK_ATTENTIONS:
        return [f"{prefix}block_attention must be one of {', '.join(BLOCK_ATTENTIONS)}, got "
                f"{block_attention!r}"]
    if block_attention == "causal" and correction not in (None, "none"):
        return [f"{prefix}block_attention=causal does not combine with {prefix}correction="
                f"{correction} (a causal block already conditions each position on the "
                "drafted tokens before it)"]
    return []


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def correction_problems(correction: Any, rank: Any, prefix: str = "",
                        rank_optional: bool = False) -> list[str]:
    """What is wrong with a (correction, correction_rank) pair, one phrase each."""
    if correction not in CORRECTIONS:
        return [f"{prefix}correction must be one of {', '.join(CORRECTIONS)}, got "
                f"{correction!r}"]
    if correction == "none":
        if rank not in (None, 0) or isinstance(rank, bool):
            return [f"{prefix}correction_rank {rank!r} needs {prefix}correction="
                    "previous-token (the correction is 'none')"]
        return []
    if rank is None and rank_optional:
        return []
    if not _is_int(rank) or rank < 1:
        return [f"{prefix}correction_rank must be an integer >= 1 for correction "
                f"{correction!r}, got {rank!r}"]
    return []


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
    # a serial correction head (CORRECTIONS) of rank correction_rank (0 with "none")
    correction: str = "none"
    correction_rank: int = 0
    # attention among the block's positions (BLOCK_ATTENTIONS)
    block_attention: str = "bidirectional"
    name: str = "drafter"

    def __post_init__(self):
        problems = correction_problems(self.correction, self.correction_rank)
        if not problems and not _is_int(self.correction_rank):
            problems = [f"correction_rank must be an integer, got {self.correction_rank!r}"]
        problems = problems or block_attention_problems(self.block_attention, self.correction)
        if problems:
            raise ValueError(problems[0])
        if self.correction_rank > self.hidden_size:
            raise ValueError(f"correction_rank {self.correction_rank} exceeds hidden_size "
                             f"{self.hidden_size}: a low-rank correction needs r <= H")
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
                   intermediate_size: Optional[int] = None, correction: str = "none",
                   correction_rank: Optional[int] = None,
                   block_attention: str = "bidirectional",
                   **overrides: Any) -> "DrafterConfig":
        """A drafter shaped like the target's layers (DFlash's choice). correction_rank
        None: min(DEFAULT_CORRECTION_RANK, H) with a correction, 0 without."""
        if expander_width is None:
            expander_width = 0 if num_categories == 1 else max(16, target.hidden_size // 4)
        if correction_rank is None:
            correction_rank = (0 if correction == "none"
                               else min(DEFAULT_CORRECTION_RANK, target.hidden_size))
        ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)
        cfg = cls(hidden_size=target.hidden_size,
                  intermediate_size=intermediate_size or target.intermediate_size,
                  num_layers=num_layers, num_heads=target.num_heads,
                  num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                  target_layer_ids=tuple(ids), num_target_layers=target.num_layers,
                  block_size=block_size, rope_theta=target.rope_theta,
                  rms_norm_eps=target.rms_norm_eps, vocab_size=target.vocab_size,
                  num_categories=num_categories, expander_width=expander_width,
                  correction=correction, correction_rank=correction_rank,
                  block_attention=block_attention)
        return cfg.replace(**overrides)


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Prompt-lookup drafting (vLLM's `ngram` method), run inside the on-device loop: the
    longest suffix of prompt + output of length max_n .. min_n that occurred before, and
    the `block_size - 1` tokens that followed its latest occurrence; when no row of the
    batch has such a suffix, the step verifies the anchor alone (a plain step). No parameters, no
    feature taps: the proposal is a function of the text so far, so it verifies as a
    one-hot Q at every temperature (exact)."""

    block_size: int = 8  # the anchor + block_size - 1 drafts (k = block_size - 1)
    max_n: int = 4
    # shorter suffixes propose nothing; a step where no row has a proposal is a plain
    # one-token step. 2, not vLLM's 1: one-token matches are accepted too rarely to pay
    # for a b-token verify on a compute-bound CPU (BENCHMARKS.md)
    min_n: int = 2
    name: str = "ngram"

    def __post_init__(self):
        for field, low in (("block_size", 2), ("min_n", 1), ("max_n", 1)):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"ngram {field} must be an integer >= {low}, got {v!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"ngram min_n ({self.min_n}) must be <= max_n ({self.max_n})")

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return ()  # reads no target features

    def replace(self, **changes: Any) -> "NgramConfig":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class CombinedDrafterConfig:
    """A trained drafter and the n-gram proposal in one loop, one verify pass per step: a
    row takes the n-gram drafts where its matched suffix is at least `min_match` tokens
    long, else the trained drafter's. The choice depends on the text so far only, never on
    either proposal's random draws, so verifying each row against the proposal it used
    stays exact. The block is the trained drafter's."""

    drafter: DrafterConfig
    ngram: NgramConfig
    min_match: int = 2
    name: str = "combined"

    def __post_init__(self):
        if self.ngram.block_size != self.drafter.block_size:
            object.__setattr__(self, "ngram",
                               self.ngram.replace(block_size=self.drafter.block_size))
        if not isinstance(self.min_match, int) or self.min_match < 1:
            raise ValueError(f"min_match must be an integer >= 1, got {self.min_match!r}")
        if self.min_match > self.ngram.max_n:
            raise ValueError(f"min_match ({self.min_match}) exceeds the n-gram's max_n "
                             f"({self.ngram.max_n}): the n-gram drafts would never be used")

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.target_layer_ids

    def replace(self, **changes: Any) -> "CombinedDrafterConfig":
        if "block_size" in changes:  # both proposals draft the same block
            block = changes.pop("block_size")
            changes["drafter"] = changes.get("drafter", self.drafter).replace(block_size=block)
            changes["ngram"] = changes.get("ngram", self.ngram).replace(block_size=block)
        return dataclasses.replace(self, **changes)


def trained_drafter_config(config: Any) -> Optional[DrafterConfig]:
    """The trained drafter inside a drafter config (None for pure n-gram drafting)."""
    if isinstance(config, NgramConfig):
        return None
    if isinstance(config, CombinedDrafterConfig):
        return config.drafter
    return config


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """The drafter a run trains, in terms that do not depend on the target: `for_target`
    turns it into the `DrafterConfig` for one target (the only place that does). A None
    field is derived from the target: the taps DFlash picks for the depth, a learned mask
    embedding, the automatic expander width, the target's MLP width. `TrainConfig.drafter`
    and `DemoConfig.drafter` hold one; overrides set its fields as `drafter.FIELD=VALUE`
    (`none` for None)."""

    num_layers: int = 1
    block_size: int = 16
    num_categories: int = 1  # K
    # target layers the drafter reads; None: DFlash's default for the depth
    # (default_target_layer_ids)
    target_layer_ids: Optional[tuple[int, ...]] = None
    # the token whose embedding row fills the block's masked slots, as in DFlash; None: a
    # learned mask embedding (DBlast-only: such exports do not load in DFlash / vLLM)
    mask_token_id: Optional[int] = None
    # the category expander's width; None: automatic (0 for K = 1, max(16, H // 4) else)
    expander_width: Optional[int] = None
    intermediate_size: Optional[int] = None  # the drafter layers' MLP; None: the target's
    # a serial correction head: "none" or "previous-token" (config.CORRECTIONS); its rank
    # None: automatic (min(DEFAULT_CORRECTION_RANK, H) with a correction)
    correction: str = "none"
    correction_rank: Optional[int] = None
    # attention among the block's positions: "bidirectional" or "causal"
    # (config.BLOCK_ATTENTIONS)
    block_attention: str = "bidirectional"

    def __post_init__(self):
        if isinstance(self.target_layer_ids, list):  # JSON / Python lists: hashable tuple
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        problems = self.problems()
        if problems:
            raise ValueError("invalid drafter: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with the fields, one phrase each, named as overrides set them."""
        out = []

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for field, low in (("num_layers", 1), ("block_size", 2), ("num_categories", 1)):
            v = getattr(self, field)
            if not is_int(v) or v < low:
                out.append(f"drafter.{field} must be an integer >= {low}, got {v!r}")
        for field, low, none in (("mask_token_id", 0, "a learned mask"),
                                 ("expander_width", 0, "automatic"),
                                 ("intermediate_size", 1, "the target's")):
            v = getattr(self, field)
            if v is not None and (not is_int(v) or v < low):
                out.append(f"drafter.{field} must be an integer >= {low} or none ({none}), "
                           f"got {v!r}")
        ids = self.target_layer_ids
        if ids is not None and (not isinstance(ids, tuple) or not ids
                                or not all(is_int(i) and i >= 0 for i in ids)):
            out.append("drafter.target_layer_ids must be target layer numbers (e.g. 1,7,14) "
                       f"or none (DFlash's default for the depth), got {ids!r}")
        out += correction_problems(self.correction, self.correction_rank, "drafter.",
                                   rank_optional=True)
        out += block_attention_problems(self.block_attention, self.correction, "drafter.")
        return out

    def replace(self, **changes: Any) -> "DrafterSpec":
        return dataclasses.replace(self, **changes)

    def for_target(self, target: TargetConfig, name: str = "drafter") -> DrafterConfig:
        """The DrafterConfig of this drafter on `target`."""
        return DrafterConfig.for_target(
            target, num_layers=self.num_layers, block_size=self.block_size,
            num_categories=self.num_categories, expander_width=self.expander_width,
            target_layer_ids=self.target_layer_ids, intermediate_size=self.intermediate_size,
            mask_token_id=self.mask_token_id, correction=self.correction,
            correction_rank=self.correction_rank, block_attention=self.block_attention,
            name=name)


# The flat TrainConfig fields that held the drafter's shape before `TrainConfig.drafter`
# (train_config.json of older runs, scripts, command lines: still accepted as aliases) ->
# the DrafterSpec field; their placeholders mean None (see legacy_drafter_value).
LEGACY_DRAFTER_FIELDS = {
    "drafter_layers": "num_layers",
    "block_size": "block_size",
    "num_categories": "num_categories",
    "target_layer_ids": "target_layer_ids",
    "mask_token_id": "mask_token_id",
    "expander_width": "expander_width",
    "drafter_intermediate_size": "intermediate_size",
    # not of before, but flat names all the same (`--override correction=previous-token`)
    "correction": "correction",
    "correction_rank": "correction_rank",
    "block_attention": "block_attention",
}


def legacy_drafter_value(field: str, value: Any) -> Any:
    """A flat field's value as the DrafterSpec's: the old placeholders (mask_token_id < 0:
    learned mask, expander_width < 0: automatic, drafter_intermediate_size 0: the target's,
    target_layer_ids (): DFlash's default) become None."""
    if field in ("mask_token_id", "expander_width") and value is not None and value < 0:
        return None
    if field == "intermediate_size" and value == 0:
        return None
    if field == "target_layer_ids" and value is not None and len(value) == 0:
        return None
    return value
