"""bfloat16 end to end: bf16 target and drafter, float32 probability math.

With bfloat16 parameters the matmuls run in bf16, but every logit leaves the LM head as
float32 (`preferred_element_type`) and every softmax / log-softmax, temperature division,
acceptance ratio min(1, p / Q), residual max(0, p - Q) normalisation and categorical draw
runs in float32. Checked here:

* the speculative sampler is lossless with bf16 parameters: the chi-square harness of
  test_speculative.py, with the exact reference distribution computed from the *same*
  bf16 target (its float32 logits), since lossless means "distributed exactly as the bf16
  target's own sampling distribution" (a K = 1 and a K > 1 verify mode);
* probabilities and acceptance statistics come out float32 and finite with bf16 inputs,
  and the float32 results on upcast bf16 logits are the same;
* one training step with param_dtype "bfloat16" agrees with the float32 step from the
  same initial weights within a stated tolerance.

The power of the chi-square harness (a broken verifier is rejected) is shown once, in
float32, by test_speculative.py; it does not depend on the parameter dtype.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import chi_square_pvalue, tiny_target  # tests/ is on sys.path (pytest "prepend")

import dblast_jax as dj
from dblast_jax import verify
from dblast_jax.config import DrafterConfig, SamplingConfig, TargetConfig
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T
from dblast_jax.sampler import PAD_ID, spec_cache_size, speculative_generate_tokens
from dblast_jax.sampling import sampling_logprobs
from dblast_jax.train import config as TC
from dblast_jax.train import trainer as TR

BF16 = jnp.bfloat16
P_VALUE = 1e-4  # as test_speculative.py
VOCAB, NEW, BLOCK, SAMPLES = 6, 4, 3, 30000
PROMPT = [1, 4]


def to_bf16(tree):
    return jax.tree.map(lambda x: x.astype(BF16), tree)


# ---- lossless with bf16 parameters ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bf16():
    """test_speculative's tiny target / drafter (peaked, unlike each other), cast to bf16."""
    tc = TargetConfig.tiny_llama(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    tp = T.init_params(tc, 11)
    tp["embed"]["embedding"] = tp["embed"]["embedding"] * 4.0
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=BLOCK, num_categories=4,
                                  target_layer_ids=(0,))
    dp = jax.tree.map(lambda x: x * 3.0, D.init_drafter_params(dc, tc, jax.random.key(5)))
    return tc, to_bf16(tp), dc, to_bf16(dp)


def exact_distribution(tc, tp, sampling):
    """Exact probability of each of the VOCAB**NEW continuations of PROMPT under the
    sampling distribution of the target `tp` as given (bf16 here: its float32 logits)."""
    seqs = np.array(list(itertools.product(range(VOCAB), repeat=NEW)), np.int32)
    full = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
    logits, _ = T.forward(tp, jnp.asarray(full), config=tc)
    assert logits.dtype == jnp.float32
    logp = sampling_logprobs(logits[:, len(PROMPT) - 1:-1], sampling.temperature,
                             sampling.top_k, sampling.top_p)  # [N, NEW, V]
    picked = np.take_along_axis(np.asarray(logp, np.float64), seqs[..., None], axis=-1)[..., 0]
    probs = np.exp(picked.sum(-1))
    return seqs, probs / probs.sum()


# Measured on CPU (seed 0, 30000 samples): p = 0.19 (greedy-branch, T = 1.0) and
# p = 0.62 (mixture, T = 1.5); in exploration mixture at T = 1.0 gave 0.85, and
# sampled-branch / sampled-mixture at T = 1.5 gave 0.66 / 0.31. (For this bf16 target the
# prefill + extend logits the sampler sees equal `T.forward`'s bit for bit.)
@pytest.mark.parametrize("mode,temperature", [("greedy-branch", 1.0), ("mixture", 1.5)])
def test_lossless_with_bf16_parameters(tiny_bf16, mode, temperature):
    tc, tp, dc, dp = tiny_bf16
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=NEW, verify_mode=mode,
                              category_temperature=1.3, draft_temperature=0.8)
    seqs, probs = exact_distribution(tc, tp, sampling)
    n = SAMPLES
    tokens = jnp.tile(jnp.asarray([PROMPT], jnp.int32), (n, 1))
    out, counts, accepted, expected = speculative_generate_tokens(
        tp, dp, tokens, jnp.full((n,), len(PROMPT), jnp.int32), jax.random.key(0),
        target_config=tc, drafter_config=dc, sampling=sampling,
        cache_size=spec_cache_size(len(PROMPT), sampling, dc.block_size))
    out, accepted, expected = np.asarray(out), np.asarray(accepted), np.asarray(expected)
    assert (np.asarray(counts) == NEW).all() and (out != PAD_ID).all()
    p_value = chi_square_pvalue(out, seqs, probs)
    print(f"\n[bf16 lossless] {mode} T={temperature}: chi-square p = {p_value:.3g}")
    assert p_value > P_VALUE
    assert (accepted > 0).mean() > 0.02  # acceptance paths are exercised
    assert expected.dtype == np.float32 and np.isfinite(expected).all()
    valid = accepted >= 0
    assert (expected[valid] >= 0).all() and (expected[valid] <= BLOCK - 1 + 1e-5).all()


# ---- float32 probabilities from bf16 inputs -------------------------------------------------

def test_sampling_distribution_is_float32_from_bf16_logits():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 3, 50)) * 3, BF16)
    for temp, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.5, 0, 0.9), (0.3, 10, 0.8)):
        got = sampling_logprobs(logits, temp, top_k, top_p)
        want = sampling_logprobs(logits.astype(jnp.float32), temp, top_k, top_p)
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        mass = np.exp(np.asarray(got, np.float64)).sum(-1)
        np.testing.assert_allclose(mass, 1.0, rtol=1e-5)


def test_verify_block_and_mixture_proposal_compute_in_float32():
    """bf16 probabilities in -> float32 acceptance ratios, residual and statistics out,
    equal to the float32 computation on the upcast inputs."""
    rng = np.random.default_rng(1)
    bsz, k, n, vocab = 16, 3, 4, 9
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(bsz, n + 1, vocab)) * 2, jnp.float32))
    branch_tokens = jnp.asarray(rng.integers(0, 4, (bsz, k, n)), jnp.int32)
    draw = jax.nn.softmax(jnp.asarray(rng.normal(size=(bsz, k)), jnp.float32))
    drafts = branch_tokens[jnp.arange(bsz), jnp.asarray(rng.integers(0, k, bsz))]
    probs_b, draw_b = probs.astype(BF16), draw.astype(BF16)
    mixture = jax.jit(verify.mixture_proposal, static_argnums=4)
    verify_block = jax.jit(verify.verify_block)
    mix_b = mixture(branch_tokens, None, drafts, draw_b, vocab)
    assert mix_b.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(mix_b),
        np.asarray(mixture(branch_tokens, None, drafts, draw_b.astype(jnp.float32), vocab)))
    branch_probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(bsz, k, n, vocab)), jnp.float32))
    assert jax.eval_shape(verify.mixture_proposal, None, branch_probs.astype(BF16), drafts,
                          draw_b, vocab).dtype == jnp.float32
    keys = jax.random.split(jax.random.key(0), 2)
    q_b = mix_b.astype(BF16)
    got = verify_block(keys[0], keys[1], probs_b, drafts, q_b)
    want = verify_block(keys[0], keys[1], probs_b.astype(jnp.float32), drafts,
                        q_b.astype(jnp.float32))
    assert got.alphas.dtype == jnp.float32
    assert got.expected_accepted.dtype == jnp.float32
    assert np.isfinite(np.asarray(got.expected_accepted)).all()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_preset_and_drafter_generate_finite_float32_statistics():
    """`load_target(..., dtype=bf16)` + `init_drafter(..., dtype=bf16)`: sampled drafts
    (draft temperature, top-k / top-p on the target) give float32, finite expected
    acceptance and in-range tokens."""
    target = dj.load_target("tiny-qwen3", dtype=BF16)
    assert {x.dtype for x in jax.tree.leaves(target.params)} == {jnp.dtype(BF16)}
    dc = DrafterConfig.for_target(target.config, num_layers=1, block_size=4, num_categories=2)
    drafter = dj.init_drafter(target, dc, rng=1, dtype=BF16)
    assert {x.dtype for x in jax.tree.leaves(drafter.params)} == {jnp.dtype(BF16)}
    tokens = jnp.asarray([[3, 4, 5, 6, 7, 8, 9, 10]] * 4, jnp.int32)
    lengths = jnp.asarray([8, 5, 3, 8], jnp.int32)
    sampling = SamplingConfig(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=8,
                              verify_mode="sampled-branch", draft_temperature=0.8)
    out, counts, _, expected = speculative_generate_tokens(
        target.params, drafter.params, tokens, lengths, jax.random.key(2),
        target_config=target.config, drafter_config=dc, sampling=sampling,
        cache_size=spec_cache_size(tokens.shape[1], sampling, dc.block_size))
    out, expected = np.asarray(out), np.asarray(expected)
    assert (np.asarray(counts) == 8).all()
    assert ((out >= 0) & (out < target.config.vocab_size)).all()
    assert expected.dtype == np.float32 and np.isfinite(expected).all()
    assert (expected >= 0).all() and (expected <= dc.block_size - 1 + 1e-5).all()


# ---- one training step: bf16 vs float32 ------------------------------------------------------

def _train_target():
    """test_trainer's tiny Llama target (host-drawn, O(1) scale), float32."""
    return tiny_target()[:2]


def _cosine(a, b) -> float:
    x = np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(a)])
    y = np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(b)])
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


# Measured on CPU (this batch and seed, tiny_dblast_k4_al): relative difference of the loss
# (and of the NLL and the AL surrogate) 2.5e-4, gradient cosine 0.99966 (1 - cos = 3.4e-4),
# grad-norm relative difference 7.1e-3 (optax sums the squares in bf16). The tolerances
# leave a ~20x margin on the loss, ~30x on 1 - cosine and ~7x on the norm.
LOSS_RTOL = 5e-3
GRAD_COSINE_MIN = 0.99
GRAD_NORM_RTOL = 5e-2


def test_bf16_train_step_matches_float32():
    """One `make_train_step` step, param_dtype "bfloat16" vs "float32", from the same
    initial weights (bf16 = the float32 drafter and target cast) on the same batch, K = 4
    NLL + AL with target log-probs computed on the fly (logp_mode "target").

    What param_dtype does in the trainer: the drafter parameters *and* the frozen target
    are held in that dtype, with no float32 master copy. The gradients come out in bf16,
    and optax's AdamW keeps its moments (mu, nu) in the parameter dtype, so updates are
    applied to bf16 weights. The loss itself is float32: logits leave the LM head in
    float32 (chunked_logits promotes to >= float32), and every log-softmax, logsumexp and
    acceptance weight in losses.py runs in float32 (`_as_float`).

    The gradient the step took is read back from the optimizer: after one step from a
    fresh state, Adam's first moment is mu = (1 - b1) * the clipped gradient (clipping
    scales the whole tree, so it leaves the cosine alone). The first step's learning rate
    is 0 under warmup, so the update itself is not compared.
    """
    tc, tp32 = _train_target()
    cfg = TC.get_experiment("tiny_dblast_k4_al", ["mesh=1,1,1"])
    dc = cfg.drafter_config(tc)
    dp32 = D.init_drafter_params(dc, tc, 0, jnp.float32)
    rng = np.random.default_rng(1)
    bsz, t = cfg.batch_size, cfg.seq_len
    mask = np.ones((bsz, t), bool)
    mask[:, :4] = False  # a short "prompt"
    batch = {"tokens": jnp.asarray(rng.integers(0, tc.vocab_size, (bsz, t)), jnp.int32),
             "loss_mask": jnp.asarray(mask), "lengths": jnp.full((bsz,), t, jnp.int32)}
    out = {}
    for name in ("float32", "bfloat16"):
        c = cfg.replace(param_dtype=name)
        dtype = jnp.dtype(name)
        dp = jax.tree.map(lambda x: x.astype(dtype), dp32)
        tp = jax.tree.map(lambda x: x.astype(dtype), tp32)
        tx, _ = TR.make_optimizer(c)
        state = TR.TrainState(step=jnp.int32(0), params=dp, opt_state=tx.init(dp),
                              rng=jax.random.PRNGKey(0))
        new, metrics = jax.jit(TR.make_train_step(c, dc, tc, "target"))(state, tp, batch)
        assert bool(metrics[TR.FINITE_KEY])
        mu = optax.tree_utils.tree_get(new.opt_state, "mu")
        assert {x.dtype for x in jax.tree.leaves(new.params)} == {dtype}
        assert {x.dtype for x in jax.tree.leaves(mu)} == {dtype}
        for key in ("loss", "nll", "al_surrogate", "al_estimate"):
            assert metrics[key].dtype == jnp.float32, key
        out[name] = (jax.device_get(metrics), jax.tree.map(lambda x: x.astype(jnp.float32), mu))
    (m32, g32), (m16, g16) = out["float32"], out["bfloat16"]
    cosine = _cosine(g32, g16)
    rel = {k: abs(float(m16[k]) / float(m32[k]) - 1.0)
           for k in ("loss", "nll", "al_surrogate", "grad_norm")}
    print(f"\n[bf16 train step] rel diffs {rel}, gradient cosine {cosine:.6f}")
    for key in ("loss", "nll", "al_surrogate"):
        np.testing.assert_allclose(m16[key], m32[key], rtol=LOSS_RTOL, err_msg=key)
    np.testing.assert_allclose(m16["grad_norm"], m32["grad_norm"], rtol=GRAD_NORM_RTOL)
    assert cosine > GRAD_COSINE_MIN
