"""Warm start: initialise a drafter from the frozen target's own layers.

A randomly initialised drafter spends its first hundreds of steps learning what the
target already knows: the scale of the final hidden state its LM head expects (SmolLM2's
final norm scales average 1.8, a fresh drafter's are 1.0) and how to read the tapped
residual stream. This copies, for drafter layer i, the target decoder layer just after
the deepest tap (layer max(target_layer_ids) + 1 + i, clipped to the last layer): its
attention and MLP kernels and its norms. `hidden_norm` takes that layer's input norm and
`fc` starts as the identity on the deepest tap (zero on the others), so the context keys
and values are at first what that target layer computes from the same residual stream.
The final norm takes the target's. q_norm / k_norm (Qwen3-style, absent in Llama
targets), the mask embedding and the DBlast heads keep their random initialisation.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.io.layer_keys import get_leaf, set_leaf

Params = dict[str, Any]

_COPIED = ("input_norm/scale", "post_attn_norm/scale", "attn/q_proj/kernel",
           "attn/k_proj/kernel", "attn/v_proj/kernel", "attn/o_proj/kernel",
           "mlp/gate_proj/kernel", "mlp/up_proj/kernel", "mlp/down_proj/kernel")


def source_layers(drafter_config: DrafterConfig, target_config: TargetConfig) -> list[int]:
    """The target layer each drafter layer starts from."""
    first = max(drafter_config.target_layer_ids) + 1
    last = target_config.num_layers - 1
    return [min(first + i, last) for i in range(drafter_config.num_layers)]


def warm_start_from_target(dparams: Params, tparams: Params, drafter_config: DrafterConfig,
                           target_config: TargetConfig) -> Params:
    """A copy of host drafter params `dparams` with the target's layers copied in (see the
    module doc). Shapes must agree (a DFlash drafter shares the target's layer shape)."""
    out = jax.tree.map(np.array, dparams)  # a host copy we may write into
    dtype = np.asarray(jax.tree.leaves(dparams)[0]).dtype
    layers = source_layers(drafter_config, target_config)

    def put(dst: str, value) -> None:
        want = np.shape(get_leaf(out, dst))
        value = np.asarray(jax.device_get(value), np.float32)
        if value.shape != want:
            raise ValueError(f"warm start: target tensor for {dst} is {value.shape}, the "
                             f"drafter's {want}; drafter_init='target' needs the target's "
                             "layer shape (hidden, heads, FFN)")
        set_leaf(out, dst, value.astype(dtype))

    for i, src in enumerate(layers):
        for name in _COPIED:
            put(f"layers/{i}/{name}", get_leaf(tparams, f"layers/{src}/{name}"))
    put("hidden_norm/scale", get_leaf(tparams, f"layers/{layers[0]}/input_norm/scale"))
    put("final_norm/scale", get_leaf(tparams, "final_norm/scale"))
    h = target_config.hidden_size
    ids = list(drafter_config.target_layer_ids)
    fc = np.zeros((len(ids) * h, h), np.float32)
    deepest = ids.index(max(ids))
    fc[deepest * h:(deepest + 1) * h] = np.eye(h, dtype=np.float32)
    put("fc/kernel", fc)
    return out
