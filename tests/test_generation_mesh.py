"""Generation on a device mesh (issue 15): `on_mesh` places a target / drafter by the
partition rules, the batch goes over the data axis, and the tokens equal a one-device
run's, for plain and speculative decoding, through the API and `dblast generate --mesh`.
Runs on the 8 fake CPU devices of conftest.py."""

import json

import jax
import numpy as np
import pytest

import dblast_jax as dj
from dblast_jax import cli
from dblast_jax.generation import init_drafter, mesh_of

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8
    return dj.parse_mesh("2,2,2")


def test_on_mesh_places_parameters_by_the_rules(mesh):
    target = dj.load_target("tiny-qwen3")
    placed = dj.on_mesh(target, mesh)
    assert mesh_of(target.params) is None and mesh_of(placed.params) == mesh
    q = placed.params["layers"][0]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert dj.on_mesh(target, None) is target
    for bad in ("2,2", "a,b,c", "3,3,3"):
        with pytest.raises(ValueError, match="mesh"):
            dj.parse_mesh(bad)


def test_generation_on_mesh_equals_one_device(mesh, temperature=1.0):
    target = dj.load_target("tiny-qwen3", seed=3)
    sampling = dj.SamplingConfig(temperature=temperature, max_new_tokens=7,
                                 stop_tokens=(10**6,))
    drafter = init_drafter(target, dj.DrafterConfig.for_target(
        target.config, num_layers=1, block_size=4, num_categories=2), rng=1)
    plain = dj.generate(target, PROMPTS, sampling, rng=5)
    spec = dj.speculative_generate(target, drafter, PROMPTS,
                                   sampling.replace(verify_mode="mixture"), rng=5)
    on = dj.on_mesh(target, mesh)
    assert dj.generate(on, PROMPTS, sampling, rng=5).tokens == plain.tokens
    # compiled ahead of time for the placed arguments (`warmup`), the same tokens
    assert dj.generate(on, PROMPTS, sampling, rng=5, warmup=True).tokens == plain.tokens
    # both placed, or only the target (the drafter follows it onto the mesh)
    for d in (dj.on_mesh(drafter, mesh), drafter):
        got = dj.speculative_generate(on, d, PROMPTS, sampling.replace(verify_mode="mixture"),
                                      rng=5)
        assert got.tokens == spec.tokens
        warm = dj.speculative_generate(on, d, PROMPTS, sampling.replace(verify_mode="mixture"),
                                       rng=5, warmup=True)
        assert warm.tokens == spec.tokens
        np.testing.assert_allclose(got.stats["tau_expected"], spec.stats["tau_expected"],
                                   rtol=1e-5)


def test_target_and_drafter_on_different_meshes_are_refused(mesh):
    target = dj.load_target("tiny-qwen3")
    drafter = init_drafter(target, dj.DrafterConfig.for_target(target.config, num_layers=1,
                                                               block_size=4))
    other = dj.parse_mesh("4,1,2")
    with pytest.raises(ValueError, match="different meshes"):
        dj.speculative_generate(dj.on_mesh(target, mesh), dj.on_mesh(drafter, other),
                                [[1, 2]], dj.SamplingConfig(max_new_tokens=3))


def test_cli_generate_mesh_flag(capsys):
    args = ["generate", "--model", "tiny-smollm2", "--prompt", "Hi", "--prompt", "Bye",
            "--max-new-tokens", "6", "--temperature", "1.0", "--json", "--drafter", "random"]
    assert cli.main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--mesh", "2,2,2"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == one["tokens"]
    assert cli.main(args + ["--mesh", "2,2"]) == 2
    assert "mesh '2,2'" in capsys.readouterr().err


def test_draft_vocabulary_on_mesh_equals_one_device(mesh):
    """A draft-time vocabulary's head rows and ids are placed by their own rules and the
    tokens equal a one-device run's."""
    target = dj.load_target("tiny-qwen3", seed=3)
    sampling = dj.SamplingConfig(temperature=1.0, max_new_tokens=7, stop_tokens=(10**6,),
                                 verify_mode="sampled-branch")
    drafter = init_drafter(target, dj.DrafterConfig.for_target(
        target.config, num_layers=1, block_size=4), rng=1)
    drafter.token_counts = np.arange(target.config.vocab_size)[::-1].copy()
    drafter = dj.with_draft_vocab(drafter, target, target.config.vocab_size // 2)
    one = dj.speculative_generate(target, drafter, PROMPTS, sampling, rng=5)
    placed = dj.on_mesh(drafter, mesh)
    assert placed.params["draft_vocab"]["head"].sharding.spec == jax.sharding.PartitionSpec(
        "tensor", "fsdp")
    got = dj.speculative_generate(dj.on_mesh(target, mesh), placed, PROMPTS, sampling, rng=5)
    assert got.tokens == one.tokens
