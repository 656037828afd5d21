"""GGUF loading: synthetic files (format, errors, Q/K permutation) and the real SmolLM2.

The real-model tests compare against transformers' own GGUF path, which dequantises the
same bytes with the same `gguf` code and undoes the Q/K permutation independently, so
the only expected difference is float32 summation order.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dblast_jax.config import TargetConfig
from dblast_jax.io.gguf import GGUFFormatError, load_gguf, permute_qk, save_gguf, unpermute_qk
from dblast_jax.io.tokenizer import bytes_to_unicode
from dblast_jax.models import target
from conftest import hf_from_gguf as _hf_from_gguf

# Logit tolerance for the real model. Weights are bit-identical on both sides; what is left
# is float32 rounding (different matmul/reduction order in XLA and PyTorch) accumulated
# over 30 layers on logits of magnitude ~40: measured ~1.2e-4. 2e-3 (5e-5 of the logit
# range) leaves margin for other CPUs/BLAS while any real mistake (a wrong permutation,
# eps, RoPE base or tying) moves logits by O(1) -- see the negative control below.
LOGIT_ATOL = 2e-3
N_GREEDY = 32

TINY_VOCAB = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list(bytes_to_unicode().values()) \
    + ["he", "ll", "hell", "Ġw"]
TINY_TOKENIZER = {
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
    "tokenizer.ggml.tokens": TINY_VOCAB,
    "tokenizer.ggml.merges": ["h e", "l l", "he ll", "Ġ w"],
    "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(TINY_VOCAB) - 3),
    "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                               "{{ m.content }}<|im_end|>\n{% endfor %}",
}


def _tiny(arch: str) -> TargetConfig:
    base = TargetConfig.tiny_llama() if arch == "llama" else TargetConfig.tiny_qwen3()
    return base.replace(vocab_size=len(TINY_VOCAB), bos_token_id=1, eos_token_ids=(2,))


def _tiny_params(cfg: TargetConfig):
    """Random params of the right layout (numpy: much faster than building the module).
    Norm scales are around 1 but not 1, so a misplaced norm shows."""
    rng = np.random.RandomState(0)

    def draw(leaf):
        if len(leaf.shape) == 1:
            return jnp.asarray(1.0 + 0.1 * rng.randn(*leaf.shape), jnp.float32)
        return jnp.asarray(0.05 * rng.randn(*leaf.shape), jnp.float32)

    return jax.tree.map(draw, target.abstract_params(cfg))


# ---- synthetic files --------------------------------------------------------------------

def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    p = permute_qk(w, 3)
    # llama.cpp layout: within each head of 8 rows, row 2j is HF row j, row 2j+1 is row j+4
    np.testing.assert_array_equal(p[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])
    np.testing.assert_array_equal(unpermute_qk(p, 3), w)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_load_round_trip(tmp_path, arch):
    cfg = _tiny(arch)
    params = _tiny_params(cfg)
    path = save_gguf(tmp_path / f"{arch}.gguf", cfg, params, TINY_TOKENIZER)
    cfg2, params2, meta = load_gguf(path, name=cfg.name)
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta["tokenizer.ggml.tokens"] == TINY_VOCAB
    _, bf16, _ = load_gguf(path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16))


@pytest.mark.torch
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_gguf_matches_transformers(tmp_path, arch):
    """transformers reads our file as the same model: checks the permutation convention
    and the metadata keys independently of our own loader."""
    import torch

    cfg = _tiny(arch)
    params = _tiny_params(cfg)
    path = save_gguf(tmp_path / f"{arch}.gguf", cfg, params, TINY_TOKENIZER)
    model = _hf_from_gguf(path, head_dim=cfg.head_dim)
    cfg2, params2, _ = load_gguf(path)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(target.forward(params2, jnp.asarray(ids), config=cfg2)[0])
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)


def _write_tiny(tmp_path, cfg=None, mutate=None, arch_name=None):
    cfg = cfg or _tiny("llama")
    params = _tiny_params(cfg)
    if mutate:
        mutate(params)
    path = save_gguf(tmp_path / "m.gguf", cfg, params, TINY_TOKENIZER)
    if arch_name:  # rewrite the architecture string in place (same length keeps offsets)
        data = path.read_bytes().replace(b"llama", arch_name.encode(), 1)
        path.write_bytes(data)
    return path


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        load_gguf(p)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.02])
def test_truncated_file(tmp_path, keep):
    p = _write_tiny(tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFFormatError, match="truncated"):
        load_gguf(p)


def test_unsupported_architecture(tmp_path):
    p = _write_tiny(tmp_path, arch_name="gptj_")
    with pytest.raises(GGUFFormatError, match=r"unsupported architecture 'gptj_'.*llama, qwen3"):
        load_gguf(p)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    cfg = _tiny("llama")
    p = _write_tiny(tmp_path, cfg)
    # same file, but metadata claims a wider FFN: every ffn tensor now mismatches
    data = p.read_bytes()
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4  # skip the uint32 value-type tag
    assert int.from_bytes(data[at:at + 4], "little") == cfg.intermediate_size
    data = data[:at] + (cfg.intermediate_size + 8).to_bytes(4, "little") + data[at + 4:]
    p.write_bytes(data)
    with pytest.raises(GGUFFormatError) as err:
        load_gguf(p)
    msg = str(err.value)
    assert "blk.0.ffn_" in msg and f"{cfg.intermediate_size}" in msg \
        and f"{cfg.intermediate_size + 8}" in msg


# ---- the real SmolLM2-135M-Instruct -------------------------------------------------------

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def ours(smollm2_jax):
    return smollm2_jax


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf


@pytest.mark.real_model
def test_real_config(ours):
    cfg, params, tok = ours
    assert cfg == TargetConfig.smollm2_135m()
    assert target.num_params(params) == 134_515_008
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    assert 2 in tok.stop_ids


@pytest.mark.real_model
@pytest.mark.torch
def test_real_chat_ids_match_transformers(ours, hf):
    _, _, tok = ours
    _, hf_tok = hf
    conversations = [
        CHAT,
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Name three prime numbers."},
         {"role": "assistant", "content": "2, 3 and 5."},
         {"role": "user", "content": "Thanks! And the next one?"}],
        [{"role": "user", "content": "Übersetze: «naïve café» — 東京 🚀\n\tdef f(x): return x**2"}],
    ]
    for conv in conversations:
        text = tok.apply_chat_template(conv)
        assert text == hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        want = hf_tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
        assert tok.encode_chat(conv) == list(want)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("<|im_end|>\n")


@functools.lru_cache(maxsize=None)
def _jitted(cfg, cache_size):
    """One prefill (all-position logits) shared by the logits and generation tests, so
    the 30-layer model is compiled once per shape."""
    prefill = jax.jit(functools.partial(target.prefill, config=cfg, cache_size=cache_size))
    extend = jax.jit(functools.partial(target.extend, config=cfg))
    return prefill, extend


@pytest.mark.real_model
@pytest.mark.torch
def test_real_logits_match_transformers(ours, hf):
    import torch

    cfg, params, tok = ours
    model, _ = hf
    ids = tok.encode_chat(CHAT)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    prefill, _ = _jitted(cfg, len(ids) + N_GREEDY)
    lengths = jnp.asarray([len(ids)])
    got = np.asarray(prefill(params, jnp.asarray([ids]), lengths)[0][0])
    diff = float(np.abs(got - ref).max())
    print(f"\n[smollm2] logits max |ours - transformers| = {diff:.3g} over {len(ids)} positions "
          f"(max |logit| {np.abs(ref).max():.1f})")
    assert diff < LOGIT_ATOL
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))

    # negative control: leaving llama.cpp's Q/K row order in place must be caught
    bad = jax.tree.map(lambda x: x, params)
    for i in range(cfg.num_layers):
        attn = bad["layers"][i]["attn"]
        attn["q_proj"]["kernel"] = permute_qk(np.asarray(attn["q_proj"]["kernel"]).T,
                                              cfg.num_heads).T
        attn["k_proj"]["kernel"] = permute_qk(np.asarray(attn["k_proj"]["kernel"]).T,
                                              cfg.num_kv_heads).T
    bad_logits = np.asarray(prefill(bad, jnp.asarray([ids]), lengths)[0][0])
    assert np.abs(bad_logits - ref).max() > 100 * LOGIT_ATOL


@pytest.mark.real_model
@pytest.mark.torch
def test_real_greedy_generation_matches_transformers(ours, hf):
    import torch

    cfg, params, tok = ours
    model, _ = hf
    ids = tok.encode_chat(CHAT)
    n = len(ids)
    prefill, extend = _jitted(cfg, n + N_GREEDY)
    logits, _, cache = prefill(params, jnp.asarray([ids]), jnp.asarray([n]))
    out = [int(jnp.argmax(logits[0, -1]))]
    while len(out) < N_GREEDY and out[-1] not in tok.stop_ids:
        logits, _, cache = extend(params, jnp.asarray([[out[-1]]]),
                                  jnp.asarray([n + len(out) - 1]), cache)
        out.append(int(jnp.argmax(logits[0, -1])))
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                             max_new_tokens=N_GREEDY, do_sample=False, pad_token_id=tok.eos_id)
    want = gen[0, n:].tolist()
    print(f"\n[smollm2] greedy: {tok.decode(out)!r}")
    assert len(want) >= 8, want
    assert out[:len(want)] == want
    if len(want) < N_GREEDY:  # transformers stopped at an end token; so did we
        assert out == want and want[-1] in tok.stop_ids
