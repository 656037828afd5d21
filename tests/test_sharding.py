"""Target forward and plain sampling on an 8-device CPU mesh equal single-device runs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dblast_jax import sharding
from dblast_jax.config import SamplingConfig, TargetConfig
from dblast_jax.models import target as T
from dblast_jax.sampler import generate_tokens, pad_prompts

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def test_every_target_parameter_has_a_rule_and_specs_fit():
    mesh = sharding.make_mesh(2, 2, 2)
    for config in (TargetConfig.tiny_llama(), TargetConfig.tiny_qwen3(),
                   TargetConfig.smollm2_135m()):
        specs = sharding.partition_specs(T.abstract_params(config), mesh)
        flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        assert len(flat) == len(jax.tree.leaves(T.abstract_params(config)))
    # SmolLM2's 3 KV heads * 64 = 192 columns divide by 2; the vocabulary 49152 too.
    specs = sharding.partition_specs(T.abstract_params(TargetConfig.smollm2_135m()), mesh)
    assert specs["layers"][0]["attn"]["k_proj"]["kernel"] == P("fsdp", "tensor")
    # a dimension that does not divide drops the axis instead of failing
    assert sharding.fit_spec(P("tensor", "fsdp"), (97, 48), mesh) == P(None, "fsdp")
    assert sharding.fit_spec(P("fsdp", "tensor"), (48, 97), mesh) == P("fsdp")


def test_unknown_parameter_names_the_path():
    mesh = sharding.make_mesh(1, 1, 1)
    with pytest.raises(ValueError, match="mystery/kernel"):
        sharding.partition_specs({"mystery": {"kernel": jnp.zeros((2, 2))}}, mesh)


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(4, 2, 2)
    assert sharding.make_mesh(-1, 2, 1).shape["data"] == 4


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_qwen3"])
def test_sharded_forward_equals_single_device(preset):
    config = getattr(TargetConfig, preset)(num_heads=4, num_kv_heads=2, vocab_size=96)
    params = T.init_params(config, 0)
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, config.vocab_size)
    expected_logits, expected_taps = T.forward(params, tokens, config=config, tap_layers=(0, 2))

    mesh = sharding.make_mesh(2, 2, 2)
    param_shardings = sharding.named_shardings(params, mesh)
    batch = NamedSharding(mesh, P("data"))
    fwd = jax.jit(functools.partial(T.forward, config=config, tap_layers=(0, 2)),
                  in_shardings=(param_shardings, batch),
                  out_shardings=(NamedSharding(mesh, P("data", None, "tensor")),
                                 NamedSharding(mesh, P("data"))))
    logits, taps = fwd(jax.device_put(params, param_shardings), jax.device_put(tokens, batch))
    assert logits.sharding.spec == P("data", None, "tensor")
    np.testing.assert_allclose(logits, expected_logits, atol=1e-5)
    np.testing.assert_allclose(taps, expected_taps, atol=1e-5)


def test_sharded_generation_equals_single_device():
    config = TargetConfig.tiny_qwen3()
    params = T.init_params(config, 5)
    tokens, lengths = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]])
    sampling = SamplingConfig(temperature=1.0, top_k=20, max_new_tokens=6)
    expected = generate_tokens(params, tokens, lengths, jax.random.key(3), config=config,
                               sampling=sampling, cache_size=32)
    mesh = sharding.make_mesh(2, 2, 2)
    sharded_params = sharding.shard_params(params, mesh)
    batch = sharding.batch_sharding(mesh, tokens.shape)
    got = generate_tokens(sharded_params, jax.device_put(tokens, batch),
                          jax.device_put(lengths, sharding.batch_sharding(mesh, lengths.shape)),
                          jax.random.key(3), config=config, sampling=sampling, cache_size=32)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_sharded_speculative_generation_equals_single_device():
    from dblast_jax.config import DrafterConfig
    from dblast_jax.models import drafter as D
    from dblast_jax.sampler import spec_cache_size, speculative_generate_tokens
    config = TargetConfig.tiny_qwen3()
    params = T.init_params(config, 5)
    dcfg = DrafterConfig.for_target(config, num_layers=1, block_size=4, num_categories=2)
    dparams = D.init_drafter_params(dcfg, config, 1)
    tokens, lengths = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=7, verify_mode="mixture")
    kw = dict(target_config=config, drafter_config=dcfg, sampling=sampling,
              cache_size=spec_cache_size(tokens.shape[1], sampling, dcfg.block_size))
    expected = speculative_generate_tokens(params, dparams, tokens, lengths, jax.random.key(3),
                                           **kw)
    mesh = sharding.make_mesh(2, 2, 2)
    got = speculative_generate_tokens(
        sharding.shard_params(params, mesh), D.shard_drafter_params(dparams, mesh),
        jax.device_put(tokens, sharding.batch_sharding(mesh, tokens.shape)),
        jax.device_put(lengths, sharding.batch_sharding(mesh, lengths.shape)),
        jax.random.key(3), **kw)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=1e-5)
