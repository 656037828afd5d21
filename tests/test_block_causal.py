"""Block-causal drafting (block_attention = "causal"): exact, and trained as drafted.

Exactness is tested like every drafting mode of test_speculative.py: a chi-square test of
all 6**4 continuations against the target's exact distribution, with the random K = 4
drafter of that file made causal (same parameters), so position 2's q depends on the token
drafted at position 1. The power check verifies the same drafts against the q of one pass
over [anchor, MASK, MASK] (the drafted prefix left out of the proposal: a plausible bug)
and must fail. The rest: T = 0 is plain greedy decoding, the training pass's teacher-forced
states are the drafting passes' states, a training step moves the parameters, the export
round-trips with vLLM's `dflash_config.causal`, and bad settings are one-line errors.
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

from dblast_jax import block_causal as BC
from dblast_jax import draft_vocab as DV
from dblast_jax.config import DrafterConfig, DrafterSpec, SamplingConfig, TargetConfig
from dblast_jax.io import dflash
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T


# half test_speculative's SAMPLES: the power check below still fails at p ~ 1e-200 (1e-36
# at 8,000 samples), and the file stays near a minute of CPU
SAMPLES = 15000


@pytest.fixture(scope="module")
def causal(tiny):
    tc, tp, dc, dp = tiny
    return tc, tp, dc.replace(block_attention="causal"), dp


# (mode, T, top-k, top-p, draft vocabulary): the K = 4 fixture made causal
CASES = [("greedy-branch", 0.7, 0, 1.0, None), ("greedy-branch", 1.5, 3, 0.9, None),
         ("sampled-branch", 1.0, 0, 1.0, None), ("sampled-branch", 1.5, 4, 0.9, None),
         ("mixture", 1.0, 0, 1.0, None), ("sampled-mixture", 1.5, 0, 1.0, (3, 1, 0))]


@pytest.mark.parametrize("mode,temperature,top_k,top_p,draft_ids", CASES)
def test_block_causal_is_lossless(causal, mode, temperature, top_k, top_p, draft_ids):
    """Every mode; with a draft vocabulary (3 of the 6 tokens) each q_i is over its ids,
    and the drafted id enters the block as the target's token."""
    tc, tp, dc, dp = causal
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              max_new_tokens=NEW, verify_mode=mode, category_temperature=1.3,
                              draft_temperature=0.8)
    if draft_ids is not None:
        dp = DV.attach(dp, tp, np.asarray(draft_ids), tc)
    seqs, probs = exact_distribution(tc, tp, sampling)
    samples, accepted, _ = sample_sequences(tc, tp, dc, dp, sampling, n=SAMPLES)
    assert chi_square_pvalue(samples, seqs, probs) > P_VALUE
    assert (accepted > 0).mean() > 0.02


def test_the_test_has_power_when_verified_against_the_q_without_the_drafted_prefix(
        causal, monkeypatch):
    """Drafts taken left to right but verified against the q of one causal pass over
    [anchor, MASK, ..] (position i not seeing d_<i in the proposal) must fail the test."""
    tc, tp, dc, dp = causal
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW,
                              verify_mode="sampled-branch", draft_temperature=0.8)
    seqs, probs = exact_distribution(tc, tp, sampling)
    real = BC.sampled_chain

    def prefix_blind_proposal(core, dv, tparams, anchor, anchor_pos, cache, start, z,
                              noise, every_branch, temperature, *, tcfg, dcfg):
        drafts, _ = real(core, dv, tparams, anchor, anchor_pos, cache, start, z, noise,
                         every_branch, temperature, tcfg=tcfg, dcfg=dcfg)
        hidden, _ = D.draft_hidden(core, tparams, anchor, anchor_pos, cache,
                                   drafter_config=dcfg, target_config=tcfg)
        h = D.select_branch(hidden, z)[:, None]  # [B, 1, b-1, H]
        return drafts, jax.nn.log_softmax(D.branch_logits(tparams, h, tcfg) / temperature,
                                          axis=-1)

    samples, _, _ = sample_patched(monkeypatch, BC, "sampled_chain", prefix_blind_proposal,
                                   tc, tp, dc, dp, sampling, n=SAMPLES, seed=1)
    assert chi_square_pvalue(samples, seqs, probs) < P_VALUE


def test_temperature_zero_equals_plain_greedy(causal):
    tc, tp, dc, dp = causal
    assert_greedy_equals_plain(tc, tp, dc, dp)


def test_training_pass_is_the_teacher_forced_drafting_pass(tiny):
    """train_hidden on [prompt, anchor, d_1 .. d_{b-1}] (one parallel pass, data tokens in
    the block) gives the states of the b - 1 drafting passes: the argmax chain every branch
    drafts left to right is the training pass's argmax, and its states and prior match the
    drafting passes' to float rounding, both the sampler's incremental steps and whole-block
    passes (`causal_pass`, the definition). A deeper, longer block than the fixture's (2
    layers, b = 5) so that later positions see several drafted tokens through two layers."""
    tc, tp, _, _ = tiny
    dc = DrafterConfig.for_target(tc, num_layers=2, block_size=5, num_categories=2,
                                  target_layer_ids=(0,), block_attention="causal")
    dp = jax.tree.map(lambda x: x * 3.0, D.init_drafter_params(dc, tc, 5))
    dp["prior"]["kernel"] = jnp.asarray(np.random.default_rng(0).standard_normal(
        dp["prior"]["kernel"].shape), jnp.float32)
    prompt = PROMPT + [3, 0]
    seq = jnp.asarray([prompt + [2]], jnp.int32)  # the anchor 2 at position len(prompt)
    anchor_pos = jnp.asarray([len(prompt)])
    k, b = dc.num_categories, dc.block_size

    @jax.jit
    def sampler_chains(dp, tp):
        _, taps = T.forward(tp, seq, config=tc, tap_layers=dc.target_layer_ids)
        cache = D.append_context(dp, taps[:, :-1], jnp.zeros((1,), jnp.int32),
                                 D.init_draft_cache(dc, 1, 16), drafter_config=dc)
        start, prior = BC.first_pass(dp, tp, seq[:, -1], anchor_pos, cache, k, dcfg=dc)
        chains = BC.greedy_chains(dp, None, tp, anchor_pos, cache, start, None,
                                  tcfg=tc, dcfg=dc)  # [1, K, b-1]: branch m's own chain
        # the incremental steps' states on branch 0's chain, and whole-block passes'
        kv = jax.tree.map(lambda a: a[:, :1], start[0])  # block 0: branch 0's chain
        steps, blocks = [start[1][:, :1]], []
        for i in range(1, b):
            if i > 1:  # slot i - 1 holds d_{i-1}
                state, _, kv = D.causal_step(dp, tp, chains[:, :1, i - 2], kv, anchor_pos,
                                             cache, i, drafter_config=dc)
                steps.append(state)
            block = jnp.concatenate([seq[:, -1:], chains[:, 0, :i - 1],
                                     jnp.full((1, b - i), -1, jnp.int32)], axis=1)
            blocks.append(D.causal_pass(dp, tp, block[:, None], anchor_pos, cache, i,
                                        drafter_config=dc)[0])
        # one causal pass over [anchor, MASK, ..]: what every position drafts blind
        blind, _ = D.draft_hidden(dp, tp, seq[:, -1], anchor_pos, cache, drafter_config=dc,
                                  target_config=tc)
        return (chains, jnp.stack(steps, axis=3)[0, 0], jnp.stack(blocks, axis=3)[0, 0],
                prior, jnp.argmax(D.branch_logits(tp, blind, tc), -1))

    chains, steps, blocks, prior, blind = sampler_chains(dp, tp)
    assert not np.array_equal(np.asarray(chains), np.asarray(blind))  # the prefix matters
    full = jnp.concatenate([jnp.tile(seq, (k, 1)), chains[0]], axis=1)

    @jax.jit
    def training(dp, tp, full):
        _, taps = T.forward(tp, full, config=tc, tap_layers=dc.target_layer_ids)
        h, prior = D.train_hidden(dp, tp, taps, full, jnp.full((k, 1), len(prompt)),
                                  drafter_config=dc, target_config=tc)
        logits = D.branch_logits(tp, h[jnp.arange(k), 0, jnp.arange(k)], tc)  # [K, b-1, V]
        return jnp.argmax(logits, -1), h[0, 0], prior[0, 0]

    argmax, h0, prior_train = training(dp, tp, full)
    np.testing.assert_array_equal(np.asarray(argmax), np.asarray(chains[0]))
    for states in (steps, blocks):  # [K, b-1, H]
        np.testing.assert_allclose(np.asarray(h0), np.asarray(states), atol=2e-5)
    np.testing.assert_allclose(np.asarray(prior_train), np.asarray(prior[0]), atol=2e-5)


def test_a_training_step_moves_the_parameters(tmp_path):
    """`--override drafter.block_attention=causal` trains a causal block with the NLL + AL
    loss and distillation to the target's top-k; the run's export loads back causal."""
    from conftest import tiny_cfg, tiny_target

    from dblast_jax.train import trainer as TR
    cfg = tiny_cfg("tiny_k1_al", "drafter.block_attention=causal", "num_steps=1",
                   "checkpoint_every=1", "distill_weight=0.5", "tensorboard=false")
    target = tiny_target()
    trainer = TR.Trainer(cfg, str(tmp_path), target=target, progress=False,
                         log=lambda s: None)
    start = jax.device_get(trainer.state.params)
    result = trainer.run()
    trainer.close()
    params = jax.device_get(result.params)
    for path, a in jax.tree_util.tree_leaves_with_path(params):
        assert np.isfinite(a).all(), path
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                      jax.tree.leaves(start))]
    assert all(moved), moved
    config, loaded = dflash.load_dflash(str(tmp_path / "export"), target[0])
    assert config.block_attention == "causal"
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)


def test_export_round_trip_and_dblast_only(tmp_path):
    tc = TargetConfig.tiny_llama()
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4, mask_token_id=0,
                                  block_attention="causal")
    dp = D.init_drafter_params(dc, tc, 3)
    plain = dc.replace(block_attention="bidirectional")
    assert dflash.needs_dblast_extras(dc) and not dflash.needs_dblast_extras(plain)
    assert "causal" not in dflash.dflash_config_dict(plain)["dflash_config"]
    folder = dflash.export_drafter(dp, dc, str(tmp_path / "out"))
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["dflash_config"]["causal"] is True  # vLLM's key
    assert cfg["dblast_config"]["dblast_only"] is True
    assert cfg["dblast_config"]["block_attention"] == "causal"
    config, loaded = dflash.load_dflash(folder, tc)
    assert config == dc.replace(name=config.name)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a DFlash checkpoint that says causal without dblast_config loads as a causal block
    foreign = {k: v for k, v in cfg.items() if k != "dblast_config"}
    assert dflash.drafter_config_from_dflash(foreign, tc).block_attention == "causal"
    for bad, message in [
            (dict(cfg, dflash_config=dict(cfg["dflash_config"], causal="yes")),
             "dflash_config.causal must be true or false, got 'yes'"),
            (dict(cfg, dblast_config=dict(cfg["dblast_config"], block_attention="sliding")),
             "block_attention 'sliding' is not one this version"),
            (dict(cfg, dflash_config=dict(cfg["dflash_config"], causal=False)),
             "dflash_config.causal false contradicts dblast_config.block_attention 'causal'")]:
        with pytest.raises(ValueError, match=message):
            dflash.drafter_config_from_dflash(bad, tc)
    from dblast_jax.io.torch_drafter import _DrafterCore  # refuses what JAX refuses
    for bad, message in [
            (dict(cfg, dblast_config=dict(cfg["dblast_config"], block_attention="sliding")),
             "block_attention 'sliding' is not one this PyTorch drafter knows"),
            (dict(cfg, dflash_config=dict(cfg["dflash_config"], causal=False)),
             "dflash_config.causal False contradicts dblast_config.block_attention 'causal'")]:
        with pytest.raises(ValueError, match=message):
            _DrafterCore()._build(bad)


def test_bad_settings_are_one_line_errors():
    tc = TargetConfig.tiny_llama()
    for kw, message in [
            (dict(block_attention="full"),
             "block_attention must be one of bidirectional, causal, got 'full'"),
            (dict(block_attention="causal", correction="previous-token"),
             "block_attention=causal does not combine with correction=previous-token")]:
        with pytest.raises(ValueError, match=message) as e:
            DrafterConfig.for_target(tc, **kw)
        assert "\n" not in str(e.value)
    from dblast_jax.train import config as TC
    with pytest.raises(ValueError, match=r"drafter.block_attention must be one of "
                                         r"bidirectional, causal, got 'Causal'"):
        TC.get_experiment("smollm2_k1_al", ["drafter.block_attention=Causal"])
    with pytest.raises(ValueError, match="drafter.block_attention=causal does not combine"):
        TC.get_experiment("smollm2_k1_al", ["block_attention=causal",
                                            "correction=previous-token"])
    cfg = TC.get_experiment("smollm2_k1_al", ["block_attention=causal"])
    assert cfg == TC.get_experiment("smollm2_k1_al", ["drafter.block_attention=causal"])
    assert cfg.drafter == DrafterSpec(num_layers=1, block_size=8,
                                      target_layer_ids=TC.SMOLLM2_TARGET_LAYER_IDS,
                                      mask_token_id=TC.SMOLLM2_MASK_TOKEN_ID,
                                      block_attention="causal")
    assert cfg.drafter_config(TargetConfig.smollm2_135m()).block_attention == "causal"
    default = TC.get_experiment("smollm2_k1_al")
    assert default.drafter_config(TargetConfig.smollm2_135m()).block_attention == \
        "bidirectional"
    # the run's identity records it only when on (workdirs of before resume)
    from dblast_jax.train.checkpoint import experiment_identity
    dcfg = default.drafter_config(TargetConfig.smollm2_135m())
    assert "block_attention" not in experiment_identity(dcfg, "t", "al")["drafter_config"]
    assert experiment_identity(dcfg.replace(block_attention="causal"), "t", "al")[
        "drafter_config"]["block_attention"] == "causal"
