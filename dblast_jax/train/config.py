"""Training configuration: one frozen dataclass and a registry of named experiments.

A `TrainConfig` says everything a run needs (drafter shape, objective, optimiser, data
shape, checkpointing, mesh). It is frozen and hashable, so the jitted train step can be
cached on it. The drafter's shape is one value, `TrainConfig.drafter` (a
`config.DrafterSpec`; `drafter_config` turns it into the DrafterConfig for the target).
Launchers pick an experiment by name and change any field with `key=value` overrides
(`apply_overrides`; the drafter's fields as `drafter.num_categories=4`, the flat names of
before, e.g. `num_categories=4`, still accepted), so one registry serves a laptop test,
the SmolLM2 runs of this machine and a Qwen3 run on a TPU pod.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, Iterable, Optional

from dblast_jax.config import (LEGACY_DRAFTER_FIELDS, DrafterConfig, DrafterSpec,
                               TargetConfig, legacy_drafter_value)
from dblast_jax.data.corpus import parse_shard_range  # noqa: F401  (moved; the old name)
from dblast_jax.dtypes import PARAM_DTYPES  # noqa: F401  (re-exported)
from dblast_jax.errors import UnknownNameError

LOSSES = ("dflash", "nll", "nll+al")
LOGP_SOURCES = ("auto", "data", "target")
NONFINITE_POLICIES = ("error", "skip")


def _not_one_of(config: Any, field: str, allowed: tuple) -> list[str]:
    """[] when config.FIELD is one of `allowed`, else the one problem saying so."""
    value = getattr(config, field)
    return [] if value in allowed else [f"{field} {value!r} is not one of {allowed}"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Step counts of the schedules are fractions of `num_steps`, so an
    experiment keeps its shape when its length is overridden."""

    name: str = "custom"
    target: str = "tiny-llama"  # preset name, HF folder or .gguf (see load_target)
    data: str = "synthetic"  # "synthetic", a .jsonl path or a regenerated corpus folder
    data_shards: int = 0  # > 0: only the corpus folder's first N shards (a fixed snapshot)

    # ---- drafter shape: layers, block size, K, taps, mask token, expander and MLP widths
    # (config.DrafterSpec; None fields come from the target). The recipes below set a mask
    # token per target (see SMOLLM2_MASK_TOKEN_ID); mask_token_id None trains a learned
    # mask embedding instead (DBlast-only: such exports do not load in DFlash / vLLM)
    drafter: DrafterSpec = DrafterSpec()

    # ---- objective
    loss: str = "dflash"  # "dflash" | "nll" | "nll+al"
    gamma: float = 7.0  # DFlash position decay exp(-(i-1)/gamma); <= 0: uniform
    nll_position_decay: bool = False  # use the gamma weights inside the mixture NLL too
    lam: float = 1.0  # weight of the AL surrogate ("nll+al")
    lam_warmup_fraction: float = 0.1  # lam ramps 0 -> lam over this fraction of the run
    lam_delay_fraction: float = 0.0  # ... starting after this fraction (NLL only before)
    tau_start: float = 0.0  # AL truncation threshold, start ...
    tau_end: float = 0.0  # ... and end (geometric between two positive values)
    tau_transition_fraction: float = 0.5
    verify_temperature: float = 1.0  # T_v of the target log-probs in the AL terms
    logp_source: str = "auto"  # "data" (stored in the corpus), "target" (on the fly), "auto"
    track_al: bool = True  # AL metrics even when the loss does not need target log-probs
    # distillation: + distill_weight * soft CE against the target's distribution at T_v at
    # every block position, truncated to its distill_topk most likely tokens + tail mass
    # (train/distill.py; stored in the feature cache when one is used). 0 disables.
    distill_weight: float = 0.0
    distill_topk: int = 64
    # "random"; "target": drafter layers / norms start from the target's own layers after
    # the deepest tap; "drafter:SPEC": every tensor of a trained drafter of the same trunk
    # (workdir, export folder or pretrained:NAME; e.g. a K = 1 run to start K = 4 from),
    # or of a shallower one, grown by identity layers on top (train/warm_start.py)
    drafter_init: str = "random"
    # True: fc trains as on taps divided by their per-channel RMS (measured on the first
    # training records): its rows start at init / RMS and learn at lr / RMS, an optimizer
    # preconditioner, so the trained fc is a plain DFlash fc (train/tap_scaling.py)
    tap_rms_scaling: bool = False
    # > 0: the training loss normalises each log q over the train_head_tokens most frequent
    # response tokens of the data plus train_head_sampled ids drawn from the rest at every
    # step (importance-weighted, train/sampled_head.py): a fraction of the 49k-way head's
    # FLOPs. The drafter is unchanged: validation, sampling and export use the full head.
    train_head_tokens: int = 0
    train_head_sampled: int = 1024

    # ---- optimisation
    learning_rate: float = 6e-4
    warmup_fraction: float = 0.04
    end_lr_fraction: float = 0.0  # cosine decays to learning_rate * this
    # One cosine over a run made of several runs (a chain of legs, each from the last one's
    # export): > 0 is the whole schedule's length in steps, schedule_offset the steps of it
    # that earlier runs took. This run warms up (warmup_fraction of its own steps) to the
    # rate the long cosine has reached at schedule_offset and follows it from there, instead
    # of restarting the cosine at learning_rate. 0: the cosine spans this run alone.
    schedule_steps: int = 0
    schedule_offset: int = 0
    weight_decay: float = 0.01  # on matrices only (norm scales, biases, mask embedding: no)
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    grad_clip: float = 1.0  # global norm; <= 0 disables
    grad_accum_steps: int = 1  # micro-batches per optimizer step (scan)
    num_steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step, all processes together
    anchors_per_sequence: int = 32
    seq_len: int = 512
    seed: int = 0

    # ---- bookkeeping
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    log_every: int = 1
    export: bool = True  # write workdir/export (DFlash format) at the end
    # a step with a non-finite loss / gradient / update is never applied nor saved;
    # "error": the run stops there (the last good checkpoint stays), "skip": the step is
    # skipped and counted (metrics `skipped_steps`), an error past max_skipped_steps
    nonfinite_policy: str = "error"
    max_skipped_steps: int = 10
    # live metrics (train/metric_writers.py): the metrics.jsonl / validation.jsonl rows
    # also as scalars; logging only, never part of a run's identity or its step
    tensorboard: bool = True  # event files in workdir/tensorboard (tensorboard --logdir)
    wandb_project: str = ""  # "": off; else a Weights & Biases run (pip install wandb)
    wandb_run_name: str = ""  # "": W&B picks one

    # ---- held-out validation (workdir/validation.jsonl), so overfitting and the real
    # acceptance of the drafter on text it never saw are visible during a run
    validate_every: int = 0  # steps between validations (and at the end); 0: never
    validation_data: str = ""  # "": the training data (its validation_shards; synthetic:
    #                            fresh draws of the same language); or a .jsonl / corpus
    validation_shards: str = ""  # "A:B": corpus shards A .. B-1, disjoint from data_shards
    validation_batches: int = 4  # batches of batch_size sequences, fixed anchors each time

    # ---- parallelism / memory
    mesh: tuple[int, int, int] = (-1, 1, 1)  # (data, fsdp, tensor); -1 takes the rest
    logits_chunk_size: int = 8192  # vocabulary chunk of the log-prob scans
    logits_row_chunk_size: int = 0  # 0: all rows at once
    param_dtype: str = "float32"  # drafter parameters (the target is loaded in the same)
    feature_cache: str = ""  # folder: compute the frozen target's taps once per record
    feature_cache_dtype: str = "float32"  # or "bfloat16" (half the disk, rounded taps)

    # ---- synthetic data (data = "synthetic"; drawn at verify_temperature)
    synthetic_num_phrases: int = 4
    synthetic_phrase_len: int = 3
    synthetic_logit_scale: float = 3.0

    def __post_init__(self):
        problems = _not_one_of(self, "loss", LOSSES)
        if not isinstance(self.drafter, DrafterSpec):
            raise ValueError(f"invalid TrainConfig {self.name!r}: drafter must be a "
                             f"DrafterSpec, got {type(self.drafter).__name__}")
        d = self.drafter
        if self.loss == "dflash" and d.num_categories != 1:
            problems.append(f"loss 'dflash' is the K = 1 loss; drafter.num_categories is "
                            f"{d.num_categories} (use 'nll' or 'nll+al')")
        problems += _not_one_of(self, "logp_source", LOGP_SOURCES)
        problems += _not_one_of(self, "nonfinite_policy", NONFINITE_POLICIES)
        if self.max_skipped_steps < 0:
            problems.append(f"max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        problems += _not_one_of(self, "param_dtype", PARAM_DTYPES)
        problems += _not_one_of(self, "feature_cache_dtype", PARAM_DTYPES)
        if self.data_shards < 0:
            problems.append(f"data_shards must be >= 0, got {self.data_shards}")
        for field in ("num_steps", "batch_size", "anchors_per_sequence", "grad_accum_steps",
                      "checkpoint_every", "keep_checkpoints", "log_every",
                      "logits_chunk_size"):
            if getattr(self, field) < 1:
                problems.append(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.seq_len < d.block_size + 1:
            problems.append(f"seq_len {self.seq_len} cannot hold a block of "
                            f"drafter.block_size {d.block_size} after a response anchor")
        if self.batch_size % self.grad_accum_steps:
            problems.append(f"batch_size {self.batch_size} is not divisible by "
                            f"grad_accum_steps {self.grad_accum_steps}")
        if not self.distill_weight >= 0:
            problems.append(f"distill_weight must be >= 0, got {self.distill_weight}")
        if self.drafter_init not in ("random", "target") and not (
                self.drafter_init.startswith("drafter:") and len(self.drafter_init) > 8):
            problems.append(f"drafter_init {self.drafter_init!r} is not one of "
                            "('random', 'target', 'drafter:SPEC')")
        for field in ("train_head_tokens", "train_head_sampled"):
            if getattr(self, field) < 0:
                problems.append(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.distill_topk < 1:
            problems.append(f"distill_topk must be >= 1, got {self.distill_topk}")
        if self.verify_temperature <= 0:
            problems.append(f"verify_temperature must be > 0, got {self.verify_temperature}")
        if self.tau_start < 0 or self.tau_end < 0:
            problems.append("tau_start and tau_end must be >= 0")
        if self.learning_rate <= 0:  # nan passes here: the non-finite step guard stops it
            problems.append(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_fraction < 1:
            problems.append(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.schedule_steps < 0 or self.schedule_offset < 0:
            problems.append("schedule_steps and schedule_offset must be >= 0, got "
                            f"{self.schedule_steps} and {self.schedule_offset}")
        elif self.schedule_offset and not self.schedule_steps:
            problems.append(f"schedule_offset={self.schedule_offset} needs schedule_steps "
                            "(the length of the schedule it is an offset into)")
        elif self.schedule_steps and self.schedule_offset + self.num_steps > self.schedule_steps:
            problems.append(f"this run's steps {self.schedule_offset} .. "
                            f"{self.schedule_offset + self.num_steps} end past the schedule's "
                            f"{self.schedule_steps} steps: raise schedule_steps")
        problems.extend(self._validation_problems())
        if len(self.mesh) != 3:
            problems.append(f"mesh must be (data, fsdp, tensor), got {self.mesh}")
        if problems:
            raise ValueError(f"invalid TrainConfig {self.name!r}: " + "; ".join(problems))

    def _validation_problems(self) -> list[str]:
        out = []
        if self.validate_every < 0:
            out.append(f"validate_every must be >= 0, got {self.validate_every}")
        if self.validation_batches < 1:
            out.append(f"validation_batches must be >= 1, got {self.validation_batches}")
        if self.validation_shards:
            try:
                first, stop = parse_shard_range(self.validation_shards)
            except ValueError as e:
                return out + [str(e)]
            same = self.validation_data in ("", self.data)
            if same and self.data == "synthetic":
                out.append("validation_shards selects shards of a corpus folder; synthetic "
                           "data validates on fresh draws without it")
            elif same and (self.data_shards == 0 or first < self.data_shards):
                train = (f"shards 0 .. {self.data_shards - 1}" if self.data_shards
                         else "every shard (data_shards = 0)")
                out.append(f"validation_shards {self.validation_shards} overlap the training "
                           f"data ({train} of {self.data}): held-out shards must come after "
                           "data_shards")
        elif (self.validate_every and self.validation_data in ("", self.data)
              and self.data != "synthetic"):
            out.append("validate_every needs held-out data: set validation_shards (A:B, "
                       "corpus shards after data_shards) or validation_data")
        return out

    def replace(self, **changes: Any) -> "TrainConfig":
        """A changed copy. The drafter's fields may be given by their flat names of before
        (block_size=4, num_categories=4, mask_token_id=-1 for a learned mask, ...: see
        config.LEGACY_DRAFTER_FIELDS) besides a whole `drafter=DrafterSpec(...)`."""
        flat = {k: changes.pop(k) for k in list(changes) if k in LEGACY_DRAFTER_FIELDS}
        if flat:
            spec = changes.get("drafter", self.drafter)
            changes["drafter"] = spec.replace(**{
                LEGACY_DRAFTER_FIELDS[k]: legacy_drafter_value(LEGACY_DRAFTER_FIELDS[k], v)
                for k, v in flat.items()})
        return dataclasses.replace(self, **changes)

    # ---- derived -------------------------------------------------------------------
    @property
    def uses_al(self) -> bool:
        return self.loss == "nll+al"

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup_fraction * self.num_steps))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """From `to_dict` / train_config.json: the drafter nested under "drafter", or (the
        files of runs from before DrafterSpec) in the flat fields drafter_layers,
        block_size, num_categories, target_layer_ids, mask_token_id, expander_width and
        drafter_intermediate_size with their placeholders (-1, 0, []): the same config."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - set(LEGACY_DRAFTER_FIELDS))
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}; known: {sorted(known)}")
        flat = sorted(set(d) & set(LEGACY_DRAFTER_FIELDS))
        if flat and "drafter" in d:
            raise ValueError(f"TrainConfig fields {flat} are the drafter's fields of before "
                             "TrainConfig.drafter; give them in 'drafter' only")
        hints = typing.get_type_hints(cls)
        kw = {k: _coerce(hints[k], v, k) for k, v in d.items() if k in known}
        if "drafter" in kw or flat:
            kw["drafter"] = kw.get("drafter", DrafterSpec()).replace(
                **dict(drafter_change(k, d[k]) for k in flat))
        return cls(**kw)

    def drafter_config(self, target: TargetConfig) -> DrafterConfig:
        """The DrafterConfig this run trains on `target` (named as the run)."""
        return self.drafter.for_target(target, name=self.name)


# ---- overrides ---------------------------------------------------------------------------

def _coerce(hint, value, key: str):
    """Turn a JSON value or a command-line string into the field's type."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]: None, JSON null, or `none` on a command line
        if value is None or (isinstance(value, str)
                             and value.strip().lower() in ("", "none", "null")):
            return None
        return _coerce(next(a for a in typing.get_args(hint) if a is not type(None)),
                       value, key)
    if hint is DrafterSpec:  # the nested "drafter" of to_dict / train_config.json
        if isinstance(value, DrafterSpec):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected the drafter's fields as a mapping "
                             f"{sorted(_DRAFTER_HINTS)}, got {value!r}")
        unknown = sorted(set(value) - set(_DRAFTER_HINTS))
        if unknown:
            raise ValueError(f"{key}: unknown drafter fields {unknown}; known: "
                             f"{sorted(_DRAFTER_HINTS)}")
        return DrafterSpec(**{k: _coerce(_DRAFTER_HINTS[k], v, f"drafter.{k}")
                              for k, v in value.items()})
    if origin is tuple:
        if isinstance(value, str):
            text = value.strip().strip("()[]")
            value = [v for v in (s.strip() for s in text.split(",")) if v]
        elem = typing.get_args(hint)[0]
        return tuple(_coerce(elem, v, key) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"override {key}={value!r}: expected a boolean (e.g. {key}=true)")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"override {key}={value!r}: expected an integer")
        try:
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() \
                else int(value)
        except (TypeError, ValueError):
            raise ValueError(f"override {key}={value!r}: expected an integer (e.g. {key}=8)"
                             ) from None
    if hint is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"override {key}={value!r}: expected a number (e.g. {key}=1.0)"
                             ) from None
        if not math.isfinite(number):
            raise ValueError(f"override {key}={value!r}: expected a finite number "
                             f"(e.g. {key}=1.0)")
        return number
    return str(value)


_DRAFTER_HINTS = typing.get_type_hints(DrafterSpec)
DRAFTER_PREFIX = "drafter."


def drafter_keys() -> list[str]:
    """The override keys of the drafter's fields: `drafter.FIELD`."""
    return [DRAFTER_PREFIX + k for k in _DRAFTER_HINTS]


def drafter_change(key: str, value: Any) -> Optional[tuple[str, Any]]:
    """(DrafterSpec field, typed value) for a key that names a drafter field, None for
    any other key. Keys: `drafter.FIELD` (`none` / JSON null: None), or a flat name of
    before (config.LEGACY_DRAFTER_FIELDS: drafter_layers, block_size, num_categories,
    target_layer_ids, mask_token_id, expander_width, drafter_intermediate_size) with its
    old meaning (mask_token_id=-1: learned mask, expander_width=-1: automatic,
    drafter_intermediate_size=0: the target's, empty target_layer_ids: DFlash's default).
    `value`: a command-line string or a JSON value."""
    if key.startswith(DRAFTER_PREFIX):
        field = key[len(DRAFTER_PREFIX):]
        if field not in _DRAFTER_HINTS:
            raise ValueError(f"override {key}={value!r}: the drafter has no field "
                             f"{field!r}; fields: {', '.join(drafter_keys())}")
        return field, _coerce(_DRAFTER_HINTS[field], value, key)
    field = LEGACY_DRAFTER_FIELDS.get(key)
    if field is None:
        return None
    return field, legacy_drafter_value(field, _coerce(_DRAFTER_HINTS[field], value, key))


def apply_overrides(config: TrainConfig, overrides: Iterable[str]) -> TrainConfig:
    """Apply `key=value` strings (command-line overrides) to `config`; every field of
    TrainConfig may be set, the drafter's as `drafter.FIELD` (drafter.num_categories=4,
    drafter.mask_token_id=none) or by their flat names of before (num_categories=4,
    mask_token_id=-1, ...; see drafter_change). Tuples take comma-separated values
    (mesh=1,2,1)."""
    hints = typing.get_type_hints(TrainConfig)
    changes: dict[str, Any] = {}
    drafter: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        change = drafter_change(key, value)
        if change is not None:
            drafter[change[0]] = change[1]
            continue
        if key not in hints or key == "drafter":
            fields = sorted([k for k in hints if k != "drafter"] + drafter_keys())
            raise ValueError(f"override {item!r}: TrainConfig has no field {key!r}; fields: "
                             f"{', '.join(fields)}")
        changes[key] = _coerce(hints[key], value, key)
    if drafter:
        changes["drafter"] = config.drafter.replace(**drafter)
    return config.replace(**changes) if changes else config


# ---- experiment registry -----------------------------------------------------------------

# Mask tokens of the recipes (DFlash fills a block's masked slots with the embedding of a
# token the text never contains; `drafter.mask_token_id=none` trains a learned mask
# embedding instead). A recipe run on another target must set its own
# (`drafter.mask_token_id=N`).
# SmolLM2 (vocabulary 49152): 16 = `<empty_output>`, one of the 17 special tokens of its
# tokenizer (0-16: <|endoftext|>, <|im_start|>, <|im_end|>, then the code / notebook
# markers of its pre-training data). Chat never uses it, and it occurs in neither shipped
# corpus (corpora/smollm2_t1, corpora/smollm2_heldout_t15; tests/test_mask_tokens.py
# checks), while <repo_name> (3) and <jupyter_start> (11) do, once each, in the T = 1
# corpus. The tiny-smollm2 test preset has the same vocabulary.
SMOLLM2_MASK_TOKEN_ID = 16
# Qwen3: DFlash's own choice (dflash_config.mask_token_id of z-lab's Qwen3-8B-DFlash-b16),
# a reserved added token past the text vocabulary.
QWEN3_MASK_TOKEN_ID = 151669
# tiny-llama on synthetic data: 0 is the batches' padding id, never a record's token.
TINY_MASK_TOKEN_ID = 0


def _recipe(base: dict[str, Any], drafter: DrafterSpec, k: int,
            kw: dict[str, Any]) -> TrainConfig:
    """The recipe `base` with `drafter` at K = `k` categories, then the fields `kw`."""
    base.update(kw)
    return TrainConfig(**base, drafter=drafter.replace(num_categories=k))


def _tiny(k: int = 1, **kw) -> TrainConfig:
    """Tiny target, synthetic multi-modal data at T_v = 1.5: seconds per run on a CPU."""
    drafter = DrafterSpec(num_layers=1, block_size=4, mask_token_id=TINY_MASK_TOKEN_ID)
    base = dict(target="tiny-llama", data="synthetic",
                gamma=4.0, verify_temperature=1.5, learning_rate=3e-3, warmup_fraction=0.05,
                weight_decay=0.0, num_steps=200, batch_size=8, anchors_per_sequence=8,
                seq_len=48, checkpoint_every=50, keep_checkpoints=2, mesh=(-1, 1, 1),
                logits_chunk_size=32)
    return _recipe(base, drafter, k, kw)


# SmolLM2's taps: five spread over its 30 layers (DFlash's spacing for five taps). They buy
# +11-13% held-out acceptance at equal CPU over the single middle tap (RESULTS.md 4.2).
SMOLLM2_TARGET_LAYER_IDS = (1, 7, 14, 20, 27)


# The sampled training head (train/sampled_head.py) of every SmolLM2 recipe: the same
# held-out acceptance per step for much cheaper steps. K = 1 DFlash loss: -4% to +4% from
# step 250 to 1,000 at 2.7x fewer CPU-s per step (RESULTS.md 4.6); K = 4 NLL + AL: within
# 0.002 of the full head at every point of a 300-step run, 4.8x fewer CPU-s per step
# (RESULTS.md 4.7). The other mixtures (K = 2 / 8, NLL only) take it unmeasured.
SMOLLM2_SAMPLED_HEAD = dict(train_head_tokens=4096, train_head_sampled=1024)


def _smollm2(k: int = 1, **kw) -> TrainConfig:
    """SmolLM2-135M-Instruct target (runs on this CPU): b = 8 (a 16-token verify costs
    ~3x a decode step here, docs/METHOD.md section 6), one drafter layer reading five
    target taps (a second layer does not pay within a CPU budget, RESULTS.md 4.2), the
    DFlash recipe otherwise. A step is compute-bound on the frozen target pass over B * T
    tokens (none with a feature cache) and the K-fold LM head over B * A * K * (b - 1)
    rows (launch/README.md has the numbers): size batch / seq_len / anchors to the
    machine. The corpus comes from the data issue: pass --data."""
    drafter = DrafterSpec(num_layers=1, block_size=8,
                          target_layer_ids=SMOLLM2_TARGET_LAYER_IDS,
                          mask_token_id=SMOLLM2_MASK_TOKEN_ID)
    kw = dict(SMOLLM2_SAMPLED_HEAD, **kw)
    base = dict(target="smollm2-135m-instruct", data="", gamma=4.0, verify_temperature=1.0,
                learning_rate=1e-3, warmup_fraction=0.04,
                num_steps=1000, batch_size=8, anchors_per_sequence=16, seq_len=256,
                checkpoint_every=100, keep_checkpoints=3, logits_chunk_size=8192)
    return _recipe(base, drafter, k, kw)


def _qwen3(k: int = 1, **kw) -> TrainConfig:
    """Qwen3-8B (a local HF folder, --target): DFlash's recipe, b = 16, 5 drafter layers,
    hundreds of anchors per sequence. Sized for a TPU pod / large GPU."""
    drafter = DrafterSpec(num_layers=5, block_size=16, mask_token_id=QWEN3_MASK_TOKEN_ID)
    base = dict(target="", data="", gamma=7.0, verify_temperature=1.0, learning_rate=6e-4,
                warmup_fraction=0.04,
                num_steps=60000, batch_size=64, anchors_per_sequence=256, seq_len=2048,
                checkpoint_every=1000, keep_checkpoints=3, mesh=(-1, 1, 1),
                logits_chunk_size=16384, logits_row_chunk_size=16384, param_dtype="bfloat16")
    return _recipe(base, drafter, k, kw)


# lam = 10 on the tiny runs (swept on the synthetic data; see launch/README.md); the
# SmolLM2 / Qwen3 runs inherit it as a starting point for the experiments issue (untuned
# there: their NLL sums over b - 1 = 7 / 15 positions, so a smaller lam may balance).
_AL = dict(loss="nll+al", lam=10.0, lam_warmup_fraction=0.05, lam_delay_fraction=0.0,
           tau_start=0.0, tau_end=0.0, tau_transition_fraction=0.5)

# The experiments every real target family gets (issue 7's reproduction, then the ablation
# over K: K = 1 is k1_al, K = 4 is dblast_k4_al). Z_T and the verification mode are
# evaluation settings of a trained drafter (NAME=DIR@zt=0.5, NAME=DIR@mode=mixture in
# `dblast eval`), see experiments/README.md.
_FAMILY_EXPERIMENTS: tuple[tuple[str, dict], ...] = (
    ("dflash_baseline", dict(loss="dflash")),
    ("k1_al", _AL),
    ("dblast_k4_nll", dict(loss="nll", k=4)),
    ("dblast_k4_al", dict(k=4, **_AL)),
    ("dblast_k2_al", dict(k=2, **_AL)),
    ("dblast_k8_al", dict(k=8, **_AL)),
)

EXPERIMENTS: dict[str, TrainConfig] = {
    # tests and demos
    "tiny_dflash": _tiny(name="tiny_dflash", loss="dflash"),
    "tiny_k1_al": _tiny(name="tiny_k1_al", **_AL),
    "tiny_dblast_k4_nll": _tiny(name="tiny_dblast_k4_nll", loss="nll", k=4),
    "tiny_dblast_k4_al": _tiny(name="tiny_dblast_k4_al", k=4, **_AL),
    # SmolLM2-135M (CPU scale) and Qwen3-8B (users with accelerators)
    **{f"{family}_{suffix}": recipe(name=f"{family}_{suffix}", **settings)
       for family, recipe in (("smollm2", _smollm2), ("qwen3", _qwen3))
       for suffix, settings in _FAMILY_EXPERIMENTS},
}


def get_experiment(name: str, overrides: Iterable[str] = ()) -> TrainConfig:
    """A registered experiment by name, with `key=value` overrides applied."""
    try:
        config = EXPERIMENTS[name]
    except KeyError:
        raise UnknownNameError(f"unknown experiment {name!r}; known: "
                               f"{', '.join(sorted(EXPERIMENTS))} (launch/train.py "
                               "--list_experiments describes them)") from None
    return apply_overrides(config, overrides)


def list_experiments() -> list[str]:
    return sorted(EXPERIMENTS)


def describe(config: TrainConfig, base: Optional[TrainConfig] = None) -> str:
    """Fields that differ from `base` (default: TrainConfig()) as 'key=value' lines (the
    drafter's as 'drafter.FIELD=value')."""
    base = base or TrainConfig()
    rows = []
    for f in dataclasses.fields(config):
        mine, theirs = getattr(config, f.name), getattr(base, f.name)
        if f.name == "drafter":
            rows += [f"{DRAFTER_PREFIX}{g.name}={getattr(mine, g.name)!r}"
                     for g in dataclasses.fields(mine)
                     if getattr(mine, g.name) != getattr(theirs, g.name)]
        elif mine != theirs:
            rows.append(f"{f.name}={mine!r}")
    return "\n".join(rows)
