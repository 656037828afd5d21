"""The serial correction head (correction = "previous-token"): exact, and trained as drafted.

Exactness is tested like every drafting mode of test_speculative.py: a chi-square test of
all 6**4 continuations against the target's exact distribution, with a random *non-zero*
correction strong enough that drafting from the uncorrected q would be a different
proposal (the power check verifies against exactly that q and must fail). The rest:
T = 0 is plain greedy decoding, a zero correction drafts what the drafter without it
drafts (same random draws), the training pass's teacher-forced states are the ones the
sampler drafts from, a training step reaches the correction's parameters, the export
round-trips, and bad settings are one-line errors.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chi_square_pvalue  # tests/ is on sys.path (pytest "prepend" mode)
from test_speculative import (NEW, P_VALUE, PROMPT, assert_greedy_equals_plain,
                              exact_distribution, sample_patched, sample_sequences,
                              tiny)  # noqa: F401 (tiny is a fixture)

from dblast_jax import correction as CORR
from dblast_jax import draft_vocab as DV
from dblast_jax.config import DrafterConfig, DrafterSpec, SamplingConfig, TargetConfig
from dblast_jax.io import dflash
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T

RANK = 4


def with_correction(dc, dp, seed=7, scale=3.0):
    """The drafter plus a random correction head of rank RANK (out kernel non-zero)."""
    dcc = dc.replace(correction="previous-token", correction_rank=RANK)
    gen = np.random.default_rng(seed)
    h = dc.hidden_size
    corr = {"prev_kernel": gen.standard_normal((h, RANK)) / np.sqrt(h),
            "ctx_kernel": gen.standard_normal((h, RANK)) / np.sqrt(h),
            "out_kernel": scale * gen.standard_normal((RANK, h))}
    return dcc, dict(dp, correction={k: jnp.asarray(v, jnp.float32) for k, v in corr.items()})


@pytest.fixture(scope="module")
def corrected(tiny):
    tc, tp, dc, dp = tiny
    return (tc, tp) + with_correction(dc, dp)


# (mode, T, top-k, top-p, draft vocabulary): the K = 4 fixture, a non-zero correction
CASES = [("greedy-branch", 0.7, 0, 1.0, None), ("greedy-branch", 1.0, 3, 0.9, None),
         ("greedy-branch", 1.5, 0, 1.0, None), ("sampled-branch", 0.7, 0, 1.0, None),
         ("sampled-branch", 1.0, 0, 1.0, None), ("sampled-branch", 1.5, 4, 0.9, None),
         ("mixture", 1.0, 0, 1.0, None), ("sampled-mixture", 1.5, 0, 1.0, (3, 1, 0))]


@pytest.mark.parametrize("mode,temperature,top_k,top_p,draft_ids", CASES)
def test_correction_head_is_lossless(corrected, mode, temperature, top_k, top_p, draft_ids):
    """Every mode; with a draft vocabulary (3 of the 6 tokens) the correction is added to
    the logits over its ids and tokens outside it come from the residual."""
    tc, tp, dc, dp = corrected
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              max_new_tokens=NEW, verify_mode=mode, category_temperature=1.3,
                              draft_temperature=0.8)
    if draft_ids is not None:
        dp = DV.attach(dp, tp, np.asarray(draft_ids), tc)
    seqs, probs = exact_distribution(tc, tp, sampling)
    samples, accepted, _ = sample_sequences(tc, tp, dc, dp, sampling)
    assert chi_square_pvalue(samples, seqs, probs) > P_VALUE
    assert (accepted > 0).mean() > 0.02


def test_the_test_has_power_when_verified_against_the_uncorrected_q(corrected, monkeypatch):
    """Drafts taken from the corrected q but verified against the parallel pass's own q
    (the correction left out of the proposal: a plausible bug) must fail the test."""
    tc, tp, dc, dp = corrected
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW,
                              verify_mode="sampled-branch", draft_temperature=0.8)
    seqs, probs = exact_distribution(tc, tp, sampling)
    real = CORR.serial_scan

    def uncorrected_proposal(base, ctx, basis, anchor, *args, temperature=1.0, **kw):
        drafts, log_q = real(base, ctx, basis, anchor, *args, temperature=temperature, **kw)
        if log_q is None:
            return drafts, log_q
        return drafts, jax.nn.log_softmax(base / temperature, axis=-1)

    samples, _, _ = sample_patched(monkeypatch, CORR, "serial_scan", uncorrected_proposal,
                                   tc, tp, dc, dp, sampling, seed=1)
    assert chi_square_pvalue(samples, seqs, probs) < P_VALUE


def _draft_step(tc, tp, dc, dp, sampling, cache, seed=0):
    """One draft (drafts, proposal) of the sampler for the rows of `cache` (the context
    PROMPT), anchored at token 2."""
    from types import SimpleNamespace

    from dblast_jax.sampler import _trained_draft, step_keys
    n = cache.lengths.shape[0]

    state = SimpleNamespace(anchor=jnp.full((n,), 2, jnp.int32),
                            anchor_pos=jnp.full((n,), len(PROMPT)), draft_cache=cache)
    # eagerly: the ops compile once for every call of the test
    return _trained_draft(dp, tp, state, step_keys(jax.random.key(seed), jnp.int32(0)), tc,
                          dc, sampling)


def test_a_zero_correction_drafts_what_the_drafter_without_it_drafts(tiny):
    """The same drafts from the same random draws and the same proposal: the serial
    drafting reduces exactly to the parallel drafting (here over a draft vocabulary of 5
    of the 6 tokens); a non-zero correction changes the proposal. (greedy-branch is the
    one-chain case of mixture's chains.)"""
    tc, tp, dc, dp = tiny
    dcc, dpz = with_correction(dc, dp, scale=0.0)
    _, dpn = with_correction(dc, dp)
    n = 64
    _, taps = T.forward(tp, jnp.asarray([PROMPT]), config=tc, tap_layers=dc.target_layer_ids)
    cache = D.append_context(dp, jnp.tile(taps, (n, 1, 1, 1)), jnp.zeros((n,), jnp.int32),
                             D.init_draft_cache(dc, n, 16), drafter_config=dc)
    dp, dpz, dpn = (DV.attach(p, tp, np.arange(5), tc) for p in (dp, dpz, dpn))
    for mode in ("sampled-branch", "mixture", "sampled-mixture"):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, verify_mode=mode,
                                  category_temperature=1.3, draft_temperature=0.8)
        plain = _draft_step(tc, tp, dc, dp, sampling, cache)
        zero = _draft_step(tc, tp, dcc, dpz, sampling, cache)
        np.testing.assert_array_equal(np.asarray(zero[0]), np.asarray(plain[0]))
        np.testing.assert_allclose(np.asarray(zero[1]), np.asarray(plain[1]), atol=1e-6)
        if mode == "sampled-mixture":
            other = _draft_step(tc, tp, dcc, dpn, sampling, cache)[1]
            assert np.abs(np.asarray(other) - np.asarray(plain[1])).max() > 0.1


def test_temperature_zero_equals_plain_greedy(corrected):
    tc, tp, dc, dp = corrected
    assert_greedy_equals_plain(tc, tp, dc, dp)


def test_training_pass_is_the_teacher_forced_drafting_pass(corrected):
    """train_hidden on [prompt, anchor, d_1 .. d_{b-1}] corrects slot i with d_{i-1}: its
    logits are the sampler's serial logits for that drafted prefix, so the argmax chain
    the sampler drafts is the training pass's argmax (K = 4: every branch)."""
    tc, tp, dc, dp = corrected
    seq = jnp.asarray([PROMPT + [2]], jnp.int32)  # the anchor 2 at position len(PROMPT)
    anchor_pos = len(PROMPT)
    cache = D.init_draft_cache(dc, 1, 16)
    _, taps = T.forward(tp, seq, config=tc, tap_layers=dc.target_layer_ids)
    cache = D.append_context(dp, taps[:, :anchor_pos], jnp.zeros((1,), jnp.int32), cache,
                             drafter_config=dc)

    @jax.jit
    def sampler_chains(dp, tp, cache):
        hidden, _ = D.draft_hidden(dp, tp, seq[:, -1], jnp.asarray([anchor_pos]), cache,
                                   drafter_config=dc, target_config=tc)
        base = D.branch_logits(tp, hidden, tc)  # [1, K, b-1, V]
        ctx, w_out = D.correction_parts(dp, hidden, drafter_config=dc)
        prev = lambda t: D.correction_prev_features(dp, tp, t, drafter_config=dc)  # noqa
        chains, _ = CORR.serial_scan(base, ctx, D.branch_logits(tp, w_out, tc), seq[:, -1],
                                     prev, lambda i: i.astype(jnp.int32))
        return base, chains

    base, chains = sampler_chains(dp, tp, cache)
    assert not np.array_equal(np.asarray(chains), np.asarray(jnp.argmax(base, -1)))
    k = dc.num_categories  # one row per branch: [prompt, anchor, that branch's chain]
    full = jnp.concatenate([jnp.tile(seq, (k, 1)), chains[0]], axis=1)

    @jax.jit
    def training_argmax(dp, tp, full):
        _, taps = T.forward(tp, full, config=tc, tap_layers=dc.target_layer_ids)
        h, _ = D.train_hidden(dp, tp, taps, full, jnp.full((k, 1), anchor_pos),
                              drafter_config=dc, target_config=tc)
        logits = D.branch_logits(tp, h[jnp.arange(k), 0, jnp.arange(k)], tc)  # [K, b-1, V]
        return jnp.argmax(logits, -1)

    np.testing.assert_array_equal(np.asarray(training_argmax(dp, tp, full)),
                                  np.asarray(chains[0]))


def test_a_training_step_reaches_the_correction(tmp_path):
    """`--override correction=previous-token` trains a correction head: with the NLL +
    AL loss, distillation and the sampled head, the loss's gradient reaches all three
    matrices (W_o starts at zero, W_p / W_c once W_o has moved), and the run's export
    loads back with the head."""
    from conftest import tiny_cfg, tiny_target

    from dblast_jax.train import trainer as TR
    cfg = tiny_cfg("tiny_k1_al", "correction=previous-token", "drafter.correction_rank=8",
                   "num_steps=3", "checkpoint_every=3", "distill_weight=0.5",
                   "train_head_tokens=16", "train_head_sampled=8", "tensorboard=false")
    target = tiny_target()
    trainer = TR.Trainer(cfg, str(tmp_path), target=target, progress=False,
                         log=lambda s: None)
    start = jax.device_get(trainer.state.params["correction"])
    result = trainer.run()
    trainer.close()
    params = jax.device_get(result.params)
    assert not np.any(start["out_kernel"])
    for name in ("prev_kernel", "ctx_kernel", "out_kernel"):
        assert np.isfinite(params["correction"][name]).all()
        assert not np.array_equal(params["correction"][name], start[name]), name
    config, loaded = dflash.load_dflash(str(tmp_path / "export"), target[0])
    assert (config.correction, config.correction_rank) == ("previous-token", 8)
    for name, value in params["correction"].items():
        np.testing.assert_array_equal(loaded["correction"][name], value)


def test_export_round_trip_and_dblast_only(corrected, tmp_path):
    tc, tp, dc, dp = corrected
    dc = dc.replace(mask_token_id=0, num_categories=1, expander_width=0)
    dp = {k: v for k, v in D.init_drafter_params(dc, tc, 3).items()}
    dp["correction"] = corrected[3]["correction"]
    assert dflash.needs_dblast_extras(dc)
    assert not dflash.needs_dblast_extras(dc.replace(correction="none", correction_rank=0))
    folder = dflash.export_drafter(dp, dc, str(tmp_path / "out"))
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["dblast_config"]["dblast_only"] is True
    assert (cfg["dblast_config"]["correction"], cfg["dblast_config"]["correction_rank"]) == (
        "previous-token", RANK)
    config, loaded = dflash.load_dflash(folder, tc)
    assert config == dc.replace(name=config.name)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    from safetensors.numpy import load_file
    keys = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert {"dblast.correction.prev_proj.weight", "dblast.correction.ctx_proj.weight",
            "dblast.correction.out_proj.weight"} <= keys
    bad = dict(cfg, dblast_config=dict(cfg["dblast_config"], correction="gru"))
    with pytest.raises(ValueError, match="correction 'gru' is not one this version"):
        dflash.drafter_config_from_dflash(bad, tc)
    from dblast_jax.io.torch_drafter import _DrafterCore  # knows previous-token only
    with pytest.raises(ValueError, match="correction 'gru'.*does not know"):
        _DrafterCore()._build(bad)


def test_bad_settings_are_one_line_errors():
    tc = TargetConfig.tiny_llama()
    for kw, message in [
            (dict(correction="gru"), "correction must be one of none, previous-token, got 'gru'"),
            (dict(correction="previous-token", correction_rank=0),
             "correction_rank must be an integer >= 1 for correction 'previous-token', got 0"),
            (dict(correction_rank=4), "correction_rank 4 needs correction=previous-token"),
            (dict(correction="previous-token", correction_rank=49),
             "correction_rank 49 exceeds hidden_size 48")]:
        with pytest.raises(ValueError, match=message) as e:
            DrafterConfig.for_target(tc, **kw)
        assert "\n" not in str(e.value)
    assert DrafterConfig.for_target(tc, correction="previous-token").correction_rank == 32
    from dblast_jax.train import config as TC
    with pytest.raises(ValueError, match=r"drafter.correction must be one of none, "
                                         r"previous-token, got 'prev'"):
        TC.get_experiment("smollm2_k1_al", ["correction=prev"])
    with pytest.raises(ValueError, match="drafter.correction_rank 8 needs"):
        TC.get_experiment("smollm2_k1_al", ["drafter.correction_rank=8"])
    cfg = TC.get_experiment("smollm2_k1_al", ["correction=previous-token"])
    assert cfg == TC.get_experiment("smollm2_k1_al", ["drafter.correction=previous-token"])
    assert cfg.drafter == DrafterSpec(num_layers=1, block_size=8,
                                      target_layer_ids=TC.SMOLLM2_TARGET_LAYER_IDS,
                                      mask_token_id=TC.SMOLLM2_MASK_TOKEN_ID,
                                      correction="previous-token")
    assert cfg.drafter_config(TargetConfig.smollm2_135m()).correction_rank == 32


def test_warm_start_from_a_k1_trunk():
    """drafter_init=drafter:SPEC adds a (zero) correction head to a trained K = 1 trunk:
    every trunk tensor is copied, so the new drafter starts as exactly the trunk."""
    from dblast_jax.train.warm_start import warm_start_from_drafter
    tc = TargetConfig.tiny_llama()
    trunk = DrafterConfig.for_target(tc, num_layers=1, block_size=4, mask_token_id=0)
    run = trunk.replace(correction="previous-token", correction_rank=8)
    source = D.init_drafter_params(trunk, tc, 1)
    out = warm_start_from_drafter(D.init_drafter_params(run, tc, 2), run, source, trunk)
    assert not np.any(out["correction"]["out_kernel"])
    for a, b in zip(jax.tree.leaves({k: v for k, v in out.items() if k != "correction"}),
                    jax.tree.leaves(source)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="unknown to this run"):  # not the other way round
        warm_start_from_drafter(source, trunk, out, run)
