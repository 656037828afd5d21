"""The DBlast drafter: layout, masking, train == inference, K = 1 == DFlash, sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T

B, CTX, BLOCK = 2, 14, 5


# ---- helpers --------------------------------------------------------------------------

def random_params(abstract, seed: int):
    """Every leaf random and O(1)-effective (norm scales around 1, kernels ~ 1/sqrt(in)),
    so a wrong mask or a swapped weight changes outputs by a lot, not by 1e-6.
    (numpy on the host: no per-shape XLA compilations.)"""
    gen = np.random.default_rng(seed)

    def leaf(a):
        z = gen.standard_normal(a.shape, np.float32)
        z = 1.0 + 0.3 * z if len(a.shape) == 1 else z / np.sqrt(a.shape[-2])
        return jnp.asarray(z.astype(np.dtype(a.dtype)))

    return jax.tree.map(leaf, abstract)


def make(target_config, seed=0, **kw):
    kw.setdefault("num_layers", 2)
    kw.setdefault("block_size", BLOCK)
    dc = DrafterConfig.for_target(target_config, **kw)
    dp = random_params(D.abstract_drafter_params(dc, target_config), seed)
    return dc, dp


@functools.lru_cache(maxsize=None)
def target_params(tc: TargetConfig, dtype=jnp.float32):
    """Random target weights drawn on the host (eager `T.init_params` is slow on CPU)."""
    return random_params(T.abstract_params(tc, dtype), 7)


def random_taps(dc, b=B, t=CTX, seed=1):
    return jax.random.normal(jax.random.key(seed),
                             (b, t, len(dc.target_layer_ids), dc.hidden_size), jnp.float32)


def random_tokens(tc, b=B, t=CTX, seed=2):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, tc.vocab_size)


train_j = jax.jit(D.train_hidden, static_argnames=("drafter_config", "target_config"))
draft_j = jax.jit(D.draft_hidden, static_argnames=("drafter_config", "target_config"))
append_j = jax.jit(D.append_context, static_argnames=("drafter_config",))


def _windows(x, starts, width=7):
    """x [B, T, ...] -> per-row windows x[b, starts[b] : starts[b] + width]."""
    idx = jnp.asarray(starts)[:, None] + jnp.arange(width)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def infer(dc, tc, dp, tp, taps, tokens, anchors, cache_size=24):
    """Inference pass for anchors [B] (one per row). The cache is filled the way a
    sampler fills it: garbage first (stale entries, as after rejected drafts), then the
    real features in width-7 windows at per-row start positions, some rewritten."""
    assert taps.shape[1] == CTX == 14
    b = taps.shape[0]
    cache = D.init_draft_cache(dc, b, cache_size)
    garbage = 5.0 * random_taps(dc, b, 7, seed=99)
    for start, feats in (([7, 7], garbage), ([14, 14], garbage), ([0, 0], taps[:, :7]),
                         ([7, 4], _windows(taps, [7, 4])), ([7, 7], _windows(taps, [7, 7]))):
        cache = append_j(dp, feats, jnp.array(start, jnp.int32), cache, drafter_config=dc)
    np.testing.assert_array_equal(cache.lengths, [14, 14])
    anchors = jnp.asarray(anchors, jnp.int32)
    anchor_tokens = tokens[jnp.arange(b), anchors]
    return draft_j(dp, tp, anchor_tokens, anchors, cache, drafter_config=dc, target_config=tc)


@pytest.fixture(scope="module")
def k4():
    tc = TargetConfig.tiny_qwen3()
    dc, dp = make(tc, num_categories=4, expander_width=8)
    return tc, dc, dp, target_params(tc)


# ---- layout ---------------------------------------------------------------------------

def test_param_layout_and_symmetry_breaking_init():
    tc = TargetConfig.tiny_qwen3()
    dc1 = DrafterConfig.for_target(tc, num_layers=2, mask_token_id=100)
    p1 = D.init_drafter_params(dc1, tc, 0)
    assert set(p1) == {"fc", "hidden_norm", "layers", "final_norm"}
    assert p1["fc"]["kernel"].shape == (2 * tc.hidden_size, tc.hidden_size)
    assert set(p1["layers"]) == {0, 1}
    attn = p1["layers"][0]["attn"]
    assert attn["q_norm"]["scale"].shape == (tc.head_dim,)  # Qwen3-style q/k norm
    assert attn["k_proj"]["kernel"].shape == (tc.hidden_size, tc.num_kv_heads * tc.head_dim)

    dc4 = DrafterConfig.for_target(tc, num_layers=1, num_categories=4, expander_width=8)
    p4 = D.init_drafter_params(dc4, tc, 0)
    assert p4["mask_embedding"].shape == (tc.hidden_size,)
    assert p4["expander"]["in_kernel"].shape == (4, tc.hidden_size, 8)
    assert p4["expander"]["out_kernel"].shape == (4, 8, tc.hidden_size)
    assert p4["prior"]["kernel"].shape == (tc.hidden_size, 4)
    ex = p4["expander"]
    for name in ("in_kernel", "out_kernel"):  # every category drawn independently
        w = np.asarray(ex[name])
        assert all(not np.allclose(w[i], w[j]) for i in range(4) for j in range(i))
        assert np.abs(w).max() > 0
    assert np.all(np.asarray(p4["prior"]["kernel"]) == 0)  # uniform prior at init
    abstract = D.abstract_drafter_params(dc4, tc, jnp.bfloat16)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == \
        jax.tree.map(lambda a: (a.shape, jnp.bfloat16), p4)
    assert bool(jnp.any(p4["mask_embedding"] != 0))
    assert 0.015 < float(jnp.std(p4["layers"][0]["mlp"]["up_proj"]["kernel"])) < 0.025
    assert bool(jnp.all(p4["final_norm"]["scale"] == 1))
    again, other = D.init_drafter_params(dc4, tc, 0), D.init_drafter_params(dc4, tc, 1)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, p4, again)))
    assert not np.array_equal(p4["fc"]["kernel"], other["fc"]["kernel"])


def test_branches_differ_at_init(k4):
    """Freshly initialised expander -> distinct branches through the real forward pass."""
    tc, dc, _, tp = k4
    dp = D.init_drafter_params(dc, tc, 3)
    taps, tokens = random_taps(dc), random_tokens(tc)
    bh, prior = train_j(dp, tp, taps, tokens, jnp.array([[3], [7]]), drafter_config=dc,
                        target_config=tc)
    assert bh.shape == (B, 1, 4, dc.block_size - 1, tc.hidden_size)
    assert prior.shape == (B, 1, 4) and prior.dtype == jnp.float32
    np.testing.assert_array_equal(prior, np.zeros((B, 1, 4)))  # zero prior head
    assert float(jnp.abs(bh[:, :, 0] - bh[:, :, 1]).max()) > 1e-3


# ---- masking --------------------------------------------------------------------------

def test_blocks_never_see_context_at_or_after_anchor(k4):
    tc, dc, dp, tp = k4
    taps, tokens = random_taps(dc), random_tokens(tc)
    anchors = jnp.array([[0, 3, 6, 9, 13], [1, 5, 6, 7, 12]])
    base_h, base_p = train_j(dp, tp, taps, tokens, anchors, drafter_config=dc,
                             target_config=tc)
    cut = 6
    noisy = taps.at[:, cut:].add(3.0 * random_taps(dc, seed=5)[:, cut:])
    h, p = train_j(dp, tp, noisy, tokens, anchors, drafter_config=dc, target_config=tc)
    for row in range(B):
        for j in range(anchors.shape[1]):
            same_h = np.array_equal(h[row, j], base_h[row, j])
            same_p = np.array_equal(p[row, j], base_p[row, j])
            if anchors[row, j] <= cut:  # context at >= cut is at/after the anchor
                assert same_h and same_p, (row, j)
            else:  # context < anchor was perturbed: the block must notice
                assert not same_h and not same_p, (row, j)

    # inference: garbage in the cache at and after the anchor is invisible
    s = jnp.array([5, 9])
    h0, p0 = infer(dc, tc, dp, tp, taps, tokens, s)
    noisy = taps.at[0, 5:].add(7.0).at[1, 9:].add(7.0)
    h1, p1 = infer(dc, tc, dp, tp, noisy, tokens, s)
    np.testing.assert_array_equal(h0, h1)
    np.testing.assert_array_equal(p0, p1)
    noisy = taps.at[:, 4].add(1.0)  # position 4 < both anchors: visible to both rows
    h2, _ = infer(dc, tc, dp, tp, noisy, tokens, s)
    assert all(not np.allclose(h2[r], h0[r]) for r in range(B))


def test_every_block_position_sees_the_whole_block(k4):
    tc, dc, dp, tp = k4
    model = D._module(dp, dc)
    taps = random_taps(dc)
    feats = D._features(model, taps, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(CTX), (B, CTX))
    ctx_kv = [l.attn.keys_values(feats, pos, D._inv_freq(dc)) for l in model.layers]
    anchors = jnp.array([[4], [8]])
    visible = jnp.arange(CTX)[None, None, :] < anchors[:, :, None]
    x = jax.random.normal(jax.random.key(3), (B, 1, BLOCK, tc.hidden_size))
    fwd = jax.jit(lambda x: D._blocks_forward(model, dc, x, anchors, ctx_kv, visible))
    base = np.asarray(fwd(x))
    for j in range(BLOCK):  # perturb one slot: every slot (before and after it) changes
        out = np.asarray(fwd(x.at[:, :, j].add(1.0)))
        diff = np.abs(out - base).max(axis=-1)  # [B, 1, b]
        assert np.all(diff > 1e-4), (j, diff)
    # public API: the prior reads the anchor slot, which sees the (learned) MASK slots
    tokens = random_tokens(tc)
    _, p0 = train_j(dp, tp, taps, tokens, anchors, drafter_config=dc, target_config=tc)
    dp2 = dict(dp, mask_embedding=dp["mask_embedding"] + 0.5)
    _, p1 = train_j(dp2, tp, taps, tokens, anchors, drafter_config=dc, target_config=tc)
    assert not np.allclose(p0, p1)


# ---- train pass == inference pass ----------------------------------------------------

@pytest.mark.parametrize("tiny", ["qwen3", "llama"])
def test_train_pass_equals_inference_pass(tiny, k4):
    if tiny == "qwen3":
        tc, dc, dp, tp = k4
    else:
        tc = TargetConfig.tiny_llama()
        dc, dp = make(tc, num_categories=3, expander_width=6, seed=4)
        tp = target_params(tc)
    taps, tokens = random_taps(dc), random_tokens(tc)
    anchors = jnp.array([[0, 5, 9, 13], [2, 7, 8, 11]])
    th, tpri = train_j(dp, tp, taps, tokens, anchors, drafter_config=dc, target_config=tc)
    tlog = D.branch_logits(tp, th, tc)
    for j in range(anchors.shape[1]):
        ih, ipri = infer(dc, tc, dp, tp, taps, tokens, anchors[:, j])
        np.testing.assert_allclose(ih, th[:, j], atol=2e-5, rtol=0)
        np.testing.assert_allclose(ipri, tpri[:, j], atol=2e-5, rtol=0)
        np.testing.assert_allclose(D.branch_logits(tp, ih, tc), tlog[:, j], atol=1e-4, rtol=0)


# ---- K = 1 is DFlash; equal offsets give equal branches -----------------------------

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, d, theta):  # x [T, N, D]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None, None] * inv
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def dflash_reference(dp, tp, tc, dc, taps, anchor_token, s):
    """Plain DFlash forward for one row in float64, written from docs/METHOD.md section 2:
    keys/values = [context features < s ; block], non-causal, same k/v projections."""
    f = lambda a: np.asarray(a, np.float64)
    eps, d = dc.rms_norm_eps, dc.head_dim
    nq, nkv, b = dc.num_heads, dc.num_kv_heads, dc.block_size
    ctx = f(taps)[:s].reshape(s, dc.hidden_size * len(dc.target_layer_ids)) @ f(dp["fc"]["kernel"])
    ctx = _rms(ctx, f(dp["hidden_norm"]["scale"]), eps)
    emb = f(tp["embed"]["embedding"])
    x = np.stack([emb[anchor_token]] + [emb[dc.mask_token_id]] * (b - 1))
    pos_c, pos_b = np.arange(s), s + np.arange(b)
    for i in range(dc.num_layers):
        L = jax.tree.map(f, dp["layers"][i])
        a = L["attn"]
        h = _rms(x, L["input_norm"]["scale"], eps)
        q = _rms((h @ a["q_proj"]["kernel"]).reshape(b, nq, d), a["q_norm"]["scale"], eps)
        kin = np.concatenate([ctx, h])
        k = _rms((kin @ a["k_proj"]["kernel"]).reshape(s + b, nkv, d), a["k_norm"]["scale"], eps)
        v = (kin @ a["v_proj"]["kernel"]).reshape(s + b, nkv, d)
        q = _rope(q, pos_b, d, dc.rope_theta)
        k = _rope(k, np.concatenate([pos_c, pos_b]), d, dc.rope_theta)
        out = np.zeros((b, nq, d))
        for n in range(nq):
            g = n // (nq // nkv)
            sc = q[:, n] @ k[:, g].T / np.sqrt(d)
            w = np.exp(sc - sc.max(-1, keepdims=True))
            out[:, n] = (w / w.sum(-1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(b, nq * d) @ a["o_proj"]["kernel"]
        m = L["mlp"]
        hm = _rms(x, L["post_attn_norm"]["scale"], eps)
        gate = hm @ m["gate_proj"]["kernel"]
        act = (gate / (1 + np.exp(-gate))) * (hm @ m["up_proj"]["kernel"])
        x = x + act @ m["down_proj"]["kernel"]
    u = _rms(x, f(dp["final_norm"]["scale"]), eps)
    head = emb.T if tc.tie_word_embeddings else f(tp["lm_head"]["kernel"])
    return u[1:] @ head


def test_k1_without_expander_is_plain_dflash():
    tc = TargetConfig.tiny_qwen3()
    dc, dp = make(tc, mask_token_id=tc.vocab_size - 1, seed=11)
    assert "expander" not in dp and "prior" not in dp and "mask_embedding" not in dp
    tp = target_params(tc)
    taps, tokens = random_taps(dc), random_tokens(tc)
    anchors = jnp.array([[0, 6, 11], [3, 4, 13]])
    th, tpri = train_j(dp, tp, taps, tokens, anchors, drafter_config=dc, target_config=tc)
    assert th.shape == (B, 3, 1, BLOCK - 1, tc.hidden_size)
    np.testing.assert_array_equal(tpri, np.zeros((B, 3, 1)))
    logits = np.asarray(D.branch_logits(tp, th, tc))
    for r in range(B):
        for j in range(3):
            s = int(anchors[r, j])
            ref = dflash_reference(dp, tp, tc, dc, taps[r], int(tokens[r, s]), s)
            np.testing.assert_allclose(logits[r, j, 0], ref, atol=1e-4, rtol=1e-4)
    ih, _ = infer(dc, tc, dp, tp, taps, tokens, anchors[:, 1])
    np.testing.assert_allclose(D.branch_logits(tp, ih, tc)[:, 0], logits[:, 1, 0], atol=1e-4)


def test_equal_offsets_give_identical_branches(k4):
    tc, dc, dp, tp = k4
    ex = dp["expander"]
    same = {"in_kernel": jnp.broadcast_to(ex["in_kernel"][1], ex["in_kernel"].shape),
            "out_kernel": jnp.broadcast_to(ex["out_kernel"][1], ex["out_kernel"].shape)}
    taps, tokens = random_taps(dc), random_tokens(tc)
    anchors = jnp.array([[2, 9], [5, 12]])
    h, _ = train_j(dict(dp, expander=same), tp, taps, tokens, anchors, drafter_config=dc,
                   target_config=tc)
    for z in range(1, 4):
        np.testing.assert_array_equal(h[:, :, z], h[:, :, 0])
    h_distinct, _ = train_j(dp, tp, taps, tokens, anchors, drafter_config=dc,
                            target_config=tc)
    assert not np.allclose(h_distinct[:, :, 1], h_distinct[:, :, 0], atol=1e-3)
    # zero offsets reduce every branch to the K = 1 (DFlash) hidden state
    zero = jax.tree.map(jnp.zeros_like, ex)
    h0, _ = train_j(dict(dp, expander=zero), tp, taps, tokens, anchors, drafter_config=dc,
                    target_config=tc)
    dc1 = dc.replace(num_categories=1, expander_width=0)
    dp1 = {k: v for k, v in dp.items() if k not in ("expander", "prior")}
    h1, _ = train_j(dp1, tp, taps, tokens, anchors, drafter_config=dc1, target_config=tc)
    for z in range(4):
        np.testing.assert_array_equal(h0[:, :, z], h1[:, :, 0])


def test_select_branch_and_logits(k4):
    tc, dc, dp, tp = k4
    taps, tokens = random_taps(dc), random_tokens(tc)
    h, prior = infer(dc, tc, dp, tp, taps, tokens, jnp.array([4, 9]))
    assert h.shape == (B, 4, BLOCK - 1, tc.hidden_size) and prior.shape == (B, 4)
    sel = D.select_branch(h, jnp.array([2, 0]))
    np.testing.assert_array_equal(sel[0], h[0, 2])
    np.testing.assert_array_equal(sel[1], h[1, 0])
    logits = D.branch_logits(tp, sel, tc)
    assert logits.shape == (B, BLOCK - 1, tc.vocab_size) and logits.dtype == jnp.float32


def test_bfloat16_params_run():
    tc = TargetConfig.tiny_llama()
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4, num_categories=2)
    dp = D.init_drafter_params(dc, tc, 0, jnp.bfloat16)
    tp = target_params(tc, jnp.bfloat16)
    taps = random_taps(dc).astype(jnp.bfloat16)
    h, prior = train_j(dp, tp, taps, random_tokens(tc), jnp.array([[3], [5]]),
                       drafter_config=dc, target_config=tc)
    assert h.dtype == jnp.bfloat16 and prior.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(h.astype(jnp.float32))))


# ---- sharding -------------------------------------------------------------------------

def test_sharded_forward_equals_single_device(k4):
    tc, dc, dp, tp = k4
    assert len(jax.devices()) == 8
    # Auto axes: GSPMD propagates shardings (an Explicit mesh would need out_sharding
    # annotations on every contraction).
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    specs = D.drafter_partition_specs(dp, mesh)
    assert specs["layers"][0]["attn"]["q_proj"]["kernel"] == P("fsdp", "tensor")
    assert specs["layers"][0]["attn"]["o_proj"]["kernel"] == P("tensor", "fsdp")
    assert specs["final_norm"]["scale"] == P()
    assert specs["expander"]["in_kernel"] == P(None, "fsdp", "tensor")
    # indivisible dims are replicated: K = 3 categories on a 2-way axis, odd hidden
    odd = {"prior": {"kernel": jax.ShapeDtypeStruct((41, 3), jnp.float32)}}
    assert D.drafter_partition_specs(odd, mesh)["prior"]["kernel"] == P()
    with pytest.raises(ValueError, match="no partition rule"):
        D.drafter_partition_specs({"mystery": jnp.zeros((4, 4))}, mesh)

    sdp = D.shard_drafter_params(dp, mesh)
    assert not sdp["layers"][0]["mlp"]["up_proj"]["kernel"].sharding.is_fully_replicated
    rep = NamedSharding(mesh, P())
    stp = jax.device_put(tp, rep)
    taps, tokens = random_taps(dc), random_tokens(tc)
    data = NamedSharding(mesh, P("data"))
    anchors = jnp.array([[1, 6, 10], [4, 8, 13]])
    want_h, want_p = train_j(dp, tp, taps, tokens, anchors, drafter_config=dc, target_config=tc)
    got_h, got_p = train_j(sdp, stp, jax.device_put(taps, data), jax.device_put(tokens, data),
                           jax.device_put(anchors, data), drafter_config=dc, target_config=tc)
    np.testing.assert_allclose(got_h, want_h, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_p, want_p, atol=1e-5, rtol=0)

    cache = D.init_draft_cache(dc, B, 16)
    want_c = append_j(dp, taps, jnp.zeros((B,), jnp.int32), cache, drafter_config=dc)
    got_c = append_j(sdp, jax.device_put(taps, data),
                     jax.device_put(jnp.zeros((B,), jnp.int32), data),
                     jax.device_put(cache, data), drafter_config=dc)
    s = jnp.array([6, 13])
    want = draft_j(dp, tp, tokens[:, 3], s, want_c, drafter_config=dc, target_config=tc)
    got = draft_j(sdp, stp, jax.device_put(tokens[:, 3], data), jax.device_put(s, data),
                  got_c, drafter_config=dc, target_config=tc)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


# ---- errors ---------------------------------------------------------------------------

def test_errors_are_clear():
    qwen, llama = TargetConfig.tiny_qwen3(), TargetConfig.tiny_llama()
    dc = DrafterConfig.for_target(qwen, num_layers=2, block_size=4)
    with pytest.raises(ValueError, match="hidden_size 40 does not match .* 48"):
        D.init_drafter_params(dc, llama)
    with pytest.raises(ValueError, match="4-layer target, but .* 3 layers"):
        D.check_drafter_fits_target(dc.replace(hidden_size=48), llama)
    with pytest.raises(ValueError, match="out of range"):
        DrafterConfig.for_target(qwen, target_layer_ids=(1, 7))
    with pytest.raises(ValueError, match="mask_token_id 500"):
        D.check_drafter_fits_target(dc.replace(mask_token_id=500), qwen)
    dp = D.init_drafter_params(dc, qwen)
    with pytest.raises(ValueError, match=r"taps must be \[B, T, 2, 40\]"):
        D.context_features(dp, jnp.zeros((1, 3, 3, 40)), drafter_config=dc)
    cache = D.init_draft_cache(dc, 1, 8)
    with pytest.raises(ValueError, match="overflows the draft cache of size 8"):
        D.append_context(dp, jnp.zeros((1, 4, 2, 40)), jnp.array([6]), cache,
                         drafter_config=dc)
    # chex at the entry (trace time): the function, the argument and the shapes are named
    with pytest.raises(AssertionError, match=r"append_context: positions must be \[batch\]"):
        D.append_context(dp, jnp.zeros((1, 4, 2, 40)), jnp.array([0, 0]), cache,
                         drafter_config=dc)
    with pytest.raises(AssertionError, match="taps .* must be floating point"):
        D.context_features(dp, jnp.zeros((1, 3, 2, 40), jnp.int32), drafter_config=dc)
    with pytest.raises(AssertionError, match=r"draft_hidden: anchor_positions must be"):
        D.draft_hidden(dp, {}, jnp.zeros((1,), jnp.int32), jnp.zeros((2,), jnp.int32), cache,
                       drafter_config=dc, target_config=qwen)
    with pytest.raises(AssertionError, match=r"draft_hidden: every KV cache buffer"):
        D.draft_hidden(dp, {}, jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), cache,
                       drafter_config=dc, target_config=qwen)
    with pytest.raises(AssertionError, match=r"train_hidden: anchors must have batch 1"):
        D.train_hidden(dp, {}, jnp.zeros((1, 3, 2, 40)), jnp.zeros((1, 3), jnp.int32),
                       jnp.zeros((2, 1), jnp.int32), drafter_config=dc, target_config=qwen)
    with pytest.raises(AssertionError, match=r"select_branch: branch must be \[batch\]"):
        D.select_branch(jnp.zeros((2, 4, 3, 40)), jnp.zeros((3,), jnp.int32))
