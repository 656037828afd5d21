"""Plain parameter dicts <-> nnx modules, shared by `target` (TargetLM) and `drafter` (Drafter).

Parameters travel as plain nested dicts (int keys for list entries); the pure functions
rebuild an nnx module around them on each call. `module_from_params` does that from a
cached abstract module (built once per module class, config and dtype with
`nnx.eval_shape`, so nothing is allocated), and `plain_dict` turns nnx pure dicts back
into plain dicts. A module class takes `(config, rngs, dtype)`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Params = dict[str, Any]


@functools.lru_cache(maxsize=None)
def graph_and_abstract_state(module_cls: type, config: Any, dtype_name: str):
    """(graphdef, abstract state) of `module_cls(config, rngs, dtype)`, without allocating."""
    abstract = nnx.eval_shape(lambda: module_cls(config, nnx.Rngs(0), jnp.dtype(dtype_name)))
    return nnx.split(abstract)


def dtype_of(params: Params):
    """The parameter dtype (that of the final norm's scale)."""
    return jnp.asarray(params["final_norm"]["scale"]).dtype


def module_from_params(module_cls: type, params: Params, config: Any):
    """A `module_cls` module holding `params` (built from the cached abstract state)."""
    graphdef, state = graph_and_abstract_state(module_cls, config,
                                               jnp.dtype(dtype_of(params)).name)
    state = jax.tree.map(lambda x: x, state)  # fresh copy of the abstract state
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def abstract_params(module_cls: type, config: Any, dtype) -> Params:
    """Parameter shapes/dtypes (`jax.ShapeDtypeStruct` leaves) without allocating."""
    _, state = graph_and_abstract_state(module_cls, config, jnp.dtype(dtype).name)
    return plain_dict(nnx.to_pure_dict(state))


def plain_dict(tree):
    """Pure dicts from nnx use int keys for list entries; keep them, but as plain dicts."""
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: plain_dict(v) for k, v in tree.items()}
    return tree
