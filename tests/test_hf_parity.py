"""Parity of `load_hf` / `save_hf` + `target.forward` with the transformers PyTorch models.

Tiny random Llama / Qwen3 models (MHA and GQA, tied and untied, odd sizes, explicit
Qwen3 head_dim, llama3 RoPE scaling) are saved with `save_pretrained` (single file and
sharded), loaded here and compared logit by logit and tap by tap.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dblast_jax.config import RopeScaling
from dblast_jax.io import hf
from dblast_jax.models import target

pytestmark = pytest.mark.torch

# jit: one compile per config is far cheaper than eager op-by-op dispatch on CPU
_forward = jax.jit(target.forward, static_argnames=("config", "tap_layers"))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    cls: str  # transformers class name
    kwargs: dict
    shard: bool  # save sharded (several files + index)


CASES = [
    Case("llama-gqa-tied", "Llama", dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 3]), shard=False),
    Case("llama-mha-untied-llama3rope", "Llama", dict(
        vocab_size=89, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=5, num_key_value_heads=5, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16),
        eos_token_id=7), shard=True),
    Case("qwen3-gqa-untied", "Qwen3", dict(
        vocab_size=101, hidden_size=40, intermediate_size=72, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=1e6,
        tie_word_embeddings=False, eos_token_id=[5, 6]), shard=True),
    Case("qwen3-mha-tied", "Qwen3", dict(
        vocab_size=83, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        tie_word_embeddings=True), shard=False),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def tf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return torch, transformers


@pytest.fixture(scope="module")
def models(tf, tmp_path_factory):
    """name -> (torch model in eval mode, checkpoint folder)."""
    torch, transformers = tf
    out = {}
    for i, case in enumerate(CASES):
        torch.manual_seed(i)
        cfg = getattr(transformers, f"{case.cls}Config")(**case.kwargs)
        model = getattr(transformers, f"{case.cls}ForCausalLM")(cfg).eval()
        with torch.no_grad():  # non-trivial norm scales, so a mis-mapped norm shows up
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(case.name)
        model.save_pretrained(folder, max_shard_size="20KB" if case.shard else "1GB")
        out[case.name] = (model, folder)
    return out


def _tokens(vocab: int, b: int = 2, t: int = 11, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, (b, t)).astype(np.int32)


def _torch_run(tf, model, tokens):
    torch, _ = tf
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


def _st_tensors(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sharded_checkpoint_is_really_sharded(models, case):
    _, folder = models[case.name]
    index = os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    assert index == case.shard
    if case.shard:
        assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 2


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_config_from_checkpoint(models, case):
    model, folder = models[case.name]
    config, _ = hf.load_hf(folder)
    c = model.config
    assert config.arch == case.cls.lower()
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        c.vocab_size, c.hidden_size, c.intermediate_size)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (
        c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
    assert config.head_dim == case.kwargs.get("head_dim", c.hidden_size // c.num_attention_heads)
    assert config.tie_word_embeddings == case.kwargs["tie_word_embeddings"]
    assert config.use_qk_norm == (case.cls == "Qwen3")
    assert config.rms_norm_eps == pytest.approx(c.rms_norm_eps)
    assert config.rope_theta == pytest.approx(case.kwargs.get("rope_theta", 10000.0))
    eos = case.kwargs.get("eos_token_id")
    assert config.eos_token_ids == (() if eos is None else tuple(np.atleast_1d(eos).tolist()))
    if "rope_scaling" in case.kwargs:
        assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    else:
        assert config.rope_scaling is None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_logits_and_taps_match_transformers(tf, models, case):
    model, folder = models[case.name]
    config, params = hf.load_hf(folder)
    tokens = _tokens(config.vocab_size, t=19)  # > original_max_position_embeddings (16)
    ref_logits, ref_hidden = _torch_run(tf, model, tokens)
    taps_idx = tuple(range(config.num_layers))
    logits, taps = _forward(params, jnp.asarray(tokens), config=config,
                                  tap_layers=taps_idx)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=0)
    assert np.abs(ref_logits).max() > 0.05  # the comparison is not vacuous
    assert taps.shape == tokens.shape + (config.num_layers, config.hidden_size)
    for i in taps_idx:
        np.testing.assert_allclose(np.asarray(taps[:, :, i]), ref_hidden[i + 1], atol=1e-4,
                                   rtol=0, err_msg=f"tap {i}")


@pytest.mark.parametrize("case", [CASES[2]], ids=[IDS[2]])
def test_bfloat16_load_is_close(tf, models, case):
    model, folder = models[case.name]
    config, params = hf.load_hf(folder, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    tokens = _tokens(config.vocab_size, t=9, seed=1)
    ref_logits, _ = _torch_run(tf, model, tokens)
    logits, _ = _forward(params, jnp.asarray(tokens), config=config)
    logits = np.asarray(logits)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    scale = np.abs(ref_logits).max()
    assert np.abs(logits - ref_logits).max() <= 0.05 * scale
    # argmax agrees almost everywhere (ties can flip in bf16)
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_round_trip_is_bit_exact_and_reloads_in_transformers(tf, models, case, tmp_path):
    torch, transformers = tf
    model, folder = models[case.name]
    config, params = hf.load_hf(folder)
    out = hf.save_hf(params, config, tmp_path / "rt",
                     max_shard_bytes=12_000 if case.shard else None)
    original, saved = _st_tensors(folder), _st_tensors(out)
    if config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    assert sorted(saved) == sorted(original)
    for key in original:
        assert saved[key].dtype == original[key].dtype, key
        assert saved[key].shape == original[key].shape, key
        assert np.array_equal(_bits(saved[key]), _bits(original[key])), key
    assert os.path.exists(out / "model.safetensors.index.json") == case.shard
    # transformers reloads our config.json + weights as the same model
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    tokens = _tokens(config.vocab_size, t=19, seed=2)
    a, _ = _torch_run(tf, model, tokens)
    b, _ = _torch_run(tf, reloaded, tokens)
    np.testing.assert_array_equal(a, b)
    # ...and our loader reads it back to the same config
    config2, _ = hf.load_hf(out)
    assert config2.replace(name="x") == config.replace(name="x")


def test_bfloat16_round_trip_is_bit_exact(tf, models, tmp_path):
    torch, _ = tf
    model, _ = models["qwen3-gqa-untied"]
    src = tmp_path / "bf16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(src)  # keep the shared model f32
    config, params = hf.load_hf(src, dtype=None)  # keep the stored dtype
    assert params["embed"]["embedding"].dtype == jnp.bfloat16
    out = hf.save_hf(params, config, tmp_path / "bf16-rt")
    original, saved = _st_tensors(src), _st_tensors(out)
    assert sorted(saved) == sorted(original)
    for key in original:
        assert saved[key].dtype == original[key].dtype == jnp.bfloat16, key
        assert np.array_equal(_bits(saved[key]), _bits(original[key])), key


def test_saved_config_reloads_in_transformers(tf, tmp_path):
    """A TargetConfig built here (not parsed from HF) -> save_hf -> transformers runs the
    same model: checks config_to_hf (llama3 RoPE, eos, tied head)."""
    torch, transformers = tf
    from dblast_jax.config import TargetConfig
    cfg = TargetConfig.tiny_llama(rope_scaling=RopeScaling(4.0, 1.0, 4.0, 8), eos_token_ids=(3,),
                                  bos_token_id=1)
    rng = np.random.RandomState(3)  # numpy init: no eager nnx init (slow on CPU)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype),
                          target.abstract_params(cfg))
    hf.save_hf(params, cfg, tmp_path / "m")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert model.config.eos_token_id == 3 and model.config.bos_token_id == 1
    tokens = _tokens(cfg.vocab_size, t=19, seed=4)
    ref, _ = _torch_run(tf, model, tokens)
    logits, _ = _forward(params, jnp.asarray(tokens), config=cfg)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


def _mesh_shardings(abstract, mesh):
    """Shard each dim over an axis when it divides evenly (vocab sizes are odd here)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    def spec(x):
        if x.ndim == 2:
            a = "fsdp" if x.shape[0] % 2 == 0 else None
            b = "tensor" if x.shape[1] % 2 == 0 else None
            return NamedSharding(mesh, P(a, b))
        return NamedSharding(mesh, P("tensor" if x.shape[0] % 2 == 0 else None))
    return jax.tree.map(spec, abstract)


@pytest.mark.parametrize("case", [CASES[2]], ids=[IDS[2]])
def test_load_into_mesh_reads_slices_and_matches(tf, models, case, monkeypatch):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    model, folder = models[case.name]
    config, plain = hf.load_hf(folder)
    auto = jax.sharding.AxisType.Auto  # let XLA reshard inside the eager forward below
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(auto,) * 3)
    shardings = _mesh_shardings(target.abstract_params(config), mesh)

    reads = []
    orig_read = hf.SafetensorsReader.read

    def spy(self, key, index=None):
        arr = orig_read(self, key, index)
        reads.append((key, index, arr.shape))
        return arr
    monkeypatch.setattr(hf.SafetensorsReader, "read", spy)
    _, sharded = hf.load_hf(folder, shardings=shardings)
    monkeypatch.undo()

    flat_p = jax.tree_util.tree_leaves_with_path(plain)
    flat_s = dict(jax.tree_util.tree_leaves_with_path(sharded))
    flat_sh = dict(jax.tree_util.tree_leaves_with_path(shardings))
    assert len(flat_s) == len(flat_p)
    for path, x in flat_p:
        y = flat_s[path]
        assert y.sharding == flat_sh[path], path
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    # every q_proj read was a quarter slice (fsdp x tensor), never the whole tensor
    q_reads = [r for r in reads if r[0] == "model.layers.0.self_attn.q_proj.weight"]
    full = tuple(plain["layers"][0]["attn"]["q_proj"]["kernel"].shape[::-1])
    assert q_reads and all(r[1] is not None for r in q_reads)
    assert all(r[2] == (full[0] // 2, full[1] // 2) for r in q_reads)
    # the sharded params run and give transformers' logits
    tokens = _tokens(config.vocab_size, t=19)
    ref, _ = _torch_run(tf, model, tokens)
    logits, _ = _forward(sharded, jnp.asarray(tokens), config=config)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)
