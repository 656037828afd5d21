"""Warm start: initialise a drafter from the frozen target's own layers or a trained drafter.

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

`drafter_init="drafter:SPEC"` starts instead from a trained drafter (a training workdir,
an export folder or `pretrained:NAME`) of the same trunk: every tensor they share is
copied, and what only the new drafter has (the DBlast category expander and prior head
when going from K = 1 to K > 1) keeps its initialisation. With the expander's small
initial offsets and a zero prior, a K = 4 drafter started from a K = 1 one drafts like it
at step 0, so training the mixture costs only the steps that split the branches rather
than a whole run at K times the LM-head cost per step.

A source with fewer layers than the run grows in depth: its layers are copied into the
bottom of the stack and each new layer on top starts with zero output projections
(attn/o_proj and mlp/down_proj), so that it adds nothing to the residual stream and the
deeper drafter drafts exactly like the source at step 0. The zero projections receive
gradients at once, the rest of the new layer (random as usual) as soon as they move; a
depth run thus continues a trained trunk instead of repeating its steps.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np

from dblast_jax import pretrained
from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.io.dflash import load_dflash
from dblast_jax.io.layer_keys import get_leaf, set_leaf

Params = dict[str, Any]

DRAFTER_PREFIX = "drafter:"
_WHO = f"drafter_init={DRAFTER_PREFIX}SPEC"  # how errors name the option
# DrafterConfig fields that only the DBlast heads depend on: the source may differ there
# (block_attention too: a causal block has the trunk's parameters, attending differently)
_HEAD_FIELDS = ("num_categories", "expander_width", "correction", "correction_rank",
                "block_attention", "name")
# the tensors of a new top layer that are zeroed when a run grows a source in depth: with
# them zero the layer is the identity on the residual stream
_GROWN_ZEROED = ("attn/o_proj/kernel", "mlp/down_proj/kernel")
# parameter subtrees that a K > 1 drafter (or one with a correction head) has and a K = 1
# drafter lacks: a run may add them to the trunk it starts from
_HEAD_PARAMS = ("expander", "prior", "correction")

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


def _flat(tree: Params, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, path + "/"))
        else:
            out[path] = value
    return out


def load_source_drafter(spec: str, target_config: TargetConfig, target_name: str,
                        log: Callable[[str], None] = print) -> tuple[DrafterConfig, Params]:
    """(config, host params) of the drafter named by `spec`: a training workdir (its
    latest checkpoint), an export folder, or `pretrained:NAME`."""
    from dblast_jax.train import restore  # cycle: restore imports the trainer, which imports this
    if pretrained.is_pretrained_spec(spec):
        folder = pretrained.pretrained_folder(spec[len(pretrained.PREFIX):], target=target_name)
        return load_dflash(str(folder), target_config)
    if restore.is_training_workdir(spec):
        restored = restore.restore_drafter(spec, log=log)
        return restored.drafter_config, restored.params_host()
    if not os.path.isdir(spec):
        raise ValueError(f"drafter_init={DRAFTER_PREFIX}{spec}: no such training workdir, "
                         "export folder or pretrained:NAME")
    return load_dflash(spec, target_config)


def warm_start_from_drafter(dparams: Params, drafter_config: DrafterConfig,
                            source_params: Params, source_config: DrafterConfig) -> Params:
    """A copy of host drafter params `dparams` with every tensor of `source_params` (a
    trained drafter of the same trunk, or a shallower one: it grows, see the module doc)
    copied in. Raises ValueError naming the difference when the source is not the same
    trunk (taps, block size, mask, layer shape, heads), is deeper than the run, or has
    heads the new drafter lacks (K > 1 into K = 1)."""
    mine = {f.name: getattr(drafter_config, f.name) for f in dataclasses.fields(drafter_config)}
    theirs = {f.name: getattr(source_config, f.name) for f in dataclasses.fields(source_config)}
    grows = source_config.num_layers < drafter_config.num_layers
    differ = [f"{k}: {theirs[k]!r} vs {mine[k]!r}" for k in mine
              if k not in _HEAD_FIELDS and not (k == "num_layers" and grows)
              and _as_tuple(theirs[k]) != _as_tuple(mine[k])]
    if differ:
        raise ValueError(f"{_WHO}: the source drafter is not the same "
                         "trunk as this run's (source vs run: " + "; ".join(differ) + ")")
    if source_config.num_categories > 1 and (
            source_config.num_categories != drafter_config.num_categories
            or source_config.expander_width != drafter_config.expander_width):
        raise ValueError(f"{_WHO}: the source has K = "
                         f"{source_config.num_categories} categories (expander width "
                         f"{source_config.expander_width}), this run K = "
                         f"{drafter_config.num_categories} ({drafter_config.expander_width}); "
                         "only K = 1 -> any K or the same K are supported")
    out = jax.tree.map(np.array, dparams)
    flat_out, flat_src = _flat(out), _flat(jax.device_get(source_params))
    new_layers = range(source_config.num_layers, drafter_config.num_layers)
    grown = {f"layers/{i}/" for i in new_layers}
    missing = sorted(k for k in flat_out if k not in flat_src
                     and k.split("/")[0] not in _HEAD_PARAMS
                     and not any(k.startswith(g) for g in grown))
    extra = sorted(k for k in flat_src if k not in flat_out)
    if missing or extra:
        raise ValueError(f"{_WHO}: parameters missing in the source "
                         f"{missing[:6]}, unknown to this run {extra[:6]}")
    for key, value in flat_src.items():
        want = flat_out[key]
        value = np.asarray(value, np.float32)
        if value.shape != want.shape:
            raise ValueError(f"{_WHO}: {key} is {value.shape} in the "
                             f"source, {want.shape} in this run")
        set_leaf(out, key, value.astype(want.dtype))
    for i in new_layers:
        for name in _GROWN_ZEROED:
            key = f"layers/{i}/{name}"
            set_leaf(out, key, np.zeros_like(flat_out[key]))
    return out


def _as_tuple(value: Any) -> Any:
    """JSON-loaded configs hold lists where built ones hold tuples (target_layer_ids)."""
    return tuple(value) if isinstance(value, list) else value
