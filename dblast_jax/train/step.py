"""The train step: state, optimizer, gradients + update, and its jit / compile caches."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax import lax
from jax.sharding import Mesh

from dblast_jax import sharding as sharding_lib
from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.dtypes import dtype_from_name
from dblast_jax.models import drafter as drafter_lib
from dblast_jax.models import target as target_lib
from dblast_jax.train.config import TrainConfig
from dblast_jax.train.objective import loss_terms
from dblast_jax.train.sampled_head import HashableIds
from dblast_jax.train import tap_scaling

Array = jax.Array
Params = dict[str, Any]

__all__ = ["TrainState", "COUNT_METRICS", "FINITE_KEY", "lr_schedule", "make_optimizer",
           "make_train_step", "compiled_train_step", "compiled_eval_step", "HashableShardings",
           "eval_config", "step_cache_key", "step_memory_analysis"]

COUNT_METRICS = ("valid_anchors", "tokens", "label_tokens")
FINITE_KEY = "finite_step"  # per-step flag of the train step; not a logged metric


@struct.dataclass
class TrainState:
    step: Array  # int32 []
    params: Params  # drafter parameters
    opt_state: Any
    rng: Array  # uint32 [2]; the step's randomness is fold_in(rng, step)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "params": self.params, "opt_state": self.opt_state,
                "rng": self.rng}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainState":
        return cls(step=d["step"], params=d["params"], opt_state=d["opt_state"], rng=d["rng"])


# ---- optimiser ------------------------------------------------------------------------------

def lr_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup 0 -> lr over warmup_fraction of the run, cosine to lr * end_lr_fraction.

    With schedule_steps > 0 the cosine spans a chain of runs: this run's step t sits at
    step schedule_offset + t of one cosine of schedule_steps steps, and its warmup ramps to
    that cosine's rate, so a chain of legs anneals once instead of restarting at the peak.
    """
    lr, warm = config.learning_rate, config.warmup_steps
    if config.schedule_steps > 0:
        long_cosine = optax.cosine_decay_schedule(lr, config.schedule_steps,
                                                  alpha=config.end_lr_fraction)
        offset = config.schedule_offset

        def chained(step):
            ramp = jnp.minimum(1.0, step / warm) if warm > 0 else 1.0  # as optax's warmup
            return ramp * long_cosine(offset + step)

        return chained
    decay = max(config.num_steps - warm, 1)
    cosine = optax.cosine_decay_schedule(lr, decay, alpha=config.end_lr_fraction)
    if warm <= 0:
        return cosine
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), cosine], [warm])


def _decay_mask(params: Params) -> Params:
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(config: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping then AdamW (weight decay on matrices only); with
    tap_rms_scaling, fc's rows' Adam steps are scaled by the optimizer state's row scale."""
    schedule = lr_schedule(config)
    parts = []
    if config.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(config.grad_clip))
    if config.tap_rms_scaling:  # fc's rows preconditioned by the taps' RMS (tap_scaling.py)
        parts.append(tap_scaling.adamw_with_fc_row_scale(
            schedule, b1=config.adam_b1, b2=config.adam_b2,
            weight_decay=config.weight_decay, mask=_decay_mask))
    else:
        parts.append(optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2,
                                 weight_decay=config.weight_decay, mask=_decay_mask))
    return optax.chain(*parts), schedule


# ---- the step ---------------------------------------------------------------------------------

def _split_micro(batch: Mapping[str, Array], n: int) -> dict[str, Array]:
    """[B, ...] -> [n, B / n, ...] taking rows m, m + n, m + 2n, .. for micro-batch m, so a
    data-sharded batch stays sharded (each device's rows split evenly)."""
    def one(x):
        return jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1)
    return {k: one(v) for k, v in batch.items()}


def make_train_step(config: TrainConfig, drafter_config: DrafterConfig,
                    target_config: TargetConfig, logp_mode: Optional[str],
                    head_ids: Optional[HashableIds] = None
                    ) -> Callable[[TrainState, Params, Mapping[str, Array]],
                                  tuple[TrainState, dict[str, Array]]]:
    """The pure (un-jitted) step: (state, tparams, batch) -> (state, metrics). head_ids:
    the sampled training head's frequent tokens (config.train_head_tokens > 0)."""
    tx, schedule = make_optimizer(config)
    n_micro = config.grad_accum_steps
    fn = functools.partial(loss_terms, config=config, drafter_config=drafter_config,
                           target_config=target_config, logp_mode=logp_mode,
                           head_ids=None if head_ids is None else head_ids.array())
    grad_fn = jax.value_and_grad(fn, has_aux=True)

    def step_fn(state: TrainState, tparams: Params, batch: Mapping[str, Array]):
        step_rng = jax.random.fold_in(state.rng, state.step)
        if n_micro == 1:
            (_, metrics), grads = grad_fn(state.params, tparams, batch, step_rng, state.step)
        else:
            micro = _split_micro(batch, n_micro)

            def body(acc, xs):
                mb, i = xs
                (_, m), g = grad_fn(state.params, tparams, mb, jax.random.fold_in(step_rng, i),
                                    state.step)
                return jax.tree.map(jnp.add, acc, g), m

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, ms = lax.scan(body, zeros, (micro, jnp.arange(n_micro)))
            grads = jax.tree.map(lambda g: g / n_micro, grads)
            metrics = {k: (jnp.sum(v, axis=0) if k in COUNT_METRICS else jnp.mean(v, axis=0))
                       for k, v in ms.items()}
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics)
        # A non-finite loss, gradient or update is never applied: the state keeps its
        # last finite parameters and optimizer moments (the host decides, per
        # `nonfinite_policy`, whether the run stops or skips the step).
        finite = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
                  & jnp.isfinite(optax.tree.norm(updates)))
        keep = lambda new_leaf, old_leaf: jnp.where(finite, new_leaf, old_leaf)
        params = jax.tree.map(keep, params, state.params)
        opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        metrics["grad_norm"] = grad_norm
        metrics[FINITE_KEY] = finite
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng)
        return new, metrics

    return step_fn


# ---- jit and compile caches -----------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def compiled_train_step(config: TrainConfig, drafter_config: DrafterConfig,
                        target_config: TargetConfig, logp_mode: Optional[str], mesh: Mesh,
                        shardings: "HashableShardings",
                        head_ids: Optional[HashableIds] = None):
    """jit(step) with explicit in/out shardings (state, target params, batch); cached so
    repeated runs in one process (resume, tests) reuse the compiled executable."""
    step_fn = make_train_step(config, drafter_config, target_config, logp_mode, head_ids)
    state_sh, tparams_sh, batch_sh = shardings.value
    return jax.jit(step_fn, in_shardings=(state_sh, tparams_sh, batch_sh),
                   out_shardings=(state_sh, sharding_lib.replicated(mesh)),
                   donate_argnums=(0,))


@functools.lru_cache(maxsize=32)
def compiled_eval_step(config: TrainConfig, drafter_config: DrafterConfig,
                       target_config: TargetConfig, logp_mode: Optional[str], mesh: Mesh):
    """jit of `loss_terms`' metrics, no gradient: (params, tparams, batch, rng, step) ->
    metrics (replicated); cached like `compiled_train_step` (training's validation and
    `validation.validate_drafters` share it)."""
    fn = functools.partial(loss_terms, config=config, drafter_config=drafter_config,
                           target_config=target_config, logp_mode=logp_mode)
    return jax.jit(lambda p, t, b, r, s: fn(p, t, b, r, s)[1],
                   out_shardings=sharding_lib.replicated(mesh))


class HashableShardings:
    """A pytree of shardings as a cache key (NamedShardings hash; dicts do not)."""

    def __init__(self, value):
        self.value = value
        leaves, treedef = jax.tree.flatten(value)
        self._key = (treedef, tuple(leaves))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, HashableShardings) and self._key == other._key


def eval_config(config: TrainConfig) -> TrainConfig:
    """The config a held-out score runs under: training-only approximations (the sampled
    training head) off, so the score is the drafter's full-softmax acceptance."""
    return config.replace(train_head_tokens=0)


def step_cache_key(config: TrainConfig) -> TrainConfig:
    """Fields that do not change the step function are normalised away."""
    return config.replace(name="", data="", target="", checkpoint_every=1, keep_checkpoints=1,
                          log_every=1, export=False, seed=0, validate_every=0,
                          validation_data="", validation_shards="", validation_batches=1,
                          feature_cache="", feature_cache_dtype="float32",
                          nonfinite_policy="error", max_skipped_steps=0, tensorboard=True,
                          wandb_project="", wandb_run_name="")


# ---- measurement ----------------------------------------------------------------------------

def step_memory_analysis(config: TrainConfig, target_config: TargetConfig,
                         drafter_config: Optional[DrafterConfig] = None) -> dict[str, int]:
    """Compile one single-device train step for abstract inputs (nothing is allocated or
    run) and return XLA's memory analysis in bytes: temp (activations and scratch: what
    vocabulary chunking bounds), argument, output, and their sum. Compare
    logits_chunk_size = vocab (one chunk: the [rows, V] logits exist, as naive code
    would hold them) with a small chunk to see the saving."""
    dcfg = drafter_config or config.drafter_config(target_config)
    dtype = dtype_from_name(config.param_dtype)
    mode = "target" if (config.uses_al or config.track_al) else None
    step_fn = make_train_step(config, dcfg, target_config, mode)
    tx, _ = make_optimizer(config)
    dparams = drafter_lib.abstract_drafter_params(dcfg, target_config, dtype)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=dparams,
                       opt_state=jax.eval_shape(tx.init, dparams),
                       rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    tparams = target_lib.abstract_params(target_config, dtype)
    b, t = config.batch_size, config.seq_len
    batch = {"tokens": jax.ShapeDtypeStruct((b, t), jnp.int32),
             "loss_mask": jax.ShapeDtypeStruct((b, t), jnp.bool_),
             "lengths": jax.ShapeDtypeStruct((b,), jnp.int32)}
    compiled = jax.jit(step_fn).lower(state, tparams, batch).compile()
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output")}
    out["total"] = out["temp"] + out["argument"] + out["output"]
    return out
