"""Per-channel tap scaling of the drafter's `fc`, as an optimizer preconditioner.

The target's hidden states are badly scaled for a linear map: SmolLM2's middle and late
layers carry massive activations (a few channels at ~25,000 against an RMS of ~110) and
the RMS of ordinary channels differs by orders of magnitude between layers 1 and 27.
Training `fc` on raw taps lets the loud channels dominate both the initial features and,
under Adam (whose step is the same size for every weight), every update. Training on
taps divided by their per-channel RMS s fixes that, but an extra normalisation would
change the DFlash layout (`fc` then `hidden_norm`). Here the same thing is done without
changing the model: with W = diag(1 / s) W', Adam on W' is Adam on W whose updates of row
j are multiplied by 1 / s_j (Adam is invariant to the gradient's scale), and W' ~ normal
(0.02) is W ~ normal(0.02) / s. So rows of `fc` start at their initialisation / s_j and
learn at lr / s_j, and the trained `fc` is an ordinary DFlash `fc` (nothing to fold at
export). Exact up to Adam's eps and the global-norm clipping, which see the raw gradient.

s is measured once, on the taps of the first records of the training data, and kept in
the optimizer state, so a resumed run (and its checkpoint) carries the same scale.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

Array = jax.Array

# channels quieter than this fraction of the median RMS are treated as that quiet (a
# channel that is ~0 on the measured records must not get an unbounded learning rate)
RMS_FLOOR_FRACTION = 1e-2


def channel_rms(taps: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """taps [B, T, n_taps, H], valid [B, T] bool -> RMS of every input channel of `fc`
    over the valid positions, [n_taps * H] float64 (fc's input order: tap-major)."""
    taps = np.asarray(taps, np.float64)
    valid = np.asarray(valid, bool)
    if taps.ndim != 4 or valid.shape != taps.shape[:2]:
        raise ValueError(f"channel_rms: taps must be [B, T, n_taps, H] and valid [B, T]; got "
                         f"{taps.shape} and {valid.shape}")
    if not valid.any():
        raise ValueError("channel_rms: no valid position to measure the taps on")
    x = taps[valid]  # [N, n_taps, H]
    return np.sqrt(np.mean(np.square(x), axis=0)).reshape(-1)


def fc_row_scale(rms: np.ndarray, floor_fraction: float = RMS_FLOOR_FRACTION) -> np.ndarray:
    """[n_taps * H] channel RMS -> fc's row multipliers 1 / max(rms, floor * median),
    [n_taps * H, 1] float32."""
    rms = np.asarray(rms, np.float64).reshape(-1)
    if not np.all(np.isfinite(rms)):
        raise ValueError("fc_row_scale: the taps' RMS is not finite")
    floor = max(float(np.median(rms)) * floor_fraction, 1e-12)
    return (1.0 / np.maximum(rms, floor)).astype(np.float32)[:, None]


class FcRowScaleState(NamedTuple):
    row_scale: Array  # [n_taps * H, 1] float32: the multiplier of fc's updates per row


def scale_fc_rows() -> optax.GradientTransformation:
    """Multiply the update of fc/kernel's rows by the state's `row_scale` (ones at init:
    the identity until the trainer sets the measured scale with `with_row_scale`)."""

    def init(params):
        rows = params["fc"]["kernel"].shape[0]
        return FcRowScaleState(row_scale=jnp.ones((rows, 1), jnp.float32))

    def update(updates, state, params=None):
        del params
        kernel = updates["fc"]["kernel"]
        scaled = (kernel.astype(jnp.float32) * state.row_scale).astype(kernel.dtype)
        return {**updates, "fc": {**updates["fc"], "kernel": scaled}}, state

    return optax.GradientTransformation(init, update)


def adamw_with_fc_row_scale(learning_rate: Any, *, b1: float, b2: float,
                            weight_decay: float, mask: Any) -> optax.GradientTransformation:
    """optax.adamw with `scale_fc_rows` between the Adam direction and the (unscaled)
    decoupled weight decay: equal to optax.adamw while the row scale is ones."""
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2), scale_fc_rows(),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))


def _is_state(x: Any) -> bool:
    return isinstance(x, FcRowScaleState)


def with_row_scale(opt_state: Any, row_scale: Any) -> Any:
    """opt_state with every FcRowScaleState's row_scale replaced by `row_scale`."""
    found = []

    def one(s):
        if _is_state(s):
            found.append(s)
            if tuple(s.row_scale.shape) != tuple(np.shape(row_scale)):
                raise ValueError(f"row scale {np.shape(row_scale)} does not fit fc's "
                                 f"{tuple(s.row_scale.shape)}")
            return s._replace(row_scale=row_scale)
        return s

    out = jax.tree.map(one, opt_state, is_leaf=_is_state)
    if not found:
        raise ValueError("this optimizer has no fc row scale (tap_rms_scaling is off)")
    return out


def row_scale_of(opt_state: Any) -> Optional[Array]:
    """The fc row scale held in opt_state, or None when the optimizer has none."""
    states = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
    return states[0].row_scale if states else None
