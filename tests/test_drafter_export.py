"""DFlash import / export and the self-contained PyTorch drafter."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dblast_jax.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dblast_jax.io import dflash
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T

QWEN = TargetConfig.tiny_qwen3()  # 4 layers, hidden 40, 4 heads / 2 KV heads, head_dim 12
LLAMA = TargetConfig.tiny_llama()  # 3 layers, hidden 48, tied embeddings
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def write_dflash_folder(folder, *, dtype="float32", layers=2, block_size=8, mask_token_id=100,
                        target_layer_ids=(1, 2), seed=0, config_overrides=None):
    """A DFlash checkpoint for the tiny Qwen3 target, laid out like the public ones:
    unprefixed keys, torch (out, in) weights, config.json with dflash_config."""
    h, f, nq, nkv, d = 40, 56, 4, 2, 12
    gen = np.random.default_rng(seed)
    n_taps = len(target_layer_ids or default_target_layer_ids(4, layers))
    shapes = {"fc.weight": (h, n_taps * h), "hidden_norm.weight": (h,),
              "norm.weight": (h,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)})
    tensors = {k: gen.standard_normal(s, np.float32).astype(NP_DTYPES[dtype])
               for k, s in shapes.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    dflash_cfg = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash_cfg["target_layer_ids"] = list(target_layer_ids)
    cfg = {"architectures": ["DFlashDraftModel"],
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "model_type": "qwen3",
           "block_size": block_size, "num_hidden_layers": layers,
           "hidden_size": h, "intermediate_size": f, "num_attention_heads": nq,
           "num_key_value_heads": nkv, "head_dim": d, "num_target_layers": 4,
           "rope_theta": 1000000, "rms_norm_eps": 1e-6, "vocab_size": 101,
           "tie_word_embeddings": False, "rope_scaling": None, "torch_dtype": dtype,
           "dflash_config": dflash_cfg}
    cfg.update(config_overrides or {})
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return tensors


def random_drafter(tc, seed=0, **kw):
    """Drafter params with every leaf O(1)-effective (norms around 1)."""
    kw.setdefault("num_layers", 2)
    kw.setdefault("block_size", 6)
    dc = DrafterConfig.for_target(tc, **kw)
    gen = np.random.default_rng(seed)

    def leaf(a):
        z = gen.standard_normal(a.shape, np.float32)
        return jnp.asarray(1.0 + 0.3 * z if len(a.shape) == 1 else z / np.sqrt(a.shape[-2]))

    return dc, jax.tree.map(leaf, D.abstract_drafter_params(dc, tc))


# ---- import ---------------------------------------------------------------------------

def test_import_dflash_checkpoint(tmp_path):
    tensors = write_dflash_folder(tmp_path / "ck")
    dc, dp = dflash.load_dflash(str(tmp_path / "ck"), QWEN)
    assert (dc.block_size, dc.mask_token_id, dc.target_layer_ids) == (8, 100, (1, 2))
    assert (dc.num_layers, dc.num_categories, dc.expander_width) == (2, 1, 0)
    assert (dc.intermediate_size, dc.head_dim, dc.rope_theta) == (56, 12, 1e6)
    assert set(dp) == {"fc", "hidden_norm", "layers", "final_norm"}
    np.testing.assert_array_equal(dp["fc"]["kernel"], tensors["fc.weight"].T)
    np.testing.assert_array_equal(dp["layers"][1]["mlp"]["down_proj"]["kernel"],
                                  tensors["layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(dp["layers"][0]["attn"]["k_norm"]["scale"],
                                  tensors["layers.0.self_attn.k_norm.weight"])
    np.testing.assert_array_equal(dp["final_norm"]["scale"], tensors["norm.weight"])
    # no target_layer_ids in the config -> DFlash's default rule
    write_dflash_folder(tmp_path / "ck2", target_layer_ids=None, layers=2)
    dc2, _ = dflash.load_dflash(str(tmp_path / "ck2"), QWEN)
    assert dc2.target_layer_ids == default_target_layer_ids(4, 2) == (1, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_export_round_trip_is_bit_exact(tmp_path, dtype):
    src = write_dflash_folder(tmp_path / "src", dtype=dtype)
    dc, dp = dflash.load_dflash(str(tmp_path / "src"), QWEN, jnp.dtype(dtype))
    out = dflash.export_drafter(dp, dc, str(tmp_path / "out"), dtype=dtype)
    got = load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == set(src)
    for k in src:
        assert got[k].dtype == src[k].dtype and got[k].shape == src[k].shape, k
        assert got[k].tobytes() == src[k].tobytes(), k
    with open(os.path.join(out, "config.json")) as fh:
        cfg = json.load(fh)
    with open(tmp_path / "src" / "config.json") as fh:
        src_cfg = json.load(fh)
    for key in ("architectures", "model_type", "block_size", "num_hidden_layers", "hidden_size",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_target_layers", "rope_theta", "rms_norm_eps", "vocab_size",
                "tie_word_embeddings", "dflash_config"):
        assert cfg[key] == src_cfg[key], key
    assert "dblast_config" not in cfg and not any(k.startswith("dblast.") for k in got)
    # and back again
    dc2, dp2 = dflash.load_dflash(out, QWEN, jnp.dtype(dtype))
    assert dc2 == dc.replace(name=dc2.name)
    assert all(jax.tree.leaves(jax.tree.map(
        lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), dp, dp2)))


def test_export_k4_learned_mask_round_trip(tmp_path):
    dc, dp = random_drafter(QWEN, num_categories=4, expander_width=8)
    out = dflash.export_drafter(dp, dc, str(tmp_path / "k4"))
    with open(os.path.join(out, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["tie_word_embeddings"] is False
    assert cfg["dflash_config"] == {"mask_token_id": None, "target_layer_ids": [1, 1]}
    assert cfg["dblast_config"]["num_categories"] == 4
    assert cfg["dblast_config"]["expander_width"] == 8 and cfg["dblast_config"]["mask"] == "learned"
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert {k for k in tensors if k.startswith("dblast.")} == {
        "dblast.mask_embedding", "dblast.expander.in_proj.weight",
        "dblast.expander.out_proj.weight", "dblast.prior.weight", "dblast.prior.bias"}
    assert tensors["dblast.expander.in_proj.weight"].shape == (4, 8, 40)  # per category (out, in)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (48, 40)
    dc2, dp2 = dflash.load_dflash(out, QWEN, num_categories=4, block_size=6)
    assert dc2.replace(name="x") == dc.replace(name="x")
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, dp, dp2)))
    # bfloat16 export stores exactly the rounded values
    out16 = dflash.export_drafter(dp, dc, str(tmp_path / "k4b"), dtype="bfloat16")
    t16 = load_file(os.path.join(out16, "model.safetensors"))
    assert t16["fc.weight"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        t16["fc.weight"], np.asarray(dp["fc"]["kernel"]).astype(ml_dtypes.bfloat16).T)


def test_export_overwrites_atomically(tmp_path):
    dc, dp = random_drafter(QWEN, mask_token_id=7)
    folder = str(tmp_path / "ex")
    dflash.export_drafter(dp, dc, folder)
    open(os.path.join(folder, "model-00002-of-00002.safetensors"), "wb").close()  # stale shard
    dp2 = jax.tree.map(lambda x: x + 1, dp)
    dflash.export_drafter(dp2, dc, folder)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["ex"]  # no temporary folders left behind
    _, back = dflash.load_dflash(folder, QWEN)
    np.testing.assert_array_equal(back["fc"]["kernel"], dp2["fc"]["kernel"])
    with pytest.raises(ValueError, match="'float32' or 'bfloat16'"):
        dflash.export_drafter(dp, dc, folder, dtype="int8")
    with pytest.raises(ValueError, match="drafter params lack expander/in_kernel"):
        dflash.export_drafter(dp, dc.replace(num_categories=2, expander_width=4), folder)


# ---- errors ---------------------------------------------------------------------------

def test_import_errors_are_clear(tmp_path):
    good = tmp_path / "good"
    write_dflash_folder(good)
    with pytest.raises(ValueError,
                       match="hidden_size 40 does not match the target's hidden_size 48"):
        dflash.load_dflash(str(good), LLAMA)
    with pytest.raises(ValueError, match="block-size-8 drafter, but block size 16"):
        dflash.load_dflash(str(good), QWEN, block_size=16)
    with pytest.raises(ValueError, match="K = 1 categories, but K = 4"):
        dflash.load_dflash(str(good), QWEN, num_categories=4)

    write_dflash_folder(tmp_path / "ids", target_layer_ids=(1, 9))
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 9\] .* do not fit the 4-layer"):
        dflash.load_dflash(str(tmp_path / "ids"), QWEN)
    write_dflash_folder(tmp_path / "deep", config_overrides={"num_target_layers": 36})
    with pytest.raises(ValueError, match="num_target_layers 36"):
        dflash.load_dflash(str(tmp_path / "deep"), QWEN)

    tensors = write_dflash_folder(tmp_path / "missing")
    del tensors["layers.1.self_attn.k_norm.weight"], tensors["norm.weight"]
    save_file(tensors, str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['norm.weight', "
                                         r"'layers.1.self_attn.k_norm.weight'\]"):
        dflash.load_dflash(str(tmp_path / "missing"), QWEN)

    tensors = write_dflash_folder(tmp_path / "shape")
    tensors["layers.0.mlp.up_proj.weight"] = np.zeros((40, 56), np.float32)
    save_file(tensors, str(tmp_path / "shape" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers.0.mlp.up_proj.weight has shape \(40, 56\).*"
                                         r"expects \(56, 40\)"):
        dflash.load_dflash(str(tmp_path / "shape"), QWEN)

    notdf = tmp_path / "qwen3_lm"
    notdf.mkdir()
    (notdf / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 40}))
    with pytest.raises(ValueError, match="not a DFlash checkpoint: config.json has architectures"):
        dflash.load_dflash(str(notdf), QWEN)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a DFlash checkpoint: no config.json"):
        dflash.load_dflash(str(tmp_path / "empty"), QWEN)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dflash.load_dflash(str(tmp_path / "nowhere"), QWEN)
    os.remove(good / "model.safetensors")
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        dflash.load_dflash(str(good), QWEN)


# ---- PyTorch module -------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _target(tc):
    tp = T.init_params(tc, 3)
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, tc.vocab_size)
    return tp, tokens


@pytest.mark.torch
@pytest.mark.parametrize("tiny", ["qwen3", "llama"])
@pytest.mark.parametrize("k,rank,causal", [(1, 0, False), (4, 0, False), (4, 4, False),
                                           (4, 0, True)])
def test_torch_module_matches_jax(tmp_path, tiny, k, rank, causal):
    """rank > 0: with a serial correction head; causal: with a causal block (JAX's
    drafting pass per slot); both teacher-forced on given previous tokens."""
    torch = pytest.importorskip("torch")
    from dblast_jax.io.torch_drafter import DBlastDrafterTorch

    tc = QWEN if tiny == "qwen3" else LLAMA
    more = dict(correction="previous-token", correction_rank=rank) if rank else {}
    if causal:
        more["block_attention"] = "causal"
    if k == 1:  # plain DFlash: token mask, no expander
        dc, dp = random_drafter(tc, seed=k, mask_token_id=tc.vocab_size - 2, **more)
    else:
        dc, dp = random_drafter(tc, seed=k, num_categories=4, expander_width=8, **more)
    tp, tokens = _target(tc)
    _, taps = T.forward(tp, tokens, config=tc, tap_layers=dc.target_layer_ids)
    anchors = jnp.array([5, 9], jnp.int32)
    anchor_tokens = tokens[jnp.arange(2), anchors]

    cache = D.init_draft_cache(dc, 2, 20)
    cache = D.append_context(dp, taps, jnp.zeros((2,), jnp.int32), cache, drafter_config=dc)
    h, prior = D.draft_hidden(dp, tp, anchor_tokens, anchors, cache, drafter_config=dc,
                              target_config=tc)
    logits = np.asarray(D.branch_logits(tp, h, tc))
    prev = None
    if rank or causal:
        prev = jax.random.randint(jax.random.key(5), (2, dc.block_size - 1), 0,
                                  tc.vocab_size).at[:, 0].set(anchor_tokens)
    if causal:  # slot i: the drafting pass over [anchor, prev[1:i], MASK ..]
        slots = []
        for i in range(1, dc.block_size):
            blk = jnp.concatenate([prev[:, :i], jnp.full((2, dc.block_size - i), -1)], 1)
            branch, _ = D.causal_pass(dp, tp, blk[:, None], anchors, cache, i,
                                      drafter_config=dc)
            slots.append(branch[:, 0])  # [2, K, H]
        logits = np.asarray(D.branch_logits(tp, jnp.stack(slots, 2), tc))
    if rank:  # lm_head(h) + silu(e(prev) W_p + h W_c) @ lm_head(W_o), the sampler's parts
        ctx, w_out = D.correction_parts(dp, h, drafter_config=dc)
        pre = D.correction_prev_features(dp, tp, prev, drafter_config=dc)[:, None] + ctx
        offset = jnp.einsum("bkjr,rv->bkjv", jax.nn.silu(pre), D.branch_logits(tp, w_out, tc))
        assert float(jnp.abs(offset).max()) > 1e-2  # the correction is exercised
        logits = logits + np.asarray(offset)

    folder = dflash.export_drafter(dp, dc, str(tmp_path / "export"))
    model = DBlastDrafterTorch.from_pretrained(folder)
    t = lambda a: torch.from_numpy(np.array(a))
    embed = t(tp["embed"]["embedding"])
    head = embed if tc.tie_word_embeddings else t(tp["lm_head"]["kernel"]).T
    with torch.no_grad():
        t_logits, t_prior = model(t(taps), t(anchor_tokens), t(anchors), embed, head,
                                  prev_tokens=None if prev is None else t(prev))
    assert tuple(t_logits.shape) == logits.shape == (2, k, dc.block_size - 1, tc.vocab_size)
    assert float(np.abs(t_logits.numpy() - logits).max()) <= 1e-4
    assert float(np.abs(t_prior.numpy() - np.asarray(prior)).max()) <= 1e-4
    if k > 1:
        assert float(np.abs(np.asarray(prior)).max()) > 1e-2  # the prior is exercised
    # the context cut is real: changing a visible feature changes the torch output
    with torch.no_grad():
        extra = dict(prev_tokens=None if prev is None else t(prev))
        bumped, _ = model(t(taps.at[:, 2].add(1.0)), t(anchor_tokens), t(anchors), embed, head,
                          **extra)
        hidden, _ = model(t(taps.at[:, 9:].add(1.0)), t(anchor_tokens), t(anchors), embed, head,
                          **extra)
    assert float((bumped - t_logits).abs().max()) > 1e-3
    assert float((hidden - t_logits).abs().max()) == 0.0


@pytest.mark.torch
def test_torch_module_errors(tmp_path):
    pytest.importorskip("torch")
    from dblast_jax.io.torch_drafter import DBlastDrafterTorch

    with pytest.raises(ValueError, match="no config.json"):
        DBlastDrafterTorch.from_pretrained(str(tmp_path))
    tensors = write_dflash_folder(tmp_path / "ck")
    del tensors["fc.weight"]
    save_file(tensors, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['fc.weight'\]"):
        DBlastDrafterTorch.from_pretrained(str(tmp_path / "ck"))
