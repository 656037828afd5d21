"""Device meshes and partition rules.

One mesh with three named axes serves every job:
  * `data`   — batch rows (and, in training, independent replicas of the step),
  * `fsdp`   — parameters split along their model (hidden) dimension and gathered on use,
  * `tensor` — heads / FFN columns / vocabulary split (Megatron-style).
Rules are regular expressions over '/'-joined parameter paths; the first match wins.
A mesh axis is dropped from a spec wherever the dimension is not divisible by the axis
size (SmolLM2's 3 KV heads on a 2-way tensor axis, say), so one rule table fits every
mesh from 1 CPU to a pod.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")

# Linear kernels are stored (in, out).
TARGET_RULES: tuple[tuple[str, P], ...] = (
    (r"embed/embedding$", P("tensor", "fsdp")),  # [V, H]
    (r"attn/(q_proj|k_proj|v_proj)/kernel$", P("fsdp", "tensor")),  # [H, N*D]
    (r"attn/o_proj/kernel$", P("tensor", "fsdp")),  # [N*D, H]
    (r"mlp/(gate_proj|up_proj)/kernel$", P("fsdp", "tensor")),  # [H, F]
    (r"mlp/down_proj/kernel$", P("tensor", "fsdp")),  # [F, H]
    (r"lm_head/kernel$", P("fsdp", "tensor")),  # [H, V]
    (r"(norm|scale)", P()),  # every RMSNorm scale: tiny, replicated
)

# Drafter: the same Megatron pattern; the per-category expander kernels [K, H, E] / [K, E, H]
# keep the category axis whole.
DRAFTER_RULES: tuple[tuple[str, P], ...] = (
    (r"^fc/kernel$", P("fsdp", "tensor")),  # [n_taps*H, H]
    (r"^layers/\d+/attn/(q_proj|k_proj|v_proj)/kernel$", P("fsdp", "tensor")),
    (r"^layers/\d+/attn/o_proj/kernel$", P("tensor", "fsdp")),
    (r"^layers/\d+/mlp/(gate_proj|up_proj)/kernel$", P("fsdp", "tensor")),
    (r"^layers/\d+/mlp/down_proj/kernel$", P("tensor", "fsdp")),
    (r"^expander/in_kernel$", P(None, "fsdp", "tensor")),
    (r"^expander/out_kernel$", P(None, "tensor", "fsdp")),
    (r"^prior/kernel$", P("fsdp", None)),
    (r"^correction/(prev_kernel|ctx_kernel)$", P("fsdp", None)),  # [H, r]
    (r"^correction/out_kernel$", P(None, "fsdp")),  # [r, H]
    (r"(^|/)scale$|^mask_embedding$|^prior/bias$", P()),
    # a decode-time draft vocabulary (dblast_jax/draft_vocab.py): the LM head's rows, laid
    # out like the target's embedding, and their ids
    (r"^draft_vocab/head$", P("tensor", "fsdp")),  # [N, H]
    (r"^draft_vocab/ids$", P()),
)

CACHE_KV_SPEC = P("data", None, "tensor", None)  # [B, S, Nkv, D]
BATCH_SPEC = P("data")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh; -1 in one axis takes the remaining devices."""
    devices = list(devices) if devices is not None else jax.devices()
    shape = [data, fsdp, tensor]
    if shape.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        shape[shape.index(-1)] = len(devices) // known
    need = int(np.prod(shape))
    if need > len(devices) or need < 1:
        raise ValueError(f"mesh {dict(zip(AXES, shape))} needs {need} devices; "
                         f"{len(devices)} available")
    # Auto axes: shardings propagate through the model's einsums (Explicit axes would
    # demand matching shardings on every contraction).
    return Mesh(np.asarray(devices[:need]).reshape(shape), AXES,
                axis_types=(AxisType.Auto,) * len(AXES))


def _path_str(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drop mesh axes from `spec` where the dimension is not divisible by their size."""
    fitted = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axis is None:
            fitted.append(None)
            continue
        names = axis if isinstance(axis, tuple) else (axis,)
        size = int(np.prod([mesh.shape[n] for n in names]))
        fitted.append(axis if size > 1 and dim % size == 0 else None)
    while fitted and fitted[-1] is None:
        fitted.pop()
    return P(*fitted)


def partition_specs(tree: Any, mesh: Mesh, rules: Iterable[tuple[str, P]] = TARGET_RULES) -> Any:
    """PartitionSpec pytree for `tree` (arrays or ShapeDtypeStructs) from regex rules."""
    rules = tuple(rules)

    def spec_for(path, leaf):
        name = _path_str(path)
        for pattern, spec in rules:
            if re.search(pattern, name):
                return fit_spec(spec, leaf.shape, mesh)
        raise ValueError(f"no partition rule for parameter {name} {tuple(leaf.shape)}")

    return jax.tree_util.tree_map_with_path(spec_for, tree)


def named_shardings(tree: Any, mesh: Mesh, rules: Iterable[tuple[str, P]] = TARGET_RULES) -> Any:
    specs = partition_specs(tree, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: Any, mesh: Mesh, rules: Iterable[tuple[str, P]] = TARGET_RULES) -> Any:
    """Place a parameter pytree on `mesh` according to `rules`."""
    return jax.device_put(params, named_shardings(params, mesh, rules))


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """NamedShardings for a KVCache-like pytree: [B, S, Nkv, D] buffers and [B] lengths."""
    def one(leaf):
        spec = CACHE_KV_SPEC if leaf.ndim == 4 else BATCH_SPEC
        return NamedSharding(mesh, fit_spec(spec, leaf.shape, mesh))
    return jax.tree.map(one, cache)


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Rows on the data axis (replicated if the batch does not divide)."""
    return NamedSharding(mesh, fit_spec(BATCH_SPEC, shape, mesh))


# ---- training: replicated values, batch rows, optimizer state, host values ------------------

def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())


def data_fsdp_batch_spec(shape: tuple[int, ...], mesh: Mesh) -> P:
    """Rows over (data, fsdp) when they divide, else data, else replicated: the training
    batch's layout (`batch_sharding` splits rows on data only, and only where data > 1)."""
    for axes in (("data", "fsdp"), ("data",)):
        size = int(np.prod([mesh.shape[a] for a in axes]))
        if shape[0] % size == 0:
            return P(axes if len(axes) > 1 else axes[0])
    return P()


def opt_state_shardings(abstract_opt: Any, param_specs: Any, mesh: Mesh) -> Any:
    """Optimizer leaves that mirror a parameter (Adam's mu / nu) take its spec; scalars
    (counts) and anything else are replicated."""
    flat = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(
            param_specs, is_leaf=lambda x: isinstance(x, P))[0]:
        flat[tuple(getattr(k, "key", k) for k in path)] = spec

    def one(path, leaf):
        keys = []
        for k in reversed(path):
            if isinstance(k, jax.tree_util.DictKey):
                keys.append(k.key)
            else:
                break
        spec = flat.get(tuple(reversed(keys)))
        if spec is not None and len(spec) <= len(leaf.shape):
            return NamedSharding(mesh, spec)
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(one, abstract_opt)


def host_value_to_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """Host value (the same on every process) -> global array with `sharding`."""
    arr = np.asarray(x)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def process_row_range(sharding: NamedSharding, global_shape: tuple[int, ...]
                      ) -> tuple[int, int]:
    """The contiguous row range of a batch that this process's devices hold."""
    idx = sharding.addressable_devices_indices_map(global_shape)
    starts, stops = [], []
    for sl in idx.values():
        s = sl[0] if sl else slice(None)
        starts.append(0 if s.start is None else s.start)
        stops.append(global_shape[0] if s.stop is None else s.stop)
    lo, hi = min(starts), max(stops)
    covered = set()
    for a, b in zip(starts, stops):
        covered.update(range(a, b))
    if covered != set(range(lo, hi)):
        raise ValueError(f"this process's batch rows are not contiguous ({sorted(covered)}); "
                         "order the mesh devices by process")
    return lo, hi
