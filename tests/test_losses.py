"""Training objectives vs brute-force numpy (explicit loops, probability domain), finite
differences, -inf safety, and unbiasedness of the AL estimate on an enumerable target."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dblast_jax import losses as L

NEG = -np.inf


# ----------------------------------------------------------------------------- references
# Written independently of the implementation: probabilities, products and plain loops.


def ref_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def ref_dflash(logq, mask, gamma):
    b_, a_, p_ = logq.shape
    total, count = 0.0, 0
    for b in range(b_):
        for a in range(a_):
            if not mask[b, a].any():
                continue
            count += 1
            for i in range(p_):
                if mask[b, a, i]:
                    w = 1.0 if gamma is None else np.exp(-i / gamma)
                    total += w * -logq[b, a, i]
    return total / max(count, 1)


def ref_nll(logq, prior, mask, weights=None):
    b_, a_, k_, p_ = logq.shape
    total, count = 0.0, 0
    for b in range(b_):
        for a in range(a_):
            if not mask[b, a].any():
                continue
            count += 1
            pi = ref_softmax(prior[b, a])
            like = 0.0
            for z in range(k_):
                prod = pi[z]
                for i in range(p_):
                    if mask[b, a, i]:
                        w = 1.0 if weights is None else weights[i]
                        prod *= np.exp(logq[b, a, z, i]) ** w
                like += prod
            total += -np.log(like) if like > 0 else np.inf
    return total / max(count, 1)


def ref_alpha(lq, lp):
    q, p = np.exp(lq), np.exp(lp)
    if q == 0:
        return 0.0
    if p == 0:
        return 1.0
    return min(1.0, q / p)


def ref_prefix_weights(logq, logp, mask):
    """W [B, A, K, P] (prefix k real only if positions 1..k all real, else 0)."""
    b_, a_, k_, p_ = logq.shape
    w = np.zeros(logq.shape)
    for b, a, z in itertools.product(range(b_), range(a_), range(k_)):
        for k in range(p_):
            if not all(mask[b, a, : k + 1]):
                continue
            prod = 1.0
            for i in range(k + 1):
                prod *= ref_alpha(logq[b, a, z, i], logp[b, a, i])
            w[b, a, z, k] = prod
    return w


def ref_al(logq, prior, logp, mask):
    w = ref_prefix_weights(logq, logp, mask)
    b_, a_, k_, _ = logq.shape
    out = np.zeros((b_, a_))
    for b, a in itertools.product(range(b_), range(a_)):
        pi = ref_softmax(prior[b, a])
        out[b, a] = sum(pi[z] * w[b, a, z].sum() for z in range(k_))
    return out


def ref_surrogate(logq, prior, logp, mask, tau):
    """-> (loss, retained count)."""
    w = ref_prefix_weights(logq, logp, mask)
    b_, a_, k_, p_ = logq.shape
    total, count = 0.0, 0
    for b, a in itertools.product(range(b_), range(a_)):
        pi = ref_softmax(prior[b, a])
        mix = [sum(pi[z] * w[b, a, z, k] for z in range(k_)) for k in range(p_)]
        for k in range(p_):
            valid = all(mask[b, a, : k + 1])
            if valid and mix[k] > 0 and mix[k] >= tau:
                total += np.log(sum(mix[j] for j in range(k, p_)))
                count += 1
    return -total / max(count, 1), count


# ----------------------------------------------------------------------------- fixtures


def make_case(seed, b=2, a=3, k=3, p=5, neg_frac=0.15, holes=True):
    rng = np.random.default_rng(seed)
    logq = np.log(rng.dirichlet(np.ones(6), size=(b, a, k, p))[..., 0]).astype(np.float64)
    logp = np.log(rng.dirichlet(np.ones(6), size=(b, a, p))[..., 0]).astype(np.float64)
    prior = rng.normal(size=(b, a, k))
    logq[rng.random(logq.shape) < neg_frac] = NEG
    logp[rng.random(logp.shape) < neg_frac] = NEG
    lengths = rng.integers(0, p + 1, size=(b, a))
    lengths[0, 0] = p          # at least one full anchor
    lengths[-1, -1] = 0        # and one fully invalid anchor
    mask = np.arange(p)[None, None, :] < lengths[..., None]
    if holes:
        mask[0, 1] = [True, False, True, True, True][:p]  # hole: prefixes 2.. unreachable
    return logq, prior, logp, mask


def f32(*xs):
    return tuple(None if x is None else jnp.asarray(x, jnp.float32) for x in xs)


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("gamma", [7.0, 2.0, None])
def test_dflash_matches_numpy(seed, gamma):
    logq, _, _, mask = make_case(seed, k=1, neg_frac=0.0)
    got = L.dflash_loss(jnp.asarray(logq, jnp.float32), jnp.asarray(mask), gamma)
    want = ref_dflash(logq[:, :, 0], mask, gamma)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    # [B, A, P] input and a 2-D anchor mask
    got3 = L.dflash_loss(jnp.asarray(logq[:, :, 0], jnp.float32), jnp.asarray(mask.any(-1)), gamma)
    want3 = ref_dflash(logq[:, :, 0], np.broadcast_to(mask.any(-1)[..., None], mask.shape), gamma)
    np.testing.assert_allclose(float(got3), want3, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixture_nll_matches_numpy(seed):
    logq, prior, _, mask = make_case(seed, neg_frac=0.1)
    # keep one branch finite everywhere so the loss itself is finite
    logq[:, :, 0][np.isneginf(logq[:, :, 0])] = -3.0
    got = L.mixture_nll(*f32(logq, prior), jnp.asarray(mask))
    np.testing.assert_allclose(float(got), ref_nll(logq, prior, mask), rtol=1e-5)
    w = np.exp(-np.arange(logq.shape[-1]) / 3.0)
    got_w = L.mixture_nll(*f32(logq, prior), jnp.asarray(mask), position_weights=jnp.asarray(w))
    np.testing.assert_allclose(float(got_w), ref_nll(logq, prior, mask, w), rtol=1e-5)


def test_mixture_nll_infinite_only_when_every_branch_is_impossible():
    logq = np.full((1, 1, 2, 3), -1.0)
    logq[0, 0, :, 1] = NEG
    prior = np.zeros((1, 1, 2))
    assert float(L.mixture_nll(*f32(logq, prior))) == np.inf
    logq[0, 0, 1, 1] = -2.0
    np.testing.assert_allclose(float(L.mixture_nll(*f32(logq, prior))),
                               -np.log(0.5 * np.exp(-4.0)), rtol=1e-6)


def test_k1_mixture_nll_is_cross_entropy_sum():
    logq, _, _, mask = make_case(3, k=1, neg_frac=0.0)
    ce = L.mixture_nll(jnp.asarray(logq, jnp.float32), None, jnp.asarray(mask))
    ce_prior = L.mixture_nll(*f32(logq, np.random.default_rng(0).normal(size=logq.shape[:3])),
                             jnp.asarray(mask))
    plain = L.dflash_loss(jnp.asarray(logq, jnp.float32), jnp.asarray(mask), gamma=None)
    anchors = mask.any(-1)
    want = sum(-logq[b, a, 0][mask[b, a]].sum()
               for b, a in zip(*np.nonzero(anchors))) / anchors.sum()
    for x in (ce, ce_prior, plain):
        np.testing.assert_allclose(float(x), want, rtol=1e-5)
    # position weights inside the product == DFlash decay at K = 1
    w = L.dflash_position_weights(logq.shape[-1], 4.0)
    np.testing.assert_allclose(
        float(L.mixture_nll(jnp.asarray(logq, jnp.float32), None, jnp.asarray(mask), w)),
        float(L.dflash_loss(jnp.asarray(logq, jnp.float32), jnp.asarray(mask), 4.0)), rtol=1e-6)


def test_combined_loss_reports_unweighted_block_nll():
    # `nll` is the objective (DFlash-weighted here); `block_nll` stays the plain mixture
    # NLL, so runs trained with different losses can be compared on one number
    logq, prior, logp, mask = make_case(0, neg_frac=0.0)  # finite NLL
    args = f32(logq, prior, logp)
    w = L.dflash_position_weights(logq.shape[-1], 4.0)
    _, weighted = L.combined_loss(*args, jnp.asarray(mask), position_weights=w)
    _, plain = L.combined_loss(*args, jnp.asarray(mask))
    want = float(L.mixture_nll(args[0], args[1], jnp.asarray(mask)))
    np.testing.assert_allclose(float(weighted["block_nll"]), want, rtol=1e-6)
    np.testing.assert_allclose(float(plain["block_nll"]), want, rtol=1e-6)
    np.testing.assert_allclose(float(plain["nll"]), want, rtol=1e-6)
    assert abs(float(weighted["nll"]) - want) > 1e-3 * abs(want)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_al_estimate_matches_numpy(seed):
    logq, prior, logp, mask = make_case(seed)
    got = L.al_estimate(*f32(logq, prior, logp), jnp.asarray(mask))
    want = ref_al(logq, prior, logp, mask)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7)
    assert float(got[-1, -1]) == 0.0  # fully invalid anchor
    np.testing.assert_allclose(np.asarray(L.predicted_tau(got)), 1 + want, rtol=1e-5)
    # per prefix length: sum_z pi_z W_{z,k}, by brute force
    w = ref_prefix_weights(logq, logp, mask)
    want_prefix = np.array([[ref_softmax(prior[b, a]) @ w[b, a] for a in range(w.shape[1])]
                            for b in range(w.shape[0])])
    got_prefix = L.prefix_acceptance(*f32(logq, prior, logp), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got_prefix), want_prefix, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_accepted_matches_a_loop(seed):
    """The leading run of hits, position by position, stopping at a miss or an unreal
    position, averaged over branches by pi."""
    rng = np.random.default_rng(seed)
    b, a, k, p = 3, 4, 2, 6
    hit = rng.random((b, a, k, p)) < 0.7
    mask = rng.random((b, a, p)) < 0.9
    pi = rng.dirichlet(np.ones(k), size=(b, a))
    want = np.zeros((b, a))
    for i, j, z in itertools.product(range(b), range(a), range(k)):
        run = 0
        while run < p and hit[i, j, z, run] and mask[i, j, run]:
            run += 1
        want[i, j] += pi[i, j, z] * run
    got = L.greedy_accepted(jnp.asarray(hit), jnp.asarray(pi, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    every = L.greedy_accepted(jnp.ones((1, 1, 1, p), bool), jnp.ones((1, 1, 1)),
                              jnp.ones((1, 1, p), bool))
    assert float(every[0, 0]) == p  # all drafts accepted


def test_al_estimate_special_values():
    # q = 0 -> alpha 0 (never proposed, even if p = 0 too); p = 0 < q -> alpha 1.
    logq = np.array([[[[np.log(0.5), np.log(0.2), NEG, -1.0]]]])
    logp = np.array([[[np.log(0.25), NEG, NEG, -1.0]]])
    got = float(L.al_estimate(*f32(logq, None, logp))[0, 0])
    np.testing.assert_allclose(got, 1.0 + 1.0 + 0.0 + 0.0, rtol=1e-6)


def _tau_between(mix_values, which):
    """A threshold far from every prefix weight: 'none' / 'some' / 'all'."""
    vals = np.unique(mix_values[mix_values > 0])
    if which == "none":
        return 1.5
    if which == "all":
        return 0.0
    lo, hi = vals[len(vals) // 2 - 1], vals[len(vals) // 2]
    return float(np.sqrt(lo * hi))


@pytest.mark.parametrize("which", ["none", "some", "all"])
@pytest.mark.parametrize("seed", [0, 5])
def test_al_surrogate_matches_numpy(seed, which):
    logq, prior, logp, mask = make_case(seed)
    w = ref_prefix_weights(logq, logp, mask)
    pis = np.stack([[ref_softmax(prior[b, a]) for a in range(prior.shape[1])]
                    for b in range(prior.shape[0])])
    mix = np.einsum("bak,bakp->bap", pis, w)
    tau = _tau_between(mix, which)
    want, count = ref_surrogate(logq, prior, logp, mask, tau)
    reachable = int((mix > 0).sum())
    assert {"none": count == 0, "some": 0 < count < reachable, "all": count == reachable}[which]
    got = L.al_surrogate(*f32(logq, prior, logp), jnp.asarray(mask), tau=tau)
    np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-7)
    s_sum, n = L.al_surrogate_terms(*f32(logq, prior, logp), jnp.asarray(mask), tau=tau)
    assert int(n.sum()) == count
    if which == "none":
        assert float(got) == 0.0


def test_al_surrogate_by_hand():
    # K = 1, P = 3, alphas 0.5, 0.5, 0.5 -> W = .5, .25, .125
    logq = np.log(np.array([[[[0.1, 0.1, 0.1]]]]))
    logp = np.log(np.array([[[0.2, 0.2, 0.2]]]))
    s = [np.log(0.875), np.log(0.375), np.log(0.125)]
    for tau, kept in [(0.0, 3), (0.3, 1), (0.2, 2), (0.6, 0)]:
        got = float(L.al_surrogate(*f32(logq, None, logp), tau=tau))
        want = -np.mean(s[:kept]) if kept else 0.0
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_combined_loss_and_jit():
    logq, prior, logp, mask = make_case(4)
    args = f32(logq, prior, logp) + (jnp.asarray(mask),)
    fn = jax.jit(lambda q, pr, lp, m, lam, tau: L.combined_loss(q, pr, lp, m, lam=lam, tau=tau))
    loss, met = fn(*args, 0.3, 0.05)
    nll = L.mixture_nll(args[0], args[1], args[3])
    sur = L.al_surrogate(*args, tau=0.05)
    al = L.al_estimate(*args)
    anchors = mask.any(-1)
    al_mean = al[anchors].mean()
    chex.assert_trees_all_close(
        {k: met[k] for k in ("nll", "block_nll", "al_surrogate", "al_estimate",
                             "predicted_tau", "loss")},
        {"nll": nll, "block_nll": nll, "al_surrogate": sur, "al_estimate": al_mean,
         "predicted_tau": 1 + al_mean, "loss": nll + 0.3 * sur}, rtol=1e-6)
    chex.assert_trees_all_close(loss, met["loss"], rtol=0)
    assert int(met["valid_anchors"]) == anchors.sum()
    assert 0.0 < float(met["retained_fraction"]) <= 1.0
    loss0, met0 = L.combined_loss(args[0], args[1], None, args[3], lam=1.0)
    chex.assert_trees_all_close(loss0, nll, rtol=1e-6)
    assert "al_estimate" not in met0


class LossVariantsTest(chex.TestCase):
    """The losses with and without jit (chex variants) against the numpy references."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_dflash_loss(self):
        logq, _, _, mask = make_case(0, k=1, neg_frac=0.0)
        got = self.variant(L.dflash_loss)(jnp.asarray(logq, jnp.float32), jnp.asarray(mask),
                                          4.0)
        chex.assert_trees_all_close(got, ref_dflash(logq[:, :, 0], mask, 4.0), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_mixture_nll(self):
        logq, prior, _, mask = make_case(1, neg_frac=0.0)
        w = np.exp(-np.arange(logq.shape[-1]) / 3.0)
        got = self.variant(L.mixture_nll)(*f32(logq, prior), jnp.asarray(mask), jnp.asarray(w))
        chex.assert_trees_all_close(got, ref_nll(logq, prior, mask, w), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_al_estimate_and_surrogate(self):
        logq, prior, logp, mask = make_case(2)
        fn = self.variant(lambda *a: (L.al_estimate(*a), L.al_surrogate(*a, tau=0.05)))
        al, sur = fn(*f32(logq, prior, logp), jnp.asarray(mask))
        chex.assert_trees_all_close(
            (al, sur), (ref_al(logq, prior, logp, mask),
                        ref_surrogate(logq, prior, logp, mask, 0.05)[0]), rtol=1e-5, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_combined_loss(self):
        logq, prior, logp, mask = make_case(3, neg_frac=0.0)
        w = np.exp(-np.arange(logq.shape[-1]) / 3.0)
        fn = self.variant(lambda *a: L.combined_loss(*a, lam=0.5, tau=0.05,
                                                     position_weights=jnp.asarray(w)))
        loss, met = fn(*f32(logq, prior, logp), jnp.asarray(mask))
        nll = ref_nll(logq, prior, mask, w)
        sur = ref_surrogate(logq, prior, logp, mask, 0.05)[0]
        chex.assert_trees_all_close(
            (loss, met["nll"], met["block_nll"], met["al_surrogate"]),
            (nll + 0.5 * sur, nll, ref_nll(logq, prior, mask), sur), rtol=1e-5)


def test_everything_masked_is_zero_not_nan():
    logq, prior, logp, _ = make_case(0)
    mask = np.zeros(logq.shape[:2] + logq.shape[-1:], bool)
    args = f32(logq, prior, logp) + (jnp.asarray(mask),)
    loss, met = L.combined_loss(*args, lam=1.0, tau=0.0)
    assert float(loss) == 0.0 and float(met["al_estimate"]) == 0.0
    g = jax.jit(jax.grad(lambda q, pr: L.combined_loss(q, pr, args[2], args[3], lam=1.0)[0],
                         argnums=(0, 1)))(args[0], args[1])
    assert all(bool(jnp.all(x == 0)) for x in g)


# ----------------------------------------------------------------------------- gradients


def _fd_check(fn, x, rng, finite_mask, n_dirs=4, eps=1e-6, rtol=1e-5, atol=1e-8):
    """Directional derivatives along random directions supported on finite entries."""
    g = np.asarray(jax.jit(jax.grad(fn))(jnp.asarray(x)))
    fn = jax.jit(fn)
    assert np.all(np.isfinite(g))
    assert np.all(g[~finite_mask] == 0)
    for _ in range(n_dirs):
        v = rng.normal(size=x.shape) * finite_mask
        x_safe = np.where(finite_mask, x, 0.0)
        base = np.where(finite_mask, 0.0, x)

        def at(t):
            return float(fn(jnp.asarray(np.where(finite_mask, x_safe + t * v, base))))

        fd = (at(eps) - at(-eps)) / (2 * eps)
        np.testing.assert_allclose(float(np.sum(g * v)), fd, rtol=rtol, atol=atol)


def _away_from_kinks(logq, logp, margin=1e-3):
    """Nudge logq so that no finite logq - logp sits within `margin` of the min(0, .) kink."""
    with np.errstate(invalid="ignore"):
        d = logq - logp[:, :, None, :]
    near = np.isfinite(d) & (np.abs(d) < margin)
    return np.where(near, logq - 10 * margin, logq)


def test_gradients_match_finite_differences():
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        logq, prior, logp, mask = make_case(7)
        logq = _away_from_kinks(logq, logp)
        fin = np.isfinite(logq)
        m = jnp.asarray(mask)
        lp, pr = jnp.asarray(logp), jnp.asarray(prior)
        w = ref_prefix_weights(logq, logp, mask)
        mix = np.einsum("bak,bakp->bap", np.stack([[ref_softmax(prior[b, a])
                                                     for a in range(prior.shape[1])]
                                                    for b in range(prior.shape[0])]), w)
        tau = _tau_between(mix, "some")
        logq_nll = _away_from_kinks(np.where(fin, logq, -2.0), logp)
        logq_mixed = logq.copy()
        logq_mixed[:, :, 0] = logq_nll[:, :, 0]  # branch 0 finite: the loss stays finite
        fns = {
            "nll": (lambda q: L.mixture_nll(q, pr, m), logq_nll, np.ones_like(fin)),
            "nll_pw": (lambda q: L.mixture_nll(q, pr, m, jnp.linspace(1.0, 0.2, logq.shape[-1])),
                       logq_mixed, np.isfinite(logq_mixed)),
            "al": (lambda q: jnp.sum(L.al_estimate(q, pr, lp, m)), logq, fin),
            "sur": (lambda q: L.al_surrogate(q, pr, lp, m, tau=tau), logq, fin),
            "sur_all": (lambda q: L.al_surrogate(q, pr, lp, m, tau=0.0), logq, fin),
            "combined": (lambda q: L.combined_loss(q, pr, lp, m, lam=0.7, tau=tau)[0],
                         logq_nll, np.ones_like(fin)),
        }
        for name, (fn, x, fm) in fns.items():
            _fd_check(fn, x, rng, fm)
        dfl = lambda q: L.dflash_loss(q, m, 3.0)  # noqa: E731
        _fd_check(dfl, logq_nll[:, :, :1], rng, np.ones_like(fin[:, :, :1]))
        # prior logits
        q = jnp.asarray(logq)
        for fn in (lambda p_: L.mixture_nll(jnp.asarray(logq_nll), p_, m),
                   lambda p_: jnp.sum(L.al_estimate(q, p_, lp, m)),
                   lambda p_: L.al_surrogate(q, p_, lp, m, tau=tau)):
            _fd_check(fn, prior, rng, np.ones(prior.shape, bool))


def test_no_nan_gradients_with_neg_inf():
    logq, prior, logp, mask = make_case(11, neg_frac=0.4)
    logq[0, 0, :, 2] = NEG        # every branch impossible at one position
    logp[0, 0, :] = NEG            # target filtered everything for one anchor
    args = f32(logq, prior, logp) + (jnp.asarray(mask),)
    fns = [
        lambda q, pr: L.mixture_nll(q, pr, args[3]),
        lambda q, pr: jnp.sum(L.al_estimate(q, pr, args[2], args[3])),
        lambda q, pr: L.al_surrogate(q, pr, args[2], args[3], tau=0.0),
        lambda q, pr: L.al_surrogate(q, pr, args[2], args[3], tau=0.9),
        lambda q, pr: L.al_surrogate(q, pr, args[2], args[3], tau=1.5),
        lambda q, pr: L.combined_loss(q, pr, args[2], args[3], lam=1.0, tau=0.01)[0],
        lambda q, pr: L.dflash_loss(q[:, :, :1], args[3], 7.0),
    ]
    for fn in fns:
        g = jax.jit(jax.grad(fn, argnums=(0, 1)))(args[0], args[1])
        for x in g:
            assert not bool(jnp.any(jnp.isnan(x))), fn
            assert bool(jnp.all(jnp.isfinite(x)))
    # values: the AL terms stay finite with -inf inputs
    assert np.isfinite(np.asarray(L.al_estimate(*args))).all()
    assert np.isfinite(float(L.al_surrogate(*args, tau=0.0)))


# ----------------------------------------------------------------------------- unbiasedness


def _enumerable_target(rng, v=3, zero_frac=0.2):
    """p_1(x1), p_2(x2|x1), p_3(x3|x1,x2): dependent, some entries filtered (= 0)."""
    def dist(shape):
        d = rng.dirichlet(np.ones(v), size=shape)
        d[rng.random(d.shape) < zero_frac] = 0.0
        d[..., 0] += (d.sum(-1) == 0)  # keep each row a distribution
        return d / d.sum(-1, keepdims=True)
    return dist(()), dist((v,)), dist((v, v))


def _exact_accepted(p1, p2, p3, q, pi):
    """sum_z pi_z sum_k sum_{x_1..k} prod_{i<=k} min(q_{z,i}(x_i), p_i(x_i | x_<i))."""
    v = len(p1)
    cond = [lambda x: p1[x[0]], lambda x: p2[x[0], x[1]], lambda x: p3[x[0], x[1], x[2]]]
    total = 0.0
    for z in range(len(pi)):
        for k in range(1, 4):
            for xs in itertools.product(range(v), repeat=k):
                prod = 1.0
                for i in range(k):
                    prod *= min(q[z, i, xs[i]], cond[i](xs))
                total += pi[z] * prod
    return total


def _sample_target(rng, p1, p2, p3, n):
    def draw(probs):  # probs [n, v]
        u = rng.random((len(probs), 1))
        return np.minimum((np.cumsum(probs, -1) < u).sum(-1), probs.shape[-1] - 1)
    x1 = draw(np.broadcast_to(p1, (n, len(p1))))
    x2 = draw(p2[x1])
    x3 = draw(p3[x1, x2])
    return np.stack([x1, x2, x3], -1)


def test_al_estimate_is_unbiased_and_matches_sampled_branch_verification():
    rng = np.random.default_rng(123)
    v, k, n = 3, 2, 40000
    p1, p2, p3 = _enumerable_target(rng)
    q = rng.dirichlet(np.ones(v) * 0.7, size=(k, 3))
    q[0, 1, 2] = 0.0
    q = q / q.sum(-1, keepdims=True)
    prior = rng.normal(size=k)
    pi = ref_softmax(prior)
    exact = _exact_accepted(p1, p2, p3, q, pi)

    x = _sample_target(rng, p1, p2, p3, n)                          # [n, 3]
    with np.errstate(divide="ignore"):
        logq = np.log(np.stack([q[:, i, x[:, i]] for i in range(3)], -1)).transpose(1, 0, 2)
        logp = np.log(np.stack([p1[x[:, 0]], p2[x[:, 0], x[:, 1]],
                                p3[x[:, 0], x[:, 1], x[:, 2]]], -1))
    est = np.asarray(L.al_estimate(jnp.asarray(logq[:, None], jnp.float32),
                                   jnp.asarray(np.broadcast_to(prior, (n, 1, k)), jnp.float32),
                                   jnp.asarray(logp[:, None], jnp.float32)))[:, 0]
    se = est.std() / np.sqrt(n)
    assert se > 0
    print(f"AL exact {exact:.5f}  estimate {est.mean():.5f} +- {se:.5f}")
    assert abs(est.mean() - exact) < 4 * se, (est.mean(), exact, se)

    # The enumerator is the right target: simulate sampled-branch verification.
    z = np.minimum((rng.random(n)[:, None] > np.cumsum(pi)[None, :]).sum(-1), k - 1)
    accepted = np.zeros(n, int)
    alive = np.ones(n, bool)
    d = np.zeros((n, 3), int)
    for i in range(3):
        qi = q[z, i]                                                 # [n, v]
        d[:, i] = np.minimum((np.cumsum(qi, -1) < rng.random((n, 1))).sum(-1), v - 1)
        pv = [p1[d[:, 0]], p2[d[:, 0], d[:, 1]], p3[d[:, 0], d[:, 1], d[:, 2]]][i]
        qv = qi[np.arange(n), d[:, i]]
        ok = rng.random(n) < np.minimum(1.0, pv / qv)
        alive &= ok
        accepted += alive
    se_sim = accepted.std() / np.sqrt(n)
    print(f"sampled-branch verification {accepted.mean():.5f} +- {se_sim:.5f}")
    assert abs(accepted.mean() - exact) < 4 * se_sim, (accepted.mean(), exact, se_sim)


# ----------------------------------------------------------------------------- schedules / errors


def test_schedules():
    f = jax.jit(lambda s: L.linear_warmup_schedule(s, end_value=2.0, warmup_steps=10,
                                                   delay_steps=5))
    np.testing.assert_allclose([float(f(s)) for s in (0, 5, 10, 15, 100)],
                               [0.0, 0.0, 1.0, 2.0, 2.0], rtol=1e-6)
    g = jax.jit(lambda s: L.tau_schedule(s, start_value=1e-1, end_value=1e-3,
                                         transition_steps=20))
    np.testing.assert_allclose([float(g(s)) for s in (0, 10, 20, 50)],
                               [1e-1, 1e-2, 1e-3, 1e-3], rtol=1e-5)
    h = L.tau_schedule(jnp.asarray(5), start_value=0.0, end_value=0.2, transition_steps=10)
    np.testing.assert_allclose(float(h), 0.1, rtol=1e-6)
    with pytest.raises(ValueError, match="tau"):
        L.tau_schedule(0, start_value=-1.0, end_value=0.1, transition_steps=5)


def test_shape_errors_name_the_problem():
    logq = jnp.zeros((2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"prior_logits shape \(2, 3, 5\)"):
        L.mixture_nll(logq, jnp.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match=r"logp shape \(2, 3, 4\)"):
        L.al_estimate(logq, jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"mask shape \(2, 5\)"):
        L.mixture_nll(logq, jnp.zeros((2, 3, 4)), jnp.ones((2, 5), bool))
    with pytest.raises(ValueError, match="K = 4"):
        L.dflash_loss(logq)
    with pytest.raises(ValueError, match="prior_logits is required"):
        L.mixture_nll(logq, None)
    with pytest.raises(ValueError, match="tau"):
        L.al_surrogate(logq, jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 5)), tau=-0.1)
    # chex at the entry where nothing else checks (shapes named in the message)
    with pytest.raises(AssertionError, match=r"different shapes.*masked_anchor_mean"):
        L.masked_anchor_mean(jnp.zeros((2, 3)), jnp.ones((2, 1), bool))
    with pytest.raises(AssertionError, match=r"\(7,\) is not broadcastable"):
        L.mixture_nll(logq, jnp.zeros((2, 3, 4)), position_weights=jnp.ones(7))
    with pytest.raises(AssertionError, match="lam and tau must be scalars"):
        L.combined_loss(logq, jnp.zeros((2, 3, 4)), None, lam=jnp.ones(2))
    ids = jnp.zeros((2, 3, 4, 5, 2))
    with pytest.raises(AssertionError, match=r"logq must be .* \(2, 3, 4, 5\)"):
        L.topk_distill_per_anchor(ids, jnp.zeros((2, 3, 5, 2)), jnp.zeros((2, 3, 4, 6)),
                                  jnp.zeros((2, 3, 4)))
