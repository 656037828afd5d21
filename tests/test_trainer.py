"""The trainer: configs, anchors, data, the objective at work, resume, sharding, bad input.

The training runs use a tiny Llama target whose weights are drawn on the host with an
O(1) scale (embedding std 0.3), so that its tied LM head can express peaked
distributions within a few hundred steps, and the synthetic multi-modal language of
`batches.SyntheticMultiModal` drawn at T_v = 1.5. The target log-probs in the AL terms
are the *exact* log-probs of that generative process (stored with the data, the
"read from the corpus" path): a target that had learned the language would assign
exactly these, and the random tiny target is only the feature extractor. That makes the
AL numbers comparable with closed-form values (printed with -s).
"""

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.models import target as T
from dblast_jax.train import batches as B
from dblast_jax.train import checkpoint as C
from dblast_jax.train import config as TC
from dblast_jax.train import trainer as TR
from conftest import TINY, tiny_cfg, tiny_target  # tests/ is on sys.path (pytest "prepend")

STEPS = 200  # the registry's tiny budget


def held_out(cfg):
    return B.SyntheticMultiModal(TINY.vocab_size, block_size=cfg.drafter.block_size,
                                 seq_len=cfg.seq_len, temperature=cfg.verify_temperature,
                                 logit_scale=cfg.synthetic_logit_scale, seed=10**6)


def closed_form_al(p: np.ndarray) -> dict[str, float]:
    """Expected accepted drafts (sampled-branch) for b = 4 blocks on phrases of 3 tokens,
    anchors uniform over the phrase offset: the anchor ends a phrase (the choice is at
    block slot 1), or sits at offset 0 / 1 (choice at slot 3 / 2)."""
    s2, s3, mx = float(np.sum(p**2)), float(np.sum(p**3)), float(np.max(p))
    return {
        # K = 1, perfect per-position marginals (the optimum of the DFlash loss)
        "k1_marginals": (1 + s2 + s3 + 2 + s2 + 3) / 3,
        # K >= #phrases, perfect mixture (the optimum of mixture NLL), prior = p
        "mixture_nll_optimum": (3 * s2 + 1 + 2 * s2 + 3) / 3,
        # best product proposal: marginal at the choice, the top phrase after it
        "best_product": (1 + 2 * mx + 2 + mx + 3) / 3,
        # `mixture` verification with the perfect mixture accepts every draft
        "mixture_verify_optimum": 3.0,
    }


# ---- configs ------------------------------------------------------------------------------

def test_registry_and_overrides():
    names = TC.list_experiments()
    for required in ("tiny_dflash", "tiny_dblast_k4_al", "smollm2_dflash_baseline",
                     "smollm2_k1_al", "smollm2_dblast_k4_nll", "smollm2_dblast_k4_al"):
        assert required in names
    cfg = TC.get_experiment("tiny_dblast_k4_al", ["mesh=2,2,2", "lam=0.5", "track_al=false",
                                                  "num_steps=1e3", "target_layer_ids=0,2"])
    assert cfg.mesh == (2, 2, 2) and cfg.lam == 0.5 and cfg.track_al is False
    assert cfg.num_steps == 1000 and cfg.drafter.target_layer_ids == (0, 2)
    assert TC.TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match="no field 'lamda'"):
        TC.apply_overrides(cfg, ["lamda=1"])
    with pytest.raises(ValueError, match="expected an integer"):
        TC.apply_overrides(cfg, ["num_steps=ten"])
    with pytest.raises(ValueError, match="K = 1 loss"):
        TC.get_experiment("tiny_dflash", ["num_categories=4"])
    with pytest.raises(KeyError, match="unknown experiment"):
        TC.get_experiment("nope")
    dc = TC.get_experiment("smollm2_dblast_k4_al").drafter_config(TargetConfig.smollm2_135m())
    assert dc.num_categories == 4 and dc.block_size == 8 and dc.mask_token_id == 16


# ---- anchors and data -----------------------------------------------------------------------

def test_anchors_inside_response_and_block_fits():
    b, a = 4, 6
    mask = np.zeros((3, 12), bool)
    mask[0, 5:10] = True  # response 5..9, length 10 -> anchors 5, 6
    mask[1, 2:12] = True  # length 12 -> anchors 2..8
    mask[2, :] = True     # length 3 < b -> none
    lengths = np.array([10, 12, 3], np.int32)
    fn = jax.jit(functools.partial(B.sample_anchors, block_size=b, num_anchors=a))
    anchors, valid = map(np.asarray, fn(jax.random.PRNGKey(0), mask, lengths))
    again, _ = map(np.asarray, fn(jax.random.PRNGKey(0), mask, lengths))
    other, _ = map(np.asarray, fn(jax.random.PRNGKey(1), mask, lengths))
    np.testing.assert_array_equal(anchors, again)
    assert not np.array_equal(anchors, other)
    assert sorted(anchors[0][valid[0]]) == [5, 6] and valid[0].sum() == 2
    assert valid[1].all() and len(set(anchors[1])) == a
    assert all(2 <= x <= 8 for x in anchors[1])
    assert not valid[2].any()
    # labels: tokens[a + i], masked outside the response
    tokens = np.arange(36, dtype=np.int32).reshape(3, 12)
    labels, lmask = B.block_labels(jnp.asarray(tokens), mask, lengths, jnp.asarray(anchors),
                                   jnp.asarray(valid), b)
    labels, lmask = np.asarray(labels), np.asarray(lmask)
    for j in range(a):
        if valid[1, j]:
            np.testing.assert_array_equal(labels[1, j], tokens[1, anchors[1, j] + 1:
                                                               anchors[1, j] + b])
    assert lmask[0][valid[0]].all() and not lmask[2].any()


def test_synthetic_language_and_batcher_state():
    src = B.SyntheticMultiModal(97, block_size=4, seq_len=48, temperature=1.5, seed=3)
    rec = src[5]
    np.testing.assert_array_equal(rec["tokens"], src[5]["tokens"])
    resp = rec["tokens"][rec["loss_mask"]].reshape(-1, 3)
    for phrase, lp in zip(resp, rec["logp"][rec["loss_mask"]].reshape(-1, 3)):
        z = np.nonzero((src.phrases == phrase).all(axis=1))[0]
        assert z.size == 1  # every response chunk is one of the phrases
        np.testing.assert_allclose(lp, [src.log_probs[z[0]], 0, 0], atol=1e-6)
    np.testing.assert_allclose(src.phrase_probs.sum(), 1.0, rtol=1e-6)
    hotter = B.SyntheticMultiModal(97, block_size=4, seq_len=48, temperature=3.0)
    assert hotter.phrase_probs.max() < src.phrase_probs.max()  # tempering flattens

    corpus = [{"tokens": list(range(1, 9 + i)), "loss_mask": [0] * 3 + [1] * (5 + i)}
              for i in range(10)]
    src = B.ListSource(corpus)
    full = B.Batcher(src, batch_size=4, seq_len=12, block_size=4, seed=1)
    halves = [B.Batcher(src, batch_size=4, seq_len=12, block_size=4, seed=1, rows=r)
              for r in ((0, 2), (2, 4))]
    for _ in range(5):  # crosses epochs
        g = next(full)
        parts = [next(h) for h in halves]
        for k in g:
            np.testing.assert_array_equal(g[k], np.concatenate([p[k] for p in parts]))
    state = full.get_state()
    ref = [next(full)["tokens"] for _ in range(3)]
    resumed = B.Batcher(src, batch_size=4, seq_len=12, block_size=4, seed=1)
    resumed.set_state(json.loads(json.dumps(state)))
    for r in ref:
        np.testing.assert_array_equal(next(resumed)["tokens"], r)


def test_iterator_batcher_position_state():
    recs = [{"tokens": list(range(1, 7 + i % 3)), "loss_mask": [0, 0] + [1] * (4 + i % 3)}
            for i in range(7)]
    make = lambda: iter(recs)  # noqa: E731  (a plain iterator: state = records consumed)
    a = B.IteratorBatcher(make, local_batch_size=3, seq_len=10, block_size=4)
    next(a)
    state = a.get_state()
    want = [next(a)["tokens"] for _ in range(3)]  # wraps around the 7 records
    b = B.IteratorBatcher(make, local_batch_size=3, seq_len=10, block_size=4)
    b.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(b)["tokens"], w)


def test_target_logprobs_on_the_fly_match_forward():
    tc, tp, _ = tiny_target()
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 11), 0, tc.vocab_size)
    taps, logp = jax.jit(functools.partial(TR.target_features, drafter_config=dc,
                                           target_config=tc, logp_temperature=1.5,
                                           chunk_size=32))(tp, tokens)
    logits, ref_taps = jax.jit(functools.partial(T.forward, config=tc,
                                                 tap_layers=dc.target_layer_ids))(tp, tokens)
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1] / 1.5, axis=-1),
                              tokens[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp[:, 1:]), np.asarray(ref), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(logp[:, 0]), 0.0)
    np.testing.assert_allclose(np.asarray(taps), np.asarray(ref_taps), atol=1e-5)


def test_mixture_conditional_is_the_exact_chain_rule():
    rng = np.random.default_rng(0)
    logq = np.log(rng.dirichlet(np.ones(5), size=(1, 1, 3, 4))[..., 0]).astype(np.float32)
    prior = rng.standard_normal((1, 1, 3)).astype(np.float32)
    mask = np.ones((1, 1, 4), bool)
    got = np.asarray(TR.mixture_conditional_logq(jnp.asarray(logq), jnp.asarray(prior), mask))
    pi = np.exp(prior - np.logaddexp.reduce(prior, axis=-1, keepdims=True))[0, 0]
    q = np.exp(logq[0, 0])  # [K, P]
    joint = [np.sum(pi * np.prod(q[:, :i], axis=1)) for i in range(5)]
    np.testing.assert_allclose(np.exp(got[0, 0]), [joint[i + 1] / joint[i] for i in range(4)],
                               rtol=1e-5)


# ---- training at work -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tiny_dflash (K = 1, DFlash loss) and tiny_dblast_k4_al (K = 4, NLL + AL), same
    budget, then evaluated on held-out synthetic data (fixed anchors)."""
    out = {}
    for name in ("tiny_dflash", "tiny_dblast_k4_al"):
        cfg = tiny_cfg(name)
        wd = str(tmp_path_factory.mktemp(name))
        t0 = time.perf_counter()
        trainer = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
        result = trainer.run()
        ev = trainer.evaluate(held_out(cfg), num_batches=8, seed=99)
        trainer.close()
        out[name] = dict(cfg=cfg, workdir=wd, result=result, eval=ev,
                         params=jax.device_get(result.params), seconds=time.perf_counter() - t0)
        print(f"\n[{name}] {STEPS} steps in {out[name]['seconds']:.1f}s "
              f"(first step incl. compile {result.timing['first_step_s']:.1f}s, then "
              f"{result.timing.get('step_time_s', 0) * 1e3:.1f} ms/step, "
              f"{result.timing.get('tokens_per_s', 0):.0f} tok/s)")
        for h in result.history[::25] + result.history[-1:]:
            print(f"  step {h['step']:4d} loss {h['loss']:.3f} nll {h['nll']:.3f} "
                  f"AL {h['al_estimate']:.3f} AL(mixture) {h['al_estimate_mixture']:.3f} "
                  f"top1 {[round(x, 2) for x in h['top1']]}")
    return out


def test_loss_falls(runs):
    for name, run in runs.items():
        hist = run["result"].history
        assert len(hist) == STEPS and [h["step"] for h in hist] == list(range(1, STEPS + 1))
        first = np.mean([h["loss"] for h in hist[:5]])
        last = np.mean([h["loss"] for h in hist[-20:]])
        assert last < 0.35 * first, (name, first, last)
        assert np.mean([h["top1_mean"] for h in hist[-20:]]) > 0.4
        assert all(np.isfinite(h["grad_norm"]) for h in hist)
        assert hist[0]["lr"] == 0.0 and max(h["lr"] for h in hist) == pytest.approx(3e-3)
        lines = open(os.path.join(run["workdir"], "metrics.jsonl")).read().splitlines()
        assert len(lines) == STEPS and json.loads(lines[-1])["step"] == STEPS


def test_k4_nll_al_beats_k1_dflash_at_temperature_1_5(runs):
    k1, k4 = runs["tiny_dflash"]["eval"], runs["tiny_dblast_k4_al"]["eval"]
    lang = held_out(runs["tiny_dflash"]["cfg"])
    theory = closed_form_al(lang.phrase_probs)
    print(f"\nphrase probabilities at T_v = 1.5: {np.round(lang.phrase_probs, 3)}")
    print("closed form (accepted drafts of 3): " + ", ".join(f"{k} {v:.3f}"
                                                            for k, v in theory.items()))
    for name, ev in (("K=1 DFlash", k1), ("K=4 NLL+AL", k4)):
        print(f"{name}: AL (sampled-branch) {ev['al_estimate']:.3f}, AL (mixture verify) "
              f"{ev['al_estimate_mixture']:.3f}, nll {ev['nll']:.3f}, top1 "
              f"{[round(x, 3) for x in ev['top1']]}")
    # The AL estimate of docs/METHOD.md section 4 (sampled-branch verification) ...
    assert k4["al_estimate"] > k1["al_estimate"] + 0.05
    # ... and the acceptance of mixture verification, where K > 1 pays most.
    assert k4["al_estimate_mixture"] > k1["al_estimate_mixture"] + 0.2
    assert k1["al_estimate"] <= theory["k1_marginals"] + 0.1  # sanity vs closed form
    np.testing.assert_allclose(k1["al_estimate_mixture"], k1["al_estimate"], rtol=1e-6)


def test_prior_diagnostics(runs):
    """prior_entropy / branch_usage: the mixture's use of its K branches, in every row."""
    for name, k in (("tiny_dflash", 1), ("tiny_dblast_k4_al", 4)):
        for row in runs[name]["result"].history[::50]:
            assert len(row["branch_usage"]) == k
            assert sum(row["branch_usage"]) == pytest.approx(1.0, abs=1e-5)
            assert -1e-6 <= row["prior_entropy"] <= np.log(k) + 1e-5
        if k == 1:
            assert row["prior_entropy"] == pytest.approx(0.0, abs=1e-6)
        else:  # on the 4-phrase language the trained prior keeps several branches alive
            assert row["prior_entropy"] > 0.1, row["branch_usage"]


def test_prefix_acceptance_adds_up_to_the_al_estimates(runs):
    """accept_prefix[k] = P(first k drafts accepted): non-increasing in k, in [0, 1], and
    summing to the expected accepted drafts of the same rows (both verify modes)."""
    for name in ("tiny_dflash", "tiny_dblast_k4_al"):
        for row in runs[name]["result"].history[::50]:
            for key, total in (("accept_prefix", "al_estimate"),
                               ("accept_prefix_mixture", "al_estimate_mixture")):
                acc = np.asarray(row[key])
                assert np.all((acc >= -1e-7) & (acc <= 1 + 1e-6)), acc
                assert np.all(np.diff(acc) <= 1e-6), acc
                assert acc.sum() == pytest.approx(row[total], rel=1e-4, abs=1e-6)


def test_export_is_the_trained_drafter(runs):
    from dblast_jax.io.dflash import load_dflash
    run = runs["tiny_dblast_k4_al"]
    path = run["result"].export_path
    assert path and os.path.exists(os.path.join(path, "config.json"))
    dc, params = load_dflash(path, TINY)
    assert dc.num_categories == 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, run["params"])


def test_resume_gives_identical_params(runs, tmp_path):
    """STEPS straight (the fixture) == STEPS/2, stop, a new Trainer on the workdir, STEPS/2."""
    cfg = runs["tiny_dflash"]["cfg"]
    wd = str(tmp_path / "resume")
    first = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
    assert first.run(stop_at=STEPS // 2).step == STEPS // 2
    first.close()
    del first
    second = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
    assert second.start_step == STEPS // 2
    result = second.run()
    second.close()
    assert result.step == STEPS
    got, want = jax.device_get(result.params), runs["tiny_dflash"]["params"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, want)
    steps = [json.loads(ln)["step"] for ln in open(os.path.join(wd, "metrics.jsonl"))]
    assert steps == list(range(1, STEPS + 1))
    assert sorted(int(s) for s in os.listdir(os.path.join(wd, "checkpoints"))) == [150, 200]


def test_mesh_2x2x2_step_equals_single_device(runs, tmp_path):
    """Two K = 4 NLL + AL steps on a (data 2, fsdp 2, tensor 2) mesh of 8 CPU devices equal
    the single-device steps (same config as the fixture: its compiled step is reused)."""
    assert jax.device_count() >= 8
    cfg = runs["tiny_dblast_k4_al"]["cfg"]
    outs = {}
    for mesh in ((1, 1, 1), (2, 2, 2)):
        tr = TR.Trainer(cfg.replace(mesh=mesh), str(tmp_path / str(mesh)), target=tiny_target(),
                        progress=False, log=lambda s: None)
        res = tr.run(stop_at=2)
        tr.close()
        outs[mesh] = (jax.device_get(res.params), res.history, tr)
    (p1, h1, _), (p8, h8, tr8) = outs[(1, 1, 1)], outs[(2, 2, 2)]
    specs = [str(x.sharding.spec) for x in jax.tree.leaves(tr8.state.params)]
    assert any("tensor" in s for s in specs) and any("fsdp" in s for s in specs)
    assert "data" in str(tr8.global_batch(next(tr8.batcher), "data")["tokens"].sharding.spec)
    assert h1[1]["lam"] > 0  # the AL term is in these steps
    for a, b in zip(h1, h8):
        for k in ("loss", "nll", "al_surrogate", "al_estimate", "grad_norm"):
            np.testing.assert_allclose(a[k], b[k], rtol=2e-5, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p8)


# ---- bad input ------------------------------------------------------------------------------

def test_drafter_target_mismatch(tmp_path):
    wd = str(tmp_path / "mismatch")
    other = DrafterConfig.for_target(TargetConfig.tiny_qwen3(), num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="hidden_size 40 does not match the target's "
                                         "hidden_size 48"):
        TR.Trainer(tiny_cfg("tiny_dflash"), wd, target=tiny_target(), drafter_config=other)
    with pytest.raises(ValueError, match="target layer id 7 out of range"):
        TR.Trainer(tiny_cfg("tiny_dflash", "target_layer_ids=7"), wd, target=tiny_target())
    assert not os.path.exists(wd)  # nothing written


def test_empty_and_too_short_corpus(tmp_path):
    cfg = tiny_cfg("tiny_dflash")
    wd = str(tmp_path / "data")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        TR.Trainer(cfg, wd, target=tiny_target(), data=str(empty))
    with pytest.raises(ValueError, match="is empty"):
        TR.Trainer(cfg, wd, target=tiny_target(), data=[])
    short = tmp_path / "short.jsonl"
    short.write_text("[1, 2, 3]\n" + json.dumps({"tokens": [1, 2, 3, 4, 5, 6],
                                                 "loss_mask": [0, 0, 0, 1, 1, 1]}) + "\n")
    with pytest.raises(ValueError, match="too short.*block of 4"):
        TR.Trainer(cfg, wd, target=tiny_target(), data=str(short))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"tokens": [1, 2, 3], "loss_mask": [1, 1]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: loss_mask has shape \(2,\)"):
        TR.Trainer(cfg, wd, target=tiny_target(), data=str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TR.Trainer(cfg, wd, target=tiny_target(), data=str(tmp_path / "missing.jsonl"))
    assert not os.path.exists(wd)


def test_foreign_checkpoint_is_refused_untouched(runs, tmp_path):
    wd = runs["tiny_dflash"]["workdir"]

    def snapshot():
        out = {}
        for root, _, files in os.walk(wd):
            for f in files:
                p = os.path.join(root, f)
                out[p] = (os.path.getmtime(p), os.path.getsize(p))
        return out

    before = snapshot()
    with pytest.raises(C.ForeignCheckpointError, match="another experiment's checkpoint.*"
                                                       "num_categories: workdir has 1"):
        TR.Trainer(tiny_cfg("tiny_dblast_k4_al"), wd, target=tiny_target())
    with pytest.raises(C.ForeignCheckpointError, match="target: workdir has 'tiny-llama-test'"):
        tc, tp, _ = tiny_target()
        TR.Trainer(runs["tiny_dflash"]["cfg"], wd, target=(tc, tp, "some-other-target"))
    assert snapshot() == before
    # checkpoints without an identity file are not adopted either
    stray = tmp_path / "stray"
    (stray / "checkpoints" / "5").mkdir(parents=True)
    with pytest.raises(C.ForeignCheckpointError, match="no experiment.json"):
        TR.Trainer(tiny_cfg("tiny_dflash"), str(stray), target=tiny_target())
    assert sorted(os.listdir(stray)) == ["checkpoints"]
