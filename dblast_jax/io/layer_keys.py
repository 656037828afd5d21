"""The decoder-layer tensor names of every checkpoint format, and parameter-tree helpers.

One row per tensor of a decoder layer (`dblast_jax.models.layers.DecoderLayer`, the same
in the target and the drafter): our path inside `layers/{i}`, the torch key inside a
layer (Hugging Face `model.layers.{i}.`, DFlash `layers.{i}.`), the GGUF name inside
`blk.{i}.` (llama.cpp), and whether the 2-D kernel is transposed (torch and GGUF store
Linear weights (out, in); our kernels are (in, out)). The rows are in llama.cpp's
order, which is the order `save_gguf` writes a layer's tensors in.

Paths into a parameter tree are tuples (`("layers", 0, "attn", "q_proj", "kernel")`) or
"/"-joined strings (`"layers/0/attn/q_proj/kernel"`, digits read as list indices).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

__all__ = ["LayerKey", "DECODER_LAYER_KEYS", "path_keys", "get_leaf", "set_leaf"]


class LayerKey(NamedTuple):
    path: tuple[str, ...]  # ours, inside layers/{i}
    torch: str             # inside model.layers.{i}. (Hugging Face) / layers.{i}. (DFlash)
    gguf: str              # inside blk.{i}. (llama.cpp), without the ".weight"
    transposed: bool       # a 2-D kernel: torch / GGUF (out, in) <-> our (in, out)


DECODER_LAYER_KEYS: tuple[LayerKey, ...] = (
    LayerKey(("input_norm", "scale"), "input_layernorm.weight", "attn_norm", False),
    LayerKey(("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", "attn_q", True),
    LayerKey(("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", "attn_k", True),
    LayerKey(("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", "attn_v", True),
    LayerKey(("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", "attn_output", True),
    LayerKey(("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "attn_q_norm", False),
    LayerKey(("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "attn_k_norm", False),
    LayerKey(("post_attn_norm", "scale"), "post_attention_layernorm.weight", "ffn_norm", False),
    LayerKey(("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", "ffn_gate", True),
    LayerKey(("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", "ffn_up", True),
    LayerKey(("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", "ffn_down", True),
)

TreePath = Union[str, tuple]


def path_keys(path: TreePath) -> tuple:
    """A path as a tuple of keys: "a/0/b" -> ("a", 0, "b"); a tuple is kept."""
    if isinstance(path, str):
        return tuple(int(p) if p.isdigit() else p for p in path.split("/"))
    return tuple(path)


def _path_text(path: TreePath) -> str:
    return path if isinstance(path, str) else "/".join(map(str, path))


def get_leaf(tree: Any, path: TreePath) -> Any:
    """The entry of nested dicts (or lists) at `path`. An int key also finds the same
    number as a string (trees restored from JSON-keyed checkpoints). KeyError
    ("params lack a/b/c") when any part is missing."""
    node = tree
    for key in path_keys(path):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            try:
                node = node[str(key)]
            except (KeyError, IndexError, TypeError):
                raise KeyError(f"params lack {_path_text(path)}") from None
    return node


def set_leaf(tree: dict, path: TreePath, value: Any) -> None:
    """Put `value` at `path`, creating the dicts on the way (an int key that is absent
    but stored as a string follows the string, as `get_leaf` does)."""
    *parents, last = path_keys(path)
    for key in parents:
        if key not in tree and str(key) in tree:
            key = str(key)
        tree = tree.setdefault(key, {})
    tree[last] = value
