"""Bad Hugging Face checkpoints fail with a `CheckpointError` that names the problem,
and config.json variants (legacy / transformers-5 layouts) parse correctly. No torch."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dblast_jax.config import RopeScaling, TargetConfig
from dblast_jax.io import hf
from dblast_jax.io.hf import CheckpointError
from dblast_jax.models import target

QWEN = TargetConfig.tiny_qwen3(num_layers=2)  # untied head
LLAMA = TargetConfig.tiny_llama(num_layers=2)  # tied head


def _random_params(config, seed=0):
    rng = np.random.RandomState(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype),
                        target.abstract_params(config))


def _save(tmp_path, config=QWEN, name="ckpt", **kw):
    return hf.save_hf(_random_params(config), config, tmp_path / name, **kw)


def _edit_weights(folder, fn):
    """Rewrite model.safetensors through fn(dict) -> dict."""
    path = folder / "model.safetensors"
    save_file(fn(load_file(path)), path, metadata={"format": "pt"})


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def _raises(folder, *fragments):
    with pytest.raises(CheckpointError) as info:
        hf.load_hf(folder)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in error message: {msg}"
    return msg


# ---- the good path works (so the failures below are caused by the damage) -----------------

def test_valid_checkpoints_load(tmp_path):
    for config in (QWEN, LLAMA):
        params = _random_params(config)
        folder = hf.save_hf(params, config, tmp_path / config.name)
        loaded_cfg, loaded = hf.load_hf(folder)
        assert loaded_cfg == config.replace(name=config.name)
        for (pa, a), (pb, b) in zip(jax.tree_util.tree_leaves_with_path(params),
                                    jax.tree_util.tree_leaves_with_path(loaded)):
            assert pa == pb
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- folder / files ----------------------------------------------------------------------------

def test_missing_folder(tmp_path):
    _raises(tmp_path / "nope", "nope", "does not exist")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    _raises(tmp_path / "f", "not a folder")


def test_missing_config_json(tmp_path):
    folder = _save(tmp_path)
    os.remove(folder / "config.json")
    _raises(folder, "no config.json")


def test_config_json_not_json(tmp_path):
    folder = _save(tmp_path)
    (folder / "config.json").write_text("{not json")
    _raises(folder, "config.json", "not valid JSON")


def test_missing_weights(tmp_path):
    folder = _save(tmp_path)
    os.remove(folder / "model.safetensors")
    _raises(folder, "no weights", "model.safetensors")


def test_shards_without_index(tmp_path):
    folder = _save(tmp_path, max_shard_bytes=20_000)
    os.remove(folder / "model.safetensors.index.json")
    _raises(folder, "no weights", "model-00001-of-", "no index")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage):
    folder = _save(tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) - 100], "garbage": b"\x00" * 3 + b"junk",
                      "empty": b""}[damage])
    _raises(folder, str(path), "corrupt or truncated")


def test_truncated_shard_names_the_shard(tmp_path):
    folder = _save(tmp_path, max_shard_bytes=20_000)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-8])
    _raises(folder, shard.name, "corrupt or truncated")


def test_index_points_to_missing_shard(tmp_path):
    folder = _save(tmp_path, max_shard_bytes=20_000)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    os.remove(shard)
    _raises(folder, "model.safetensors.index.json", shard.name, "do not exist")


def test_index_maps_key_to_wrong_shard(tmp_path):
    folder = _save(tmp_path, max_shard_bytes=20_000)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    key = "model.norm.weight"
    other = next(f for f in sorted(set(wm.values())) if f != wm[key])
    wm[key] = other
    index_path.write_text(json.dumps(index))
    _raises(folder, key, other, "does not contain it")


def test_index_not_json(tmp_path):
    folder = _save(tmp_path, max_shard_bytes=20_000)
    (folder / "model.safetensors.index.json").write_text("[1, 2")
    _raises(folder, "model.safetensors.index.json", "not valid JSON")


# ---- tensors --------------------------------------------------------------------------------

def test_missing_key_is_named(tmp_path):
    folder = _save(tmp_path)
    _edit_weights(folder, lambda t: {k: v for k, v in t.items()
                                     if k != "model.layers.1.mlp.up_proj.weight"})
    _raises(folder, "missing", "model.layers.1.mlp.up_proj.weight")


def test_untied_config_without_lm_head(tmp_path):
    folder = _save(tmp_path)
    _edit_weights(folder, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    _raises(folder, "lm_head.weight", "tie_word_embeddings=false")


def test_wrong_shape_names_key_and_both_shapes(tmp_path):
    folder = _save(tmp_path)
    key = "model.layers.0.self_attn.k_proj.weight"  # torch [Nkv*D, H] = (24, 40)
    _edit_weights(folder, lambda t: {**t, key: np.zeros((24, 39), np.float32)})
    _raises(folder, key, "(24, 39)", "expected (24, 40)")


def test_wrong_norm_shape(tmp_path):
    folder = _save(tmp_path)
    key = "model.layers.1.self_attn.q_norm.weight"
    _edit_weights(folder, lambda t: {**t, key: np.ones((13,), np.float32)})
    _raises(folder, key, "(13,)", "expected (12,)")


def test_unexpected_extra_keys_are_named(tmp_path):
    folder = _save(tmp_path)
    extra = {"model.layers.2.mlp.up_proj.weight": np.zeros((72, 40), np.float32),
             "vision_tower.patch.weight": np.zeros((2, 2), np.float32)}
    _edit_weights(folder, lambda t: {**t, **extra})
    _raises(folder, "unexpected", *extra)


def test_qk_norm_in_a_llama_checkpoint_is_unexpected(tmp_path):
    folder = _save(tmp_path, config=LLAMA)
    key = "model.layers.0.self_attn.q_norm.weight"
    _edit_weights(folder, lambda t: {**t, key: np.ones((8,), np.float32)})
    _raises(folder, "unexpected", key)


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    folder = _save(tmp_path)
    _edit_weights(folder, lambda t: {**t, "model.rotary_emb.inv_freq": np.ones((6,), np.float32)})
    hf.load_hf(folder)


def test_tied_checkpoint_with_equal_lm_head_loads(tmp_path):
    folder = _save(tmp_path, config=LLAMA)
    _edit_weights(folder, lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"]})
    config, params = hf.load_hf(folder)
    assert config.tie_word_embeddings and "lm_head" not in params


def test_tied_checkpoint_with_different_lm_head_fails(tmp_path):
    folder = _save(tmp_path, config=LLAMA)
    _edit_weights(folder, lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1})
    _raises(folder, "lm_head.weight", "differs", "model.embed_tokens.weight")


# ---- config.json --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM"])
def test_unknown_architecture_names_it_and_the_supported(tmp_path, arch):
    folder = _save(tmp_path)
    _edit_config(folder, architectures=[arch])
    _raises(folder, arch, "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_unknown_model_type_without_architectures(tmp_path):
    folder = _save(tmp_path)
    _edit_config(folder, architectures=..., model_type="gemma3")
    _raises(folder, "'gemma3'", "supported")


def test_model_type_only_is_enough(tmp_path):
    folder = _save(tmp_path)
    _edit_config(folder, architectures=...)
    assert hf.load_hf(folder)[0].arch == "qwen3"


def test_architecture_model_type_mismatch(tmp_path):
    folder = _save(tmp_path)
    _edit_config(folder, model_type="llama")
    _raises(folder, "Qwen3ForCausalLM", "'llama'")


@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_biases_are_unsupported(tmp_path, flag):
    folder = _save(tmp_path)
    _edit_config(folder, **{flag: True})
    _raises(folder, "unsupported", flag)


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_other_rope_types_are_unsupported(tmp_path, rope_type):
    folder = _save(tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": rope_type, "rope_theta": 1e6,
                                          "factor": 4.0})
    _raises(folder, "unsupported", repr(rope_type), "llama3")


def test_sliding_window_and_activation_unsupported(tmp_path):
    folder = _save(tmp_path)
    _edit_config(folder, use_sliding_window=True)
    _raises(folder, "use_sliding_window")
    _edit_config(folder, use_sliding_window=False, hidden_act="gelu")
    _raises(folder, "hidden_act", "gelu")


def test_missing_required_field(tmp_path):
    folder = _save(tmp_path)
    _edit_config(folder, intermediate_size=...)
    _raises(folder, "intermediate_size")


def test_bad_head_counts(tmp_path):
    folder = _save(tmp_path)
    _edit_config(folder, num_key_value_heads=3)
    _raises(folder, "num_heads (4)", "num_kv_heads (3)")


def _base(**changes):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 50,
           "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4}
    cfg.update(changes)
    return cfg


def test_config_defaults_and_legacy_fields():
    c = hf.config_from_hf(_base(rope_theta=5e5, eos_token_id=7, bos_token_id=1,
                                rope_scaling={"type": "llama3", "factor": 32.0,
                                              "original_max_position_embeddings": 8192}))
    assert (c.head_dim, c.num_kv_heads, c.tie_word_embeddings) == (8, 4, False)
    assert c.rope_theta == 5e5 and c.eos_token_ids == (7,) and c.bos_token_id == 1
    assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert not c.use_qk_norm
    c = hf.config_from_hf(_base(eos_token_id=[3, 4], rope_scaling={"rope_type": "default"}))
    assert c.eos_token_ids == (3, 4) and c.rope_scaling is None and c.rope_theta == 10000.0


def test_config_transformers5_rope_parameters_win():
    c = hf.config_from_hf(_base(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                                head_dim=16, rope_theta=1.0,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert c.use_qk_norm and c.head_dim == 16 and c.rope_theta == 1e6
    c = hf.config_from_hf(_base(rope_parameters={"full_attention": {
        "rope_type": "llama3", "rope_theta": 2e5, "factor": 8.0, "low_freq_factor": 2.0,
        "high_freq_factor": 8.0, "original_max_position_embeddings": 4096}}))
    assert c.rope_theta == 2e5 and c.rope_scaling == RopeScaling(8.0, 2.0, 8.0, 4096)
    with pytest.raises(CheckpointError, match="per-layer-type"):
        hf.config_from_hf(_base(rope_parameters={"full_attention": {}, "sliding_attention": {}}))
    with pytest.raises(CheckpointError, match="original_max_position_embeddings"):
        hf.config_from_hf(_base(rope_parameters={"rope_type": "llama3", "factor": 8.0}))


def test_config_round_trip_through_hf_dict():
    for cfg in (QWEN, LLAMA.replace(rope_scaling=RopeScaling(), eos_token_ids=(1, 2),
                                    bos_token_id=0)):
        assert hf.config_from_hf(hf.config_to_hf(cfg), name=cfg.name) == cfg


def test_key_table_both_directions():
    assert hf.hf_key_to_param("model.layers.12.self_attn.o_proj.weight") == (
        "layers/12/attn/o_proj/kernel", True)
    assert hf.hf_key_to_param("model.layers.3.self_attn.k_norm.weight") == (
        "layers/3/attn/k_norm/scale", False)
    assert hf.hf_key_to_param("model.layers.x.mlp.up_proj.weight") is None
    assert hf.hf_key_to_param("model.layers.0.mlp.up_proj.bias") is None
    for path, leaf in hf._flatten(target.abstract_params(QWEN)):
        key, transpose = hf.param_to_hf_key(path)
        assert hf.hf_key_to_param(key) == (path, transpose)
        assert transpose == (leaf.ndim == 2 and path != "embed/embedding")


# ---- saving -------------------------------------------------------------------------------------

def test_save_refuses_non_empty_folder_unless_overwrite(tmp_path):
    folder = _save(tmp_path, max_shard_bytes=20_000)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not empty"):
        _save(tmp_path)
    _save(tmp_path, overwrite=True)  # single file now: stale shards + index must go
    names = sorted(os.listdir(folder))
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]
    hf.load_hf(folder)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # no temp folders left


def test_save_into_empty_existing_folder(tmp_path):
    (tmp_path / "ckpt").mkdir()
    folder = _save(tmp_path)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


def test_save_rejects_params_not_matching_config(tmp_path):
    params = _random_params(QWEN)
    with pytest.raises(CheckpointError, match="lm_head/kernel"):
        hf.save_hf(params, QWEN.replace(tie_word_embeddings=True), tmp_path / "x")
    params["layers"][0]["mlp"]["up_proj"]["kernel"] = jnp.zeros((40, 71))
    with pytest.raises(CheckpointError, match=r"layers/0/mlp/up_proj/kernel.*\(40, 71\)"):
        hf.save_hf(params, QWEN, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_save_dtype_cast_and_sharding(tmp_path):
    folder = _save(tmp_path, dtype=jnp.bfloat16, max_shard_bytes=10_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(target.abstract_params(QWEN)))
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 3 and all(s.stat().st_size < 10_000 + 4096 for s in shards)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    _, params = hf.load_hf(folder, dtype=None)
    assert params["embed"]["embedding"].dtype == jnp.bfloat16


def test_shardings_missing_an_entry(tmp_path):
    folder = _save(tmp_path)
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: sh, target.abstract_params(QWEN))
    del shardings["lm_head"]
    with pytest.raises(ValueError, match="lm_head/kernel"):
        hf.load_hf(folder, shardings=shardings)
    config, params = hf.load_hf(folder, shardings=sh)  # one Sharding for every leaf
    assert params["lm_head"]["kernel"].sharding == sh
