"""Training levers of the recipe (issue 14). Distillation from the target's top-k
distribution: the chunked teacher, the student's log q at the teacher's ids and the
truncated soft CE / KL against brute-force numpy; the trainer's live and feature-cache
paths agree, and the term trains. Warm start from the target's layers."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax

from dblast_jax import losses
from dblast_jax.chunked_logits import teacher_topk, token_logprobs
from dblast_jax.train import distill
from dblast_jax.train import step as step_lib
from dblast_jax.train import trainer as TR
from conftest import corpus_cfg as _cfg, train_quietly as _train  # `corpus`: a conftest fixture
from conftest import limit_traces


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("layout", ["vh", "hv"])
@pytest.mark.parametrize("chunk", [7, 16, 100])
def test_teacher_topk_is_the_exact_top_k(layout, chunk):
    rng = np.random.default_rng(0)
    v, h, k = 37, 8, 5
    hid = rng.normal(size=(3, 4, h)).astype(np.float32)
    w = rng.normal(size=(v, h)).astype(np.float32)
    head = w if layout == "vh" else w.T
    got = teacher_topk(jnp.asarray(hid), jnp.asarray(head), layout, k, temperature=0.7,
                       chunk_size=chunk)
    ref = _log_softmax(hid @ w.T / 0.7)
    want_ids = np.argsort(-ref, axis=-1)[..., :k]
    np.testing.assert_array_equal(np.asarray(got.ids), want_ids)
    np.testing.assert_allclose(np.asarray(got.logprob),
                               np.take_along_axis(ref, want_ids, -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="top-k"):
        teacher_topk(jnp.asarray(hid), jnp.asarray(head), layout, v + 1)


def test_teacher_from_final_is_shifted_to_the_predicted_position():
    rng = np.random.default_rng(1)
    final = jnp.asarray(rng.normal(size=(2, 6, 8)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(30, 8)).astype(np.float32))
    t = distill.teacher_from_final(final, w, "vh", 4, 1.0, chunk_size=8)
    assert t.ids.shape == (2, 6, 4)
    direct = teacher_topk(final[:, 2], w, "vh", 4)
    np.testing.assert_array_equal(np.asarray(t.ids[:, 3]), np.asarray(direct.ids))
    assert np.all(np.asarray(t.logp[:, 0]) < -1e8)  # position 0: no teacher


def test_student_logq_at_ids_is_the_log_softmax():
    rng = np.random.default_rng(2)
    b, a, kz, p, h, v, k = 2, 3, 2, 4, 8, 25, 6
    hid = rng.normal(size=(b, a, kz, p, h)).astype(np.float32)
    w = rng.normal(size=(v, h)).astype(np.float32)
    labels = rng.integers(0, v, size=(b, a, kz, p))
    ids = rng.integers(0, v, size=(b, a, p, k))
    label_logq = token_logprobs(jnp.asarray(hid), jnp.asarray(w), "vh", jnp.asarray(labels),
                                1.0, 8).logprob
    for layout, head in (("vh", w), ("hv", w.T)):
        got = distill.student_logq_at(jnp.asarray(hid), jnp.asarray(head), layout,
                                      jnp.asarray(ids), jnp.asarray(labels), label_logq)
        ref = _log_softmax(hid @ w.T)  # [b, a, kz, p, v]
        want = np.take_along_axis(ref, np.broadcast_to(ids[:, :, None], (b, a, kz, p, k)), -1)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def _brute_distill(logq_full, prior_logits, labels, tids, tlogp, mask, weights):
    """Per-anchor (ce, kl) written out with loops: the mixture conditional Q_i given the
    data prefix over the full vocabulary, then coarsened to the teacher's ids + tail."""
    b, a, kz, p, v = logq_full.shape
    ce = np.zeros((b, a))
    kl = np.zeros((b, a))
    for bi in range(b):
        for ai in range(a):
            log_pi = _log_softmax(prior_logits[bi, ai])
            post = log_pi.copy()
            for i in range(p):
                if not mask[bi, ai, i]:
                    continue
                w_post = np.exp(post - np.logaddexp.reduce(post))
                q = (w_post[:, None] * np.exp(logq_full[bi, ai, :, i])).sum(0)  # [v]
                ids, pt = tids[bi, ai, i], np.exp(tlogp[bi, ai, i])
                p_tail, q_tail = max(1 - pt.sum(), 0.0), max(1 - q[ids].sum(), 1e-6)
                c = -(pt @ np.log(q[ids]) + p_tail * np.log(q_tail))
                ent = -(pt @ np.log(pt) + (p_tail * np.log(p_tail) if p_tail > 0 else 0.0))
                wi = 1.0 if weights is None else weights[i]
                ce[bi, ai] += wi * c
                kl[bi, ai] += wi * (c - ent)
                post = post + logq_full[bi, ai, :, i, labels[bi, ai, i]]
    return ce, kl


@pytest.mark.parametrize("kz", [1, 3])
def test_topk_distill_matches_brute_force(kz):
    rng = np.random.default_rng(3 + kz)
    b, a, p, v, k = 2, 3, 4, 12, 4
    logq_full = _log_softmax(rng.normal(size=(b, a, kz, p, v)) * 2)
    prior = rng.normal(size=(b, a, kz))
    labels = rng.integers(0, v, size=(b, a, p))
    teacher = _log_softmax(rng.normal(size=(b, a, p, v)) * 2)
    tids = np.argsort(-teacher, -1)[..., :k]
    tlogp = np.take_along_axis(teacher, tids, -1)
    mask = np.ones((b, a, p), bool)
    mask[0, 1, 2:] = False
    mask[1, 2] = False
    logq = np.take_along_axis(logq_full, np.broadcast_to(labels[:, :, None, :, None],
                                                         (b, a, kz, p, 1)), -1)[..., 0]
    logq_ids = np.take_along_axis(logq_full, np.broadcast_to(tids[:, :, None],
                                                             (b, a, kz, p, k)), -1)
    weights = np.exp(-np.arange(p) / 3.0)
    for w in (None, weights):
        ce, kl = losses.topk_distill_per_anchor(jnp.asarray(logq_ids), jnp.asarray(tlogp),
                                                jnp.asarray(logq), jnp.asarray(prior),
                                                jnp.asarray(mask), w)
        want_ce, want_kl = _brute_distill(logq_full, prior, labels, tids, tlogp, mask, w)
        np.testing.assert_allclose(np.asarray(ce), want_ce, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(kl), want_kl, rtol=1e-4, atol=1e-5)
    # the KL of a student that equals the teacher on the kept ids is ~0
    same = np.broadcast_to(tlogp[:, :, None], logq_ids.shape)
    _, kl0 = losses.topk_distill_per_anchor(jnp.asarray(same), jnp.asarray(tlogp),
                                            jnp.zeros((b, a, kz, p)), jnp.asarray(prior))
    np.testing.assert_allclose(np.asarray(kl0), 0.0, atol=1e-4)
    grads = jax.grad(lambda x: jnp.sum(losses.topk_distill_per_anchor(
        x, jnp.asarray(tlogp), jnp.asarray(logq), jnp.asarray(prior), jnp.asarray(mask))[0])
    )(jnp.asarray(logq_ids))
    assert np.all(np.isfinite(np.asarray(grads)))


def test_distillation_trains_and_cached_teacher_equals_live(corpus, tmp_path,  # noqa: F811
                                                           monkeypatch):
    more = ("distill_weight=1.0", "distill_topk=8", "num_steps=6", "checkpoint_every=6")
    # The train step is traced once per run: all 6 steps reuse the first step's program
    # (chex.assert_max_traces on the loss inside the step fails at a second trace). No
    # other test uses this step config, so `compiled_train_step` builds it afresh here.
    traces = limit_traces(monkeypatch, step_lib, "loss_terms", n=1)
    live = _train(_cfg(corpus, *more), tmp_path / "live")
    assert len(traces) == 1
    monkeypatch.undo()
    cached = _train(_cfg(corpus, *more, f"feature_cache={tmp_path / 'fc'}"),
                    tmp_path / "cached")
    for a, b in zip(live.history, cached.history):
        for key in ("loss", "distill_ce", "distill_kl"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, err_msg=key)
    kl = [h["distill_kl"] for h in live.history]
    assert all(np.isfinite(kl)) and kl[-1] < kl[0]
    plain = _train(_cfg(corpus, "num_steps=6", "checkpoint_every=6"), tmp_path / "plain")
    assert "distill_kl" not in plain.history[0]
    assert live.history[0]["loss"] > plain.history[0]["loss"]  # the extra term is counted
    (sub,) = [d for d in (tmp_path / "fc").iterdir()]
    assert (sub / "teacher_ids.npy").exists()


def test_distillation_needs_a_cache_with_the_teacher(corpus, tmp_path):  # noqa: F811
    _train(_cfg(corpus, f"feature_cache={tmp_path / 'fc'}", "num_steps=1"), tmp_path / "a")
    # the teacher changes the cache key: a distillation run builds its own cache
    _train(_cfg(corpus, f"feature_cache={tmp_path / 'fc'}", "num_steps=1",
                "distill_weight=0.5", "distill_topk=4"), tmp_path / "b")
    assert len(list((tmp_path / "fc").iterdir())) == 2
    with pytest.raises(ValueError, match="distill_topk"):
        _cfg(corpus, "distill_topk=0")
    with pytest.raises(ValueError, match="distill_weight"):
        _cfg(corpus, "distill_weight=-1")
    assert TR.target_features  # the plain API is kept


def test_warm_start_copies_the_layer_after_the_deepest_tap(corpus, tmp_path):  # noqa: F811
    from dblast_jax.train import warm_start
    from conftest import tiny_target
    cfg = _cfg(corpus, "drafter_init=target", "num_steps=1")
    trainer = TR.Trainer(cfg, str(tmp_path / "w"), target=tiny_target(), progress=False,
                         log=lambda s: None)
    tcfg, tparams, _ = tiny_target()
    dcfg = trainer.drafter_config
    params = jax.device_get(trainer.state.params)
    src = warm_start.source_layers(dcfg, tcfg)[0]
    assert src == min(max(dcfg.target_layer_ids) + 1, tcfg.num_layers - 1)
    tl, dl = tparams["layers"][src], params["layers"][0]
    for a, b in (("attn", "q_proj"), ("attn", "o_proj"), ("mlp", "down_proj")):
        np.testing.assert_array_equal(dl[a][b]["kernel"], tl[a][b]["kernel"])
    np.testing.assert_array_equal(params["final_norm"]["scale"], tparams["final_norm"]["scale"])
    np.testing.assert_array_equal(params["hidden_norm"]["scale"], tl["input_norm"]["scale"])
    h = tcfg.hidden_size
    np.testing.assert_array_equal(params["fc"]["kernel"][-h:], np.eye(h))
    result = trainer.run()
    trainer.close()
    assert np.isfinite(result.history[-1]["loss"])
    with pytest.raises(ValueError, match="drafter_init"):
        _cfg(corpus, "drafter_init=copy")


def test_warm_start_from_a_k1_drafter_copies_its_trunk_into_k4(corpus, tmp_path):  # noqa: F811
    """drafter_init=drafter:WORKDIR (or an export folder): a K = 4 run starts from a trained
    K = 1 drafter's tensors, its category heads from their own initialisation."""
    from dblast_jax.train import restore, warm_start
    from conftest import tiny_target

    def trainer(cfg, name):
        return TR.Trainer(cfg, str(tmp_path / name), target=tiny_target(), progress=False,
                          log=lambda s: None)

    _train(_cfg(corpus, "num_steps=1", "checkpoint_every=1"), tmp_path / "k1")
    src = warm_start._flat(restore.restore_drafter(str(tmp_path / "k1"),
                                                   log=lambda s: None).params_host())
    restore.export_workdir(str(tmp_path / "k1"), str(tmp_path / "k1_export"),
                           log=lambda s: None)
    for spec in ("k1", "k1_export"):
        t = trainer(_cfg(corpus, "loss=nll", "num_categories=4", "num_steps=1",
                         "checkpoint_every=1",
                         f"drafter_init=drafter:{tmp_path / spec}"), f"k4_from_{spec}")
        got = warm_start._flat(jax.device_get(t.state.params))
        new = set(got) - set(src)
        assert new and all(k.split("/")[0] in ("expander", "prior") for k in new), new
        for key, value in src.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        np.testing.assert_array_equal(got["prior/kernel"], 0)
        if spec == "k1":
            t.run()  # a K = 4 checkpoint for the refusal below
        t.close()
    # another trunk (other taps) and K = 4 -> K = 1 are refused, naming the difference
    with pytest.raises(ValueError, match="target_layer_ids"):
        trainer(_cfg(corpus, "target_layer_ids=0", "num_steps=1",
                     f"drafter_init=drafter:{tmp_path / 'k1'}"), "other_taps")
    with pytest.raises(ValueError, match="K = 4"):
        trainer(_cfg(corpus, f"drafter_init=drafter:{tmp_path / 'k4_from_k1'}", "num_steps=1"),
                "back")
    with pytest.raises(ValueError, match="no such"):
        trainer(_cfg(corpus, f"drafter_init=drafter:{tmp_path / 'nowhere'}"), "none")


# ---- tap_rms_scaling: fc preconditioned by the taps' per-channel RMS -----------------------

def test_channel_rms_and_row_scale_match_numpy():
    from dblast_jax.train import tap_scaling
    rng = np.random.default_rng(3)
    taps = rng.normal(size=(2, 5, 3, 4)) * np.array([0.1, 1.0, 300.0])[None, None, :, None]
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    rms = tap_scaling.channel_rms(taps, valid)
    want = np.sqrt(np.mean(taps[valid] ** 2, axis=0)).reshape(-1)  # tap-major, like fc
    np.testing.assert_allclose(rms, want)
    rms[0] = 0.0  # a dead channel gets the floor, not an unbounded learning rate
    scale = tap_scaling.fc_row_scale(rms)
    assert scale.shape == (12, 1)
    np.testing.assert_allclose(scale[1:, 0], 1.0 / want[1:], rtol=1e-6)
    np.testing.assert_allclose(scale[0, 0], 1.0 / (np.median(rms) * tap_scaling.RMS_FLOOR_FRACTION),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="valid"):
        tap_scaling.channel_rms(taps, np.zeros((2, 5), bool))
    with pytest.raises(ValueError, match="B, T, n_taps, H"):
        tap_scaling.channel_rms(taps[0], valid)


def _fc_problem(seed=4):
    rng = np.random.default_rng(seed)
    s = np.exp(rng.uniform(-3, 6, size=12)).astype(np.float32)  # channel scales 0.05 .. 400
    x = (rng.normal(size=(32, 12)) * s).astype(np.float32)
    y = rng.normal(size=(32, 5)).astype(np.float32)
    w0 = (0.02 * rng.normal(size=(12, 5))).astype(np.float32)
    params = {"fc": {"kernel": jnp.asarray(w0)}, "norm": {"scale": jnp.ones((5,))}}

    def loss(p, inputs):
        out = inputs @ p["fc"]["kernel"]
        out = out / jnp.sqrt(jnp.mean(out ** 2, -1, keepdims=True) + 1e-6) * p["norm"]["scale"]
        return jnp.mean((out - y) ** 2)
    return s, x, params, loss


def _run(tx, params, grad_of, steps=5):
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grad_of(params), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_unit_row_scale_is_plain_adamw():
    from dblast_jax.train import tap_scaling
    s, x, params, loss = _fc_problem()
    mask = jax.tree.map(lambda a: a.ndim >= 2, params)
    grad = jax.grad(lambda p: loss(p, x))
    a, _ = _run(optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1, mask=mask), params, grad)
    b, state = _run(tap_scaling.adamw_with_fc_row_scale(1e-2, b1=0.9, b2=0.95, weight_decay=0.1,
                                                        mask=mask), params, grad)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7), a, b)
    np.testing.assert_array_equal(tap_scaling.row_scale_of(state), np.ones((12, 1)))
    assert tap_scaling.row_scale_of(optax.adamw(1e-2).init(params)) is None
    with pytest.raises(ValueError, match="tap_rms_scaling is off"):
        tap_scaling.with_row_scale(optax.adamw(1e-2).init(params), np.ones((12, 1)))


def test_row_scaled_adamw_is_adamw_on_standardised_inputs():
    """The claim of tap_scaling.py: rows of W scaled by 1 / s at init and in every Adam
    step is Adam on W' = diag(s) W fed x / s, step for step (weight decay included)."""
    from dblast_jax.train import tap_scaling
    s, x, params, loss = _fc_problem()
    d = 1.0 / s[:, None]
    mask = jax.tree.map(lambda a: a.ndim >= 2, params)
    kw = dict(b1=0.9, b2=0.95, weight_decay=0.1, mask=mask)
    ref, _ = _run(optax.adamw(3e-2, **kw), params, jax.grad(lambda p: loss(p, x * d.T)))
    tx = tap_scaling.adamw_with_fc_row_scale(3e-2, **kw)
    start = {**params, "fc": {"kernel": params["fc"]["kernel"] * d}}
    state = tap_scaling.with_row_scale(tx.init(start), jnp.asarray(d))
    grad = jax.grad(lambda p: loss(p, x))
    p = start
    for _ in range(5):
        updates, state = tx.update(grad(p), state, p)
        p = optax.apply_updates(p, updates)
    np.testing.assert_allclose(np.asarray(p["fc"]["kernel"]) / d, ref["fc"]["kernel"],
                               rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(p["norm"]["scale"], ref["norm"]["scale"], rtol=1e-5)
    # the plain optimizer on the raw inputs is a different run (the test can tell them apart)
    raw, _ = _run(optax.adamw(3e-2, **kw), start, grad)
    assert not np.allclose(np.asarray(raw["fc"]["kernel"]) / d, ref["fc"]["kernel"], rtol=1e-2)


def test_tap_rms_scaling_trains_resumes_and_matches_the_cache(corpus, tmp_path):  # noqa: F811
    from dblast_jax.models import target as target_lib
    from dblast_jax.train import tap_scaling
    from conftest import tiny_target
    tcfg, tparams, _ = tiny_target()
    more = ("tap_rms_scaling=true", "num_steps=4", "checkpoint_every=2")
    cfg = _cfg(corpus, *more)
    trainer = TR.Trainer(cfg, str(tmp_path / "live"), target=tiny_target(), progress=False,
                         log=lambda s: None)
    dcfg = trainer.drafter_config
    # the scale: 1 / RMS of the first batch_size records' taps, computed here directly
    src = trainer.batcher.source
    recs = [src[i] for i in range(cfg.batch_size)]
    from dblast_jax.data import records as records_lib
    batch = records_lib.collate(recs, cfg.seq_len, with_logp=False)
    taps = np.asarray(target_lib.forward(tparams, jnp.asarray(batch["tokens"]), config=tcfg,
                                         tap_layers=dcfg.target_layer_ids)[1])
    valid = np.arange(cfg.seq_len)[None] < batch["lengths"][:, None]
    want = tap_scaling.fc_row_scale(tap_scaling.channel_rms(taps, valid))
    got = np.asarray(tap_scaling.row_scale_of(jax.device_get(trainer.state.opt_state)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not np.allclose(got, 1.0)
    # fc starts at its usual initialisation divided by the RMS, row by row
    plain = TR.Trainer(_cfg(corpus, "num_steps=4"), str(tmp_path / "plain"),
                       target=tiny_target(), progress=False, log=lambda s: None)
    np.testing.assert_allclose(np.asarray(trainer.state.params["fc"]["kernel"]),
                               np.asarray(plain.state.params["fc"]["kernel"]) * want, rtol=1e-5)
    plain.close()
    result = trainer.run(stop_at=2)
    trainer.close()
    # resumed from step 2: the scale comes back with the optimizer state
    again = TR.Trainer(cfg, str(tmp_path / "live"), target=tiny_target(), progress=False,
                       log=lambda s: None)
    assert again.start_step == 2
    np.testing.assert_array_equal(
        np.asarray(tap_scaling.row_scale_of(jax.device_get(again.state.opt_state))), got)
    rest = again.run()
    again.close()
    # the other optimizer (no row scale) cannot resume this workdir: refused, naming it
    with pytest.raises(ValueError, match="tap_rms_scaling"):
        TR.Trainer(_cfg(corpus, "num_steps=4", "checkpoint_every=2"), str(tmp_path / "live"),
                   target=tiny_target(), progress=False, log=lambda s: None)
    live = result.history + rest.history
    assert all(np.isfinite(h["loss"]) for h in live)
    # the feature-cache path reads the same taps: the same scale and the same run
    cached = _train(_cfg(corpus, *more, f"feature_cache={tmp_path / 'fc'}"), tmp_path / "cached")
    for a, b in zip(live, cached.history):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4)


def test_warm_start_grows_a_trunk_in_depth_as_the_identity():
    """A 1-layer source into a 2-layer run: layer 0 and everything else copied, the new top
    layer zero in o_proj / down_proj, so the grown drafter's states equal the source's
    exactly; the new layer still gets gradients, and a deeper source is refused."""
    from dblast_jax.config import DrafterConfig
    from dblast_jax.models import drafter as D
    from dblast_jax.models import target as T
    from dblast_jax.train import warm_start
    from conftest import tiny_target
    tc, tp, _ = tiny_target()
    shallow = DrafterConfig.for_target(tc, num_layers=1, block_size=4,
                                       mask_token_id=tc.vocab_size - 1)
    deep = shallow.replace(num_layers=2)
    gen = np.random.default_rng(3)
    source = jax.tree.map(  # a "trained" source: every tensor away from its init
        lambda a: (gen.standard_normal(a.shape) / np.sqrt(a.shape[-1])).astype(np.float32),
        D.init_drafter_params(shallow, tc, 1))
    grown = warm_start.warm_start_from_drafter(D.init_drafter_params(deep, tc, 2), deep,
                                               source, shallow)
    flat, src = warm_start._flat(grown), warm_start._flat(source)
    for key, value in src.items():
        np.testing.assert_array_equal(flat[key], value, err_msg=key)
    assert not np.any(flat["layers/1/attn/o_proj/kernel"])
    assert not np.any(flat["layers/1/mlp/down_proj/kernel"])
    assert np.any(flat["layers/1/attn/q_proj/kernel"])  # the rest keeps its random init

    tokens = jnp.asarray(gen.integers(0, tc.vocab_size - 1, (2, 12)), jnp.int32)
    _, taps = T.forward(tp, tokens, config=tc, tap_layers=shallow.target_layer_ids)
    anchors = jnp.asarray([[0, 3, 7], [1, 5, 8]], jnp.int32)

    def hidden(p, dc):
        return D.train_hidden(p, tp, taps, tokens, anchors, drafter_config=dc,
                              target_config=tc)[0]

    np.testing.assert_allclose(hidden(grown, deep), hidden(source, shallow), atol=1e-5)
    grads = jax.grad(lambda p: jnp.sum(hidden(p, deep) ** 2))(grown)
    assert np.any(np.asarray(grads["layers"][1]["attn"]["o_proj"]["kernel"]))
    assert np.any(np.asarray(grads["layers"][1]["mlp"]["down_proj"]["kernel"]))
    with pytest.raises(ValueError, match="num_layers"):
        warm_start.warm_start_from_drafter(source, shallow, grown, deep)
